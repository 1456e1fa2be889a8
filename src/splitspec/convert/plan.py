"""Conversion planning without weights: does a TP-N (EP-M) split of this target work, and how many weight bytes
does each rank hold, worked out from ``config.json`` alone (the published layout, :mod:`splitspec.convert.layout`).

The split rules are those of :func:`splitspec.convert.target.target_rank_tensors`: ``embed_tokens`` / ``lm_head``
rows, ``q_b_proj`` / ``kv_b_proj`` rows and ``o_proj`` columns by head, dense and shared-expert MLPs by
intermediate width are split ``tp`` ways; routed experts go ``n_routed_experts / ep`` to each expert group and are
split ``tp / ep`` ways inside it; everything else (norms, ``q_a_proj``, ``kv_a_proj_with_mqa``, the router) is
replicated. The vision tower of a ``kimi_k25`` checkpoint is not converted.

Two byte counts per rank: *as published* (the stored form: FP8 with its scales, INT4 packed with its scales) and
*as converted* by ``splitspec convert`` (INT4 routed experts kept packed, any other INT4 linear dequantised to bf16;
FP8 kept where the split falls on tile boundaries, else bf16). An INT4 expert split whose slices of down_proj's input
columns are not whole groups is not possible (convert refuses it).

These are the published and the converted layouts, tensor by tensor (``weight_shape`` and ``inv_freq`` included),
not the engine's: the memory plan (:mod:`splitspec.build.weight_bytes`) counts the runtime layout ``build`` makes
from the converted shards (fused projections, ``w_uk`` / ``w_uv``, a float32 router, the chosen dtype), so its
numbers differ by design. What the two share, how a quantised linear or its TP slice is stored, is
:mod:`splitspec.convert.stored_bytes`.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from splitspec import quant
from splitspec.config import Mapping, TargetConfig
from splitspec.convert.layout import Tensor
from splitspec.convert.stored_bytes import INT4_PER_WORD, fp8_cut_inside_tile
from splitspec.errors import SplitspecError

GiB = 2**30


@dataclass(frozen=True)
class RankPlan:
    """One TP/EP split of a target: ``error`` (why it does not work) or the weight bytes of its largest rank."""

    tp: int
    ep: int
    error: str | None = None
    published_bytes: int = 0
    converted_bytes: int = 0
    replicated_bytes: int = 0

    def line(self) -> str:
        head = f"TP{self.tp} EP{self.ep}"
        if self.error:
            return f"{head}: not possible — {self.error}"
        return (f"{head}: {self.published_bytes / GiB:.2f} GiB per rank as published, {self.converted_bytes / GiB:.2f} GiB "
                f"as converted (of which {self.replicated_bytes / GiB:.2f} GiB replicated on every rank)")


def _suffix(t: Tensor) -> str:
    for s in ("rotary_emb.inv_freq", "weight_packed", "weight_scale_inv", "weight_scale", "weight_shape"):
        if t.name.endswith(s):
            return s
    return ""


def _groups(tensors: list[Tensor]) -> Counter:
    """Tensors counted by (split kind, dim, suffix, shape, dtype, base): a few dozen groups stand for ~10^5 tensors."""
    return Counter((t.split, t.dim, _suffix(t), t.shape, t.dtype, t.base) for t in tensors)


def _slice(key: tuple, parts: int, index: int, scheme: quant.QuantScheme) -> tuple[int, int]:
    """(bytes as published, bytes as ``splitspec convert`` writes them) of slice ``index`` of ``parts`` of one tensor.

    FP8 slices keep their tiles unless the cut falls inside a tile (:func:`~splitspec.convert.stored_bytes.fp8_slice`);
    then they are written dequantised (bf16) without scales; as published, a slice of the scales counts the tiles
    it overlaps. INT4 routed experts are written as published (each slice with its own ``weight_shape``); other INT4 packed
    weights as bf16 values, their scales and shapes not at all; ``inv_freq`` buffers are dropped.
    """
    kind, dim, suffix, shape, dtype, base = key
    if scheme.method == "int4" and kind == "expert" and suffix.startswith("weight_"):
        return (Tensor("", shape, dtype).nbytes // (parts if dim >= 0 and suffix != "weight_shape" else 1),) * 2
    whole = Tensor("", shape, dtype).nbytes
    if dim < 0 or parts == 1 or suffix == "weight_shape":
        pub = whole
    elif suffix == "weight_scale_inv":
        b, step = scheme.block[dim], base[dim] // parts
        pub = whole // shape[dim] * (-(-(index + 1) * step // b) - index * step // b)
    else:
        pub = whole // parts
    if suffix == "rotary_emb.inv_freq" or (scheme.method == "int4" and suffix in ("weight_scale", "weight_shape")):
        return pub, 0
    if suffix == "weight_packed":
        return pub, pub // 4 * INT4_PER_WORD * 2  # int32 words of 8 nibbles → bf16 values
    fp8 = dtype == quant.FP8_DTYPE or suffix == "weight_scale_inv"
    if fp8 and dim >= 0 and parts > 1 and fp8_cut_inside_tile(base or shape, dim, parts, index, tuple(scheme.block)):
        return pub, (pub * 2 if dtype == quant.FP8_DTYPE else 0)
    return pub, pub


def plan_split(cfg: TargetConfig, scheme: quant.QuantScheme, tensors: list[Tensor] | Counter, tp: int, ep: int = 1) -> RankPlan:
    """Check ``Mapping(tp, ep)`` against ``cfg`` and count the weight bytes of its largest rank (text model only).

    ``tensors``: the layout, or its :func:`_groups`.
    """
    mapping = Mapping(tp_size=tp, ep_size=ep)
    try:
        mapping.check(cfg, where="")
    except SplitspecError as e:
        return RankPlan(tp, ep, error=str(e).removeprefix(": "))
    g = scheme.group_size
    if scheme.method == "int4" and (cfg.moe_intermediate_size // mapping.moe_tp_size) % g:
        return RankPlan(tp, ep, error=f"INT4 experts: moe_intermediate_size {cfg.moe_intermediate_size} / expert-TP "
                                      f"{mapping.moe_tp_size} is not a whole number of groups of {g}")
    groups = tensors if isinstance(tensors, Counter) else _groups(tensors)
    best = None
    for rank in range(tp):
        pub = conv = rep = 0
        for key, n in groups.items():
            kind = key[0]
            if kind == "vision":
                continue
            if kind == "replicated":
                parts, index, count = 1, 0, n
            elif kind == "tp":
                parts, index, count = tp, rank, n
            else:
                parts, index, count = mapping.moe_tp_size, mapping.moe_tp_rank(rank), n // ep
            p, c = _slice(key, parts, index, scheme)
            pub, conv = pub + p * count, conv + c * count
            rep += p * count if kind == "replicated" else 0
        if best is None or (pub, conv) > (best.published_bytes, best.converted_bytes):
            best = RankPlan(tp, ep, None, pub, conv, rep)
    return best


def plan_lines(cfg: TargetConfig, scheme: quant.QuantScheme, tensors: list[Tensor], splits=((1, 1), (8, 1), (8, 8))) -> list[str]:
    """``convert`` planning lines for each (tp, ep) in ``splits``."""
    groups = _groups(tensors)
    return [plan_split(cfg, scheme, groups, tp, ep).line() for tp, ep in splits]
