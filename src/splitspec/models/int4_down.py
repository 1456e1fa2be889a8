"""The ``down`` kernels of :mod:`splitspec.models.int4_moe`'s tensor-core variants (W4A16): each token's slots'
down rows of INT4 experts times their activations and routing weights, summed in float32 — as a loop over the
slots (optionally split over programs, into a float32 output by atomics), or with the slots side by side in one dot
(``_down_columns``). Weight format, numerics and configurations: :mod:`splitspec.models.int4_moe`.
"""

from __future__ import annotations

import torch

from splitspec.models import int4_fma
from splitspec.models.fused_moe import jit, tl, triton
from splitspec.models.int4_tiles import column0, dequant, k_mask, operand, split_count, unpack_mode, weight_tile


@jit
def _down_mma(a_ptr, ids_ptr, wt_ptr, p_ptr, s_ptr, out_ptr, H, I, E, top_k, slot_share, stride_pe, stride_pn,
              stride_se, stride_sn, G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              ATOMIC: tl.constexpr, EVEN_K: tl.constexpr, MODE: tl.constexpr):
    t, sp = tl.program_id(0), tl.program_id(2)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_N, 16], dtype=tl.float32)
    for j in range(sp * slot_share, tl.minimum(sp * slot_share + slot_share, top_k)):
        p = t * top_k + j
        e = tl.load(ids_ptr + p).to(tl.int64)
        if (e >= 0) & (e < E):
            packed, scales = p_ptr + e * stride_pe, s_ptr + e * stride_se
            acc_e = tl.zeros([BLOCK_N, 16], dtype=tl.float32)
            for k0 in range(0, I, BLOCK_K):
                v, sc = weight_tile(packed, scales, n, n < H, k0, I, stride_pn, stride_sn, G, BLOCK_N, BLOCK_K, EVEN_K)
                w = k0 // 4 + tl.arange(0, BLOCK_K // 4)
                for jn in tl.static_range(4):
                    a = operand(tl.load(a_ptr + p * I + jn * (I // 4) + w, mask=k_mask(w, I, EVEN_K), other=0.0), MODE)
                    acc_e = tl.dot(dequant(v, sc, jn, MODE), tl.broadcast_to(a[:, None], [BLOCK_K // 4, 16]), acc_e)
            acc += tl.load(wt_ptr + p) * acc_e
    y = column0(acc)
    if ATOMIC:
        tl.atomic_add(out_ptr + t * H + n, y, mask=n < H)
    else:
        tl.store(out_ptr + t * H + n, y.to(out_ptr.dtype.element_ty), mask=n < H)


@jit
def _down_columns(a_ptr, ids_ptr, wt_ptr, p_ptr, s_ptr, out_ptr, H, I, E, top_k, stride_pn, stride_sn, G: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SLOTS: tl.constexpr, EVEN_K: tl.constexpr,
                  MODE: tl.constexpr):
    """``down`` with a token's slots side by side in one dot: row m = slot·BLOCK_N + r of the left operand is row
    n0 + r of that slot's expert (``packed`` and ``scales`` contiguous: expert e's row n is row e·H + n), column c
    of the right operand is slot c's activations (zero past top_k and for another rank's pairs); entry
    (m, slot(m)) of the product is what the slot adds to row n0 + r, times its routing weight."""
    t = tl.program_id(0)
    n0 = tl.program_id(1) * BLOCK_N
    m = tl.arange(0, SLOTS * BLOCK_N)
    slot, c = m // BLOCK_N, tl.arange(0, 16)
    e = tl.load(ids_ptr + t * top_k + slot, mask=slot < top_k, other=-1).to(tl.int64)
    ok = (e >= 0) & (e < E) & (slot < top_k)
    rows = tl.where(ok, e, 0) * H + n0 + m % BLOCK_N
    rmask = ok & (n0 + m % BLOCK_N < H)
    ec = tl.load(ids_ptr + t * top_k + c, mask=c < top_k, other=-1)
    cok = (ec >= 0) & (ec < E) & (c < top_k)
    acc = tl.zeros([SLOTS * BLOCK_N, 16], dtype=tl.float32)
    for kb in range(0, tl.cdiv(I, BLOCK_K)):
        k0 = kb * BLOCK_K
        v, sc = weight_tile(p_ptr, s_ptr, rows, rmask, k0, I, stride_pn, stride_sn, G, SLOTS * BLOCK_N, BLOCK_K, EVEN_K)
        w = k0 // 4 + tl.arange(0, BLOCK_K // 4)
        for jn in tl.static_range(4):
            a = tl.load(a_ptr + (t * top_k + c)[None, :] * I + jn * (I // 4) + w[:, None],
                        mask=k_mask(w, I, EVEN_K)[:, None] & cok[None, :], other=0.0)
            acc = tl.dot(dequant(v, sc, jn, MODE), operand(a, MODE), acc)
    wt = tl.load(wt_ptr + t * top_k + slot, mask=ok, other=0.0)
    y = tl.sum(tl.reshape(tl.sum(tl.where(c[None, :] == slot[:, None], acc, 0.0), axis=1) * wt, [SLOTS, BLOCK_N]), axis=0)
    n = n0 + tl.arange(0, BLOCK_N)
    tl.store(out_ptr + t * H + n, y.to(out_ptr.dtype.element_ty), mask=n < H)


def down_call(act: torch.Tensor, ids: torch.Tensor, wts: torch.Tensor, p2: torch.Tensor, s2: torch.Tensor,
              dtype: torch.dtype, group: int, variant: str, config: list[int] | tuple[int, ...]) -> torch.Tensor:
    """out [T, H] in ``dtype`` from :func:`gate_up_call`'s act, ids [T, top_k] int32, wts [T, top_k] float32
    (contiguous arguments): ``down`` (split over the slots: into float32 by atomics, then cast)."""
    T, top_k = ids.shape
    E, H, I = p2.shape[0], p2.shape[1], p2.shape[2] * 8
    dn_n, dn_k, dn_w, dn_s, dn_split, *form = config
    dn_k = min(dn_k, triton.next_power_of_2(I))
    if variant == "fma":
        return int4_fma.down(act, ids, wts, p2, s2, dtype, group, dn_n, dn_k, dn_w, dn_s)
    mode = unpack_mode(variant, act)
    q2 = p2.view(torch.int16)
    if form and form[0] == 1:  # slots side by side in one dot
        out = torch.empty(T, H, dtype=dtype, device=act.device)
        _down_columns[(T, triton.cdiv(H, dn_n))](act, ids, wts, q2, s2, out, H, I, E, top_k, q2.stride(1), s2.stride(1),
                                                 G=group, BLOCK_N=dn_n, BLOCK_K=dn_k,
                                                 SLOTS=triton.next_power_of_2(top_k), EVEN_K=I % dn_k == 0, MODE=mode,
                                                 num_warps=dn_w, num_stages=dn_s)
        return out
    ds = split_count(dn_split, T * triton.cdiv(H, dn_n), top_k, act.device)
    slots = triton.cdiv(top_k, ds)
    ds = triton.cdiv(top_k, slots)
    out = torch.zeros(T, H, dtype=torch.float32, device=act.device) if ds > 1 else torch.empty(T, H, dtype=dtype,
                                                                                               device=act.device)
    _down_mma[(T, triton.cdiv(H, dn_n), ds)](act, ids, wts, q2, s2, out, H, I, E, top_k, slots, q2.stride(0),
                                             q2.stride(1), s2.stride(0), s2.stride(1), G=group, BLOCK_N=dn_n,
                                             BLOCK_K=dn_k, ATOMIC=ds > 1, EVEN_K=I % dn_k == 0, MODE=mode,
                                             num_warps=dn_w, num_stages=dn_s)
    return out.to(dtype)
