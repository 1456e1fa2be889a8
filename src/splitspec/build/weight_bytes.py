"""Bytes of one GPU's weights, by tensor kind, for a target rank and an EAGLE-3 drafter, from their configs
(and, where the published shards are present, their safetensors headers), without reading a weight.

The layout counted is the engine's runtime layout (:mod:`splitspec.build.runtime_layout`, docs/formats.md
"Engine files"): per target rank ``embed_tokens`` / ``lm_head`` [V/N, H]; per layer the fused
``q_a_proj`` + ``kv_a_proj_with_mqa`` (replicated), ``q_b_proj`` rows, ``kv_b_proj`` as ``w_uk`` / ``w_uv`` (its
rows, always float), ``o_proj`` columns, dense / shared ``gate``+``up`` rows and ``down`` columns split N ways;
routed experts E/ep per rank, each of width I_e/moe_tp; the router ``gate`` [E, H] and its correction bias
[E] replicated in float32 (build casts them); norms replicated.

Weight formats (``fmt``), each a float element size for what is not quantised (bf16 beside quantised
weights):

- ``bfloat16`` / ``float16`` / ``float32``: numel × element size (what ``splitspec build --dtype`` writes).
- ``fp8`` (Kimi-K2-Instruct, kept by ``build --dtype fp8``): a linear stored FP8 keeps 1 byte per weight plus a
  float32 ``scale_inv`` per 128×128 tile of its slice when the TP slice starts on a tile boundary (and ends on
  one unless it is the last), and a fused pair only when the first part ends on a tile; otherwise bf16
  (convert's and build's rule: :func:`splitspec.quant.blocked_slice`, :func:`splitspec.quant.cat_blocked`,
  applied here to meta tensors). ``w_uk`` / ``w_uv`` are always bf16.
- FP8 drafter (``build --drafter-dtype fp8``, whatever the target's format): its ``fc``, attention linears and MLP
  1 byte per weight + a float32 ``scale_inv`` per 128×128 tile (:func:`drafter_bytes`); embedding, lm_head and norms
  in the float dtype.
- ``int4`` (Kimi-K2-Thinking, K2.5, as published; compressed-tensors ``pack-quantized``; ``build --dtype int4``): a
  routed expert stored INT4 keeps ``weight_packed`` int32 [out, ceil(in/8)] and ``weight_scale`` [out, ceil(in/32)]
  (bf16 as published), stacked per layer; the engine records the group once (``int4.group_size`` int64 [1]); a
  slice along the input dimension must keep whole groups. Any other linear a checkpoint stores INT4 is dequantised
  to the float dtype by convert.

Which linears a checkpoint stores quantised: from ``quantization_config`` (FP8: every decoder-layer linear;
INT4: each ``Linear`` not matched by ``ignore``, :meth:`splitspec.quant.QuantScheme.int4_quantised`), or, with
shards present, from the headers (``weight_scale_inv`` / ``weight_packed`` beside the module), each shape checked
against the config.

This is the runtime layout, not the published or the converted one that ``splitspec inspect`` counts per rank
(:mod:`splitspec.convert.plan`: every published tensor, ``weight_shape`` and ``inv_freq`` included, unfused, the
router bf16): the two counts measure different things and differ by design. They share how a quantised linear or
its TP slice is stored (:mod:`splitspec.convert.stored_bytes`).
"""

from __future__ import annotations

import functools
from collections import Counter
from dataclasses import dataclass

import torch

from splitspec import quant
from splitspec.config import Mapping, TargetConfig
from splitspec.drafter_config import DrafterConfig
from splitspec.convert.safetensors import CheckpointReader
from splitspec.convert.stored_bytes import fp8_slice, int4_bytes, int4_packed_shape
from splitspec.errors import CheckpointError, ConfigError

FLOAT_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
FORMATS = ("int4", "fp8", *FLOAT_BYTES)
KINDS = {"attention": "attention (MLA)", "dense_mlp": "dense MLP", "shared_experts": "shared experts",
         "routed_experts": "routed experts", "router": "router (float32)", "embeddings": "embeddings",
         "lm_head": "lm_head", "norms": "norms"}
DRAFTER_KINDS = {"drafter_layer": "drafter layer (fc, attention, MLP)", "drafter_embeddings": "drafter embeddings",
                 "drafter_lm_head": "drafter lm_head + draft→target map"}


