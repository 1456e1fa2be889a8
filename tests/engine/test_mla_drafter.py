"""MLA EAGLE-3 drafters (``Eagle3DeepseekV2ForCausalLM``): each published layout converts and builds beside the demo
target; the drafter's forward equals transformers' DeepSeek-V3 modules; greedy speculation with it is target-only
greedy at k = 1…5 with the drafter on its own (draft_tp 1) and sharded over the target's group (draft_tp 2), whose
drafts are the TP1 drafter's, also when the latent cache moves between placements every cycle; bad drafters get one
line naming the file and field, and nothing is written."""

from __future__ import annotations

import itertools
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from splitspec.build.engines import build_engines
from splitspec.cli import main as cli_main
from splitspec.drafter_config import DrafterConfig
from splitspec.convert.pair import convert_pair
from splitspec.convert.safetensors import CheckpointReader
from splitspec.errors import CheckpointError
from splitspec.files import read_json
from splitspec.models.batch import ForwardBatch, single_blocks
from splitspec.models.drafters import drafter_cache, drafter_model
from splitspec.runtime.scheduler import SpeculativeEngine
from splitspec.runtime.tokenizer import ChatTokenizer
from splitspec.settings import ServeConfig
from splitspec.testing.mla_drafter_fixture import MLA_DRAFTER_FORMS, write_mla_drafter
from splitspec.testing.reference import reference_mla_drafter

PROMPT = "import os\nimport sys\n\n\nclass Config:\n    def __init__(self"
TOKENS = 12
# the aux convention each form's config leaves open (lightseekorg's drafters are trained on SGLang's layer inputs)
CONVENTION = {"mla": "input", "mla31": None, "mla_modelopt": None}


@pytest.fixture(scope="module")
def mla_engines(demo_models, tmp_path_factory):
    """``mla_engines(form)`` → engines folder: the demo target at TP2 and the MLA drafter of ``form`` (built once)."""
    root, cache = tmp_path_factory.mktemp("mla"), {}

    def get(form: str):
        if form not in cache:
            d = root / form
            write_mla_drafter(d / "drafter", demo_models / "target", form)
            convert_pair(demo_models / "target", d / "drafter", d / "ckpt", tp_size=2, aux_convention=CONVENTION[form], progress=False)
            cache[form] = build_engines(d / "ckpt", d / "engines", max_batch_size=2, max_seq_len=256, progress=False)
        return cache[form]

    return get


@pytest.fixture(scope="module")
def prompt_ids(demo_models):
    return ChatTokenizer.from_dir(demo_models / "target").encode(PROMPT)


@pytest.fixture(scope="module")
def target_only(engines_for, prompt_ids):
    with SpeculativeEngine.load(ServeConfig(engines_for(1))) as eng:
        return eng.generate(prompt_ids, TOKENS, num_draft_tokens=0, stop_token_ids=set()).token_ids


