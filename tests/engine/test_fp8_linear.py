"""The FP8 linear (splitspec.models.fp8_linear) against the dequantised reference (quant.dequantize_fp8, then the
product in float64): its Triton kernel in every mode, split K, token blocks and ragged tiles; the activation
quantiser of the cuBLAS path; the choice of path. On CPU through Triton's interpreter, on CUDA where there is one
(there also the cuBLAS path itself, where the GPU has DeepSeek-style block scaling)."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")
if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.fail("Triton's interpreter is off: tests/conftest.py sets TRITON_INTERPRET=1 before Triton is imported", pytrace=False)

from splitspec import quant
from splitspec.models import fp8_linear
from splitspec.models.fp8_tiles import MODE_DOT, MODE_DOT_BITS, MODE_F32, MODE_F32_BITS

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# N and K not multiples of the tiles (ragged last tile row and column), of BLOCK_N or of BLOCK_K
N, K, BLOCK = 72, 100, (16, 32)


def fp8_weight(n=N, k=K, block=BLOCK, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, s = quant.quantize_fp8(torch.randn(n, k, generator=g) / k ** 0.5, block)
    return q.to(DEVICE), s.to(DEVICE), quant.dequantize_fp8(q, s, block).double()


def tokens(t, k=K, seed=1, dtype=torch.float32):
    return (torch.randn(t, k, generator=torch.Generator().manual_seed(seed)) * 2).to(dtype).to(DEVICE)


def rel_to_terms(y, x, w) -> float:
    """max |y − x Wᵀ| / (|x| |W|ᵀ), elementwise: the error against the sum of the products' magnitudes."""
    x = x.double().cpu()
    return ((y.double().cpu() - x @ w.T).abs() / (x.abs() @ w.abs().T)).max().item()


# (mode, BLOCK_T, BLOCK_N, BLOCK_K, SPLIT_K, warps, stages), tokens. The float32 modes sum exactly the dequantised
# products up to float32 order (tolerance 1e-6 of Σ|x·w|); the dot modes round x · scale · 2⁸ to f16 once
# (relative 2⁻¹¹), so each output is within 2⁻¹⁰ of Σ|x·w| (tolerance stated with a factor 2 of slack).
CASES = [((MODE_F32, 1, 16, 32, 1, 1, 1), 3, 1e-6),
         ((MODE_F32_BITS, 1, 8, 64, 2, 1, 1), 2, 1e-6),  # 8-row blocks in 16-row tiles, K split in two
         ((MODE_DOT, 16, 16, 32, 0, 1, 1), 3, 2 ** -10),  # split chosen to fill the (interpreter's 4) SMs
         ((MODE_DOT_BITS, 16, 16, 32, 3, 1, 1), 20, 2 ** -10)]  # two token blocks, K in three


@pytest.mark.parametrize("config,t,tol", CASES, ids=[f"mode{c[0][0]}" for c in CASES])
def test_triton_linear_matches_the_dequantised_reference(config, t, tol):
    q, s, w = fp8_weight()
    x = tokens(t)
    y = fp8_linear.triton_linear(x, q, s, BLOCK, config)
    assert y.shape == (t, N) and y.dtype == torch.float32
    assert rel_to_terms(y, x, w) < tol


def test_bf16_activations_round_once_at_the_end():
    q, s, w = fp8_weight(seed=2)
    x = tokens(4, dtype=torch.bfloat16, seed=3)
    y = fp8_linear.triton_linear(x, q, s, BLOCK, (MODE_DOT, 16, 16, 32, 1, 1, 1))
    assert y.dtype == torch.bfloat16
    assert rel_to_terms(y, x, w) < 2 ** -10 + 2 ** -8  # the dot mode's rounding plus the output's bf16 rounding


@pytest.mark.parametrize("config", [(MODE_F32, 4, 16, 32, 1, 1, 1), (MODE_DOT, 8, 16, 32, 1, 1, 1),
                                    (MODE_DOT, 16, 8, 32, 1, 1, 1), (MODE_F32, 1, 32, 32, 1, 1, 1), (7, 1, 16, 32, 1, 1, 1)])
def test_configs_the_kernel_cannot_run_are_refused(config):
    q, s, _ = fp8_weight()
    with pytest.raises(ValueError, match="fp8_linear config|FP8 mode"):
        fp8_linear.triton_linear(tokens(2), q, s, BLOCK, config)


