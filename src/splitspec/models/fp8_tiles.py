"""How Triton kernels turn a tile of block-scaled FP8 weights (float8_e4m3fn, ``quant`` docs) into arithmetic: the
conversion modes shared by the FP8 linear (:mod:`splitspec.models.fp8_linear`) and the fused MoE decode kernels
(:mod:`splitspec.models.fused_moe`).

Every mode folds the weight's block scale into the activations — one product per column, not per weight — which
needs each program's rows to lie in one tile row. What differs is how a weight byte becomes a number:

- ``MODE_F32`` (0): ``w.to(float32)``, one multiply-add per weight in float32. On SM90 Triton converts e4m3 through
  f16 (``cvt.rn.f16x2.e4m3x2`` then f16 → f32), conversion-unit instructions that cap a decode kernel near
  2.3–2.5 TB/s of FP8 (docs/lab/2026-11-30-fused-mla-dropped).
- ``MODE_F32_BITS`` (1): the byte's bits moved into a float32 by integer operations: sign to bit 31, exponent and
  mantissa to bits 20–26. That float32 is the weight × 2⁻¹²⁰ exactly (e4m3 subnormals land on float32
  subnormals); the activations carry 2⁶⁰ and the sum 2⁶⁰ back, so nothing overflows for |x · scale| < 2⁶⁸.
- ``MODE_DOT`` (2): ``w.to(float16)`` (one ``cvt.rn.f16x2.e4m3x2`` per two weights, exact: e4m3 ⊂ f16) into
  ``tl.dot`` on the tensor cores with float32 accumulation; the activations (x · scale · 2⁸, so that they sit in
  f16's normal range) become f16, the token dimension padded to 16. Needs |x · scale| < 256.
- ``MODE_DOT_BITS`` (3): as ``MODE_DOT``, the f16 made by integer operations (sign to bit 15, exponent and mantissa
  to bits 7–14: the weight × 2⁻⁸ exactly), so the activations' 2⁸ cancels it.
- ``MODE_W8A8`` (4): no conversion of the weights at all: the activations are quantised to e4m3 per group of one
  tile's columns (:func:`quantize_e4m3`) and both operands go to FP8 ``tl.dot`` on the tensor cores, one tile column
  per step, its product scaled by (weight tile scale × activation scale) in float32 — DeepSeek-V3's published FP8
  inference recipe (1 × 128 activation groups), with power-of-two activation scales. Used by the fused MoE kernels
  (:mod:`splitspec.models.fp8_moe_w8a8`).

Kernels load the weights of modes 1 and 3 through a uint8 view (:func:`weight_view`). The dot modes round the
scaled activations to f16 (relative 2⁻¹¹, against bf16 activations' own 2⁻⁸); the float32 modes are exact up to the
order of the float32 sums; ``MODE_W8A8`` rounds the activations to e4m3 (relative 2⁻⁴ at most).
"""

from __future__ import annotations

import torch

try:  # comes with CUDA builds of PyTorch; CPU-only installs may lack it
    import triton
    import triton.language as tl

    jit = triton.jit
except ImportError:
    triton = tl = None
    jit = staticmethod  # the kernels below are then never called

MODE_F32, MODE_F32_BITS, MODE_DOT, MODE_DOT_BITS, MODE_W8A8 = 0, 1, 2, 3, 4
MODE_NAMES = {MODE_F32: "f32", MODE_F32_BITS: "f32-bits", MODE_DOT: "dot", MODE_DOT_BITS: "dot-bits", MODE_W8A8: "w8a8"}
E4M3_MAX = 448.0  # float8_e4m3fn's largest finite value

#: (activation factor, result factor) of each mode (see the module docstring).
FACTORS = {MODE_F32: (1.0, 1.0), MODE_F32_BITS: (2.0 ** 60, 2.0 ** 60), MODE_DOT: (2.0 ** 8, 2.0 ** -8),
           MODE_DOT_BITS: (2.0 ** 8, 1.0), MODE_W8A8: (1.0, 1.0)}


def is_dot(mode: int) -> bool:
    """Whether ``mode`` multiplies on the tensor cores (its blocks must be at least 16 wide)."""
    return mode in (MODE_DOT, MODE_DOT_BITS, MODE_W8A8)


