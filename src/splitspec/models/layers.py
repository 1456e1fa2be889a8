"""Building blocks shared by the target and the drafter: RMSNorm, rotary embeddings (with YaRN),
gated SiLU MLP, and the tensor-parallel communicator.

Shapes use T = tokens in a forward (all sequences concatenated), H = hidden size.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from splitspec.config import RopeConfig
from splitspec.models import paged_attention


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm (Zhang & Sennrich 2019): x / sqrt(mean(x²) + eps) · weight, computed in float32.

    x: [..., D]; weight: [D]. Returns x's dtype.
    """
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * weight.float()).to(x.dtype)


def gated_mlp(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """SwiGLU MLP with fused gate/up weights: w2 · (silu(x W1ᵀ) ⊙ x W3ᵀ).

    x: [T, H]; w13: [2·I, H] (gate rows first, then up); w2: [H, I]. Returns [T, H].
    """
    gate, up = F.linear(x, w13).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, w2)


class Rotary:
    """Rotary position embedding (Su et al. 2021) with YaRN frequency scaling (arXiv:2309.00071).

    YaRN as in DeepSeek-V3: frequencies between the correction dims for ``beta_fast``/``beta_slow``
    rotations at ``original_max_position_embeddings`` are blended linearly between extrapolation
    (θ_i) and interpolation (θ_i / factor); cos/sin are scaled by :attr:`RopeConfig.cos_sin_scale`.
    """

    def __init__(self, cfg: RopeConfig, device: torch.device | str = "cpu"):
        self.cfg = cfg
        d = cfg.dim
        inv_freq = 1.0 / (cfg.theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
        if cfg.factor > 1:
            def corr_dim(rot: float) -> float:
                return d * math.log(cfg.original_max_position_embeddings / (rot * 2 * math.pi)) / (2 * math.log(cfg.theta))
            low = max(math.floor(corr_dim(cfg.beta_fast)), 0)
            high = min(math.ceil(corr_dim(cfg.beta_slow)), d - 1)
            ramp = ((torch.arange(d // 2, dtype=torch.float32) - low) / max(high - low, 1e-3)).clamp(0, 1)
            inv_freq = inv_freq / cfg.factor * ramp + inv_freq * (1 - ramp)
        self.inv_freq = inv_freq.to(device)
        self.scale = cfg.cos_sin_scale

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [T] int64 → (cos, sin), each [T, dim/2] float32."""
        ang = positions.float()[:, None] * self.inv_freq[None, :]
        return ang.cos() * self.scale, ang.sin() * self.scale

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate x: [T, heads, dim] by per-token angles (cos/sin: [T, dim/2]).

        Interleaved layout rotates pairs (x0, x1), (x2, x3)… and keeps the layout; half-split
        rotates (x_i, x_{i+dim/2}).
        """
        c, s = cos[:, None, :].to(x.dtype), sin[:, None, :].to(x.dtype)
        if self.cfg.interleaved:
            x1, x2 = x[..., 0::2], x[..., 1::2]
            return torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2)
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


def compile_parts(*functions, static=(), pdl: bool = False):
    """``functions`` through ``torch.compile`` (dynamic shapes: one compilation per function and token-count class, not
    per batch bucket), for the padded (CUDA-graph) path of the target's layer halves and the drafter's parts. A
    function that fails to compile runs eagerly instead; dynamo's recompile limit is raised to 64, past its default
    of 8 a function would silently run eagerly (one graph per token-count class, and more when a benchmark switches
    kernels off and on). Pass the class's functions, called with self: compiled bound methods would hold self, and
    self the compiled functions, a reference cycle that keeps a dropped engine's weights on the GPU until the garbage
    collector next runs. Less to trace: floats (eps, softmax scale: constants of the engine) are specialised, and
    ``static`` tensors, whose shapes are fixed for the engine's life (weights), marked static, so that only the
    activations' sizes are symbolic. ``pdl``: the generated Triton kernels launched with programmatic dependent launch
    (inductor's ``triton.enable_pdl``; Hopper and later, ``ServeConfig.pdl``). Returns the compiled functions, in order."""
    import torch._dynamo

    for t in static:
        torch._dynamo.mark_static(t)
    torch._dynamo.config.suppress_errors = True
    torch._dynamo.config.specialize_float = True
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    options = {"triton.enable_pdl": pdl}  # the switch decides, whatever TORCHINDUCTOR_ENABLE_PDL says
    return tuple(torch.compile(f, dynamic=True, options=options) for f in functions)


class TPComm:
    """Collectives of one tensor-parallel group (``torch.distributed``; gloo on CPU, NCCL on GPU).

    With ``size == 1`` every collective is the identity, so one code path serves TP1 and TP-N.
    """

    def __init__(self, rank: int = 0, size: int = 1, group=None):
        self.rank, self.size, self.group = rank, size, group

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over ranks, in place; returns x."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate each rank's x along the last dim, in rank order: [..., D] → [..., size·D]."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of one sequence's new queries over its cached keys.

    q: [L, heads, Dk] at absolute positions q_pos [L]; k: [S, heads, Dk], v: [S, heads, Dv] for
    positions 0..S-1. Key j is visible to a query at position p iff j ≤ p, so cache rows past a
    query (stale rejected drafts) are never read. Returns [L, heads, Dv]; softmax in float32.
    """
    scores = torch.einsum("lhd,shd->hls", q.float(), k.float()) * scale
    mask = torch.arange(k.shape[0], device=q.device)[None, :] > q_pos[:, None]
    scores.masked_fill_(mask[None], float("-inf"))
    return torch.einsum("hls,shd->lhd", scores.softmax(-1), v.float()).to(q.dtype)


def attend_padded(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of B sequences with n new queries each over a padded key window (static shapes,
    CUDA-graph friendly).

    q: [B, n, hq, Dk] at positions q_pos [B, n]; k: [B, S, hk, Dk], v: [B, S, hk, Dv] hold positions 0..S−1 of
    each sequence (rows past a sequence's end are masked, whatever they hold); hq a multiple of hk (grouped-query;
    hk = 1 is the absorbed MLA form, one latent "head" shared by all query heads). K and V are never expanded to
    hq heads: the g = hq/hk query heads of a group are stacked as rows of one matrix product. Scores and the
    value product run in q's dtype, the softmax in float32 (as transformers' eager attention does).
    Returns [B, n, hq, Dv].
    """
    B, n, hq, dk = q.shape
    S, hk, dv = k.shape[1], k.shape[2], v.shape[-1]
    g = hq // hk
    qg = q.reshape(B, n, hk, g, dk).permute(0, 2, 3, 1, 4).reshape(B, hk, g * n, dk)
    scores = torch.matmul(qg, k.permute(0, 2, 3, 1)).float().view(B, hk, g, n, S) * scale
    mask = torch.arange(S, device=q.device)[None, None, :] > q_pos[:, :, None]  # [B, n, S]
    probs = scores.masked_fill(mask[:, None, None], float("-inf")).softmax(-1).to(v.dtype)
    out = torch.matmul(probs.view(B, hk, g * n, S), v.permute(0, 2, 1, 3))  # [B, hk, g·n, Dv]
    return out.view(B, hk, g, n, dv).permute(0, 3, 1, 2, 4).reshape(B, n, hq, dv)


def mla_attention(x: torch.Tensor | None, lw: dict[str, torch.Tensor], c, heads: int, rotary: Rotary, cos: torch.Tensor,
                  sin: torch.Tensor, batch, kv: torch.Tensor, linear, qkv_a: torch.Tensor | None = None,
                  norm_linear=None, paged: bool = False) -> torch.Tensor:
    """Multi-head Latent Attention (DeepSeek-V2/V3) in absorbed form over one layer's latent cache, for the target's
    layers and an MLA EAGLE-3 drafter's single layer alike.

    x: [T, D] normalised input (D = H for the target, 2·H for the drafter, whose ``q_a_proj`` and
    ``kv_a_proj_with_mqa`` read concat(embedding, hidden) as vLLM, SGLang and TensorRT-LLM load them).
    lw: runtime-layout weights ``attn.fused_qkv_a`` [q_lora + kv_lora + rope, D], ``attn.q_a_layernorm``,
    ``attn.kv_a_layernorm``, ``attn.q_b_proj`` [heads·(nope + rope), q_lora], ``attn.w_uk`` [heads, nope, kv_lora],
    ``attn.w_uv`` [heads, v, kv_lora] (this rank's ``heads``). c: a config with q_lora_rank, kv_lora_rank,
    qk_nope_head_dim, qk_rope_head_dim, qk_head_dim, softmax_scale, rms_norm_eps. cos, sin: [T, rope/2] of
    ``batch.positions``. kv: [rows, kv_lora + rope] latent cache (latent then rope key per row; written here for the
    batch's tokens). linear(x, name): x Wᵀ for weight ``name`` of ``lw`` (float or FP8). qkv_a: ``linear(x,
    "attn.fused_qkv_a")`` [T, q_lora + kv_lora + rope] when the caller computed it (with the norm that makes x folded
    in, :mod:`splitspec.models.skinny_gemm`); x is then not read (None). norm_linear(x, norm, name): rms_norm(x,
    lw[norm]) · W[name]ᵀ, for ``q_a_layernorm`` → ``q_b_proj`` (default: the norm, then ``linear``). paged: a padded
    batch attends through :func:`splitspec.models.paged_attention.attend_latent` (the cache rows read through the
    table, no gathered window; a token's bits independent of its batch), else :func:`attend_padded` over ``kv[table]``.
    Returns [T, heads·v_head_dim], the input of ``o_proj``.
    """
    qkv_a = linear(x, "attn.fused_qkv_a") if qkv_a is None else qkv_a
    T = qkv_a.shape[0]
    qa, ckv, kpe = qkv_a.split([c.q_lora_rank, c.kv_lora_rank, c.qk_rope_head_dim], -1)
    if norm_linear is None:
        q = linear(rms_norm(qa, lw["attn.q_a_layernorm"], c.rms_norm_eps), "attn.q_b_proj")
    else:
        q = norm_linear(qa, "attn.q_a_layernorm", "attn.q_b_proj")
    q = q.view(-1, heads, c.qk_head_dim)
    q_nope, q_pe = q.split([c.qk_nope_head_dim, c.qk_rope_head_dim], -1)
    q_pe = rotary.apply(q_pe, cos, sin)
    ckv = rms_norm(ckv, lw["attn.kv_a_layernorm"], c.rms_norm_eps)
    kpe = rotary.apply(kpe[:, None, :], cos, sin)[:, 0]
    new = torch.cat((ckv, kpe), -1)  # the token's cache row: latent, then rope key
    B = None if batch.table is None else batch.table.shape[0]
    if B is not None:  # padded form: static shapes
        kv[batch.write_rows] = new
    q_lat = torch.einsum("thn,hnc->thc", q_nope, lw["attn.w_uk"])  # [T, h, kv_lora]
    q_cat = torch.cat((q_lat, q_pe), -1)
    if B is not None:
        qb, pos = q_cat.view(B, -1, heads, q_cat.shape[-1]), batch.positions.view(B, -1)
        if paged:
            out = paged_attention.attend_latent(qb, kv, batch.table, pos, c.softmax_scale, c.kv_lora_rank)
        else:
            k = kv[batch.table][:, :, None, :]  # [B, S, 1, kv_lora + rope]: one gather of the window
            out = attend_padded(qb, k, k[..., : c.kv_lora_rank], pos, c.softmax_scale)
        out = out.reshape(T, heads, -1)
    else:
        out = torch.empty(T, heads, c.kv_lora_rank, dtype=qkv_a.dtype, device=qkv_a.device)
        t = 0
        for (start, n), rows in zip(batch.segments, batch.slots):
            kv[rows[start:]] = new[t:t + n]
            k = kv[rows][:, None, :].expand(-1, heads, -1)
            out[t:t + n] = attend(q_cat[t:t + n], k, k[..., : c.kv_lora_rank], batch.positions[t:t + n], c.softmax_scale)
            t += n
    return torch.einsum("thc,hvc->thv", out, lw["attn.w_uv"]).reshape(T, -1)
