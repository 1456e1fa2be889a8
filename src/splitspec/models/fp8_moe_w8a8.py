"""W8A8 fused MoE decode kernels: block-scaled FP8 experts multiplied on the tensor cores as FP8, no weight conversion.

The float32 modes of :mod:`splitspec.models.fused_moe` turn every FP8 weight into a float32 before its multiply-add;
on SM90 those conversions, not HBM, cap the kernels near 2.3 TB/s (docs/lab/2026-12-02-h200-int4-fp8-full-depth).
Here the weights go from memory to FP8 ``tl.dot`` untouched (``fp8_tiles.MODE_W8A8``): a first kernel quantises
each kernel's activations to e4m3 per group of one weight tile's columns (BS1, 128 in Kimi-K2-Instruct) with a
power-of-two scale (:func:`quantize`; the tokens' x before ``gate_up``, the pairs' silu(gate) · up before ``down``);
the programs read them as the MMA's right operand, the token padded to 16 columns, and scale each tile column's
product in float32 by (weight tile scale × activation scale) before it joins the sum — the 1 × 128 activation groups
of DeepSeek-V3's published FP8 inference, promoted to float32 every tile as its authors do on Hopper. Same grids,
activation buffer and pair/shared-expert conventions as the float kernels (``fused_moe._gate_up`` /
``fused_moe._down``), so either kernel can run in either form:

- ``gate_up``: program (pair or shared expert, BLOCK_N rows): silu(Σ gate) · Σ up in float32 to ``act``;
- ``down``: program (token, BLOCK_N hidden rows[, share of the slots]): Σ over the token's slots of routing weight ×
  Σ_tiles (scale × FP8 dot of the down rows with that pair's quantised activations), plus the shared expert's; with
  the slots split over programs (few tokens: more programs than SMs), float32 partial sums added in a last kernel.

Every program's rows lie in one tile row (BLOCK_N divides BS0) and each K step is one tile column (BLOCK_K = BS1):
one weight scale per step. The arithmetic, for the tests' float64 reference: with x_g the activations of tile column
g, p_g = pow2_scale(max |x_g|), q_g = rne_e4m3(x_g / p_g) and s the weight tile's scale_inv,
y[n] = Σ_g s[n // BS0, g] · p_g · Σ_{k in g} W_q[n, k] · q_g[k].
"""

from __future__ import annotations

import torch

from splitspec.models.fp8_tiles import jit, quantize_e4m3, sum_splits, tl, triton


@jit
def _quantize_rows(v_ptr, q_ptr, p_ptr, K, K_tail, tail, v_stride, q_stride, p_stride, G: tl.constexpr):
    """Program (row r, group g): v[r, g·G : (g+1)·G] (float) as e4m3 q[r, ...] and its power-of-two scale p[r, g]
    (:func:`splitspec.models.fp8_tiles.quantize_e4m3`); rows from ``tail`` on hold K_tail columns, the others K
    (columns past them are never read)."""
    r, g = tl.program_id(0), tl.program_id(1)
    k = g * G + tl.arange(0, G)
    kmask = k < tl.where(r < tail, K, K_tail)
    v, p = quantize_e4m3(tl.load(v_ptr + r * v_stride + k, mask=kmask, other=0.0).to(tl.float32))
    tl.store(q_ptr + r * q_stride + k, v.to(tl.float8e4nv), mask=kmask)
    tl.store(p_ptr + r * p_stride + g, p)