def test_published_kimi_mla_drafter_config_parses():
    """The fields of a published Kimi-K2.5 MLA drafter (k-l-lambda/Kimi-K2.5-Eagle3's config.json, as
    lightseekorg/kimi-k2.5-eagle3-mla): MLA with the target's layout, the full 163,840-token vocabulary, YaRN."""
    raw = {"architectures": ["Eagle3DeepseekV2ForCausalLM"], "model_type": "kimi_k2", "draft_vocab_size": 163840,
           "eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 30, 58], "use_aux_hidden_state": True},
           "head_dim": 128, "hidden_act": "silu", "hidden_size": 7168, "intermediate_size": 18432, "num_attention_heads": 64,
           "num_hidden_layers": 1, "num_key_value_heads": 64, "rms_norm_eps": 1e-05, "vocab_size": 163840,
           "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 64.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                            "original_max_position_embeddings": 4096, "type": "yarn"}, "rope_theta": 50000.0,
           "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "q_lora_rank": 1536, "kv_lora_rank": 512, "v_head_dim": 128}
    cfg = DrafterConfig.from_hf(raw, aux_convention="input")
    assert cfg.is_mla and (cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_head_dim, cfg.v_head_dim) == (1536, 512, 192, 128)
    assert cfg.draft_vocab_size == cfg.vocab_size == 163840 and cfg.capture_points() == (2, 30, 58)
    assert cfg.rope.dim == 64 and cfg.rope.interleaved and cfg.rope.factor == 64.0
    assert cfg.softmax_scale == pytest.approx(192 ** -0.5 * (0.1 * 1.0 * torch.log(torch.tensor(64.0)).item() + 1) ** 2)
    assert DrafterConfig.from_dict(cfg.to_dict()) == cfg and "MLA (q_lora 1536" in cfg.describe_attention()
    v31 = DrafterConfig.from_hf(raw | {"fc_norm": True, "norm_output": True}, aux_convention="input")
    assert v31.fc_norm and v31.norm_output and not cfg.norm_output


@pytest.mark.parametrize("form", MLA_DRAFTER_FORMS)
def test_drafter_matches_transformers_deepseek_v3_modules(mla_engines, demo_models, form):
    """Logits and next-step states of the built drafter equal :func:`reference_mla_drafter` (transformers' MLA
    attention, YaRN rotary, MLP and norms on the published tensors); two chunks through the latent cache equal one;
    draft ids map to target ids through d2t."""
    eng = mla_engines(form)
    meta = read_json(eng / "drafter" / "engine.json")
    assert meta["architecture"] == "Eagle3DeepseekV2ForCausalLM"
    cfg = DrafterConfig.from_dict(meta["config"])
    m = drafter_model(cfg, load_file(str(eng / "drafter" / "rank0.safetensors")))
    cache = drafter_cache(cfg, 2 * 256, torch.float32, "cpu")
    reader = CheckpointReader(demo_models / "target")
    embed, lm_head = reader.get("model.embed_tokens.weight"), reader.get("lm_head.weight")
    reader.close()
    g = torch.Generator().manual_seed(0)
    T = 12
    aux, tokens = torch.randn(T, 3 * cfg.target_hidden_size, generator=g), torch.randint(0, cfg.vocab_size, (T,), generator=g)
    ref_logits, ref_h = reference_mla_drafter(eng.parent / "drafter", embed, aux, tokens, lm_head)
    b0, b1 = single_blocks(0, 256), single_blocks(1, 256)
    with torch.inference_mode():
        logits, h = m.forward(ForwardBatch.build([(b0, 0, tokens.tolist())], "all"), m.fuse(aux), cache)
        a, _ = m.forward(ForwardBatch.build([(b1, 0, tokens[:5].tolist())], "all"), m.fuse(aux[:5]), cache)
        b, _ = m.forward(ForwardBatch.build([(b1, 5, tokens[5:].tolist())], "all"), m.fuse(aux[5:]), cache)
    print(f"{form}: drafter logits max |ours - transformers| = {(logits - ref_logits).abs().max():.2e} (std {ref_logits.std():.2f})")
    assert (logits - ref_logits).abs().max() < 1e-4 and (h - ref_h).abs().max() < 1e-4
    assert (torch.cat((a, b)) - logits).abs().max() < 1e-4
    assert cfg.norm_output == (form == "mla31") and cfg.fc_norm == (form == "mla31")
    if form == "mla31":  # norm_output: the next step reads the final norm's output, rows of unit RMS over the norm weight
        assert torch.allclose((h / m.w["norm"]).pow(2).mean(-1), torch.ones(T), atol=1e-4)
        assert cfg.draft_vocab_size == 1024 and torch.equal(m.propose(logits), m.draft_to_target[logits.argmax(-1)])
        assert not torch.equal(m.draft_to_target, torch.arange(1024))


def _drafting(eng) -> list:
    seen, run = [], eng.group.run
    eng.group.run = lambda plan, *a: seen.append((out := run(plan, *a)).drafts) or out
    return seen


def test_greedy_speculation_is_lossless_at_both_placements(mla_engines, prompt_ids, target_only):
    """EAGLE-3.1 MLA drafter (fc_norm, norm_output, reduced vocabulary): k = 1…5 give target-only greedy tokens with
    the drafter on its own and sharded over the TP2 group, and the sharded drafter drafts exactly what TP1 drafts."""
    eng_dir = mla_engines("mla31")
    drafts = {}
    for draft_tp in (1, 2):
        with SpeculativeEngine.load(ServeConfig(eng_dir, draft_tp=draft_tp)) as eng:
            seen = _drafting(eng)
            for k in range(1, 6):
                res = eng.generate(prompt_ids, TOKENS, num_draft_tokens=k, stop_token_ids=set())
                assert res.token_ids == target_only, (draft_tp, k)
            drafts[draft_tp] = [list(d.values()) for d in seen]
    assert drafts[1] == drafts[2] and sum(len(d[0]) for d in drafts[1] if d) > 100


@pytest.mark.parametrize("form", ["mla", "mla_modelopt"])
def test_other_forms_are_lossless_sharded(mla_engines, prompt_ids, target_only, form):
    with SpeculativeEngine.load(ServeConfig(mla_engines(form), draft_tp=2)) as eng:
        assert eng.generate(prompt_ids, TOKENS, num_draft_tokens=3, stop_token_ids=set()).token_ids == target_only


def test_switching_placement_moves_the_latent_cache(mla_engines, prompt_ids, target_only, tmp_path):
    """Both placements loaded and the drafting one switched every cycle: the latent rows are broadcast to the shards
    and copied back, so every cycle drafts what the TP1 drafter alone drafts; output is target-only greedy."""
    eng_dir = tmp_path / "e"
    shutil.copytree(mla_engines("mla31"), eng_dir)
    with SpeculativeEngine.load(ServeConfig(eng_dir, draft_tp=1)) as eng:
        alone = _drafting(eng)
        eng.generate(prompt_ids, TOKENS, num_draft_tokens=3, stop_token_ids=set())
    (eng_dir / "tuning.json").write_text(json.dumps({"draft_tp_by_batch": {"1": 1, "2": 2}, "k_by_batch": {"1": 3, "2": 3}}))
    with SpeculativeEngine.load(ServeConfig(eng_dir)) as eng:
        assert eng.group.placements == (1, 2)
        seen, placed, turns = _drafting(eng), [], itertools.cycle([2, 1])
        eng.draft_tp_for, eng.switch_after = lambda batch: next(turns), 1
        eng.on_cycle = lambda stats: stats.draft_tp and placed.append(stats.draft_tp)
        assert eng.generate(prompt_ids, TOKENS, stop_token_ids=set()).token_ids == target_only
    assert [list(d.values()) for d in seen] == [list(d.values()) for d in alone]
    assert sum(a != b for a, b in zip(placed, placed[1:])) > 8


# ---------------------------------------------------------------- bad drafters

@pytest.fixture(scope="module")
def good_mla(demo_models, tmp_path_factory):
    d = tmp_path_factory.mktemp("bad") / "drafter"
    write_mla_drafter(d, demo_models / "target", "mla31")
    return d


def _broken(good, tmp_path, config: dict | None = None, drop: str | None = None):
    d = tmp_path / "drafter"
    shutil.copytree(good, d)
    if config is not None:
        (d / "config.json").write_text(json.dumps(read_json(d / "config.json") | config))
    if drop is not None:
        t = load_file(str(d / "model.safetensors"))
        del t[drop]
        save_file(t, str(d / "model.safetensors"), metadata={"format": "pt"})
    return d


@pytest.mark.parametrize("change,match", [
    ({"config": {"hidden_size": 128}}, r"drafter/config.json: hidden_size \(no target_hidden_size\) = 128, but the target's hidden_size is 256"),
    ({"config": {"vocab_size": 5000}}, r"drafter/config.json: vocab_size = 5000, but the target's vocab_size is 4096"),
    ({"config": {"architectures": ["Eagle3MiniMaxForCausalLM"]}},
     r"drafter/config.json: architectures\[0\] = 'Eagle3MiniMaxForCausalLM', expected an EAGLE-3 drafter"),
    ({"config": {"q_lora_rank": None}}, r"drafter/config.json: field 'q_lora_rank' is null"),
    ({"config": {"kv_lora_rank": "512"}}, r"drafter/config.json: field 'kv_lora_rank' = '512', expected int"),
    ({"drop": "midlayer.self_attn.kv_b_proj.weight"}, r"drafter: tensor 'midlayer.self_attn.kv_b_proj.weight' is missing"),
    ({"drop": "fc_norm.1.weight"}, r"drafter: tensor 'fc_norm.1.weight' is missing"),
])
def test_bad_mla_drafters_are_refused(demo_models, good_mla, tmp_path, change, match):
    d = _broken(good_mla, tmp_path, **change)
    with pytest.raises(CheckpointError, match=match):
        convert_pair(demo_models / "target", d, tmp_path / "out", tp_size=1, progress=False)
    assert not (tmp_path / "out").exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]


def test_cli_error_is_one_line(demo_models, good_mla, tmp_path, capsys):
    d = _broken(good_mla, tmp_path, drop="midlayer.self_attn.q_a_proj.weight")
    rc = cli_main(["convert", "--target", str(demo_models / "target"), "--drafter", str(d), "--out", str(tmp_path / "out"), "--tp", "1"])
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line or "Traceback" in line]
    assert rc == 2 and len(errors) == 1 and "convert: error: " in errors[0] and "q_a_proj.weight' is missing" in errors[0]
    assert not (tmp_path / "out").exists()
