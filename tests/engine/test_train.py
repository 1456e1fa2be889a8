"""The trained demo pair: export formats, determinism, and the EAGLE-3 training-time test against the runtime.

Full training takes minutes, so most tests train a tiny configuration for a few steps (same code
paths, small widths). ``test_cached_preset_pair`` checks the real pair when ``make demo-models``
has already put it in the cache, and is skipped otherwise.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from splitspec.build.engines import build_pair
from splitspec.convert.pair import convert_pair
from splitspec.demo.cache import TRAINING_INFO, cache_key, install_trained_pair
from splitspec.demo.pair import ensure_trained_pair, train_pair
from splitspec.demo.train_config import TrainConfig
from splitspec.demo.train_drafter import Eagle3Trainable, ttt_attention_mask
from splitspec.engine.group import Group
from splitspec.models.batch import ForwardBatch, single_blocks
from splitspec.runtime.scheduler import SpeculativeEngine
from splitspec.runtime.tokenizer import ChatTokenizer
from splitspec.settings import ServeConfig
from splitspec.testing.reference import load_hf_reference_target

# Kimi-K2 structure at tiny width: 5 layers (dense first, MoE with shared expert and noaux_tc), MLA + YaRN.
TINY = TrainConfig(
    hidden_size=64, num_hidden_layers=5, intermediate_size=128, moe_intermediate_size=32, num_attention_heads=8,
    n_routed_experts=8, num_experts_per_tok=2, q_lora_rank=32, kv_lora_rank=16, drafter_intermediate_size=128,
    draft_vocab_size=256, max_corpus_files=24, heldout_every=8,
    target_steps=4, target_batch_size=2, target_seq_len=64, target_warmup=2,
    distill_code_prompts=6, distill_chat_prompts=2, distill_prompt_tokens=16, distill_new_tokens=8,
    distill_corpus_windows=4, generate_batch_size=4,
    drafter_steps=3, drafter_batch_size=4, drafter_warmup=1, ttt_steps=3,
    eval_prompts=2, eval_new_tokens=8, log_every=2)


def read_folder(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("trained") / "pair"
    train_pair(out, TINY, progress=False, measure=False)
    return out


@pytest.fixture(scope="module")
def tiny_engines(tiny_pair, tmp_path_factory) -> Path:
    return build_pair(tiny_pair, tmp_path_factory.mktemp("tiny_engines"), tp_size=1, max_batch_size=2, max_seq_len=256)


# ---------------------------------------------------------------------------- export


def test_exported_pair_converts_cleanly(tiny_pair, tmp_path, capsys, recwarn):
    """The published-format pair converts at TP2 with every tensor used and nothing to warn about."""
    assert sorted(p.name for p in (tiny_pair / "target").iterdir()) == sorted([
        "config.json", "generation_config.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
        "model.safetensors.index.json", "special_tokens_map.json", "tokenizer.json", "tokenizer_config.json"])
    assert sorted(p.name for p in (tiny_pair / "drafter").iterdir()) == ["config.json", "model.safetensors"]
    dcfg = json.loads((tiny_pair / "drafter" / "config.json").read_text())
    assert dcfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 2, 4]
    assert dcfg["eagle_config"]["aux_layer_id_convention"] == "input"
    drafter = load_file(str(tiny_pair / "drafter" / "model.safetensors"))
    assert not any("embed" in k for k in drafter), "the drafter shares the target's embedding"
    assert drafter["d2t"].dtype == torch.int64 and drafter["t2d"].dtype == torch.bool
    assert drafter["fc.weight"].dtype == torch.bfloat16 and drafter["fc.weight"].shape == (64, 3 * 64)
    target = read_folder(tiny_pair / "target")
    bias = target["model.layers.1.mlp.gate.e_score_correction_bias"]
    assert bias.dtype == torch.float32 and bias.abs().max() > 0, "the correction bias must be trained"
    assert target["model.layers.1.mlp.experts.3.gate_proj.weight"].dtype == torch.bfloat16

    capsys.readouterr()
    convert_pair(tiny_pair / "target", tiny_pair / "drafter", tmp_path / "ckpt", tp_size=2)
    out = capsys.readouterr().out
    assert "unused" not in out and "notice" not in out and "DIFFERS" not in out, out
    assert "drafter embedding: the target's" in out
    assert not [w for w in recwarn if "splitspec" in str(w.filename)], [str(w.message) for w in recwarn]


def test_engine_matches_transformers_on_trained_target(tiny_pair, tiny_engines):
    """The trained export gives the same logits and aux states in our engine as in transformers' DeepseekV3."""
    tok = ChatTokenizer.from_dir(tiny_pair / "target")
    ids = tok.encode("def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n")
    hf = load_hf_reference_target(tiny_pair / "target")
    group = Group(ServeConfig(tiny_engines))
    try:
        r = group.rank0
        with torch.inference_mode():
            ours, aux = r.target.forward(ForwardBatch.build([(single_blocks(0, 256), 0, ids)], "all"), r.tcache, (1, 2, 4))
            ref = hf(torch.tensor([ids]), output_hidden_states=True)
    finally:
        group.close()
    assert (ours - ref.logits[0].float()).abs().max() < 2e-4
    for j, i in enumerate((1, 2, 4)):
        assert (aux[:, j * 64:(j + 1) * 64] - ref.hidden_states[i][0]).abs().max() < 2e-4


