"""The drafter side of convert: an EAGLE-3 drafter's tensors read and checked, its draft → target vocabulary
mapping, and the choice of its token embedding (its own or the target's).

Published drafters name their single decoder layer ``midlayer.*`` (EAGLE-3, SpecForge) or ``layers.0.*``; the
converted checkpoint always says ``midlayer.*``. ``d2t`` holds offsets (target id = draft id + d2t[draft id]) and
is written as absolute ids, ``draft_to_target``.
"""

from __future__ import annotations

import torch

from splitspec.config import DrafterConfig
from splitspec.convert.safetensors import CheckpointReader
from splitspec.convert.target import FLOAT_DTYPES, TargetSource
from splitspec.errors import CheckpointError, ConfigError

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


def drafter_tensors(reader: CheckpointReader, cfg: DrafterConfig, target: TargetSource,
                    embedding: str | None = None, tied: bool = False) -> tuple[dict, dict]:
    """Read and check every drafter tensor.

    Args:
        embedding: None (decide: the target's when the drafter has none or an equal one, the drafter's
            own when it differs), "target" or "own" (forced by the caller).
        tied: the drafter's config declares its embedding is the target's (``eagle_config.share_target_embedding``).
    Returns:
        (tensors under published names with the layer as ``midlayer.*``, plus ``draft_to_target``,
        ``embed_tokens.weight`` and, when asked for, ``input_norm.weight`` / ``fc_norm.{i}.weight``;
        embedding decision {"source": "target"|"drafter", "note": str}).
    Raises:
        CheckpointError: naming the tensor (wrong shape/dtype, ``fc`` width not 3 × target hidden, ...).
    """
    H, I, TH = cfg.hidden_size, cfg.intermediate_size, cfg.target_hidden_size
    nq, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    lp = _drafter_layer_prefix(reader)
    layer = {
        "self_attn.q_proj.weight": (nq * hd, 2 * H), "self_attn.k_proj.weight": (nkv * hd, 2 * H),
        "self_attn.v_proj.weight": (nkv * hd, 2 * H), "self_attn.o_proj.weight": (H, nq * hd),
        "mlp.gate_proj.weight": (I, H), "mlp.up_proj.weight": (I, H), "mlp.down_proj.weight": (H, I),
        "input_layernorm.weight": (H,), "hidden_norm.weight": (H,), "post_attention_layernorm.weight": (H,),
    }
    top = {"fc.weight": (H, 3 * TH), "norm.weight": (H,), "lm_head.weight": (cfg.draft_vocab_size, H)}
    if cfg.norm_before_fc:
        top["input_norm.weight"] = (3 * TH,)
    if cfg.fc_norm:
        top.update({f"fc_norm.{i}.weight": (TH,) for i in range(3)})
    if "fc.weight" in reader:
        fc = reader.info("fc.weight")
        if len(fc.shape) == 2 and fc.shape[1] != 3 * TH:
            raise CheckpointError(f"{reader.file_of('fc.weight')}: tensor 'fc.weight' has {fc.shape[1]} input columns, "
                                  f"expected 3 × target hidden size = 3 × {TH} = {3 * TH}")
    out = {"midlayer." + name: reader.get(lp + name, shape, FLOAT_DTYPES) for name, shape in layer.items()}
    out.update({name: reader.get(name, shape, FLOAT_DTYPES) for name, shape in top.items()})
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