@dataclass(frozen=True)
class WeightFormat:
    """How weights are held: ``name`` (one of :data:`FORMATS`), ``float_bytes`` (element size of float weights),
    ``block`` (FP8 tile) and ``group`` (INT4 group along the input)."""

    name: str
    float_bytes: int
    block: tuple[int, int] | None = None
    group: int | None = None

    @staticmethod
    def choose(name: str | None, scheme: quant.QuantScheme, where: str) -> "WeightFormat":
        """The format ``name`` (None: as published) for a checkpoint stored as ``scheme``.

        Raises:
            ConfigError: an unknown name, or a quantised format the checkpoint is not stored in (this project keeps
                published FP8 or INT4 weights; it does not quantise).
        """
        published = {"fp8": "fp8", "int4": "int4"}.get(scheme.method, "bfloat16")
        name = published if name is None else name
        if name not in FORMATS:
            raise ConfigError(f"dtype '{name}' is not supported (expected one of {', '.join(FORMATS)})")
        if name in ("fp8", "int4") and name != scheme.method:
            raise ConfigError(f"dtype '{name}' keeps weights published in {name}, but {where} holds "
                              f"{scheme.describe()}; choose {published} (as published) or a float dtype")
        return WeightFormat(name, FLOAT_BYTES.get(name, 2), scheme.block if name == "fp8" else None,
                            scheme.group_size if name == "int4" else None)


class Storage:
    """How the published checkpoint stores each Linear: "fp8", "int4" or "float".

    Config-only (``reader`` None): from the quantisation scheme. With shards: from the headers, each module's
    stored shape checked against the config (``prefix``: "language_model." for a K2.5 nesting).
    """

    def __init__(self, scheme: quant.QuantScheme, reader: CheckpointReader | None = None, prefix: str = ""):
        self.scheme, self.reader, self.prefix = scheme, reader, prefix
        self.int4_scale_bytes = 2
        # config-only FP8 or float: every linear stored alike, whatever its name
        self.uniform = reader is None and scheme.method != "int4"

    def of(self, module: str, shape: tuple[int, int]) -> str:
        """Storage of Linear ``module`` (canonical name) of logical shape [out, in]."""
        m = self.prefix + module
        r = self.reader
        if r is None:
            if self.scheme.method == "fp8":
                return "fp8"
            return "int4" if _int4_quantised(self.scheme.ignore, m) else "float"
        if m + ".weight_packed" in r:
            want = int4_packed_shape(*shape)
            if tuple(r.info(m + ".weight_packed").shape) != want:
                raise CheckpointError(f"{r.file_of(m + '.weight_packed')}: tensor '{m}.weight_packed' has shape "
                                      f"{list(r.info(m + '.weight_packed').shape)}, expected {list(want)} from the config")
            self.int4_scale_bytes = r.info(m + ".weight_scale").dtype.itemsize if m + ".weight_scale" in r else 2
            return "int4"
        if m + ".weight" not in r:
            raise CheckpointError(f"{r.folder}: tensor '{m}.weight' (or '.weight_packed') is missing")
        info = r.info(m + ".weight")
        if tuple(info.shape) != tuple(shape):
            raise CheckpointError(f"{r.file_of(m + '.weight')}: tensor '{m}.weight' has shape {list(info.shape)}, "
                                  f"expected {list(shape)} from the config")
        return "fp8" if info.dtype == quant.FP8_DTYPE else "float"


@functools.lru_cache(maxsize=None)
def _int4_quantised(ignore: tuple[str, ...], module: str) -> bool:
    """:meth:`splitspec.quant.QuantScheme.int4_quantised`, remembered: a plan asks it of every expert of every layer."""
    return quant.QuantScheme("int4", ignore=ignore).int4_quantised(module)


@dataclass(frozen=True)
class Slice:
    """One Linear's part on a rank: ``module`` of logical [out, in], cut into ``parts`` along ``dim`` (-2 rows,
    -1 columns), piece ``index``."""

    module: str
    out: int
    inp: int
    dim: int = -2
    parts: int = 1
    index: int = 0

    @property
    def shape(self) -> tuple[int, int]:
        rows, cols = self.out, self.inp
        if self.dim == -2:
            rows //= self.parts
        else:
            cols //= self.parts
        return rows, cols