# ---------------------------------------------------------------------------- determinism


def test_retraining_is_bit_identical(tiny_pair, tmp_path):
    """Same seed, same machine: every exported byte is the same (weights, tokenizer, configs)."""
    again = tmp_path / "again"
    report = train_pair(again, TINY, progress=False, measure=False)
    for sub in ("target", "drafter"):
        for f in sorted((tiny_pair / sub).iterdir()):
            assert (again / sub / f.name).read_bytes() == f.read_bytes(), f"{sub}/{f.name} differs"
    first = json.loads((tiny_pair / TRAINING_INFO).read_text())
    assert report["target"]["loss"] == first["target"]["loss"]
    assert report["drafter"]["loss"] == first["drafter"]["loss"]
    assert not list(tmp_path.glob(".again*")), "temporary folders left behind"


def test_seed_and_config_change_the_cache_key():
    assert cache_key(TINY) == cache_key(TINY)
    assert cache_key(TINY) != cache_key(TrainConfig(**{**TINY.to_dict(), "aux_layer_ids": (1, 2, 4), "seed": 1}))
    assert cache_key(TINY) != cache_key(TrainConfig(**{**TINY.to_dict(), "aux_layer_ids": (1, 2, 4), "target_steps": 5}))


def test_cache_trains_once_and_installs(tiny_pair, tmp_path, monkeypatch):
    """ensure_trained_pair trains into demo-<key> once; install copies it and skips an identical copy."""
    import shutil

    import splitspec.demo.pair as train

    key = cache_key(TINY)
    entry = tmp_path / "cache" / f"demo-{key}"
    shutil.copytree(tiny_pair, entry)  # as if trained before
    info = json.loads((entry / TRAINING_INFO).read_text())
    assert info["key"] == key
    monkeypatch.setattr(train, "train_pair", lambda *a, **k: pytest.fail("trained although cached"))
    assert ensure_trained_pair(TINY, cache_dir=tmp_path / "cache") == entry
    out = tmp_path / "models" / "demo"
    assert install_trained_pair(entry, out) is True
    assert (out / "target" / "config.json").is_file() and (out / TRAINING_INFO).is_file()
    assert install_trained_pair(entry, out) is False


# ---------------------------------------------------------------------------- training-time test


def test_ttt_mask_small_cases():
    assert torch.equal(ttt_attention_mask(4, 1), torch.ones(4, 4, dtype=torch.bool).tril())
    m = ttt_attention_mask(4, 2)  # step 2, row j: step-1 keys i <= j - 1, step-2 key at row j
    assert m.tolist() == [
        [False, False, False, False, True, False, False, False],
        [True, False, False, False, False, True, False, False],
        [True, True, False, False, False, False, True, False],
        [True, True, True, False, False, False, False, True],
    ]
    m3 = ttt_attention_mask(5, 3)  # row 4: step-1 keys 0..2, step-2 key row 3, step-3 key row 4
    assert m3[4].nonzero().flatten().tolist() == [0, 1, 2, 5 + 3, 10 + 4]


def _trainable_from_export(pair: Path) -> Eagle3Trainable:
    dcfg = json.loads((pair / "drafter" / "config.json").read_text())
    embed = read_folder(pair / "target")["model.embed_tokens.weight"].float()
    model = Eagle3Trainable(dcfg, embed, seed=0)
    model.load_published({k: v.float() for k, v in load_file(str(pair / "drafter" / "model.safetensors")).items()})
    return model.eval()


