"""Fused MoE decode kernels: the experts of a few tokens, each token reading only its own experts.

At decode and verify (tens of tokens) a MoE layer is memory-bound matrix-vector work: what costs is reading each
activated expert's weights once, at full HBM bandwidth, and not paying a kernel launch for every small step in
between. The general path (:func:`splitspec.models.target.noaux_tc_route`, the shared expert as two GEMMs,
:func:`splitspec.models.grouped_moe.grouped_experts`) is about twenty kernels, most of them latency-bound at batch 1,
with grouped-GEMM tiles sized for many rows per expert. Here it is four Triton kernels, two for the routing
(:mod:`splitspec.models.fused_route`) and two for the experts:

- ``gate_up``: one program per ((token, slot) pair or (token, shared expert), block of intermediate rows):
  that expert's gate and up rows against the token, writing ``silu(gate) · up`` in float32.
- ``down``: one program per (token, block of hidden rows): each of the token's slots' down-projection rows
  times its activation and routing weight, then the shared expert's, summed in float32.

No sort, no atomics: each token's sum over its experts depends only on that token (batch-invariant,
deterministic) — with one block configuration the kernels give a token the same bits alone, in a batch or inside
a k+1-token verify. (By default a single token gets a configuration of its own, :data:`GATE_UP_CONFIG_ONE_TOKEN`,
which sums in another order; and the layer around them is not bit-invariant either: the shared expert joins the
kernels only for a single token, and the cuBLAS projections and the grouped GEMMs above :data:`MAX_TOKENS` round
by batch size.) Pairs routed to another
rank's experts (ids outside [0, E_local)) are skipped without reading anything. A pair reads its expert's weights even
when another pair of the batch has the same expert, so past a few tokens per expert the grouped GEMMs win;
:func:`use_fused` draws that line (:data:`MAX_TOKENS`). For the same reason the shared expert (and a dense MLP,
whose weights every token uses) is best left to one GEMM over all tokens once there are two or more.

FP8 block-scaled weights are read as FP8 and turned into arithmetic in one of the modes of
:mod:`splitspec.models.fp8_tiles` (float32 multiply-adds, or f16 dots on the tensor cores, the token padded to 16
columns); where a program's rows share a tile row (Kimi's 128 × 128 tiles) the scales multiply the activations.
The w8a8 mode runs either kernel as its twin in :mod:`splitspec.models.fp8_moe_w8a8` (FP8 dots on the tensor cores,
activations quantised to e4m3).

The kernels run on CUDA tensors, and on CPU tensors under ``TRITON_INTERPRET=1`` (Triton's interpreter, read
when Triton is imported; the tests use it to check the arithmetic without a GPU).
"""

from __future__ import annotations

import contextlib

import torch

from splitspec.models import fp8_moe_w8a8
from splitspec.models.fp8_tiles import FACTORS, MODE_W8A8, check_mode, column16, fp8_tile, jit, tl, triton, weight_view

#: Fused kernels serve batches of at most this many tokens: T · top_k pairs each read a whole expert, so with
#: 8 of 384 experts 16 tokens read ~1.15× the distinct experts' bytes and 32 tokens ~1.4×, where the grouped
#: GEMMs (each distinct expert once, ~65–70% of bandwidth) catch up (bench/gpu_bench.py, section moe_kernel).
MAX_TOKENS = 16

#: (BLOCK_N, BLOCK_K, num_warps, num_stages) of ``gate_up`` for two or more tokens, of ``gate_up`` for a single token
#: (a decode step at batch 1: its pairs are the 8 routed experts and the shared expert, whose ninth pair changes how
#: the grid fills the GPU) and of ``down``: the fastest of a sweep on H200 at Kimi-K2 shapes (hidden 7168,
#: intermediate 2048, 1024 and 256: TP1, TP2, TP8; bench/gpu_bench.py, section moe_kernel).
GATE_UP_CONFIG = (16, 512, 4, 4)
GATE_UP_CONFIG_ONE_TOKEN = (8, 1024, 4, 3)
DOWN_CONFIG = (16, 256, 8, 4)

