"""The Kimi-K2 / DeepSeek-V3 target forward, one tensor-parallel rank of it.

Architecture (DeepSeek-V3 technical report, arXiv:2412.19437; Kimi-K2 config):
- Multi-head Latent Attention (MLA): q = W_qb·norm(W_qa·x); latent c_kv = norm(W_kva·x)[:kv_lora_rank]
  plus one shared rope key k_pe; per-head keys/values are W_UK·c_kv and W_UV·c_kv. The runtime uses the
  absorbed form (q·W_UK against the latent cache), so the KV cache holds kv_lora_rank + qk_rope_head_dim
  values per token per layer (512 + 64 for Kimi-K2), not per-head K/V.
- First ``first_k_dense_replace`` layers dense SwiGLU; then MoE: ``noaux_tc`` router (sigmoid scores;
  ``e_score_correction_bias`` added for expert *selection only*; weights from unbiased scores,
  normalised if ``norm_topk_prob``, × ``routed_scaling_factor``), routed experts plus shared experts.

Tensor parallelism (Megatron-style): heads, dense/shared intermediate and vocabulary are split; the MLA
down-projections and the router are replicated; routed experts are split expert-TP × expert-parallel
(:class:`splitspec.config.Mapping`). Two all-reduces per layer (attention, MLP), one for the embedding,
one all-gather for the logits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from splitspec import quant

from splitspec.models import fp8_grouped, fp8_linear, fused_moe, fused_route, int4_layer, int4_routed, paged_attention, skinny_gemm
from splitspec.models.grouped_moe import grouped_experts
from splitspec.config import Mapping, TargetConfig
from splitspec.models.layers import Rotary, TPComm, compile_parts, mla_attention, rms_norm
from splitspec.models.batch import ForwardBatch


def noaux_tc_route(x: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor, cfg: TargetConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 ``noaux_tc`` routing.

    x: [T, H]; gate: [E, H]; bias: [E] float32. Returns (weights [T, top_k] float32, expert ids [T, top_k] int64).
    The bias shifts scores for selection (and group selection) only; weights use the raw sigmoid scores.
    """
    scores = F.linear(x.float(), gate.float()).sigmoid()
    choice = scores + bias.float()
    if cfg.n_group > 1:
        grouped = choice.view(x.shape[0], cfg.n_group, -1)
        group_scores = grouped.topk(2, dim=-1).values.sum(-1)
        keep = torch.zeros_like(group_scores).scatter_(1, group_scores.topk(cfg.topk_group, dim=-1).indices, 1.0)
        choice = grouped.masked_fill(keep[..., None] == 0, float("-inf")).view(x.shape[0], -1)
    ids = choice.topk(cfg.num_experts_per_tok, dim=-1).indices
    w = scores.gather(1, ids)
    if cfg.norm_topk_prob:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return w * cfg.routed_scaling_factor, ids


class TargetKVCache:
    """MLA latent cache of one rank: per layer and token row, the normalised latent c_kv (kv_lora_rank values)
    followed by the shared rope key k_pe (qk_rope_head_dim values), in one tensor ``kv``
    [layers, rows, kv_lora_rank + qk_rope_head_dim] so that attention gathers a window once.

    ``rows`` = token budget (blocks × block size, see :mod:`splitspec.models.kv`). Replicated on every TP rank
    (the latent is shared by all heads). Bytes: layers × rows × (kv_lora_rank + qk_rope_head_dim) × dtype size
    (Kimi-K2: 61 × (512 + 64) × 2 = 70 KB per token in bf16).
    """

    def __init__(self, cfg: TargetConfig, rows: int, dtype: torch.dtype, device):
        self.kv_lora_rank = cfg.kv_lora_rank
        self.kv = torch.zeros(cfg.num_hidden_layers, rows, cfg.kv_lora_rank + cfg.qk_rope_head_dim, dtype=dtype, device=device)

    @property
    def c_kv(self) -> torch.Tensor:
        """[layers, rows, kv_lora_rank] view of the latents."""
        return self.kv[..., : self.kv_lora_rank]

    @property
    def k_pe(self) -> torch.Tensor:
        """[layers, rows, qk_rope_head_dim] view of the rope keys."""
        return self.kv[..., self.kv_lora_rank:]

    @property
    def nbytes(self) -> int:
        return self.kv.nbytes