def quantize(v: torch.Tensor, group: int, cols: int | None = None, tail: int | None = None,
             tail_cols: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """v [R, W] float (CUDA, or CPU under Triton's interpreter) as (q [R, W] float8_e4m3fn, p [R, ⌈W/group⌉] float32):
    its first ``cols`` (default W) columns, from row ``tail`` on its first ``tail_cols``, one power-of-two scale per
    group of ``group`` (a power of two) columns; q and p past those columns are left unset."""
    R, W = v.shape
    q = torch.empty(R, W, dtype=torch.float8_e4m3fn, device=v.device)
    p = torch.empty(R, triton.cdiv(W, group), dtype=torch.float32, device=v.device)
    _quantize_rows[(R, p.shape[1])](v, q, p, W if cols is None else cols, tail_cols, R if tail is None else tail,
                                    v.stride(0), q.stride(0), p.stride(0), G=group, num_warps=1)
    return q, p


@jit
def _column(q_row, p_row, k0, k, kmask, BLOCK_K: tl.constexpr):
    """Tile column k0 // BLOCK_K of a quantised row: the [16, BLOCK_K] e4m3 right operand (transposed) with the row
    in row 0, zeros below it, and its scale p."""
    col = tl.arange(0, 16)
    q = tl.load(q_row + col[:, None] * 0 + k[None, :], mask=(col[:, None] == 0) & kmask[None, :], other=0.0)
    return q, tl.load(p_row + k0 // BLOCK_K)


@jit
def _tile_dot(rows, n, k, nmask, kmask, stride_n, q):
    """FP8 rows n, columns k of the weight at ``rows`` times the quantised column q ([16, BLOCK_K]): [BLOCK_N, 16]."""
    w = tl.load(rows + n[:, None].to(tl.int64) * stride_n + k[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0)
    return tl.dot(w, tl.trans(q))


@jit
def _swiglu(q_row, p_row, rows, stride_n, scales, s_stride_n, n_rows, H, n0, out_row, BS0, BLOCK_N: tl.constexpr,
            BLOCK_K: tl.constexpr):
    """silu(gate rows n) · (up rows n) of one expert ([2·n_rows, H] FP8 at ``rows``, scale_inv tiles at ``scales``)
    against one token (H quantised activations at q_row, their scales at p_row), float32 to out_row[n]."""
    n = n0 + tl.arange(0, BLOCK_N)
    nmask = n < n_rows
    s_gate = scales + (n0 // BS0) * s_stride_n
    s_up = scales + ((n_rows + n0) // BS0) * s_stride_n
    acc_g = tl.zeros([BLOCK_N, 16], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N, 16], dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        kmask = k < H
        q, p = _column(q_row, p_row, k0, k, kmask, BLOCK_K)
        acc_g += _tile_dot(rows, n, k, nmask, kmask, stride_n, q) * (tl.load(s_gate + k0 // BLOCK_K) * p)
        acc_u += _tile_dot(rows, n + n_rows, k, nmask, kmask, stride_n, q) * (tl.load(s_up + k0 // BLOCK_K) * p)
    g = tl.sum(acc_g, axis=1)
    u = tl.sum(acc_u, axis=1)
    tl.store(out_row + n, g / (1.0 + tl.exp(-g)) * u, mask=nmask)


@jit
def gate_up(xq_ptr, xp_ptr, ids_ptr, w_ptr, ws_ptr, s_ptr, ss_ptr, act_ptr, H, I, I_s, E, top_k, pairs, stride_we,
            stride_wn, stride_wsn, s_stride_e, s_stride_n, ss_stride_n, BS0, BS1, act_stride, xp_stride,
            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    p = tl.program_id(0)  # a (token, slot) pair, or past the pairs a token's shared expert
    n0 = tl.program_id(1) * BLOCK_N
    out_row = act_ptr + p * act_stride
    if p < pairs:
        e = tl.load(ids_ptr + p).to(tl.int64)
        if (e >= 0) & (e < E) & (n0 < I):
            t = p // top_k
            _swiglu(xq_ptr + t * H, xp_ptr + t * xp_stride, w_ptr + e * stride_we, stride_wn, s_ptr + e * s_stride_e,
                    s_stride_n, I, H, n0, out_row, BS0, BLOCK_N, BLOCK_K)
    elif n0 < I_s:
        t = p - pairs
        _swiglu(xq_ptr + t * H, xp_ptr + t * xp_stride, ws_ptr, stride_wsn, ss_ptr, ss_stride_n, I_s, H, n0, out_row,
                BS0, BLOCK_N, BLOCK_K)


@jit
def _down_rows(acc, q_row, p_row, rows, stride_n, scales, width, n, nmask, weight, BLOCK_K: tl.constexpr):
    """acc + weight × (rows n of [H, width] FP8 at ``rows``) · (the width quantised activations at q_row, scales
    at p_row), scale_inv tiles of this tile row at ``scales``."""
    for k0 in range(0, width, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        kmask = k < width
        q, p = _column(q_row, p_row, k0, k, kmask, BLOCK_K)
        acc += _tile_dot(rows, n, k, nmask, kmask, stride_n, q) * (tl.load(scales + k0 // BLOCK_K) * p * weight)
    return acc


@jit
def down(aq_ptr, ap_ptr, ids_ptr, wt_ptr, w_ptr, ws_ptr, s_ptr, ss_ptr, out_ptr, H, I, I_s, E, top_k, pairs, stride_we,
         stride_wn, stride_wsn, s_stride_e, s_stride_n, ss_stride_n, BS0, BS1, act_stride, ap_stride, T,
         SHARED: tl.constexpr, SPLIT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    t = tl.program_id(0)
    n0 = tl.program_id(1) * BLOCK_N
    n = n0 + tl.arange(0, BLOCK_N)
    nmask = n < H
    # this program's share of the token's slots (the shared expert is slot top_k): [lo, hi)
    per = tl.cdiv(top_k + SHARED, SPLIT)
    lo = tl.program_id(2) * per
    hi = lo + per
    acc = tl.zeros([BLOCK_N, 16], dtype=tl.float32)
    for j in range(lo, tl.minimum(hi, top_k)):
        p = t * top_k + j
        e = tl.load(ids_ptr + p).to(tl.int64)
        if (e >= 0) & (e < E):
            acc = _down_rows(acc, aq_ptr + p * act_stride, ap_ptr + p * ap_stride, w_ptr + e * stride_we, stride_wn,
                             s_ptr + e * s_stride_e + (n0 // BS0) * s_stride_n, I, n, nmask, tl.load(wt_ptr + p), BLOCK_K)
    if SHARED:
        if (top_k >= lo) & (top_k < hi):
            p = pairs + t
            acc = _down_rows(acc, aq_ptr + p * act_stride, ap_ptr + p * ap_stride, ws_ptr, stride_wsn,
                             ss_ptr + (n0 // BS0) * ss_stride_n, I_s, n, nmask, 1.0, BLOCK_K)
    y = tl.sum(acc, axis=1)
    if SPLIT == 1:
        tl.store(out_ptr + t * H + n, y.to(out_ptr.dtype.element_ty), mask=nmask)
    else:  # float32 partial sums [SPLIT, T, H], added by fp8_tiles.sum_splits
        tl.store(out_ptr + (tl.program_id(2) * T + t) * H + n, y, mask=nmask)


def run_down(out: torch.Tensor, aq: torch.Tensor, ap: torch.Tensor, *args, shared: bool, split: int, block_n: int,
             block_k: int, num_warps: int, num_stages: int) -> None:
    """``down`` into out [T, H] over a grid (T, H / block_n, split): with split > 1 each program takes its share
    of the token's slots into float32 partial sums, then one kernel adds them in split order (deterministic)."""
    T, H = out.shape
    dest = out if split == 1 else torch.empty(split, T, H, dtype=torch.float32, device=out.device)
    down[(T, triton.cdiv(H, block_n), split)](aq, ap, *args[:6], dest, *args[6:], ap.stride(0), T,
                                              SHARED=shared, SPLIT=split, BLOCK_N=block_n, BLOCK_K=block_k,
                                              num_warps=num_warps, num_stages=num_stages)
    if split > 1:
        sum_splits(dest, out)
