"""`splitspec inspect` on the published Kimi checkpoints' configs (no weights) states their published facts, resolves
EAGLE-3 aux layer ids under both conventions, and plans a TP8 conversion whose per-rank bytes agree with arithmetic
done here from the config and, on small real checkpoints, with what `splitspec convert` writes.

Fixtures: tests/fixtures/published (README.md there cites the source of every value).
"""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

import pytest

from splitspec import quant
from splitspec.config import TargetConfig
from splitspec.drafter_config import DrafterConfig
from splitspec.errors import CheckpointError
from splitspec.convert.describe import aux_readings, inspect_checkpoint
from splitspec.convert.layout import index_for, target_layout
from splitspec.convert.plan import plan_split
from splitspec.files import read_json, write_json

PUB = Path(__file__).resolve().parents[1] / "fixtures" / "published"
TARGETS = ["kimi-k2-instruct", "kimi-k2-instruct-0905", "kimi-k2-thinking", "kimi-k2.5", "kimi-k2.6"]
GiB = 2**30
K2_SHAPE = ["61 layers (1 dense: first_k_dense_replace 1, layer 0 dense; 60 MoE), hidden 7168, vocab 163840, 64 heads "
            "(MLA: q_lora 1536, kv_lora 512, nope 128 / rope 64 / v 128)",
            "experts: 384 routed (8 per token, width 2048) + 1 shared; dense width 18432; router noaux_tc, scaling 2.827"]
INT4_KEPT = "not quantised: lm_head (1), embedding (1), dense MLP (3), attention (305), router (60), shared experts (180)"
FACTS = {
    "kimi-k2-instruct": ["model_type kimi_k2)", "YaRN factor 32 (original 4096, beta_fast 1, beta_slow 1); max positions 131072",
                         "FP8 e4m3 block-scaled, tiles 128×128", "69608 float8_e4m3fn weights (61 with ragged last tiles)",
                         "covers: dense MLP (3), attention (305), routed experts (69120), shared experts (180); "
                         "not quantised: lm_head (1), embedding (1), router (60)",
                         "tensors: 139644 (no shard files), 958.49 GiB"],
    "kimi-k2-instruct-0905": ["model_type kimi_k2)", "YaRN factor 64 (original 4096, beta_fast 1, beta_slow 1); max positions 262144",
                              "FP8 e4m3 block-scaled, tiles 128×128", "tensors: 139644"],
    "kimi-k2-thinking": ["model_type kimi_k2)", "YaRN factor 64", "INT4 compressed-tensors pack-quantized, symmetric, group 32",
                         "69120 packed linears (69120 routed-expert)", "ignore: ['lm_head', 're:.*self_attn.*'",
                         "covers: routed experts (69120); " + INT4_KEPT],
    "kimi-k2.5": ["model_type kimi_k25; text model kimi_k2 under text_config, tensors under language_model.",
                  "YaRN factor 64 (original 4096, beta_fast 32, beta_slow 1); max positions 262144",
                  "INT4 compressed-tensors pack-quantized, symmetric, group 32", "'re:vision_tower.*', 're:mm_projector.*']",
                  "covers: routed experts (69120); " + INT4_KEPT, "tensors: 208550 (no shard files), 554.27 GiB",
                  "vision: 335 tensors"],
    "kimi-k2.6": ["model_type kimi_k25; text model kimi_k2 under text_config", "YaRN factor 64",
                  "INT4 compressed-tensors pack-quantized, symmetric, group 32", "covers: routed experts (69120); " + INT4_KEPT,
                  "tensors: 208550", "vision: 335 tensors"],
}


@pytest.fixture(scope="module")
def described() -> dict[str, str]:
    return {name: "\n".join(inspect_checkpoint(PUB / name)) for name in TARGETS}


def _parts(folder: Path):
    raw = read_json(folder / "config.json")
    cfg = TargetConfig.from_hf(raw)
    text, where, _ = TargetConfig.text_config(raw)
    return raw, cfg, quant.parse_quantization_config(text.get("quantization_config"), where)


