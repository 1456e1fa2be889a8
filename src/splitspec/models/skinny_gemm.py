"""Skinny products y = x Wᵀ of 1–8 tokens against a bf16 weight, in one Triton kernel each, with optional prologues.

At decode and verify a large linear of a TP8 shard (7168 × 1024 … 4608 × 7168) is a matrix-vector product: what
costs is reading W once at HBM bandwidth. cuBLAS serves one token of some of these shapes with split-K and a second
reduction kernel; here each program owns ``BLOCK_N`` output rows, loops over all of K in steps of ``BLOCK_K`` and
stores its rows once (no split-K, no atomics: each token's result depends only on that token, deterministic). The
grid has ⌈N / BLOCK_N⌉ programs, so a small BLOCK_N keeps every SM busy (7168 rows / 32 = 224 programs).

Prologues, computed from x inside the loop (x is at most 8 × 7168, read from L2 by every program):

- ``residual``: s = x + residual (rounded to x's dtype, as the engine's bf16 add), the new residual stream. Each of
  K's steps is stored by one program (step i by program i mod grid), so s is written once in all.
- ``norm_weight``: RMSNorm folded into the product: y[t] = rsqrt(mean_k s[t,k]² + eps) · Σ_k W[n,k] · (s[t,k] · g[k]),
  s's sum of squares gathered in the same pass over K (one read of x, the rms applied to the sums at the end). The
  product s · g is rounded to W's dtype before the multiply (the engine rounds s · rstd · g instead: the two differ by
  bf16 rounding, not more).
- ``act``: SwiGLU's silu(gate) · up of an x [T, 2·K] holding gate columns then up columns (``mlp.w13``'s output
  feeding ``mlp.w2``), computed in float32 and rounded to W's dtype.

Two ways to multiply (per config): ``dot`` (``tl.dot`` on the tensor cores, tokens padded to 16 rows, float32
accumulation; BLOCK_N ≥ 16) or float32 multiply-adds into a [tokens, BLOCK_N, BLOCK_K] accumulator summed at the end.
Block sizes come from :data:`CONFIGS` by shape class (:func:`shape_class`), filled from the sweep of
``bench/lab/skinny_gemm_bench.py`` on an H200.

The kernel runs on CUDA tensors, and on CPU tensors under ``TRITON_INTERPRET=1`` (the tests; the dot's operands then
go through float32, :data:`INTERPRETED`). In the engine it serves
the target's bf16 linears of at most :data:`MAX_TOKENS` tokens when ``ServeConfig.skinny_gemm`` is on
(:meth:`splitspec.models.target.TargetModel.linear`); both entry points are ``torch.library`` custom ops, so they run
inside ``torch.compile``d layer halves and CUDA graphs.
"""

from __future__ import annotations

import os

import torch

from splitspec.models.fp8_tiles import jit, tl, triton
from splitspec.models.fused_moe import on_device

#: Under Triton's interpreter the dot's bf16 operands go to float32 first: its bf16 ``tl.dot`` gives wrong sums.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

#: Tokens the kernel serves; more go to cuBLAS (each program's x tile and accumulator grow with the tokens).
MAX_TOKENS = 8

#: Tokens up to which a norm, residual add or silu · up is folded into the product (the target's ``fold``). With the
#: dot form (2+ tokens) a prologue made the product 2.5–7× slower on an H200, in the float32 multiply-add form
#: (one token) it costs under 10% (docs/lab/2026-12-03-h200-branches-timed).
FOLD_TOKENS = 1

