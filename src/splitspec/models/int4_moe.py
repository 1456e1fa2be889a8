"""W4A16 MoE decode kernels: routed experts kept INT4 as Kimi-K2-Thinking / K2.5 publish them, for a few tokens.

Weight format (compressed-tensors ``pack-quantized``, symmetric, as :mod:`splitspec.quant` reads it): an expert's
linear [N, K] is ``packed`` int32 [N, K/8], value j of word w being bits 4j..4j+3 of that word and standing for
column 8w + j, stored with an offset of 8 (value = nibble − 8), and ``scale`` [N, K/G] (bf16 as published, G = 32
in Kimi's checkpoints): weight[n, k] = (nibble − 8) · scale[n, k // G]. Here the experts are stacked:
w13 packed [E, 2·I, H/8] (gate rows, then up rows) with scales [E, 2·I, H/G]; w2 packed [E, H, I/8] with scales
[E, H, I/G].

Two kernels, as :mod:`splitspec.models.fused_moe`'s float/FP8 path, reading only 4 bits per weight:

1. ``gate_up``: one program per ((token, slot) pair, block of intermediate rows): the expert's gate and up rows
   against the token, ``silu(gate) · up`` in float32. Each K step reads BLOCK_K/8 words per row and their
   scales, and unpacks the nibbles in registers (see ``_int4_dot``).
2. ``down``: one program per (token, block of hidden rows): the token's slots' down rows times their activation and
   routing weight, summed in float32.

Pairs routed to another rank (ids outside [0, E_local)) read nothing. No sort, no atomics: each token's result
depends on that token only. The kernels run on CUDA tensors, and on CPU under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import torch

from splitspec.models.fused_moe import available, jit, on_device, tl, triton

#: (BLOCK_N, BLOCK_K, num_warps, num_stages) of each kernel; BLOCK_K is a multiple of the group size.
GATE_UP_CONFIG = (16, 256, 4, 4)
DOWN_CONFIG = (16, 256, 4, 4)


@jit
def _int4_dot(x_row, packed, scales, r, rmask, K, k0, stride_pn, stride_sn, G: tl.constexpr, BLOCK_K: tl.constexpr):
    """[len(r), BLOCK_K // 8] float32: rows r of the INT4 linear, columns k0..k0+BLOCK_K, times x there, summed
    over each word's 8 columns and scaled by the word's group scale (the caller sums over words at the end).

    A word w holds columns 8w..8w+7, low nibble first; all 8 share the scale of group 8w // G. Per word: one load
    of the word and one of its scale (the G/8 words of a group hit the same cache line), then for each of the 8
    nibble positions a shift, a mask, an add and a multiply-add against x's column; the offset of 8 is taken
    out once per word as 8 · Σ x over its columns, which is the same for every row."""
    w = k0 // 8 + tl.arange(0, BLOCK_K // 8)
    wmask = w < K // 8
    mask = rmask[:, None] & wmask[None, :]
    rows = r[:, None].to(tl.int64)
    words = tl.load(packed + rows * stride_pn + w[None, :], mask=mask, other=0)
    acc = tl.zeros(words.shape, dtype=tl.float32)
    xsum = tl.zeros(w.shape, dtype=tl.float32)
    for j in tl.static_range(8):
        xj = tl.load(x_row + w * 8 + j, mask=wmask, other=0.0).to(tl.float32)
        # nibble → float without an int-to-float conversion (a quarter-rate instruction): 2^23 + nibble has the
        # nibble as its mantissa bits, so OR-ing the exponent of 2^23 in and subtracting 2^23 gives it exactly
        nib = (((words >> (4 * j)) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
        acc += nib * xj[None, :]
        xsum += xj
    s = tl.load(scales + rows * stride_sn + (w * 8 // G)[None, :], mask=mask, other=0.0).to(tl.float32)
    return (acc - 8.0 * xsum[None, :]) * s


@jit
def _gate_up(x_ptr, ids_ptr, p_ptr, s_ptr, act_ptr, H, I, E, top_k, stride_pe, stride_pn, stride_se, stride_sn, act_stride,
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
        tl.store(act_ptr + p * act_stride + n, g / (1.0 + tl.exp(-g)) * tl.sum(acc_u, axis=1), mask=n < I)


@jit
def _down(act_ptr, ids_ptr, wt_ptr, p_ptr, s_ptr, out_ptr, H, I, E, top_k, stride_pe, stride_pn, stride_se, stride_sn,
          act_stride, G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    t = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_N, BLOCK_K // 8], dtype=tl.float32)
    for j in range(0, top_k):
        p = t * top_k + j
        e = tl.load(ids_ptr + p).to(tl.int64)
        if (e >= 0) & (e < E):
            wt = tl.load(wt_ptr + p)
            for k0 in range(0, I, BLOCK_K):
                acc += wt * _int4_dot(act_ptr + p * act_stride, p_ptr + e * stride_pe, s_ptr + e * stride_se, n, n < H, I,
                                      k0, stride_pn, stride_sn, G, BLOCK_K)
    tl.store(out_ptr + t * H + n, tl.sum(acc, axis=1).to(out_ptr.dtype.element_ty), mask=n < H)


def check_int4_experts(w13_packed: torch.Tensor, w13_scale: torch.Tensor, w2_packed: torch.Tensor, w2_scale: torch.Tensor,
                       hidden: int, group: int) -> tuple[int, int]:
    """Check the stacked INT4 expert tensors against each other; returns (E, I).

    Raises:
        ValueError: naming the tensor and the shape it should have.
    """
    if w13_packed.dtype != torch.int32 or w2_packed.dtype != torch.int32:
        raise ValueError(f"INT4 experts: packed weights must be int32, got {w13_packed.dtype} / {w2_packed.dtype}")
    if group % 8 or hidden % group:
        raise ValueError(f"INT4 experts: group size {group} must be a multiple of 8 dividing hidden size {hidden}")
    E, two_i = w13_packed.shape[0], w13_packed.shape[1]
    I = two_i // 2
    expect = {"w13_packed": (w13_packed, (E, 2 * I, hidden // 8)), "w13_scale": (w13_scale, (E, 2 * I, hidden // group)),
              "w2_packed": (w2_packed, (E, hidden, I // 8)), "w2_scale": (w2_scale, (E, hidden, I // group))}
    if I % group or two_i % 2:
        raise ValueError(f"INT4 experts: intermediate size {I} must be a multiple of the group size {group}")
    for name, (t, shape) in expect.items():
        if tuple(t.shape) != shape:
            raise ValueError(f"INT4 experts: {name} has shape {list(t.shape)}, expected {list(shape)}")
    return E, I


@torch.library.custom_op("splitspec::int4_experts", mutates_args=())
def _int4_experts_op(x: torch.Tensor, local: torch.Tensor, weights: torch.Tensor, w13_packed: torch.Tensor,
                     w13_scale: torch.Tensor, w2_packed: torch.Tensor, w2_scale: torch.Tensor, group: int,
                     gate_up_config: list[int], down_config: list[int]) -> torch.Tensor:
    with on_device(x):
        T, H = x.shape
        top_k = local.shape[1]
        E, I = w13_packed.shape[0], w13_packed.shape[1] // 2
        x, ids = x.contiguous(), local.to(torch.int32).contiguous()
        p13, s13, p2, s2 = (t.contiguous() for t in (w13_packed, w13_scale, w2_packed, w2_scale))
        act = torch.empty(T * top_k, I, dtype=torch.float32, device=x.device)
        out = torch.empty_like(x)
        (gu_n, gu_k, gu_w, gu_s), (dn_n, dn_k, dn_w, dn_s) = gate_up_config, down_config
        _gate_up[(T * top_k, triton.cdiv(I, gu_n))](
            x, ids, p13, s13, act, H, I, E, top_k, p13.stride(0), p13.stride(1), s13.stride(0), s13.stride(1), I,
            G=group, BLOCK_N=gu_n, BLOCK_K=min(gu_k, triton.next_power_of_2(H)), num_warps=gu_w, num_stages=gu_s)
        _down[(T, triton.cdiv(H, dn_n))](
            act, ids, weights.to(torch.float32).contiguous(), p2, s2, out, H, I, E, top_k, p2.stride(0), p2.stride(1),
            s2.stride(0), s2.stride(1), I, G=group, BLOCK_N=dn_n, BLOCK_K=min(dn_k, triton.next_power_of_2(I)),
            num_warps=dn_w, num_stages=dn_s)
        return out


@_int4_experts_op.register_fake
def _(x, local, weights, w13_packed, w13_scale, w2_packed, w2_scale, group, gate_up_config, down_config):
    return torch.empty_like(x)


def int4_experts(x: torch.Tensor, local: torch.Tensor, weights: torch.Tensor, w13_packed: torch.Tensor,
                 w13_scale: torch.Tensor, w2_packed: torch.Tensor, w2_scale: torch.Tensor, group: int = 32,
                 gate_up_config: tuple[int, int, int, int] | None = None,
                 down_config: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """This rank's routed experts for a few tokens, their weights INT4 (see the module docstring), in two kernels.

    x [T, H] float (bf16 in the engine); local [T, top_k] integer expert ids relative to this rank's first expert
    (outside [0, E_local): another rank's, skipped); weights [T, top_k] float32 routing weights. Returns [T, H]
    in x's dtype: Σ_slots weight · W2[e] (silu(W_gate[e] x) ⊙ W_up[e] x), with W = (nibble − 8) · scale, summed in
    float32 — the same as :func:`splitspec.models.fused_moe.fused_experts` on the dequantised weights
    (:func:`splitspec.quant.dequantize_int4`) up to the order of the float32 sums. BLOCK_K of each config must be
    a multiple of ``group``.
    """
    if not available():
        raise RuntimeError("INT4 experts need Triton (it comes with CUDA builds of PyTorch)")
    gate_up_config, down_config = gate_up_config or GATE_UP_CONFIG, down_config or DOWN_CONFIG
    for name, cfg in (("gate_up_config", gate_up_config), ("down_config", down_config)):
        if cfg[1] % group:
            raise ValueError(f"INT4 experts: {name} BLOCK_K {cfg[1]} must be a multiple of the group size {group}")
    return _int4_experts_op(x, local, weights, w13_packed, w13_scale, w2_packed, w2_scale, int(group),
                            list(gate_up_config), list(down_config))
