"""Routed experts as grouped GEMMs: the MoE path for batches past the fused decode kernels' limit
(:data:`splitspec.models.fused_moe.MAX_TOKENS`), and on CPU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def grouped_experts(x: torch.Tensor, local: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """Routed experts of this rank as two grouped GEMMs (``torch._grouped_mm``), with no host synchronisation.

    x: [T, H]; local: [T, top_k] expert ids relative to this rank's first expert (outside [0, E_local) = another
    rank's); weights: [T, top_k] float32; w13: [E_local, 2·I, H]; w2: [E_local, H, I]. Returns [T, H], the
    weighted sum over this rank's chosen experts. (token, expert) pairs are sorted by expert; each group
    multiplies only its own expert's weights, so only activated experts are read.
    """
    T, K = local.shape
    E = w13.shape[0]
    mine = (local >= 0) & (local < E)
    if x.is_cuda and x.dtype == torch.float32:  # CUDA grouped GEMM is bf16-only: every expert over every token, masked
        gate_w = torch.zeros(T, E + 1, dtype=x.dtype, device=x.device).scatter_add_(
            1, torch.where(mine, local, E), torch.where(mine, weights, 0.0).to(x.dtype))[:, :E]
        h = torch.einsum("th,eih->eti", x, w13)
        gate, up = h.chunk(2, dim=-1)
        return torch.einsum("eti,ehi,te->th", F.silu(gate) * up, w2, gate_w)
    flat = torch.where(mine, local, E).flatten()  # another rank's pairs sort last, past every group
    order = flat.argsort(stable=True)
    counts = torch.zeros(E + 1, dtype=torch.int64, device=x.device).scatter_add_(0, flat, torch.ones_like(flat))
    offs = counts[:E].cumsum(0).to(torch.int32)  # (bincount would synchronise with the host on CUDA)
    tok = order // K
    out = None
    if x.dtype == torch.bfloat16:  # the grouped GEMM's only dtype
        try:
            h = torch._grouped_mm(x[tok], w13.transpose(1, 2), offs=offs)
            gate, up = h.chunk(2, dim=-1)
            out = torch._grouped_mm((F.silu(gate) * up).contiguous(), w2.transpose(1, 2), offs=offs)
        except RuntimeError:  # not on this device
            out = None
    if out is None:  # gather each pair's expert (reads the weights twice)
        e = flat[order].clamp(max=E - 1)
        h = torch.bmm(w13[e], x[tok][:, :, None])[:, :, 0]
        gate, up = h.chunk(2, dim=-1)
        out = torch.bmm(w2[e], (F.silu(gate) * up)[:, :, None])[:, :, 0]
    scale = torch.where(mine.flatten()[order], weights.flatten()[order], 0.0).to(x.dtype)[:, None]
    out = torch.where(scale != 0, out * scale, 0.0)  # rows past the last group are undefined
    return torch.zeros_like(x).index_add_(0, tok, out)
