"""W8A8 FP8 MoE kernels (splitspec.models.fp8_moe_w8a8, fp8_tiles.MODE_W8A8): the activation quantiser against
torch's own e4m3 cast, and both kernels against a float64 loop that quantises the activations by the formula of the
module docstring; on CPU through Triton's interpreter, on CUDA where there is one."""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.nn.functional as F

triton = pytest.importorskip("triton")
if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.fail("Triton's interpreter is off: tests/conftest.py sets TRITON_INTERPRET=1 before Triton is imported", pytrace=False)

import triton.language as tl  # noqa: E402

from splitspec import quant  # noqa: E402
from splitspec.models import fused_moe  # noqa: E402
from splitspec.models.fp8_tiles import MODE_W8A8, pow2_scale, round_e4m3  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
T, H, E, TOP_K = 3, 80, 5, 3  # H: 2 whole tile columns of 32 and a ragged 16
I, I_S, BLOCK = 32, 16, (16, 32)  # tiles of 16 rows × 32 columns: I and I_s whole tile rows
W8A8 = (16, 32, 4, 2, MODE_W8A8)


@triton.jit
def _round_kernel(v_ptr, r_ptr, p_ptr, n, BLOCK_V: tl.constexpr):
    i = tl.program_id(0) * BLOCK_V + tl.arange(0, BLOCK_V)
    v = tl.load(v_ptr + i, mask=i < n, other=0.0)
    tl.store(r_ptr + i, round_e4m3(v), mask=i < n)
    p, inv = pow2_scale(tl.abs(v))
    tl.store(p_ptr + 2 * i, p, mask=i < n)
    tl.store(p_ptr + 2 * i + 1, inv, mask=i < n)


def _kernel_round(v: torch.Tensor):
    r, p = torch.empty_like(v), torch.empty(2 * v.numel(), device=v.device)
    _round_kernel[(triton.cdiv(v.numel(), 256),)](v, r, p, v.numel(), BLOCK_V=256)
    return r, p[0::2], p[1::2]


def test_round_e4m3_is_torchs_cast():
    """Every e4m3 value, every midpoint between neighbours (ties: to even), values just beside each midpoint and
    random ones in [−448, 448] round to what torch's float32 → float8_e4m3fn cast gives."""
    grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[grid.isfinite()].unique()
    mids = (grid[1:] + grid[:-1]) / 2
    g = torch.Generator().manual_seed(0)
    v = torch.cat((grid, mids, mids.nextafter(torch.tensor(math.inf)), mids.nextafter(torch.tensor(-math.inf)),
                   torch.rand(4096, generator=g) * 896 - 448, torch.randn(4096, generator=g) * 2 ** -8)).to(DEVICE)
    r, _, _ = _kernel_round(v)
    assert torch.equal(r, v.to(torch.float8_e4m3fn).float())
    assert torch.equal(r.to(torch.float8_e4m3fn).float(), r)  # on the grid: the cast is exact


def test_pow2_scale_is_the_smallest_power_of_two_under_448():
    """p is the smallest power of two ≥ 2⁻¹²⁶ with amax / p ≤ 448 (float64 reference); 1/p its exact inverse."""
    g = torch.Generator().manual_seed(1)
    e = torch.arange(-30, 30, dtype=torch.float64)
    amax = torch.cat((torch.tensor([0.0, 1e-45, 2.0 ** -130, 448.0, 1.0]), 1.75 * 2 ** e, (1.75 * 2 ** e).nextafter(e.new_tensor(math.inf)),
                      torch.rand(1000, generator=g, dtype=torch.float64) * 2 ** torch.randint(-40, 40, (1000,), generator=g)))
    amax = amax.float()
    _, p, inv = _kernel_round(amax.to(DEVICE))
    a = amax.double()
    want = torch.exp2(torch.ceil(torch.log2(a / 448)).clamp_min(-126)).where(a > 0, torch.tensor(2.0 ** -126, dtype=torch.float64))
    assert torch.equal(p.double().cpu(), want)
    assert torch.equal((p.double() * inv.double()).cpu(), torch.ones_like(want))


def _quantised(v: torch.Tensor, cols: int) -> torch.Tensor:
    """v [..., K] float64 with each group of ``cols`` columns replaced by p · rne_e4m3(v / p), p the group's power-of-two
    scale (the module docstring's formula, computed here in float64 with torch's cast)."""
    out = v.clone()
    for k0 in range(0, v.shape[-1], cols):
        g = v[..., k0:k0 + cols]
        amax = g.abs().amax(-1, keepdim=True)
        p = torch.exp2(torch.ceil(torch.log2(amax / 448)).clamp_min(-126)).where(amax > 0, torch.full_like(amax, 2.0 ** -126))
        out[..., k0:k0 + cols] = (g / p).float().to(torch.float8_e4m3fn).double() * p
    return out


