"""Routed experts as grouped GEMMs: the MoE path for batches past the fused decode kernels' limit
(:data:`splitspec.models.fused_moe.MAX_TOKENS`), and on CPU; for INT4-kept experts, W4A16 grouped kernels
(:func:`int4_grouped_experts`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from splitspec.models import int4_moe, int4_tiles
from splitspec.models.fused_moe import available, jit, on_device, tl, triton


def grouped_experts(x: torch.Tensor, local: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """Routed experts of this rank as two grouped GEMMs (``torch._grouped_mm``), with no host synchronisation.

    x: [T, H]; local: [T, top_k] expert ids relative to this rank's first expert (outside [0, E_local) = another
    rank's); weights: [T, top_k] float32; w13: [E_local, 2·I, H]; w2: [E_local, H, I]. Returns [T, H], the
    weighted sum over this rank's chosen experts. (token, expert) pairs are sorted by expert; each group
    multiplies only its own expert's weights, so only activated experts are read. Where the grouped GEMM is not
    available: :func:`pairs_gathered` on a GPU (no host synchronisation), :func:`pairs_by_expert` on the CPU.
    """
    T, K = local.shape
    E = w13.shape[0]
    mine = (local >= 0) & (local < E)
    if x.is_cuda and x.dtype == torch.float32:  # CUDA grouped GEMM is bf16-only: every expert over every token, masked
        gate_w = torch.zeros(T, E + 1, dtype=x.dtype, device=x.device).scatter_add_(
            1, torch.where(mine, local, E).long(), torch.where(mine, weights, 0.0).to(x.dtype))[:, :E]
        h = torch.einsum("th,eih->eti", x, w13)
        gate, up = h.chunk(2, dim=-1)
        return torch.einsum("eti,ehi,te->th", F.silu(gate) * up, w2, gate_w)
    flat = torch.where(mine, local, E).flatten().long()  # another rank's pairs sort last, past every group
    order = flat.argsort(stable=True)
    counts = torch.zeros(E + 1, dtype=torch.int64, device=x.device).scatter_add_(0, flat, torch.ones_like(flat))
    offs = counts[:E].cumsum(0).to(torch.int32)  # (bincount would synchronise with the host on CUDA)
    tok = order // K
    out = None
    if x.dtype == torch.bfloat16:  # the grouped GEMM's only dtype
        try:
            h = torch._grouped_mm(x[tok], w13.transpose(1, 2), offs=offs)
            gate, up = h.chunk(2, dim=-1)
            out = torch._grouped_mm((F.silu(gate) * up).contiguous(), w2.transpose(1, 2), offs=offs)
        except RuntimeError:  # not on this device
            out = None
    if out is None:
        # on the CPU a host synchronisation costs nothing (but would break a torch.compile'd graph in two)
        by_expert = x.device.type == "cpu" and not torch.compiler.is_compiling()
        out = (pairs_by_expert if by_expert else pairs_gathered)(x[tok], flat[order], counts[:E], w13, w2)
    scale = torch.where(mine.flatten()[order], weights.flatten()[order], 0.0).to(x.dtype)[:, None]
    out = torch.where(scale != 0, out * scale, 0.0)  # rows past the last group are undefined
    return torch.zeros_like(x).index_add_(0, tok, out)


def pairs_gathered(xs: torch.Tensor, experts: torch.Tensor, counts: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """The SwiGLU of each (token, expert) pair with its expert's weights gathered per pair (read once per pair, not per
    expert), without a host synchronisation. xs: [P, H] the pairs' tokens sorted by expert; experts: [P] their
    expert ids (E_local for another rank's); counts: [E_local] pairs per expert (unused: the signature of
    :func:`pairs_by_expert`). Returns [P, H]; rows of another rank's pairs hold the last expert's output."""
    e = experts.clamp(max=w13.shape[0] - 1)
    h = torch.bmm(w13[e], xs[:, :, None])[:, :, 0]
    gate, up = h.chunk(2, dim=-1)
    return torch.bmm(w2[e], (F.silu(gate) * up)[:, :, None])[:, :, 0]


def pairs_by_expert(xs: torch.Tensor, experts: torch.Tensor, counts: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """:func:`pairs_gathered`'s result (same arguments) by two GEMMs per expert over its own pairs, each expert's
    weights read once; reads ``counts`` on the host. Rows of another rank's pairs are undefined."""
    out = torch.empty_like(xs)
    start = 0
    for e, n in enumerate(counts.tolist()):
        if n:
            gate, up = F.linear(xs[start:start + n], w13[e]).chunk(2, dim=-1)
            out[start:start + n] = F.linear(F.silu(gate) * up, w2[e])
            start += n
    return out