#: The same for FP8 routed experts, with a fifth entry: the FP8 mode (:mod:`splitspec.models.fp8_tiles`; modes
#: other than 0 need every weight of the kernel FP8 and each program's rows in one tile row, else mode 0 runs), and
#: an optional sixth: split gate/up's H, or (w8a8) down's slots, over that many programs. (gate_up, down) by token
#: class ("one" token, "many") and shard: "narrow" for at most :data:`NARROW_I` intermediate rows per expert (the
#: TP8 shard of Kimi's 2048), else "wide". One activation form per shard (w8a8 quantises them to e4m3, the others
#: keep them bf16), so that a token's numerics do not depend on how many tokens share its step (a verify of k + 1
#: tokens and a one-token decode agree up to the order of float32 sums). Paste the winners of
#: ``bench/fp8_bench.py`` (section ``moe``) here.
NARROW_I = 256
FP8_CONFIGS = {("one", "wide"): ((64, 128, 4, 4, 4), (64, 128, 4, 4, 4, 3)),
               ("many", "wide"): ((64, 128, 4, 6, 4), (64, 128, 4, 4, 4)),
               ("one", "narrow"): ((8, 512, 4, 4, 0), (16, 256, 8, 4, 0)),
               ("many", "narrow"): ((8, 512, 4, 4, 0), (8, 512, 4, 4, 0))}


def fp8_class(tokens: int, intermediate: int) -> tuple[str, str]:
    """The :data:`FP8_CONFIGS` key of ``tokens`` tokens through experts of ``intermediate`` rows (this rank's); INT4
    experts' decode kernels are keyed the same way (:data:`splitspec.models.int4_routed.DECODE`)."""
    return "one" if tokens == 1 else "many", "narrow" if intermediate <= NARROW_I else "wide"


def available() -> bool:
    """True when Triton can be imported."""
    return triton is not None


def use_fused(x: torch.Tensor) -> bool:
    """Whether the fused kernels serve x [T, H]: a CUDA tensor, T ≤ :data:`MAX_TOKENS`, Triton importable."""
    return x.is_cuda and x.shape[0] <= MAX_TOKENS and available()