def test_ttt_forward_equals_engine_drafter(tiny_pair, tiny_engines):
    """Same weights, same inputs: the training forward's step 1 (all rows) and its step-2 / step-3 rows
    equal the engine's DrafterModel.forward run the way speculation runs it (extend, then chained steps)."""
    model = _trainable_from_export(tiny_pair)
    group = Group(ServeConfig(tiny_engines))
    m, cache = group.rank0.drafter, group.rank0.dcache
    group.close()
    g = torch.Generator().manual_seed(0)
    T = 14
    tokens = torch.randint(0, 4096, (T,), generator=g)
    aux = torch.randn(T, 3 * 64, generator=g)
    with torch.no_grad():
        steps = model(tokens[None], aux[None], steps=3)
    R = T - 1
    b0, b1 = single_blocks(0, 256), single_blocks(1, 256)
    with torch.inference_mode():
        # step 1: rows 0..R-1 pair aux(j) with token j+1 at position j
        l1, h1 = m.forward(ForwardBatch.build([(b0, 0, tokens[1:].tolist())], "all"), m.fuse(aux[:R]), cache)
        assert (l1 - steps[0][0]).abs().max() < 1e-4
        for j in (1, 6, R - 2):
            # the runtime after accepting x_0..x_j: extend rows 0..j-1, then draft step 2 at position j, step 3 at j+1
            _, hx = m.forward(ForwardBatch.build([(b1, 0, tokens[1:j + 1].tolist())], "all"), m.fuse(aux[:j]), cache)
            l2, h2 = m.forward(ForwardBatch.build([(b1, j, [int(tokens[j + 1])])], "last"), hx[-1:], cache)
            assert (l2[0] - steps[1][0, j]).abs().max() < 1e-4, f"step 2, row {j}"
            l3, _ = m.forward(ForwardBatch.build([(b1, j + 1, [int(tokens[j + 2])])], "last"), h2, cache)
            assert (l3[0] - steps[2][0, j + 1]).abs().max() < 1e-4, f"step 3, row {j + 1}"
    # the step-2 rows really depend on the shifted previous state (an off-by-one would not match above)
    assert (steps[1][0, 6] - steps[0][0, 6]).abs().max() > 1e-3


class CacheRecorder:
    """Wraps the engine drafter: records which (draft step, row) wrote each KV-cache position and checks
    every query's visible keys against ttt_attention_mask. Proposes the target's own continuation with
    every third draft wrong, so cycles accept several drafts and extends span several rows."""

    def __init__(self, inner, continuation: list[int], offset: int):
        self.inner, self.cont, self.offset = inner, continuation, offset
        self.tags: dict[int, tuple[int, int]] = {}
        self.step = 0
        self.checked = 0
        self.rng = random.Random(0)
        self.last_pos = 0

    def __getattr__(self, name):  # device, cfg, draft_to_target, ... of the wrapped drafter
        return getattr(self.inner, name)

    def fuse(self, aux):
        self.step = 0  # the next forward is the extend over accepted tokens: draft step 1
        return self.inner.fuse(aux)

    def forward(self, batch, hidden, cache):
        self.step += 1
        s = self.step
        positions = batch.positions.tolist()
        for p in positions:
            self.tags[p] = (s, p)
        for p in positions:  # each row is a query at position p
            visible = {tag for pos, tag in self.tags.items() if pos <= p}
            mask = ttt_attention_mask(p + 1, s)
            expected = {(t + 1, i) for t in range(s) for i in range(p + 1) if mask[p, t * (p + 1) + i]}
            assert visible == expected, f"step {s}, position {p}: cache holds {sorted(visible)}, mask says {sorted(expected)}"
            self.checked += 1
        self.last_pos = positions[-1]
        return self.inner.forward(batch, hidden, cache)

    def draft(self, batch, hidden, cache):  # the padded draft phase's step: this wrapper's forward and propose
        logits, h = self.forward(batch, hidden, cache)
        return self.propose(logits), h[batch.logits_rows]

    def propose(self, logits):
        idx = self.last_pos + 2 - self.offset  # drafter row j predicts token j + 2
        right = self.cont[idx] if 0 <= idx < len(self.cont) else 0
        return torch.tensor([right if self.rng.random() > 0.3 else (right + 1) % 4096])


def test_ttt_mask_is_what_the_runtime_cache_holds(tiny_pair, tiny_engines):
    tok = ChatTokenizer.from_dir(tiny_pair / "target")
    ids = tok.encode("import os\nimport sys\n\n\nclass Config:\n    def __init__(self")
    with SpeculativeEngine.load(ServeConfig(tiny_engines)) as eng:
        ref = eng.generate(ids, 40, num_draft_tokens=0).token_ids
        rec = CacheRecorder(eng.group.rank0.drafter, ref, len(ids))
        eng.group.rank0.drafter = rec
        res = eng.generate(ids, 40, num_draft_tokens=4)
    assert res.token_ids == ref
    assert res.acceptance_length > 1.5, "few drafts accepted: extends of several rows not exercised"
    assert rec.checked > 40


# ---------------------------------------------------------------------------- the real pair, when cached


def test_cached_preset_pair(tmp_path):
    """The pair `make demo-models` trains: skipped unless it is already in the cache."""
    from splitspec.demo.cache import cache_root

    cfg = TrainConfig.preset("cpu")
    entry = cache_root() / f"demo-{cache_key(cfg)}"
    if not (entry / TRAINING_INFO).is_file():
        pytest.skip(f"trained demo pair not cached ({entry}); run 'make demo-models'")
    info = json.loads((entry / TRAINING_INFO).read_text())
    assert info["acceptance"]["lossless"] is True
    assert info["acceptance"]["acceptance_length"] > 1.5
    assert info["target"]["heldout_loss"] < 6.0
    convert_pair(entry / "target", entry / "drafter", tmp_path / "ckpt", tp_size=2)
