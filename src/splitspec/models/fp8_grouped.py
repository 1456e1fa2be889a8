"""Block-scaled FP8 routed experts as W8A16 grouped GEMMs: the path of FP8-kept experts past the fused decode kernels'
limit (:data:`splitspec.models.fused_moe.MAX_TOKENS`) on a GPU — prefill chunks and large verifies — in place of
dequantising every expert of the rank per call (``quant.dequantize_fp8`` of the stacked weights: 12 bytes of
transients per weight, and all of them read and written at every layer whatever the tokens chose).

Layout as the engine keeps it (``docs/formats.md``): w13 float8_e4m3fn [E, 2·I, H] (gate rows, then up rows), w2
[E, H, I], each with float32 ``scale_inv`` [E, ⌈rows / B0⌉, ⌈cols / B1⌉] per B0 × B1 tile (DeepSeek-V3 / Kimi-K2:
128 × 128); weight = e4m3 value × its tile's scale_inv.

The (token, slot) pairs are sorted by expert and cut into blocks of at most BLOCK_M pairs of one expert
(:func:`splitspec.models.grouped_moe.expert_blocks`, shared with the INT4 grouped kernels); a program multiplies one
block by BLOCK_N rows of its expert's weights, K in steps of BLOCK_K inside one tile column (B1 % BLOCK_K == 0): the
e4m3 tile converted to bf16 in registers (exact: every e4m3 value is a bf16), one tensor-core product with the
pairs' bf16 activations, scaled per row by the tile's scale_inv into a float32 accumulator. Each chosen expert's
weights are read once per block of its pairs; unchosen experts are not read. Under Triton's interpreter (CPU tensors:
the tests) the operands are float32.
"""

from __future__ import annotations

import numbers
import os

import torch

from splitspec.models.fused_moe import available, jit, on_device, tl, triton
from splitspec.models.grouped_moe import block_pairs, expert_blocks

#: (BLOCK_M pairs, BLOCK_N rows, BLOCK_K columns, num_warps, num_stages) of the gate/up and down kernels: the
#: fastest of ``bench/lab/fp8_grouped_bench.py --sweep`` over 64 and 512 tokens at the TP8 shard on an H200
#: (docs/lab/2026-12-04-h200-int4-fixup-fp8-grouped).
GATE_UP = (16, 64, 128, 4, 3)
DOWN = (16, 64, 128, 4, 3)


@jit
def _operand(v, F32: tl.constexpr):
    """A loaded tile as a tensor-core operand: bf16, or float32 under the interpreter."""
    return v.to(tl.float32) if F32 else v.to(tl.float32).to(tl.bfloat16)


