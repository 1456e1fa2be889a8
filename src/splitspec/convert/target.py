"""The target side of convert: a published Kimi-K2-class checkpoint read in any of its real forms, and one rank's
slice of it under canonical Hugging Face names.

Forms read (docs/formats.md, "Target checkpoints"; :mod:`splitspec.quant`):

- bf16 (``kimi_k2`` / ``deepseek_v3``): written as is, sliced per rank;
- FP8 block-scaled (Kimi-K2-Instruct): kept FP8, each slice with its own tiles of ``weight_scale_inv``;
  a slice that would cut through a tile (a TP split not on a 128 boundary) is dequantised to bf16;
- INT4 compressed-tensors (K2-Thinking, K2.5): routed experts kept as published, each rank's slice of
  ``weight_packed`` / ``weight_scale`` with its own ``weight_shape`` (an expert-TP split must keep whole groups);
  any other linear the config quantises is dequantised to bf16 here; everything the ``ignore`` list matches is
  read as the float tensor it is;
- K2.5 nesting (``kimi_k25``): fields under ``text_config``, tensors under ``language_model.``;
  the vision part (``vision_tower.*``, ``mm_projector.*``) is skipped with one notice.

Tensors are read one at a time with positioned reads (:class:`splitspec.convert.safetensors.CheckpointReader`), so
resident memory stays near the largest source tensor plus its slice.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import torch

from splitspec import quant
from splitspec.config import Mapping, TargetConfig
from splitspec.convert.safetensors import CheckpointReader
from splitspec.errors import CheckpointError
from splitspec.files import read_json

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
VISION_PREFIXES = ("vision_tower.", "mm_projector.")
DEQUANT_DTYPE = torch.bfloat16  # dtype of weights dequantised at convert time (that of the unquantised tensors)

# A linear weight as read: (weight, None) for float, (float8_e4m3fn weight, float32 scale_inv) for FP8.
Weight = tuple[torch.Tensor, "torch.Tensor | None"]
Int4 = tuple[torch.Tensor, torch.Tensor]  # (weight_packed int32 [out, in/8], weight_scale [out, in/group])


def _split(t: torch.Tensor, dim: int, parts: int, index: int) -> torch.Tensor:
    return t.chunk(parts, dim=dim)[index]


class TargetSource:
    """A published target checkpoint opened for conversion.

    Resolves the nesting (``language_model.`` for ``kimi_k25``), parses the quantisation scheme, skips
    vision tensors, and reads tensors under canonical (un-nested) Hugging Face names with shape/dtype checks.

    Attributes:
        cfg: the text model's :class:`TargetConfig`.
        scheme: the weights' :class:`splitspec.quant.QuantScheme`.
        prefix: "" or "language_model.".
        skipped: vision tensor names skipped.
        dequantized: FP8 linears stored dequantised because a TP split cut through their tiles.
        int4_dequantized: INT4 linears other than routed experts, stored dequantised (bf16).
    Raises:
        CheckpointError: naming the file, tensor or field.
    """

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        where = str(self.folder / "config.json")
        raw = read_json(self.folder / "config.json")
        self.raw = raw
        self.cfg = TargetConfig.from_hf(raw, where)
        text, twhere, nested = TargetConfig.text_config(raw, where)
        self.prefix = "language_model." if nested else ""
        qc = text.get("quantization_config")
        qwhere = twhere
        if qc is None and nested and raw.get("quantization_config"):
            qc, qwhere = raw["quantization_config"], where
        self.scheme = quant.parse_quantization_config(qc, qwhere)
        self.reader = CheckpointReader(self.folder)
        names = self.reader.names()
        self.skipped = [n for n in names if n.startswith(VISION_PREFIXES)]
        self.reader.mark_used(self.skipped)
        self.reader.mark_used(n for n in names if n.endswith("rotary_emb.inv_freq"))
        if nested:
            stray = [n for n in names if not n.startswith(self.prefix) and n not in self.reader.used]
            if stray:
                raise CheckpointError(f"{self.folder}: model_type 'kimi_k25' keeps the text model under 'language_model.', "
                                      f"but tensor '{stray[0]}' is outside it (and {len(stray) - 1} more)")
        self.dequantized: list[str] = []
        self.int4_dequantized: list[str] = []

    def stored(self, name: str) -> str:
        return self.prefix + name

    def tensor(self, name: str, shape: tuple[int, ...], dtype=FLOAT_DTYPES) -> torch.Tensor:
        """A plain tensor (norm, embedding, router) under its canonical name."""
        return self.reader.get(self.stored(name), shape, dtype)

    def linear(self, module: str, shape: tuple[int, int]) -> Weight:
        """The weight of Linear ``module`` (canonical name, no ``.weight``) of logical shape [out, in].

        FP8: (float8_e4m3fn weight, float32 scale_inv) when stored quantised, else (float, None).
        INT4: dequantised to bf16 when the config quantises the module (routed experts: :meth:`int4`), else read as stored.
        """
        m = self.stored(module)
        r, scheme = self.reader, self.scheme
        if scheme.method == "int4":
            if scheme.int4_quantised(m):
                packed, scale = self.int4(module, shape)
                if module not in self.int4_dequantized:
                    self.int4_dequantized.append(module)
                return quant.dequantize_int4(packed, scale, shape[1], scheme.group_size, DEQUANT_DTYPE), None
            if m + ".weight_packed" in r:
                raise CheckpointError(f"{self.folder}: tensor '{m}.weight_packed' is stored quantised, but quantization_config's "
                                      "'ignore' list says this module is not quantised")
            return r.get(m + ".weight", shape, FLOAT_DTYPES), None
        if scheme.method == "fp8" and m + ".weight" in r and r.info(m + ".weight").dtype == quant.FP8_DTYPE:
            w = r.get(m + ".weight", shape)
            if m + ".weight_scale_inv" not in r:
                raise CheckpointError(f"{self.folder}: tensor '{m}.weight' is float8_e4m3fn but '{m}.weight_scale_inv' is missing")
            want = quant.fp8_scale_shape(shape, scheme.block)
            s = r.get(m + ".weight_scale_inv", None, (torch.float32, torch.bfloat16))
            if tuple(s.shape) != want:
                raise CheckpointError(f"{r.file_of(m + '.weight_scale_inv')}: tensor '{m}.weight_scale_inv' has shape {list(s.shape)}, "
                                      f"expected {list(want)} (one scale per {scheme.block[0]}×{scheme.block[1]} tile of the "
                                      f"{list(shape)} weight, last tiles ragged)")
            return w, s.float()
        if m + ".weight_scale_inv" in r:
            raise CheckpointError(f"{self.folder}: tensor '{m}.weight_scale_inv' is present but '{m}.weight' is not float8_e4m3fn"
                                  + ("" if scheme.method == "fp8" else " and config.json has no FP8 quantization_config"))
        return r.get(m + ".weight", shape, FLOAT_DTYPES), None

    def int4(self, module: str, shape: tuple[int, int]) -> Int4:
        """The published INT4 tensors of Linear ``module`` of logical shape [out, in], checked against each other
        (:func:`splitspec.quant.check_int4_shapes`)."""
        m, r = self.stored(module), self.reader
        if m + ".weight_packed" not in r:
            held = " (it holds '" + m + ".weight' instead)" if m + ".weight" in r else ""
            raise CheckpointError(f"{self.folder}: tensor '{m}.weight_packed' is missing{held}: quantization_config "
                                  f"quantises '{m}' (no 'ignore' entry matches it)")
        packed = r.get(m + ".weight_packed", None, torch.int32)
        scale = r.get(m + ".weight_scale", None, FLOAT_DTYPES)
        wshape = r.get(m + ".weight_shape", None, (torch.int32, torch.int64))
        quant.check_int4_shapes(m, packed, scale, wshape, shape, self.scheme.group_size, str(r.file_of(m + ".weight_packed")))
        return packed, scale

    def keeps_int4(self, module: str) -> bool:
        """Whether routed-expert Linear ``module`` (canonical name) is carried as published INT4."""
        return self.scheme.method == "int4" and self.scheme.int4_quantised(self.stored(module))

    def check_int4_split(self, mapping: Mapping) -> None:
        """Refuse, before anything is written, INT4 routed experts whose group does not divide the hidden size or
        whose expert-TP slice of the intermediate size (down_proj's input columns) would cut a group.

        Raises:
            CheckpointError: naming the first expert linear and the sizes.
        """
        c, g = self.cfg, self.scheme.group_size
        first = next((i for i in range(c.num_hidden_layers) if c.is_moe_layer(i)), None)
        m = f"model.layers.{first}.mlp.experts.0."
        if first is None or not self.keeps_int4(m + "down_proj"):
            return
        where = f"{self.folder}: INT4 routed experts (e.g. '{self.stored(m)}down_proj.weight_packed')"
        if c.hidden_size % g:
            raise CheckpointError(f"{where}: group_size {g} does not divide hidden_size {c.hidden_size} (gate/up inputs)")
        width = c.moe_intermediate_size // mapping.moe_tp_size
        if width % g:
            raise CheckpointError(f"{where}: expert-TP {mapping.moe_tp_size} gives each rank {width} of down_proj's "
                                  f"{c.moe_intermediate_size} input columns, not whole groups of {g}; choose a smaller "
                                  f"--tp or a larger --ep (moe_intermediate_size / (tp / ep) must be a multiple of {g})")

    def check_nibble_order(self, reference: Path) -> str:
        """Known-value check of the INT4 packing: the first routed expert's gate, up and down rows 0–3, dequantised
        low nibble first, against the same linears' ``.weight`` in ``reference`` (a float checkpoint of the same
        weights). Returns a one-line summary.

        Raises:
            CheckpointError: naming the tensor, when they disagree by more than the quantiser's rounding, and
                which other convention (:data:`splitspec.quant.NIBBLE_ORDERS`) would agree.
        """
        c = self.cfg
        layer = next(i for i in range(c.num_hidden_layers) if c.is_moe_layer(i))
        ref = CheckpointReader(Path(reference))
        try:
            prefix = "language_model." if any(n.startswith("language_model.") for n in ref.names()) else ""
            worst = 0.0
            for n, shape in (("gate_proj", (c.moe_intermediate_size, c.hidden_size)), ("up_proj", (c.moe_intermediate_size, c.hidden_size)),
                             ("down_proj", (c.hidden_size, c.moe_intermediate_size))):
                m = f"model.layers.{layer}.mlp.experts.0.{n}"
                packed, scale = self.int4(m, shape)
                rows = ref.get(prefix + m + ".weight", shape, FLOAT_DTYPES)[:4]
                found, err = quant.nibble_order(packed[:4], scale[:4], rows, self.scheme.group_size)
                worst = max(worst, err)
                if not found or found != next(iter(quant.NIBBLE_ORDERS)):
                    how = f"it agrees with the {found} order" if found else "no known nibble order agrees (different weights?)"
                    raise CheckpointError(f"{self.reader.file_of(self.stored(m) + '.weight_packed')}: tensor '{self.stored(m)}"
                                          f".weight_packed' rows 0-3 unpacked low nibble first differ from '{m}.weight' of "
                                          f"{reference} by {err:.1f} scale steps (at most 0.6 expected): {how}")
        finally:
            ref.close()
        return f"INT4 nibble order checked against {reference}: expert 0 of layer {layer}, rows 0-3, within {worst:.2f} scale steps"

    def split(self, module: str, w: Weight, dim: int, parts: int, index: int) -> Weight:
        """Slice ``index`` of ``parts`` along ``dim`` (0 rows, 1 columns), keeping FP8 tiles when the cut allows."""
        t, s = w
        if s is None:
            return _split(t, dim, parts, index), None
        if parts == 1:
            return w
        got = quant.blocked_slice(t, s, dim, parts, index, self.scheme.block)
        if got is not None:
            return got
        if module not in self.dequantized:
            self.dequantized.append(module)
        return _split(quant.dequantize_fp8(t, s, self.scheme.block, DEQUANT_DTYPE), dim, parts, index), None


def _emit(module: str, w: Weight) -> Iterator[tuple[str, torch.Tensor]]:
    yield module + ".weight", w[0]
    if w[1] is not None:
        yield module + ".weight_scale_inv", w[1]


def rank_tensor_count(cfg: TargetConfig, mapping: Mapping) -> int:
    """Number of logical weights (scales not counted) in one target rank's converted shard."""
    experts = cfg.n_routed_experts // mapping.ep_size
    moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    dense = cfg.num_hidden_layers - moe_layers
    per_layer = 9
    return 3 + cfg.num_hidden_layers * per_layer + dense * 3 + moe_layers * (2 + 3 * experts + (3 if cfg.n_shared_experts else 0))


