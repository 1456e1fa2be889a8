"""Runtime-layout tensor names and shapes of one rank (what :mod:`splitspec.build.runtime_layout` makes and
:mod:`splitspec.build.engines` writes to ``rank{i}.safetensors``), and seeded random tensors of those shapes for
synthetic engines.

Shapes are per rank: the target's attention heads, vocabulary and dense MLP are split over ``tp_size``,
its routed experts over ``ep_size`` (and their width over ``moe_tp_size``); the drafter is the TP1 whole.
:func:`int4_expert_shapes` turns a target rank's shapes into those of an engine keeping its routed experts INT4.
"""

from __future__ import annotations

import math

import torch

from splitspec import quant
from splitspec.config import Mapping, TargetConfig
from splitspec.drafter_config import DrafterConfig


def mla_shapes(cfg, heads: int, d_in: int, H: int, prefix: str = "") -> dict[str, tuple[int, ...]]:
    """Runtime-layout shapes of one MLA attention (``heads`` of this rank, input width ``d_in``, output H); ``cfg``
    has the MLA fields (a :class:`TargetConfig` or an MLA :class:`DrafterConfig`)."""
    p = prefix + "attn."
    return {p + "fused_qkv_a": (cfg.q_lora_rank + cfg.kv_lora_rank + cfg.qk_rope_head_dim, d_in),
            p + "q_a_layernorm": (cfg.q_lora_rank,), p + "kv_a_layernorm": (cfg.kv_lora_rank,),
            p + "q_b_proj": (heads * cfg.qk_head_dim, cfg.q_lora_rank),
            p + "w_uk": (heads, cfg.qk_nope_head_dim, cfg.kv_lora_rank), p + "w_uv": (heads, cfg.v_head_dim, cfg.kv_lora_rank),
            p + "o_proj": (H, heads * cfg.v_head_dim)}


