"""The drafter side of convert: an EAGLE-3 drafter's tensors read and checked, its draft → target vocabulary
mapping, and the choice of its token embedding (its own or the target's).

Published drafters name their single decoder layer ``midlayer.*`` (EAGLE-3, SpecForge, ModelOpt exports) or
``layers.0.*`` (read as ``midlayer.*`` by vLLM, SGLang and TensorRT-LLM alike); the converted checkpoint always
says ``midlayer.*``. The layer's attention is Llama's (``q/k/v/o_proj``) or, for ``Eagle3DeepseekV2ForCausalLM``,
DeepSeek-V3 MLA (``q_a_proj``, ``q_a_layernorm``, ``q_b_proj``, ``kv_a_proj_with_mqa``, ``kv_a_layernorm``,
``kv_b_proj``, ``o_proj``; the two down-projections read the 2·H input). ``d2t`` holds offsets (target id =
draft id + d2t[draft id]) and is written as absolute ids, ``draft_to_target``. A drafter without ``lm_head`` over
the full vocabulary takes the target's (what ModelOpt's export does: modelopt/torch/export/plugins/hf_spec_export.py).

An FP8 drafter checkpoint (``quantization_config`` as Kimi-K2-Instruct's: block-scaled float8_e4m3fn ``X.weight`` with a
float32 ``X.weight_scale_inv`` per tile) has its layer's linears and ``fc`` read and written as they are, weight and
scales; an FP8 ``lm_head`` is dequantised to bfloat16 (the engine keeps lm_head in the activation dtype). Which linears
are FP8 is read from the headers; ``splitspec build --drafter-dtype fp8`` keeps them, a float build dequantises them.
"""

from __future__ import annotations

import torch

from splitspec import quant
from splitspec.drafter_config import DrafterConfig
from splitspec.convert.safetensors import CheckpointReader
from splitspec.convert.target import FLOAT_DTYPES, TargetSource
from splitspec.errors import CheckpointError, ConfigError

def drafter_scheme(raw: dict, where: str) -> quant.QuantScheme:
    """The quantisation of a drafter checkpoint from its config.json ``raw``: none or FP8 block-scaled.
    Raises CheckpointError naming ``where`` for a malformed ``quantization_config`` or an INT4 one."""
    scheme = quant.parse_quantization_config(raw.get("quantization_config"), where)
    if scheme.method == "int4":
        raise CheckpointError(f"{where}: quantization_config is INT4 compressed-tensors; a drafter is read in float or FP8 "
                              "block-scaled (weight_scale_inv) form only")
    return scheme


def _fp8_allowed(name: str) -> bool:
    """Converted names an FP8 drafter checkpoint may store as float8_e4m3fn: the layer's linears, fc and lm_head."""
    return name.endswith("_proj.weight") or name in ("fc.weight", "lm_head.weight")


def _check_tensor(reader: CheckpointReader, name: str, stored: str, shape: tuple[int, ...], scheme: quant.QuantScheme) -> bool:
    """Check one drafter tensor from the headers; True when it is FP8 (then its ``weight_scale_inv`` is checked too).
    Raises CheckpointError naming the file and tensor."""
    scale = stored.removesuffix("weight") + "weight_scale_inv"
    if stored in reader and reader.info(stored).dtype == quant.FP8_DTYPE:
        if not _fp8_allowed(name):
            raise CheckpointError(f"{reader.file_of(stored)}: tensor '{stored}' is float8_e4m3fn; only the drafter layer's "
                                  "linears, fc and lm_head are read in FP8")
        if scheme.method != "fp8":
            raise CheckpointError(f"{reader.file_of(stored)}: tensor '{stored}' is float8_e4m3fn but the drafter's config.json has "
                                  "no FP8 quantization_config (quant_method 'fp8', weight_block_size)")
        reader.check(stored, shape)
        if scale not in reader:
            raise CheckpointError(f"{reader.folder}: tensor '{stored}' is float8_e4m3fn but '{scale}' is missing")
        reader.check(scale, quant.fp8_scale_shape(shape, scheme.block), (torch.float32, torch.bfloat16))
        return True
    if _fp8_allowed(name) and scale in reader:
        raise CheckpointError(f"{reader.folder}: tensor '{scale}' is present but '{stored}' is not float8_e4m3fn")
    reader.check(stored, shape, FLOAT_DTYPES)
    return False