def linear_bytes(parts: list[Slice], fmt: WeightFormat, storage: Storage) -> int:
    """Bytes of one runtime linear made of ``parts`` fused along rows (one part: a plain linear)."""
    kinds = tuple(storage.of(p.module, (p.out, p.inp)) for p in parts)
    # the engine keeps only routed experts INT4 (convert dequantises any other INT4 linear)
    kinds = tuple("float" if k == "int4" and ".experts." not in p.module else k for k, p in zip(kinds, parts))
    geometry = tuple((p.out, p.inp, p.dim, p.parts, p.index) for p in parts)
    return _geometry_bytes(geometry, kinds, fmt, storage.int4_scale_bytes)


@functools.lru_cache(maxsize=4096)
def _geometry_bytes(geometry: tuple, kinds: tuple[str, ...], fmt: WeightFormat, int4_scale_bytes: int) -> int:
    parts = [Slice("", *g) for g in geometry]
    rows_cols = [p.shape for p in parts]
    if fmt.name == "fp8" and all(k == "fp8" for k in kinds):
        sliced = [fp8_slice((p.out, p.inp), p.dim, p.parts, p.index, fmt.block) for p in parts]
        if all(x is not None for x in sliced):
            fused = quant.cat_blocked(sliced, fmt.block)
            if fused is not None:
                return fused[0].numel() + fused[1].numel() * 4
    if fmt.name == "int4" and all(k == "int4" for k in kinds):
        g = fmt.group
        if all(c % g == 0 or p.dim == -2 for p, (_, c) in zip(parts, rows_cols)):
            return sum(int4_bytes(r, c, g, int4_scale_bytes) for r, c in rows_cols)
    return sum(r * c for r, c in rows_cols) * fmt.float_bytes


def target_rank_bytes(cfg: TargetConfig, mapping: Mapping, rank: int, fmt: WeightFormat, storage: Storage) -> Counter:
    """Bytes of target rank ``rank``'s runtime-layout weights by kind (:data:`KINDS`)."""
    N, H, fb = mapping.tp_size, cfg.hidden_size, fmt.float_bytes
    out: Counter = Counter()
    out["embeddings"] = cfg.vocab_size // N * H * fb
    out["lm_head"] = cfg.vocab_size // N * H * fb
    out["norms"] = H * fb + {"fp8": 16, "int4": 8}.get(fmt.name, 0)  # final norm; fp8.weight_block_size / int4.group_size
    same: dict[bool, Counter] = {}  # layers of one type are identical when the storage does not depend on names
    for layer in range(cfg.num_hidden_layers):
        moe = cfg.is_moe_layer(layer)
        if storage.uniform and moe in same:
            out.update(same[moe])
            continue
        got = _layer_bytes(cfg, mapping, rank, fmt, storage, layer)
        same[moe] = got
        out.update(got)
    return out


def _layer_bytes(cfg: TargetConfig, mapping: Mapping, rank: int, fmt: WeightFormat, storage: Storage, layer: int) -> Counter:
    N, H, fb, heads = mapping.tp_size, cfg.hidden_size, fmt.float_bytes, cfg.num_attention_heads
    M, r_moe = mapping.moe_tp_size, mapping.moe_tp_rank(rank)
    lin = lambda *parts: linear_bytes(list(parts), fmt, storage)  # noqa: E731
    out: Counter = Counter()
    a, m = f"model.layers.{layer}.self_attn.", f"model.layers.{layer}.mlp."
    out["norms"] += (2 * H + cfg.q_lora_rank + cfg.kv_lora_rank) * fb
    out["attention"] += lin(Slice(a + "q_a_proj", cfg.q_lora_rank, H),
                            Slice(a + "kv_a_proj_with_mqa", cfg.kv_lora_rank + cfg.qk_rope_head_dim, H))
    out["attention"] += lin(Slice(a + "q_b_proj", heads * cfg.qk_head_dim, cfg.q_lora_rank, -2, N, rank))
    kv_b = heads * (cfg.qk_nope_head_dim + cfg.v_head_dim)
    storage.of(a + "kv_b_proj", (kv_b, cfg.kv_lora_rank))  # checked; w_uk / w_uv are float whatever its storage
    out["attention"] += kv_b // N * cfg.kv_lora_rank * fb
    out["attention"] += lin(Slice(a + "o_proj", H, heads * cfg.v_head_dim, -1, N, rank))
    if not cfg.is_moe_layer(layer):
        I = cfg.intermediate_size
        out["dense_mlp"] += lin(Slice(m + "gate_proj", I, H, -2, N, rank), Slice(m + "up_proj", I, H, -2, N, rank))
        out["dense_mlp"] += lin(Slice(m + "down_proj", H, I, -1, N, rank))
        return out
    E, Ie = cfg.n_routed_experts, cfg.moe_intermediate_size
    out["router"] += (E * H + E) * 4
    per = E // mapping.ep_size
    first = mapping.ep_rank(rank) * per
    for e in range(first, first + per):
        x = f"{m}experts.{e}."
        one = lin(Slice(x + "gate_proj", Ie, H, -2, M, r_moe), Slice(x + "up_proj", Ie, H, -2, M, r_moe))
        one += lin(Slice(x + "down_proj", H, Ie, -1, M, r_moe))
        if storage.uniform:  # every expert alike
            out["routed_experts"] += one * per
            break
        out["routed_experts"] += one
    if cfg.n_shared_experts:
        Is, s = Ie * cfg.n_shared_experts, m + "shared_experts."
        out["shared_experts"] += lin(Slice(s + "gate_proj", Is, H, -2, N, rank), Slice(s + "up_proj", Is, H, -2, N, rank))
        out["shared_experts"] += lin(Slice(s + "down_proj", H, Is, -1, N, rank))
    return out


