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

import torch

from splitspec.models.fused_moe import available, jit, on_device, tl, triton
from splitspec.models.grouped_moe import block_pairs, expert_blocks

#: (BLOCK_M pairs, BLOCK_N rows, BLOCK_K columns, num_warps, num_stages) of the gate/up and down kernels.
GATE_UP = (32, 64, 128, 4, 3)
DOWN = (32, 64, 128, 4, 3)


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
def _expert_block(order_ptr, bexp_ptr, bfirst_ptr, bcount_ptr, w_ptr, s_ptr, stride_we, stride_se, BLOCK_M: tl.constexpr):
    """This program's block: (expert, or −1 past the last block; its pair indices [BLOCK_M] int64 and mask; the
    expert's weight and scale pointers)."""
    b = tl.program_id(0)
    e = tl.load(bexp_ptr + b).to(tl.int64)
    pair, pm = block_pairs(order_ptr, bfirst_ptr, bcount_ptr, b, BLOCK_M)
    return e, pair, pm, w_ptr + tl.maximum(e, 0) * stride_we, s_ptr + tl.maximum(e, 0) * stride_se


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
    e, pair, pm, w, s = _expert_block(order_ptr, bexp_ptr, bfirst_ptr, bcount_ptr, w_ptr, s_ptr, stride_we, stride_se, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nm = n < I
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
    e, pair, pm, w, s = _expert_block(order_ptr, bexp_ptr, bfirst_ptr, bcount_ptr, w_ptr, s_ptr, stride_we, stride_se, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nm = n < H
    if e >= 0:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        for k0 in range(0, I, BLOCK_K):
            ab = _rows_tile(act_ptr, pair, pm, k0, I, BLOCK_K, F32)
            acc = _scaled_rows(acc, w, s, n, nm, k0, I, ab, stride_wn, stride_sn, B0, B1, BLOCK_K, F32)
        wt = tl.load(wt_ptr + pair, mask=pm, other=0.0)
        tl.store(out_ptr + pair[None, :] * H + n[:, None], acc * wt[None, :], mask=nm[:, None] & pm[None, :])


def check(w13: torch.Tensor, s13: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor, block: tuple[int, int],
          configs: tuple[tuple[int, ...], tuple[int, ...]]) -> None:
    """Raise ValueError naming what disagrees: weights not float8_e4m3fn [E, 2I, H] / [E, H, I], scales not one per
    tile, a config's BLOCK_K not dividing the tile's B1 or blocks under 16."""
    E, I2, H = w13.shape
    if w13.dtype != torch.float8_e4m3fn or w2.dtype != torch.float8_e4m3fn or I2 % 2 or tuple(w2.shape) != (E, H, I2 // 2):
        raise ValueError(f"FP8 grouped experts: w13 {w13.dtype} {list(w13.shape)} and w2 {w2.dtype} {list(w2.shape)}, "
                         f"expected float8_e4m3fn [E, 2·I, H] and [E, H, I]")
    B0, B1 = block
    for name, w, s in (("w13", w13, s13), ("w2", w2, s2)):
        want = (E, -(-w.shape[1] // B0), -(-w.shape[2] // B1))
        if tuple(s.shape) != want:
            raise ValueError(f"FP8 grouped experts: {name} scale_inv {list(s.shape)}, expected {list(want)} ({B0}×{B1} tiles)")
    for name, (bm, bn, bk, *_) in zip(("gate_up", "down"), configs):
        if bm < 16 or bn < 16 or bk < 16 or B1 % bk:
            raise ValueError(f"FP8 grouped experts: {name} config BLOCK_M {bm}, BLOCK_N {bn}, BLOCK_K {bk}: each ≥ 16, "
                             f"BLOCK_K dividing the tile's {B1} columns")


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
    block = (int(block[0]), int(block[1]))
    check(w13, w13_scale, w2, w2_scale, block, configs)
    return _fp8_grouped_op(x, local, weights, w13, w13_scale, w2, w2_scale, list(block), list(configs[0]), list(configs[1]))


def use_grouped(x: torch.Tensor) -> bool:
    """Whether FP8-kept experts over x [T, H] (past the fused kernels) take these kernels: a CUDA tensor, Triton
    importable. On the CPU the engine dequantises instead (the interpreter would be far slower)."""
    return x.is_cuda and available()