def check_mode(mode: int, block_n: int, block_k: int, where: str) -> None:
    """Raise ValueError naming ``where`` for an unknown mode or a dot mode with blocks under 16 (``tl.dot``'s minimum)."""
    if mode not in MODE_NAMES:
        raise ValueError(f"{where}: FP8 mode {mode!r}, expected one of {sorted(MODE_NAMES)} ({MODE_NAMES})")
    least = 32 if mode == MODE_W8A8 else 16  # FP8 MMA steps K by 32
    if is_dot(mode) and (block_n < 16 or block_k < least):
        raise ValueError(f"{where}: FP8 mode {MODE_NAMES[mode]} needs BLOCK_N ≥ 16 and BLOCK_K ≥ {least}, got {block_n}, "
                         f"{block_k}")


def weight_view(w: torch.Tensor, mode: int) -> torch.Tensor:
    """The tensor a kernel of ``mode`` loads: a float8_e4m3fn weight as uint8 for the bit modes, else itself."""
    return w.view(torch.uint8) if mode in (MODE_F32_BITS, MODE_DOT_BITS) and w.dtype == torch.float8_e4m3fn else w


@jit
def fp8_tile(w, MODE: tl.constexpr):
    """A loaded weight tile (float8_e4m3fn, or uint8 for the bit modes) as the numbers ``MODE`` multiplies: float32
    (modes 0, 1) or float16 (2, 3), scaled by 2⁻¹²⁰ (mode 1) or 2⁻⁸ (mode 3)."""
    if MODE == 1:
        b = w.to(tl.uint32)
        t = (((b & 0x80) << 24) | ((b & 0x7F) << 20)).to(tl.float32, bitcast=True)
    elif MODE == 2:
        t = w.to(tl.float16)
    elif MODE == 3:
        b = w.to(tl.uint32)
        t = (((b & 0x80) << 8) | ((b & 0x7F) << 7)).to(tl.uint16).to(tl.float16, bitcast=True)
    else:
        t = w.to(tl.float32)
    return t


@jit
def column16(v):
    """v [K] float32 as the f16 [K, 16] right operand of ``tl.dot`` for one token: v in column 0, zeros elsewhere."""
    col = tl.arange(0, 16)
    return tl.where(col[None, :] == 0, v[:, None], 0.0).to(tl.float16)


@jit
def pow2_scale(amax):
    """(p, 1/p) float32 for amax ≥ 0 (float32): the smallest power of two p ≥ 2⁻¹²⁶ with amax / p ≤ 448, from the bits
    (amax = (1 + m) · 2^e needs p = 2^(e−8) when 1 + m ≤ 1.75, else 2^(e−7)); exact, so x · (1/p) is x / p."""
    bits = amax.to(tl.int32, bitcast=True)
    e = tl.minimum(tl.maximum(((bits >> 23) & 0xFF) - 8 + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32), 1), 253)
    return (e << 23).to(tl.float32, bitcast=True), ((254 - e) << 23).to(tl.float32, bitcast=True)


@jit
def round_e4m3(v):
    """v (float32, |v| ≤ 448) rounded to the nearest float8_e4m3fn value, ties to even, still float32: the step is
    2^(E−3) in binade E ≥ −6 and 2⁻⁹ below it (subnormals); the integer rounding adds and takes away 1.5 · 2²³.
    Casting the result to e4m3 is then exact under any rounding mode (Triton's interpreter truncates)."""
    e = tl.maximum(((v.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)
    r = v * ((130 - e) << 23).to(tl.float32, bitcast=True)  # v / 2^(e−3), exact
    r = (r + 12582912.0) - 12582912.0
    return r * ((e - 3 + 127) << 23).to(tl.float32, bitcast=True)


@jit
def quantize_e4m3(v):
    """v [K] float32 (one group) as (r, p): r [K] float32 on the e4m3 grid (casts to float8_e4m3fn exactly) with
    r · p ≈ v, p = :func:`pow2_scale` of max |v| and r = v / p rounded to nearest even (:func:`round_e4m3`)."""
    p, inv = pow2_scale(tl.max(tl.abs(v), axis=0))
    return round_e4m3(v * inv), p


@jit
def _sum_splits(ws_ptr, out_ptr, size, SPLITS: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in tl.static_range(SPLITS):  # in split order: the same bits every call
        acc += tl.load(ws_ptr + s * size + i, mask=i < size, other=0.0)
    tl.store(out_ptr + i, acc.to(out_ptr.dtype.element_ty), mask=i < size)


def sum_splits(parts: torch.Tensor, out: torch.Tensor) -> None:
    """out (any float dtype, contiguous) = Σ_s parts[s] (float32 [S, *out.shape], contiguous), added in split order
    in float32: the split-K / split-slot partial sums of the FP8 kernels, deterministic."""
    size = out.numel()
    _sum_splits[(triton.cdiv(size, 1024),)](parts, out, size, SPLITS=parts.shape[0], BLOCK=1024, num_warps=4)