def drafter_rank_weights(cfg: DrafterConfig, float_bytes: int, tp: int = 1,
                         fp8_block: tuple[int, int] | None = None) -> dict[str, torch.Tensor]:
    """One rank's drafter weights (``tp`` 1: the whole TP1 drafter) as meta tensors (no memory) in the engine's own
    runtime layout: :func:`splitspec.models.shapes.drafter_shapes` (Llama attention or MLA), float tensors of
    ``float_bytes`` per element and ``draft_to_target`` int64; with ``fp8_block`` the FP8 drafter of
    ``splitspec build --drafter-dtype fp8`` (:func:`splitspec.models.drafters.quantize_drafter`: its linears
    float8_e4m3fn + float32 ``scale_inv`` per tile, and the tile itself, int64 [2]); sliced by
    :func:`splitspec.models.drafters.shard_drafter_weights` for rank 0 of ``tp`` (an FP8 slice that cuts tiles
    falls back to the float dtype there, as in the engine).

    Raises:
        ConfigError: ``tp`` does not divide the drafter's heads, intermediate size or draft vocabulary.
    """
    from splitspec.models.drafters import quantize_drafter, shard_drafter_weights
    from splitspec.models.shapes import drafter_shapes

    sizes = (("num_attention_heads", cfg.num_attention_heads), ("intermediate_size", cfg.intermediate_size),
             ("draft_vocab_size", cfg.draft_vocab_size)) + ((() if cfg.is_mla else (("num_key_value_heads", cfg.num_key_value_heads),)))
    for name, v in sizes:
        if v % tp:
            raise ConfigError(f"drafter {name} = {v} is not divisible by draft_tp = {tp}")
    dtype = torch.float32 if float_bytes == 4 else torch.bfloat16
    meta = {n: torch.empty(shape, dtype=torch.int64 if n == "draft_to_target" else dtype, device="meta")
            for n, shape in drafter_shapes(cfg).items()}
    if fp8_block is not None:
        meta = quantize_drafter(meta, cfg, fp8_block)
    return shard_drafter_weights(meta, cfg, 0, tp) if tp > 1 else meta


def drafter_bytes(cfg: DrafterConfig, float_bytes: int, tp: int = 1, fp8_block: tuple[int, int] | None = None) -> Counter:
    """Bytes of one rank of the drafter (``tp`` 1: the whole TP1 drafter) by kind (:data:`DRAFTER_KINDS`): the
    tensors of :func:`drafter_rank_weights` (an FP8 drafter with ``fp8_block``), each its element size."""
    out = Counter()
    for n, t in drafter_rank_weights(cfg, float_bytes, tp, fp8_block).items():
        kind = ("drafter_embeddings" if n == "embed_tokens" else "drafter_lm_head" if n in ("lm_head", "draft_to_target")
                else "drafter_layer")
        out[kind] += t.numel() * t.element_size()
    return out
