"""W4A16 MoE decode kernels: routed experts kept INT4 as Kimi-K2-Thinking / K2.5 publish them, for a few tokens.

Weight format (compressed-tensors ``pack-quantized``, symmetric, as :mod:`splitspec.quant` reads it): an expert's
linear [N, K] is ``packed`` int32 [N, K/8], value j of word w being bits 4j..4j+3 of that word and standing for
column 8w + j, stored with an offset of 8 (value = nibble − 8), and ``scale`` [N, K/G] (bf16 as published, G = 32
in Kimi's checkpoints): weight[n, k] = (nibble − 8) · scale[n, k // G]. Here the experts are stacked:
w13 packed [E, 2·I, H/8] (gate rows, then up rows) with scales [E, 2·I, H/G]; w2 packed [E, H, I/8] with scales
[E, H, I/G].

Two kernels, as :mod:`splitspec.models.fused_moe`'s float/FP8 path, reading only 4 bits per weight: ``gate_up``, one
program per ((token, slot) pair, block of intermediate rows[, K split]): the expert's gate and up rows against the
token, ``silu(gate) · up``; ``down``, one program per (token, block of hidden rows[, group of slots]): the token's
slots' down rows times their activation and routing weight, summed. Pairs routed to another rank (ids outside
[0, E_local)) read nothing. Without K or slot splits each token's result depends on that token only. The
kernels run on CUDA tensors, and on CPU under ``TRITON_INTERPRET=1``. Variants (:class:`Kernel`; which one the
engine takes is :func:`splitspec.models.int4_routed.kernel_for`):

- ``fma``: CUDA cores, float32, any float x (:mod:`splitspec.models.int4_fma`).
- ``mma``, ``mma_asm``: tensor cores, bf16 x. The packed words are read as int16, four nibbles each; nibble position
  j of a tile [BLOCK_N rows, BLOCK_K/4 int16] is its own bf16 tile and its own ``tl.dot`` against the activations at
  columns 4w + j (a sum over k may take k in any order). The weights are the left operand (rows in M), the
  token the right one, repeated over its 16 columns (the least Triton multiplies), so Triton moves the *packed*
  tile into the MMA's register layout and unpacks it there: (v >> 4j) & 0xF | 0x4300 is the bf16 128 + nibble,
  − 136 gives nibble − 8 exactly, × the group scale rounds as :func:`splitspec.quant.dequantize_int4` does. In
  ``mma_asm`` a thread's two int16 (one packed word) become two bf16 at once: PTX shr, lop3 (mask 0x000F000F,
  OR 0x43004300) and fma.bf16x2, three instructions for two weights; ``mma`` writes the same in Triton bit
  operations (under the interpreter, which cannot run PTX and keeps bf16 as raw integers: float32 tiles and
  activations, the same values unrounded). Splits: gate_up's programs may each take a share of H, adding float32
  partial gate and up sums into a workspace by atomics, the last program of a (pair, row block) putting the sums
  through silu (the fix-up of :func:`splitspec.models.int4_tiles.workspace`; inside a CUDA-graph capture before
  any eager call, partial sums that ``_silu_mul`` adds), or cut each K step into slices that
  different warps of one program take (a batched dot, the slices' sums added at the end: more warps on one token's
  rows without a second kernel); down's programs may each take a share of
  the slots, adding into a workspace the same way. Or down's programs take all of a token's slots in one
  dot (form 1 of :class:`Kernel`): the left operand stacks BLOCK_N rows of each slot's expert, the right one holds
  slot c's activations in column c (where the other forms repeat one pair's over 16 columns), and entry
  (slot s's rows, column s) is slot s's share — one K loop per program, the pipeline never drained between slots,
  a program's warps on different slots. The activations are rounded to bf16 for the tensor cores, as the bf16
  engine's grouped GEMMs round them.

Numerics: every tensor-core configuration (blocks, splits, down's form) computes the same products — x and the
activations rounded to bf16, each weight (nibble − 8) · scale rounded to bf16 — and differs from another only in
the order of its float32 sums (over K steps, K splits and slices, slots); so does ``grouped`` / ``grouped_asm``. A token's
result with one configuration alone and with another inside a k + 1-token verify therefore agree up to float32
sum order, as :data:`splitspec.models.fused_moe.FP8_CONFIGS` requires of its per-shard forms. ``fma`` keeps the
weights and activations in float32: another form, not to be mixed with the tensor-core ones within a shard.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from splitspec.models import int4_down, int4_fma
from splitspec.models.fused_moe import available, jit, on_device, tl, triton
from splitspec.models.int4_tiles import (column0, dequant, k_mask, last_to_arrive, load_k, operand, split_count,
                                        take, unpack_mode, weight_tile, workspace, zeroed_on_failure)

VARIANTS = ("fma", "mma", "mma_asm")


@dataclass(frozen=True)
class Kernel:
    """How INT4 experts are computed: ``variant`` (:data:`VARIANTS`, or :data:`splitspec.models.grouped_moe`'s
    ``grouped`` / ``grouped_asm`` / ``dequant``) and each kernel's block configuration. Decode variants:
    (BLOCK_N, BLOCK_K, num_warps, num_stages, split) — split: gate_up's share of H, down's of the slots, in programs
    (0: enough for :data:`FILL` programs per multiprocessor; ``fma`` takes 1). BLOCK_K is a multiple of the
    group size; for the tensor-core variants BLOCK_N is 16 · num_warps (mma.sync) or 64 · num_warps / 4 (wgmma).
    ``gate_up`` of a tensor-core variant may take a sixth entry, K slices: each K step cut into that many slices
    (a power of two; BLOCK_K / slices ≥ 64), one batched dot over them, so num_warps = slices · BLOCK_N / 16 warps
    share a program's rows (:func:`_sliced_sums`). ``down`` of a tensor-core variant may take a sixth entry, its
    form: 0 (default) a loop over the token's slots,
    1 the slots side by side in one dot (``_down_columns``: no slot loop, no split; rows per program
    next_power_of_2(top_k) · BLOCK_N, so BLOCK_N = 16 · num_warps / 8 at Kimi's 8 slots).
    Grouped variants: (BLOCK_M pairs, BLOCK_N, BLOCK_K, num_warps, num_stages); ``dequant``: no config, ()."""
    variant: str
    gate_up: tuple[int, ...]
    down: tuple[int, ...]


@jit
def _sliced_sums(x_row, packed, scales, n, kb_lo, kb_hi, H, I, stride_pn, stride_sn, G: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, KS: tl.constexpr, EVEN_K: tl.constexpr,
                 MODE: tl.constexpr):
    """(gate [BLOCK_N], up [BLOCK_N]) float32 sums of rows n (and n + I) against x over K steps kb_lo..kb_hi, each
    step's BLOCK_K columns cut into KS slices of C = BLOCK_K / KS: tiles [KS, BLOCK_N, C/4] and one batched dot per
    nibble position, so a program's warps can take different slices (a K split inside the program: no partial
    sums in memory, no second kernel); the KS slices' sums are added at the end."""
    C: tl.constexpr = BLOCK_K // KS
    sl = tl.arange(0, KS)[:, None, None]
    r = n[None, :, None].to(tl.int64)
    acc_g = tl.zeros([KS, BLOCK_N, 16], dtype=tl.float32)
    acc_u = tl.zeros([KS, BLOCK_N, 16], dtype=tl.float32)
    for kb in range(kb_lo, kb_hi):
        k0 = kb * BLOCK_K
        w = k0 // 4 + sl * (C // 4) + tl.arange(0, C // 4)[None, None, :]  # [KS, 1, C/4]
        g = k0 // G + sl * (C // G) + tl.arange(0, C // G)[None, None, :]
        rm = (n < I)[None, :, None]
        vg = load_k(packed + r * stride_pn + w, rm, w < H // 4, 0, EVEN_K)
        vu = load_k(packed + (r + I) * stride_pn + w, rm, w < H // 4, 0, EVEN_K)
        sg = load_k(scales + r * stride_sn + g, rm, g < H // G, 0.0, EVEN_K)
        su = load_k(scales + (r + I) * stride_sn + g, rm, g < H // G, 0.0, EVEN_K)
        sg = tl.reshape(tl.broadcast_to(sg[:, :, :, None], [KS, BLOCK_N, C // G, G // 4]), [KS, BLOCK_N, C // 4])
        su = tl.reshape(tl.broadcast_to(su[:, :, :, None], [KS, BLOCK_N, C // G, G // 4]), [KS, BLOCK_N, C // 4])
        wx = tl.reshape(w, [KS, C // 4])
        for j in tl.static_range(4):
            xj = operand(tl.load(x_row + 4 * wx + j, mask=k_mask(wx, H, EVEN_K), other=0.0), MODE)
            b = tl.broadcast_to(xj[:, :, None], [KS, C // 4, 16])
            acc_g = tl.dot(dequant(vg, sg, j, MODE), b, acc_g)
            acc_u = tl.dot(dequant(vu, su, j, MODE), b, acc_u)
    return column0(tl.sum(acc_g, axis=0)), column0(tl.sum(acc_u, axis=0))


@jit
def _gate_up_mma(x_ptr, ids_ptr, p_ptr, s_ptr, out_ptr, ws_ptr, cnt_ptr, H, I, E, top_k, steps, stride_pe,
                 stride_pn, stride_se, stride_sn, G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 PARTIAL: tl.constexpr, FIXUP: tl.constexpr, EVEN_K: tl.constexpr, MODE: tl.constexpr,
                 KS: tl.constexpr = 1):
    """Writes act [pairs, I] (bf16; float32 under the interpreter) at the permuted column (n % 4)·(I/4) + n // 4
    (``down`` reads column 4w + j at j·(I/4) + w). With a share of H per program: FIXUP, the split's partial gate and
    up sums added into the workspace [pairs, 2, I] and the last program of a (pair, row block) writing act
    (:func:`splitspec.models.int4_tiles.workspace`); PARTIAL, float32 partial sums [splits, pairs, 2, I] (gate, up)
    for :func:`_silu_mul`. KS > 1: each K step in KS slices (:func:`_sliced_sums`)."""
    p, s = tl.program_id(0), tl.program_id(2)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    e = tl.load(ids_ptr + p).to(tl.int64)
    if (e >= 0) & (e < E):
        x_row = x_ptr + (p // top_k) * H
        packed, scales = p_ptr + e * stride_pe, s_ptr + e * stride_se
        kb_lo, kb_hi = s * steps, tl.minimum(s * steps + steps, tl.cdiv(H, BLOCK_K))  # this split's K steps
        if KS == 1:
            acc_g = tl.zeros([BLOCK_N, 16], dtype=tl.float32)
            acc_u = tl.zeros([BLOCK_N, 16], dtype=tl.float32)
            for kb in range(kb_lo, kb_hi):
                k0 = kb * BLOCK_K  # (a multiple of BLOCK_K Triton can see: whole-width vector loads)
                vg, sg = weight_tile(packed, scales, n, n < I, k0, H, stride_pn, stride_sn, G, BLOCK_N, BLOCK_K, EVEN_K)
                vu, su = weight_tile(packed, scales, n + I, n < I, k0, H, stride_pn, stride_sn, G, BLOCK_N, BLOCK_K,
                                     EVEN_K)
                w = k0 // 4 + tl.arange(0, BLOCK_K // 4)
                for j in tl.static_range(4):
                    xj = operand(tl.load(x_row + 4 * w + j, mask=k_mask(w, H, EVEN_K), other=0.0), MODE)
                    b = tl.broadcast_to(xj[:, None], [BLOCK_K // 4, 16])
                    acc_g = tl.dot(dequant(vg, sg, j, MODE), b, acc_g)
                    acc_u = tl.dot(dequant(vu, su, j, MODE), b, acc_u)
            g, u = column0(acc_g), column0(acc_u)
        else:
            g, u = _sliced_sums(x_row, packed, scales, n, kb_lo, kb_hi, H, I, stride_pn, stride_sn, G, BLOCK_N, BLOCK_K,
                                KS, EVEN_K, MODE)
        col = (n % 4) * (I // 4) + n // 4
        if FIXUP:
            base = ws_ptr + p.to(tl.int64) * (2 * I)
            tl.atomic_add(base + col, g, mask=n < I, sem="relaxed")
            tl.atomic_add(base + I + col, u, mask=n < I, sem="relaxed")
            tile = p * tl.num_programs(1) + tl.program_id(1)
            if last_to_arrive(cnt_ptr, tile, tl.num_programs(2)):
                g, u = take(base + col, g, n < I), take(base + I + col, u, n < I)
                tl.atomic_xchg(cnt_ptr + tile, 0)
                tl.store(out_ptr + p * I + col, (g / (1.0 + tl.exp(-g)) * u).to(out_ptr.dtype.element_ty), mask=n < I)
        elif not PARTIAL:
            tl.store(out_ptr + p * I + col, (g / (1.0 + tl.exp(-g)) * u).to(out_ptr.dtype.element_ty), mask=n < I)
        else:
            base = out_ptr + (s * tl.num_programs(0) + p).to(tl.int64) * (2 * I)  # the grid has a program per pair
            tl.store(base + col, g, mask=n < I)
            tl.store(base + I + col, u, mask=n < I)


@jit
def _silu_mul(part_ptr, ids_ptr, act_ptr, pairs, I, E, splits, BLOCK: tl.constexpr):
    """act [pairs, I] = silu(Σ gate) · Σ up over the partial sums [splits, pairs, 2, I] of ``_gate_up_mma`` (the
    pairs of this rank's experts: the others' partial sums were never written)."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    e = tl.load(ids_ptr + i // I, mask=i < pairs * I, other=-1)
    mask = (i < pairs * I) & (e >= 0) & (e < E)
    base = part_ptr + (i // I) * (2 * I) + i % I
    g = tl.zeros([BLOCK], dtype=tl.float32)
    u = tl.zeros([BLOCK], dtype=tl.float32)
    for s in range(0, splits):
        g += tl.load(base + s * pairs * 2 * I, mask=mask, other=0.0)
        u += tl.load(base + s * pairs * 2 * I + I, mask=mask, other=0.0)
    tl.store(act_ptr + i, (g / (1.0 + tl.exp(-g)) * u).to(act_ptr.dtype.element_ty), mask=mask)


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


def gate_up_call(x: torch.Tensor, ids: torch.Tensor, p13: torch.Tensor, s13: torch.Tensor, group: int, variant: str,
                 config: list[int] | tuple[int, ...]) -> torch.Tensor:
    """act [P, I] for ids [T, top_k] int32 (P = T·top_k; contiguous arguments): ``gate_up`` (and, split over H,
    ``_silu_mul``). float32 for ``fma`` and under the interpreter, else bf16."""
    T, H = x.shape
    top_k, P = ids.shape[1], ids.numel()
    E, I = p13.shape[0], p13.shape[1] // 2
    gu_n, gu_k, gu_w, gu_s, gu_split, *slices = config
    gu_k = min(gu_k, triton.next_power_of_2(H))
    if variant == "fma":
        return int4_fma.gate_up(x, ids, p13, s13, group, gu_n, gu_k, gu_w, gu_s)
    mode = unpack_mode(variant, x)
    q13 = p13.view(torch.int16)  # int32 [.., K/8] → int16 [.., K/4], low half first
    blocks = triton.cdiv(I, gu_n)
    gs = split_count(gu_split, P * blocks, triton.cdiv(H, gu_k), x.device)
    steps = triton.cdiv(triton.cdiv(H, gu_k), gs)  # K steps per split
    gs = triton.cdiv(triton.cdiv(H, gu_k), steps)
    act = torch.empty(P, I, dtype=torch.bfloat16 if mode else torch.float32, device=x.device)
    ws = workspace(x.device, P * 2 * I, P * blocks) if gs > 1 else None
    partial = gs > 1 and ws is None  # captured before the workspace's first eager use: partial sums, _silu_mul
    part = torch.empty(gs, P, 2, I, dtype=torch.float32, device=x.device) if partial else act
    ws_, cnt = ws or (act, act)  # never read without FIXUP
    with zeroed_on_failure(ws):
        _gate_up_mma[(P, blocks, gs)](x.to(torch.bfloat16), ids, q13, s13, part, ws_, cnt, H, I, E, top_k, steps,
                                      q13.stride(0), q13.stride(1), s13.stride(0), s13.stride(1), G=group, BLOCK_N=gu_n,
                                      BLOCK_K=gu_k, PARTIAL=partial, FIXUP=ws is not None, EVEN_K=H % gu_k == 0,
                                      MODE=mode, KS=slices[0] if slices else 1, num_warps=gu_w, num_stages=gu_s)
    if partial:
        _silu_mul[(triton.cdiv(P * I, 1024),)](part, ids, act, P, I, E, gs, BLOCK=1024, num_warps=4)
    return act


@torch.library.custom_op("splitspec::int4_experts", mutates_args=())
def _int4_experts_op(x: torch.Tensor, local: torch.Tensor, weights: torch.Tensor, w13_packed: torch.Tensor,
                     w13_scale: torch.Tensor, w2_packed: torch.Tensor, w2_scale: torch.Tensor, group: int, variant: str,
                     gate_up_config: list[int], down_config: list[int]) -> torch.Tensor:
    with on_device(x):
        x, ids, wts = x.contiguous(), local.to(torch.int32).contiguous(), weights.to(torch.float32).contiguous()
        p13, s13, p2, s2 = (t.contiguous() for t in (w13_packed, w13_scale, w2_packed, w2_scale))
        act = gate_up_call(x, ids, p13, s13, group, variant, gate_up_config)
        return int4_down.down_call(act, ids, wts, p2, s2, x.dtype, group, variant, down_config)


@_int4_experts_op.register_fake
def _(x, local, weights, w13_packed, w13_scale, w2_packed, w2_scale, group, variant, gate_up_config, down_config):
    return torch.empty_like(x)


#: ``fma`` with the blocks of the H200 sweep in docs/lab/2026-12-02-h200-int4-moe-kernels (0.163 ms at TP1, one token)
DEFAULT = Kernel("fma", (8, 1024, 4, 4, 1), (8, 1024, 4, 3, 1))


def check_kernel(kernel: Kernel, group: int) -> None:
    """Raises ValueError naming the field of ``kernel`` that the kernels cannot take."""
    if kernel.variant not in VARIANTS:
        raise ValueError(f"INT4 experts: variant {kernel.variant!r} is not one of {', '.join(VARIANTS)}")
    for name, cfg in (("gate_up", kernel.gate_up), ("down", kernel.down)):
        if len(cfg) not in (5, 6):
            raise ValueError(f"INT4 experts: {name} config {cfg} must be (BLOCK_N, BLOCK_K, num_warps, num_stages, split"
                             f"[, {'form' if name == 'down' else 'K slices'}])")
        if cfg[1] % group:
            raise ValueError(f"INT4 experts: {name} BLOCK_K {cfg[1]} must be a multiple of the group size {group}")
        if kernel.variant != "fma" and (cfg[0] < 16 or cfg[1] < 64):
            raise ValueError(f"INT4 experts: {name} config {cfg}: tensor-core variants need BLOCK_N ≥ 16, BLOCK_K ≥ 64")
    ks = kernel.gate_up[5] if len(kernel.gate_up) == 6 else 1
    if ks < 1 or ks & (ks - 1) or (ks > 1 and (kernel.variant == "fma" or kernel.gate_up[1] // ks < max(64, group)
                                               or (kernel.gate_up[1] // ks) % group)):
        raise ValueError(f"INT4 experts: gate_up config {kernel.gate_up}: K slices {ks} must be a power of two, > 1 "
                         "only for tensor-core variants, each slice (BLOCK_K / slices) ≥ 64 and a multiple of the group")
    form = kernel.down[5] if len(kernel.down) == 6 else 0
    if form not in (0, 1) or (form == 1 and (kernel.variant == "fma" or kernel.down[4] > 1)):
        raise ValueError(f"INT4 experts: down config {kernel.down}: form {form} must be 0 (a loop over the slots) or 1 "
                         "(slots side by side: tensor-core variants, split 0 or 1)")


def int4_experts(x: torch.Tensor, local: torch.Tensor, weights: torch.Tensor, w13_packed: torch.Tensor,
                 w13_scale: torch.Tensor, w2_packed: torch.Tensor, w2_scale: torch.Tensor, group: int = 32,
                 kernel: Kernel | None = None) -> torch.Tensor:
    """This rank's routed experts for a few tokens, their weights INT4 (see the module docstring), in two kernels.

    x [T, H] float (bf16 in the engine; the tensor-core variants round it to bf16); local [T, top_k] integer expert
    ids relative to this rank's first expert (outside [0, E_local): another rank's, skipped); weights [T, top_k]
    float32 routing weights. Returns [T, H] in x's dtype: Σ_slots weight · W2[e] (silu(W_gate[e] x) ⊙ W_up[e] x),
    with W = (nibble − 8) · scale, summed in float32 — the same as :func:`splitspec.models.fused_moe.fused_experts`
    on the dequantised weights (:func:`splitspec.quant.dequantize_int4`) up to the order of the float32 sums (and,
    for the tensor-core variants, x and the activations rounded to bf16). ``kernel``: variant and blocks
    (default :data:`DEFAULT`).
    """
    if not available():
        raise RuntimeError("INT4 experts need Triton (it comes with CUDA builds of PyTorch)")
    kernel = kernel or DEFAULT
    check_kernel(kernel, group)
    return _int4_experts_op(x, local, weights, w13_packed, w13_scale, w2_packed, w2_scale, int(group), kernel.variant,
                            list(kernel.gate_up), list(kernel.down))