# W4A16 grouped kernels: INT4 experts (layout of splitspec.models.int4_moe) for batches past the decode kernels. The
# (token, slot) pairs are sorted by expert and cut into blocks of at most BLOCK_M pairs of one expert
# (:func:`expert_blocks`); a program multiplies one block by one block of its expert's rows, the INT4 tile unpacked
# in registers as ``int4_moe``'s tensor-core variants do (nibble position j against the activations at columns
# 4w + j), the block's tokens as the right operand. Each expert's weights are read once per block of its pairs.

GROUPED_VARIANTS = ("grouped", "grouped_asm")  # unpack in Triton bit operations / in PTX (int4_tiles.dequant's MODE 1 / 2)


def expert_blocks(local: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, ...]:
    """Blocks of pairs by expert, without a host synchronisation: (order [P] int32: pair indices t·top_k + slot sorted
    by expert; expert [NB] int32, first [NB] int32 (into ``order``), count [NB] int32 of each block; expert −1 for
    the blocks past the last). NB = ⌈P / block_m⌉ + min(E, P) bounds the blocks; pairs of another rank (ids outside
    [0, E)) are in none."""
    E, P = num_experts, local.numel()
    dev = local.device
    flat = torch.where((local >= 0) & (local < E), local, E).flatten().long()
    order = flat.argsort(stable=True)
    counts = torch.zeros(E + 1, dtype=torch.int64, device=dev).scatter_add_(0, flat, torch.ones_like(flat))[:E]
    nblk = (counts + block_m - 1) // block_m
    end = nblk.cumsum(0)
    b = torch.arange(-(-P // block_m) + min(E, P), device=dev)
    e = torch.searchsorted(end, b, right=True)
    ec = e.clamp(max=E - 1)
    i = b - (end[ec] - nblk[ec])  # the block's index among its expert's
    first = counts.cumsum(0)[ec] - counts[ec] + i * block_m
    count = (counts[ec] - i * block_m).clamp(max=block_m)
    return order.int(), torch.where(e < E, e, -1).int(), first.int(), count.int()


@jit
def block_pairs(order_ptr, bfirst_ptr, bcount_ptr, b, BLOCK_M: tl.constexpr):
    """(pair indices [BLOCK_M] int64, mask) of block b."""
    m = tl.arange(0, BLOCK_M)
    mask = m < tl.load(bcount_ptr + b)
    return tl.load(order_ptr + tl.load(bfirst_ptr + b) + m, mask=mask, other=0).to(tl.int64), mask


@jit
def _gate_up_grouped(xp_ptr, order_ptr, bexp_ptr, bfirst_ptr, bcount_ptr, p_ptr, s_ptr, act_ptr, H, I, top_k, stride_pe,
                     stride_pn, stride_se, stride_sn, G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, MODE: tl.constexpr):
    """act [P, I] (bf16; float32 under the interpreter) at the permuted column (n % 4)·(I/4) + n // 4; xp [T, H]: x at column j·(H/4) + w for 4w + j."""
    b = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    e = tl.load(bexp_ptr + b).to(tl.int64)
    if e >= 0:
        pair, pm = block_pairs(order_ptr, bfirst_ptr, bcount_ptr, b, BLOCK_M)
        x_cols = xp_ptr + (pair // top_k)[None, :] * H
        packed, scales = p_ptr + e * stride_pe, s_ptr + e * stride_se
        acc_g = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            vg, sg = int4_tiles.weight_tile(packed, scales, n, n < I, k0, H, stride_pn, stride_sn, G, BLOCK_N, BLOCK_K,
                                          EVEN_K)
            vu, su = int4_tiles.weight_tile(packed, scales, n + I, n < I, k0, H, stride_pn, stride_sn, G, BLOCK_N, BLOCK_K,
                                          EVEN_K)
            w = k0 // 4 + tl.arange(0, BLOCK_K // 4)
            kmask = int4_tiles.k_mask(w, H, EVEN_K)
            for j in tl.static_range(4):
                xb = tl.load(x_cols + j * (H // 4) + w[:, None], mask=kmask[:, None] & pm[None, :], other=0.0)
                xb = int4_tiles.operand(xb, MODE)
                acc_g = tl.dot(int4_tiles.dequant(vg, sg, j, MODE), xb, acc_g)
                acc_u = tl.dot(int4_tiles.dequant(vu, su, j, MODE), xb, acc_u)
        act = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
        col = (n % 4) * (I // 4) + n // 4
        tl.store(act_ptr + pair[None, :] * I + col[:, None], act.to(act_ptr.dtype.element_ty),
                 mask=(n < I)[:, None] & pm[None, :])


@jit
def _down_grouped(act_ptr, order_ptr, bexp_ptr, bfirst_ptr, bcount_ptr, wt_ptr, p_ptr, s_ptr, out_ptr, H, I, stride_pe,
                  stride_pn, stride_se, stride_sn, G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, MODE: tl.constexpr):
    """out [P, H] float32: each pair's routing weight · W2[e] act, at row t·top_k + slot."""
    b = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    e = tl.load(bexp_ptr + b).to(tl.int64)
    if e >= 0:
        pair, pm = block_pairs(order_ptr, bfirst_ptr, bcount_ptr, b, BLOCK_M)
        packed, scales = p_ptr + e * stride_pe, s_ptr + e * stride_se
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        for k0 in range(0, I, BLOCK_K):
            v, sc = int4_tiles.weight_tile(packed, scales, n, n < H, k0, I, stride_pn, stride_sn, G, BLOCK_N, BLOCK_K,
                                         EVEN_K)
            w = k0 // 4 + tl.arange(0, BLOCK_K // 4)
            kmask = int4_tiles.k_mask(w, I, EVEN_K)
            for j in tl.static_range(4):
                ab = tl.load(act_ptr + pair[None, :] * I + j * (I // 4) + w[:, None], mask=kmask[:, None] & pm[None, :],
                             other=0.0)
                acc = tl.dot(int4_tiles.dequant(v, sc, j, MODE), int4_tiles.operand(ab, MODE), acc)
        wt = tl.load(wt_ptr + pair, mask=pm, other=0.0)
        tl.store(out_ptr + pair[None, :] * H + n[:, None], acc * wt[None, :], mask=(n < H)[:, None] & pm[None, :])


@torch.library.custom_op("splitspec::int4_grouped_experts", mutates_args=())
def _int4_grouped_op(x: torch.Tensor, local: torch.Tensor, weights: torch.Tensor, w13_packed: torch.Tensor,
                     w13_scale: torch.Tensor, w2_packed: torch.Tensor, w2_scale: torch.Tensor, group: int, variant: str,
                     gate_up_config: list[int], down_config: list[int]) -> torch.Tensor:
    with on_device(x):
        T, H = x.shape
        top_k, P = local.shape[1], local.numel()
        E, I = w13_packed.shape[0], w13_packed.shape[1] // 2
        mode = int4_tiles.unpack_mode(variant, x)
        xp = x.to(torch.bfloat16).reshape(T, H // 4, 4).transpose(1, 2).contiguous()
        q13, q2 = w13_packed.contiguous().view(torch.int16), w2_packed.contiguous().view(torch.int16)
        s13, s2, wts = w13_scale.contiguous(), w2_scale.contiguous(), weights.to(torch.float32).contiguous()
        (gm, gn, gk, gw, gs), (dm, dn, dk, dw, ds) = gate_up_config, down_config
        act = torch.empty(P, I, dtype=torch.bfloat16 if mode else torch.float32, device=x.device)
        blocks = expert_blocks(local, E, gm)
        gk, dk = min(gk, triton.next_power_of_2(H)), min(dk, triton.next_power_of_2(I))
        _gate_up_grouped[(blocks[1].shape[0], triton.cdiv(I, gn))](
            xp, *blocks, q13, s13, act, H, I, top_k, q13.stride(0), q13.stride(1), s13.stride(0), s13.stride(1), G=group,
            BLOCK_M=gm, BLOCK_N=gn, BLOCK_K=gk, EVEN_K=H % gk == 0, MODE=mode, num_warps=gw, num_stages=gs)
        out = torch.zeros(P, H, dtype=torch.float32, device=x.device)  # another rank's pairs: rows of zeros
        blocks = blocks if dm == gm else expert_blocks(local, E, dm)
        _down_grouped[(blocks[1].shape[0], triton.cdiv(H, dn))](
            act, *blocks, wts, q2, s2, out, H, I, q2.stride(0), q2.stride(1), s2.stride(0), s2.stride(1), G=group,
            BLOCK_M=dm, BLOCK_N=dn, BLOCK_K=dk, EVEN_K=I % dk == 0, MODE=mode, num_warps=dw, num_stages=ds)
        return out.view(T, top_k, H).sum(1).to(x.dtype)


@_int4_grouped_op.register_fake
def _(x, local, weights, w13_packed, w13_scale, w2_packed, w2_scale, group, variant, gate_up_config, down_config):
    return torch.empty_like(x)


def int4_grouped_experts(x: torch.Tensor, local: torch.Tensor, weights: torch.Tensor, w13_packed: torch.Tensor,
                         w13_scale: torch.Tensor, w2_packed: torch.Tensor, w2_scale: torch.Tensor, group: int,
                         kernel: int4_moe.Kernel) -> torch.Tensor:
    """Routed experts of this rank with INT4 weights (layout of :mod:`splitspec.models.int4_moe`), as W4A16 grouped
    GEMMs (see the comment above :data:`GROUPED_VARIANTS`): the same contract and result as
    :func:`splitspec.models.int4_moe.int4_experts`, for any number of tokens, each chosen expert read once per
    block of up to BLOCK_M of its pairs. ``kernel``: variant ``grouped`` / ``grouped_asm``; gate_up and down configs
    (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages), BLOCK_M ≥ 16 pairs, BLOCK_N ≥ 16 rows, BLOCK_K a multiple of
    the group size and ≥ 64. Transients: act [T·top_k, I] bf16 and per-pair outputs [T·top_k, H] float32 (summed
    over slots at the end: no atomics)."""
    if not available():
        raise RuntimeError("INT4 experts need Triton (it comes with CUDA builds of PyTorch)")
    if kernel.variant not in GROUPED_VARIANTS:
        raise ValueError(f"INT4 grouped experts: variant {kernel.variant!r} is not one of {', '.join(GROUPED_VARIANTS)}")
    for name, cfg in (("gate_up", kernel.gate_up), ("down", kernel.down)):
        if len(cfg) != 5 or cfg[0] < 16 or cfg[1] < 16 or cfg[2] < 64 or cfg[2] % group:
            raise ValueError(f"INT4 grouped experts: {name} config {cfg} must be (BLOCK_M ≥ 16, BLOCK_N ≥ 16, BLOCK_K ≥ 64 "
                             f"and a multiple of the group size {group}, num_warps, num_stages)")
    return _int4_grouped_op(x, local, weights, w13_packed, w13_scale, w2_packed, w2_scale, int(group), kernel.variant,
                            list(kernel.gate_up), list(kernel.down))
