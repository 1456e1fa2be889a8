"""Every published checkpoint form converts to the same engine numerics.

One set of float weights (:mod:`splitspec.testing.fixtures`) is written as bf16, FP8 block-scaled (ragged
tiles), INT4 compressed-tensors and K2.5-nested INT4, plus EAGLE-3 drafter variants. Each test checks a
converter output against the float original: dequantised weights within the format's own rounding
(checked with dequantisers written here, independent of :mod:`splitspec.quant`), engine logits against
transformers' DeepseekV3 on the same dequantised weights (tight) and on the float original (reported).
"""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from splitspec import quant

from splitspec.testing import fixtures

from splitspec.build.engines import build_engines
from splitspec.cli import main as cli_main
from splitspec.drafter_config import DrafterConfig
from splitspec.convert.pair import convert_pair
from splitspec.testing.engine_logits import assert_bf16_close, engine_logits
from splitspec.testing.reference import load_hf_reference_target
from splitspec.errors import ConfigError
from splitspec.convert.safetensors import CheckpointReader
from splitspec.files import read_json
from splitspec.models.layers import rms_norm

TIGHT = 2e-4  # float32 engine vs transformers on identical weights (see test_numerics.LOGITS_ATOL)


# ---------------------------------------------------------------- helpers

@pytest.fixture(scope="module")
def master(fx) -> dict[str, torch.Tensor]:
    return load_file(str(fx / "master.safetensors"))


@pytest.fixture(scope="module")
def dmaster(fx) -> dict[str, torch.Tensor]:
    return load_file(str(fx / "drafter_master.safetensors"))


def ref_dequant_fp8(w: torch.Tensor, s: torch.Tensor, block=(128, 128)) -> torch.Tensor:
    """Tile by tile, independent of splitspec.quant."""
    out = torch.empty(w.shape, dtype=torch.float32)
    b0, b1 = block
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            out[i * b0:(i + 1) * b0, j * b1:(j + 1) * b1] = w[i * b0:(i + 1) * b0, j * b1:(j + 1) * b1].float() * float(s[i, j])
    return out


def ref_unpack_int4(packed: torch.Tensor, cols: int) -> np.ndarray:
    """Nibble k of each little-endian int32 word is input column 8·word + k, stored +8 (numpy, unsigned)."""
    u = packed.numpy().view(np.uint32)
    nib = np.stack([(u >> (4 * k)) & 0xF for k in range(8)], axis=-1).reshape(u.shape[0], -1)[:, :cols]
    return nib.astype(np.int64) - 8


