"""The EAGLE-3 drafter forward (Li et al. 2025, "EAGLE-3", arXiv:2503.01840; published
``LlamaForCausalLMEagle3`` checkpoints).

One Llama decoder layer whose attention input is 2·H wide:
    g   = fc(concat(aux_low, aux_mid, aux_high))          # first draft step; later steps feed the
                                                           # drafter's own output state instead
    a   = concat(input_layernorm(embed(token)), hidden_norm(g))   # embedding first
    h   = g + o_proj(attn(a))                             # residual is g
    out = h + mlp(post_attention_layernorm(h))
    logits over the draft vocabulary = lm_head(norm(out)); target id = draft id + d2t[draft id]
Row j of a drafter forward pairs the target's state at position j with token j+1 and predicts token j+2;
its rotary position is j.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from splitspec.config import DrafterConfig
from splitspec.layers import Rotary, attend, gated_mlp, rms_norm
from splitspec.models.batch import ForwardBatch


class DrafterKVCache:
    """Per-head K/V cache of the drafter's single layer: k, v [slots, max_seq, kv_heads, head_dim]."""

    def __init__(self, cfg: DrafterConfig, slots: int, max_seq_len: int, dtype: torch.dtype, device):
        shape = (slots, max_seq_len, cfg.num_key_value_heads, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


class DrafterModel:
    """An EAGLE-3 drafter at TP1, weights in the runtime layout written by ``splitspec.build``.

    ``draft_to_target`` [draft_vocab] int64 maps draft ids to target ids (from d2t offsets).
    """

    def __init__(self, cfg: DrafterConfig, weights: dict[str, torch.Tensor]):
        self.cfg, self.w = cfg, weights
        self.device = weights["fc"].device
        self.rotary = Rotary(cfg.rope, self.device)
        self.draft_to_target = weights["draft_to_target"]

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """aux [T, 3·target_hidden] (target states at the capture points) → [T, H]."""
        return F.linear(aux.to(self.w["fc"].dtype), self.w["fc"])

    def forward(self, batch: ForwardBatch, hidden: torch.Tensor, cache: DrafterKVCache) -> tuple[torch.Tensor, torch.Tensor]:
        """One drafter step over ``batch``.

        Args:
            batch: tokens to embed (target ids) with positions/segments; logits for ``batch.logits_rows``.
            hidden: [T, H], fc(aux) or the drafter's previous output state.
        Returns:
            (logits [R, draft_vocab] float32, output states [T, H] before the final norm).
        """
        c, w = self.cfg, self.w
        emb = w["embed_tokens"][batch.input_ids]
        a = torch.cat((rms_norm(emb, w["input_layernorm"], c.rms_norm_eps), rms_norm(hidden, w["hidden_norm"], c.rms_norm_eps)), -1)
        nq, nkv, hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        q, k, v = F.linear(a, w["qkv_proj"]).split([nq * hd, nkv * hd, nkv * hd], -1)
        cos, sin = self.rotary.cos_sin(batch.positions)
        q = self.rotary.apply(q.view(-1, nq, hd), cos, sin)
        k = self.rotary.apply(k.view(-1, nkv, hd), cos, sin)
        v = v.view(-1, nkv, hd)
        out = torch.empty_like(q)
        t = 0
        for slot, start, n in batch.segments:
            cache.k[slot, start:start + n] = k[t:t + n]
            cache.v[slot, start:start + n] = v[t:t + n]
            ks = cache.k[slot, :start + n].repeat_interleave(nq // nkv, dim=1)
            vs = cache.v[slot, :start + n].repeat_interleave(nq // nkv, dim=1)
            out[t:t + n] = attend(q[t:t + n], ks, vs, batch.positions[t:t + n], hd ** -0.5)
            t += n
        h = hidden + F.linear(out.reshape(out.shape[0], -1), w["o_proj"])
        h = h + gated_mlp(rms_norm(h, w["post_attention_layernorm"], c.rms_norm_eps), w["mlp.w13"], w["mlp.w2"])
        logits = F.linear(rms_norm(h[batch.logits_rows], w["norm"], c.rms_norm_eps), w["lm_head"]).float()
        return logits, h

    def propose(self, logits: torch.Tensor) -> torch.Tensor:
        """Greedy draft tokens as target ids: logits [R, draft_vocab] → [R] int64."""
        return self.draft_to_target[logits.argmax(-1)]