@jit
def _scaled_rows(acc, w_ptr, s_ptr, rows, rmask, k0, K, xb, stride_wn, stride_sn, B0: tl.constexpr, B1: tl.constexpr,
                 BLOCK_K: tl.constexpr, F32: tl.constexpr):
    """acc + (W[rows, k0:k0+BLOCK_K] · xb) × scale_inv[rows // B0, k0 // B1] per row; xb [BLOCK_K, BLOCK_M]."""
    k = k0 + tl.arange(0, BLOCK_K)
    w = tl.load(w_ptr + rows[:, None] * stride_wn + k[None, :], mask=rmask[:, None] & (k < K)[None, :], other=0.0)
    s = tl.load(s_ptr + (rows // B0) * stride_sn + k0 // B1, mask=rmask, other=0.0)
    return acc + tl.dot(_operand(w, F32), xb) * s[:, None]


@jit
def _expert_block(order_ptr, bexp_ptr, bfirst_ptr, bcount_ptr, w_ptr, s_ptr, stride_we, stride_se, N,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's block and rows: (expert, or −1 past the last block; its pair indices [BLOCK_M] int64 and mask;
    the expert's weight and scale pointers; the program's output rows [BLOCK_N] of N and their mask)."""
    b = tl.program_id(0)
    e = tl.load(bexp_ptr + b).to(tl.int64)
    pair, pm = block_pairs(order_ptr, bfirst_ptr, bcount_ptr, b, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    return e, pair, pm, w_ptr + tl.maximum(e, 0) * stride_we, s_ptr + tl.maximum(e, 0) * stride_se, n, n < N


@jit
def _rows_tile(a_ptr, rows, rmask, k0, K, BLOCK_K: tl.constexpr, F32: tl.constexpr):
    """Columns k0..k0+BLOCK_K of rows ``rows`` of a [*, K] tensor, transposed: the right operand [BLOCK_K, BLOCK_M]."""
    k = k0 + tl.arange(0, BLOCK_K)
    return _operand(tl.load(a_ptr + rows[None, :] * K + k[:, None], mask=(k < K)[:, None] & rmask[None, :], other=0.0), F32)


@jit
def _gate_up(x_ptr, order_ptr, bexp_ptr, bfirst_ptr, bcount_ptr, w_ptr, s_ptr, act_ptr, H, I, top_k, stride_we, stride_wn,
             stride_se, stride_sn, B0: tl.constexpr, B1: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
             BLOCK_K: tl.constexpr, F32: tl.constexpr):
    """act [P, I] = silu(gate) · up of each pair (row t·top_k + slot); x [T, H]."""
    e, pair, pm, w, s, n, nm = _expert_block(order_ptr, bexp_ptr, bfirst_ptr, bcount_ptr, w_ptr, s_ptr, stride_we,
                                             stride_se, I, BLOCK_M, BLOCK_N)
    if e >= 0:
        acc_g = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            xb = _rows_tile(x_ptr, pair // top_k, pm, k0, H, BLOCK_K, F32)
            acc_g = _scaled_rows(acc_g, w, s, n, nm, k0, H, xb, stride_wn, stride_sn, B0, B1, BLOCK_K, F32)
            acc_u = _scaled_rows(acc_u, w, s, n + I, nm, k0, H, xb, stride_wn, stride_sn, B0, B1, BLOCK_K, F32)
        act = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
        tl.store(act_ptr + pair[None, :] * I + n[:, None], act.to(act_ptr.dtype.element_ty), mask=nm[:, None] & pm[None, :])


@jit
def _down(act_ptr, order_ptr, bexp_ptr, bfirst_ptr, bcount_ptr, wt_ptr, w_ptr, s_ptr, out_ptr, H, I, stride_we, stride_wn,
          stride_se, stride_sn, B0: tl.constexpr, B1: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
          BLOCK_K: tl.constexpr, F32: tl.constexpr):
    """out [P, H] float32: each pair's routing weight · W2[e] act, at row t·top_k + slot."""
    e, pair, pm, w, s, n, nm = _expert_block(order_ptr, bexp_ptr, bfirst_ptr, bcount_ptr, w_ptr, s_ptr, stride_we,
                                             stride_se, H, BLOCK_M, BLOCK_N)
    if e >= 0:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        for k0 in range(0, I, BLOCK_K):
            ab = _rows_tile(act_ptr, pair, pm, k0, I, BLOCK_K, F32)
            acc = _scaled_rows(acc, w, s, n, nm, k0, I, ab, stride_wn, stride_sn, B0, B1, BLOCK_K, F32)
        wt = tl.load(wt_ptr + pair, mask=pm, other=0.0)
        tl.store(out_ptr + pair[None, :] * H + n[:, None], acc * wt[None, :], mask=nm[:, None] & pm[None, :])


def _shape(t: torch.Tensor) -> str:
    return f"{str(t.dtype).removeprefix('torch.')} {list(t.shape)}"


def check(x: torch.Tensor, local: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor, s13: torch.Tensor,
          w2: torch.Tensor, s2: torch.Tensor, block, configs) -> tuple[int, int]:
    """The tile (B0, B1) as ints, after checking every argument of :func:`fp8_grouped_experts`. Raises ValueError
    naming the first that disagrees: a tensor on another device than x, or x on a CPU without Triton's interpreter
    (``TRITON_INTERPRET=1``); x not float [T, H]; local not integer [T, top_k]; weights not float of local's
    shape; w13 / w2 not float8_e4m3fn [E ≥ 1, 2·I, H] / [E, H, I]; a scale_inv not float32 one per tile; block not two
    positive integers; a config not 5 positive integers with BLOCK_M, BLOCK_N, BLOCK_K powers of two in 16..256,
    BLOCK_K dividing B1, num_warps a power of two ≤ 32 and num_stages ≤ 8."""
    err = lambda what: ValueError(f"FP8 grouped experts: {what}")  # noqa: E731
    named = {"x": x, "local": local, "weights": weights, "w13": w13, "w13_scale": s13, "w2": w2, "w2_scale": s2}
    for name, t in named.items():
        if not isinstance(t, torch.Tensor):
            raise err(f"{name} is {type(t).__name__}, expected a tensor")
        if t.device != x.device:
            raise err(f"{name} on {t.device}, expected x's device {x.device}")
    if x.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise err(f"x on {x.device}: the kernels need a CUDA device (or TRITON_INTERPRET=1 set before Triton is imported)")
    if w13.dim() != 3 or w13.dtype != torch.float8_e4m3fn or w13.shape[0] < 1 or w13.shape[1] % 2:
        raise err(f"w13 {_shape(w13)}, expected float8_e4m3fn [E ≥ 1, 2·I, H]")
    E, I2, H = w13.shape
    if w2.dtype != torch.float8_e4m3fn or tuple(w2.shape) != (E, H, I2 // 2):
        raise err(f"w2 {_shape(w2)}, expected float8_e4m3fn {[E, H, I2 // 2]} (w13's E, H, I)")
    if x.dim() != 2 or not x.is_floating_point() or x.shape[1] != H:
        raise err(f"x {_shape(x)}, expected a float [T, {H}] (w13's H)")
    if local.dim() != 2 or local.is_floating_point() or local.dtype == torch.bool or local.shape[0] != x.shape[0]:
        raise err(f"local {_shape(local)}, expected integer expert ids [{x.shape[0]}, top_k] (x's T)")
    if not weights.is_floating_point() or weights.shape != local.shape:
        raise err(f"weights {_shape(weights)}, expected float routing weights of local's shape {list(local.shape)}")
    ok = lambda v: isinstance(v, numbers.Integral) and not isinstance(v, bool) and v > 0  # noqa: E731
    if not isinstance(block, (tuple, list)) or len(block) != 2 or not all(map(ok, block)):
        raise err(f"block {block!r}, expected two positive integers (the tile's rows, columns)")
    B0, B1 = map(int, block)
    for name, w, sc in (("w13", w13, s13), ("w2", w2, s2)):
        want = [E, -(-w.shape[1] // B0), -(-w.shape[2] // B1)]
        if sc.dtype != torch.float32 or list(sc.shape) != want:
            raise err(f"{name} scale_inv {_shape(sc)}, expected float32 {want} (one per {B0}×{B1} tile)")
    if not isinstance(configs, (tuple, list)) or len(configs) != 2:
        raise err(f"configs {configs!r}, expected (gate_up, down)")
    pow2 = lambda v, lo, hi: lo <= v <= hi and v & (v - 1) == 0  # noqa: E731
    for name, c in zip(("gate_up", "down"), configs):
        if (not isinstance(c, (tuple, list)) or len(c) != 5 or not all(map(ok, c))
                or not all(pow2(v, 16, 256) for v in c[:3]) or B1 % c[2] or not pow2(c[3], 1, 32) or c[4] > 8):
            raise err(f"{name} config {c!r}, expected (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages): positive "
                      f"integers, the blocks powers of two in 16..256, BLOCK_K dividing the tile's {B1} columns, "
                      "num_warps a power of two ≤ 32, num_stages ≤ 8")
    return B0, B1


@torch.library.custom_op("splitspec::fp8_grouped_experts", mutates_args=())
def _fp8_grouped_op(x: torch.Tensor, local: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor, s13: torch.Tensor,
                    w2: torch.Tensor, s2: torch.Tensor, block: list[int], gate_up_config: list[int],
                    down_config: list[int]) -> torch.Tensor:
    with on_device(x):
        T, H = x.shape
        top_k, P = local.shape[1], local.numel()
        E, I = w13.shape[0], w13.shape[1] // 2
        f32 = not x.is_cuda
        (gm, gn, gk, gw, gs), (dm, dn, dk, dw, ds) = gate_up_config, down_config
        xc = x.to(torch.float32 if f32 else torch.bfloat16).contiguous()
        w13, w2, s13, s2 = w13.contiguous(), w2.contiguous(), s13.contiguous(), s2.contiguous()
        act = torch.empty(P, I, dtype=torch.float32 if f32 else torch.bfloat16, device=x.device)
        blocks = expert_blocks(local, E, gm)
        _gate_up[(blocks[1].shape[0], triton.cdiv(I, gn))](
            xc, *blocks, w13, s13, act, H, I, top_k, w13.stride(0), w13.stride(1), s13.stride(0), s13.stride(1),
            B0=block[0], B1=block[1], BLOCK_M=gm, BLOCK_N=gn, BLOCK_K=gk, F32=f32, num_warps=gw, num_stages=gs)
        out = torch.zeros(P, H, dtype=torch.float32, device=x.device)  # another rank's pairs: rows of zeros
        blocks = blocks if dm == gm else expert_blocks(local, E, dm)
        _down[(blocks[1].shape[0], triton.cdiv(H, dn))](
            act, *blocks, weights.to(torch.float32).contiguous(), w2, s2, out, H, I, w2.stride(0), w2.stride(1),
            s2.stride(0), s2.stride(1), B0=block[0], B1=block[1], BLOCK_M=dm, BLOCK_N=dn, BLOCK_K=dk, F32=f32,
            num_warps=dw, num_stages=ds)
        return out.view(T, top_k, H).sum(1).to(x.dtype)


@_fp8_grouped_op.register_fake
def _(x, local, weights, w13, s13, w2, s2, block, gate_up_config, down_config):
    return torch.empty_like(x)


def fp8_grouped_experts(x: torch.Tensor, local: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor,
                        w2: torch.Tensor, w2_scale: torch.Tensor, block: tuple[int, int],
                        configs: tuple[tuple[int, ...], tuple[int, ...]] = (GATE_UP, DOWN)) -> torch.Tensor:
    """Routed experts of this rank with block-scaled FP8 weights, any number of tokens: the contract of
    :func:`splitspec.models.grouped_moe.grouped_experts` on the dequantised weights. x: [T, H]; local: [T, top_k]
    expert ids relative to this rank's first (outside [0, E): another rank's, skipped); weights: [T, top_k] float32.
    Returns [T, H] in x's dtype. Transients: act [T·top_k, I] bf16 and per-pair outputs [T·top_k, H] float32 (summed
    over slots at the end: no atomics). ``configs``: (gate_up, down), each (BLOCK_M, BLOCK_N, BLOCK_K, num_warps,
    num_stages)."""
    if not available():
        raise RuntimeError("FP8 grouped experts need Triton (it comes with CUDA builds of PyTorch)")
    block = check(x, local, weights, w13, w13_scale, w2, w2_scale, block, configs)
    configs = tuple(tuple(map(int, c)) for c in configs)
    return unchecked(x, local, weights, w13, w13_scale, w2, w2_scale, block, configs)


def unchecked(x: torch.Tensor, local: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor,
              w2: torch.Tensor, w2_scale: torch.Tensor, block: tuple[int, int],
              configs: tuple[tuple[int, ...], tuple[int, ...]] = (GATE_UP, DOWN)) -> torch.Tensor:
    """:func:`fp8_grouped_experts` without its argument checks (~16 µs of host time a call, once per MoE layer and
    forward): the engine's path, whose weights and scales the build wrote and whose activations and routing it makes
    itself."""
    return _fp8_grouped_op(x, local, weights, w13, w13_scale, w2, w2_scale, list(block), list(configs[0]), list(configs[1]))


def use_grouped(x: torch.Tensor) -> bool:
    """Whether FP8-kept experts over x [T, H] (past the fused kernels) take these kernels: a CUDA tensor, Triton
    importable. On the CPU the engine dequantises instead (the interpreter would be far slower)."""
    return x.is_cuda and available()