def target_shapes(cfg: TargetConfig, mapping: Mapping) -> dict[str, tuple[int, ...]]:
    """Runtime-layout tensor shapes of one target rank (see :mod:`splitspec.build.runtime_layout`)."""
    tp = mapping.tp_size
    H, h = cfg.hidden_size, cfg.num_attention_heads // tp
    s = {"embed_tokens": (cfg.vocab_size // tp, H), "lm_head": (cfg.vocab_size // tp, H), "norm": (H,)}
    for layer in range(cfg.num_hidden_layers):
        p = f"layers.{layer}."
        s |= {p + "input_layernorm": (H,), p + "post_attention_layernorm": (H,)} | mla_shapes(cfg, h, H, H, p)
        if not cfg.is_moe_layer(layer):
            s |= {p + "mlp.w13": (2 * cfg.intermediate_size // tp, H), p + "mlp.w2": (H, cfg.intermediate_size // tp)}
            continue
        E, I = cfg.n_routed_experts // mapping.ep_size, cfg.moe_intermediate_size // mapping.moe_tp_size
        si = cfg.moe_intermediate_size * cfg.n_shared_experts // tp
        s |= {p + "mlp.gate": (cfg.n_routed_experts, H), p + "mlp.e_score_correction_bias": (cfg.n_routed_experts,),
              p + "mlp.experts.w13": (E, 2 * I, H), p + "mlp.experts.w2": (E, H, I),
              p + "mlp.shared.w13": (2 * si, H), p + "mlp.shared.w2": (H, si)}
    return s


def drafter_shapes(cfg: DrafterConfig) -> dict[str, tuple[int, ...]]:
    """Runtime-layout tensor shapes of the TP1 drafter (Llama attention or MLA)."""
    H, hd, TH = cfg.hidden_size, cfg.head_dim, cfg.target_hidden_size
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    attn = (mla_shapes(cfg, cfg.num_attention_heads, 2 * H, H) if cfg.is_mla
            else {"qkv_proj": (q + 2 * kv, 2 * H), "o_proj": (H, q)})
    norms = ({"fc_input_norm": (3 * TH,)} if cfg.norm_before_fc else {}) | ({"fc_norm": (3, TH)} if cfg.fc_norm else {})
    return {"embed_tokens": (cfg.vocab_size, H), "fc": (H, 3 * TH), "input_layernorm": (H,),
            "hidden_norm": (H,), "post_attention_layernorm": (H,), **attn,
            "mlp.w13": (2 * cfg.intermediate_size, H), "mlp.w2": (H, cfg.intermediate_size), "norm": (H,),
            "lm_head": (cfg.draft_vocab_size, H), "draft_to_target": (cfg.draft_vocab_size,)} | norms


#: The routed experts' runtime names that an INT4 engine keeps packed (each with ``<name>.scale`` beside it).
INT4_EXPERTS = ("mlp.experts.w13", "mlp.experts.w2")
#: RMS of a uniformly random stored nibble's value (nibble − 8 over −8 … 7): √(21.25 + 0.5²).
NIBBLE_RMS = math.sqrt(21.5)


def int4_expert_shapes(shapes: dict[str, tuple[int, ...]], group: int) -> dict[str, tuple[int, ...]]:
    """``shapes`` of a target rank (:func:`target_shapes`) with every MoE layer's routed experts in the INT4 runtime
    layout ``splitspec build --dtype int4`` writes (docs/formats.md, "Engine files"): each float [E, N, K] becomes
    ``<name>`` int32 [E, N, K/8] (8 nibbles per word) and ``<name>.scale`` [E, N, K/group]; plus
    :data:`splitspec.quant.INT4_KEY` [1]. Raises ValueError when ``group`` is not a multiple of 8 or does not divide
    an expert's input width K."""
    if group < 8 or group % 8:
        raise ValueError(f"INT4 group size {group}: expected a positive multiple of 8")
    out: dict[str, tuple[int, ...]] = {}
    for name, shape in shapes.items():
        if name.endswith(INT4_EXPERTS):
            E, N, K = shape
            if K % group:
                raise ValueError(f"{name}: input width {K} is not a multiple of the INT4 group size {group}")
            out[name], out[name + ".scale"] = (E, N, K // 8), (E, N, K // group)
        else:
            out[name] = shape
    return out | {quant.INT4_KEY: (1,)}


def random_weights(shapes: dict[str, tuple[int, ...]], dtype: torch.dtype, device: str, seed: int,
                   int4_group: int | None = None) -> dict[str, torch.Tensor]:
    """Seeded random tensors: norms ≈ 1, router and its bias float32, linears N(0, 1/fan_in),
    ``draft_to_target`` the first draft-vocabulary ids.

    ``int4_group``: ``shapes`` come from :func:`int4_expert_shapes` and the routed experts are drawn INT4 in that
    layout: packed int32 words of uniformly random nibbles, bf16 group scales uniform in [0.5, 1.5] ×
    fan_in^−½ / :data:`NIBBLE_RMS` (so a weight's RMS is ≈ fan_in^−½, as the float linears'), and
    :data:`splitspec.quant.INT4_KEY` = [int4_group]."""
    g = torch.Generator(device=device).manual_seed(seed)
    out = {}
    for name, shape in shapes.items():
        if int4_group and name == quant.INT4_KEY:
            out[name] = torch.tensor([int4_group], dtype=torch.int64, device=device)
        elif int4_group and name + ".scale" in shapes:  # every bit pattern is a valid word: 8 uniform nibbles
            out[name] = torch.empty(shape, dtype=torch.int32, device=device).random_(-2 ** 31, 2 ** 31, generator=g)
        elif int4_group and name.endswith(".scale") and name.removesuffix(".scale") in shapes:
            fan_in = shape[-1] * int4_group
            t = torch.empty(shape, dtype=torch.bfloat16, device=device).uniform_(0.5, 1.5, generator=g)
            out[name] = t.mul_(fan_in ** -0.5 / NIBBLE_RMS)
        elif name == "draft_to_target":
            out[name] = torch.arange(shape[0], device=device, dtype=torch.int64)
        elif len(shape) == 1:
            out[name] = torch.ones(shape, device=device, dtype=torch.float32 if "bias" in name else dtype)
            if "bias" in name:
                out[name].normal_(0, 0.01, generator=g)
        else:
            t = torch.empty(shape, device=device, dtype=torch.float32 if name.endswith("mlp.gate") else dtype)
            out[name] = t.normal_(0, shape[-1] ** -0.5, generator=g)
    return out