@functools.cache
def _layout(name: str):
    raw, cfg, scheme = _parts(PUB / name)
    return cfg, scheme, target_layout(cfg, scheme, raw)


@pytest.mark.parametrize("name", TARGETS)
def test_inspect_states_the_published_facts(described, name):
    out = described[name]
    assert "config only: no shard files and no index" in out
    for fact in K2_SHAPE + FACTS[name]:
        assert fact in out, (name, fact, out)


def test_tp8_per_rank_bytes_agree_with_arithmetic_from_the_config(described):
    """Kimi-K2-Instruct: every linear FP8 but the router; everything split 8 ways but the replicated tensors."""
    H, L, moe, E, V = 7168, 61, 60, 384, 163840
    fp8 = lambda o, i: o * i + -(-o // 128) * -(-i // 128) * 4  # noqa: E731  weight bytes + float32 scale_inv tiles
    replicated = L * (2 * H * 2 + fp8(1536, H) + 1536 * 2 + fp8(576, H) + 512 * 2 + 56 * 2) + moe * (E * H * 2 + E * 4) + H * 2
    split = (L * (fp8(64 * 192, 1536) + fp8(64 * 256, 512) + fp8(H, 64 * 128)) + 3 * fp8(18432, H)
             + moe * (E + 1) * 3 * fp8(2048, H) + 2 * V * H * 2)
    assert f"{(replicated + split) / GiB:.2f} GiB" == "958.49 GiB"  # the published tensor bytes
    cfg, scheme, layout = _layout("kimi-k2-instruct")
    for ep in (1, 8):
        plan = plan_split(cfg, scheme, layout, 8, ep)
        assert (plan.published_bytes, plan.replicated_bytes) == (split // 8 + replicated, replicated)
        assert plan.converted_bytes == plan.published_bytes - L * 56 * 2  # FP8 kept (every cut on a tile edge), inv_freq dropped
        assert f"TP8 EP{ep}: {plan.published_bytes / GiB:.2f} GiB per rank as published" in described["kimi-k2-instruct"]


def test_tp8_plan_for_int4_keeps_experts_as_published(described):
    """K2.5 at TP8: INT4 experts published at 4.5 bits per value (4-bit values, a bf16 scale per 32), plus an 8-byte
    weight_shape per expert linear, converted as published (each slice with its own weight_shape)."""
    cfg, scheme, layout = _layout("kimi-k2.5")
    plan = plan_split(cfg, scheme, layout, 8, 1)
    experts = 60 * 384 * 3 * 2048 * 7168  # routed expert values
    shapes = 60 * 384 * 3 * 8
    assert plan.converted_bytes == plan.published_bytes
    assert plan.published_bytes - plan.replicated_bytes > (experts // 8 * 9 // 16 + shapes) // 8  # the experts' eighth
    assert "TP8 EP1: 70.95 GiB per rank as published, 70.95 GiB as converted" in described["kimi-k2.5"]
    assert plan_split(cfg, scheme, [], 6, 1).error == "num_attention_heads = 64 is not divisible by 6 (tp_size=6, ep_size=1)"
    assert plan_split(cfg, scheme, [], 8, 3).error.startswith("tp_size=8, ep_size=3: need positive sizes with ep_size dividing")


def test_index_generated_from_config_is_read_as_the_checkpoint(tmp_path):
    folder = tmp_path / "kimi-k2.5"
    folder.mkdir()
    for f in ("config.json", "shards.json"):
        shutil.copy(PUB / "kimi-k2.5" / f, folder / f)
    spec = read_json(folder / "shards.json")
    names = [spec["pattern"].format(i=i, n=spec["count"]) for i in range(1, spec["count"] + 1)]
    (folder / "model.safetensors.index.json").write_text(json.dumps(index_for(_layout("kimi-k2.5")[2], names)))
    out = "\n".join(inspect_checkpoint(folder))
    assert "model.safetensors.index.json lists 208550 tensors in 64 shard file(s)" in out
    assert "every indexed tensor is implied by config.json, and every implied tensor is indexed" in out
    assert "tensors: 208550 in 64 shard(s), 554.27 GiB of tensor data (largest shard 8." in out


def test_drafter_index_that_disagrees_with_its_config_is_reported(tmp_path):
    src = PUB / "drafter-aq-medai-kimi-k2-instruct-eagle3"
    out = "\n".join(inspect_checkpoint(src, target=PUB / "kimi-k2-instruct"))
    for fact in ["fc: [7168, 21504] over 3 × target hidden 7168", "vocabulary: draft 32000 of 163840 target ids, mapping: d2t + t2d",
                 "every indexed tensor is implied", "aux layer ids [2, 30, 58]: convention UNKNOWN"]:
        assert fact in out, (fact, out)
    shutil.copytree(src, tmp_path / "d")
    index = read_json(src / "model.safetensors.index.json")
    del index["weight_map"]["d2t"]
    index["weight_map"]["midlayer.self_attn.rotary_emb.inv_freq"] = "model.safetensors"
    write_json(index, tmp_path / "d" / "model.safetensors.index.json")
    out = "\n".join(inspect_checkpoint(tmp_path / "d"))
    assert ("index DISAGREES with config.json: 1 implied tensors not indexed ['d2t'], 1 indexed tensors not implied "
            "['midlayer.self_attn.rotary_emb.inv_freq']") in out
    assert "mapping: t2d" in out


@pytest.mark.parametrize("ids, conv, points", [
    ([1, 29, 57], "input", [1, 29, 57]), ([1, 29, 57], "output", [2, 30, 58]),
    ([2, 30, 58], "input", [2, 30, 58]), ([2, 30, 58], "output", [3, 31, 59])])
def test_aux_ids_resolve_under_both_conventions(ids, conv, points):
    raw = read_json(PUB / "drafter-aq-medai-kimi-k2-instruct-eagle3" / "config.json")
    raw["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = ids
    cfg = DrafterConfig.from_hf(raw, aux_convention=conv)
    assert list(cfg.capture_points()) == points
    table = aux_readings(ids, 61, cfg.aux_convention)
    mine = next(x for x in table if x.strip().startswith(conv))
    assert mine.endswith("← this drafter") and f"inputs to layers {points} = outputs of layers {[p - 1 for p in points]}" in mine
    assert "within a 61-layer target" in mine


def test_aux_readings_name_the_equivalent_ids_and_the_convention_inferred():
    table = "\n".join(aux_readings([1, 29, 57], 61))
    assert "output-of-layer: inputs to layers [2, 30, 58] = outputs of layers [1, 29, 57] (the same states as ids [2, 30, 58] " \
           "read as input-of-layer)" in table
    edge = aux_readings([2, 30, 61], 61)
    assert edge[1].endswith("within a 61-layer target (the last one is after the final layer, before the final norm)")
    assert edge[2].endswith("OUT OF RANGE for a 61-layer target: [61]")
    # a ModelOpt export (its eagle_config keys) resolves to the output convention and inspect says where it came from
    raw = read_json(PUB / "drafter-aq-medai-kimi-k25-eagle3" / "config.json")
    raw["eagle_config"]["use_last_layernorm"] = True
    cfg = DrafterConfig.from_hf(raw)
    assert cfg.aux_convention == "output" and "ModelOpt" in cfg.aux_convention_source
    assert aux_readings(cfg.aux_layer_ids, 61, cfg.aux_convention)[2].endswith("← this drafter")


def test_plan_matches_the_bytes_convert_writes(tmp_path):
    """On small real FP8 and INT4 checkpoints: the layout is their headers, and the planned bytes of the largest rank
    are those of the tensors `convert` writes for it (TP2 EP1, TP2 EP2, TP4 with FP8 cuts inside tiles)."""
    from splitspec.config import Mapping
    from splitspec.convert.target import TargetSource, target_rank_tensors
    from splitspec.testing import fixtures

    fx = fixtures.make_fixtures(tmp_path / "fx", forms=("fp8", "int4"))
    for form in ("fp8", "int4"):
        raw, cfg, scheme = _parts(fx / form)
        layout = {t.name: t for t in target_layout(cfg, scheme, raw)}
        src = TargetSource(fx / form)
        published = [n for n in src.reader.names() if not n.endswith("rotary_emb.inv_freq")]
        assert sorted(published) == sorted(n for n in layout if not n.endswith("rotary_emb.inv_freq"))
        for n in published:
            assert (tuple(src.reader.info(n).shape), src.reader.info(n).dtype) == (layout[n].shape, layout[n].dtype), n
        for tp, ep in ((2, 1), (2, 2), (4, 1)):
            plan = plan_split(cfg, scheme, [layout[n] for n in published], tp, ep)
            written = [sum(t.numel() * t.element_size() for _, t in target_rank_tensors(src, cfg, Mapping(tp, ep), r))
                       for r in range(tp)]
            assert plan.converted_bytes == max(written), (form, tp, ep, plan, written)
        src.reader.close()


def test_inspect_describes_the_published_mla_drafter():
    """k-l-lambda/Kimi-K2.5-Eagle3 (Eagle3DeepseekV2ForCausalLM): MLA attention, the full vocabulary, no embedding
    of its own, aux ids [2, 30, 58] whose convention the config does not declare."""
    out = "\n".join(inspect_checkpoint(PUB / "drafter-k-l-lambda-kimi-k2.5-eagle3-mla"))
    for fact in ["architecture: Eagle3DeepseekV2ForCausalLM (one decoder layer), hidden 7168, 64 heads, MLA (q_lora 1536, "
                 "kv_lora 512, nope 128 / rope 64 / v 128), intermediate 18432", "fc: [7168, 21504] over 3 × target hidden 7168",
                 "vocabulary: the full 163840 ids", "aux layer ids [2, 30, 58]: convention UNKNOWN", "embedding: none (uses the target's)"]:
        assert fact in out, (fact, out)


def test_more_experts_per_token_than_experts_is_refused():
    cfg = read_json(PUB / "kimi-k2-instruct" / "config.json") | {"num_experts_per_tok": 385}
    with pytest.raises(CheckpointError, match=r"config.json: field 'num_experts_per_tok' = 385, expected at most "
                                              r"n_routed_experts \(384\)"):
        TargetConfig.from_hf(cfg)


def test_inspect_names_a_missing_path_a_file_and_a_folder_without_a_config(tmp_path):
    (tmp_path / "f").write_text("x")
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    for path, why in ((tmp_path / "none", "not found"), (tmp_path / "f", "not a folder"),
                      (tmp_path / "loop", r"a link to nothing \(broken or looping\)"),
                      (tmp_path, "no config.json \\(or engine.json\\)")):
        with pytest.raises(CheckpointError, match=f"^{path}: {why}"):
            inspect_checkpoint(path)


def test_inspect_points_into_a_pair_folder_and_refuses_a_foreign_engine_json(tmp_path):
    for sub, name in (("target", "config.json"), ("drafter", "engine.json"), ("notes", "README")):
        (tmp_path / sub).mkdir()
        (tmp_path / sub / name).write_text("{}")
    with pytest.raises(CheckpointError, match=f"^{tmp_path}: no config.json .*; it holds drafter, target: inspect one"):
        inspect_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match=f"^{tmp_path / 'drafter' / 'engine.json'}: format None, expected 'splitspec-"):
        inspect_checkpoint(tmp_path / "drafter")


def test_parameter_counts_read_in_the_unit_they_round_to():
    from splitspec.convert.describe import _human_count

    assert _human_count(1_026_408_235_864) == "1.03 T (1,026,408,235,864)"
    assert _human_count(999_995) == "1.00 M (999,995)"  # not '1000.00 K'
    assert _human_count(994_000) == "994.00 K (994,000)"
    assert _human_count(1_000) == "1.00 K (1,000)" and _human_count(999) == "999" and _human_count(0) == "0"


@pytest.mark.parametrize("edit, says", [
    ({"rms_norm_eps": "tiny"}, r"field 'rms_norm_eps' = 'tiny', expected a number ≥ 0"),
    ({"max_position_embeddings": "big"}, r"field 'max_position_embeddings' = 'big', expected int in 1\.\."),
    ({"rope_theta": {}}, r"field 'rope_theta' = \{\}, expected a number"),
    ({"n_group": "two"}, r"field 'n_group' = 'two'"),
    ({"rope_scaling": {"type": "yarn", "original_max_position_embeddings": 4096}}, r"rope_scaling: field 'factor' is missing"),
    ({"n_shared_experts": -1}, r"field 'n_shared_experts' = -1, expected int in 0\.\."),
    ({"hidden_size": 10 ** 30}, r"field 'hidden_size' = 1000000000000000000000000000000, expected int in 1\.\.16777216"),
    ({"num_hidden_layers": 10 ** 9}, r"field 'num_hidden_layers' = 1000000000, expected int in 1\.\.4096"),
    ({"first_k_dense_replace": 62}, r"field 'first_k_dense_replace' = 62, expected at most num_hidden_layers \(61\)"),
    ({"routed_scaling_factor": float("nan")}, r"field 'routed_scaling_factor' = nan, expected a number ≥ 0"),
])
def test_target_fields_of_the_wrong_type_or_range_are_named(edit, says):
    cfg = read_json(PUB / "kimi-k2-instruct" / "config.json") | edit
    with pytest.raises(CheckpointError, match="^config.json: " + says):
        TargetConfig.from_hf(cfg)


@pytest.mark.parametrize("edit, says", [
    ({"eagle_config": "x"}, r"field 'eagle_config' = 'x', expected an object or null"),
    ({"architectures": 5}, r"field 'architectures' = 5, expected a list of names"),
    ({"draft_vocab_size": 10 ** 7}, r"field 'draft_vocab_size' = 10000000, expected int in 0\.\.163840"),
])
def test_drafter_fields_of_the_wrong_type_or_range_are_named(edit, says):
    cfg = read_json(PUB / "drafter-aq-medai-kimi-k25-eagle3" / "config.json") | edit
    with pytest.raises(CheckpointError, match="^config.json: " + says):
        DrafterConfig.from_hf(cfg)
    assert DrafterConfig.from_hf(read_json(PUB / "drafter-aq-medai-kimi-k25-eagle3" / "config.json")
                                 | {"architectures": "LlamaForCausalLMEagle3"}).architecture == "LlamaForCausalLMEagle3"


def test_a_bad_ignore_pattern_is_named():
    qc = read_json(PUB / "kimi-k2-thinking" / "config.json")["quantization_config"] | {"ignore": ["lm_head", "re:(unclosed"]}
    with pytest.raises(CheckpointError, match=r"^c: quantization_config.ignore entry 're:\(unclosed': not a regular expression"):
        quant.parse_quantization_config(qc, "c")


@pytest.mark.parametrize("shard", [5, "../../x.safetensors", "/etc/hostname", ""])
def test_an_index_naming_a_shard_outside_its_folder_is_refused(tmp_path, shard):
    from splitspec.convert.safetensors import CheckpointReader

    shutil.copytree(PUB / "kimi-k2.5", tmp_path / "k")
    write_json({"weight_map": {"a": shard}}, tmp_path / "k" / "model.safetensors.index.json")
    with pytest.raises(CheckpointError, match=r"model.safetensors.index.json: names shard .*expected a file name"):
        inspect_checkpoint(tmp_path / "k")
    with pytest.raises(CheckpointError, match=r"model.safetensors.index.json: names shard .*expected a file name"):
        CheckpointReader(tmp_path / "k")
