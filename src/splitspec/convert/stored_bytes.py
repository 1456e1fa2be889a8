"""How a linear weight [out, in], or one TP slice of it, is stored in each quantised form: the per-tensor-kind
arithmetic shared by the two weight-byte counts, which count different layouts:

- :mod:`splitspec.convert.plan` (``splitspec inspect``): the *published* layout (:mod:`splitspec.convert.layout`,
  tensor by tensor, with ``weight_shape`` and ``inv_freq``) and what ``splitspec convert`` writes from it, per rank;
- :mod:`splitspec.build.weight_bytes` (``splitspec plan``): the engine's *runtime* layout (fused projections,
  ``w_uk`` / ``w_uv``, float32 router, the dtype ``build`` chose), per GPU.

Forms (docs/formats.md, "Target checkpoints"):

- INT4 compressed-tensors ``pack-quantized``: ``weight_packed`` int32 [out, ceil(in/8)] (8 values per word) and
  ``weight_scale`` [out, ceil(in/group)] (bf16 as published; :func:`int4_shapes`, :func:`int4_bytes`).
- FP8 block-scaled: float8_e4m3fn [out, in] and float32 ``weight_scale_inv`` per tile
  (:func:`splitspec.quant.fp8_scale_shape`); a TP slice keeps its tiles only where :func:`splitspec.quant.blocked_slice`
  (the rule convert and build apply) can cut it, else it is dequantised (:func:`fp8_slice`).
"""

from __future__ import annotations

import functools

import torch

from splitspec import quant

INT4_PER_WORD = 8  # 4-bit values packed in one int32 word


def int4_packed_shape(out: int, inp: int) -> tuple[int, int]:
    """Shape of ``weight_packed`` (int32) of an INT4 linear of logical shape [out, inp]."""
    return out, -(-inp // INT4_PER_WORD)


def int4_shapes(out: int, inp: int, group: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """Shapes of ``weight_packed`` (int32) and ``weight_scale`` of an INT4 linear of logical shape [out, inp] with
    ``group`` input values per scale."""
    return int4_packed_shape(out, inp), (out, -(-inp // group))


def int4_bytes(out: int, inp: int, group: int, scale_bytes: int = 2) -> int:
    """Bytes of an INT4 linear [out, inp] held as ``weight_packed`` + ``weight_scale`` (``scale_bytes`` per scale;
    no ``weight_shape``)."""
    (po, pi), (so, si) = int4_shapes(out, inp, group)
    return po * pi * 4 + so * si * scale_bytes


def fp8_slice(shape: tuple[int, int], dim: int, parts: int, index: int,
              block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Slice ``index`` of ``parts`` along ``dim`` (0 or -2: rows, 1 or -1: columns) of an FP8 weight of ``shape`` and
    its scales, as meta tensors (no memory) from :func:`splitspec.quant.blocked_slice`; None when the cut falls inside
    a tile (the slice has no block-scaled form of its own)."""
    w = torch.empty(shape, dtype=quant.FP8_DTYPE, device="meta")
    sc = torch.empty(quant.fp8_scale_shape(shape, block), dtype=torch.float32, device="meta")
    return quant.blocked_slice(w, sc, dim, parts, index, block)


@functools.lru_cache(maxsize=4096)
def fp8_cut_inside_tile(shape: tuple[int, int], dim: int, parts: int, index: int, block: tuple[int, int]) -> bool:
    """Whether :func:`fp8_slice` of these arguments is None (remembered: a plan asks it for every rank)."""
    return fp8_slice(shape, dim, parts, index, block) is None
