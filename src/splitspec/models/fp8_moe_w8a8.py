"""W8A8 fused MoE decode kernels: block-scaled FP8 experts multiplied on the tensor cores as FP8, no weight conversion.

The float32 modes of :mod:`splitspec.models.fused_moe` turn every FP8 weight into a float32 before its multiply-add;
on SM90 those conversions, not HBM, cap the kernels near 2.3 TB/s (docs/lab/2026-12-02-h200-int4-fp8-full-depth).
Here the weights go from memory to FP8 ``tl.dot`` untouched (``fp8_tiles.MODE_W8A8``): each program quantises its
token's activations to e4m3 per group of one weight tile's columns (BS1, 128 in Kimi-K2-Instruct) with a
power-of-two scale (:func:`splitspec.models.fp8_tiles.quantize_e4m3`), the token padded to the 16 columns of the
MMA, and each tile column's product is scaled in float32 by (weight tile scale × activation scale) before it joins
the sum — the 1 × 128 activation groups of DeepSeek-V3's published FP8 inference, promoted to float32 every tile as
its authors do on Hopper. Same grid, activation buffer and pair/shared-expert conventions as the float kernels
(``fused_moe._gate_up`` / ``fused_moe._down``), so either kernel can run in either form:

- ``gate_up``: program (pair or shared expert, BLOCK_N rows): silu(Σ gate) · Σ up in float32 to ``act``;
- ``down``: program (token, BLOCK_N hidden rows): Σ over the token's slots of routing weight × Σ_tiles (scale ×
  FP8 dot of the down rows with that pair's activations quantised per tile column), plus the shared expert's.

Every program's rows lie in one tile row (BLOCK_N divides BS0) and each K step is one tile column (BLOCK_K = BS1):
one weight scale per step. The arithmetic, for the tests' float64 reference: with x_g the activations of tile column
g, p_g = pow2_scale(max |x_g|), q_g = rne_e4m3(x_g / p_g) and s the weight tile's scale_inv,
y[n] = Σ_g s[n // BS0, g] · p_g · Σ_{k in g} W_q[n, k] · q_g[k].
"""

from __future__ import annotations

from splitspec.models.fp8_tiles import jit, quantize_e4m3, tl


@jit
def _column(x_row, k, kmask, col):
    """The activations x_row[k] quantised (one tile column): the [16, BLOCK_K] e4m3 right operand (transposed)
    with the token in row 0, and its scale p."""
    r, p = quantize_e4m3(tl.load(x_row + k, mask=kmask, other=0.0).to(tl.float32))
    return tl.where(col[:, None] == 0, r[None, :], 0.0).to(tl.float8e4nv), p


@jit
def _tile_dot(rows, n, k, nmask, kmask, stride_n, q):
    """FP8 rows n, columns k of the weight at ``rows`` times the quantised column q ([16, BLOCK_K]): [BLOCK_N, 16]."""
    w = tl.load(rows + n[:, None].to(tl.int64) * stride_n + k[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0)
    return tl.dot(w, tl.trans(q))


@jit
def _swiglu(x_row, rows, stride_n, scales, s_stride_n, n_rows, H, n0, out_row, BS0, BS1,
            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """silu(gate rows n) · (up rows n) of one expert ([2·n_rows, H] FP8 at ``rows``, scale_inv tiles at ``scales``)
    against one token (H activations at x_row), float32 to out_row[n]."""
    n = n0 + tl.arange(0, BLOCK_N)
    col = tl.arange(0, 16)
    nmask = n < n_rows
    s_gate = scales + (n0 // BS0) * s_stride_n
    s_up = scales + ((n_rows + n0) // BS0) * s_stride_n
    acc_g = tl.zeros([BLOCK_N, 16], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N, 16], dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        kmask = k < H
        q, p = _column(x_row, k, kmask, col)
        acc_g += _tile_dot(rows, n, k, nmask, kmask, stride_n, q) * (tl.load(s_gate + k0 // BS1) * p)
        acc_u += _tile_dot(rows, n + n_rows, k, nmask, kmask, stride_n, q) * (tl.load(s_up + k0 // BS1) * p)
    g = tl.sum(acc_g, axis=1)
    u = tl.sum(acc_u, axis=1)
    tl.store(out_row + n, g / (1.0 + tl.exp(-g)) * u, mask=nmask)


@jit
def gate_up(x_ptr, ids_ptr, w_ptr, ws_ptr, s_ptr, ss_ptr, act_ptr, H, I, I_s, E, top_k, pairs, stride_we, stride_wn,
            stride_wsn, s_stride_e, s_stride_n, ss_stride_n, BS0, BS1, act_stride,
            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    p = tl.program_id(0)  # a (token, slot) pair, or past the pairs a token's shared expert
    n0 = tl.program_id(1) * BLOCK_N
    out_row = act_ptr + p * act_stride
    if p < pairs:
        e = tl.load(ids_ptr + p).to(tl.int64)
        if (e >= 0) & (e < E) & (n0 < I):
            _swiglu(x_ptr + (p // top_k) * H, w_ptr + e * stride_we, stride_wn, s_ptr + e * s_stride_e, s_stride_n, I,
                    H, n0, out_row, BS0, BS1, BLOCK_N, BLOCK_K)
    elif n0 < I_s:
        _swiglu(x_ptr + (p - pairs) * H, ws_ptr, stride_wsn, ss_ptr, ss_stride_n, I_s, H, n0, out_row, BS0, BS1,
                BLOCK_N, BLOCK_K)


@jit
def _down_rows(acc, a_row, rows, stride_n, scales, width, n, nmask, weight, BS1, BLOCK_K: tl.constexpr):
    """acc + weight × (rows n of [H, width] FP8 at ``rows``) · (the width activations at a_row), scale_inv tiles of
    this tile row at ``scales``."""
    col = tl.arange(0, 16)
    for k0 in range(0, width, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        kmask = k < width
        q, p = _column(a_row, k, kmask, col)
        acc += _tile_dot(rows, n, k, nmask, kmask, stride_n, q) * (tl.load(scales + k0 // BS1) * p * weight)
    return acc


@jit
def down(act_ptr, ids_ptr, wt_ptr, w_ptr, ws_ptr, s_ptr, ss_ptr, out_ptr, H, I, I_s, E, top_k, pairs, stride_we,
         stride_wn, stride_wsn, s_stride_e, s_stride_n, ss_stride_n, BS0, BS1, act_stride, SHARED: tl.constexpr,
         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    t = tl.program_id(0)
    n0 = tl.program_id(1) * BLOCK_N
    n = n0 + tl.arange(0, BLOCK_N)
    nmask = n < H
    acc = tl.zeros([BLOCK_N, 16], dtype=tl.float32)
    for j in range(0, top_k):
        p = t * top_k + j
        e = tl.load(ids_ptr + p).to(tl.int64)
        if (e >= 0) & (e < E):
            acc = _down_rows(acc, act_ptr + p * act_stride, w_ptr + e * stride_we, stride_wn,
                             s_ptr + e * s_stride_e + (n0 // BS0) * s_stride_n, I, n, nmask, tl.load(wt_ptr + p), BS1,
                             BLOCK_K)
    if SHARED:
        acc = _down_rows(acc, act_ptr + (pairs + t) * act_stride, ws_ptr, stride_wsn, ss_ptr + (n0 // BS0) * ss_stride_n,
                         I_s, n, nmask, 1.0, BS1, BLOCK_K)
    tl.store(out_ptr + t * H + n, tl.sum(acc, axis=1).to(out_ptr.dtype.element_ty), mask=nmask)
