"""Build: turn converted rank shards into engines in the runtime layout.

Runtime layout of a target rank (names used by :class:`splitspec.models.target.TargetModel`):
``embed_tokens`` [V/N, H], ``lm_head`` [V/N, H], ``norm`` [H]; per layer ``layers.L.``:
``input_layernorm``, ``post_attention_layernorm``; ``attn.fused_qkv_a`` [q_lora + kv_lora + rope, H]
(q_a_proj and kv_a_proj_with_mqa fused), ``attn.q_a_layernorm``, ``attn.kv_a_layernorm``,
``attn.q_b_proj`` [h·(nope+rope), q_lora], decode-time MLA weights ``attn.w_uk`` [h, nope, kv_lora] and
``attn.w_uv`` [h, v, kv_lora] (kv_b_proj split per head), ``attn.o_proj`` [H, h·v]; dense
``mlp.w13`` [2·I/N, H] / ``mlp.w2``; MoE ``mlp.gate`` [E, H] and ``mlp.e_score_correction_bias`` [E]
(float32), stacked experts ``mlp.experts.w13`` [E_local, 2·I_e, H] / ``mlp.experts.w2`` [E_local, H, I_e],
``mlp.shared.w13`` / ``mlp.shared.w2``. Drafter: ``qkv_proj`` fused, ``mlp.w13`` fused, ``draft_to_target``.

``engine.json`` records architecture, dtype, model config, mapping, limits (max batch size,
max sequence length, max draft length) and, for the drafter, its aux layer ids and convention.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from tqdm import tqdm

from splitspec.config import DrafterConfig, Mapping, TargetConfig
from splitspec.convert import FORMAT, TOKENIZER_FILES
from splitspec.errors import CheckpointError, ConfigError
from splitspec.io import CheckpointReader, atomic_dir, read_json, save_tensors, write_json

ENGINE_FORMAT = "splitspec-engine-v1"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def target_runtime_layout(src: CheckpointReader, cfg: TargetConfig, mapping: Mapping, rank: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Runtime-layout tensors of one target rank from its converted shard (Hugging Face names)."""
    heads = cfg.num_attention_heads // mapping.tp_size
    cast = lambda t: t.to(dtype)  # noqa: E731
    out = {"embed_tokens": cast(src.get("model.embed_tokens.weight")), "lm_head": cast(src.get("lm_head.weight")),
           "norm": cast(src.get("model.norm.weight"))}
    for layer in range(cfg.num_hidden_layers):
        p, q = f"model.layers.{layer}.", f"layers.{layer}."
        a = p + "self_attn."
        out[q + "input_layernorm"] = cast(src.get(p + "input_layernorm.weight"))
        out[q + "post_attention_layernorm"] = cast(src.get(p + "post_attention_layernorm.weight"))
        out[q + "attn.fused_qkv_a"] = cast(torch.cat((src.get(a + "q_a_proj.weight"), src.get(a + "kv_a_proj_with_mqa.weight"))))
        out[q + "attn.q_a_layernorm"] = cast(src.get(a + "q_a_layernorm.weight"))
        out[q + "attn.kv_a_layernorm"] = cast(src.get(a + "kv_a_layernorm.weight"))
        out[q + "attn.q_b_proj"] = cast(src.get(a + "q_b_proj.weight"))
        kv_b = src.get(a + "kv_b_proj.weight").view(heads, cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.kv_lora_rank)
        out[q + "attn.w_uk"] = cast(kv_b[:, : cfg.qk_nope_head_dim])
        out[q + "attn.w_uv"] = cast(kv_b[:, cfg.qk_nope_head_dim:])
        out[q + "attn.o_proj"] = cast(src.get(a + "o_proj.weight"))
        m = p + "mlp."
        if not cfg.is_moe_layer(layer):
            out[q + "mlp.w13"] = cast(torch.cat((src.get(m + "gate_proj.weight"), src.get(m + "up_proj.weight"))))
            out[q + "mlp.w2"] = cast(src.get(m + "down_proj.weight"))
            continue
        out[q + "mlp.gate"] = src.get(m + "gate.weight").float()
        out[q + "mlp.e_score_correction_bias"] = src.get(m + "gate.e_score_correction_bias").float()
        per = cfg.n_routed_experts // mapping.ep_size
        first = mapping.ep_rank(rank) * per
        experts = range(first, first + per)
        out[q + "mlp.experts.w13"] = cast(torch.stack([torch.cat((src.get(f"{m}experts.{e}.gate_proj.weight"),
                                                                  src.get(f"{m}experts.{e}.up_proj.weight"))) for e in experts]))
        out[q + "mlp.experts.w2"] = cast(torch.stack([src.get(f"{m}experts.{e}.down_proj.weight") for e in experts]))
        if cfg.n_shared_experts:
            s = m + "shared_experts."
            out[q + "mlp.shared.w13"] = cast(torch.cat((src.get(s + "gate_proj.weight"), src.get(s + "up_proj.weight"))))
            out[q + "mlp.shared.w2"] = cast(src.get(s + "down_proj.weight"))
    return out


