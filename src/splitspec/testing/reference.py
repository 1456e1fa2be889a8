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
