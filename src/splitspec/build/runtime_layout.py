"""The runtime layout: a converted checkpoint's tensors turned into the ones the runtime reads, for one target rank
and for the drafter (:mod:`splitspec.build.engines` writes them into engines).

Runtime layout of a target rank (names used by :class:`splitspec.models.target.TargetModel`):
``embed_tokens`` [V/N, H], ``lm_head`` [V/N, H], ``norm`` [H]; per layer ``layers.L.``:
``input_layernorm``, ``post_attention_layernorm``; ``attn.fused_qkv_a`` [q_lora + kv_lora + rope, H]
(q_a_proj and kv_a_proj_with_mqa fused), ``attn.q_a_layernorm``, ``attn.kv_a_layernorm``,
``attn.q_b_proj`` [h·(nope+rope), q_lora], decode-time MLA weights ``attn.w_uk`` [h, nope, kv_lora] and
``attn.w_uv`` [h, v, kv_lora] (kv_b_proj split per head), ``attn.o_proj`` [H, h·v]; dense
``mlp.w13`` [2·I/N, H] / ``mlp.w2``; MoE ``mlp.gate`` [E, H] and ``mlp.e_score_correction_bias`` [E]
(float32), stacked experts ``mlp.experts.w13`` [E_local, 2·I_e, H] / ``mlp.experts.w2`` [E_local, H, I_e],
``mlp.shared.w13`` / ``mlp.shared.w2``. Drafter: ``qkv_proj`` fused (Llama attention) or the target layer's
``attn.*`` tensors with ``attn.fused_qkv_a`` [q_lora + kv_lora + rope, 2·H] (MLA), ``mlp.w13`` fused,
``draft_to_target``, and, when its config asks for norms before ``fc``, ``fc_input_norm`` [3·target_hidden]
(norm_before_fc) and/or ``fc_norm`` [3, target_hidden] (one per aux state).

FP8 engines (``dtype="fp8"``, from a converted FP8 block-scaled checkpoint): every linear weight above
whose tiles survive the fusion stays float8_e4m3fn with a float32 ``<name>.scale_inv``
[..., ceil(out/b0), ceil(in/b1)] beside it, and ``fp8.weight_block_size`` int64 [2] records the tile;
activations and every other weight are bfloat16 (or ``float_dtype``), the drafter too; ``w_uk``/``w_uv`` (einsum
operands, not linears) are dequantised, as in other engines' absorbed-MLA FP8 paths. With a float ``dtype`` an FP8
checkpoint is dequantised here (tile × scale in float32, then cast).

FP8 drafters (``drafter_dtype="fp8"``, any target dtype): the drafter's ``fc``, attention linears and ``mlp.w13`` /
``mlp.w2`` are float8_e4m3fn with ``<name>.scale_inv`` and ``fp8.weight_block_size``, as above — an FP8 drafter
checkpoint's tiles kept, float weights quantised here (:func:`splitspec.quant.quantize_fp8`, 128×128 tiles); its
embedding, lm_head and norms stay in the engine's float dtype. The drafter's ``engine.json`` says which
(``quantization``).

INT4 engines (``dtype="int4"``, the default for a converted INT4 compressed-tensors checkpoint): the routed experts
stay as the checkpoint publishes them, stacked: ``mlp.experts.w13`` int32 [E_local, 2·I_e, H/8] (gate rows, then
up rows; 8 values per word along the input, low nibble first, value = nibble − 8) with ``mlp.experts.w13.scale``
[E_local, 2·I_e, H/G] (bf16 as published), ``mlp.experts.w2`` int32 [E_local, H, I_e/8] with ``mlp.experts.w2.scale``
[E_local, H, I_e/G]; ``int4.group_size`` int64 [1] records G (:mod:`splitspec.models.int4_moe`). Everything else
is ``float_dtype`` (default bfloat16). With a float ``dtype`` INT4 experts are dequantised here ((nibble − 8) ×
scale in float32 — exact —, then cast).
"""