class TargetModel:
    """One rank of the target, holding its weights in the runtime layout written by ``splitspec.build.engines``.

    Args:
        cfg: the target config.
        mapping: the TP/EP mapping; ``comm`` must be this rank's group.
        weights: runtime-layout tensors of this rank (see :func:`splitspec.build.runtime_layout.target_runtime_layout`).
        skinny_gemm: bf16 linears of at most :data:`splitspec.models.skinny_gemm.MAX_TOKENS` CUDA tokens through the
            skinny-GEMM kernel, one configuration per shape for every token count; where a shape's configuration
            multiplies by multiply-adds (:func:`splitspec.models.skinny_gemm.folds`) input_layernorm (and its
            residual add) folded into ``attn.fused_qkv_a``, ``attn.q_a_layernorm`` into ``attn.q_b_proj``,
            post_attention_layernorm (and its add) into a dense layer's ``mlp.w13`` and SwiGLU's silu · up into
            ``w2``, alike for every token count. The MoE layer then keeps its shared expert out of the fused expert
            kernels and gives gate/up one configuration for every token count too, so that a token's layer is the
            same bits alone and inside a verify. Other linears, FP8 ones and more tokens as without it
            (``ServeConfig.skinny_gemm``).

    Each decoder layer is two halves around its all-reduces: :meth:`attention_half` (residual add, norm + MLA)
    and :meth:`mlp_half` (residual add, norm + dense MLP or MoE), pure functions of the layer's weight dict. :meth:`compile`
    puts both through ``torch.compile`` (dynamic shapes: one compilation per half and layer type, not per
    layer or batch), used for static-shape (padded) batches — the CUDA-graph path — where fusing the
    element-wise work between the matrix products removes most of a layer's small kernels.
    """

    def __init__(self, cfg: TargetConfig, mapping: Mapping, rank: int, weights: dict[str, torch.Tensor], comm: TPComm,
                 skinny_gemm: bool = False):
        self.cfg, self.mapping, self.rank, self.w, self.comm = cfg, mapping, rank, weights, comm
        self.skinny_gemm = skinny_gemm
        self.device = weights["embed_tokens"].device
        self.fp8_block = quant.block_size_of(weights)  # FP8 tile when the engine keeps FP8 linears (``build --dtype fp8``), else None
        self.int4_group = quant.group_size_of(weights)  # INT4 group when routed experts are kept packed (``--dtype int4``)
        # FP8 linears of many tokens through torch._scaled_mm's block scaling where this GPU has it
        self.fp8_scaled_mm = self.fp8_block is not None and fp8_linear.scaled_mm_supported(self.device)
        self.rotary = Rotary(cfg.rope, self.device)
        self.local_heads = cfg.num_attention_heads // mapping.tp_size
        self.vocab_start = rank * (cfg.vocab_size // mapping.tp_size)
        self.expert_start = mapping.ep_rank(rank) * (cfg.n_routed_experts // mapping.ep_size)
        prefixes = [f"layers.{i}." for i in range(cfg.num_hidden_layers)]
        self.layer_w = [{n[len(p):]: t for n, t in weights.items() if n.startswith(p)} for p in prefixes]
        self.fast = None  # compiled (attention_half, mlp_half), see compile()
        # padded batches attend through the latent paged kernel where it serves (bf16 / fp16 on a GPU)
        self.paged_kernel = paged_attention.latent_serves(self.device, weights["embed_tokens"].dtype, cfg)

    def compile(self, pdl: bool = False) -> None:
        """Use ``torch.compile``d layer halves for padded batches (see the class docstring;
        :func:`splitspec.models.layers.compile_parts`, ``pdl`` its programmatic dependent launch)."""
        self.fast = compile_parts(TargetModel.attention_half, TargetModel.mlp_half,
                                  static=[t for lw in self.layer_w for t in lw.values()], pdl=pdl)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Vocabulary-parallel embedding lookup: ids [T] → [T, H] (summed over ranks)."""
        table = self.w["embed_tokens"]
        local = ids - self.vocab_start
        inside = (local >= 0) & (local < table.shape[0])
        h = table[local.clamp(0, table.shape[0] - 1)] * inside[:, None].to(table.dtype)
        return self.comm.all_reduce(h)

    def attention_half(self, lw: dict[str, torch.Tensor], h: torch.Tensor, pending: torch.Tensor | None, batch: ForwardBatch,
                       kv: torch.Tensor, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        """Residual add of ``pending`` (the previous half's reduced output [T, H], or None), input_layernorm + MLA
        in absorbed form over the layer's latent cache ``kv`` [rows, kv_lora + rope] (written here).
        lw: the layer's weights; h: [T, H] residual stream. Returns (h + pending, partial sum [T, H] before
        all-reduce)."""
        x = qkv_a = None
        if self.fold(h, lw, "attn.fused_qkv_a"):  # norm and residual add inside the first product
            qkv_a, h = skinny_gemm.norm_linear(h, pending, lw["input_layernorm"], lw["attn.fused_qkv_a"], self.cfg.rms_norm_eps)
        else:
            h = h if pending is None else h + pending
            x = rms_norm(h, lw["input_layernorm"], self.cfg.rms_norm_eps)
        o = mla_attention(x, lw, self.cfg, self.local_heads, self.rotary, cos, sin, batch, kv, lambda t, n: self.linear(t, lw, n),
                          qkv_a, lambda t, norm, n: self.norm_linear(t, lw, norm, n), self.paged_kernel)
        return h, self.linear(o, lw, "attn.o_proj")

    def norm_linear(self, x: torch.Tensor, lw: dict[str, torch.Tensor], norm: str, name: str) -> torch.Tensor:
        """rms_norm(x, ``lw[norm]``) · ``lw[name]``ᵀ: in one skinny-GEMM kernel where :meth:`skinny` says so, else the
        norm, then :meth:`linear`. x: [T, K] (a view with unit column stride will do) → [T, N]."""
        if self.fold(x, lw, name):
            return skinny_gemm.norm_linear(x, None, lw[norm], lw[name], self.cfg.rms_norm_eps)[0]
        return self.linear(rms_norm(x, lw[norm], self.cfg.rms_norm_eps), lw, name)

    def skinny(self, x: torch.Tensor, lw: dict[str, torch.Tensor], name: str) -> bool:
        """Whether x · ``lw[name]``ᵀ goes through the skinny-GEMM kernel: switched on, a float weight the kernel
        takes (:func:`splitspec.models.skinny_gemm.applies`)."""
        return self.skinny_gemm and name + ".scale_inv" not in lw and skinny_gemm.applies(x, lw[name])

    def fold(self, x: torch.Tensor, lw: dict[str, torch.Tensor], name: str) -> bool:
        """Whether a norm, residual add or silu · up before x · ``lw[name]``ᵀ is folded into the skinny-GEMM kernel:
        :meth:`skinny`, in a multiply-add configuration (:func:`splitspec.models.skinny_gemm.folds`)."""
        return self.skinny(x, lw, name) and skinny_gemm.folds(lw[name])

    def linear(self, x: torch.Tensor, lw: dict[str, torch.Tensor], name: str) -> torch.Tensor:
        """x Wᵀ for weight ``name`` of ``lw``: float, or FP8 with ``name.scale_inv`` tiles, executed in FP8 on the GPU
        and dequantised on CPU (:func:`splitspec.models.fp8_linear.linear`); or the skinny-GEMM kernel (:meth:`skinny`)."""
        if self.skinny(x, lw, name):
            return skinny_gemm.linear(x, lw[name])
        return fp8_linear.linear(x, lw[name], lw.get(name + ".scale_inv"), self.fp8_block, self.fp8_scaled_mm)

    def mlp(self, x: torch.Tensor, lw: dict[str, torch.Tensor], prefix: str) -> torch.Tensor:
        """SwiGLU w2 · (silu(x W1ᵀ) ⊙ x W3ᵀ) over ``prefix + "w13"`` [2·I, H] (gate rows first) / ``prefix + "w2"`` [H, I]
        of ``lw`` (dense or shared expert), float or FP8 (:meth:`linear`). x: [T, H] → [T, H]."""
        return self.down(self.linear(x, lw, prefix + "w13"), lw, prefix)

    def down(self, gate_up: torch.Tensor, lw: dict[str, torch.Tensor], prefix: str) -> torch.Tensor:
        """``prefix + "w2"`` · (silu(gate) ⊙ up) from w13's output [T, 2·I] (gate columns first) → [T, H]; where it
        folds (:meth:`fold`) the skinny-GEMM kernel makes silu · up itself."""
        if self.fold(gate_up, lw, prefix + "w2"):
            return skinny_gemm.linear(gate_up, lw[prefix + "w2"], act=True)
        gate, up = gate_up.chunk(2, dim=-1)
        return self.linear(F.silu(gate) * up, lw, prefix + "w2")

    def moe(self, lw: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """Routed (this rank's experts / intermediate slice) plus shared experts. x: [T, H] → [T, H] partial sum.

        A few tokens on CUDA take the fused decode kernels (:mod:`splitspec.models.fused_moe`): routing in two kernels when
        there is one expert group, the routed experts (and, for a single token, the shared one) in two more,
        which read FP8-kept weights as FP8 (a shared expert left outside them goes through :meth:`mlp`). Otherwise
        :func:`noaux_tc_route`, the shared expert as a SwiGLU and the routed ones as grouped GEMMs
        (:func:`grouped_experts`); FP8-kept experts on a GPU as W8A16 grouped GEMMs
        (:func:`splitspec.models.fp8_grouped.unchecked`), on the CPU dequantised per call. INT4-kept experts: the same routing, the
        shared expert as a SwiGLU, the routed ones by :func:`splitspec.models.int4_routed.routed_experts`; for a few
        CUDA tokens and a bf16 shared expert all in :func:`splitspec.models.int4_layer.moe_layer` (shared expert on a
        side stream)."""
        c = self.cfg
        gate, bias = lw["mlp.gate"], lw["mlp.e_score_correction_bias"]
        experts = ("mlp.experts.w13", "mlp.experts.w2")
        if self.int4_group:
            fused = fused_moe.use_fused(x) and (c.n_group == 1 or c.topk_group >= c.n_group)
            if fused and c.n_shared_experts and "mlp.shared.w13.scale_inv" not in lw:  # shared expert on a side stream
                return int4_layer.moe_layer(x, gate, bias, c.num_experts_per_tok, c.routed_scaling_factor, c.norm_topk_prob,
                                            self.expert_start, tuple(lw[n] for n in int4_routed.NAMES),
                                            (lw["mlp.shared.w13"], lw["mlp.shared.w2"]), self.int4_group)
            if fused:
                weights, local = fused_route.route(x, gate, bias, c.num_experts_per_tok, c.routed_scaling_factor,
                                                   c.norm_topk_prob, self.expert_start)
            else:
                weights, ids = noaux_tc_route(x, gate, bias, c)
                local = ids - self.expert_start
            y = int4_routed.routed_experts(x, local, weights, lw, self.int4_group)
            return y + self.mlp(x, lw, "mlp.shared.") if c.n_shared_experts else y
        if not fused_moe.use_fused(x):
            weights, ids = noaux_tc_route(x, gate, bias, c)
            y = self.mlp(x, lw, "mlp.shared.") if c.n_shared_experts else torch.zeros_like(x)
            if "mlp.experts.w13.scale_inv" in lw and fp8_grouped.use_grouped(x):
                return y + fp8_grouped.unchecked(x, ids - self.expert_start, weights, *(
                    lw[n + s] for n in experts for s in ("", ".scale_inv")), self.fp8_block)
            w13, w2 = (quant.dequantize_fp8(lw[n], lw[n + ".scale_inv"], self.fp8_block, x.dtype) if n + ".scale_inv" in lw
                       else lw[n] for n in experts)
            return y + grouped_experts(x, ids - self.expert_start, weights, w13, w2)
        if c.n_group > 1 and c.topk_group < c.n_group:  # group-limited choice: not in the routing kernel
            weights, ids = noaux_tc_route(x, gate, bias, c)
            local = ids - self.expert_start
        else:
            weights, local = fused_route.route(x, gate, bias, c.num_experts_per_tok, c.routed_scaling_factor,
                                               c.norm_topk_prob, self.expert_start)
        # the kernels read the shared expert once per token: worth it for one token only, and not where a token's
        # layer must be the same bits alone and among others (skinny_gemm: one path and one gate/up config for all)
        one = x.shape[0] == 1 and not self.skinny_gemm
        shared = ("mlp.shared.w13", "mlp.shared.w2") if c.n_shared_experts and one else ()
        names = experts + shared
        scales = [lw.get(n + ".scale_inv") for n in names] + [None] * (4 - len(names))
        y = fused_moe.fused_experts(x, local, weights, *(lw[n] for n in names), scales=scales, fp8_block=self.fp8_block,
                                    gate_up_config=fused_moe.GATE_UP_CONFIG if self.skinny_gemm and scales[0] is None else None)
        return y + self.mlp(x, lw, "mlp.shared.") if c.n_shared_experts and not shared else y

    def mlp_half(self, lw: dict[str, torch.Tensor], moe: bool, h: torch.Tensor, pending: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Residual add of ``pending`` (the attention's reduced output [T, H]), post_attention_layernorm + dense MLP
        or MoE. h: [T, H]. Returns (h + pending, partial sum [T, H] before all-reduce)."""
        if not moe and self.fold(h, lw, "mlp.w13") and self.fold(h, lw, "mlp.w2"):  # norm and add inside w13's product
            gate_up, h = skinny_gemm.norm_linear(h, pending, lw["post_attention_layernorm"], lw["mlp.w13"], self.cfg.rms_norm_eps)
            return h, self.down(gate_up, lw, "mlp.")
        h = h + pending
        x = rms_norm(h, lw["post_attention_layernorm"], self.cfg.rms_norm_eps)
        return h, self.moe(lw, x) if moe else self.mlp(x, lw, "mlp.")

    def block(self, layer: int, h: torch.Tensor, pending: torch.Tensor | None, batch: ForwardBatch, cache: TargetKVCache,
              cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        """One decoder layer with two all-reduces (attention, MLP). The residual stream is carried as (h, pending):
        its value is h + pending ([T, H] each; pending None: h). Each add is done by the half that follows it,
        inside its compiled graph with the norm it feeds. Returns the layer's output in the same form."""
        attention, mlp = self.fast if self.fast and batch.table is not None else (TargetModel.attention_half, TargetModel.mlp_half)
        lw = self.layer_w[layer]
        h, partial = attention(self, lw, h, pending, batch, cache.kv[layer], cos, sin)
        h, partial = mlp(self, lw, self.cfg.is_moe_layer(layer), h, self.comm.all_reduce(partial))
        return h, self.comm.all_reduce(partial)

    def forward(self, batch: ForwardBatch, cache: TargetKVCache, capture: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run the target over ``batch``, writing its tokens' latents into ``cache``.

        Args:
            capture: input-to-layer indices i ∈ [0, N] whose hidden states feed the drafter
                (i = N: after the last block, before the final norm).
        Returns:
            logits [R, vocab_size] for ``batch.logits_rows`` (float32, full vocabulary on every rank), and
            the captured states concatenated [T, len(capture)·H] (or None when capture is empty).
        """
        c = self.cfg
        h, pending = self.embed(batch.input_ids), None
        cos, sin = self.rotary.cos_sin(batch.positions)
        captured = {}
        for layer in range(c.num_hidden_layers):
            if layer in capture:
                captured[layer] = h if pending is None else h + pending
            h, pending = self.block(layer, h, pending, batch, cache, cos, sin)
        h = h if pending is None else h + pending
        if c.num_hidden_layers in capture:
            captured[c.num_hidden_layers] = h
        aux = torch.cat([captured[i] for i in capture], -1) if capture else None
        last = rms_norm(h[batch.logits_rows], self.w["norm"], c.rms_norm_eps)
        logits = self.comm.all_gather_last(F.linear(last, self.w["lm_head"]).float())
        return logits, aux
