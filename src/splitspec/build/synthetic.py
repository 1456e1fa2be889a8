"""Synthetic engines: Kimi-K2-shaped target and drafter with random weights, made on the device at load.

For measuring costs at full Kimi-K2 width (hidden 7168, MLA dims, 384 experts × 2048, 8 per token,
1 shared expert, vocabulary 163840) with the depth reduced to fit the GPUs at hand, and a drafter at the
published Kimi-K2 EAGLE-3 size (hidden 7168, 64 heads × 128, intermediate 18432, draft vocabulary 32000).
No checkpoint is written: ``engine.json`` says ``"weights": {"synthetic": {...}}`` and each rank draws its
runtime-layout tensors (:mod:`splitspec.models.shapes`) from a seeded generator. ``dtype="int4"`` keeps the
target's routed experts INT4 as Kimi-K2-Thinking / K2.5 publish them (the layout ``splitspec build --dtype int4``
writes: packed int32 words of 8 nibbles with bf16 scales per group of :data:`INT4_GROUP` inputs), everything else
bf16; ``engine.json`` records it as a built INT4 engine does (``dtype`` ``int4``, ``quantization``).
Outputs of such engines are meaningless; use them with synthetic acceptance (labelled in every result).
"""

from __future__ import annotations

from pathlib import Path

from splitspec.build.engines import int4_quantization
from splitspec.config import Mapping, RopeConfig, TargetConfig
from splitspec.drafter_config import DrafterConfig
from splitspec.errors import ConfigError
from splitspec.files import atomic_dir, write_json

ENGINE_FORMAT = "splitspec-engine-v1"
# Conditional acceptance by draft position for synthetic runs, chosen so that the expected acceptance length
# at k = 3 is 3.28 — inside the published Kimi-K2 EAGLE-3 drafter's 3.2–3.5 at 3 steps (docs/lab/README.md, "Conventions").
KIMI_DRAFTER_PROFILE = [0.90, 0.85, 0.80, 0.75, 0.70, 0.65, 0.60, 0.55]
INT4_GROUP = 32  # inputs per INT4 scale in Kimi-K2-Thinking / K2.5 (compressed-tensors group_size)
SYNTHETIC_DTYPES = ("bfloat16", "float16", "float32", "int4")


def kimi_k2_target(num_layers: int) -> TargetConfig:
    """Kimi-K2's target config (61 layers in the published model) at ``num_layers`` depth."""
    return TargetConfig(
        vocab_size=163840, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
        num_hidden_layers=num_layers, first_k_dense_replace=1, num_attention_heads=64, n_routed_experts=384,
        num_experts_per_tok=8, n_shared_experts=1, routed_scaling_factor=2.827, norm_topk_prob=True,
        q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        rms_norm_eps=1e-6, max_position_embeddings=131072,
        rope=RopeConfig(theta=50000.0, dim=64, factor=32.0, original_max_position_embeddings=4096, beta_fast=1.0,
                        beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0, interleaved=True),
        bos_token_id=163584, eos_token_id=163585, model_type="kimi_k2")


def kimi_k2_drafter(num_target_layers: int) -> DrafterConfig:
    """The published Kimi-K2 EAGLE-3 drafter's shape; aux ids low/mid/high of the reduced target."""
    n = num_target_layers
    return DrafterConfig(hidden_size=7168, intermediate_size=18432, num_attention_heads=64, num_key_value_heads=64,
                         head_dim=128, vocab_size=163840, draft_vocab_size=32000, target_hidden_size=7168,
                         rms_norm_eps=1e-6, rope=RopeConfig(theta=50000.0, dim=128, interleaved=False),
                         aux_layer_ids=(min(1, n), max(n // 2, 1), n), aux_convention="input")


def write_synthetic_engines(out: Path, num_layers: int, tp_size: int, ep_size: int = 1, dtype: str = "bfloat16",
                            max_batch_size: int = 16, max_seq_len: int = 2048, max_draft_len: int = 8, tiny: bool = False) -> Path:
    """Write ``out/target/engine.json`` and ``out/drafter/engine.json`` for Kimi-shaped synthetic engines
    (``tiny``: the demo pair's shapes in float32 instead, for checking a benchmark on a CPU; with ``int4`` the routed
    experts 256 wide, so that every expert-TP slice up to 8 holds whole groups). ``dtype``: one of
    :data:`SYNTHETIC_DTYPES`; ``int4``: routed experts INT4, the rest bf16 (tiny: float32). Raises ConfigError for
    another dtype or a mapping the config cannot take."""
    if dtype not in SYNTHETIC_DTYPES:
        raise ConfigError(f"synthetic engines: dtype '{dtype}', expected one of {', '.join(SYNTHETIC_DTYPES)}")
    int4 = dtype == "int4"
    float_dtype = "bfloat16" if int4 else dtype
    tcfg, dcfg = kimi_k2_target(num_layers), kimi_k2_drafter(num_layers)
    if tiny:
        import dataclasses

        tcfg = dataclasses.replace(tcfg, vocab_size=4096, hidden_size=256, intermediate_size=768,
                                   moe_intermediate_size=256 if int4 else 128,
                                   num_attention_heads=8, n_routed_experts=16, num_experts_per_tok=4, q_lora_rank=96,
                                   kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
                                   rope=dataclasses.replace(tcfg.rope, dim=16))
        dcfg = dataclasses.replace(dcfg, hidden_size=256, intermediate_size=768, num_attention_heads=8, num_key_value_heads=8,
                                   head_dim=32, vocab_size=4096, draft_vocab_size=1024, target_hidden_size=256,
                                   rope=dataclasses.replace(dcfg.rope, dim=32))
        float_dtype = "float32"
    dtype = "int4" if int4 else float_dtype
    mapping = Mapping(tp_size, ep_size)
    mapping.check(tcfg, "synthetic Kimi-K2 target")
    if int4 and (tcfg.moe_intermediate_size // mapping.moe_tp_size) % INT4_GROUP:
        raise ConfigError(f"synthetic INT4 engine: expert slices of {tcfg.moe_intermediate_size // mapping.moe_tp_size} inputs "
                          f"(moe_intermediate_size / moe_tp_size {mapping.moe_tp_size}) do not hold whole groups of {INT4_GROUP}")
    limits = {"max_batch_size": max_batch_size, "max_seq_len": max_seq_len, "max_draft_len": max_draft_len}
    weights = {"synthetic": {"seed": 0, "note": "random weights at Kimi-K2 width; outputs are meaningless"
                             + ("; routed experts random INT4 nibbles and group scales" if int4 else "")}}
    quantization = {"quantization": int4_quantization(INT4_GROUP, float_dtype, "synthetic")} if int4 else {}
    with atomic_dir(out) as tmp:
        (tmp / "target").mkdir()
        (tmp / "drafter").mkdir()
        write_json({"format": ENGINE_FORMAT, "kind": "target", "architecture": "DeepseekV3ForCausalLM", "dtype": dtype,
                    **quantization, "weights": weights, "config": tcfg.to_dict(), "mapping": mapping.to_dict(), "limits": limits},
                   tmp / "target" / "engine.json")
        write_json({"format": ENGINE_FORMAT, "kind": "drafter", "architecture": "LlamaForCausalLMEagle3", "dtype": float_dtype,
                    "weights": weights, "config": dcfg.to_dict(), "mapping": {"tp_size": 1}, "limits": limits,
                    "aux_layer_ids": list(dcfg.aux_layer_ids), "aux_convention": "input",
                    "capture_points": list(dcfg.capture_points())}, tmp / "drafter" / "engine.json")
    return out