def drafter_runtime_layout(src: CheckpointReader, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Runtime-layout tensors of the TP1 drafter from its converted checkpoint."""
    cast = lambda name: src.get(name).to(dtype)  # noqa: E731
    a, m = "midlayer.self_attn.", "midlayer.mlp."
    return {
        "embed_tokens": cast("embed_tokens.weight"), "fc": cast("fc.weight"),
        "input_layernorm": cast("midlayer.input_layernorm.weight"), "hidden_norm": cast("midlayer.hidden_norm.weight"),
        "post_attention_layernorm": cast("midlayer.post_attention_layernorm.weight"),
        "qkv_proj": torch.cat([cast(a + n + ".weight") for n in ("q_proj", "k_proj", "v_proj")]),
        "o_proj": cast(a + "o_proj.weight"),
        "mlp.w13": torch.cat((cast(m + "gate_proj.weight"), cast(m + "up_proj.weight"))), "mlp.w2": cast(m + "down_proj.weight"),
        "norm": cast("norm.weight"), "lm_head": cast("lm_head.weight"), "draft_to_target": src.get("draft_to_target"),
    }


def _read_checkpoint_config(folder: Path, kind: str) -> dict:
    meta = read_json(folder / "config.json")
    if meta.get("format") != FORMAT or meta.get("kind") != kind:
        raise CheckpointError(f"{folder / 'config.json'}: not a converted {kind} checkpoint (format {meta.get('format')!r}, "
                              f"kind {meta.get('kind')!r}); run 'splitspec convert' first")
    return meta


def build_engines(checkpoints: Path, out: Path, dtype: str = "float32", max_batch_size: int = 8,
                  max_seq_len: int = 1024, max_draft_len: int = 8) -> Path:
    """Build ``out/target`` and ``out/drafter`` engines from ``checkpoints`` (output of :func:`convert_pair`).

    Args:
        dtype: weight/activation dtype of the engines ("float32", "bfloat16", "float16"); the router
            and its correction bias stay float32.
        max_batch_size: sequences the KV caches hold at once (slots).
        max_seq_len: tokens per sequence (prompt + generated + draft), bounds the KV caches.
        max_draft_len: largest number of draft tokens per cycle a request may ask for.
    Raises:
        ConfigError: a limit out of range. CheckpointError: a missing or malformed shard.
    """
    checkpoints, out = Path(checkpoints), Path(out)
    if dtype not in DTYPES:
        raise ConfigError(f"dtype '{dtype}' is not supported (expected one of {', '.join(DTYPES)})")
    for name, v in (("max_batch_size", max_batch_size), ("max_seq_len", max_seq_len), ("max_draft_len", max_draft_len)):
        if v < 1:
            raise ConfigError(f"{name} = {v}, expected a positive integer")
    tmeta = _read_checkpoint_config(checkpoints / "target", "target")
    dmeta = _read_checkpoint_config(checkpoints / "drafter", "drafter")
    tcfg, mapping = TargetConfig.from_dict(tmeta["config"]), Mapping.from_dict(tmeta["mapping"])
    dcfg = DrafterConfig.from_dict(dmeta["config"])
    if max_seq_len > tcfg.max_position_embeddings:
        raise ConfigError(f"max_seq_len = {max_seq_len} exceeds the target's max_position_embeddings = {tcfg.max_position_embeddings}")
    limits = {"max_batch_size": max_batch_size, "max_seq_len": max_seq_len, "max_draft_len": max_draft_len}
    tdt = DTYPES[dtype]
    with atomic_dir(out) as tmp:
        (tmp / "target").mkdir()
        (tmp / "drafter").mkdir()
        for rank in tqdm(range(mapping.tp_size), desc="build target ranks", unit="rank"):
            shard = checkpoints / "target" / f"rank{rank}.safetensors"
            if not shard.exists():
                raise CheckpointError(f"{shard}: shard missing (mapping says tp_size={mapping.tp_size})")
            src = CheckpointReader.single(shard)
            save_tensors(target_runtime_layout(src, tcfg, mapping, rank, tdt), tmp / "target" / f"rank{rank}.safetensors")
        for f in TOKENIZER_FILES:
            if (checkpoints / "target" / f).exists():
                shutil.copy2(checkpoints / "target" / f, tmp / "target" / f)
        write_json({"format": ENGINE_FORMAT, "kind": "target", "architecture": "DeepseekV3ForCausalLM", "dtype": dtype,
                    "config": tcfg.to_dict(), "mapping": mapping.to_dict(), "limits": limits}, tmp / "target" / "engine.json")
        save_tensors(drafter_runtime_layout(CheckpointReader.single(checkpoints / "drafter" / "rank0.safetensors"), tdt),
                     tmp / "drafter" / "rank0.safetensors")
        write_json({"format": ENGINE_FORMAT, "kind": "drafter", "architecture": "LlamaForCausalLMEagle3", "dtype": dtype,
                    "config": dcfg.to_dict(), "mapping": {"tp_size": 1}, "limits": limits,
                    "aux_layer_ids": list(dcfg.aux_layer_ids), "aux_convention": dcfg.aux_convention,
                    "capture_points": list(dcfg.capture_points()), "embedding": dmeta.get("embedding")},
                   tmp / "drafter" / "engine.json")
    print(f"built engines → {out}/target (TP{mapping.tp_size}, {dtype}) and {out}/drafter (TP1, {dtype}); limits {limits}")
    return out
