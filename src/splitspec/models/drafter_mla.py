"""The MLA EAGLE-3 drafter: one DeepSeek-V3 multi-head latent attention layer over the 2·H EAGLE-3 input
(``Eagle3DeepseekV2ForCausalLM``; vLLM models/deepseek_eagle3.py, SGLang models/kimi_k25_eagle3.py,
TensorRT-LLM _torch/models/modeling_speculative.py ``Eagle3MLAttention``).

Everything around the attention is :class:`splitspec.models.drafter.Eagle3Drafter`'s; the attention is the
target's own :func:`splitspec.models.layers.mla_attention` with ``q_a_proj`` and ``kv_a_proj_with_mqa``
(fused as ``attn.fused_qkv_a`` [q_lora + kv_lora + rope, 2·H]) reading concat(input_layernorm(embed),
hidden_norm(g)), YaRN rotary (interleaved pairs) and the softmax scale of the drafter's own config. Its KV cache
is the target's kind: one latent row (kv_lora_rank + qk_rope_head_dim values) per token, shared by every head,
so a draft_tp shard holds all of it (like the target's ranks) and splits only heads (q_b_proj rows, w_uk, w_uv,
o_proj columns), the MLP and lm_head.
"""

from __future__ import annotations

import torch

from splitspec.drafter_config import DrafterConfig
from splitspec.models import paged_attention
from splitspec.models.batch import ForwardBatch
from splitspec.models.drafter import Eagle3Drafter, shard_common, spans, take
from splitspec.models.layers import TPComm, mla_attention


class MLADrafterKVCache:
    """Latent cache of the MLA drafter's single layer: ``kv`` [rows, kv_lora_rank + qk_rope_head_dim] (latent, then
    the rope key), the same on every rank of a draft_tp group. Bytes: rows × (kv_lora + rope) × dtype size
    (Kimi-K2.5 drafters: 576 × 2 = 1152 bytes per token in bf16, against 64 heads × 2 × 128 × 2 = 32 KiB for a
    Llama drafter of the same width)."""

    shard_dim = None  # every rank holds all of it

    def __init__(self, cfg: DrafterConfig, rows: int, dtype: torch.dtype, device, tp_size: int = 1):
        self.kv = torch.zeros(rows, cfg.kv_lora_rank + cfg.qk_rope_head_dim, dtype=dtype, device=device)

    def parts(self) -> dict[str, torch.Tensor]:
        return {"kv": self.kv}

    @property
    def nbytes(self) -> int:
        return self.kv.nbytes


def shard_mla_drafter(w: dict[str, torch.Tensor], cfg: DrafterConfig, rank: int, size: int) -> dict[str, torch.Tensor]:
    """Slice TP1 runtime-layout MLA-drafter weights for rank ``rank`` of ``size``: ``attn.q_b_proj`` rows,
    ``attn.w_uk`` / ``attn.w_uv`` and ``attn.o_proj`` columns by head (the target's split); the down-projection
    ``attn.fused_qkv_a`` and the norms replicated; the rest as :func:`splitspec.models.drafter.shard_common`; FP8 linears
    with their tiles (:func:`splitspec.models.drafter.take`).
    Raises ConfigError if ``size`` does not divide the heads, intermediate size or draft vocabulary."""
    if size == 1:
        return w
    out = shard_common(w, cfg, rank, size, (("num_attention_heads", cfg.num_attention_heads),))
    for name in ("attn.w_uk", "attn.w_uv"):  # float einsum operands [heads, ·, kv_lora]
        out[name] = w[name].chunk(size, 0)[rank]
    take(out, w, "attn.q_b_proj", 0, [spans(0, cfg.num_attention_heads * cfg.qk_head_dim, size, rank)])
    take(out, w, "attn.o_proj", 1, [spans(0, cfg.num_attention_heads * cfg.v_head_dim, size, rank)])
    return {n: t.contiguous() for n, t in out.items()}


class MLADrafterModel(Eagle3Drafter):
    """An MLA EAGLE-3 drafter (one rank of it when ``comm.size`` > 1: weights from :func:`shard_mla_drafter`), weights
    in the runtime layout of ``splitspec.build.runtime_layout`` (the target layer's ``attn.*`` names)."""

    def __init__(self, cfg: DrafterConfig, weights: dict[str, torch.Tensor], comm: TPComm | None = None):
        super().__init__(cfg, weights, comm)
        self.heads = cfg.num_attention_heads // self.comm.size
        # padded batches attend through the latent paged kernel where it serves (bf16 / fp16 on a GPU)
        self.paged_kernel = paged_attention.latent_serves(self.device, self.dtype, cfg)

    def attention(self, a: torch.Tensor, batch: ForwardBatch, cache: MLADrafterKVCache) -> torch.Tensor:
        cos, sin = self.rotary.cos_sin(batch.positions)
        o = mla_attention(a, self.w, self.cfg, self.heads, self.rotary, cos, sin, batch, cache.kv, self._linear,
                          paged=self.paged_kernel)
        return self._linear(o, "attn.o_proj")
