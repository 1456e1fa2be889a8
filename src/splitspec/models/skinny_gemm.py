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

Two ways to multiply (a configuration's form): float32 multiply-adds (:data:`FMA`), one [BLOCK_N, BLOCK_K]
accumulator per token summed over its K lanes at the end, or ``tl.dot`` on the tensor cores (:data:`DOT`, tokens
padded to 16 rows, float32 accumulation; BLOCK_N ≥ 16).

**Batch invariance.** Greedy speculation is lossless only if a verify of k + 1 tokens gives each token's product the
same bits as a one-token decode (cuBLAS does, for 1–8 tokens: ``tests/gpu/test_gpu_skinny_gemm.py``). Here a
shape's configuration is the same for every token count (:data:`CONFIGS` is keyed by shape class, not tokens), and
in either form a token's sums do not depend on the others': the multiply-add kernel runs the same code for token i
whatever T (its own accumulator, the same tile layout, the same K order), and a dot's output row depends on its own
input row only, with the same instructions whatever T. The prologues are folded for every token count or none.
Block sizes come from :data:`CONFIGS` by shape class (:func:`shape_class`), filled from the sweep of
``bench/lab/skinny_gemm_bench.py``.

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

#: Tokens the kernel serves; more go to cuBLAS (each program's x tile and accumulators grow with the tokens).
MAX_TOKENS = 8

#: The two ways to multiply (a config's last field): float32 multiply-adds, one accumulator tile per token, which take
#: the folded prologues at no measurable cost; or ``tl.dot`` on the tensor cores (tokens padded to 16 rows), where a
#: prologue made the product 2.5–7× slower on an H200 (docs/lab/2026-12-03-h200-branches-timed), so the target folds
#: nothing into a product of that form.
FMA, DOT = 0, 1

#: (BLOCK_N, BLOCK_K, num_warps, num_stages, form) by :func:`shape_class` (N class, K class): one configuration for
#: every token count 1 … :data:`MAX_TOKENS`, which is what makes a token's product the same bits alone and among
#: others (the module docstring); None: the class stays with cuBLAS. A class missing here takes
#: :data:`DEFAULT_CONFIG`. From ``bench/lab/skinny_gemm_bench.py`` on an H100 (summed over the class's shapes and
#: 1 / 2 / 4 / 8 tokens, against cuBLAS; docs/lab/2026-12-06-h100-skinny-invariant): the multiply-add form, fastest at
#: one token, costs 1.9–3.4× cuBLAS at eight, so no class chose it and nothing is folded with these.
CONFIGS: dict[tuple[str, str], tuple[int, int, int, int, int] | None] = {
    ("mid", "long"): (64, 256, 4, 4, DOT),  # 543.9 vs 597.9 µs: tp1.w2, tp2.w2
    ("mid", "mid"): (64, 256, 4, 4, DOT),  # 362.9 vs 375.5 µs: tp1.o_proj, tp2.o_proj, tp8.w13
    ("mid", "short"): (64, 256, 4, 3, DOT),  # 99.1 vs 103.2 µs: tp8.o_proj, tp8.shared.w2, tp8.w2
    ("narrow", "mid"): None,  # cuBLAS 94.6 µs: tp8.qkv_a, tp8.shared.w13
    ("narrow", "short"): None,  # cuBLAS 22.6 µs: tp8.q_b
    ("wide", "mid"): (32, 128, 4, 3, DOT),  # 1073.7 vs 1134.4 µs: tp1.w13, tp2.w13
}
DEFAULT_CONFIG = (8, 256, 4, 2, FMA)

#: N and K class edges: N ≤ 2560 "narrow" (fused_qkv_a, q_b_proj), ≤ 8192 "mid" (TP8's w13 / w2 / o_proj), else
#: "wide"; K ≤ 2560 "short" (TP8's w2 / o_proj / q_b_proj), ≤ 8192 "mid" (hidden 7168), else "long".
N_EDGES = ((2560, "narrow"), (8192, "mid"))
K_EDGES = ((2560, "short"), (8192, "mid"))


def _edge(v: int, edges: tuple[tuple[int, str], ...], last: str) -> str:
    return next((name for top, name in edges if v <= top), last)


def shape_class(n: int, k: int) -> tuple[str, str]:
    """The :data:`CONFIGS` key of a product against W [n, k]."""
    return _edge(n, N_EDGES, "wide"), _edge(k, K_EDGES, "long")


def config_for(n: int, k: int) -> tuple[int, int, int, int, int] | None:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages, form) for products against W [n, k] (:data:`CONFIGS`, else the
    default); None where cuBLAS serves the class."""
    return CONFIGS.get(shape_class(n, k), DEFAULT_CONFIG)


def applies(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether the kernel serves x [T, K] · w [N, K]ᵀ in the engine: CUDA, 1 ≤ T ≤ :data:`MAX_TOKENS`, bf16 weight,
    a shape class with a configuration."""
    return (triton is not None and x.is_cuda and x.dim() == 2 and 1 <= x.shape[0] <= MAX_TOKENS
            and w.dim() == 2 and w.dtype == torch.bfloat16 and config_for(*w.shape) is not None)


