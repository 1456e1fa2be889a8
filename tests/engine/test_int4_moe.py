"""The W4A16 MoE kernels (splitspec.models.int4_moe) against the experts computed in float64 from weights dequantised
by hand here, and against the float fused kernels on quant.dequantize_int4's weights; on CPU through Triton's
interpreter, on CUDA where there is one."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")
if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.fail("Triton's interpreter is off: tests/conftest.py sets TRITON_INTERPRET=1 before Triton is imported", pytrace=False)

from splitspec import quant
from splitspec.models import fused_moe, int4_moe

# H and I multiples of the group (as the format requires) but not of the row blocks; several K steps; pairs of
# another rank (-1 and E).
T, H, I, E, TOP_K, G = 3, 96, 64, 5, 3, 32
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SMALL = (16, 32, 1, 1)  # (BLOCK_N, BLOCK_K, warps, stages): 3 K steps over H, 2 over I; 2 row blocks of I, 6 of H


def by_hand(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float64 [..., N, K]: column 8w + j of row n = (((packed[n, w] >> 4j) & 15) − 8) · scale[n, (8w + j) // G],
    one Python integer at a time (no library unpacking)."""
    p, s = packed.reshape(-1, packed.shape[-1]).tolist(), scale.double().reshape(-1, scale.shape[-1])
    out = torch.zeros(len(p), packed.shape[-1] * 8, dtype=torch.float64)
    for n, row in enumerate(p):
        for w, word in enumerate(row):
            word &= 0xFFFFFFFF
            for j in range(8):
                out[n, 8 * w + j] = (((word >> (4 * j)) & 15) - 8) * s[n, (8 * w + j) // G]
    return out.reshape(*packed.shape[:-1], -1)


def problem(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    local = torch.tensor([[0, 4, 2], [-1, 1, 4], [3, 5, 0]])
    weights = torch.rand(T, TOP_K, generator=g)
    w13 = torch.randn(E, 2 * I, H, generator=g) / H ** 0.5
    w2 = torch.randn(E, H, I, generator=g) / I ** 0.5
    q13 = [quant.quantize_int4(w13[e], G) for e in range(E)]
    q2 = [quant.quantize_int4(w2[e], G) for e in range(E)]
    stack = lambda qs, i: torch.stack([q[i] for q in qs])  # noqa: E731
    return x, local, weights, stack(q13, 0), stack(q13, 1), stack(q2, 0), stack(q2, 1)


def reference(x, local, weights, w13, w2) -> torch.Tensor:
    x = x.double()
    y = torch.zeros_like(x)
    for t in range(T):
        for j in range(TOP_K):
            e = int(local[t, j])
            if 0 <= e < E:
                gate, up = (w13[e] @ x[t]).chunk(2)
                y[t] += float(weights[t, j]) * (w2[e] @ (F.silu(gate) * up))
    return y


@pytest.mark.parametrize("config", [SMALL, None], ids=["small-blocks", "default-blocks"])
def test_int4_experts_match_hand_dequantised_float64(config):
    x, local, weights, p13, s13, p2, s2 = problem()
    ref = reference(x, local, weights, by_hand(p13, s13), by_hand(p2, s2))
    dev = [t.to(DEVICE) for t in (x, local, weights, p13, s13, p2, s2)]
    out = int4_moe.int4_experts(*dev, group=G, gate_up_config=config, down_config=config).cpu()
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), ref, rtol=2e-2, atol=2e-2)  # bf16 output rounding
    assert out[1].abs().sum() > 0 and (ref[1] != 0).any()  # the token with another rank's pair still has its own


def test_int4_experts_equal_the_float_kernels_on_dequantised_weights():
    x, local, weights, p13, s13, p2, s2 = problem(seed=1)
    x = x.float()
    w13 = torch.stack([quant.dequantize_int4(p13[e], s13[e], H, G, torch.float32) for e in range(E)])
    w2 = torch.stack([quant.dequantize_int4(p2[e], s2[e], I, G, torch.float32) for e in range(E)])
    dev = lambda *ts: [t.to(DEVICE) for t in ts]  # noqa: E731
    want = fused_moe.fused_experts(*dev(x, local, weights, w13, w2)).cpu()
    got = int4_moe.int4_experts(*dev(x, local, weights, p13, s13, p2, s2), group=G, gate_up_config=SMALL,
                                down_config=SMALL).cpu()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # float32 both: only the order of the sums differs


def test_nibble_order_known_value():
    """Word 0x76543210 holds nibbles 0..7 for columns 0..7 (low bits first): values −8..−1, in the hand reference
    the kernel tests compare with and in the library's unpacking."""
    word = 0x76543210
    packed = torch.full((1, 2, 1), word, dtype=torch.int32)
    vals = by_hand(packed[0], torch.ones(2, 1))[0, :8]
    assert vals.tolist() == [-8, -7, -6, -5, -4, -3, -2, -1]
    assert (quant.unpack_int4(packed[0], 8)[0].tolist()) == [-8, -7, -6, -5, -4, -3, -2, -1]


def test_bad_shapes_name_the_tensor():
    _, _, _, p13, s13, p2, s2 = problem()
    assert int4_moe.check_int4_experts(p13, s13, p2, s2, H, G) == (E, I)
    with pytest.raises(ValueError, match=r"w2_scale has shape \[5, 96, 1\], expected \[5, 96, 2\]"):
        int4_moe.check_int4_experts(p13, s13, p2, s2[..., :1], H, G)
    with pytest.raises(ValueError, match="group size 12 must be a multiple of 8"):
        int4_moe.check_int4_experts(p13, s13, p2, s2, H, 12)
    with pytest.raises(ValueError, match="packed weights must be int32"):
        int4_moe.check_int4_experts(p13.float(), s13, p2, s2, H, G)
    x, local, weights = problem()[:3]
    with pytest.raises(ValueError, match="BLOCK_K 48 must be a multiple of the group size 32"):
        int4_moe.int4_experts(x, local, weights, p13, s13, p2, s2, group=G, gate_up_config=(16, 48, 1, 1))
