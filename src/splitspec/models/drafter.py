"""The EAGLE-3 drafter forward (Li et al. 2025, "EAGLE-3", arXiv:2503.01840): the part every published drafter
shares (:class:`Eagle3Drafter`) and the Llama-attention drafter of ``LlamaForCausalLMEagle3`` checkpoints
(:class:`DrafterModel`); the MLA drafter is in :mod:`splitspec.models.drafter_mla`.

One decoder layer whose attention input is 2·H wide:
    g   = fc(concat(aux_low, aux_mid, aux_high))          # first draft step; later steps feed the
                                                           # drafter's own output state instead
    a   = concat(input_layernorm(embed(token)), hidden_norm(g))   # embedding first
    h   = g + o_proj(attn(a))                             # residual is g
    out = h + mlp(post_attention_layernorm(h))
    logits over the draft vocabulary = lm_head(norm(out)); target id = draft id + d2t[draft id]
    next step's state: out, or norm(out) when the config says ``norm_output`` (EAGLE-3.1)
Row j of a drafter forward pairs the target's state at position j with token j+1 and predicts token j+2;
its rotary position is j.

The interface the engine uses (:mod:`splitspec.models.drafters` picks the class): a model with ``fuse``,
``forward``, ``propose``, ``device``, ``dtype`` and ``cfg``; a KV cache with ``parts()`` (name → tensor, rows first)
and ``shard_dim`` (the dimension a draft_tp shard splits, or None when every rank holds all of it); a shard function.

FP8 drafters (``splitspec build --drafter-dtype fp8``): every linear of :func:`splitspec.models.drafters.drafter_linears`
is float8_e4m3fn with a float32 ``<name>.scale_inv`` per tile beside it and ``fp8.weight_block_size`` in the weights;
each goes through :func:`splitspec.models.fp8_linear.linear` as the target's do (computed in FP8 on a GPU,
dequantised by :func:`splitspec.quant.linear` on the CPU). Embedding, lm_head, norms (and an MLA drafter's ``w_uk`` /
``w_uv``) stay in the activation dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from splitspec import quant
from splitspec.drafter_config import DrafterConfig
from splitspec.errors import ConfigError
from splitspec.models import fp8_linear, paged_attention
from splitspec.models.layers import Rotary, TPComm, attend, attend_padded, compile_parts, rms_norm
from splitspec.models.batch import ForwardBatch


class DrafterKVCache:
    """K/V cache of the Llama drafter's single layer on one rank: k, v [rows, local kv heads, head_dim]
    (rows = token budget, shared block layout with the target; see :mod:`splitspec.models.kv`)."""

    shard_dim = 1  # a draft_tp shard holds its heads

    def __init__(self, cfg: DrafterConfig, rows: int, dtype: torch.dtype, device, tp_size: int = 1):
        shape = (rows, cfg.num_key_value_heads // tp_size, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    def parts(self) -> dict[str, torch.Tensor]:
        return {"k": self.k, "v": self.v}

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


def spans(offset: int, size: int, parts: int, index: int) -> tuple[int, int]:
    """Piece ``index`` of ``parts`` equal pieces of the ``size`` rows or columns starting at ``offset``: (lo, hi)."""
    step = size // parts
    return offset + index * step, offset + (index + 1) * step


def take(out: dict[str, torch.Tensor], w: dict[str, torch.Tensor], name: str, dim: int, pieces: list[tuple[int, int]]) -> None:
    """Set ``out[name]`` to weight ``name`` of ``w`` restricted to ``pieces`` [(lo, hi), …] along ``dim`` (0 rows, 1
    columns), concatenated in that order. An FP8 weight (``<name>.scale_inv`` in ``w``) keeps its tiles when every
    piece starts on a tile boundary and every piece but the last ends on one (the last may end at the weight's
    edge); otherwise the slice is dequantised to the drafter's activation dtype (that of ``embed_tokens``) and
    ``<name>.scale_inv`` is dropped from ``out``."""
    t, s = w[name], w.get(name + ".scale_inv")
    if s is None:
        out[name] = torch.cat([t.narrow(dim, lo, hi - lo) for lo, hi in pieces], dim)
        return
    b = quant.block_size_of(w)[dim]
    size = t.shape[dim]
    tiled = all(lo % b == 0 and (hi % b == 0 or (i == len(pieces) - 1 and hi == size)) for i, (lo, hi) in enumerate(pieces))
    if tiled:
        out[name] = torch.cat([t.narrow(dim, lo, hi - lo) for lo, hi in pieces], dim)
        out[name + ".scale_inv"] = torch.cat([s.narrow(dim, lo // b, -(-hi // b) - lo // b) for lo, hi in pieces], dim)
        return
    full = quant.dequantize_fp8(t, s, quant.block_size_of(w), w["embed_tokens"].dtype)
    out[name] = torch.cat([full.narrow(dim, lo, hi - lo) for lo, hi in pieces], dim)
    out.pop(name + ".scale_inv", None)


def shard_common(w: dict[str, torch.Tensor], cfg: DrafterConfig, rank: int, size: int,
                 divisible: tuple[tuple[str, int], ...] = ()) -> dict[str, torch.Tensor]:
    """The slicing every drafter shares (Megatron-style): gate/up rows and down columns by intermediate, lm_head
    rows by draft vocabulary (logits all-gathered); fc, norms, embedding and the vocabulary map replicated. FP8
    weights are sliced with their tiles (:func:`take`).
    Raises ConfigError if ``size`` does not divide the intermediate size, the draft vocabulary or a ``divisible`` field."""
    for name, v in divisible + (("intermediate_size", cfg.intermediate_size), ("draft_vocab_size", cfg.draft_vocab_size)):
        if v % size:
            raise ConfigError(f"drafter {name} = {v} is not divisible by draft_tp = {size}")
    I = cfg.intermediate_size
    out = dict(w)
    take(out, w, "mlp.w13", 0, [spans(0, I, size, rank), spans(I, I, size, rank)])
    take(out, w, "mlp.w2", 1, [spans(0, I, size, rank)])
    take(out, w, "lm_head", 0, [spans(0, cfg.draft_vocab_size, size, rank)])
    return out


def shard_drafter(w: dict[str, torch.Tensor], cfg: DrafterConfig, rank: int, size: int) -> dict[str, torch.Tensor]:
    """Slice TP1 runtime-layout Llama-drafter weights for rank ``rank`` of ``size``: q/k/v rows and o_proj columns
    by head, the rest as :func:`shard_common`. Raises ConfigError if ``size`` does not divide a split dimension."""
    if size == 1:
        return w
    out = shard_common(w, cfg, rank, size, (("num_attention_heads", cfg.num_attention_heads),
                                            ("num_key_value_heads", cfg.num_key_value_heads)))
    nq, nkv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    take(out, w, "qkv_proj", 0, [spans(0, nq, size, rank), spans(nq, nkv, size, rank), spans(nq + nkv, nkv, size, rank)])
    take(out, w, "o_proj", 1, [spans(0, nq, size, rank)])
    return {n: t.contiguous() for n, t in out.items()}


class Eagle3Drafter:
    """What every EAGLE-3 drafter shares: aux fusion, embedding and the two input norms, residuals, the MLP, the
    final norm, the draft-vocabulary head and its map to target ids. One rank of it when ``comm.size`` > 1.
    A subclass supplies :meth:`attention` (the layer's attention, through ``o_proj``, before the all-reduce).

    ``draft_to_target`` [draft_vocab] int64 maps draft ids to target ids (from d2t offsets). ``dtype``: the
    activations' (that of ``embed_tokens``; an FP8 drafter's linears are float8_e4m3fn, ``block`` their tile).
    """

    def __init__(self, cfg: DrafterConfig, weights: dict[str, torch.Tensor], comm: TPComm | None = None):
        self.cfg, self.w = cfg, weights
        self.comm = comm or TPComm()
        self.device = weights["fc"].device
        self.dtype = weights["embed_tokens"].dtype
        self.block = quant.block_size_of(weights)
        # FP8 linears of many tokens through torch._scaled_mm's block scaling where this GPU has it (as the target's)
        self.fp8_scaled_mm = self.block is not None and fp8_linear.scaled_mm_supported(self.device)
        self.rotary = Rotary(cfg.rope, self.device)
        self.draft_to_target = weights["draft_to_target"]
        self.fast = None  # compiled (attention_part, mlp_part, head_part, propose_part), see compile()

    def _linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """x [T, in] · weight ``name``ᵀ, float or FP8 with its ``scale_inv`` (:func:`splitspec.models.fp8_linear.linear`)."""
        return fp8_linear.linear(x, self.w[name], self.w.get(name + ".scale_inv"), self.block, self.fp8_scaled_mm)

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        """SwiGLU w2 · (silu(x W1ᵀ) ⊙ x W3ᵀ) over ``mlp.w13`` [2·I, H] (gate rows first) and ``mlp.w2``: [T, H] → [T, H]."""
        gate, up = self._linear(x, "mlp.w13").chunk(2, dim=-1)
        return self._linear(F.silu(gate) * up, "mlp.w2")

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """aux [T, 3·target_hidden] (target states at the capture points) → [T, H].

        When the drafter's config asks for it, the aux states are RMS-normalised first: ``norm_before_fc``
        (one norm over all 3·target_hidden, weight ``fc_input_norm``), then ``fc_norm`` (one norm per aux
        state, weights ``fc_norm`` [3, target_hidden]) — vLLM's order.
        """
        c, w = self.cfg, self.w
        if c.norm_before_fc:
            aux = rms_norm(aux, w["fc_input_norm"], c.rms_norm_eps)
        if c.fc_norm:
            aux = torch.cat([rms_norm(part, w["fc_norm"][i], c.rms_norm_eps) for i, part in enumerate(aux.chunk(3, -1))], -1)
        return self._linear(aux.to(self.dtype), "fc")

    def attention(self, a: torch.Tensor, batch: ForwardBatch, cache) -> torch.Tensor:
        """a: [T, 2·H] attention input → [T, H], this rank's part of o_proj's output (summed over ranks after)."""
        raise NotImplementedError

    def compile(self, pdl: bool = False) -> None:
        """Use ``torch.compile``d parts (:meth:`attention_part`, :meth:`mlp_part`, :meth:`head_part`,
        :meth:`propose_part`) for padded batches, the CUDA-graph path: the norms, rotary, residual adds and casts between
        the matrix products fuse into a few kernels per step (:func:`splitspec.models.layers.compile_parts`, ``pdl`` its
        programmatic dependent launch)."""
        cls = type(self)
        self.fast = compile_parts(cls.attention_part, cls.mlp_part, cls.head_part, cls.propose_part, static=self.w.values(),
                                  pdl=pdl)

    def attention_part(self, batch: ForwardBatch, hidden: torch.Tensor, cache) -> torch.Tensor:
        """Embedding, the two input norms and :meth:`attention`: [T, H] partial sum before the all-reduce."""
        c, w = self.cfg, self.w
        emb = w["embed_tokens"][batch.input_ids]
        a = torch.cat((rms_norm(emb, w["input_layernorm"], c.rms_norm_eps), rms_norm(hidden, w["hidden_norm"], c.rms_norm_eps)), -1)
        return self.attention(a, batch, cache)

    def mlp_part(self, hidden: torch.Tensor, attn: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Residual add of the reduced attention output, post-attention norm and MLP: (h [T, H], partial sum [T, H])."""
        h = hidden + attn
        return h, self._mlp(rms_norm(h, self.w["post_attention_layernorm"], self.cfg.rms_norm_eps))

    def head_part(self, h: torch.Tensor, mlp: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Residual add of the reduced MLP output, final norm and this rank's lm_head rows at ``rows``:
        (logits [R, draft_vocab / ranks] float32, output states [T, H], normed when ``norm_output``)."""
        c, w = self.cfg, self.w
        h = h + mlp
        if c.norm_output:
            h = rms_norm(h, w["norm"], c.rms_norm_eps)
            last = h[rows]
        else:
            last = rms_norm(h[rows], w["norm"], c.rms_norm_eps)
        return self._linear(last, "lm_head").float(), h

    def propose_part(self, h: torch.Tensor, mlp: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`head_part` and :meth:`propose` in one (one rank: the whole draft vocabulary), for the rows at ``rows``
        only: (draft tokens as target ids [R] int64, output states [R, H]). Compiled, the final norm, the float cast,
        argmax and the map to target ids fuse around the lm_head GEMM (no float logits in memory)."""
        c, w = self.cfg, self.w
        h = (h + mlp)[rows]
        last = rms_norm(h, w["norm"], c.rms_norm_eps)
        return self.propose(self._linear(last, "lm_head").float()), last if c.norm_output else h

    def forward(self, batch: ForwardBatch, hidden: torch.Tensor, cache) -> tuple[torch.Tensor, torch.Tensor]:
        """One drafter step over ``batch``.

        Args:
            batch: tokens to embed (target ids) with positions/segments; logits for ``batch.logits_rows``.
            hidden: [T, H], fc(aux) or the drafter's previous output state.
        Returns:
            (logits [R, draft_vocab] float32, output states [T, H]: before the final norm, or after it with
            ``norm_output``).
        """
        cls = type(self)
        attention, mlp, head = (self.fast[:3] if self.fast and batch.table is not None
                                else (cls.attention_part, cls.mlp_part, cls.head_part))
        h, partial = mlp(self, hidden, self.comm.all_reduce(attention(self, batch, hidden, cache)))
        logits, h = head(self, h, self.comm.all_reduce(partial), batch.logits_rows)
        return self.comm.all_gather_last(logits), h

    def propose(self, logits: torch.Tensor) -> torch.Tensor:
        """Greedy draft tokens as target ids: logits [R, draft_vocab] → [R] int64."""
        return self.draft_to_target[logits.argmax(-1)]

    def draft(self, batch: ForwardBatch, hidden: torch.Tensor, cache) -> tuple[torch.Tensor, torch.Tensor]:
        """One drafter step and its greedy proposal, for the padded draft phase: (draft tokens as target ids [R] int64,
        output states [R, H] at ``batch.logits_rows``, the next step's ``hidden``). With the compiled parts on one rank
        the head is :meth:`propose_part` (every op of the step inside a compiled part); otherwise :meth:`forward`, then
        :meth:`propose`. Same tokens either way."""
        if self.fast and batch.table is not None and self.comm.size == 1:
            attention, mlp, _, propose = self.fast
            h, partial = mlp(self, hidden, attention(self, batch, hidden, cache))
            return propose(self, h, partial, batch.logits_rows)
        logits, h = self.forward(batch, hidden, cache)
        return self.propose(logits), h[batch.logits_rows]


class DrafterModel(Eagle3Drafter):
    """An EAGLE-3 drafter with Llama attention (``LlamaForCausalLMEagle3``): GQA with half-split rotary over the 2·H
    input; weights in the runtime layout of ``splitspec.build.runtime_layout`` (``qkv_proj`` fused, ``o_proj``),
    a rank's from :func:`shard_drafter`. Padded batches attend through
    :func:`splitspec.models.paged_attention.attend_paged` (K/V rows read through the row table) where
    :attr:`paged_kernel` is set (bf16/fp16 on a GPU), else through :func:`splitspec.models.layers.attend_padded` over
    the gathered windows."""

    def __init__(self, cfg: DrafterConfig, weights: dict[str, torch.Tensor], comm: TPComm | None = None):
        super().__init__(cfg, weights, comm)
        self.nq, self.nkv = cfg.num_attention_heads // self.comm.size, cfg.num_key_value_heads // self.comm.size
        # padded batches attend straight from the cache rows (no window gather): bf16/fp16 on a GPU with Triton
        self.paged_kernel = paged_attention.serves(self.device, self.dtype)

    def attention(self, a: torch.Tensor, batch: ForwardBatch, cache: DrafterKVCache) -> torch.Tensor:
        nq, nkv, hd = self.nq, self.nkv, self.cfg.head_dim
        q, k, v = self._linear(a, "qkv_proj").split([nq * hd, nkv * hd, nkv * hd], -1)
        cos, sin = self.rotary.cos_sin(batch.positions)
        q = self.rotary.apply(q.view(-1, nq, hd), cos, sin)
        k = self.rotary.apply(k.view(-1, nkv, hd), cos, sin)
        v = v.view(-1, nkv, hd)
        if batch.table is not None:  # padded form: static shapes
            cache.k[batch.write_rows] = k
            cache.v[batch.write_rows] = v
            B = batch.table.shape[0]
            qb, pos = q.view(B, -1, nq, hd), batch.positions.view(B, -1)
            if self.paged_kernel:
                out = paged_attention.attend_paged(qb, cache.k, cache.v, batch.table, pos, hd ** -0.5).reshape(q.shape)
            else:
                out = attend_padded(qb, cache.k[batch.table], cache.v[batch.table], pos, hd ** -0.5).reshape(q.shape)
        else:
            out = self._attend_segments(q, k, v, batch, cache)
        return self._linear(out.reshape(out.shape[0], -1), "o_proj")

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
