"""The numerical reference for tests: a Kimi-K2 / DeepSeek-V3 checkpoint loaded with transformers' own model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from splitspec.errors import CheckpointError


def load_hf_reference_target(target_dir: Path, dtype: torch.dtype = torch.float32) -> Any:
    """Load a Kimi-K2 / DeepSeek-V3 checkpoint with transformers' native ``DeepseekV3ForCausalLM``.

    Kimi-K2 configs say ``model_type: kimi_k2``, which transformers does not know: loaded as is, its
    per-expert -> stacked-expert weight conversion (registered under ``deepseek_v3``) is skipped and
    every routed expert is left randomly initialised with only a warning. This loads the config, sets
    ``model_type`` to ``deepseek_v3`` and insists that no key is missing or unexpected.

    Args:
        target_dir: folder with ``config.json`` and safetensors weights.
        dtype: parameter dtype of the loaded model (router weight and bias stay float32).

    Returns:
        ``transformers.DeepseekV3ForCausalLM`` in eval mode on the CPU.

    Raises:
        CheckpointError: keys missing, unexpected or of mismatched shape.
    """
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    cfg = DeepseekV3Config.from_pretrained(str(target_dir))
    cfg.model_type = "deepseek_v3"
    model, info = DeepseekV3ForCausalLM.from_pretrained(str(target_dir), config=cfg, dtype=dtype,
                                                        output_loading_info=True)
    problems = {k: sorted(info[k])[:5] for k in ("missing_keys", "unexpected_keys", "mismatched_keys") if info[k]}
    if problems:
        raise CheckpointError(f"{target_dir}: transformers DeepseekV3ForCausalLM could not load every tensor: {problems}")
    return model.eval()


def reference_mla_drafter(folder: Path, embed: torch.Tensor, aux: torch.Tensor, tokens: torch.Tensor,
                          lm_head: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """An MLA EAGLE-3 drafter (``Eagle3DeepseekV2ForCausalLM``) forward from its published checkpoint, built from
    transformers' DeepSeek-V3 modules: ``DeepseekV3Attention`` (made with hidden size 2·H, so ``q_a_proj`` and
    ``kv_a_proj_with_mqa`` read concat(embedding, hidden) as vLLM / SGLang / TensorRT-LLM load them, its ``o_proj``
    replaced by the drafter's [H, heads·v]), ``DeepseekV3RotaryEmbedding`` (YaRN), ``DeepseekV3MLP`` and
    ``DeepseekV3RMSNorm``; full causal attention over the T tokens, no cache, float32.

    Every norm uses the config's ``rms_norm_eps``, the latent norms too (vLLM and SGLang build them so;
    transformers' own attention would use 1e-6 there). ``fc_norm`` and ``norm_output`` as the config says.

    Args:
        embed: [vocab, H] the embedding the drafter reads (its own or the target's); aux: [T, 3·H]; tokens: [T].
        lm_head: [draft_vocab, H] when the checkpoint has none (a ModelOpt export: the target's).
    Returns:
        (logits [T, draft_vocab], the state fed to the next step [T, H]).
    """
    from safetensors.torch import load_file
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (DeepseekV3Attention, DeepseekV3MLP, DeepseekV3RMSNorm,
                                                                      DeepseekV3RotaryEmbedding)

    from splitspec.files import read_json

    raw = read_json(Path(folder) / "config.json")
    w: dict[str, torch.Tensor] = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        w |= {k.replace("layers.0.", "midlayer.", 1): v for k, v in load_file(str(f)).items()}
    w = {k: v.float() for k, v in w.items()}
    H, eps, T = raw["hidden_size"], raw["rms_norm_eps"], tokens.shape[0]
    keys = ("num_attention_heads", "num_key_value_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
            "v_head_dim", "rope_theta", "rope_scaling", "max_position_embeddings", "vocab_size", "intermediate_size")
    cfg = DeepseekV3Config(**{k: raw[k] for k in keys}, hidden_size=2 * H, rms_norm_eps=eps, attention_bias=False)
    cfg._attn_implementation = "eager"

    def load(module: torch.nn.Module, prefix: str) -> torch.nn.Module:
        module.load_state_dict({n: w[prefix + n] for n, _ in module.named_parameters()})
        return module

    attn = DeepseekV3Attention(cfg, 0)
    attn.o_proj = torch.nn.Linear(raw["num_attention_heads"] * raw["v_head_dim"], H, bias=False)
    load(attn, "midlayer.self_attn.")
    attn.q_a_layernorm.variance_epsilon = attn.kv_a_layernorm.variance_epsilon = eps
    mlp = load(DeepseekV3MLP(DeepseekV3Config(**{k: raw[k] for k in keys}, hidden_size=H)), "midlayer.mlp.")

    def norm(x: torch.Tensor, name: str) -> torch.Tensor:
        return load(DeepseekV3RMSNorm(x.shape[-1], eps=eps), name.removesuffix("weight"))(x)

    if raw.get("fc_norm"):
        aux = torch.cat([norm(c, f"fc_norm.{i}.weight") for i, c in enumerate(aux.chunk(3, -1))], -1)
    g = aux @ w["fc.weight"].T
    a = torch.cat((norm(embed.float()[tokens], "midlayer.input_layernorm.weight"), norm(g, "midlayer.hidden_norm.weight")), -1)[None]
    cos, sin = DeepseekV3RotaryEmbedding(cfg)(a, torch.arange(T)[None])
    mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
    h = g + attn(a, (cos, sin), mask)[0][0]
    h = h + mlp(norm(h, "midlayer.post_attention_layernorm.weight"))
    out = norm(h, "norm.weight")
    head = w["lm_head.weight"] if "lm_head.weight" in w else lm_head.float()
    return out @ head.T, out if raw.get("norm_output") else h
