"""Skinny GEMM for decode: y = x Wᵀ for a few tokens (T ≤ 16), with the RMSNorm of x optionally folded in.

At decode and verify a dense linear is a matrix-vector product: its time is the weight's bytes over HBM
bandwidth, if enough of the GPU reads them at once. cuBLAS's small-batch kernels reach about half of that on
the attention projections of a Kimi-K2 layer (bench/gpu_bench.py, ``layers`` profiles: split-K tiles plus a
reduction kernel). Here one Triton kernel reads each weight row block once for all T tokens:

- program (n, s) computes rows n·BLOCK_N … of y over K-range s of :func:`split_k` ranges;
- one token: products summed element-wise in float32 registers, reduced once at the end (a GEMV); 2–16 tokens:
  ``tl.dot`` with the tokens padded to 16 rows;
- with ``norm`` the kernel first reads x's rows to get each token's RMS (x is a few KB, from cache), then
  multiplies x by 1/RMS and the norm weight and rounds it to x's dtype as :func:`splitspec.layers.rms_norm`
  does, so the RMSNorm kernel before the linear disappears;
- K-ranges are summed in float32 by the caller (``partials.sum(0)``, which ``torch.compile`` fuses into the
  next element-wise work): deterministic, no atomics.

The kernel runs on CUDA tensors, and on CPU tensors under ``TRITON_INTERPRET=1`` (as :mod:`splitspec.fused_moe`).
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

from splitspec import fused_moe
from splitspec.fused_moe import jit, tl, triton
from splitspec.layers import rms_norm

#: (BLOCK_N, BLOCK_K, num_warps, num_stages) by BLOCK_T (tokens padded to 1 or 16): the fastest of a sweep on
#: H200 over the Kimi-K2 attention and dense-MLP shapes at TP1, TP2 and TP8 (bench/gpu_bench.py, section skinny).
CONFIGS = {1: (8, 512, 4, 4), 16: (32, 128, 4, 4)}

#: Whether :func:`dispatch_linear` uses the kernel (``SPLITSPEC_SKINNY=0``: cuBLAS, the norm as its own kernel).
ENABLED = os.environ.get("SPLITSPEC_SKINNY", "1") != "0"

#: :func:`split_k` splits K until there are at least this many programs per streaming multiprocessor.
PROGRAMS_PER_SM = 2


def block_t(T: int) -> int:
    """Token rows of the kernel for T tokens: 1 (a GEMV: element-wise products), else 16 (``tl.dot``; element-wise
    products for 2–4 tokens read at ~2 TB/s on H200, the 16-row tl.dot at cuBLAS's speed)."""
    return 1 if T == 1 else 16


@functools.lru_cache(maxsize=None)
def _sm_count(device: str) -> int:
    if device.startswith("cuda"):
        return torch.cuda.get_device_properties(torch.device(device)).multi_processor_count
    return 1  # the interpreter: no split unless asked


def split_k(N: int, K: int, block_n: int, block_k: int, device: str) -> int:
    """K-ranges for a [N, K] weight: the power of two (≤ 8) that gives ≥ :data:`PROGRAMS_PER_SM` programs per
    streaming multiprocessor, while each range keeps ≥ 2 K-blocks."""
    want = PROGRAMS_PER_SM * _sm_count(device)
    blocks, s = triton.cdiv(N, block_n), 1
    while blocks * s < want and s < 8 and K >= 4 * s * block_k:
        s *= 2
    return s


@jit
def _skinny(x_ptr, w_ptr, g_ptr, out_ptr, T, N, K, k_range, eps, stride_xt, stride_wn, NORM: tl.constexpr,
            DOT: tl.constexpr, F32_DOT: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    s = tl.program_id(1)
    t = tl.arange(0, BLOCK_T)
    tmask = t < T
    inv_rms = tl.zeros([BLOCK_T], dtype=tl.float32)
    if NORM:  # each token's 1/RMS over the whole row (every K-range needs it)
        ss = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            xv = tl.load(x_ptr + t[:, None] * stride_xt + k[None, :], mask=tmask[:, None] & (k[None, :] < K),
                         other=0.0).to(tl.float32)
            ss += xv * xv
        inv_rms = tl.rsqrt(tl.sum(ss, axis=1) / K + eps)
    if DOT:
        acc = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
    else:
        acc3 = tl.zeros([BLOCK_T, BLOCK_N, BLOCK_K], dtype=tl.float32)
    k_lo = s * k_range
    for k0 in range(k_lo, tl.minimum(k_lo + k_range, K), BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        kmask = k < K
        xv = tl.load(x_ptr + t[:, None] * stride_xt + k[None, :], mask=tmask[:, None] & kmask[None, :], other=0.0)
        if NORM:  # rms_norm's rounding: float32 product, then x's dtype
            g = tl.load(g_ptr + k, mask=kmask, other=0.0).to(tl.float32)
            xv = (xv.to(tl.float32) * inv_rms[:, None] * g[None, :]).to(x_ptr.dtype.element_ty)
        w = tl.load(w_ptr + n[:, None].to(tl.int64) * stride_wn + k[None, :], mask=(n[:, None] < N) & kmask[None, :],
                    other=0.0)
        if DOT:
            if F32_DOT:
                acc += tl.dot(xv.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
            else:
                acc += tl.dot(xv, tl.trans(w))
        else:
            acc3 += xv.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
    if not DOT:
        acc = tl.sum(acc3, axis=2)
    out = out_ptr + s * T * N + t[:, None] * N + n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=tmask[:, None] & (n[None, :] < N))


@torch.library.custom_op("splitspec::skinny_linear", mutates_args=())
def _linear_op(x: torch.Tensor, w: torch.Tensor, norm: torch.Tensor | None, eps: float, splits: int,
               config: list[int]) -> torch.Tensor:
    T, K = x.shape
    N = w.shape[0]
    x = x if x.stride(-1) == 1 else x.contiguous()
    w = w if w.stride(-1) == 1 else w.contiguous()
    out = torch.empty(T, N, dtype=x.dtype, device=x.device) if splits == 1 else \
        torch.empty(splits, T, N, dtype=torch.float32, device=x.device)
    BLOCK_N, BLOCK_K, warps, stages = config
    k_range = triton.cdiv(triton.cdiv(K, splits), BLOCK_K) * BLOCK_K
    bt = block_t(T)
    _skinny[(triton.cdiv(N, BLOCK_N), splits)](
        x, w, x if norm is None else norm, out, T, N, K, k_range, eps, x.stride(0), w.stride(0), NORM=norm is not None,
        DOT=bt == 16,
        # float32: IEEE products, not TF32. The interpreter's bf16 tl.dot is wrong (Triton 3.9): there, through float32
        F32_DOT=x.dtype == torch.float32 or not x.is_cuda, BLOCK_T=bt, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, num_warps=warps,
        num_stages=stages)
    return out


@_linear_op.register_fake
def _(x, w, norm, eps, splits, config):
    shape = (x.shape[0], w.shape[0]) if splits == 1 else (splits, x.shape[0], w.shape[0])
    return x.new_empty(shape, dtype=x.dtype if splits == 1 else torch.float32)


def linear(x: torch.Tensor, w: torch.Tensor, norm: torch.Tensor | None = None, eps: float = 1e-6,
           splits: int | None = None, config: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """y = rms_norm(x) Wᵀ (or x Wᵀ without ``norm``) for a few tokens, in one kernel (see the module docstring).

    x: [T, K] float (any row stride; T ≤ 16 is what the configs are for, any T works); w: [N, K], x's dtype;
    norm: [K] RMSNorm weight (RMSNorm as :func:`splitspec.layers.rms_norm`, epsilon ``eps``). Products are summed
    in float32 (float32 inputs: IEEE products, no TF32). Returns [T, N] in x's dtype. ``splits`` (K-ranges, default
    :func:`split_k`) and ``config`` (BLOCK_N, BLOCK_K, num_warps, num_stages; default :data:`CONFIGS`) are for
    tests and sweeps.
    """
    config = tuple(config or CONFIGS[block_t(x.shape[0])])
    splits = splits or split_k(w.shape[0], w.shape[1], config[0], config[1], str(x.device))
    y = _linear_op(x, w, norm, float(eps), int(splits), list(config))
    return y if splits == 1 else y.sum(0).to(x.dtype)


def dispatch_linear(x: torch.Tensor, w: torch.Tensor, norm: torch.Tensor | None = None, eps: float = 1e-6) -> torch.Tensor:
    """y = rms_norm(x) Wᵀ (x Wᵀ without ``norm``) through :func:`linear` for a few tokens on CUDA (the rule of the
    MoE decode kernels, :func:`splitspec.fused_moe.use_fused`) unless :data:`ENABLED` is off, else :func:`splitspec.layers.rms_norm` and
    ``F.linear``. x: [T, K]; w: [N, K] float; norm: [K]. Returns [T, N] in x's dtype."""
    if ENABLED and fused_moe.use_fused(x):
        return linear(x, w, norm, eps)
    return F.linear(x if norm is None else rms_norm(x, norm, eps), w)
