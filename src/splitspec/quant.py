"""Quantised weight formats of published Kimi-K2-class checkpoints: parsing, dequantisation, and the
dequantising FP8 block-scaled linear (the reference; GPUs run :mod:`splitspec.models.fp8_linear`).

Formats (docs/formats.md, "Target checkpoints"):

- **FP8, block-scaled** (Kimi-K2-Instruct, DeepSeek-V3): ``quantization_config = {"quant_method": "fp8",
  "fmt": "e4m3", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}``. A quantised linear
  stores ``weight`` float8_e4m3fn [out, in] and ``weight_scale_inv`` float32 [ceil(out/128), ceil(in/128)];
  the dequantised weight is tile × its scale (a multiplication, whatever the name says); the last tile
  along a dimension that is not a multiple of the block is ragged (smaller).
- **INT4, compressed-tensors ``pack-quantized``** (Kimi-K2-Thinking, K2.5): symmetric, group-wise
  along the input dimension (group 32). A quantised linear stores ``weight_packed`` int32
  [out, ceil(in/8)] (eight 4-bit values per word along the input dimension, value i of a word in bits
  4i..4i+3, each stored with a +8 offset), ``weight_scale`` bf16 [out, ceil(in/group)] and
  ``weight_shape`` int32 [2] = (out, in). Value = (nibble − 8) × scale[row, col // group]. Which linears
  are quantised: every ``Linear`` not matched by the config's ``ignore`` list (entries are exact module
  names, or regular expressions after ``re:``, matched from the start of the module name).
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from splitspec.errors import CheckpointError

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn
QUANT_METHODS = ("fp8", "compressed-tensors")


@dataclass(frozen=True)
class QuantScheme:
    """How a checkpoint's linear weights are stored.

    Attributes:
        method: "none", "fp8" (block-scaled float8_e4m3fn) or "int4" (compressed-tensors pack-quantized).
        block: FP8 tile (rows, cols), e.g. (128, 128).
        group_size: INT4 group along the input dimension, e.g. 32.
        ignore: INT4 ``ignore`` entries (module names or ``re:`` patterns) left unquantised.
        source: the checkpoint's ``quantization_config`` as published.
    """

    method: str = "none"
    block: tuple[int, int] | None = None
    group_size: int | None = None
    ignore: tuple[str, ...] = ()
    source: dict = field(default_factory=dict)

    def int4_quantised(self, module: str) -> bool:
        """Whether the INT4 config quantises Linear ``module`` (full stored name, e.g. ``model.layers.3.mlp.experts.7.up_proj``)."""
        if self.method != "int4":
            return False
        for entry in self.ignore:
            if entry.startswith("re:"):
                if _pattern(entry[3:]).match(module):
                    return False
            elif entry == module:
                return False
        return True

    def describe(self) -> str:
        if self.method == "fp8":
            return f"FP8 e4m3 block-scaled, tiles {self.block[0]}×{self.block[1]} (weight_scale_inv per tile)"
        if self.method == "int4":
            return f"INT4 compressed-tensors pack-quantized, symmetric, group {self.group_size}"
        return "none (float weights)"

    def to_dict(self) -> dict:
        return {"method": self.method, "block": list(self.block) if self.block else None,
                "group_size": self.group_size, "ignore": list(self.ignore)}


@functools.lru_cache(maxsize=256)
def _pattern(text: str) -> re.Pattern:
    return re.compile(text)


def parse_quantization_config(qc: dict | None, where: str) -> QuantScheme:
    """Parse a ``quantization_config`` (or None) into a :class:`QuantScheme`.

    Args:
        where: the config file (and nesting, e.g. ``config.json: text_config``) for messages.
    Raises:
        CheckpointError: naming the field, for an unknown ``quant_method`` or a variant of a known one
            this converter does not read (FP8 other than e4m3 with 2-D tiles; compressed-tensors other
            than symmetric int4 group-wise pack-quantized weights without activation quantisation).
    """
    if not qc:
        return QuantScheme()
    if not isinstance(qc, dict):
        raise CheckpointError(f"{where}: quantization_config = {qc!r}, expected an object")
    method = qc.get("quant_method")
    if method == "fp8":
        fmt = qc.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise CheckpointError(f"{where}: quantization_config.fmt = {fmt!r}; only 'e4m3' (float8_e4m3fn) is read")
        block = qc.get("weight_block_size")
        if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
            raise CheckpointError(f"{where}: quantization_config.weight_block_size = {block!r}, expected two positive "
                                  "integers (per-tensor FP8 scales are not read)")
        return QuantScheme("fp8", block=(block[0], block[1]), source=qc)
    if method == "compressed-tensors":
        fmt = qc.get("format")
        if fmt != "pack-quantized":
            raise CheckpointError(f"{where}: quantization_config.format = {fmt!r}; only 'pack-quantized' is read")
        groups = qc.get("config_groups") or {}
        if not isinstance(groups, dict) or len(groups) != 1:
            raise CheckpointError(f"{where}: quantization_config.config_groups = {groups!r:.80}, expected an object of "
                                  "exactly one group")
        gname, group = next(iter(groups.items()))
        at = f"quantization_config.config_groups.{gname}"
        w = group.get("weights") if isinstance(group, dict) else None
        if not isinstance(w, dict):
            raise CheckpointError(f"{where}: {at}.weights = {w!r:.80}, expected an object (num_bits, type, ...)")
        expect = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group"}
        for k, v in expect.items():
            if w.get(k) != v:
                raise CheckpointError(f"{where}: {at}.weights.{k} = {w.get(k)!r}, expected {v!r}")
        gs = w.get("group_size")
        if not isinstance(gs, int) or gs <= 0 or gs % 8:
            raise CheckpointError(f"{where}: {at}.weights.group_size = {gs!r}, expected a positive multiple of 8")
        if group.get("input_activations") or group.get("output_activations"):
            raise CheckpointError(f"{where}: {at} quantises activations; only weight-only INT4 is read")
        targets = group.get("targets", ["Linear"])
        if targets != ["Linear"]:
            raise CheckpointError(f"{where}: {at}.targets = {targets!r}, expected ['Linear']")
        ignore = qc.get("ignore") or []
        if not isinstance(ignore, list) or not all(isinstance(i, str) for i in ignore):
            raise CheckpointError(f"{where}: quantization_config.ignore = {ignore!r}, expected a list of names")
        for entry in ignore:
            try:
                if entry.startswith("re:"):
                    _pattern(entry[3:])
            except re.error as e:
                raise CheckpointError(f"{where}: quantization_config.ignore entry {entry!r}: not a regular expression "
                                      f"({e})") from None
        return QuantScheme("int4", group_size=gs, ignore=tuple(ignore), source=qc)
    raise CheckpointError(f"{where}: quantization_config.quant_method = {method!r} is not supported "
                          f"(expected one of {', '.join(QUANT_METHODS)})")


# ---------------------------------------------------------------- FP8 block-scaled

def fp8_scale_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, ...]:
    """Shape of ``weight_scale_inv`` for a weight of ``shape`` [..., out, in]: [..., ceil(out/b0), ceil(in/b1)]."""
    *lead, rows, cols = shape
    return (*lead, -(-rows // block[0]), -(-cols // block[1]))


def expand_scale(scale: torch.Tensor, shape: tuple[int, ...], block: tuple[int, int]) -> torch.Tensor:
    """Per-element scale [..., out, in] from per-tile ``scale`` [..., ceil(out/b0), ceil(in/b1)] (ragged last tiles cut)."""
    rows, cols = shape[-2:]
    return scale.repeat_interleave(block[0], dim=-2)[..., :rows, :].repeat_interleave(block[1], dim=-1)[..., :cols]


def dequantize_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Block-scaled FP8 → float: weight float8_e4m3fn [..., out, in] × scale_inv float32 per tile.

    Computed in float32, returned as ``dtype``.
    Raises:
        CheckpointError: ``scale_inv`` does not have one entry per tile.
    """
    want = fp8_scale_shape(tuple(weight.shape), block)
    if tuple(scale_inv.shape) != want:
        raise CheckpointError(f"weight_scale_inv has shape {list(scale_inv.shape)}, expected {list(want)} for a "
                              f"{list(weight.shape)} weight in {block[0]}×{block[1]} tiles")
    return (weight.float() * expand_scale(scale_inv.float(), tuple(weight.shape), block)).to(dtype)