def read_draft_vocab(reader: CheckpointReader, cfg: DrafterConfig) -> torch.Tensor:
    """Read d2t (offsets: target id = draft id + d2t[draft id]; all zeros = identity) and check it against t2d.

    Returns draft_to_target [draft_vocab] int64 (absolute target ids).
    Raises:
        CheckpointError: a reduced vocabulary without d2t; ids outside the target vocabulary;
            a mapping that is not one-to-one; t2d disagreeing with d2t.
    """
    dv, v = cfg.draft_vocab_size, cfg.vocab_size
    if "d2t" not in reader:
        if dv < v:
            raise CheckpointError(f"{reader.folder}: draft_vocab_size {dv} < vocab_size {v} but tensor 'd2t' (the draft → target "
                                  "vocabulary mapping) is missing")
        if "t2d" in reader:
            t2d = reader.get("t2d", (v,), (torch.bool, torch.uint8, torch.int64)).bool()
            if not bool(t2d.all()):
                raise CheckpointError(f"{reader.folder}: t2d marks {int((~t2d).sum())} target ids as absent, but the draft "
                                      "vocabulary is the full vocabulary")
        return torch.arange(dv, dtype=torch.int64)
    d2t = reader.get("d2t", (dv,), (torch.int64, torch.int32)).to(torch.int64)
    mapped = torch.arange(dv, dtype=torch.int64) + d2t
    if mapped.min() < 0 or mapped.max() >= v:
        bad = int(((mapped < 0) | (mapped >= v)).nonzero()[0])
        raise CheckpointError(f"{reader.file_of('d2t')}: tensor 'd2t' maps draft id {bad} to target id {int(mapped[bad])}, "
                              f"outside the target vocabulary [0, {v})")
    if mapped.unique().numel() != dv:
        raise CheckpointError(f"{reader.file_of('d2t')}: tensor 'd2t' is not one-to-one (two draft ids map to the same target id)")
    if "t2d" in reader:
        t2d = reader.get("t2d", (v,), (torch.bool, torch.uint8, torch.int64)).bool()
        expect = torch.zeros(v, dtype=torch.bool)
        expect[mapped] = True
        if not torch.equal(t2d, expect):
            raise CheckpointError(f"{reader.file_of('t2d')}: tensor 't2d' disagrees with d2t at {int((t2d != expect).sum())} target ids")
    return mapped


def _drafter_layer_prefix(reader: CheckpointReader) -> str:
    """``midlayer.`` (EAGLE-3 / SpecForge) or ``layers.0.`` (some exports name the single layer so)."""
    if any(n.startswith("midlayer.") for n in reader.names()):
        return "midlayer."
    if any(n.startswith("layers.0.") for n in reader.names()):
        return "layers.0."
    return "midlayer."


def drafter_layer_shapes(cfg: DrafterConfig) -> dict[str, tuple[int, ...]]:
    """Published names (under the layer prefix) and shapes of the drafter layer's tensors."""
    H, I, nq = cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads
    if cfg.is_mla:
        attn = {"q_a_proj": (cfg.q_lora_rank, 2 * H), "q_a_layernorm": (cfg.q_lora_rank,),
                "q_b_proj": (nq * cfg.qk_head_dim, cfg.q_lora_rank),
                "kv_a_proj_with_mqa": (cfg.kv_lora_rank + cfg.qk_rope_head_dim, 2 * H), "kv_a_layernorm": (cfg.kv_lora_rank,),
                "kv_b_proj": (nq * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank), "o_proj": (H, nq * cfg.v_head_dim)}
    else:
        nkv, hd = cfg.num_key_value_heads, cfg.head_dim
        attn = {"q_proj": (nq * hd, 2 * H), "k_proj": (nkv * hd, 2 * H), "v_proj": (nkv * hd, 2 * H), "o_proj": (H, nq * hd)}
    return {f"self_attn.{n}.weight": shape for n, shape in attn.items()} | {
        "mlp.gate_proj.weight": (I, H), "mlp.up_proj.weight": (I, H), "mlp.down_proj.weight": (H, I),
        "input_layernorm.weight": (H,), "hidden_norm.weight": (H,), "post_attention_layernorm.weight": (H,)}


