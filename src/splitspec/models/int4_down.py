"""The ``down`` kernels of :mod:`splitspec.models.int4_moe`'s tensor-core variants (W4A16): each token's slots'
down rows of INT4 experts times their activations and routing weights, summed in float32 — as a loop over the
slots (optionally split over programs), or with the slots side by side in one dot (``_down_columns``). Weight
format, numerics and configurations: :mod:`splitspec.models.int4_moe`.

A slot split's programs add their float32 partial sums into a workspace by atomics and count themselves in per
tile (token, block of rows); the last of a tile to arrive reads the sum (an atomic add of 0: from where the adds
went), zeroes it, resets the count and writes the rounded result — no zeroing launch before the kernel and no
cast after it (the fix-up of stream-K GEMMs). The workspace [T·H] float32 and counts [T·row blocks] int32:
:func:`splitspec.models.int4_tiles.workspace`. Captured before its first eager use, a split falls back to a zeroed
float32 output and a cast.

``add`` (optional, [T, H] in the output dtype): added to the rounded result and rounded again — the bits of
``down(...) + add`` in torch, one launch fewer (the MoE layer's shared expert, :mod:`splitspec.models.int4_layer`).
"""

from __future__ import annotations

import torch

from splitspec.models import int4_fma
from splitspec.models.fused_moe import jit, tl, triton
from splitspec.models.int4_tiles import (column0, dequant, k_mask, last_to_arrive, operand, split_count, take,
                                        unpack_mode, weight_tile, workspace, zeroed_on_failure)


@jit
def _store(out_ptr, add_ptr, offs, y, mask, HAS_ADD: tl.constexpr):
    """out[offs] = y rounded to out's dtype (+ add[offs], rounded once more)."""
    y = y.to(out_ptr.dtype.element_ty)
    if HAS_ADD:
        y = (y.to(tl.float32) + tl.load(add_ptr + offs, mask=mask, other=0.0).to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + offs, y, mask=mask)


@jit
def _down_mma(a_ptr, ids_ptr, wt_ptr, p_ptr, s_ptr, out_ptr, ws_ptr, cnt_ptr, add_ptr, H, I, E, top_k, slot_share,
              stride_pe, stride_pn, stride_se, stride_sn, G: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_K: tl.constexpr, ATOMIC: tl.constexpr, FIXUP: tl.constexpr, HAS_ADD: tl.constexpr,
              EVEN_K: tl.constexpr, MODE: tl.constexpr):
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
    if FIXUP:  # the last of the tile's programs to arrive writes the sum and leaves workspace and count at zero
        tl.atomic_add(ws_ptr + t * H + n, y, mask=n < H, sem="relaxed")
        tile = t * tl.num_programs(1) + tl.program_id(1)
        if last_to_arrive(cnt_ptr, tile, tl.num_programs(2)):
            total = take(ws_ptr + t * H + n, y, n < H)
            tl.atomic_xchg(cnt_ptr + tile, 0)
            _store(out_ptr, add_ptr, t * H + n, total, n < H, HAS_ADD)
    elif ATOMIC:  # into a zeroed float32 output, cast after the kernel
        tl.atomic_add(out_ptr + t * H + n, y, mask=n < H)
    else:
        _store(out_ptr, add_ptr, t * H + n, y, n < H, HAS_ADD)


@jit
def _down_columns(a_ptr, ids_ptr, wt_ptr, p_ptr, s_ptr, out_ptr, add_ptr, H, I, E, top_k, stride_pn, stride_sn,
                  G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SLOTS: tl.constexpr,
                  HAS_ADD: tl.constexpr, EVEN_K: tl.constexpr, MODE: tl.constexpr):
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
    _store(out_ptr, add_ptr, t * H + n, y, n < H, HAS_ADD)


def down_call(act: torch.Tensor, ids: torch.Tensor, wts: torch.Tensor, p2: torch.Tensor, s2: torch.Tensor,
              dtype: torch.dtype, group: int, variant: str, config: list[int] | tuple[int, ...],
              add: torch.Tensor | None = None) -> torch.Tensor:
    """out [T, H] in ``dtype`` from :func:`gate_up_call`'s act, ids [T, top_k] int32, wts [T, top_k] float32
    (contiguous arguments): ``down`` (split over the slots: the fix-up of the module docstring); ``add`` [T, H]
    in ``dtype`` (contiguous), if given, added to the rounded result."""
    T, top_k = ids.shape
    E, H, I = p2.shape[0], p2.shape[1], p2.shape[2] * 8
    if add is not None and (add.shape != (T, H) or add.dtype != dtype or add.device != act.device
                            or not add.is_contiguous()):
        raise ValueError(f"INT4 down: add {add.dtype} {list(add.shape)} on {add.device}, expected a contiguous "
                         f"{dtype} [{T}, {H}] on {act.device}")
    dn_n, dn_k, dn_w, dn_s, dn_split, *form = config
    dn_k = min(dn_k, triton.next_power_of_2(I))
    if variant == "fma":
        out = int4_fma.down(act, ids, wts, p2, s2, dtype, group, dn_n, dn_k, dn_w, dn_s)
        return out if add is None else out + add
    mode = unpack_mode(variant, act)
    q2 = p2.view(torch.int16)
    blocks = triton.cdiv(H, dn_n)
    out = torch.empty(T, H, dtype=dtype, device=act.device)
    plus = out if add is None else add  # never read without HAS_ADD
    if form and form[0] == 1:  # slots side by side in one dot
        _down_columns[(T, blocks)](act, ids, wts, q2, s2, out, plus, H, I, E, top_k, q2.stride(1), s2.stride(1),
                                   G=group, BLOCK_N=dn_n, BLOCK_K=dn_k, SLOTS=triton.next_power_of_2(top_k),
                                   HAS_ADD=add is not None, EVEN_K=I % dn_k == 0, MODE=mode, num_warps=dn_w,
                                   num_stages=dn_s)
        return out
    ds = split_count(dn_split, T * blocks, top_k, act.device)
    slots = triton.cdiv(top_k, ds)
    ds = triton.cdiv(top_k, slots)
    ws = workspace(act.device, T * H, T * blocks) if ds > 1 else None
    fallback = ds > 1 and ws is None
    if fallback:
        out = torch.zeros(T, H, dtype=torch.float32, device=act.device)
    ws_, cnt = ws or (out, out)  # never read without FIXUP
    with zeroed_on_failure(ws):
        _down_mma[(T, blocks, ds)](act, ids, wts, q2, s2, out, ws_, cnt, plus, H, I, E, top_k, slots, q2.stride(0),
                                   q2.stride(1), s2.stride(0), s2.stride(1), G=group, BLOCK_N=dn_n, BLOCK_K=dn_k,
                                   ATOMIC=ds > 1, FIXUP=ws is not None, HAS_ADD=add is not None and not fallback,
                                   EVEN_K=I % dn_k == 0, MODE=mode, num_warps=dn_w, num_stages=dn_s)
    if fallback:
        out = out.to(dtype)
        return out if add is None else out + add
    return out
