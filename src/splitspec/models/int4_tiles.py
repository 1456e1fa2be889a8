"""Tile arithmetic shared by the W4A16 tensor-core kernels (:mod:`splitspec.models.int4_moe`,
:mod:`splitspec.models.int4_down`, :mod:`splitspec.models.grouped_moe`): the packed int16 tiles and their group
scales, their unpacking to bf16 (PTX, bit operations, or float32 under the interpreter), launch arithmetic, and the
workspaces of the split kernels' fix-ups. The weight format and the unpacking are described in
:mod:`splitspec.models.int4_moe`.
"""

from __future__ import annotations

import contextlib
import os

import torch

from splitspec.models.fused_moe import available, jit, tl

FILL = 2  # a split of 0 ("auto") splits until the grid has this many programs per multiprocessor


def _asm(j: int) -> str:
    """PTX: the 32-bit register $1 holds two int16; $0 gets their nibbles j as bf16 pair, minus 8 (exact)."""
    shift = f"shr.b32 t, $1, {4 * j}; " if j else "mov.b32 t, $1; "
    return ("{ .reg .b32 t, one, off; " + shift + "lop3.b32 t, t, 0x000F000F, 0x43004300, 0xEA; "
            "mov.b32 one, 0x3F803F80; mov.b32 off, 0xC308C308; fma.rn.bf16x2 $0, t, one, off; }")


if available():
    _ASM0, _ASM1, _ASM2, _ASM3 = (tl.constexpr(_asm(j)) for j in range(4))


@jit
def dequant(v, s, J: tl.constexpr, MODE: tl.constexpr):
    """bf16 tile: (nibble J (bits 4J..4J+3) of each int16 of v − 8) · s, rounded once (as
    :func:`splitspec.quant.dequantize_int4`). MODE 2: PTX (``mma_asm``); 1: bit operations and a bitcast; 0: a
    float32 tile, not rounded (the interpreter's: it cannot run PTX, and keeps bf16 as raw 16-bit integers, which
    its bitcasts, arithmetic and tl.dot take for numbers)."""
    if MODE == 2:
        if J == 0:
            q = tl.inline_asm_elementwise(_ASM0, "=r,r", [v], dtype=tl.bfloat16, is_pure=True, pack=2)
        elif J == 1:
            q = tl.inline_asm_elementwise(_ASM1, "=r,r", [v], dtype=tl.bfloat16, is_pure=True, pack=2)
        elif J == 2:
            q = tl.inline_asm_elementwise(_ASM2, "=r,r", [v], dtype=tl.bfloat16, is_pure=True, pack=2)
        else:
            q = tl.inline_asm_elementwise(_ASM3, "=r,r", [v], dtype=tl.bfloat16, is_pure=True, pack=2)
        return q * s
    elif MODE == 1:
        return ((((v >> (4 * J)) & 0xF) | 0x4300).to(tl.bfloat16, bitcast=True) - 136.0) * s
    else:
        return (((v >> (4 * J)) & 0xF) - 8).to(tl.float32) * s.to(tl.float32)


@jit
def operand(v, MODE: tl.constexpr):
    """v as the right operand of :func:`dequant`'s tiles: bf16, or float32 under the interpreter (MODE 0)."""
    return v.to(tl.float32) if MODE == 0 else v.to(tl.bfloat16)