from __future__ import annotations

from typing import Iterator

import torch

from splitspec import quant
from splitspec.config import Mapping, TargetConfig
from splitspec.convert.safetensors import CheckpointReader
from splitspec.drafter_config import DrafterConfig
from splitspec.errors import CheckpointError

Fp8 = tuple[torch.Tensor, "torch.Tensor | None"]  # (weight, scale_inv or None)


def _as_float(w: Fp8, block, dtype: torch.dtype) -> torch.Tensor:
    return w[0].to(dtype) if w[1] is None else quant.dequantize_fp8(w[0], w[1], block, dtype)


def _fuse_rows(parts: list[Fp8], block, dtype: torch.dtype, keep: bool) -> Fp8:
    """Concatenate linear weights along rows: FP8 with scales when kept and tile-aligned, else float ``dtype``."""
    if keep and all(s is not None for _, s in parts):
        got = quant.cat_blocked(parts, block)
        if got is not None:
            return got
    return torch.cat([_as_float(p, block, dtype) for p in parts]), None


def _stack(items: list[Fp8], block, dtype: torch.dtype) -> Fp8:
    if all(s is not None for _, s in items):
        return torch.stack([w for w, _ in items]), torch.stack([s for _, s in items])
    return torch.stack([_as_float(p, block, dtype) for p in items]), None


def _emit(name: str, w: Fp8) -> Iterator[tuple[str, torch.Tensor]]:
    yield name, w[0]
    if w[1] is not None:
        yield name + ".scale_inv", w[1]


def _linear(src: CheckpointReader, module: str, dtype: torch.dtype = torch.float32, group: int | None = None) -> Fp8:
    """A converted linear: (FP8 weight, scale_inv), (float weight, None), or an INT4 expert (``group``) dequantised to
    ``dtype``."""
    if module + ".weight_packed" in src:
        packed, scale = src.get(module + ".weight_packed"), src.get(module + ".weight_scale")
        cols = int(src.get(module + ".weight_shape")[1])
        return quant.dequantize_int4(packed, scale, cols, group, dtype), None
    s = src.get(module + ".weight_scale_inv") if module + ".weight_scale_inv" in src else None
    return src.get(module + ".weight"), s


def _int4_experts(src: CheckpointReader, m: str, out: str, experts: range, group: int, hidden: int) -> Iterator[tuple[str, torch.Tensor]]:
    """A layer's routed experts kept INT4, stacked (see the module docstring), checked against each other."""
    from splitspec.models.int4_moe import check_int4_experts

    def part(e: int, names: tuple[str, ...], suffix: str) -> torch.Tensor:
        got = []
        for n in names:
            name = f"{m}experts.{e}.{n}.weight_{suffix}"
            if name not in src:
                raise CheckpointError(f"{src.folder}: tensor '{name}' is missing: an int4 engine keeps every routed expert "
                                      f"packed (this one was converted as float; build with a float --dtype)")
            got.append(src.get(name))
        return torch.cat(got)

    t = {f"{w}{s}": torch.stack([part(e, names, suffix) for e in experts])
         for w, names in (("w13", ("gate_proj", "up_proj")), ("w2", ("down_proj",)))
         for s, suffix in (("", "packed"), (".scale", "scale"))}
    try:
        check_int4_experts(t["w13"], t["w13.scale"], t["w2"], t["w2.scale"], hidden, group)
    except ValueError as e:
        raise CheckpointError(f"{src.folder}: layer '{m}': {e}") from None
    for name, v in t.items():
        yield out + name, v


