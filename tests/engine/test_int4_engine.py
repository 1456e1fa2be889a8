"""INT4 routed experts kept as published, end to end on CPU: convert carries the packed words and scales through
untouched, ``build --dtype int4`` stacks them, and the engine computes what the dequantised checkpoint says (the same
checkpoint built with a float dtype is the reference); greedy speculation on an INT4 engine is lossless."""

from __future__ import annotations

import contextlib
import io
import os
from pathlib import Path
from unittest.mock import patch

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from splitspec import quant
from splitspec.build.engines import build_engines
from splitspec.build.memory_plan import Deployment, plan_memory
from splitspec.build.weight_bytes import Storage, WeightFormat
from splitspec.config import TargetConfig
from splitspec.convert.pair import convert_pair
from splitspec.convert.safetensors import CheckpointReader
from splitspec.files import read_json
from splitspec.models import fused_moe, int4_routed
from splitspec.testing import fixtures
from splitspec.testing.engine_logits import engine_logits

FLOAT32_TOL = 1e-5  # INT4 engine vs the float32 engine of the same checkpoint (measured: 0, the same arithmetic)


@pytest.fixture(scope="module")
def fx(tmp_path_factory) -> Path:
    return fixtures.make_fixtures(tmp_path_factory.mktemp("int4") / "fx", forms=("float", "int4", "drafter"))


def _quiet(fn, *a, **kw):
    with contextlib.redirect_stdout(io.StringIO()):
        return fn(*a, **kw)


@pytest.fixture(scope="module")
def ckpt(fx, tmp_path_factory):
    """``ckpt(tp)`` → the INT4 fixture converted at TP-tp, its nibble order checked against the float original."""
    cache = {}

    def get(tp: int) -> Path:
        if tp not in cache:
            cache[tp] = _quiet(convert_pair, fx / "int4", fx / "drafter", tmp_path_factory.mktemp(f"ck{tp}"), tp_size=tp,
                               progress=False, int4_reference=fx / "float")
        return cache[tp]

    return get


