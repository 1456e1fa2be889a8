"""splitspec.models.fp8_grouped's W8A16 grouped kernels against experts computed in float64 from FP8 weights
dequantised by hand here (value × its tile's scale_inv); on CPU through Triton's interpreter, on CUDA where there is
one (the FP8 engine through them: test_fp8_engine_kernels)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")
if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.fail("Triton's interpreter is off: tests/conftest.py sets TRITON_INTERPRET=1 before Triton is imported", pytrace=False)

from splitspec import quant
from splitspec.models import fp8_grouped

# I not a multiple of the row tile (a tile holds gate and up rows), H not of BLOCK_K's multiple 32 past one tile
# column, pairs of another rank (−1 and E)
T, H, I, E, TOP_K, BLOCK = 9, 96, 40, 5, 3, (16, 32)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CONFIGS = ((16, 32, 32, 2, 1), (16, 16, 16, 1, 1))


def by_hand(w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """float64 weight: each element × the scale_inv of its (row // B0, column // B1) tile."""
    r = torch.arange(w.shape[1]) // BLOCK[0]
    c = torch.arange(w.shape[2]) // BLOCK[1]
    return w.double() * s.double()[:, r][:, :, c]


def fp8_weights(g: torch.Generator, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    w = torch.randn(E, rows, cols, generator=g) * torch.rand(E, rows, 1, generator=g) * 0.3
    return quant.quantize_fp8(w, BLOCK)


def reference(x, local, weights, w13, s13, w2, s2) -> torch.Tensor:
    a, b = by_hand(w13, s13), by_hand(w2, s2)
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for slot in range(TOP_K):
            e = int(local[t, slot])
            if 0 <= e < E:
                h = a[e] @ x[t].double()
                out[t] += float(weights[t, slot]) * (b[e] @ (F.silu(h[:I]) * h[I:]))
    return out


def inputs(seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g)
    local = torch.randint(-1, E + 1, (T, TOP_K), generator=g)  # −1 and E: another rank's experts
    local[0] = torch.tensor([0, 0, 0])  # one expert chosen by every slot of a token
    weights = torch.rand(T, TOP_K, generator=g)
    return (x, local, weights, *fp8_weights(g, 2 * I, H), *fp8_weights(g, H, I))


def test_kernels_match_hand_dequantised_float64():
    x, local, weights, w13, s13, w2, s2 = inputs(0)
    want = reference(x, local, weights, w13, s13, w2, s2)
    dev = [t.to(DEVICE) for t in (x, local, weights, w13, s13, w2, s2)]
    if DEVICE == "cuda":
        dev[0] = dev[0].bfloat16()
    got = fp8_grouped.fp8_grouped_experts(*dev, BLOCK, CONFIGS).cpu().double()
    err = ((got - want).abs().max() / want.abs().max()).item()
    assert err < (2e-2 if DEVICE == "cuda" else 1e-5), err


def test_bad_arguments_are_named_before_any_kernel_runs():
    x, local, weights, w13, s13, w2, s2 = (t.to(DEVICE) for t in inputs(0))
    good = dict(x=x, local=local, weights=weights, w13=w13, w13_scale=s13, w2=w2, w2_scale=s2, block=BLOCK, configs=CONFIGS)
    cases = [
        (dict(x=x[:, :-8]), r"x float32 \[9, 88\], expected a float \[T, 96\] \(w13's H\)"),
        (dict(x=x.int()), r"x int32 \[9, 96\], expected a float"),
        (dict(local=local[:5]), r"local int64 \[5, 3\], expected integer expert ids \[9, top_k\]"),
        (dict(local=local.float()), "local float32"),
        (dict(weights=weights[:, :2]), r"weights float32 \[9, 2\], expected float routing weights of local's shape"),
        (dict(w13=w13.float()), r"w13 float32 \[5, 80, 96\], expected float8_e4m3fn \[E ≥ 1, 2·I, H\]"),
        (dict(w2=w2[:, :, :8]), r"w2 float8_e4m3fn \[5, 96, 8\], expected float8_e4m3fn \[5, 96, 40\]"),
        (dict(w13_scale=s13[:, :4]), r"w13 scale_inv float32 \[5, 4, 3\], expected float32 \[5, 5, 3\]"),
        (dict(w2_scale=s2.half()), r"w2 scale_inv float16"),
        (dict(block=(0, 32)), r"block \(0, 32\), expected two positive integers"),
        (dict(block=(16.9, 32)), r"block \(16.9, 32\)"),
        (dict(configs=(CONFIGS[0], (16, 16, 24, 1, 1))), r"down config \(16, 16, 24, 1, 1\)"),
        (dict(configs=((24, 32, 32, 2, 1), CONFIGS[1])), r"gate_up config \(24, 32, 32, 2, 1\).*powers of two"),
        (dict(configs=((16, 32, 32), CONFIGS[1])), r"gate_up config \(16, 32, 32\)"),
        (dict(configs=((2 ** 20, 32, 32, 2, 1), CONFIGS[1])), r"gate_up config \(1048576, .*in 16..256"),
        (dict(configs=(CONFIGS[0], (16, 16, 32, 2 ** 20, 1))), r"down config .*num_warps a power of two ≤ 32"),
        (dict(configs=None), r"configs None, expected \(gate_up, down\)"),
        (dict(block=None), r"block None, expected two positive integers"),
        (dict(w2_scale=s2.to("meta")), r"w2_scale on meta, expected x's device"),
        (dict(weights=weights.tolist()), r"weights is list, expected a tensor"),
    ]
    for change, message in cases:
        with pytest.raises(ValueError, match="^FP8 grouped experts: " + message):
            fp8_grouped.fp8_grouped_experts(**(good | change))


def test_a_cpu_call_without_the_interpreter_is_named(monkeypatch):
    x, local, weights, w13, s13, w2, s2 = inputs(0)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match=r"^FP8 grouped experts: x on cpu: the kernels need a CUDA device"):
        fp8_grouped.fp8_grouped_experts(x, local, weights, w13, s13, w2, s2, BLOCK, CONFIGS)


def test_numpy_integers_are_taken_as_the_block():
    np = pytest.importorskip("numpy")
    x, local, weights, w13, s13, w2, s2 = [t.to(DEVICE) for t in inputs(0)]
    want = fp8_grouped.fp8_grouped_experts(x, local, weights, w13, s13, w2, s2, BLOCK, CONFIGS)
    got = fp8_grouped.fp8_grouped_experts(x, local, weights, w13, s13, w2, s2, tuple(np.int64(b) for b in BLOCK), CONFIGS)
    assert torch.equal(want, got)