def _reference(x, local, weights, dense, quantise_gate_up: bool, quantise_down: bool) -> torch.Tensor:
    """The fused experts in float64 over the dequantised weights, the activations of each kernel in W8A8 form
    quantised per tile column (or not)."""
    w13, w2, s13, s2 = (d.double().cpu() for d in dense)
    x = x.double().cpu()
    y = torch.zeros_like(x)

    def expert(xt, a13, a2, weight):
        gate, up = (a13 @ (_quantised(xt, BLOCK[1]) if quantise_gate_up else xt)).chunk(2)
        act = F.silu(gate) * up
        return weight * (a2 @ (_quantised(act, BLOCK[1]) if quantise_down else act))

    for t in range(x.shape[0]):
        for j in range(local.shape[1]):
            e = int(local[t, j])
            if 0 <= e < w13.shape[0]:
                y[t] += expert(x[t], w13[e], w2[e], float(weights[t, j]))
        y[t] += expert(x[t], s13, s2, 1.0)
    return y


def _problem(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(T, H, generator=g) * torch.rand(1, H, generator=g) * 4).to(DEVICE)  # columns of unequal size
    local = torch.tensor([[0, 4, 2], [-1, 1, 4], [3, 5, 0]]).to(DEVICE)  # -1 and 5 = E: another rank's experts
    weights = torch.rand(T, TOP_K, generator=g).to(DEVICE)
    tensors = [torch.randn(E, 2 * I, H, generator=g) / H ** 0.5, torch.randn(E, H, I, generator=g) / I ** 0.5,
               torch.randn(2 * I_S, H, generator=g) / H ** 0.5, torch.randn(H, I_S, generator=g) / I_S ** 0.5]
    q, s = zip(*(quant.quantize_fp8(t.to(DEVICE), BLOCK) for t in tensors))
    dense = [quant.dequantize_fp8(a, b, BLOCK) for a, b in zip(q, s)]
    return x, local, weights, list(q), list(s), dense


@pytest.mark.parametrize("gate_up,down", [(W8A8, W8A8), (W8A8, (16, 32, 4, 2, 0)), ((16, 32, 4, 2, 0), W8A8),
                                          (W8A8, (*W8A8, 2)), ((16, 32, 4, 2, 0), (*W8A8, 3))])
def test_w8a8_kernels_match_the_quantised_loop(gate_up, down):
    """Either kernel in W8A8 form (the other in float32 form; down's 3 routed slots + the shared expert whole or
    split over 2 or 3 programs, the last with nothing to do) equals the float64 loop that quantises that kernel's
    activations as the module docstring says, to float32 sums' accuracy; the unquantised loop differs by e4m3's
    rounding of the activations (each by up to 2⁻⁴ of itself: more than that accuracy, under 2⁻³ of the output)."""
    x, local, weights, q, s, dense = _problem()
    out = fused_moe.fused_experts(x, local, weights, *q, scales=s, fp8_block=BLOCK, gate_up_config=gate_up,
                                  down_config=down).double().cpu()
    ref = _reference(x, local, weights, dense, gate_up[4] == MODE_W8A8, down[4] == MODE_W8A8)
    exact = _reference(x, local, weights, dense, False, False)
    scale = ref.abs().max().item()
    assert (out - ref).abs().max().item() < 1e-5 * scale
    assert 1e-4 * scale < (out - exact).abs().max().item() < 2 ** -3 * scale


@pytest.mark.parametrize("gate_up,down,modes,quantised", [
    ((16, 64, 4, 2, MODE_W8A8), W8A8, [0, MODE_W8A8], (False, True)),  # a K step of two tile columns
    ((16, 32, 4, 2, 0, 2), W8A8, [0, 0], (False, False)),  # gate/up's split partial sums need a float-mode down
    ((*W8A8, 2), W8A8, [MODE_W8A8, MODE_W8A8], (True, True))])  # no split of H in w8a8
def test_w8a8_falls_back_where_it_cannot_run(monkeypatch, gate_up, down, modes, quantised):
    """Where w8a8 cannot run, the float32 mode does (the engine's defaults meet checkpoints of any tile shape and
    every sweep combination): a K step other than the tile's columns, a down behind gate/up's split of H; a w8a8
    gate/up ignores a split."""
    x, local, weights, q, s, dense = _problem()
    seen = []
    pick = fused_moe.mode_for
    monkeypatch.setattr(fused_moe, "mode_for", lambda *a: seen.append(pick(*a)) or seen[-1])
    out = fused_moe.fused_experts(x, local, weights, *q, scales=s, fp8_block=BLOCK, gate_up_config=gate_up,
                                  down_config=down).double().cpu()
    assert seen[0] == modes[0]
    ref = _reference(x, local, weights, dense, *quantised)
    assert (out - ref).abs().max().item() < 1e-5 * ref.abs().max().item()


def test_shipped_configs_keep_one_activation_form_per_shard():
    """Each kernel quantises its activations (w8a8) for one token exactly when it does for many, on either shard
    class: a verify and a one-token decode of the same token then differ only in the order of float32 sums."""
    for width in ("wide", "narrow"):
        for kernel in (0, 1):
            forms = {fused_moe.FP8_CONFIGS[(cls, width)][kernel][4] == MODE_W8A8 for cls in ("one", "many")}
            assert len(forms) == 1, (width, kernel)