def test_convert_carries_the_published_int4_experts(fx, ckpt):
    src = CheckpointReader(fx / "int4")
    shards = [load_file(str(ckpt(2) / "target" / f"rank{r}.safetensors")) for r in range(2)]
    meta = read_json(ckpt(2) / "target" / "config.json")
    assert meta["quantization"]["method"] == "int4" and meta["quantization"]["group_size"] == 32
    for e in (0, 7):
        m = f"model.layers.2.mlp.experts.{e}."
        for n, dim in (("gate_proj", 0), ("up_proj", 0), ("down_proj", 1)):
            for suffix in ("weight_packed", "weight_scale"):
                whole = src.get(m + n + "." + suffix)
                assert torch.equal(torch.cat([s[m + n + "." + suffix] for s in shards], dim), whole), (n, suffix)
            rows, cols = src.get(m + n + ".weight_shape").tolist()
            assert shards[1][m + n + ".weight_shape"].tolist() == ([rows // 2, cols] if dim == 0 else [rows, cols // 2])
    assert not any(n.endswith("weight_packed") and ".experts." not in n for n in shards[0])


@pytest.mark.parametrize("tp", [1, 2])
def test_int4_engine_equals_the_dequantised_engine(fx, ckpt, tp, tmp_path):
    """Routed experts INT4 + the rest float32 (the CPU engine dtype) against --dtype float32 of the same checkpoint;
    the default (INT4 + bf16) against --dtype bfloat16. CPU: the grouped path, chosen experts dequantised per call."""
    prompt = torch.randint(0, 512, (24,), generator=torch.Generator().manual_seed(3)).tolist()
    built = {name: _quiet(build_engines, ckpt(tp), tmp_path / name, dtype=dtype, float_dtype=fdt, max_batch_size=1,
                          max_seq_len=64, progress=False)
             for name, dtype, fdt in (("int4_f32", "int4", "float32"), ("f32", "float32", None), ("int4_bf16", None, None),
                                      ("bf16", "bfloat16", None))}
    meta = read_json(built["int4_bf16"] / "target" / "engine.json")
    q = meta["quantization"]
    assert meta["dtype"] == "int4" and q["group_size"] == 32 and q["activation_dtype"] == "bfloat16" and "w13" in q["layout"]
    w = load_file(str(built["int4_f32"] / "target" / "rank0.safetensors"))
    assert w["layers.1.mlp.experts.w13"].dtype == torch.int32 and w["layers.1.mlp.experts.w13"].shape == (8, 512 // tp, 40)
    assert w["layers.1.mlp.experts.w2.scale"].dtype == torch.bfloat16 and w["layers.1.mlp.experts.w2.scale"].shape == (8, 320, 8 // tp)
    assert w["layers.1.mlp.shared.w13"].dtype == torch.float32 and int(w[quant.INT4_KEY][0]) == 32
    logits = {name: engine_logits(path, prompt)[0] for name, path in built.items()}
    d32 = (logits["int4_f32"] - logits["f32"]).abs().max().item()
    d16 = (logits["int4_bf16"] - logits["bf16"]).abs()
    print(f"TP{tp}: INT4 engine vs dequantised engine logits max |Δ| float32 {d32:.3g}, bfloat16 {d16.max():.3g} "
          f"(mean {d16.mean():.3g}; logit std {logits['f32'].std():.2f})")
    assert d32 <= FLOAT32_TOL
    assert d16.mean() < 0.02 and (logits["int4_bf16"].argmax(-1) == logits["bf16"].argmax(-1)).float().mean() >= 0.9
    # the memory plan counts the engine's own bytes: the rank file's tensors exactly
    cfg = TargetConfig.from_dict(meta["config"])
    plan = plan_memory(cfg, WeightFormat("int4", 4, group=32), Storage(quant.QuantScheme("int4", group_size=32,
                       ignore=(r"re:(?!.*\.experts\.)",))), None, Deployment(tp=tp, max_batch_size=1, max_seq_len=64), on_gpu=False)
    r = CheckpointReader.single(built["int4_f32"] / "target" / "rank0.safetensors")
    assert plan.gpus[0].group("weights") == sum(r.info(n).nbytes for n in r.names())


def test_int4_routed_paths_agree_with_float64():
    """The dispatch's two paths on tiny shapes: grouped (chosen experts dequantised, two chunks of slots) and fused
    (the W4A16 kernels, forced on for CPU tensors under Triton's interpreter) against float64 on dequantised weights;
    ids of another rank (-1, E) skipped."""
    g = torch.Generator().manual_seed(0)
    T, H, I, E, K = 3, 64, 32, 20, 6
    x = torch.randn(T, H, generator=g)
    local = torch.stack([torch.randperm(E + 2, generator=g)[:K] - 1 for _ in range(T)])
    weights = torch.rand(T, K, generator=g)
    q13 = [quant.quantize_int4(torch.randn(2 * I, H, generator=g) / 8, 32) for _ in range(E)]
    q2 = [quant.quantize_int4(torch.randn(H, I, generator=g) / 6, 32) for _ in range(E)]
    lw = dict(zip(int4_routed.NAMES, (torch.stack([q[i] for q in qs]) for qs, i in ((q13, 0), (q13, 1), (q2, 0), (q2, 1)))))
    w13 = torch.stack([quant.dequantize_int4(p, s, H, 32, torch.float64) for p, s, _ in q13])
    w2 = torch.stack([quant.dequantize_int4(p, s, I, 32, torch.float64) for p, s, _ in q2])
    ref = torch.zeros(T, H, dtype=torch.float64)
    for t in range(T):
        for j in range(K):
            e = int(local[t, j])
            if 0 <= e < E:
                gate, up = (w13[e] @ x[t].double()).chunk(2)
                ref[t] += float(weights[t, j]) * (w2[e] @ (F.silu(gate) * up))
    slots, sub = int4_routed.chosen_experts(local, E)
    assert len(slots) == T * K and set(local[(local >= 0) & (local < E)].tolist()) <= set(slots[: len(set(slots.tolist()))].tolist())
    assert torch.equal(slots[sub[sub >= 0]], local[sub >= 0])
    grouped = int4_routed.routed_experts(x, local, weights, lw, 32)
    assert (grouped.double() - ref).abs().max() < 1e-5
    if not fused_moe.available() or (os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available()):
        pytest.skip("the fused path needs Triton (its interpreter on CPU)")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    with patch.object(fused_moe, "use_fused", lambda x: x.shape[0] <= fused_moe.MAX_TOKENS):
        fused = int4_routed.routed_experts(x.to(dev), local.to(dev), weights.to(dev), {n: t.to(dev) for n, t in lw.items()}, 32)
    print(f"INT4 routed experts: grouped vs float64 max |Δ| {(grouped.double() - ref).abs().max():.3g}, "
          f"fused {(fused.cpu().double() - ref).abs().max():.3g}")
    assert (fused.cpu().double() - ref).abs().max() < 1e-4


def test_int4_demo_speculation_is_lossless(demo_models, tmp_path):
    """The demo target with INT4 experts (built with the default dtype: INT4 experts, float32 rest via build_pair's
    rule), target TP2 (expert-TP splits down_proj's 128 inputs into 64, two groups) and the trained drafter: greedy
    speculation gives target-only greedy tokens."""
    from splitspec.build.engines import build_pair
    from splitspec.runtime.scheduler import SpeculativeEngine
    from splitspec.runtime.tokenizer import ChatTokenizer
    from splitspec.settings import ServeConfig

    models = tmp_path / "models"
    fixtures.write_int4_copy(demo_models / "target", models / "target")
    (models / "drafter").symlink_to(demo_models / "drafter", target_is_directory=True)
    engines = build_pair(models, tmp_path / "out", tp_size=2, max_batch_size=2, max_seq_len=256, quiet=True)
    assert read_json(engines / "target" / "engine.json")["dtype"] == "int4"
    tok = ChatTokenizer.from_dir(demo_models / "target")
    with SpeculativeEngine.load(ServeConfig(engines)) as eng:
        for p in ("def fibonacci(n):", "import os\nimport sys\n"):
            ids = tok.encode(p)
            ref = eng.generate(ids, 24, num_draft_tokens=0, stop_token_ids=set()).token_ids
            res = eng.generate(ids, 24, num_draft_tokens=3, stop_token_ids=set())
            print(f"INT4 demo TP2, k=3: acceptance length {res.acceptance_length:.2f}")
            assert res.token_ids == ref and 1.0 <= res.acceptance_length <= 4.0


def test_build_dtype_int4_needs_an_int4_checkpoint(fx, ckpt, tmp_path):
    from splitspec.errors import ConfigError

    plain = _quiet(convert_pair, fx / "float", fx / "drafter", tmp_path / "ck", tp_size=1, progress=False)
    with pytest.raises(ConfigError, match=r"dtype 'int4' keeps an INT4 checkpoint's routed experts, but .* holds none"):
        build_engines(plain, tmp_path / "eng", dtype="int4", progress=False)
    with pytest.raises(ConfigError, match="float_dtype 'float32' goes with dtype fp8 or int4"):
        build_engines(ckpt(1), tmp_path / "eng", dtype="bfloat16", float_dtype="float32", progress=False)
    assert not (tmp_path / "eng").exists()