#: (BLOCK_N, BLOCK_K, num_warps, num_stages, dot) by :func:`shape_class` (tokens rounded up to 1/2/4/8, N class,
#: K class); a class missing here takes :data:`DEFAULT_CONFIG` (dot ≥ 2 tokens). From ``bench/lab/skinny_gemm_bench.py``
#: on an H200 (kernel vs cuBLAS µs summed over the class's shapes); one token: multiply-add configs only (dot 0),
#: which take the folded prologues.
CONFIGS: dict[tuple[int, str, str], tuple[int, int, int, int, int]] = {
    (1, "mid", "long"): (32, 512, 4, 2, 0),  # 96.9 vs 104.6 µs
    (1, "mid", "mid"): (8, 512, 4, 2, 0),  # 69.2 vs 73.9 µs
    (1, "mid", "short"): (16, 256, 8, 4, 0),  # 19.3 vs 21.2 µs
    (1, "narrow", "mid"): (8, 2048, 8, 2, 0),  # 16.4 vs 21.5 µs
    (1, "narrow", "short"): (8, 1024, 8, 4, 0),  # 4.0 vs 7.0 µs
    (1, "wide", "mid"): (16, 512, 4, 2, 0),  # 181.5 vs 198.4 µs
    (2, "mid", "long"): (64, 256, 4, 4, 1),  # 95.2 vs 104.4 µs
    (2, "mid", "mid"): (64, 256, 4, 4, 1),  # 66.6 vs 74.8 µs
    (2, "mid", "short"): (64, 256, 4, 4, 1),  # 20.6 vs 21.1 µs
    (2, "narrow", "mid"): (8, 1024, 4, 2, 0),  # 21.8 vs 21.2 µs
    (2, "narrow", "short"): (16, 512, 4, 3, 1),  # 4.9 vs 6.6 µs
    (2, "wide", "mid"): (32, 128, 4, 3, 1),  # 184.1 vs 200.1 µs
    (4, "mid", "long"): (64, 256, 4, 4, 1),  # 95.5 vs 105.5 µs
    (4, "mid", "mid"): (64, 256, 4, 4, 1),  # 66.7 vs 75.1 µs
    (4, "mid", "short"): (64, 256, 4, 4, 1),  # 20.4 vs 21.5 µs
    (4, "narrow", "mid"): (16, 1024, 4, 3, 1),  # 24.7 vs 21.3 µs
    (4, "narrow", "short"): (16, 512, 4, 3, 1),  # 4.8 vs 6.3 µs
    (4, "wide", "mid"): (64, 128, 4, 3, 1),  # 185.3 vs 200.8 µs
    (8, "mid", "long"): (64, 256, 4, 4, 1),  # 95.7 vs 107.6 µs
    (8, "mid", "mid"): (64, 256, 4, 4, 1),  # 66.9 vs 75.2 µs
    (8, "mid", "short"): (64, 256, 4, 4, 1),  # 20.7 vs 21.0 µs
    (8, "narrow", "mid"): (16, 1024, 4, 3, 1),  # 24.5 vs 21.4 µs
    (8, "narrow", "short"): (16, 512, 4, 3, 1),  # 4.9 vs 5.5 µs
    (8, "wide", "mid"): (64, 128, 4, 3, 1),  # 187.2 vs 200.6 µs
}
DEFAULT_CONFIG = {1: (16, 512, 4, 4, 0), 2: (16, 256, 4, 4, 1), 4: (16, 256, 4, 4, 1), 8: (16, 256, 4, 4, 1)}

#: N and K class edges: N ≤ 2560 "narrow" (fused_qkv_a, q_b_proj), ≤ 8192 "mid" (TP8's w13 / w2 / o_proj), else
#: "wide"; K ≤ 2560 "short" (TP8's w2 / o_proj / q_b_proj), ≤ 8192 "mid" (hidden 7168), else "long".
N_EDGES = ((2560, "narrow"), (8192, "mid"))
K_EDGES = ((2560, "short"), (8192, "mid"))


def token_class(tokens: int) -> int:
    """1, 2, 4 or 8: ``tokens`` (1 … :data:`MAX_TOKENS`) rounded up to a power of two."""
    return 1 if tokens <= 1 else 2 if tokens <= 2 else 4 if tokens <= 4 else 8


def _edge(v: int, edges: tuple[tuple[int, str], ...], last: str) -> str:
    return next((name for top, name in edges if v <= top), last)


