"""The skinny GEMM (splitspec.skinny) against float64 products and against rms_norm + F.linear; on CPU through
Triton's interpreter, on CUDA where there is one."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")
if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.fail("Triton's interpreter is off: tests/conftest.py sets TRITON_INTERPRET=1 before Triton is imported", pytrace=False)

from splitspec import skinny  # noqa: E402
from splitspec.layers import rms_norm  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
N, K = 37, 70  # not multiples of the blocks below
SMALL = (16, 16, 1, 1)  # 3 row blocks, 5 K-blocks


def problem(T: int, dtype: torch.dtype, seed: int = 0, stride: int | None = None):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, stride or K, generator=g)[:, :K]  # a wider row stride: a column slice of a larger output
    w = torch.randn(N, K, generator=g) / K ** 0.5
    norm = 1 + 0.1 * torch.randn(K, generator=g)
    return [t.to(dtype).to(DEVICE) for t in (x, w, norm)]


@pytest.mark.parametrize("T", [1, 2, 5, 16])
@pytest.mark.parametrize("splits", [1, 3])
def test_float32_matches_float64_products(T, splits):
    """Both token-row modes (one token element-wise; 2–16 through tl.dot), one and several K-ranges (3 ranges of
    ragged length: 2 K-blocks, 2, 1), a strided x."""
    x, w, _ = problem(T, torch.float32, stride=K + 9)
    got = skinny.linear(x, w, splits=splits, config=SMALL)
    ref = x.double() @ w.double().T
    assert got.dtype == torch.float32 and got.shape == (T, N)
    assert (got.double() - ref).abs().max().item() < 1e-5


@pytest.mark.parametrize("T", [1, 4, 9])
@pytest.mark.parametrize("splits", [1, 2])
def test_norm_is_folded_in(T, splits):
    """With ``norm``: rms_norm(x) then the product; float32 agrees to rounding, bfloat16 to bf16 products
    (the normalised x is rounded to bf16 as rms_norm rounds it)."""
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        x, w, norm = problem(T, dtype, seed=1)
        got = skinny.linear(x, w, norm, eps=1e-5, splits=splits, config=SMALL)
        ref = rms_norm(x, norm, 1e-5).double() @ w.double().T
        assert got.dtype == dtype
        assert (got.double() - ref).abs().max().item() < tol * ref.abs().max().item()


def test_bfloat16_accumulates_in_float32():
    """bf16 in, bf16 out, summed in float32: as close to the float64 product as one bf16 rounding of the result."""
    x, w, _ = problem(4, torch.bfloat16, seed=2)
    got = skinny.linear(x, w, splits=2, config=SMALL).double()
    ref = x.double() @ w.double().T
    assert ((got - ref).abs() <= ref.abs() * 2 ** -8 + 1e-6).all()


def test_rows_are_batch_invariant():
    """A token's row is the same bits alone or among others with the same token-row mode (no cross-token sums)."""
    x, w, norm = problem(4, torch.float32, seed=3)
    both = skinny.linear(x[:3], w, norm, splits=2, config=SMALL)
    assert torch.equal(both[1:2], skinny.linear(x[1:4], w, norm, splits=2, config=SMALL)[:1])


def test_default_configs_on_larger_shapes():
    """The shipped CONFIGS (BLOCK_K up to 512) and split_k's choice on a Kimi-like aspect ratio."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, 1100, generator=g).to(DEVICE)
    w = (torch.randn(48, 1100, generator=g) / 1100 ** 0.5).to(DEVICE)
    for T in (1, 2):
        assert torch.allclose(skinny.linear(x[:T], w), F.linear(x[:T], w), atol=1e-5, rtol=1e-5)


def test_split_k_targets_the_streaming_multiprocessors(monkeypatch):
    """Few row blocks → K split in powers of two up to 8, never below 2 K-blocks per range; many → no split."""
    monkeypatch.setattr(skinny, "_sm_count", lambda device: 132)
    assert skinny.split_k(2112, 7168, 16, 512, "cuda") == 2  # 132 row blocks, 264 wanted
    assert skinny.split_k(1536, 1536, 16, 128, "cuda") == 4  # 96 blocks → 384
    assert skinny.split_k(256, 7168, 16, 512, "cuda") == 4  # 14 K-blocks: 8 ranges would have < 2 each
    assert skinny.split_k(256, 16384, 16, 512, "cuda") == 8  # capped at 8
    assert skinny.split_k(256, 1024, 16, 512, "cuda") == 1  # 2 K-blocks: a split would leave < 2 per range
    assert skinny.split_k(18432, 7168, 16, 512, "cuda") == 1


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs the CPU demo engine through Triton's interpreter")
def test_drafter_step_with_skinny_gemms(engines_for):
    """The demo drafter's step (qkv, o_proj, w13 with post_attention_layernorm folded in, w2) through the skinny
    GEMMs — forced on for CPU tensors — gives the F.linear path's logits and output states."""
    from unittest.mock import patch

    from splitspec import fused_moe
    from splitspec.engine import Group
    from splitspec.models.batch import ForwardBatch, single_blocks

    group = Group(engines_for(1))
    try:
        runner = group.rank0
        m = runner.drafter
        hidden = torch.randn(3, m.cfg.hidden_size, generator=torch.Generator().manual_seed(5)).to(m.w["fc"].dtype)

        def step():
            batch = ForwardBatch.build([(single_blocks(0, 256), 0, [7, 8, 9])], "all")
            with torch.inference_mode():
                return m.forward(batch, hidden, runner.dcache)

        logits, h = step()
        calls = []
        spy = lambda *a, **kw: calls.append(1) or linear(*a, **kw)  # noqa: E731
        linear = skinny.linear
        with patch.object(fused_moe, "use_fused", lambda x: x.shape[0] <= fused_moe.MAX_TOKENS), \
                patch.object(skinny, "linear", spy):
            logits2, h2 = step()
    finally:
        group.close()
    assert len(calls) == 4
    assert (logits2 - logits).abs().max().item() < 1e-4 and (h2 - h).abs().max().item() < 1e-4
    assert torch.equal(logits2.argmax(-1), logits.argmax(-1))