def quantize_fp8(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Float [..., out, in] → (float8_e4m3fn [..., out, in], float32 scale_inv [..., ceil(out/b0), ceil(in/b1)]
    per tile), scale = tile amax / 448; leading dimensions (stacked experts) are independent matrices.

    The inverse of :func:`dequantize_fp8` up to e4m3 rounding (3 mantissa bits: relative error ≤ 2⁻⁴,
    absolute ≤ 2⁻¹⁰ × scale below the normal range). Used to write fixtures; tiles of zeros get scale 1.
    """
    *lead, rows, cols = weight.shape
    b0, b1 = block
    pr, pc = -rows % b0, -cols % b1
    w = F.pad(weight.float(), (0, pc, 0, pr))
    tiles = w.view(*lead, w.shape[-2] // b0, b0, w.shape[-1] // b1, b1)
    amax = tiles.abs().amax(dim=(-3, -1))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (tiles / scale[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).view_as(w)[..., :rows, :cols].to(FP8_DTYPE)
    return q.contiguous(), scale.float().contiguous()


def blocked_slice(weight: torch.Tensor, scale_inv: torch.Tensor, dim: int, parts: int, index: int,
                  block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Slice ``index`` of ``parts`` equal slices along ``dim`` (-2 rows, -1 columns) of an FP8 weight and its scales.

    Returns None when the slice does not start on a tile boundary or (unless it is the last slice) end on one:
    such a slice has no block-scaled form of its own and must be dequantised.
    """
    dim = dim % weight.dim()
    size = weight.shape[dim]
    step = size // parts
    b = block[0] if dim == weight.dim() - 2 else block[1]
    lo, hi = index * step, (index + 1) * step
    if lo % b or (hi % b and hi != size):
        return None
    w = weight.narrow(dim, lo, step)
    s = scale_inv.narrow(dim, lo // b, -(-hi // b) - lo // b)
    return w, s


def cat_blocked(parts: list[tuple[torch.Tensor, torch.Tensor]], block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Concatenate FP8 weights (with scales) along rows; None when a part other than the last ends inside a tile."""
    if any(w.shape[-2] % block[0] for w, _ in parts[:-1]):
        return None
    return torch.cat([w for w, _ in parts], -2), torch.cat([s for _, s in parts], -2)


def linear(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor | None = None,
           block: tuple[int, int] | None = None) -> torch.Tensor:
    """y = x Wᵀ. x: [T, in]; weight [out, in] float, or float8_e4m3fn with ``scale_inv`` per ``block`` tile.

    Float weights go straight to ``F.linear``. FP8 weights are dequantised tile by tile to x's dtype
    (through float32) for this call, then multiplied: the stored weights stay FP8 (half the memory of
    bf16), the arithmetic is x's dtype, identical to an engine whose build dequantised to that dtype. The
    reference and the CPU path; on GPUs :func:`splitspec.models.fp8_linear.linear` computes in FP8.
    """
    if scale_inv is None:
        return F.linear(x, weight)
    return F.linear(x, dequantize_fp8(weight, scale_inv, block, x.dtype))


FP8_BLOCK_KEY = "fp8.weight_block_size"  # runtime-layout tensor int64 [2] present in engines that keep FP8 weights


def block_size_of(weights: dict[str, torch.Tensor]) -> tuple[int, int] | None:
    """The FP8 tile of an engine rank's runtime weights, or None for a float engine."""
    t = weights.get(FP8_BLOCK_KEY)
    return None if t is None else (int(t[0]), int(t[1]))


# ---------------------------------------------------------------- INT4 compressed-tensors

#: Where column j of a word's 8 sits, as nibble index, under the packing conventions a checkpoint may use:
#: compressed-tensors (the only one read), its reverse, and AWQ's interleaved order (used to name a mismatch).
NIBBLE_ORDERS = {"low nibble first (compressed-tensors)": (0, 1, 2, 3, 4, 5, 6, 7),
                 "high nibble first": (7, 6, 5, 4, 3, 2, 1, 0),
                 "AWQ interleaved (0 2 4 6 1 3 5 7)": (0, 4, 1, 5, 2, 6, 3, 7)}
INT4_KEY = "int4.group_size"  # runtime-layout tensor int64 [1] present in engines that keep INT4 routed experts


def unpack_int4(packed: torch.Tensor, cols: int, order: tuple[int, ...] = NIBBLE_ORDERS["low nibble first (compressed-tensors)"]) -> torch.Tensor:
    """int32 [..., ceil(cols/8)] → int8 [..., cols] signed values in [-8, 7] (column j of a word = nibble ``order[j]``,
    bits 4·order[j]..+3, minus 8; compressed-tensors: nibble i = column i)."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)  # a kernel, not a copy: CUDA-graph safe
    if tuple(order) != tuple(range(8)):
        shifts = 4 * torch.tensor(order, dtype=torch.int32, device=packed.device)
    nib = (packed.to(torch.int32)[..., None] >> shifts) & 0xF
    return (nib.reshape(*packed.shape[:-1], -1)[..., :cols] - 8).to(torch.int8)


def pack_int4(values: torch.Tensor) -> torch.Tensor:
    """int [out, cols] in [-8, 7] → int32 [out, ceil(cols/8)] (stored +8; value i of a word in bits 4i..4i+3; padded with 0 → stored 8)."""
    if values.min() < -8 or values.max() > 7:
        raise ValueError("INT4 values must lie in [-8, 7]")
    cols = values.shape[-1]
    v = F.pad(values.to(torch.int64) + 8, (0, -cols % 8), value=8)
    v = v.reshape(*values.shape[:-1], -1, 8)
    word = (v << torch.arange(0, 32, 4, dtype=torch.int64)).sum(-1)
    word = torch.where(word >= 2 ** 31, word - 2 ** 32, word)  # reinterpret as signed int32
    return word.to(torch.int32)


def check_int4_shapes(name: str, packed: torch.Tensor, scale: torch.Tensor, shape: torch.Tensor,
                      expected: tuple[int, int], group: int, where: str) -> None:
    """Check one INT4 triple against the expected [out, in] weight shape.

    Raises:
        CheckpointError: naming the tensor: ``weight_shape`` is not (out, in) or disagrees with the packed
            size; ``weight_packed`` is not [out, ceil(in/8)]; ``weight_scale`` is not [out, ceil(in/group)].
    """
    ws = [int(v) for v in shape.reshape(-1).tolist()]
    if len(ws) != 2:
        raise CheckpointError(f"{where}: tensor '{name}.weight_shape' = {ws}, expected two values [out, in]")
    out, cols = ws
    if (out, -(-cols // 8)) != tuple(packed.shape):
        raise CheckpointError(f"{where}: tensor '{name}.weight_shape' = {ws} disagrees with '{name}.weight_packed' of shape "
                              f"{list(packed.shape)} (8 values per int32: expected [{out}, {-(-cols // 8)}])")
    if tuple(ws) != tuple(expected):
        raise CheckpointError(f"{where}: tensor '{name}.weight_shape' = {ws}, expected {list(expected)} from the config")
    want = (out, -(-cols // group))
    if tuple(scale.shape) != want:
        raise CheckpointError(f"{where}: tensor '{name}.weight_scale' has shape {list(scale.shape)}, expected {list(want)} "
                              f"(one scale per {group} inputs)")


def dequantize_int4(packed: torch.Tensor, scale: torch.Tensor, cols: int, group: int,
                    dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """INT4 → float: (nibble − 8) × scale[row, col // group], computed in float32, returned as ``dtype``.

    packed: int32 [out, ceil(cols/8)]; scale: [out, ceil(cols/group)] (bf16 as published).
    """
    q = unpack_int4(packed, cols).float()
    s = scale.float().repeat_interleave(group, dim=-1)[..., :cols]
    return (q * s).to(dtype)


def group_size_of(weights: dict[str, torch.Tensor]) -> int | None:
    """The INT4 group of an engine rank's runtime weights (routed experts kept packed), or None."""
    t = weights.get(INT4_KEY)
    return None if t is None else int(t.reshape(-1)[0])


def int4_slice(packed: torch.Tensor, scale: torch.Tensor, dim: int, parts: int, index: int,
               group: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Slice ``index`` of ``parts`` equal slices of an INT4 linear (packed int32 [out, in/8], scale [out, in/group])
    along ``dim`` (0 rows, 1 input columns), or None when a column slice would not hold whole groups."""
    if dim == 0:
        return packed.chunk(parts, 0)[index], scale.chunk(parts, 0)[index]
    cols = packed.shape[-1] * 8
    step = cols // parts
    if cols % parts or step % group:
        return None
    return packed.narrow(-1, index * step // 8, step // 8), scale.narrow(-1, index * step // group, step // group)


def nibble_order(packed: torch.Tensor, scale: torch.Tensor, reference: torch.Tensor, group: int) -> tuple[str | None, float]:
    """Which packing convention of :data:`NIBBLE_ORDERS` makes rows ``packed`` [r, in/8] / ``scale`` [r, in/group]
    reproduce ``reference`` [r, in] (the same weights in float) within the quantiser's rounding, 0.6 of a scale step
    (round to nearest: half a step; the clamped extreme of a group: half a step). Returns (the first that does, or
    None; the largest error of compressed-tensors' order, in scale steps)."""
    cols = reference.shape[-1]
    s = scale.float().repeat_interleave(group, dim=-1)[..., :cols]
    found, err_ct = None, 0.0
    for name, order in NIBBLE_ORDERS.items():
        err = ((unpack_int4(packed, cols, order).float() * s - reference.float()).abs() / s.clamp_min(1e-30)).max().item()
        if order == tuple(range(8)):
            err_ct = err
        if found is None and err <= 0.6:
            found = name
    return found, err_ct


def quantize_int4(weight: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Float [out, in] → (weight_packed int32, weight_scale bf16, weight_shape int32 [2]), symmetric per group.

    scale = group amax / 7 rounded to bf16 (so |w / scale| ≤ 7·(1 + 2⁻⁸) and no value needs clamping);
    q = round(w / scale) ∈ [-7, 7], so |w − q·scale| ≤ scale / 2 exactly. Used to write fixtures.
    """
    out, cols = weight.shape
    w = F.pad(weight.float(), (0, -cols % group))
    g = w.view(out, -1, group)
    amax = g.abs().amax(-1)
    scale = torch.where(amax > 0, amax / 7, torch.ones_like(amax)).to(torch.bfloat16)
    q = torch.round(g / scale.float()[..., None]).clamp(-8, 7).view(out, -1)[:, :cols]
    return pack_int4(q.to(torch.int64)), scale.contiguous(), torch.tensor([out, cols], dtype=torch.int32)
