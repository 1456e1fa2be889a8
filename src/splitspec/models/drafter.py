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
from splitspec.models.layers import Rotary, TPComm, attend, attend_padded, gated_mlp, rms_norm
from splitspec.models.batch import ForwardBatch


class DrafterKVCache:
    """K/V cache of the drafter's single layer on one rank: k, v [rows, local kv heads, head_dim]
    (rows = token budget, shared block layout with the target; see :mod:`splitspec.models.kv`)."""

    def __init__(self, cfg: DrafterConfig, rows: int, dtype: torch.dtype, device, tp_size: int = 1):
        shape = (rows, cfg.num_key_value_heads // tp_size, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


def shard_drafter(w: dict[str, torch.Tensor], cfg: DrafterConfig, rank: int, size: int) -> dict[str, torch.Tensor]:
    """Slice TP1 runtime-layout drafter weights for rank ``rank`` of ``size`` (Megatron-style).

    q/k/v rows and o_proj columns by head; gate/up rows and down columns by intermediate; lm_head rows
    by draft vocabulary (logits all-gathered). fc, norms, embedding and the vocabulary map are replicated.
    Raises ConfigError if ``size`` does not divide the heads, intermediate size or draft vocabulary.
    """
    from splitspec.errors import ConfigError

    if size == 1:
        return w
    for name, v in (("num_attention_heads", cfg.num_attention_heads), ("num_key_value_heads", cfg.num_key_value_heads),
                    ("intermediate_size", cfg.intermediate_size), ("draft_vocab_size", cfg.draft_vocab_size)):
        if v % size:
            raise ConfigError(f"drafter {name} = {v} is not divisible by draft_tp = {size}")
    nq, nkv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    part = lambda t, dim: t.chunk(size, dim)[rank]  # noqa: E731
    q, k, v = w["qkv_proj"].split([nq, nkv, nkv])
    gate, up = w["mlp.w13"].chunk(2)
    out = dict(w)
    out["qkv_proj"] = torch.cat([part(q, 0), part(k, 0), part(v, 0)])
    out["o_proj"] = part(w["o_proj"], 1)
    out["mlp.w13"] = torch.cat([part(gate, 0), part(up, 0)])
    out["mlp.w2"] = part(w["mlp.w2"], 1)
    out["lm_head"] = part(w["lm_head"], 0)
    return {n: t.contiguous() for n, t in out.items()}


class DrafterModel:
    """An EAGLE-3 drafter (one rank of it when ``comm.size`` > 1: weights from :func:`shard_drafter`),
    weights in the runtime layout written by ``splitspec.build.engines``.

    ``draft_to_target`` [draft_vocab] int64 maps draft ids to target ids (from d2t offsets).
    """

    def __init__(self, cfg: DrafterConfig, weights: dict[str, torch.Tensor], comm: TPComm | None = None):
        self.cfg, self.w = cfg, weights
        self.comm = comm or TPComm()
        self.device = weights["fc"].device
        self.rotary = Rotary(cfg.rope, self.device)
        self.draft_to_target = weights["draft_to_target"]
        self.nq, self.nkv = cfg.num_attention_heads // self.comm.size, cfg.num_key_value_heads // self.comm.size

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """aux [T, 3·target_hidden] (target states at the capture points) → [T, H].

        When the drafter's config asks for it, the aux states are RMS-normalised first: ``norm_before_fc``
        (one norm over all 3·target_hidden, weight ``fc_input_norm``), then ``fc_norm`` (one norm per aux
        state, weights ``fc_norm`` [3, target_hidden]) — vLLM's order.
        """
        c, w = self.cfg, self.w
        if getattr(c, "norm_before_fc", False):
            aux = rms_norm(aux, w["fc_input_norm"], c.rms_norm_eps)
        if getattr(c, "fc_norm", False):
            aux = torch.cat([rms_norm(part, w["fc_norm"][i], c.rms_norm_eps) for i, part in enumerate(aux.chunk(3, -1))], -1)
        return F.linear(aux.to(w["fc"].dtype), w["fc"])

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
        nq, nkv, hd = self.nq, self.nkv, c.head_dim
        q, k, v = F.linear(a, w["qkv_proj"]).split([nq * hd, nkv * hd, nkv * hd], -1)
        cos, sin = self.rotary.cos_sin(batch.positions)
        q = self.rotary.apply(q.view(-1, nq, hd), cos, sin)
        k = self.rotary.apply(k.view(-1, nkv, hd), cos, sin)
        v = v.view(-1, nkv, hd)
        if batch.table is not None:  # padded form: static shapes
            cache.k[batch.write_rows] = k
            cache.v[batch.write_rows] = v
            B = batch.table.shape[0]
            out = attend_padded(q.view(B, -1, nq, hd), cache.k[batch.table], cache.v[batch.table], batch.positions.view(B, -1),
                                hd ** -0.5).reshape(q.shape)
        else:
            out = self._attend_segments(q, k, v, batch, cache)
        h = hidden + self.comm.all_reduce(F.linear(out.reshape(out.shape[0], -1), w["o_proj"]))
        h = h + self.comm.all_reduce(gated_mlp(rms_norm(h, w["post_attention_layernorm"], c.rms_norm_eps), w["mlp.w13"], w["mlp.w2"]))
        logits = self.comm.all_gather_last(F.linear(rms_norm(h[batch.logits_rows], w["norm"], c.rms_norm_eps), w["lm_head"]).float())
        return logits, h

    def _attend_segments(self, q, k, v, batch: ForwardBatch, cache: DrafterKVCache) -> torch.Tensor:
        nq, nkv, hd = self.nq, self.nkv, self.cfg.head_dim
        out = torch.empty_like(q)
        t = 0
        for (start, n), rows in zip(batch.segments, batch.slots):
            cache.k[rows[start:]] = k[t:t + n]
            cache.v[rows[start:]] = v[t:t + n]
            ks = cache.k[rows].repeat_interleave(nq // nkv, dim=1)
            vs = cache.v[rows].repeat_interleave(nq // nkv, dim=1)
            out[t:t + n] = attend(q[t:t + n], ks, vs, batch.positions[t:t + n], hd ** -0.5)
            t += n
        return out

    def propose(self, logits: torch.Tensor) -> torch.Tensor:
        """Greedy draft tokens as target ids: logits [R, draft_vocab] → [R] int64."""
        return self.draft_to_target[logits.argmax(-1)]