@jit
def _weights(base, r, k, rmask, kmask, stride_n, scales, s_stride_n, BS0, BS1, FP8: tl.constexpr,
             ONE_ROW_TILE: tl.constexpr, MODE: tl.constexpr):
    """Tile [len(r), len(k)]: rows r, columns k of the weight at ``base`` (row stride ``stride_n``), float32; FP8
    weights as ``fp8_tile`` makes them in MODE, times their tile's scale_inv ``scales[r // BS0, k // BS1]``
    (block-scaled FP8, as :func:`splitspec.quant.dequantize_fp8`) — except with ONE_ROW_TILE (all rows r in one tile
    row), where the caller multiplies the activations by :func:`_column_scales` instead: one product per column,
    not per element (MODE 0 only without it)."""
    mask = rmask[:, None] & kmask[None, :]
    w = tl.load(base + r[:, None].to(tl.int64) * stride_n + k[None, :], mask=mask, other=0.0)
    if FP8:
        w = fp8_tile(w, MODE)
        if not ONE_ROW_TILE:
            w *= tl.load(scales + (r // BS0)[:, None] * s_stride_n + (k // BS1)[None, :], mask=mask, other=0.0)
    else:
        w = w.to(tl.float32)
    return w


@jit
def _column_scales(v, r, k, kmask, scales, s_stride_n, BS0, BS1, FP8: tl.constexpr, ONE_ROW_TILE: tl.constexpr):
    """v [len(k)] times the scale_inv of columns k in the tile row of rows r, when :func:`_weights` leaves it out
    (FP8 and ONE_ROW_TILE); otherwise v."""
    if FP8 and ONE_ROW_TILE:
        v *= tl.load(scales + (tl.min(r, axis=0) // BS0) * s_stride_n + k // BS1, mask=kmask, other=0.0)
    return v


@jit
def _accumulate(acc, w, v, x_mul, FP8: tl.constexpr, MODE: tl.constexpr):
    """acc + w · v: w [BLOCK_N, BLOCK_K] from :func:`_weights`, v [BLOCK_K] float32 (FP8: times the mode's factor);
    acc [BLOCK_N, 16] on the tensor cores (FP8 dot modes, v in column 0), else [BLOCK_N, BLOCK_K] before its row sum."""
    if FP8 and MODE >= 2:
        acc = tl.dot(w, column16(v * x_mul), acc)
    elif FP8:
        acc += w * (v * x_mul)[None, :]
    else:
        acc += w * v[None, :]
    return acc


@jit
def _new_acc(FP8: tl.constexpr, MODE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    if FP8 and MODE >= 2:
        acc = tl.zeros([BLOCK_N, 16], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    return acc


@jit
def _swiglu_rows(x_row, rows, stride_n, scales, s_stride_n, n_rows, k_lo, k_hi, n, out_row, half, BS0, BS1, x_mul,
                 out_mul, FP8: tl.constexpr, ONE_ROW_TILE: tl.constexpr, MODE: tl.constexpr, SPLIT: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """silu(gate rows n) · (up rows n) of one expert ([2·n_rows, H] at ``rows``) against one token, to out_row[n]; with
    SPLIT > 1 the gate and up sums over columns [k_lo, k_hi) only, to out_row[n] and out_row[half + n] (the down
    kernel adds the splits and applies the SiLU, :func:`_act`)."""
    acc_g = _new_acc(FP8, MODE, BLOCK_N, BLOCK_K)
    acc_u = _new_acc(FP8, MODE, BLOCK_N, BLOCK_K)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        kmask = k < k_hi
        xv = tl.load(x_row + k, mask=kmask, other=0.0).to(tl.float32)
        xg = _column_scales(xv, n, k, kmask, scales, s_stride_n, BS0, BS1, FP8, ONE_ROW_TILE)
        xu = _column_scales(xv, n + n_rows, k, kmask, scales, s_stride_n, BS0, BS1, FP8, ONE_ROW_TILE)
        acc_g = _accumulate(acc_g, _weights(rows, n, k, n < n_rows, kmask, stride_n, scales, s_stride_n, BS0, BS1, FP8,
                                            ONE_ROW_TILE, MODE), xg, x_mul, FP8, MODE)
        acc_u = _accumulate(acc_u, _weights(rows, n + n_rows, k, n < n_rows, kmask, stride_n, scales, s_stride_n, BS0,
                                            BS1, FP8, ONE_ROW_TILE, MODE), xu, x_mul, FP8, MODE)
    g = tl.sum(acc_g, axis=1)
    u = tl.sum(acc_u, axis=1)
    if FP8:
        g *= out_mul
        u *= out_mul
    if SPLIT == 1:
        tl.store(out_row + n, g / (1.0 + tl.exp(-g)) * u, mask=n < n_rows)
    else:
        tl.store(out_row + n, g, mask=n < n_rows)
        tl.store(out_row + half + n, u, mask=n < n_rows)


@jit
def _gate_up(x_ptr, ids_ptr, w_ptr, ws_ptr, s_ptr, ss_ptr, act_ptr, H, I, I_s, E, top_k, pairs, stride_we, stride_wn,
             stride_wsn, s_stride_e, s_stride_n, ss_stride_n, BS0, BS1, act_stride, split_stride, half, k_per_split,
             x_mul, out_mul, FP8: tl.constexpr, SHARED_FP8: tl.constexpr, ONE_ROW_TILE: tl.constexpr, MODE: tl.constexpr,
             SPLIT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    p = tl.program_id(0)  # a (token, slot) pair, or past the pairs a token's shared expert
    n0 = tl.program_id(1) * BLOCK_N  # the grid covers max(I, I_s) rows: blocks past this expert's rows do nothing
    n = n0 + tl.arange(0, BLOCK_N)
    k_lo = tl.program_id(2) * k_per_split  # this program's share of the H columns (SPLIT > 1)
    k_hi = tl.minimum(k_lo + k_per_split, H)
    out_row = act_ptr + tl.program_id(2) * split_stride + p * act_stride
    if p < pairs:
        e = tl.load(ids_ptr + p).to(tl.int64)
        if (e >= 0) & (e < E) & (n0 < I):
            _swiglu_rows(x_ptr + (p // top_k) * H, w_ptr + e * stride_we, stride_wn, s_ptr + e * s_stride_e, s_stride_n,
                         I, k_lo, k_hi, n, out_row, half, BS0, BS1, x_mul, out_mul, FP8, ONE_ROW_TILE, MODE, SPLIT,
                         BLOCK_N, BLOCK_K)
    elif n0 < I_s:
        _swiglu_rows(x_ptr + (p - pairs) * H, ws_ptr, stride_wsn, ss_ptr, ss_stride_n, I_s, k_lo, k_hi, n, out_row, half,
                     BS0, BS1, x_mul, out_mul, SHARED_FP8, ONE_ROW_TILE, MODE, SPLIT, BLOCK_N, BLOCK_K)


@jit
def _act(a_row, k, kmask, split_stride, half, SPLIT: tl.constexpr):
    """A pair's activations at columns k: as gate/up stored them, or with SPLIT > 1 silu(Σ gate) · Σ up over the
    splits, added in split order."""
    if SPLIT == 1:
        a = tl.load(a_row + k, mask=kmask, other=0.0)
    else:
        g = tl.load(a_row + k, mask=kmask, other=0.0)
        u = tl.load(a_row + half + k, mask=kmask, other=0.0)
        for s in tl.static_range(1, SPLIT):
            g += tl.load(a_row + s * split_stride + k, mask=kmask, other=0.0)
            u += tl.load(a_row + s * split_stride + half + k, mask=kmask, other=0.0)
        a = g / (1.0 + tl.exp(-g)) * u
    return a


@jit
def _down_rows(acc, a_row, rows, stride_n, scales, s_stride_n, n_rows, width, n, scale, split_stride, half, BS0, BS1,
               x_mul, FP8: tl.constexpr, ONE_ROW_TILE: tl.constexpr, MODE: tl.constexpr, SPLIT: tl.constexpr,
               BLOCK_K: tl.constexpr):
    """acc + (rows n of [n_rows, width] at ``rows``) · (activations at a_row · scale), as :func:`_accumulate` sums."""
    for k0 in range(0, width, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        a = _column_scales(_act(a_row, k, k < width, split_stride, half, SPLIT) * scale, n, k, k < width, scales,
                           s_stride_n, BS0, BS1, FP8, ONE_ROW_TILE)
        w = _weights(rows, n, k, n < n_rows, k < width, stride_n, scales, s_stride_n, BS0, BS1, FP8, ONE_ROW_TILE, MODE)
        acc = _accumulate(acc, w, a, x_mul, FP8, MODE)
    return acc


@jit
def _down(act_ptr, ids_ptr, wt_ptr, w_ptr, ws_ptr, s_ptr, ss_ptr, out_ptr, H, I, I_s, E, top_k, pairs, stride_we,
          stride_wn, stride_wsn, s_stride_e, s_stride_n, ss_stride_n, BS0, BS1, act_stride, split_stride, half, x_mul,
          out_mul, SHARED: tl.constexpr, FP8: tl.constexpr, SHARED_FP8: tl.constexpr, ONE_ROW_TILE: tl.constexpr,
          MODE: tl.constexpr, SPLIT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    t = tl.program_id(0)  # MODE > 0 only when the shared expert, if any, is FP8 too: one kind of accumulator
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = _new_acc(FP8, MODE, BLOCK_N, BLOCK_K)
    for j in range(0, top_k):
        p = t * top_k + j
        e = tl.load(ids_ptr + p).to(tl.int64)
        if (e >= 0) & (e < E):
            acc = _down_rows(acc, act_ptr + p * act_stride, w_ptr + e * stride_we, stride_wn, s_ptr + e * s_stride_e,
                             s_stride_n, H, I, n, tl.load(wt_ptr + p), split_stride, half, BS0, BS1, x_mul, FP8,
                             ONE_ROW_TILE, MODE, SPLIT, BLOCK_K)
    if SHARED:
        acc = _down_rows(acc, act_ptr + (pairs + t) * act_stride, ws_ptr, stride_wsn, ss_ptr, ss_stride_n, H, I_s, n,
                         1.0, split_stride, half, BS0, BS1, x_mul, SHARED_FP8, ONE_ROW_TILE, MODE, SPLIT, BLOCK_K)
    y = tl.sum(acc, axis=1)
    if FP8 or SHARED_FP8:
        y *= out_mul
    tl.store(out_ptr + t * H + n, y.to(out_ptr.dtype.element_ty), mask=n < H)


def device_index(device) -> int:
    """The CUDA device index of ``device`` ("cuda", "cuda:N" or a torch.device); "cuda" alone: the current device."""
    index = torch.device(device).index
    return torch.cuda.current_device() if index is None else index


def on_device(x: torch.Tensor):
    """Context making x's GPU current: Triton launches on the current device, whatever its arguments' device."""
    return torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext()


@torch.library.custom_op("splitspec::fused_experts", mutates_args=())
def _experts_op(x: torch.Tensor, local: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                shared_w13: torch.Tensor | None, shared_w2: torch.Tensor | None, scales: list[torch.Tensor | None],
                fp8_block: list[int], gate_up_config: list[int], down_config: list[int]) -> torch.Tensor:
    with on_device(x):
        T, H = x.shape
        top_k = local.shape[1]
        E, I = w13.shape[0], w2.shape[-1]
        shared = shared_w13 is not None
        ws13, ws2 = (shared_w13, shared_w2) if shared else (w13[0], w2[0])  # unused pointers when not shared
        I_s = ws2.shape[-1] if shared else 0
        s13, s2, ss13, ss2 = (s if s is None else s.contiguous() for s in scales)
        x, w13, w2, ws13, ws2 = (t.contiguous() for t in (x, w13, w2, ws13, ws2))
        ids = local.to(torch.int32).contiguous()
        BS0, BS1 = fp8_block or (1, 1)
        width = max(I, I_s)
        (gu_n, gu_k, gu_warps, gu_stages, *gu_more), (dn_n, dn_k, dn_warps, dn_stages, *dn_mode_more) = gate_up_config, down_config
        # each gate/up program's gate rows lie in one tile row, and so do its up rows; each down program's rows
        gu_one, dn_one = BS0 % gu_n == 0 and I % BS0 == 0 and I_s % BS0 == 0, BS0 % dn_n == 0
        gu_mode = mode_for(gu_more[:1], gu_one, s13, ss13, shared, gu_n, gu_k, BS1, "gate_up")
        dn_mode = mode_for(dn_mode_more[:1], dn_one, s2, ss2, shared, dn_n, dn_k, BS1, "down")
        # gate/up's H columns in `split` shares (float modes): partial gate and up sums [split, pairs, 2, width],
        # added by a float-mode down
        steps = triton.cdiv(H, gu_k)
        per = triton.cdiv(steps, max(1, min(gu_more[1] if len(gu_more) > 1 and gu_mode != MODE_W8A8 else 1, steps))) * gu_k
        split = triton.cdiv(H, per)
        dn_mode = 0 if split > 1 else dn_mode
        act = torch.empty(split, T * (top_k + shared), (1 if split == 1 else 2) * width, dtype=torch.float32,
                          device=x.device)
        out = torch.empty_like(x)

        def scale_args(s, ss, w, ws):  # pointers (the weight's own when not FP8: never read) and strides
            s, ss = (w if s is None else s), (ws if ss is None else ss)
            return (s, ss), (s.stride(0), s.stride(-2), ss.stride(-2))

        (p13, ps13), st13 = scale_args(s13, ss13, w13, ws13)
        common = (H, I, I_s, E, top_k, T * top_k, w13.stride(0), w13.stride(-2), ws13.stride(-2), *st13, BS0, BS1,
                  act.stride(1))
        if gu_mode == MODE_W8A8:
            xq, xp = fp8_moe_w8a8.quantize(x, BS1)
            fp8_moe_w8a8.gate_up[(T * (top_k + shared), triton.cdiv(width, gu_n))](
                xq, xp, ids, w13, ws13, p13, ps13, act, *common, xp.stride(0), BLOCK_N=gu_n, BLOCK_K=gu_k,
                num_warps=gu_warps, num_stages=gu_stages)
        else:
            _gate_up[(T * (top_k + shared), triton.cdiv(width, gu_n), split)](
                x, ids, weight_view(w13, gu_mode), weight_view(ws13, gu_mode), p13, ps13, act, *common, act.stride(0),
                width, per, *FACTORS[gu_mode], FP8=s13 is not None, SHARED_FP8=ss13 is not None, ONE_ROW_TILE=gu_one,
                MODE=gu_mode, SPLIT=split, BLOCK_N=gu_n, BLOCK_K=gu_k, num_warps=gu_warps, num_stages=gu_stages)
        (p2, ps2), st2 = scale_args(s2, ss2, w2, ws2)
        common = (H, I, I_s, E, top_k, T * top_k, w2.stride(0), w2.stride(-2), ws2.stride(-2), *st2, BS0, BS1,
                  act.stride(1))
        wts = weights.to(torch.float32).contiguous()
        if dn_mode == MODE_W8A8:
            aq, ap = fp8_moe_w8a8.quantize(act[0], BS1, I, T * top_k, I_s)  # the shared expert's rows: I_s columns
            fp8_moe_w8a8.run_down(out, aq, ap, ids, wts, w2, ws2, p2, ps2, *common, shared=shared,
                                  split=dn_mode_more[1] if len(dn_mode_more) > 1 else 1, block_n=dn_n, block_k=dn_k,
                                  num_warps=dn_warps, num_stages=dn_stages)
        else:
            _down[(T, triton.cdiv(H, dn_n))](
                act, ids, wts, weight_view(w2, dn_mode), weight_view(ws2, dn_mode), p2, ps2, out, *common,
                act.stride(0), width, *FACTORS[dn_mode], SHARED=shared, FP8=s2 is not None, SHARED_FP8=ss2 is not None,
                ONE_ROW_TILE=dn_one, MODE=dn_mode, SPLIT=split, BLOCK_N=dn_n, BLOCK_K=dn_k, num_warps=dn_warps,
                num_stages=dn_stages)
        return out


def mode_for(asked: list[int], one_row_tile: bool, s: torch.Tensor | None, ss: torch.Tensor | None, shared: bool,
             block_n: int, block_k: int, tile_cols: int, kernel: str) -> int:
    """The FP8 mode a kernel runs: the config's (``asked``, [] → 0) when its routed weights are FP8, so is the shared
    expert's (if any), each program's rows lie in one tile row and, for w8a8, each K step is one tile column; else
    0. Raises ValueError for a mode the blocks cannot run (:func:`splitspec.models.fp8_tiles.check_mode`)."""
    mode = asked[0] if asked else 0
    if s is None or (shared and ss is None) or not one_row_tile or (mode == MODE_W8A8 and block_k != tile_cols):
        return 0
    check_mode(mode, block_n, block_k, f"fused_experts {kernel} config")
    return mode


@_experts_op.register_fake
def _(x, local, weights, w13, w2, shared_w13, shared_w2, scales, fp8_block, gate_up_config, down_config):
    return torch.empty_like(x)


def fused_experts(x: torch.Tensor, local: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  shared_w13: torch.Tensor | None = None, shared_w2: torch.Tensor | None = None,
                  scales: tuple[torch.Tensor | None, ...] = (None,) * 4, fp8_block: tuple[int, int] | None = None,
                  gate_up_config: tuple[int, ...] | None = None, down_config: tuple[int, ...] | None = None) -> torch.Tensor:
    """Routed experts of this rank, plus the shared expert if given, for a few tokens, in two kernels.

    Same contract as :func:`splitspec.models.grouped_moe.grouped_experts`: x [T, H] (float dtype d); local [T, top_k]
    integer expert ids relative to this rank's first expert (outside [0, E_local): another rank's, skipped);
    weights [T, top_k] float32 routing weights; w13 [E_local, 2·I, H] (gate rows, then up rows) and
    w2 [E_local, H, I]. shared_w13 [2·I_s, H] / shared_w2 [H, I_s]: this rank's slice of the shared expert(s),
    weight 1. Each weight is float, or float8_e4m3fn with its float32 scale_inv tiles in ``scales``
    (w13, w2, shared_w13, shared_w2; None for a float weight) of ``fp8_block`` (rows, cols) elements — read as
    FP8 and scaled in registers, never dequantised to memory. Returns [T, H] dtype d:
    Σ_slots weight · w2[e] (silu(gate) · up) (+ the shared expert's), accumulated in float32. The configs
    (BLOCK_N, BLOCK_K, num_warps, num_stages[, FP8 mode[, gate/up's split of H]]) override the defaults (for sweeps;
    a split sums the parts in a fixed order: deterministic, batch-invariant for one config): float routed experts
    :data:`GATE_UP_CONFIG` (:data:`GATE_UP_CONFIG_ONE_TOKEN` when T = 1) and :data:`DOWN_CONFIG`; FP8 ones the
    :data:`FP8_CONFIGS`. The dot modes round the scaled activations to f16, w8a8 to e4m3 (:mod:`splitspec.models.fp8_tiles`).
    """
    one = x.shape[0] == 1
    if scales[0] is not None:
        gu, dn = FP8_CONFIGS[fp8_class(x.shape[0], w2.shape[-1])]
        gate_up_config, down_config = gate_up_config or gu, down_config or dn
    gate_up_config = gate_up_config or (GATE_UP_CONFIG_ONE_TOKEN if one else GATE_UP_CONFIG)
    return _experts_op(x, local, weights, w13, w2, shared_w13, shared_w2, list(scales), list(fp8_block or ()),
                       list(gate_up_config), list(down_config or DOWN_CONFIG))