@jit
def weight_tile(packed, scales, rows, rmask, k0, K, stride_pn, stride_sn, G: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """(int16 [BLOCK_N, BLOCK_K/4]: the packed columns k0..k0+BLOCK_K of ``rows``, read as int16 — ``packed`` points
    to int16 — and bf16 [BLOCK_N, BLOCK_K/4]: each int16's group scale, 0 past K or outside ``rmask``). EVEN_K: K is
    a multiple of BLOCK_K, no mask along K (a mask Triton cannot prove constant over 8 int16 halves the loads' width)."""
    w = k0 // 4 + tl.arange(0, BLOCK_K // 4)
    g = k0 // G + tl.arange(0, BLOCK_K // G)
    r = rows[:, None].to(tl.int64)
    if EVEN_K:
        v = tl.load(packed + r * stride_pn + w[None, :], mask=rmask[:, None], other=0)
        s = tl.load(scales + r * stride_sn + g[None, :], mask=rmask[:, None], other=0.0)
    else:
        v = tl.load(packed + r * stride_pn + w[None, :], mask=rmask[:, None] & (w < K // 4)[None, :], other=0)
        s = tl.load(scales + r * stride_sn + g[None, :], mask=rmask[:, None] & (g < K // G)[None, :], other=0.0)
    s = tl.reshape(tl.broadcast_to(s[:, :, None], [BLOCK_N, BLOCK_K // G, G // 4]), [BLOCK_N, BLOCK_K // 4])
    return v, s


@jit
def k_mask(w, K, EVEN_K: tl.constexpr):
    """Columns w (int16 index) inside K: w < K / 4, or every one when EVEN_K."""
    if EVEN_K:
        return w >= 0
    return w < K // 4


@jit
def column0(acc):
    """Column 0 of a [rows, 16] tile, as [rows]."""
    return tl.sum(tl.where(tl.arange(0, 16)[None, :] == 0, acc, 0.0), axis=1)


@jit
def load_k(ptrs, rmask, inside, other, EVEN_K: tl.constexpr):
    """tl.load of ``ptrs`` under the row mask, and under ``inside`` (columns inside K) unless EVEN_K."""
    if EVEN_K:
        v = tl.load(ptrs, mask=rmask, other=other)
    else:
        v = tl.load(ptrs, mask=rmask & inside, other=other)
    return v


def unpack_mode(variant: str, x: torch.Tensor) -> int:
    """:func:`dequant`'s MODE for a tensor-core variant on x's device (CPU tensors: the interpreter's)."""
    if not x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1":
        return 0
    return 2 if variant.endswith("_asm") else 1


def split_count(split: int, programs: int, most: int, device: torch.device) -> int:
    """A config's split (0: automatic) for a grid of ``programs`` programs before splitting, at most ``most``."""
    if split <= 0:
        sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
        split = -(-FILL * sms // max(programs, 1))
    return max(1, min(split, most))



@jit
def last_to_arrive(cnt_ptr, tile, splits):
    """True in the last of a tile's ``splits`` programs to call this (each once, after its atomic adds into the
    workspace): a barrier, so every thread's adds are issued first, then one acquire-release increment of the
    tile's count — the fix-up of :func:`workspace`."""
    tl.debug_barrier()
    return tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel") == splits - 1


@jit
def take(ptrs, like, mask):
    """The sums at ``ptrs`` (an atomic add of 0: read where the adds went), left zero (no program of the tile is
    left); ``like``: a tensor of their shape and dtype."""
    total = tl.atomic_add(ptrs, tl.zeros_like(like), mask=mask)
    tl.store(ptrs, tl.zeros_like(like), mask=mask)
    return total

_WORKSPACE: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
_RETIRED: list[tuple[torch.Tensor, torch.Tensor]] = []  # never freed: graphs may hold their addresses


def workspace(device: torch.device, sums: int, tiles: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(float32 [sums], int32 [tiles]), zeroed, for a split kernel's fix-up on ``device`` — its programs add partial
    sums there by atomics and count themselves in per tile; the last of a tile to arrive reads the sums, zeroes them
    and its count, and writes the result (``down``'s slot split, ``gate_up``'s K split). One pair per (device, sums,
    tiles), made on first use and left zeroed by every call, so kernels and calls of the same sizes share it: calls
    on one device run one at a time (the engine's layers do; two streams decoding at once would need a pair each).
    None when there is none yet and the current stream is capturing a CUDA graph (made there, it would live in the
    graph's memory pool): the caller falls back to a form without it. The workspaces are small ([T·H] float32 at
    most 16 tokens: 0.46 MB at Kimi's H)."""
    key = (device, sums, tiles)
    if key not in _WORKSPACE:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        _WORKSPACE[key] = (torch.zeros(sums, dtype=torch.float32, device=device),
                           torch.zeros(tiles, dtype=torch.int32, device=device))
    return _WORKSPACE[key]


@contextlib.contextmanager
def zeroed_on_failure(ws: tuple[torch.Tensor, torch.Tensor] | None):
    """Zero workspace ``ws`` in place if the launch inside raises: a launch stopped part-way may leave sums or counts
    behind, which would spoil every later call (and every captured graph that adds there). Should zeroing fail too
    (a broken device), the pair is retired — kept allocated, since captured graphs hold its address, never handed
    out again."""
    try:
        yield
    except BaseException:
        if ws is not None:
            try:
                ws[0].zero_()
                ws[1].zero_()
            except Exception:
                for key, pair in list(_WORKSPACE.items()):
                    if pair is ws:
                        _RETIRED.append(_WORKSPACE.pop(key))
        raise
