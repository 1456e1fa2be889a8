"""The skinny-GEMM kernel on the GPU: its products at Kimi-K2's TP8-shard shapes against cuBLAS for 1–8 tokens with the
shipped configurations, and the TP8 shard's dense and MoE layers (random bf16 weights, compiled layer halves replayed
from a CUDA graph, as the engine runs them) with ``skinny_gemm`` on against the same halves off, each half on the same
inputs (so that the MoE layer routes to the same experts); whether a token's product is the same bits alone and among
2–8 tokens (cuBLAS: yes; the kernel: not yet, which keeps it off by default)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.gpu  # skipped without CUDA (tests/conftest.py)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return (got.float() - want.float()).abs().max().item() / want.float().abs().max().item()


@pytest.mark.parametrize("N, K", [(4608, 7168), (2112, 7168), (7168, 2304), (7168, 1024), (1536, 1536)])
def test_products_match_cublas(N, K):
    from splitspec.models import skinny_gemm

    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16, generator=g) * K ** -0.5
    norm = torch.rand(K, device="cuda", dtype=torch.bfloat16, generator=g) + 0.5
    for T in range(1, skinny_gemm.MAX_TOKENS + 1):
        x, r = (torch.randn(T, K, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
        assert rel_err(skinny_gemm.linear(x, w), F.linear(x, w)) < 0.02, T
        y, h = skinny_gemm.norm_linear(x, r, norm, w, 1e-6)
        assert torch.equal(h, x + r), T
        s = (x + r).float()
        ref = F.linear((s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6) * norm.float()).bfloat16(), w)
        assert rel_err(y, ref) < 0.02, T
        gu = torch.randn(T, 2 * K, device="cuda", dtype=torch.bfloat16, generator=g)
        gate, up = gu.chunk(2, -1)
        assert rel_err(skinny_gemm.linear(gu, w, act=True), F.linear(F.silu(gate) * up, w)) < 0.02, T


SHAPES_TP8 = [(4608, 7168), (2112, 7168), (7168, 2304), (7168, 1024)]  # w13, fused_qkv_a, w2, o_proj of a TP8 shard


def _alone_vs_among(product, N: int, K: int) -> list[int]:
    """For T = 2 … 8: how many outputs of tokens 0 … T − 1 differ, bit for bit, between ``product`` of each token
    alone (a one-token decode) and of the T tokens together (a verify of T tokens)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16, generator=g) * K ** -0.5
    x = torch.randn(8, K, device="cuda", dtype=torch.bfloat16, generator=g)
    alone = torch.cat([product(x[i:i + 1], w) for i in range(8)])
    return [int((product(x[:T], w) != alone[:T]).sum()) for T in range(2, 9)]


@pytest.mark.parametrize("N, K", SHAPES_TP8)
def test_cublas_gives_a_token_the_same_bits_alone_and_among_eight(N, K):
    """Greedy speculation equals target-only greedy in bf16 only because a verify's product of each token is bit for
    bit the one-token decode's: true of cuBLAS at the engine's shapes for 1–8 tokens on the GPUs measured (an H200),
    and checked here, since a library or GPU where it is not would make the engine's exactness tests flaky."""
    assert _alone_vs_among(F.linear, N, K) == [0] * 7


@pytest.mark.xfail(strict=True, reason="known: the kernel's one-token form (float32 multiply-add) and its 2–8-token "
                   "form (tensor-core dot) sum in different orders, so skinny_gemm is off by default (docs/architecture.md)")
@pytest.mark.parametrize("N, K", SHAPES_TP8)
def test_skinny_kernel_gives_a_token_the_same_bits_alone_and_among_eight(N, K):
    """What ``skinny_gemm`` needs before it can be lossless in bf16 (the cuBLAS test above); fails today (on an H200,
    2–11 of one token's 1024–7168 outputs differ at these shapes), strict so that a fix shows."""
    from splitspec.models import skinny_gemm

    assert _alone_vs_among(skinny_gemm.linear, N, K) == [0] * 7


def test_tp8_layers_on_match_off(monkeypatch):
    from lab.gpu_kernels import capture_graph

    from splitspec.build.synthetic import kimi_k2_target
    from splitspec.config import Mapping
    from splitspec.models import skinny_gemm
    from splitspec.models.batch import padded
    from splitspec.models.layers import TPComm
    from splitspec.models.shapes import random_weights, target_shapes
    from splitspec.models.target import TargetKVCache, TargetModel

    torch.manual_seed(0)  # the layers' inputs: one unseeded run measured 0.0203 against the bar below
    cfg, S = kimi_k2_target(2), 256
    w = random_weights(target_shapes(cfg, Mapping(8)), torch.bfloat16, "cuda", seed=0)
    model = TargetModel(cfg, Mapping(8), 0, w, TPComm())
    model.compile()
    cache = TargetKVCache(cfg, 4 * S + 16, torch.bfloat16, "cuda")
    calls = []
    launch = skinny_gemm.launch
    monkeypatch.setattr(skinny_gemm, "launch", lambda *a, **kw: calls.append(1) or launch(*a, **kw))
    for n in (1, 4):
        batch = padded([(list(range(16)), 100, [1] * n)], S, "cuda", scratch_row=4 * S)
        cos, sin = model.rotary.cos_sin(batch.positions)
        h = torch.randn(n, 7168, device="cuda", dtype=torch.bfloat16)
        pend = torch.randn_like(h)
        attention, mlp = model.fast
        for layer in (0, 1):
            lw, moe = model.layer_w[layer], cfg.is_moe_layer(layer)
            halves = {"attention": lambda: attention(model, lw, h, pend if layer else None, batch, cache.kv[layer], cos, sin),
                      "mlp": lambda: mlp(model, lw, moe, h, pend)}  # the same inputs on and off: the same experts
            for name, half in halves.items():
                out = {}
                for on in (False, True):
                    model.skinny_gemm = on
                    res = []
                    capture_graph(lambda: res.append(half())).replay()
                    torch.cuda.synchronize()
                    out[on] = res[-1]
                for a, b in zip(out[True], out[False]):
                    assert rel_err(a, b) < 0.02, (n, layer, name)
    assert calls, "the skinny-GEMM kernel should serve the layers' products"
