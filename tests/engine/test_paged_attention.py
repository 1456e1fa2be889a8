"""The paged attention kernel (splitspec.models.paged_attention) against a float64 loop over each query's visible keys
and against attend_padded over gathered windows, with and without split keys, for grouped-query and one-head caches,
single and several queries, positions at 0 and masked tails; cache rows past the last query never count, whatever they
hold; and the Llama drafter's padded forward is the same through the kernel as through attend_padded. On CPU through
Triton's interpreter, on CUDA where there is one."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

pytest.importorskip("triton")
if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.fail("Triton's interpreter is off: tests/conftest.py sets TRITON_INTERPRET=1 before Triton is imported", pytrace=False)

from splitspec.build.synthetic import kimi_k2_drafter, kimi_k2_target
from splitspec.models import paged_attention
from splitspec.models.batch import padded, single_blocks
from splitspec.models.drafter import DrafterKVCache, DrafterModel
from splitspec.models.layers import TPComm, attend_padded
from splitspec.models.shapes import drafter_shapes, random_weights

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BLOCK_N = 16  # several key blocks per share at these windows


def problem(B, n, hq, hk, S, D, dtype, seed=0, starts=None):
    """q [B, n, hq, D], K/V caches of B·S + 7 rows (tables a random permutation of them), positions [B, n] from
    ``starts`` (default random, the first sequence at 0)."""
    g = torch.Generator().manual_seed(seed)
    rows = B * S + 7
    kc, vc = (torch.randn(rows, hk, D, generator=g).to(dtype) for _ in range(2))
    table = torch.randperm(rows, generator=g)[: B * S].view(B, S)
    if starts is None:
        starts = torch.randint(0, S - n + 1, (B,), generator=g)
        starts[0] = 0
    pos = torch.as_tensor(starts)[:, None] + torch.arange(n)
    q = torch.randn(B, n, hq, D, generator=g).to(dtype)
    return [t.to(DEVICE) for t in (q, kc, vc, table, pos)]


def loop_reference(q, kc, vc, table, pos, scale) -> torch.Tensor:
    """softmax(scale · q · K[:p+1]ᵀ) · V[:p+1] per (sequence, query, head) in float64, K/V rows from the table."""
    B, n, hq, D = q.shape
    g = hq // kc.shape[1]
    out = torch.empty(B, n, hq, D, dtype=torch.float64)
    q, kc, vc, table, pos = (t.cpu() for t in (q.double(), kc.double(), vc.double(), table, pos))
    for b in range(B):
        for i in range(n):
            rows = table[b, : int(pos[b, i]) + 1]
            for h in range(hq):
                w = torch.softmax(kc[rows, h // g] @ q[b, i, h] * scale, 0)
                out[b, i, h] = w @ vc[rows, h // g]
    return out


# (B, n, hq, hk, S, D, dtype, splits): g = 1, GQA g = 4 and g = 8 with g·n > MAX_BLOCK_M (two query blocks), one
# cache head (hk = 1), n = 1, D not a power of two, split keys (3; automatic), float32 and bf16
CASES = [(2, 3, 4, 4, 40, 32, torch.float32, 1), (3, 2, 8, 2, 64, 16, torch.bfloat16, 1),
         (2, 1, 4, 1, 50, 32, torch.float32, 3), (1, 9, 8, 1, 30, 24, torch.float32, 0),
         (2, 6, 4, 4, 48, 16, torch.bfloat16, 2), (3, 1, 2, 2, 33, 16, torch.bfloat16, 0)]


@pytest.mark.parametrize("B, n, hq, hk, S, D, dtype, splits", CASES)
def test_kernel_equals_loop_and_attend_padded(B, n, hq, hk, S, D, dtype, splits):
    q, kc, vc, table, pos = problem(B, n, hq, hk, S, D, dtype)
    out = paged_attention.attend_paged(q, kc, vc, table, pos, D ** -0.5, splits=splits, block_n=BLOCK_N)
    assert out.shape == q.shape and out.dtype == dtype
    exact = loop_reference(q, kc, vc, table, pos, D ** -0.5)
    # bf16: the output's rounding (2⁻⁸ relative) and the probabilities rounded to bf16 before the value product
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert (out.cpu().double() - exact).abs().max() < tol
    gathered = attend_padded(q, kc[table], vc[table], pos, D ** -0.5)  # its scores are rounded to q's dtype too
    assert (out.float() - gathered.float()).abs().max() < (1e-5 if dtype == torch.float32 else 3e-2)


def test_rows_past_the_last_query_are_never_read():
    """NaN in every cache row no query can see (the tails of the windows, the unused rows) changes nothing, also with
    shares of the keys that start past every query (positions near 0 in a long window)."""
    B, n, hq, hk, S, D = 3, 2, 4, 2, 64, 16
    q, kc, vc, table, pos = problem(B, n, hq, hk, S, D, torch.float32, starts=[0, 1, 20])
    visible = torch.zeros(kc.shape[0], dtype=torch.bool, device=DEVICE)
    for b in range(B):
        visible[table[b, : int(pos[b, -1]) + 1]] = True
    clean = paged_attention.attend_paged(q, kc, vc, table, pos, D ** -0.5, splits=4, block_n=BLOCK_N)
    kc[~visible], vc[~visible] = float("nan"), float("nan")
    for splits in (1, 4):
        out = paged_attention.attend_paged(q, kc, vc, table, pos, D ** -0.5, splits=splits, block_n=BLOCK_N)
        assert torch.isfinite(out).all()
        assert (out.cpu().double() - loop_reference(q, kc, vc, table, pos, D ** -0.5)).abs().max() < 1e-5
        assert (out - clean).abs().max() < 1e-5


def test_bad_inputs_are_refused():
    q, kc, vc, table, pos = problem(2, 2, 4, 2, 16, 16, torch.float32)
    with pytest.raises(ValueError, match="K/V caches"):
        paged_attention.attend_paged(q, kc[:, :, :8], vc[:, :, :8], table, pos, 0.25)
    with pytest.raises(ValueError, match="one dtype"):
        paged_attention.attend_paged(q, kc.half(), vc.half(), table, pos, 0.25)
    with pytest.raises(ValueError, match="positions"):
        paged_attention.attend_paged(q, kc, vc, table, pos[:, :1], 0.25)
    with pytest.raises(ValueError, match=r"table \[2, 0\].*S ≥ 1"):  # an empty window
        paged_attention.attend_paged(q, kc, vc, table[:, :0], pos, 0.25)


def tiny_drafter(dtype: torch.dtype) -> tuple[DrafterModel, DrafterKVCache]:
    """A random Llama drafter with grouped-query attention (8 query heads over 2 K/V heads of 16), on DEVICE, and its
    cache filled with random rows (the earlier tokens' K/V)."""
    base = kimi_k2_drafter(2)
    cfg = dataclasses.replace(base, hidden_size=64, intermediate_size=96, num_attention_heads=8, num_key_value_heads=2,
                              head_dim=16, vocab_size=256, draft_vocab_size=64, target_hidden_size=64,
                              rope=dataclasses.replace(base.rope, dim=16))
    m = DrafterModel(cfg, random_weights(drafter_shapes(cfg), dtype, DEVICE, seed=1))
    cache = DrafterKVCache(cfg, 4 * 64, dtype, DEVICE)
    g = torch.Generator().manual_seed(2)
    cache.k.copy_(torch.randn(cache.k.shape, generator=g))
    cache.v.copy_(torch.randn(cache.v.shape, generator=g))
    return m, cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_drafter_padded_forward_through_the_kernel(dtype):
    """An extend (3 rows per sequence, one of them a padding sequence at position 0) and a single-token step give the
    same logits and states through the kernel as through the gathered windows."""
    m, cache = tiny_drafter(dtype)
    assert m.paged_kernel == (DEVICE == "cuda" and dtype == torch.bfloat16)  # CPU engines and float32 keep attend_padded
    blocks = [single_blocks(s, 64) for s in range(3)]
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(4 * 3, 64, generator=g).to(dtype).to(DEVICE)
    batches = [padded([(b, start, [5, 6, 7]) for b, start in zip(blocks, (0, 17, 40))], 64, DEVICE, scratch_row=255, pad_to=4),
               padded([(b, start, [9]) for b, start in zip(blocks, (3, 20, 43))], 64, DEVICE, scratch_row=255, pad_to=4)]
    results = {}
    # on a GPU in bf16 also through the compiled parts, as the engine's CUDA graphs run them (the kernel inside)
    variants = (False, True, "compiled") if m.paged_kernel else (False, True)
    for kernel in variants:
        m.paged_kernel = bool(kernel)
        if kernel == "compiled":
            m.compile()
        k0, v0 = cache.k.clone(), cache.v.clone()
        results[kernel] = [m.forward(batch, hidden[: batch.input_ids.numel()], cache) for batch in batches]
        cache.k.copy_(k0)
        cache.v.copy_(v0)
    tol = 1e-4 if dtype == torch.float32 else 0.06  # bf16: attend_padded rounds the scores to bf16, the kernel does not
    for (lg, hg), (lk, hk) in zip(results[False], results[True]):
        # the real sequences' rows (the first 3 of 4): the padding sequence's rows all write the scratch row, which of
        # them lands there last is unordered on a GPU, so what it reads back may differ between two runs
        lr, hr = 3 * lg.shape[0] // 4, 3 * hg.shape[0] // 4
        assert (lk[:lr] - lg[:lr]).abs().max() < tol and (hk[:hr].float() - hg[:hr].float()).abs().max() < tol
    for (lk, hk), (lc, hc) in zip(results[True], results.get("compiled", ())):
        lr, hr = 3 * lk.shape[0] // 4, 3 * hk.shape[0] // 4
        assert (lc[:lr] - lk[:lr]).abs().max() < 0.06 and (hc[:hr].float() - hk[:hr].float()).abs().max() < 0.06


def latent_problem(B, n, heads, S, latent, rope, dtype, seed=0, starts=None):
    """q [B, n, heads, latent + rope], one latent cache [B·S + 7, latent + rope] (the K/V "head" of absorbed MLA),
    table, positions: :func:`problem` with one cache head; the cache's K and V are then (row, row[:latent])."""
    q, kc, _, table, pos = problem(B, n, heads, 1, S, latent + rope, dtype, seed, starts)
    return q, kc[:, 0], table, pos


def latent_reference(q, cache, table, pos, scale, latent):
    """The float64 loop over (cache row, its first ``latent`` values) as K and V."""
    return loop_reference(q, cache[:, None], cache[:, None], table, pos, scale)[..., :latent]


# (B, n, heads, S, latent, rope, dtype, share keys): TP8 Kimi's 8 heads and n = 1 (one program, half its rows
# padding), 2 tokens of 8 heads in one program, 3 programs per token, one share and several (16: shares of one
# key block; 32: two blocks), bf16
LATENT_CASES = [(1, 1, 8, 40, 32, 16, torch.float32, 256), (2, 3, 8, 50, 32, 16, torch.float32, 16),
                (3, 2, 24, 64, 16, 16, torch.float32, 32), (2, 4, 8, 48, 32, 16, torch.bfloat16, 16),
                (1, 6, 4, 30, 64, 32, torch.bfloat16, 256)]


@pytest.mark.parametrize("B, n, heads, S, latent, rope, dtype, share", LATENT_CASES)
def test_latent_kernel_equals_loop_and_attend_padded(B, n, heads, S, latent, rope, dtype, share, monkeypatch):
    monkeypatch.setattr(paged_attention, "LATENT_SPLIT_KEYS", share)
    q, cache, table, pos = latent_problem(B, n, heads, S, latent, rope, dtype)
    scale = (latent + rope) ** -0.5
    out = paged_attention.attend_latent(q, cache, table, pos, scale, latent, block_n=BLOCK_N)
    assert out.shape == (B, n, heads, latent) and out.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert (out.cpu().double() - latent_reference(q, cache, table, pos, scale, latent)).abs().max() < tol
    window = cache[table][:, :, None, :]  # mla_attention's gathered form
    gathered = attend_padded(q, window, window[..., :latent], pos, scale)
    assert (out.float() - gathered.float()).abs().max() < (1e-5 if dtype == torch.float32 else 3e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_latent_kernel_gives_a_token_the_same_bits_alone_and_in_a_batch(dtype, monkeypatch):
    """A query decoded alone (B 1, n 1, the shortest window) and the same query as the 3rd token of a 4-token verify
    of the 2nd of 3 sequences, in a window twice as long split into more shares: bit-equal output (the lossless
    verify of speculative decoding needs it)."""
    monkeypatch.setattr(paged_attention, "LATENT_SPLIT_KEYS", 16)
    heads, latent, rope, S = 8, 32, 16, 32
    q, cache, table, pos = latent_problem(3, 4, heads, 2 * S, latent, rope, dtype, starts=[5, 20, 0])
    scale = (latent + rope) ** -0.5
    among = paged_attention.attend_latent(q, cache, table, pos, scale, latent, block_n=BLOCK_N)
    p = int(pos[1, 2])
    assert p < S  # the query's visible keys all lie in the short window
    alone = paged_attention.attend_latent(q[1:2, 2:3].contiguous(), cache, table[1:2, :S].contiguous(), pos[1:2, 2:3].contiguous(),
                                          scale, latent, block_n=BLOCK_N)
    assert torch.equal(alone[0, 0], among[1, 2])


def test_latent_rows_past_the_last_query_are_never_read(monkeypatch):
    monkeypatch.setattr(paged_attention, "LATENT_SPLIT_KEYS", 16)
    q, cache, table, pos = latent_problem(3, 2, 8, 64, 32, 16, torch.float32, starts=[0, 1, 20])
    visible = torch.zeros(cache.shape[0], dtype=torch.bool, device=DEVICE)
    for b in range(3):
        visible[table[b, : int(pos[b, -1]) + 1]] = True
    clean = paged_attention.attend_latent(q, cache, table, pos, 48 ** -0.5, 32, block_n=BLOCK_N)
    cache[~visible] = float("nan")
    out = paged_attention.attend_latent(q, cache, table, pos, 48 ** -0.5, 32, block_n=BLOCK_N)
    assert torch.isfinite(out).all() and torch.equal(out, clean)


def test_latent_bad_inputs_are_refused():
    q, cache, table, pos = latent_problem(2, 2, 8, 16, 32, 16, torch.float32)
    with pytest.raises(ValueError, match="latent 24 .* expected both powers of two"):
        paged_attention.attend_latent(q, cache, table, pos, 0.25, 24)
    with pytest.raises(ValueError, match=r"cache \[.*expected \[rows, 48\]"):
        paged_attention.attend_latent(q, cache[:, :40], table, pos, 0.25, 32)
    with pytest.raises(ValueError, match="positions"):
        paged_attention.attend_latent(q, cache, table, pos[:, :1], 0.25, 32)
    with pytest.raises(ValueError, match=r"rope 8, expected both powers of two ≥ 16"):  # a tensor-core product's least K
        paged_attention.attend_latent(q[..., :40].contiguous(), cache[:, :40].contiguous(), table, pos, 0.25, 32)
    assert not paged_attention.latent_fits(512, 8) and paged_attention.latent_fits(512, 64)
    with pytest.raises(ValueError, match=r"table \[2, 0\].*S ≥ 1"):  # an empty window: nothing to attend to
        paged_attention.attend_latent(q, cache, table[:, :0], pos, 0.25, 32)
    with pytest.raises(ValueError, match="integers"):
        paged_attention.attend_latent(q, cache, table.float(), pos, 0.25, 32)
    with pytest.raises(ValueError, match="bf16, fp16 or float32"):
        paged_attention.attend_latent(q.long(), cache.long(), table, pos, 0.25, 32)
    with pytest.raises(ValueError, match=r"expected \[B, n, heads"):
        paged_attention.attend_latent(q[0], cache, table, pos, 0.25, 32)
    with pytest.raises(ValueError, match="block_n 48"):
        paged_attention.attend_latent(q, cache, table, pos, 0.25, 32, block_n=48)


def test_target_layers_through_the_latent_kernel(monkeypatch):
    """A tiny Kimi-shaped target's dense and MoE layers over a padded verify (2 sequences × 3 tokens plus a padding
    sequence, windows in two key shares) give the same outputs and cache rows with ``paged_kernel`` on as through the
    gathered window."""
    from splitspec.config import Mapping
    from splitspec.models.shapes import target_shapes
    from splitspec.models.target import TargetKVCache, TargetModel

    monkeypatch.setattr(paged_attention, "LATENT_SPLIT_KEYS", 32)
    base = kimi_k2_target(2)
    cfg = dataclasses.replace(base, vocab_size=64, hidden_size=96, intermediate_size=80, moe_intermediate_size=24,
                              num_attention_heads=4, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
                              q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16,
                              rope=dataclasses.replace(base.rope, dim=16))
    model = TargetModel(cfg, Mapping(1), 0, random_weights(target_shapes(cfg, Mapping(1)), torch.float32, DEVICE, seed=0), TPComm())
    assert model.paged_kernel is False  # float32: the gathered window, unless switched on as here
    cache = TargetKVCache(cfg, 4 * 64, torch.float32, DEVICE)
    cache.kv.copy_(torch.randn(cache.kv.shape, generator=torch.Generator().manual_seed(4)))
    batch = padded([(single_blocks(s, 64), start, [1, 2, 3]) for s, start in zip(range(2), (7, 40))], 64, DEVICE,
                   scratch_row=255, pad_to=3)
    cos, sin = model.rotary.cos_sin(batch.positions)
    g = torch.Generator().manual_seed(5)
    h, pending = (torch.randn(9, 96, generator=g).to(DEVICE) for _ in range(2))
    results = {}
    for on in (False, True):
        model.paged_kernel = on
        kv0 = cache.kv.clone()
        results[on] = ([model.block(layer, h, pending, batch, cache, cos, sin) for layer in (0, 1)], cache.kv.clone())
        cache.kv.copy_(kv0)
    (off, kv_off), (on, kv_on) = results[False], results[True]
    assert torch.equal(kv_on[:200], kv_off[:200])  # the rows written (the scratch row aside)
    for (h_off, out_off), (h_on, out_on) in zip(off, on):
        assert (h_on[:6] - h_off[:6]).abs().max() < 1e-4 and (out_on[:6] - out_off[:6]).abs().max() < 1e-4