def folds(w: torch.Tensor) -> bool:
    """Whether prologues are folded into products against ``w`` [N, K]: its class multiplies by multiply-adds."""
    cfg = config_for(*w.shape)
    return cfg is not None and cfg[4] == FMA


@jit
def _prologue(xo, ro, ho, g, m, store_h, sq, K, RESID: tl.constexpr, NORM: tl.constexpr, ACT: tl.constexpr):
    """x's tile at pointers ``xo`` after the prologues, float32, and ``sq`` plus its squares (NORM). ``ro``, ``ho``:
    the residual's and the new residual's tile pointers (RESID; the new residual stored where ``store_h``); ``g``: the
    norm weight's tile (float32, broadcast against the tile); ``m``: the tile's mask. Any tile shape ([BLOCK_K] or
    [tokens, BLOCK_K])."""
    if ACT:
        gate = tl.load(xo, mask=m, other=0.0).to(tl.float32)
        xv = gate * tl.sigmoid(gate) * tl.load(xo + K, mask=m, other=0.0).to(tl.float32)
    else:
        xv = tl.load(xo, mask=m, other=0.0)
        if RESID:
            xv = (xv.to(tl.float32) + tl.load(ro, mask=m, other=0.0).to(tl.float32)).to(ho.dtype.element_ty)
            tl.store(ho, xv, mask=store_h)
        xv = xv.to(tl.float32)
        if NORM:
            sq += xv * xv
            xv = xv * g
    return xv, sq


@jit
def _fma_token(acc, sq, w, w_ptr, i, x_ptr, r_ptr, h_ptr, g, k, kmask, store_h, stride_x, stride_r, K,
               RESID: tl.constexpr, NORM: tl.constexpr, ACT: tl.constexpr):
    """Token i's multiply-adds over one K step: acc [BLOCK_N, BLOCK_K] += w (the tile in float32) · x_i (rounded to
    the weight's dtype, as the product's operand)."""
    xv, sq = _prologue(x_ptr + i * stride_x + k, r_ptr + i * stride_r + k, h_ptr + i * K + k, g, kmask, kmask & store_h,
                       sq, K, RESID, NORM, ACT)
    return acc + w * xv.to(w_ptr.dtype.element_ty).to(tl.float32)[None, :], sq


@jit
def _store_token(y_ptr, i, n, nmask, N, acc, sq, K, eps, NORM: tl.constexpr):
    """Row i of y: the accumulator summed over its K lanes (× the token's rsqrt(mean square + eps) with NORM)."""
    y = tl.sum(acc, axis=1)
    if NORM:
        y *= tl.rsqrt(tl.sum(sq, axis=0) / K + eps)
    tl.store(y_ptr + i * N + n, y.to(y_ptr.dtype.element_ty), mask=nmask)