def test_activation_quantiser_groups_of_128_per_token():
    """e4m3 per token and 128 columns (ragged last group), scale = amax / 448, padding rows zero with scale 1, scales
    column-major. Values within one e4m3 step of the exact quotient (GPUs round to nearest: half a step). Triton's
    interpreter mis-rounds a value whose rounding carries into the exponent (0.4864 → 0.25, torch: 0.5): on CPU those
    (mantissa above 1.875) are left out; GPUs check them too."""
    x = tokens(5, k=300, seed=4) * 3
    x[1, 128:256] = 0  # a group of zeros: scale 1
    q, s = fp8_linear.quantize_activations(x, rows=8)
    assert q.shape == (8, 300) and q.dtype == torch.float8_e4m3fn and s.shape == (8, 3) and s.stride() == (1, 8)
    amax = torch.stack([x[:, g * 128:(g + 1) * 128].abs().amax(1) for g in range(3)], 1)
    want = torch.where(amax > 0, amax / 448, torch.ones_like(amax))
    assert torch.allclose(s[:5], want, rtol=1e-6) and torch.equal(s[5:].cpu(), torch.ones(3, 3))
    assert not q[5:].float().any()
    exact = x / s[:5].repeat_interleave(128, 1)[:, :300]
    octave = 2.0 ** exact.abs().log2().floor()
    step = torch.where(exact.abs() < 2 ** -6, torch.full_like(exact, 2 ** -9), octave / 8)
    checked = (exact.abs() <= octave * 1.875) | (exact.abs() < 2 ** -6) | (q.device.type == "cuda")
    assert checked.float().mean() > 0.9
    assert ((q[:5].float() - exact).abs() <= step * 1.0001)[checked].all()


def test_plan_follows_the_tables():
    kimi = (128, 128)
    assert fp8_linear.plan(1, 7168, 7168, kimi, True) == ("triton", fp8_linear.LINEAR_CONFIGS[1])
    assert fp8_linear.plan(16, 7168, 7168, kimi, True) == ("triton", fp8_linear.LINEAR_CONFIGS[16])
    assert fp8_linear.plan(17, 2112, 7168, kimi, True) == ("scaled_mm", None)
    assert fp8_linear.plan(256, 2112, 7168, kimi, False)[0] == "triton"  # no block scaling on this GPU
    assert fp8_linear.plan(256, 7168, 2304, kimi, True)[0] == "triton"  # 18 scale columns: not 16-byte aligned
    assert fp8_linear.plan(256, 7168, 7168, (64, 128), True)[0] == "triton"
    mode, bt, bn, *_ = fp8_linear.plan(4, 64, 64, (8, 16), False)[1]  # 8-row tiles: no 16-row dot blocks
    assert (mode, bt, bn) == (MODE_F32, 1, 8)


def test_linear_dequantises_off_the_gpu_and_passes_float_weights_through():
    q, s, w = fp8_weight()
    x = tokens(3).cpu()
    assert torch.equal(fp8_linear.linear(x, q.cpu(), s.cpu(), BLOCK), quant.linear(x, q.cpu(), s.cpu(), BLOCK))
    assert torch.equal(fp8_linear.linear(x, w.float()), x @ w.float().T)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("t", [1, 4, 16, 40])
def test_linear_on_the_gpu_at_kimi_tiles(t):
    """The engine's choice per token count on 128 × 128 tiles: Triton up to 16 tokens (bf16 in and out), cuBLAS
    block-scaled W8A8 beyond where the GPU has it (activations rounded to e4m3: relative 2⁻⁴ per element, so 2⁻³
    of Σ|x·w| at most), else Triton."""
    q, s, w = fp8_weight(n=576, k=1024, block=(128, 128), seed=5)
    x = tokens(t, k=1024, seed=6, dtype=torch.bfloat16)
    scaled = fp8_linear.scaled_mm_supported(x.device)
    how, _ = fp8_linear.plan(t, 576, 1024, (128, 128), scaled)
    y = fp8_linear.linear(x, q, s, (128, 128), scaled)
    assert y.dtype == torch.bfloat16 and y.shape == (t, 576)
    assert rel_to_terms(y, x, w) < (2 ** -3 if how == "scaled_mm" else 2 ** -10 + 2 ** -8)