def iter_mla_runtime_layout(src: CheckpointReader, a: str, q: str, cfg, heads: int, dtype: torch.dtype,
                            block: tuple[int, int] | None = None, keep: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield the runtime-layout tensors of one MLA attention (see the module docstring) from Hugging Face tensors
    under ``a`` (``…self_attn.``), named under ``q``: a target layer or an MLA drafter's single layer.

    Args:
        cfg: has the MLA fields (a :class:`TargetConfig` or an MLA :class:`DrafterConfig`); heads: this rank's.
        block, keep: the FP8 tile, and whether FP8 linears stay FP8 (see :func:`iter_target_runtime_layout`).
    """
    fused = lambda *modules: _fuse_rows([_linear(src, m) for m in modules], block, dtype, keep)  # noqa: E731
    yield from _emit(q + "attn.fused_qkv_a", fused(a + "q_a_proj", a + "kv_a_proj_with_mqa"))
    yield q + "attn.q_a_layernorm", src.get(a + "q_a_layernorm.weight").to(dtype)
    yield q + "attn.kv_a_layernorm", src.get(a + "kv_a_layernorm.weight").to(dtype)
    yield from _emit(q + "attn.q_b_proj", fused(a + "q_b_proj"))
    kv_b = _as_float(_linear(src, a + "kv_b_proj"), block, dtype).view(heads, cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.kv_lora_rank)
    yield q + "attn.w_uk", kv_b[:, : cfg.qk_nope_head_dim].contiguous()
    yield q + "attn.w_uv", kv_b[:, cfg.qk_nope_head_dim:].contiguous()
    yield from _emit(q + "attn.o_proj", fused(a + "o_proj"))


def iter_target_runtime_layout(src: CheckpointReader, cfg: TargetConfig, mapping: Mapping, rank: int, dtype: torch.dtype,
                               block: tuple[int, int] | None = None, keep_fp8: bool = False,
                               int4_group: int | None = None, keep_int4: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield the runtime-layout tensors of one target rank from its converted shard (Hugging Face names).

    Args:
        dtype: float dtype of every weight not kept quantised (activations run in it).
        block: the FP8 tile of the converted checkpoint (None: no FP8 weights).
        keep_fp8: keep FP8 linears with their scales (fp8 engine) instead of dequantising to ``dtype``.
        int4_group: the INT4 group of the converted checkpoint's routed experts (None: none are INT4).
        keep_int4: keep them packed with their scales (int4 engine) instead of dequantising to ``dtype``.
    """
    heads = cfg.num_attention_heads // mapping.tp_size
    keep = keep_fp8 and block is not None
    cast = lambda t: t.to(dtype)  # noqa: E731

    def fused(*modules: str) -> Fp8:
        return _fuse_rows([_linear(src, m) for m in modules], block, dtype, keep)

    if keep:
        yield quant.FP8_BLOCK_KEY, torch.tensor(block, dtype=torch.int64)
    if keep_int4:
        yield quant.INT4_KEY, torch.tensor([int4_group], dtype=torch.int64)
    yield "embed_tokens", cast(src.get("model.embed_tokens.weight"))
    yield "lm_head", cast(src.get("lm_head.weight"))
    yield "norm", cast(src.get("model.norm.weight"))
    for layer in range(cfg.num_hidden_layers):
        p, q = f"model.layers.{layer}.", f"layers.{layer}."
        yield q + "input_layernorm", cast(src.get(p + "input_layernorm.weight"))
        yield q + "post_attention_layernorm", cast(src.get(p + "post_attention_layernorm.weight"))
        yield from iter_mla_runtime_layout(src, p + "self_attn.", q, cfg, heads, dtype, block, keep)
        m = p + "mlp."
        if not cfg.is_moe_layer(layer):
            yield from _emit(q + "mlp.w13", fused(m + "gate_proj", m + "up_proj"))
            yield from _emit(q + "mlp.w2", fused(m + "down_proj"))
            continue
        yield q + "mlp.gate", src.get(m + "gate.weight").float()
        yield q + "mlp.e_score_correction_bias", src.get(m + "gate.e_score_correction_bias").float()
        per = cfg.n_routed_experts // mapping.ep_size
        first = mapping.ep_rank(rank) * per
        experts = range(first, first + per)
        if keep_int4:
            yield from _int4_experts(src, m, q + "mlp.experts.", experts, int4_group, cfg.hidden_size)
        else:
            expert = lambda *ms: _fuse_rows([_linear(src, x, dtype, int4_group) for x in ms], block, dtype, keep)  # noqa: E731
            yield from _emit(q + "mlp.experts.w13", _stack([expert(f"{m}experts.{e}.gate_proj", f"{m}experts.{e}.up_proj") for e in experts], block, dtype))
            yield from _emit(q + "mlp.experts.w2", _stack([expert(f"{m}experts.{e}.down_proj") for e in experts], block, dtype))
        if cfg.n_shared_experts:
            s = m + "shared_experts."
            yield from _emit(q + "mlp.shared.w13", fused(s + "gate_proj", s + "up_proj"))
            yield from _emit(q + "mlp.shared.w2", fused(s + "down_proj"))


def target_runtime_layout(src: CheckpointReader, cfg: TargetConfig, mapping: Mapping, rank: int, dtype: torch.dtype,
                          block: tuple[int, int] | None = None, keep_fp8: bool = False, **int4) -> dict[str, torch.Tensor]:
    """Runtime-layout tensors of one target rank as a dict (see :func:`iter_target_runtime_layout`)."""
    return dict(iter_target_runtime_layout(src, cfg, mapping, rank, dtype, block, keep_fp8, **int4))


def drafter_runtime_layout(src: CheckpointReader, dtype: torch.dtype, cfg: DrafterConfig, block: tuple[int, int] | None = None,
                           keep_fp8: bool = False) -> dict[str, torch.Tensor]:
    """Runtime-layout tensors of the TP1 drafter from its converted checkpoint.

    Args:
        dtype: the activations' dtype, and that of every weight not kept FP8.
        block: the converted checkpoint's FP8 tile (None: a float checkpoint).
        keep_fp8: FP8 linears keep their tiles where these survive the fusion (as the target's), with
            ``<name>.scale_inv``; False: they are dequantised to ``dtype``. An FP8 drafter then has the rest of
            :func:`splitspec.models.drafters.drafter_linears` quantised (:func:`splitspec.models.drafters.quantize_drafter`).
    """
    cast = lambda name: src.get(name).to(dtype)  # noqa: E731
    keep = keep_fp8 and block is not None
    a, m = "midlayer.self_attn.", "midlayer.mlp."

    def lin(name: str, *modules: str) -> dict[str, torch.Tensor]:
        return dict(_emit(name, _fuse_rows([_linear(src, x) for x in modules], block, dtype, keep)))

    if cfg.is_mla:
        attn = dict(iter_mla_runtime_layout(src, a, "", cfg, cfg.num_attention_heads, dtype, block, keep))
    else:
        attn = lin("qkv_proj", a + "q_proj", a + "k_proj", a + "v_proj") | lin("o_proj", a + "o_proj")
    out = {
        "embed_tokens": cast("embed_tokens.weight"), **lin("fc", "fc"),
        "input_layernorm": cast("midlayer.input_layernorm.weight"), "hidden_norm": cast("midlayer.hidden_norm.weight"),
        "post_attention_layernorm": cast("midlayer.post_attention_layernorm.weight"), **attn,
        **lin("mlp.w13", m + "gate_proj", m + "up_proj"), **lin("mlp.w2", m + "down_proj"),
        "norm": cast("norm.weight"), "lm_head": cast("lm_head.weight"), "draft_to_target": src.get("draft_to_target"),
    } | ({"fc_input_norm": cast("input_norm.weight")} if "input_norm.weight" in src else {}) \
      | ({"fc_norm": torch.stack([cast(f"fc_norm.{i}.weight") for i in range(3)])} if "fc_norm.0.weight" in src else {})
    return out