def ref_dequant_int4(packed, scale, cols: int, group: int = 32) -> torch.Tensor:
    q = torch.from_numpy(ref_unpack_int4(packed, cols)).float()
    return q * scale.float()[:, torch.arange(cols) // group]


def dequantised_checkpoint(fx: Path, form: str, out: Path) -> Path:
    """The ``form`` checkpoint's weights dequantised here (independently), as a float32 kimi_k2 checkpoint."""
    r = CheckpointReader(fx / form)
    tensors = {}
    for n in r.names():
        if n.endswith(("weight_scale_inv", "weight_scale", "weight_shape")):
            continue
        if n.endswith("weight_packed"):
            m = n.removesuffix(".weight_packed")
            shape = r.get(m + ".weight_shape").tolist()
            tensors[m + ".weight"] = ref_dequant_int4(r.get(n), r.get(m + ".weight_scale"), shape[1])  # exact in float32
        elif r.info(n).dtype == torch.float8_e4m3fn:
            tensors[n] = ref_dequant_fp8(r.get(n), r.get(n + "_scale_inv"))
        else:
            tensors[n] = r.get(n).float()
    fixtures.write_checkpoint(out, tensors.items(), dict(fixtures.target_config(), torch_dtype="float32"))
    return out


def hf_logits(folder: Path, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return load_hf_reference_target(folder)(torch.tensor([ids])).logits[0].float()


@pytest.fixture(scope="module")
def ref_float(fx, prompt) -> torch.Tensor:
    return hf_logits(fx / "float", prompt)


# ---------------------------------------------------------------- dequantised weights

def _converted(fx: Path, tmp: Path, form: str, tp: int = 1, **kw) -> list[dict[str, torch.Tensor]]:
    convert_pair(fx / form, fx / "drafter", tmp / form, tp_size=tp, progress=False, **kw)
    return [load_file(str(tmp / form / "target" / f"rank{r}.safetensors")) for r in range(tp)]


def test_bf16_form_converts_to_the_float_original(fx, master, tmp_path):
    (shard,) = _converted(fx, tmp_path, "bf16")
    assert set(shard) == set(master)
    worst = max((shard[n].float() - master[n]).abs().max().item() for n in master)
    print(f"bf16: max |dequantised − original| over {len(master)} tensors = {worst:.3g}")
    assert worst == 0


def test_quantize_fp8_treats_leading_dimensions_as_separate_matrices():
    w = torch.randn(3, 2, 40, 70, generator=torch.Generator().manual_seed(7))
    q, s = quant.quantize_fp8(w, (16, 32))
    assert q.shape == w.shape and s.shape == (3, 2, 3, 3)
    for i in range(3):
        for j in range(2):
            q1, s1 = quant.quantize_fp8(w[i, j], (16, 32))
            assert torch.equal(q[i, j].view(torch.uint8), q1.view(torch.uint8)) and torch.equal(s[i, j], s1)


def test_fp8_dequantised_weights_within_e4m3_rounding(fx, master, tmp_path):
    (shard,) = _converted(fx, tmp_path, "fp8")
    block = fixtures.BLOCK
    linears = [n for n in shard if n.endswith(".weight") and shard[n].dtype == torch.float8_e4m3fn]
    assert len(linears) == len(fixtures.target_linears(fixtures.target_config()))
    worst, ragged = 0.0, 0
    for n in linears:
        w, s = shard[n], shard[n + "_scale_inv"]
        assert tuple(s.shape) == (math.ceil(w.shape[0] / 128), math.ceil(w.shape[1] / 128))
        ragged += w.shape[0] % 128 != 0 or w.shape[1] % 128 != 0
        deq = ref_dequant_fp8(w, s)
        assert torch.equal(deq, quant.dequantize_fp8(w, s, block)), n
        scale = quant.expand_scale(s, tuple(w.shape), block)
        err = (deq - master[n]).abs()
        bound = master[n].abs() * 2.0 ** -4 + scale * 2.0 ** -10 + 1e-12  # e4m3: 3 mantissa bits; subnormal step 2^-9
        assert bool((err <= bound).all()), n
        worst = max(worst, err.max().item())
    for n in set(shard) - set(linears) - {x + "_scale_inv" for x in linears}:
        assert torch.equal(shard[n].float(), master[n]), n
    print(f"fp8: max |dequantised − original| = {worst:.4g} over {len(linears)} linears ({ragged} with ragged tiles)")
    assert ragged >= 30


def test_int4_dequantised_weights_within_group_rounding(fx, master, built, tmp_path):
    """Convert carries the INT4 experts as published; a float32 build dequantises them exactly."""
    (shard,) = _converted(fx, tmp_path, "int4")
    eng = load_file(str(built("int4") / "target" / "rank0.safetensors"))
    src = CheckpointReader(fx / "int4")
    experts = [n for n in master if ".experts." in n]
    worst = 0.0
    for n in experts:
        m = n.removesuffix(".weight")
        packed, scale = src.get(m + ".weight_packed"), src.get(m + ".weight_scale")
        assert torch.equal(shard[m + ".weight_packed"], packed) and torch.equal(shard[m + ".weight_scale"], scale), n
        cols = master[n].shape[1]
        assert np.array_equal(ref_unpack_int4(packed, cols), quant.unpack_int4(packed, cols).numpy()), n
        layer, e, proj = int(n.split(".")[2]), int(n.split(".")[5]), n.split(".")[6]
        stacked = eng[f"layers.{layer}.mlp.experts.{'w2' if proj == 'down_proj' else 'w13'}"][e]
        rows = master[n].shape[0]
        got = stacked[rows:] if proj == "up_proj" else stacked[:rows]
        assert torch.equal(got, ref_dequant_int4(packed, scale, cols)), n
        s = scale.float()[:, torch.arange(cols) // 32]
        err = (got - master[n]).abs()
        assert bool((err <= s / 2 + 1e-12).all()), n
        worst = max(worst, err.max().item())
    for n in set(master) - set(experts):
        assert torch.equal(shard[n].float(), master[n]), n
    print(f"int4: max |dequantised − original| = {worst:.4g} over {len(experts)} routed-expert linears; "
          f"{len(master) - len(experts)} other tensors exact")


def test_k25_nesting_converts_to_the_same_shards_as_int4(fx, tmp_path, capsys):
    k25 = _converted(fx, tmp_path, "k25", tp=2)
    out = capsys.readouterr().out
    int4 = _converted(fx, tmp_path, "int4", tp=2)
    assert out.count("skipped 3 vision tensors") == 1 and "unused tensors" not in out
    for a, b in zip(k25, int4):
        assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    meta = read_json(tmp_path / "k25" / "target" / "config.json")
    assert meta["config"]["model_type"] == "kimi_k25" and meta["quantization"]["method"] == "int4"


# ---------------------------------------------------------------- engine numerics

@pytest.mark.parametrize("form", ["bf16", "fp8", "int4", "k25"])
def test_engine_logits_per_form(form, fx, built, prompt, ref_float, tmp_path):
    ours, _ = engine_logits(built(form), prompt)
    vs_float = (ours - ref_float).abs().max().item()
    if form == "bf16":
        same = vs_float
    else:
        ref_deq = hf_logits(dequantised_checkpoint(fx, "int4" if form == "k25" else form, tmp_path / "deq"), prompt)
        same = (ours - ref_deq).abs().max().item()
    agree = (ours.argmax(-1) == ref_float.argmax(-1)).float().mean().item()
    mean = (ours - ref_float).abs().mean().item()
    print(f"{form}: engine logits vs float original max |Δ| {vs_float:.4g}, mean |Δ| {mean:.3g} (logit std {ref_float.std():.2f}, "
          f"argmax agreement {agree:.0%}); vs transformers on the same dequantised weights max |Δ| {same:.3g}")
    assert same < TIGHT  # the engine computes exactly what the dequantised weights say
    if form == "bf16":
        assert vs_float < TIGHT
    else:  # the format's own rounding (and the expert choices it flips in a random toy model): a sanity bound only
        assert mean < 0.25 * ref_float.std() and agree >= 0.75


def test_fp8_engine_keeps_fp8_weights_and_matches_dequantised_bf16_engine(built, prompt, ref_float):
    kept = built("fp8", dtype="fp8")
    w = load_file(str(kept / "target" / "rank0.safetensors"))
    fp8 = [n for n, t in w.items() if t.dtype == torch.float8_e4m3fn]
    assert "layers.1.mlp.experts.w13" in fp8 and "layers.0.attn.fused_qkv_a" in fp8
    assert all(n + ".scale_inv" in w for n in fp8)
    assert w["embed_tokens"].dtype == torch.bfloat16 and w["layers.0.attn.w_uk"].dtype == torch.bfloat16
    bf16 = built("fp8", dtype="bfloat16")
    a, _ = engine_logits(kept, prompt)
    b, _ = engine_logits(bf16, prompt)
    size = lambda d: sum(p.stat().st_size for p in (d / "target").glob("*.safetensors"))  # noqa: E731
    print(f"fp8 kept: logits max |Δ| vs float original {(a - ref_float).abs().max():.4g}; vs the bf16 engine dequantised "
          f"at build {(a - b).abs().max():.3g}; weights {size(kept) / 2**20:.2f} MiB vs {size(bf16) / 2**20:.2f} MiB")
    assert torch.equal(a, b)


def test_fp8_tp2_slices_tiles_and_matches_tp1(fx, built, prompt, tmp_path):
    shards = _converted(fx, tmp_path, "fp8", tp=2)
    meta = read_json(tmp_path / "fp8" / "target" / "config.json")
    assert meta["quantization"]["dequantized_at_convert"] == []
    q_b = "model.layers.0.self_attn.q_b_proj"
    assert [tuple(s[q_b + ".weight_scale_inv"].shape) for s in shards] == [(2, 2), (2, 2)]
    tp1, _ = engine_logits(built("fp8"), prompt)
    tp2, _ = engine_logits(built("fp8", tp=2), prompt)
    k1, _ = engine_logits(built("fp8", dtype="fp8"), prompt)
    k2, _ = engine_logits(built("fp8", tp=2, dtype="fp8"), prompt)
    print(f"fp8 TP2 vs TP1: float32 engines max |Δ| {(tp2 - tp1).abs().max():.3g}; fp8-kept (bf16 activations) engines "
          f"max |Δ| {(k2 - k1).abs().max():.3g}, mean |Δ| {(k2 - k1).abs().mean():.3g}")
    assert (tp2 - tp1).abs().max() < TIGHT
    assert_bf16_close(k2, k1)


def test_fp8_tp4_split_inside_tiles_is_dequantised_with_a_notice(fx, master, built, prompt, tmp_path, capsys):
    shards = _converted(fx, tmp_path, "fp8", tp=4)
    out = capsys.readouterr().out
    assert "stored dequantised (bfloat16) because the TP4 split cuts through" in out
    n = "model.layers.1.mlp.experts.3.up_proj.weight"
    src = CheckpointReader(fx / "fp8")
    full = ref_dequant_fp8(src.get(n), src.get(n + "_scale_inv")).bfloat16()
    assert all(s[n].dtype == torch.bfloat16 and n + "_scale_inv" not in s for s in shards)
    assert torch.equal(torch.cat([s[n] for s in shards]), full)
    q_b = "model.layers.0.self_attn.q_b_proj.weight"  # 128 rows per rank: still tile-aligned, kept FP8
    assert all(s[q_b].dtype == torch.float8_e4m3fn for s in shards)
    tp4, _ = engine_logits(built("fp8", tp=4, dtype="fp8"), prompt)
    tp1, _ = engine_logits(built("fp8", dtype="fp8"), prompt)
    print(f"fp8 TP4 (expert slices dequantised) vs TP1, fp8-kept engines: max |Δ| {(tp4 - tp1).abs().max():.3g}, "
          f"mean |Δ| {(tp4 - tp1).abs().mean():.3g}")
    assert_bf16_close(tp4, tp1)


# ---------------------------------------------------------------- drafters

def _drafter_meta(engines: Path) -> dict:
    return read_json(engines / "drafter" / "engine.json")


def test_published_drafter_aux_after_last_block_is_before_final_norm(fx, built, prompt):
    """Aux id 3 = number of target layers under the input convention: the state after the last block, before
    the final norm. Checked against transformers with a hook on the last decoder layer."""
    eng = built("bf16")
    meta = _drafter_meta(eng)
    assert meta["capture_points"] == [0, 1, 3] and "after the last layer" in meta["capture"]
    _, aux = engine_logits(eng, prompt, tuple(meta["capture_points"]))
    ref = load_hf_reference_target(fx / "float")
    got = {}
    ref.model.layers[-1].register_forward_hook(lambda m, i, o: got.setdefault("last", o[0] if isinstance(o, tuple) else o))
    with torch.inference_mode():
        hs = ref(torch.tensor([prompt]), output_hidden_states=True).hidden_states
    H = 320
    expect = [hs[0][0], hs[1][0], got["last"][0]]
    for j, e in enumerate(expect):
        assert (aux[:, j * H:(j + 1) * H] - e).abs().max() < TIGHT, j
    assert (aux[:, 2 * H:] - hs[3][0]).abs().max() > 0.1  # transformers' last hidden_states entry is after the norm


def test_drafter_variants(fx, master, dmaster, tmp_path, capsys):
    ids = dmaster["draft_ids"]
    # published SpecForge form: no embedding, d2t + t2d, declared input convention
    convert_pair(fx / "bf16", fx / "drafter", tmp_path / "a", tp_size=1, progress=False)
    d = load_file(str(tmp_path / "a" / "drafter" / "rank0.safetensors"))
    assert torch.equal(d["draft_to_target"], ids) and torch.equal(d["embed_tokens.weight"].float(), master["model.embed_tokens.weight"])
    assert torch.equal(d["lm_head.weight"].float(), dmaster["lm_head_full"][ids])
    out = capsys.readouterr().out
    assert "target states feeding the drafter (input convention, declared in eagle_config.aux_layer_id_convention)" in out
    # ModelOpt export: own embedding equal to the target's, full vocabulary, output convention inferred from origin keys
    convert_pair(fx / "bf16", fx / "drafter_modelopt", tmp_path / "b", tp_size=1, progress=False)
    meta = read_json(tmp_path / "b" / "drafter" / "config.json")
    assert meta["capture_points"] == [1, 2, 3] and "ModelOpt" in meta["aux_convention_source"]
    assert meta["embedding_source"] == "target" and "equal" in meta["embedding"]
    d = load_file(str(tmp_path / "b" / "drafter" / "rank0.safetensors"))
    assert torch.equal(d["draft_to_target"], torch.arange(512))
    capsys.readouterr()
    # own embedding that differs; no convention anywhere: refused until one is given
    with pytest.raises(ConfigError, match="aux_convention is unknown"):
        convert_pair(fx / "bf16", fx / "drafter_own_embed", tmp_path / "c", tp_size=1, progress=False)
    assert not (tmp_path / "c").exists()
    convert_pair(fx / "bf16", fx / "drafter_own_embed", tmp_path / "c", tp_size=1, aux_convention="output", progress=False)
    out = capsys.readouterr().out
    assert "DIFFERS from the target's" in out and "given on the command line" in out
    d = load_file(str(tmp_path / "c" / "drafter" / "rank0.safetensors"))
    assert torch.equal(d["embed_tokens.weight"].float(), dmaster["own_embed"])
    convert_pair(fx / "bf16", fx / "drafter_own_embed", tmp_path / "d", tp_size=1, aux_convention="output",
                 drafter_embedding="target", progress=False)
    d = load_file(str(tmp_path / "d" / "drafter" / "rank0.safetensors"))
    assert torch.equal(d["embed_tokens.weight"].float(), master["model.embed_tokens.weight"])
    # explicitly tied in the config: the target's, silently fine
    tied = tmp_path / "tied"
    shutil.copytree(fx / "drafter_own_embed", tied)
    cfg = json.loads((tied / "config.json").read_text())
    cfg["eagle_config"].update(share_target_embedding=True, aux_layer_id_convention="output")
    (tied / "config.json").write_text(json.dumps(cfg))
    convert_pair(fx / "bf16", tied, tmp_path / "e", tp_size=1, progress=False)
    meta = read_json(tmp_path / "e" / "drafter" / "config.json")
    assert meta["embedding_source"] == "target" and "share_target_embedding" in meta["embedding"]


def reference_fuse(aux: torch.Tensor, w: dict[str, torch.Tensor], cfg: DrafterConfig) -> torch.Tensor:
    """The drafter's fc over aux states [T, 3·target_hidden] with the norms its config asks for
    (norm_before_fc: one RMSNorm over all 3·target_hidden; fc_norm: one per aux state; vLLM's order)."""
    x = aux
    if cfg.norm_before_fc:
        x = rms_norm(x, w["fc_input_norm"], cfg.rms_norm_eps)
    if cfg.fc_norm:
        x = torch.cat([rms_norm(c, w["fc_norm"][i], cfg.rms_norm_eps) for i, c in enumerate(x.chunk(3, -1))], -1)
    return F.linear(x.to(w["fc"].dtype), w["fc"])


def test_drafter_norm_before_fc_is_carried_and_applied(fx, dmaster, tmp_path):
    convert_pair(fx / "bf16", fx / "drafter_norm_fc", tmp_path / "ck", tp_size=1, progress=False)
    meta = read_json(tmp_path / "ck" / "drafter" / "config.json")
    assert meta["config"]["norm_before_fc"] is True
    d = load_file(str(tmp_path / "ck" / "drafter" / "rank0.safetensors"))
    assert torch.equal(d["input_norm.weight"].float(), dmaster["input_norm"])
    build_engines(tmp_path / "ck", tmp_path / "eng", progress=False)
    from splitspec.drafter_config import DrafterConfig
    from splitspec.models.drafter import DrafterModel

    w = load_file(str(tmp_path / "eng" / "drafter" / "rank0.safetensors"))
    cfg = DrafterConfig.from_dict(read_json(tmp_path / "eng" / "drafter" / "engine.json")["config"])
    aux = torch.randn(3, 960)
    assert torch.allclose(DrafterModel(cfg, w).fuse(aux), reference_fuse(aux, w, cfg), atol=1e-5)


# ---------------------------------------------------------------- inspect, io

def test_inspect_prints_what_a_checkpoint_is(fx, capsys):
    for args, expect in [
        (["fp8"], ["FP8 e4m3 block-scaled, tiles 128×128", "72 float8_e4m3fn weights",
                  "3 layers (1 dense: first_k_dense_replace 1, layer 0 dense; 2 MoE), hidden 320"]),
        (["int4"], ["INT4 compressed-tensors pack-quantized", "48 packed linears (48 routed-expert)"]),
        (["k25"], ["model_type kimi_k25", "under language_model.", "vision: 3 tensors"]),
        (["drafter", "--target", str(fx / "bf16")], ["draft 128 of 512", "d2t + t2d", "after the last layer", "embedding: none"]),
        (["drafter_modelopt"], ["output-of-layer convention (inferred from its origin: ModelOpt", "own 'embed_tokens.weight'"]),
        (["drafter_own_embed"], ["convention UNKNOWN"]),
        (["drafter_norm_fc"], ["norm_before_fc (input_norm.weight)"]),
    ]:
        assert cli_main(["inspect", str(fx / args[0]), *args[1:]]) == 0
        out = capsys.readouterr().out
        for e in expect:
            assert e in out, (args, e, out)
    # the parameter count with a readable suffix and in full: the two agree
    assert cli_main(["inspect", str(fx / "bf16")]) == 0
    short, suffix, full = re.search(r"parameters: (\d+\.\d\d) ([KMBT]) \(([\d,]+)\)", capsys.readouterr().out).groups()
    n = int(full.replace(",", ""))
    assert abs(float(short) * {"K": 1e3, "M": 1e6, "B": 1e9, "T": 1e12}[suffix] - n) <= 0.005 * n


def test_streamed_files_are_standard_safetensors(tmp_path):
    from splitspec.convert.safetensors import write_tensors

    ts = {"a": torch.randn(3, 5).bfloat16(), "b": torch.arange(7), "c": torch.ones(4, dtype=torch.bool),
          "d": torch.randn(130, 70).to(torch.float8_e4m3fn), "e": torch.zeros(0, 3)}
    write_tensors(ts.items(), tmp_path / "x.safetensors")
    back = load_file(str(tmp_path / "x.safetensors"))
    assert all(torch.equal(back[k].view(torch.uint8), ts[k].view(torch.uint8)) for k in "abcd") and back["e"].shape == (0, 3)
    assert not list(tmp_path.glob("*.data"))


def test_int4_packing_agrees_with_compressed_tensors():
    ct = pytest.importorskip("compressed_tensors.compressors.quantized_compressors.pack_quantized")
    v = torch.randint(-8, 8, (6, 64), generator=torch.Generator().manual_seed(0))
    assert torch.equal(quant.pack_int4(v), ct.pack_to_int32(v.to(torch.int8), 4))
