"""Block-scaled FP8 linears executed in FP8: y = x Wᵀ with W float8_e4m3fn [N, K] and its float32 ``scale_inv``
[ceil(N/b0), ceil(K/b1)] (Kimi-K2-Instruct, DeepSeek-V3: 128 × 128 tiles; ``quant`` docs), never dequantised to memory.

Three ways, chosen per call by :func:`plan` from the token count T and the weight's shape:

1. **Triton, W8A16** (T < :data:`SCALED_MM_MIN_TOKENS`, and any T that the next way does not take): ``_linear`` reads
   each weight byte once per block of tokens and folds the tile scales into the activations (bf16 in, float32
   sums), in one of the modes of :mod:`splitspec.models.fp8_tiles`; the K loop can be split over programs so that
   a short, wide weight still fills the GPU (partial sums in float32, added in a second kernel: deterministic).
   Block sizes and mode per token bucket: :data:`LINEAR_CONFIGS`. At decode this is memory-bound work, and
   reading 1 byte per weight is the point.
2. **cuBLAS, W8A8** (T ≥ :data:`SCALED_MM_MIN_TOKENS` on SM90 with CUDA ≥ 12.9, 128 × 128 tiles, N a multiple of 16,
   K of 512: :func:`scaled_mm_fits`): the activations are quantised per token and 128 columns to e4m3 (scale = group amax / 448, one
   kernel), then ``torch._scaled_mm`` with 1 × 128 activation and 128 × 128 weight scales (DeepSeek-style block
   scaling: the scheme DeepSeek-V3 was trained in, ``activation_scheme: dynamic`` in the checkpoint's config). It
   rounds the activations to e4m3 (relative 2⁻⁴ per element), unlike the other two.
3. **Dequantise** (CPU, or Triton missing): :func:`splitspec.quant.linear`, the reference.

The kernels run on CUDA tensors, and on CPU tensors under ``TRITON_INTERPRET=1`` (the tests call them directly).
"""

from __future__ import annotations

import functools
import warnings

import torch
import torch.nn.functional as F

from splitspec import quant
from splitspec.models.fp8_tiles import (FACTORS, MODE_DOT, MODE_F32, check_mode, fp8_tile, is_dot, jit, sum_splits, tl,
                                        triton, weight_view)
from splitspec.models.fused_moe import on_device

#: (MODE, BLOCK_T, BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages) of the Triton linear by token count: the entry
#: with the smallest key ≥ T (the largest key above that). SPLIT_K 0: split K until the programs fill the GPU twice
#: over (at most 8 ways). MODE_F32 runs one token per program (BLOCK_T must be 1); the dot modes need BLOCK_T ≥ 16.
#: Paste the winners of ``bench/fp8_bench.py`` (section ``linear``) here.
#: Set from an H200 run (docs/lab/2026-12-02-h200-int4-fp8-full-depth): the configuration best summed over the ten
#: Kimi-K2 attention / dense-MLP shapes at TP1 and the TP8 shard for each token bucket.
LINEAR_CONFIGS = {
    1: (MODE_F32, 1, 16, 512, 0, 4, 3),
    4: (MODE_DOT, 16, 64, 128, 0, 4, 3),
    16: (MODE_DOT, 16, 64, 128, 0, 4, 3),
    1 << 20: (MODE_DOT, 32, 64, 128, 0, 4, 3),
}
SCALED_MM_MIN_TOKENS = 17  #: from this many tokens ``torch._scaled_mm`` serves the shapes it fits; below, Triton
ACT_GROUP = 128  # activation quantisation group of the cuBLAS path (its 1 × 128 scaling)


def available() -> bool:
    """True when Triton can be imported."""
    return triton is not None


def use_kernels(x: torch.Tensor) -> bool:
    """Whether x [T, K] goes to the FP8 kernels (a CUDA tensor, Triton importable) rather than the dequantising path."""
    return x.is_cuda and available()