def drafter_specs(reader: CheckpointReader, cfg: DrafterConfig, target_hidden: int) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Every float tensor the drafter must hold: converted name → (stored name, shape). ``lm_head.weight`` is left
    out when the drafter has none over the full vocabulary at the target's width (the target's stands in)."""
    H, TH = cfg.hidden_size, cfg.target_hidden_size
    lp = _drafter_layer_prefix(reader)
    specs = {"midlayer." + name: (lp + name, shape) for name, shape in drafter_layer_shapes(cfg).items()}
    top = {"fc.weight": (H, 3 * TH), "norm.weight": (H,)}
    if "lm_head.weight" in reader or cfg.draft_vocab_size < cfg.vocab_size or H != target_hidden:
        top["lm_head.weight"] = (cfg.draft_vocab_size, H)
    if cfg.norm_before_fc:
        top["input_norm.weight"] = (3 * TH,)
    if cfg.fc_norm:
        top.update({f"fc_norm.{i}.weight": (TH,) for i in range(3)})
    return specs | {name: (name, shape) for name, shape in top.items()}


def check_drafter_tensors(reader: CheckpointReader, cfg: DrafterConfig, target_hidden: int,
                          scheme: quant.QuantScheme | None = None) -> None:
    """Check from the headers alone that every drafter tensor is there with its shape and a float dtype, or FP8 with
    its tile scales under an FP8 ``scheme`` (before anything is converted). Raises CheckpointError naming the file and
    tensor (``fc`` narrower or wider than 3 × target hidden first, in those words)."""
    TH = cfg.target_hidden_size
    if "fc.weight" in reader:
        fc = reader.info("fc.weight")
        if len(fc.shape) == 2 and fc.shape[1] != 3 * TH:
            raise CheckpointError(f"{reader.file_of('fc.weight')}: tensor 'fc.weight' has {fc.shape[1]} input columns, "
                                  f"expected 3 × target hidden size = 3 × {TH} = {3 * TH}")
    for name, (stored, shape) in drafter_specs(reader, cfg, target_hidden).items():
        _check_tensor(reader, name, stored, shape, scheme or quant.QuantScheme())


def drafter_tensors(reader: CheckpointReader, cfg: DrafterConfig, target: TargetSource,
                    embedding: str | None = None, tied: bool = False,
                    scheme: quant.QuantScheme | None = None) -> tuple[dict, dict]:
    """Read and check every drafter tensor.

    Args:
        scheme: the drafter checkpoint's quantisation (:func:`drafter_scheme`; None: float). Under FP8 a linear stored
            float8_e4m3fn comes with ``<module>.weight_scale_inv`` (float32); an FP8 ``lm_head`` is dequantised.
        embedding: None (decide: the target's when the drafter has none or an equal one, the drafter's
            own when it differs), "target" or "own" (forced by the caller).
        tied: the drafter's config declares its embedding is the target's (``eagle_config.share_target_embedding``).
    Returns:
        (tensors under published names with the layer as ``midlayer.*``, plus ``draft_to_target``,
        ``embed_tokens.weight``, ``lm_head.weight`` (the target's when the drafter has none over the full
        vocabulary) and, when asked for, ``input_norm.weight`` / ``fc_norm.{i}.weight``;
        embedding decision {"source": "target"|"drafter", "note": str}).
    Raises:
        CheckpointError: naming the tensor (wrong shape/dtype, ``fc`` width not 3 × target hidden, ...).
    """
    H, TH = cfg.hidden_size, cfg.target_hidden_size
    scheme = scheme or quant.QuantScheme()
    check_drafter_tensors(reader, cfg, target.cfg.hidden_size, scheme)
    specs = drafter_specs(reader, cfg, target.cfg.hidden_size)
    out = {}
    for name, (stored, shape) in specs.items():
        out[name] = reader.get(stored, shape)  # dtypes checked above
        if out[name].dtype == quant.FP8_DTYPE:
            s = reader.get(stored.removesuffix("weight") + "weight_scale_inv").float()
            if name == "lm_head.weight":
                out[name] = quant.dequantize_fp8(out[name], s, scheme.block, torch.bfloat16)
            else:
                out[name.removesuffix("weight") + "weight_scale_inv"] = s
    if "lm_head.weight" not in out:  # full vocabulary, same width: the target's head (ModelOpt's export convention)
        out["lm_head.weight"] = target.tensor("lm_head.weight", (cfg.vocab_size, H))
    out["draft_to_target"] = read_draft_vocab(reader, cfg)
    target_embed = None
    if TH == H:
        target_embed = target.tensor("model.embed_tokens.weight", (cfg.vocab_size, TH))
    own_name = next((n for n in ("embed_tokens.weight", "model.embed_tokens.weight") if n in reader), None)
    own = reader.get(own_name, (cfg.vocab_size, H), FLOAT_DTYPES) if own_name else None
    if own is None:
        if target_embed is None:
            raise CheckpointError(f"{reader.folder}: the drafter has no embed_tokens and its hidden size {H} differs from the "
                                  f"target's {TH}, so the target's embedding cannot stand in")
        if embedding == "own":
            raise ConfigError(f"{reader.folder}: --drafter-embedding own, but the drafter has no embed_tokens")
        out["embed_tokens.weight"] = target_embed
        return out, {"source": "target", "note": "the target's (the drafter has none)"}
    if target_embed is None:
        if embedding == "target":
            raise ConfigError(f"{reader.folder}: --drafter-embedding target, but the drafter's hidden size {H} differs from the target's {TH}")
        out["embed_tokens.weight"] = own
        return out, {"source": "drafter", "note": "the drafter's own (its hidden size differs from the target's)"}
    diff = (own.float() - target_embed.float()).abs().max().item()
    if diff == 0:
        out["embed_tokens.weight"] = target_embed
        return out, {"source": "target", "note": f"the target's (the drafter's own '{own_name}' is equal to it)"}
    if embedding == "target" or (embedding is None and tied):
        why = "--drafter-embedding target" if embedding == "target" else "eagle_config.share_target_embedding = true"
        out["embed_tokens.weight"] = target_embed
        return out, {"source": "target", "note": f"the target's ({why}; the drafter's own '{own_name}' differs by up to {diff:.3g} and is not used)"}
    out["embed_tokens.weight"] = own
    why = "--drafter-embedding own" if embedding == "own" else "it is what the drafter was trained with; pass --drafter-embedding target to use the target's"
    return out, {"source": "drafter", "note": f"the drafter's own '{own_name}', which DIFFERS from the target's by up to {diff:.3g} ({why})"}