def target_rank_tensors(src: TargetSource, cfg: TargetConfig, mapping: Mapping, rank: int) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) of target rank ``rank`` under canonical Hugging Face names, sliced for TP/EP.

    Split rules: q_b_proj/kv_b_proj rows and o_proj columns by head; dense and shared-expert
    gate/up rows and down columns by intermediate; routed experts by expert group (EP) and
    intermediate slice (expert-TP); embed_tokens/lm_head rows by vocabulary. q_a_proj,
    kv_a_proj_with_mqa, their norms, the router and all layer norms are replicated.
    FP8 linears are followed by their ``weight_scale_inv`` slice; INT4 routed experts are yielded as their
    ``weight_packed`` / ``weight_scale`` slices and the slice's ``weight_shape`` (call
    :meth:`TargetSource.check_int4_split` first). Every tensor's shape and dtype is checked against ``cfg``.
    """
    tp, H = mapping.tp_size, cfg.hidden_size
    heads, mtp, mrank = cfg.num_attention_heads, mapping.moe_tp_size, mapping.moe_tp_rank(rank)
    V = cfg.vocab_size

    def lin(module, shape, dim=None, parts=1, index=0):
        w = src.linear(module, shape)
        if dim is not None:
            w = src.split(module, w, dim, parts, index)
        return _emit(module, w)

    def expert(module, shape, dim):  # a routed expert's slice: published INT4 kept packed, else as any linear
        if not src.keeps_int4(module):
            return lin(module, shape, dim, mtp, mrank)
        packed, scale = quant.int4_slice(*src.int4(module, shape), dim, mtp, mrank, src.scheme.group_size)
        rows, cols = shape[0] // (mtp if dim == 0 else 1), shape[1] // (mtp if dim == 1 else 1)
        return iter(((module + ".weight_packed", packed), (module + ".weight_scale", scale),
                     (module + ".weight_shape", torch.tensor([rows, cols], dtype=torch.int32))))

    yield "model.embed_tokens.weight", _split(src.tensor("model.embed_tokens.weight", (V, H)), 0, tp, rank)
    yield "lm_head.weight", _split(src.tensor("lm_head.weight", (V, H)), 0, tp, rank)
    yield "model.norm.weight", src.tensor("model.norm.weight", (H,))
    for layer in range(cfg.num_hidden_layers):
        p = f"model.layers.{layer}."
        a = p + "self_attn."
        for n in ("input_layernorm", "post_attention_layernorm"):
            yield p + n + ".weight", src.tensor(p + n + ".weight", (H,))
        yield from lin(a + "q_a_proj", (cfg.q_lora_rank, H))
        yield a + "q_a_layernorm.weight", src.tensor(a + "q_a_layernorm.weight", (cfg.q_lora_rank,))
        yield from lin(a + "kv_a_proj_with_mqa", (cfg.kv_lora_rank + cfg.qk_rope_head_dim, H))
        yield a + "kv_a_layernorm.weight", src.tensor(a + "kv_a_layernorm.weight", (cfg.kv_lora_rank,))
        yield from lin(a + "q_b_proj", (heads * cfg.qk_head_dim, cfg.q_lora_rank), 0, tp, rank)
        yield from lin(a + "kv_b_proj", (heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank), 0, tp, rank)
        yield from lin(a + "o_proj", (H, heads * cfg.v_head_dim), 1, tp, rank)
        m = p + "mlp."
        if not cfg.is_moe_layer(layer):
            for n in ("gate_proj", "up_proj"):
                yield from lin(m + n, (cfg.intermediate_size, H), 0, tp, rank)
            yield from lin(m + "down_proj", (H, cfg.intermediate_size), 1, tp, rank)
            continue
        E = cfg.n_routed_experts
        yield m + "gate.weight", src.tensor(m + "gate.weight", (E, H))
        yield m + "gate.e_score_correction_bias", src.tensor(m + "gate.e_score_correction_bias", (E,), (torch.float32, torch.bfloat16))
        per = E // mapping.ep_size
        first = mapping.ep_rank(rank) * per
        for e in range(first, first + per):
            x = f"{m}experts.{e}."
            for n in ("gate_proj", "up_proj"):
                yield from expert(x + n, (cfg.moe_intermediate_size, H), 0)
            yield from expert(x + "down_proj", (H, cfg.moe_intermediate_size), 1)
        if cfg.n_shared_experts:
            s, inter = m + "shared_experts.", cfg.moe_intermediate_size * cfg.n_shared_experts
            for n in ("gate_proj", "up_proj"):
                yield from lin(s + n, (inter, H), 0, tp, rank)
            yield from lin(s + "down_proj", (H, inter), 1, tp, rank)