@functools.lru_cache(maxsize=16)
def scaled_mm_supported(device: torch.device | str) -> bool:
    """Whether ``torch._scaled_mm`` takes DeepSeek-style block scales on ``device`` (cuBLAS ≥ 12.9 has them on SM90
    only) and computes with them what :func:`quantize_activations` and the dequantised weights say: one small product
    is checked once per device. A failure warns, naming it, and the Triton kernel serves every token count."""
    device = torch.device(device)
    if device.type != "cuda" or not available() or not hasattr(torch, "_scaled_mm") or not torch.version.cuda:
        return False
    cuda = tuple(int(v) for v in torch.version.cuda.split(".")[:2])
    if torch.cuda.get_device_capability(device) != (9, 0) or cuda < (12, 9):
        return False
    g = torch.Generator(device=device).manual_seed(0)
    w, s = quant.quantize_fp8(torch.randn(256, 1024, device=device, generator=g), (128, 128))
    x = torch.randn(24, 1024, device=device, generator=g).to(torch.bfloat16)
    try:
        y = _scaled_mm_op(x, w, s).float()
    except Exception as e:  # whatever this torch / cuBLAS raises: the other path serves
        warnings.warn(f"torch._scaled_mm block scaling unusable on {device}: {type(e).__name__}: {str(e)[:200]}")
        return False
    q, qs = quantize_activations(x)
    ref = (q.float() * qs.repeat_interleave(ACT_GROUP, 1)) @ quant.dequantize_fp8(w, s, (128, 128)).T
    err = ((y - ref).abs().max() / ref.abs().max()).item()
    if not err < 2 ** -6:  # the same products in another order, rounded to bf16: 2⁻⁸ of an element
        warnings.warn(f"torch._scaled_mm block scaling on {device} is off by {err:.3g} of the largest output; not used")
        return False
    return True


def scaled_mm_fits(n: int, k: int, block: tuple[int, int]) -> bool:
    """Whether a [n, k] weight in ``block`` tiles suits ``torch._scaled_mm``'s block scaling: 128 × 128 tiles, n a
    multiple of 16, k a multiple of 512 (the weight scales' row stride, k/128 floats, a multiple of 16 bytes)."""
    return tuple(block) == (128, 128) and n % 16 == 0 and k % 512 == 0


def plan(tokens: int, n: int, k: int, block: tuple[int, int], scaled_mm: bool) -> tuple[str, tuple[int, ...] | None]:
    """How a call with ``tokens`` rows on a [n, k] FP8 weight runs on the GPU: ("scaled_mm", None) or ("triton", its
    config, fitted to the tile: BLOCK_N at most the largest power of two dividing the tile's rows, a dot mode
    dropped for MODE_F32 where that is under 16). ``scaled_mm``: :func:`scaled_mm_supported` on this device."""
    if scaled_mm and tokens >= SCALED_MM_MIN_TOKENS and scaled_mm_fits(n, k, block):
        return "scaled_mm", None
    key = min([b for b in LINEAR_CONFIGS if b >= tokens] or [max(LINEAR_CONFIGS)])
    mode, bt, bn, bk, split, warps, stages = LINEAR_CONFIGS[key]
    bn = min(bn, block[0] & -block[0])
    if is_dot(mode) and bn < 16:
        mode, bt = MODE_F32, 1
    return "triton", (mode, bt, bn, bk, split, warps, stages)