@jit
def _skinny_fma(x_ptr, r_ptr, g_ptr, w_ptr, y_ptr, h_ptr, N, K, stride_x, stride_r, stride_w, eps, T: tl.constexpr,
                RESID: tl.constexpr, NORM: tl.constexpr, ACT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Rows [pid·BLOCK_N, +BLOCK_N) of y [T, N] by float32 multiply-adds: one accumulator per token (T ≤ 8), each
    token's the same code whatever T, so a token's sums run in the same order alone and among others. The eight
    accumulators are named and their steps written out, a line each: a Triton loop cannot carry a list of tensors."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < N
    a0 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    a1, a2, a3, a4, a5, a6, a7 = a0, a0, a0, a0, a0, a0, a0
    s0 = tl.zeros([BLOCK_K], dtype=tl.float32)
    s1, s2, s3, s4, s5, s6, s7 = s0, s0, s0, s0, s0, s0, s0
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        kmask = k < K
        store_h = (k // BLOCK_K) % nprog == pid  # each K step of the new residual stored by one program
        g = tl.load(g_ptr + k, mask=kmask, other=0.0).to(tl.float32) if NORM else 0.0
        w = tl.load(w_ptr + n[:, None].to(tl.int64) * stride_w + k[None, :], mask=nmask[:, None] & kmask[None, :],
                    other=0.0, eviction_policy="evict_first").to(tl.float32)  # read once: keep L2 for x
        a0, s0 = _fma_token(a0, s0, w, w_ptr, 0, x_ptr, r_ptr, h_ptr, g, k, kmask, store_h, stride_x, stride_r, K, RESID, NORM, ACT)
        if T > 1:
            a1, s1 = _fma_token(a1, s1, w, w_ptr, 1, x_ptr, r_ptr, h_ptr, g, k, kmask, store_h, stride_x, stride_r, K, RESID, NORM, ACT)
        if T > 2:
            a2, s2 = _fma_token(a2, s2, w, w_ptr, 2, x_ptr, r_ptr, h_ptr, g, k, kmask, store_h, stride_x, stride_r, K, RESID, NORM, ACT)
        if T > 3:
            a3, s3 = _fma_token(a3, s3, w, w_ptr, 3, x_ptr, r_ptr, h_ptr, g, k, kmask, store_h, stride_x, stride_r, K, RESID, NORM, ACT)
        if T > 4:
            a4, s4 = _fma_token(a4, s4, w, w_ptr, 4, x_ptr, r_ptr, h_ptr, g, k, kmask, store_h, stride_x, stride_r, K, RESID, NORM, ACT)
        if T > 5:
            a5, s5 = _fma_token(a5, s5, w, w_ptr, 5, x_ptr, r_ptr, h_ptr, g, k, kmask, store_h, stride_x, stride_r, K, RESID, NORM, ACT)
        if T > 6:
            a6, s6 = _fma_token(a6, s6, w, w_ptr, 6, x_ptr, r_ptr, h_ptr, g, k, kmask, store_h, stride_x, stride_r, K, RESID, NORM, ACT)
        if T > 7:
            a7, s7 = _fma_token(a7, s7, w, w_ptr, 7, x_ptr, r_ptr, h_ptr, g, k, kmask, store_h, stride_x, stride_r, K, RESID, NORM, ACT)
    _store_token(y_ptr, 0, n, nmask, N, a0, s0, K, eps, NORM)
    if T > 1:
        _store_token(y_ptr, 1, n, nmask, N, a1, s1, K, eps, NORM)
    if T > 2:
        _store_token(y_ptr, 2, n, nmask, N, a2, s2, K, eps, NORM)
    if T > 3:
        _store_token(y_ptr, 3, n, nmask, N, a3, s3, K, eps, NORM)
    if T > 4:
        _store_token(y_ptr, 4, n, nmask, N, a4, s4, K, eps, NORM)
    if T > 5:
        _store_token(y_ptr, 5, n, nmask, N, a5, s5, K, eps, NORM)
    if T > 6:
        _store_token(y_ptr, 6, n, nmask, N, a6, s6, K, eps, NORM)
    if T > 7:
        _store_token(y_ptr, 7, n, nmask, N, a7, s7, K, eps, NORM)


@jit
def _skinny_dot(x_ptr, r_ptr, g_ptr, w_ptr, y_ptr, h_ptr, T, N, K, stride_x, stride_r, stride_w, eps,
                RESID: tl.constexpr, NORM: tl.constexpr, ACT: tl.constexpr, UPCAST: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Rows [pid·BLOCK_N, +BLOCK_N) of y [T, N] on the tensor cores, the T ≤ 16 tokens padded to 16 rows (the same
    instructions whatever T; each output row of a dot depends on its own row only). UPCAST: the operands in float32
    (the interpreter, whose bf16 ``tl.dot`` is wrong)."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < N
    t = tl.arange(0, 16)
    tmask = t < T
    acc = tl.zeros([16, BLOCK_N], dtype=tl.float32)
    sq = tl.zeros([16, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        kmask = k < K
        m = tmask[:, None] & kmask[None, :]
        g = tl.load(g_ptr + k, mask=kmask, other=0.0).to(tl.float32)[None, :] if NORM else 0.0
        xv, sq = _prologue(x_ptr + t[:, None] * stride_x + k[None, :], r_ptr + t[:, None] * stride_r + k[None, :],
                           h_ptr + t[:, None] * K + k[None, :], g, m, m & ((k // BLOCK_K) % nprog == pid)[None, :], sq, K,
                           RESID, NORM, ACT)
        xv = xv.to(w_ptr.dtype.element_ty)
        w = tl.load(w_ptr + n[:, None].to(tl.int64) * stride_w + k[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0,
                    eviction_policy="evict_first")
        if UPCAST:
            acc = tl.dot(xv.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
        else:
            acc = tl.dot(xv, tl.trans(w), acc)
    if NORM:
        acc *= tl.rsqrt(tl.sum(sq, axis=1) / K + eps)[:, None]
    tl.store(y_ptr + t[:, None] * N + n[None, :], acc.to(y_ptr.dtype.element_ty), mask=tmask[:, None] & nmask[None, :])


def launch(x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None,
           eps: float = 0.0, act: bool = False, config: tuple[int, int, int, int, int] | None = None
           ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One launch of the kernel, outside any custom op (the ops below and the benchmark's sweep call it).

    x: [T, K] (or [T, 2·K] with ``act``), T ≤ :data:`MAX_TOKENS`, unit column stride; w: [N, K] bf16; residual: [T, K]
    or None; norm_weight: [K] or None. config: (BLOCK_N, BLOCK_K, num_warps, num_stages, form), default
    :func:`config_for` (which must not be None). Returns (y [T, N] in x's dtype, the new residual x + residual [T, K]
    or None)."""
    if x.dim() != 2 or w.dim() != 2:
        raise ValueError(f"skinny_gemm: x {tuple(x.shape)}, weight {tuple(w.shape)}: expected [T, K] and [N, K]")
    T = x.shape[0]
    N, K = w.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    if (x.shape[1] != 2 * K) if act else (x.shape[1] != K):
        raise ValueError(f"skinny_gemm: x {tuple(x.shape)} against weight {tuple(w.shape)}{' (act: x holds 2·K)' if act else ''}")
    if not 1 <= T <= MAX_TOKENS:
        raise ValueError(f"skinny_gemm: x has {T} tokens, expected 1 … {MAX_TOKENS}")
    if act and (residual is not None or norm_weight is not None):
        raise ValueError("skinny_gemm: act excludes residual and norm_weight")
    if residual is not None and tuple(residual.shape) != (T, K):
        raise ValueError(f"skinny_gemm: residual {tuple(residual.shape)}, expected {(T, K)}")
    if norm_weight is not None and tuple(norm_weight.shape) != (K,):
        raise ValueError(f"skinny_gemm: norm_weight {tuple(norm_weight.shape)}, expected ({K},)")
    config = config or config_for(N, K)
    if config is None:
        raise ValueError(f"skinny_gemm: no configuration for weight {tuple(w.shape)} (its class stays with cuBLAS)")
    if (len(config) != 5 or config[4] not in (FMA, DOT) or any(b < 1 or b & (b - 1) for b in config[:2])
            or config[4] == DOT and min(config[:2]) < 16):
        raise ValueError(f"skinny_gemm: config {config}: expected (BLOCK_N, BLOCK_K, num_warps, num_stages, form) with "
                         f"BLOCK_N and BLOCK_K powers of two, form {FMA} or {DOT}, and both ≥ 16 for dot")
    block_n, block_k, warps, stages, form = config
    w = w if w.stride(-1) == 1 else w.contiguous()
    if norm_weight is not None:
        norm_weight = norm_weight.contiguous()
    y = torch.empty(T, N, dtype=x.dtype, device=x.device)
    h = None
    if residual is not None:
        residual = residual if residual.stride(-1) == 1 else residual.contiguous()
        h = torch.empty(T, K, dtype=x.dtype, device=x.device)
    args = (x, residual if residual is not None else x, norm_weight if norm_weight is not None else x, w, y,
            h if h is not None else y)
    flags = dict(RESID=residual is not None, NORM=norm_weight is not None, ACT=act, BLOCK_N=block_n, BLOCK_K=block_k,
                 num_warps=warps, num_stages=stages)
    strides = (x.stride(0), residual.stride(0) if residual is not None else 0, w.stride(0), float(eps))
    with on_device(x):
        if form == DOT:
            _skinny_dot[(triton.cdiv(N, block_n),)](*args, T, N, K, *strides, UPCAST=INTERPRETED, **flags)
        else:
            _skinny_fma[(triton.cdiv(N, block_n),)](*args, N, K, *strides, T=T, **flags)
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
