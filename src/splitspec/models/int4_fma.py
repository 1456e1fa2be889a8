"""The ``fma`` variant of :mod:`splitspec.models.int4_moe`'s W4A16 decode kernels: CUDA cores, float32, any float x.

Same weight format and contract as :func:`splitspec.models.int4_moe.int4_experts`. Per packed int32 word one load of
the word and its scale, then per nibble a shift, a mask, an OR of the exponent of 2^23 (the nibble becomes a float's
mantissa, no int-to-float conversion), a subtraction and a multiply-add; the offset of 8 is taken out once per word
(``_int4_dot``). Weights and activations stay float32: not the tensor-core variants' numerics (bf16 operands).
"""

from __future__ import annotations

import torch

from splitspec.models.fused_moe import jit, tl, triton


@jit
def _int4_dot(x_row, packed, scales, r, rmask, K, k0, stride_pn, stride_sn, G: tl.constexpr, BLOCK_K: tl.constexpr):
    """``fma``: [len(r), BLOCK_K // 8] float32, rows r of the INT4 linear times x over columns k0..k0+BLOCK_K, one
    entry per packed word (summed by the caller)."""
    w = k0 // 8 + tl.arange(0, BLOCK_K // 8)
    wmask = w < K // 8
    mask = rmask[:, None] & wmask[None, :]
    rows = r[:, None].to(tl.int64)
    words = tl.load(packed + rows * stride_pn + w[None, :], mask=mask, other=0)
    acc = tl.zeros(words.shape, dtype=tl.float32)
    xsum = tl.zeros(w.shape, dtype=tl.float32)
    for j in tl.static_range(8):
        xj = tl.load(x_row + w * 8 + j, mask=wmask, other=0.0).to(tl.float32)
        nib = (((words >> (4 * j)) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
        acc += nib * xj[None, :]
        xsum += xj
    s = tl.load(scales + rows * stride_sn + (w * 8 // G)[None, :], mask=mask, other=0.0).to(tl.float32)
    return (acc - 8.0 * xsum[None, :]) * s


@jit
def _gate_up_fma(x_ptr, ids_ptr, p_ptr, s_ptr, act_ptr, H, I, E, top_k, stride_pe, stride_pn, stride_se, stride_sn,
                 G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    p = tl.program_id(0)  # a (token, slot) pair
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    e = tl.load(ids_ptr + p).to(tl.int64)
    if (e >= 0) & (e < E):
        x_row = x_ptr + (p // top_k) * H
        packed, scales = p_ptr + e * stride_pe, s_ptr + e * stride_se
        acc_g = tl.zeros([BLOCK_N, BLOCK_K // 8], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_N, BLOCK_K // 8], dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            acc_g += _int4_dot(x_row, packed, scales, n, n < I, H, k0, stride_pn, stride_sn, G, BLOCK_K)
            acc_u += _int4_dot(x_row, packed, scales, n + I, n < I, H, k0, stride_pn, stride_sn, G, BLOCK_K)
        g = tl.sum(acc_g, axis=1)
        tl.store(act_ptr + p * I + n, g / (1.0 + tl.exp(-g)) * tl.sum(acc_u, axis=1), mask=n < I)


@jit
def _down_fma(act_ptr, ids_ptr, wt_ptr, p_ptr, s_ptr, out_ptr, H, I, E, top_k, stride_pe, stride_pn, stride_se,
              stride_sn, G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    t = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_N, BLOCK_K // 8], dtype=tl.float32)
    for j in range(0, top_k):
        p = t * top_k + j
        e = tl.load(ids_ptr + p).to(tl.int64)
        if (e >= 0) & (e < E):
            wt = tl.load(wt_ptr + p)
            for k0 in range(0, I, BLOCK_K):
                acc += wt * _int4_dot(act_ptr + p * I, p_ptr + e * stride_pe, s_ptr + e * stride_se, n, n < H, I, k0,
                                      stride_pn, stride_sn, G, BLOCK_K)
    tl.store(out_ptr + t * H + n, tl.sum(acc, axis=1).to(out_ptr.dtype.element_ty), mask=n < H)


def gate_up(x: torch.Tensor, ids: torch.Tensor, p13: torch.Tensor, s13: torch.Tensor, group: int, block_n: int,
            block_k: int, num_warps: int, num_stages: int) -> torch.Tensor:
    """act [T·top_k, I] float32: silu(gate) · up of each (token, slot) pair; contiguous arguments, ids [T, top_k]
    int32, p13 int32 [E, 2·I, H/8], s13 [E, 2·I, H/G]."""
    H, top_k, P = x.shape[1], ids.shape[1], ids.numel()
    E, I = p13.shape[0], p13.shape[1] // 2
    act = torch.empty(P, I, dtype=torch.float32, device=x.device)
    _gate_up_fma[(P, triton.cdiv(I, block_n))](x, ids, p13, s13, act, H, I, E, top_k, p13.stride(0), p13.stride(1),
                                               s13.stride(0), s13.stride(1), G=group, BLOCK_N=block_n, BLOCK_K=block_k,
                                               num_warps=num_warps, num_stages=num_stages)
    return act


def down(act: torch.Tensor, ids: torch.Tensor, wts: torch.Tensor, p2: torch.Tensor, s2: torch.Tensor, dtype: torch.dtype,
         group: int, block_n: int, block_k: int, num_warps: int, num_stages: int) -> torch.Tensor:
    """out [T, H] in ``dtype``: Σ over each token's slots of weight · W2[e] act, from :func:`gate_up`'s act."""
    T, top_k = ids.shape
    E, H, I = p2.shape[0], p2.shape[1], p2.shape[2] * 8
    out = torch.empty(T, H, dtype=dtype, device=act.device)
    _down_fma[(T, triton.cdiv(H, block_n))](act, ids, wts, p2, s2, out, H, I, E, top_k, p2.stride(0), p2.stride(1),
                                            s2.stride(0), s2.stride(1), G=group, BLOCK_N=block_n, BLOCK_K=block_k,
                                            num_warps=num_warps, num_stages=num_stages)
    return out