@jit
def _linear(x_ptr, w_ptr, s_ptr, out_ptr, T, N, K, k_per_split, stride_x, stride_w, stride_s, stride_split, BS0, BS1,
            x_mul, out_mul, MODE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pn, pk, pt = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    n = pn * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < N
    s_row = s_ptr + (pn * BLOCK_N // BS0) * stride_s  # BLOCK_N divides BS0: the program's rows share one tile row
    k_lo = pk * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    out = out_ptr + pk * stride_split
    if MODE >= 2:  # tensor cores: [BLOCK_N, BLOCK_T] per program
        t = pt * BLOCK_T + tl.arange(0, BLOCK_T)
        acc = tl.zeros([BLOCK_N, BLOCK_T], dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            kmask = k < k_hi
            sc = tl.load(s_row + k // BS1, mask=kmask, other=0.0) * x_mul
            xv = tl.load(x_ptr + t[:, None] * stride_x + k[None, :], mask=(t[:, None] < T) & kmask[None, :], other=0.0)
            w = tl.load(w_ptr + n[:, None].to(tl.int64) * stride_w + k[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0)
            acc = tl.dot(fp8_tile(w, MODE), tl.trans((xv.to(tl.float32) * sc[None, :]).to(tl.float16)), acc)
        tl.store(out + t[None, :] * N + n[:, None], (acc * out_mul).to(out_ptr.dtype.element_ty),
                 mask=nmask[:, None] & (t[None, :] < T))
    else:  # one token per program, multiply-adds in float32
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            kmask = k < k_hi
            sc = tl.load(s_row + k // BS1, mask=kmask, other=0.0) * x_mul
            xv = tl.load(x_ptr + pt * stride_x + k, mask=kmask, other=0.0).to(tl.float32) * sc
            w = tl.load(w_ptr + n[:, None].to(tl.int64) * stride_w + k[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0)
            acc += fp8_tile(w, MODE) * xv[None, :]
        tl.store(out + pt * N + n, (tl.sum(acc, axis=1) * out_mul).to(out_ptr.dtype.element_ty), mask=nmask)


@jit
def _quant_act(x_ptr, q_ptr, s_ptr, T, K, stride_x, stride_s, GROUPS: tl.constexpr, GROUP: tl.constexpr):
    t = tl.program_id(0)  # rows t ≥ T pad the matrix: zeros with scale 1
    g = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    k = g[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    v = tl.load(x_ptr + t * stride_x + k, mask=k < tl.minimum(T - t, 1) * K, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(v), axis=1)
    s = tl.where(amax > 0, amax / 448.0, 1.0)
    tl.store(q_ptr + t * K + k, tl.clamp(v / s[:, None], -448.0, 448.0).to(q_ptr.dtype.element_ty), mask=k < K)
    tl.store(s_ptr + g * stride_s + t, s, mask=g * GROUP < K)


@functools.lru_cache(maxsize=16)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


@torch.library.custom_op("splitspec::fp8_linear", mutates_args=())
def _linear_op(x: torch.Tensor, w: torch.Tensor, scale_inv: torch.Tensor, block: list[int], config: list[int]) -> torch.Tensor:
    with on_device(x):
        mode, bt, bn, bk, split, warps, stages = config
        T, K = x.shape
        N = w.shape[0]
        x, w = (t if t.stride(-1) == 1 else t.contiguous() for t in (x, w))
        s = scale_inv.contiguous()
        n_blocks, t_blocks, k_steps = triton.cdiv(N, bn), triton.cdiv(T, bt), triton.cdiv(K, bk)
        if split <= 0:
            split = max(1, min(8, k_steps, 2 * _sm_count(x.device) // (n_blocks * t_blocks)))
        per = triton.cdiv(k_steps, min(split, k_steps)) * bk
        split = triton.cdiv(K, per)
        out = torch.empty(T, N, dtype=x.dtype, device=x.device)
        dst = out if split == 1 else torch.empty(split, T, N, dtype=torch.float32, device=x.device)
        x_mul, out_mul = FACTORS[mode]
        _linear[(n_blocks, split, t_blocks)](x, weight_view(w, mode), s, dst, T, N, K, per, x.stride(0), w.stride(0),
                                             s.stride(0), T * N, block[0], block[1], x_mul, out_mul, MODE=mode,
                                             BLOCK_T=bt, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages)
        if split > 1:
            sum_splits(dst, out)
        return out


@_linear_op.register_fake
def _(x, w, scale_inv, block, config):
    return x.new_empty(x.shape[0], w.shape[0])


def quantize_activations(x: torch.Tensor, rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] float → (float8_e4m3fn [R, K], float32 scales [R, ceil(K/128)] with strides (1, R)), per token and
    128 columns: scale = group amax / 448 (1 for a group of zeros), value = x / scale rounded to e4m3. R = ``rows``
    (≥ T; rows past T are zeros) or T. The scales' layout is the one ``torch._scaled_mm`` wants for 1 × 128 scaling."""
    T, K = x.shape
    R = rows or T
    L = triton.cdiv(K, ACT_GROUP)
    q = torch.empty(R, K, dtype=quant.FP8_DTYPE, device=x.device)
    s = torch.empty(L, R, dtype=torch.float32, device=x.device)
    x = x if x.stride(-1) == 1 else x.contiguous()
    _quant_act[(R, triton.cdiv(L, 8))](x, q, s, T, K, x.stride(0), R, GROUPS=8, GROUP=ACT_GROUP, num_warps=4)
    return q, s.t()


@torch.library.custom_op("splitspec::fp8_scaled_mm", mutates_args=())
def _scaled_mm_op(x: torch.Tensor, w: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    with on_device(x):
        T = x.shape[0]
        q, s = quantize_activations(x, -(-T // 4) * 4)  # rows padded to 4: the scales' leading dimension 16-byte aligned
        out = torch._scaled_mm(q, w.t(), scale_a=s, scale_b=scale_inv.contiguous().t(), out_dtype=x.dtype)
        return out[:T]


@_scaled_mm_op.register_fake
def _(x, w, scale_inv):
    return x.new_empty(x.shape[0], w.shape[0])


def triton_linear(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                  config: tuple[int, ...]) -> torch.Tensor:
    """x [T, K] (bf16/f16/f32) · weightᵀ by the Triton kernel with ``config`` (a :data:`LINEAR_CONFIGS` entry) → [T, N]
    x's dtype. Raises ValueError for a config the kernel cannot run (unknown mode, dot blocks under 16, BLOCK_T not
    1 in MODE_F32, BLOCK_N not dividing the tile's rows)."""
    mode, bt, bn, bk, *_ = config
    check_mode(mode, bn, bk, "fp8_linear config")
    if (mode in (0, 1)) != (bt == 1) or (is_dot(mode) and bt < 16) or block[0] % bn:
        raise ValueError(f"fp8_linear config {tuple(config)}: BLOCK_T must be 1 in the float32 modes and ≥ 16 in the "
                         f"dot modes, and BLOCK_N must divide the tile's {block[0]} rows")
    return _linear_op(x, weight, scale_inv, list(block), list(config))


def scaled_mm_linear(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """x [T, K] bf16 · weightᵀ through ``torch._scaled_mm`` (activations quantised per token and 128 columns) → [T, N]."""
    return _scaled_mm_op(x, weight, scale_inv)


def linear(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor | None = None, block: tuple[int, int] | None = None,
           scaled_mm: bool = False) -> torch.Tensor:
    """y = x Wᵀ. x: [..., K]; weight [N, K] float (``F.linear``), or float8_e4m3fn with ``scale_inv`` per ``block`` tile,
    run as :func:`plan` says on the GPU and dequantised (:func:`splitspec.quant.linear`) elsewhere. ``scaled_mm``:
    :func:`scaled_mm_supported` for x's device (the caller's, computed once). Returns [..., N] x's dtype."""
    if scale_inv is None:
        return F.linear(x, weight)
    if not use_kernels(x):
        return quant.linear(x, weight, scale_inv, block)
    x2 = x.reshape(-1, x.shape[-1])
    how, config = plan(x2.shape[0], weight.shape[0], weight.shape[1], block, scaled_mm)
    y = _scaled_mm_op(x2, weight, scale_inv) if how == "scaled_mm" else _linear_op(x2, weight, scale_inv, list(block), list(config))
    return y.reshape(*x.shape[:-1], weight.shape[0])
