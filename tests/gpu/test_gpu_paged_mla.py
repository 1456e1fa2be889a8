"""The latent paged attention kernel (splitspec.models.paged_attention.attend_latent) on a GPU at Kimi-K2's MLA shapes
(latent 512, rope 64; 8 heads: one TP8 rank, 64: TP1) in bf16: against a float64 reference over the gathered window,
and a token's output bit-equal decoded alone and verified among others in a longer window (the target's lossless
speculation rests on it)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu  # skipped without CUDA (tests/conftest.py)

LATENT, ROPE = 512, 64


def problem(B, n, heads, S, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    rows = B * S + 7
    cache = torch.randn(rows, LATENT + ROPE, generator=g, device="cuda").bfloat16()
    table = torch.randperm(rows, generator=g, device="cuda")[: B * S].view(B, S)
    starts = torch.randint(0, S - n + 1, (B,), generator=g, device="cuda")
    pos = starts[:, None] + torch.arange(n, device="cuda")
    q = torch.randn(B, n, heads, LATENT + ROPE, generator=g, device="cuda").bfloat16()
    return q, cache, table, pos


def reference(q, cache, table, pos, scale):
    """softmax(scale · q · windowᵀ) · window[:, :latent] in float64, keys past each query's position masked."""
    w = cache[table].double()  # [B, S, latent + rope]
    s = torch.einsum("bnhd,bsd->bnhs", q.double(), w) * scale
    s.masked_fill_(torch.arange(table.shape[1], device="cuda")[None, None, None, :] > pos[:, :, None, None], float("-inf"))
    return torch.einsum("bnhs,bsd->bnhd", s.softmax(-1), w[..., :LATENT])


@pytest.mark.parametrize("B, n, heads, S", [(1, 1, 8, 256), (2, 4, 8, 4096), (16, 1, 8, 1024), (1, 6, 64, 256), (4, 2, 64, 2048)])
def test_latent_kernel_at_kimi_shapes(B, n, heads, S):
    from splitspec.models.paged_attention import attend_latent

    q, cache, table, pos = problem(B, n, heads, S)
    scale = (192) ** -0.5  # Kimi-K2's qk_head_dim 128 + 64
    out = attend_latent(q, cache, table, pos, scale, LATENT)
    # bf16 output (2⁻⁸ relative) and probabilities rounded to bf16 before the value product
    assert (out.double() - reference(q, cache, table, pos, scale)).abs().max() < 2e-2


@pytest.mark.parametrize("heads", [8, 64])
def test_a_token_gets_the_same_bits_alone_and_verified_among_others(heads):
    from splitspec.models.paged_attention import attend_latent

    q, cache, table, pos = problem(3, 6, heads, 4096, seed=1)
    pos = torch.tensor([[300 + i for i in range(6)], [100 + i for i in range(6)], [2000 + i for i in range(6)]], device="cuda")
    among = attend_latent(q, cache, table, pos, 0.07, LATENT)
    for b, i in ((1, 0), (1, 3), (0, 5), (2, 2)):
        S = 256 if pos[b, i] < 256 else 4096 if pos[b, i] >= 1024 else 1024
        alone = attend_latent(q[b:b + 1, i:i + 1].contiguous(), cache, table[b:b + 1, :S].contiguous(),
                              pos[b:b + 1, i:i + 1].contiguous(), 0.07, LATENT)
        assert torch.equal(alone[0, 0], among[b, i]), f"sequence {b}, token {i}: bits differ alone and among others"