def shape_class(tokens: int, n: int, k: int) -> tuple[int, str, str]:
    """The :data:`CONFIGS` key of a product of ``tokens`` tokens against W [n, k]."""
    return token_class(tokens), _edge(n, N_EDGES, "wide"), _edge(k, K_EDGES, "long")


def config_for(tokens: int, n: int, k: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages, dot) for this product (:data:`CONFIGS`, else the default)."""
    key = shape_class(tokens, n, k)
    return CONFIGS.get(key, DEFAULT_CONFIG[key[0]])


def applies(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether the kernel serves x [T, K] · w [N, K]ᵀ in the engine: CUDA, 1 ≤ T ≤ :data:`MAX_TOKENS`, bf16 weight."""
    return (triton is not None and x.is_cuda and x.dim() == 2 and 1 <= x.shape[0] <= MAX_TOKENS
            and w.dim() == 2 and w.dtype == torch.bfloat16)


@jit
def _skinny(x_ptr, r_ptr, g_ptr, w_ptr, y_ptr, h_ptr, T, N, K, stride_x, stride_r, stride_w, eps,
            TP: tl.constexpr, RESID: tl.constexpr, NORM: tl.constexpr, ACT: tl.constexpr, DOT: tl.constexpr,
            UPCAST: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Rows [pid·BLOCK_N, +BLOCK_N) of y [T, N] (see the module docstring); TP ≥ T tokens (16 with DOT). UPCAST: the
    dot's operands in float32 (the interpreter, whose bf16 ``tl.dot`` is wrong)."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < N
    t = tl.arange(0, TP)
    tmask = t < T
    if DOT:
        acc = tl.zeros([TP, BLOCK_N], dtype=tl.float32)
    elif TP == 1:
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    else:
        acc = tl.zeros([TP, BLOCK_N, BLOCK_K], dtype=tl.float32)
    sq = tl.zeros([TP, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        kmask = k < K
        m = tmask[:, None] & kmask[None, :]
        xo = x_ptr + t[:, None] * stride_x + k[None, :]
        if ACT:
            gate = tl.load(xo, mask=m, other=0.0).to(tl.float32)
            xv = gate * tl.sigmoid(gate) * tl.load(xo + K, mask=m, other=0.0).to(tl.float32)
        else:
            xv = tl.load(xo, mask=m, other=0.0)
            if RESID:
                xv = (xv.to(tl.float32) + tl.load(r_ptr + t[:, None] * stride_r + k[None, :], mask=m, other=0.0).to(tl.float32))
                xv = xv.to(h_ptr.dtype.element_ty)
                tl.store(h_ptr + t[:, None] * K + k[None, :], xv, mask=m & ((k // BLOCK_K) % nprog == pid)[None, :])
            xv = xv.to(tl.float32)
            if NORM:
                sq += xv * xv
                xv = xv * tl.load(g_ptr + k, mask=kmask, other=0.0).to(tl.float32)[None, :]
        xv = xv.to(w_ptr.dtype.element_ty)
        w = tl.load(w_ptr + n[:, None].to(tl.int64) * stride_w + k[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0,
                    eviction_policy="evict_first")  # read once: keep L2 for x and what follows
        if DOT and UPCAST:
            acc = tl.dot(xv.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
        elif DOT:
            acc = tl.dot(xv, tl.trans(w), acc)
        elif TP == 1:  # one token: a 2-D accumulator
            acc += w.to(tl.float32) * tl.sum(xv.to(tl.float32), axis=0)[None, :]
        else:
            acc += w.to(tl.float32)[None, :, :] * xv.to(tl.float32)[:, None, :]
    if DOT:
        y = acc
    elif TP == 1:
        y = tl.sum(acc, axis=1)[None, :]
    else:
        y = tl.sum(acc, axis=2)
    if NORM:
        y *= tl.rsqrt(tl.sum(sq, axis=1) / K + eps)[:, None]
    tl.store(y_ptr + t[:, None] * N + n[None, :], y.to(y_ptr.dtype.element_ty), mask=tmask[:, None] & nmask[None, :])


def launch(x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None,
           eps: float = 0.0, act: bool = False, config: tuple[int, int, int, int, int] | None = None
           ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One launch of the kernel, outside any custom op (the ops below and the benchmark's sweep call it).

    x: [T, K] (or [T, 2·K] with ``act``), unit column stride; w: [N, K]; residual: [T, K] or None; norm_weight: [K] or
    None. config: (BLOCK_N, BLOCK_K, num_warps, num_stages, dot), default :func:`config_for`. Returns (y [T, N] in x's
    dtype, the new residual x + residual [T, K] or None)."""
    T = x.shape[0]
    N, K = w.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    if (x.shape[1] != 2 * K) if act else (x.shape[1] != K):
        raise ValueError(f"skinny_gemm: x {tuple(x.shape)} against weight {tuple(w.shape)}{' (act: x holds 2·K)' if act else ''}")
    if act and (residual is not None or norm_weight is not None):
        raise ValueError("skinny_gemm: act excludes residual and norm_weight")
    block_n, block_k, warps, stages, dot = config or config_for(T, N, K)
    if dot and block_n < 16:
        raise ValueError(f"skinny_gemm: config {config}: dot needs BLOCK_N ≥ 16")
    w = w if w.stride(-1) == 1 else w.contiguous()
    y = torch.empty(T, N, dtype=x.dtype, device=x.device)
    h = None
    if residual is not None:
        residual = residual if residual.stride(-1) == 1 else residual.contiguous()
        h = torch.empty(T, K, dtype=x.dtype, device=x.device)
    with on_device(x):
        _skinny[(triton.cdiv(N, block_n),)](
            x, residual if residual is not None else x, norm_weight if norm_weight is not None else x, w, y,
            h if h is not None else y, T, N, K, x.stride(0), residual.stride(0) if residual is not None else 0, w.stride(0),
            float(eps), TP=16 if dot else triton.next_power_of_2(T), RESID=residual is not None, NORM=norm_weight is not None,
            ACT=act, DOT=bool(dot), UPCAST=INTERPRETED, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages)
    return y, h


@torch.library.custom_op("splitspec::skinny_linear", mutates_args=())
def _linear_op(x: torch.Tensor, w: torch.Tensor, act: bool) -> torch.Tensor:
    return launch(x, w, act=act)[0]


@_linear_op.register_fake
def _(x, w, act):
    return x.new_empty(x.shape[0], w.shape[0])


@torch.library.custom_op("splitspec::skinny_norm_linear", mutates_args=())
def _norm_linear_op(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, w: torch.Tensor,
                    eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    y, h = launch(x, w, residual, norm_weight, eps)
    return y, x.new_empty(0) if h is None else h  # an op's outputs may not alias its inputs


@_norm_linear_op.register_fake
def _(x, residual, norm_weight, w, eps):
    return x.new_empty(x.shape[0], w.shape[0]), x.new_empty(0) if residual is None else x.new_empty(x.shape)


def linear(x: torch.Tensor, w: torch.Tensor, act: bool = False) -> torch.Tensor:
    """x [T, K] · w [N, K]ᵀ → [T, N]; with ``act`` x is [T, 2·K] (gate, up) and the product is silu(gate) · up · wᵀ."""
    return _linear_op(x, w, act)


def norm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, w: torch.Tensor,
                eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of s = x + residual (s = x when residual is None) into the product: returns (rms_norm(s, norm_weight,
    eps) · wᵀ [T, N], s [T, K]). x, residual: [T, K]; norm_weight: [K]; w: [N, K]. With residual None, s is x
    itself (no copy; not to be written to in place)."""
    if residual is None:
        return _norm_linear_op(x, None, norm_weight, w, eps)[0], x
    return _norm_linear_op(x, residual, norm_weight, w, eps)
