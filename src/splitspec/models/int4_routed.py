"""This rank's routed experts kept INT4 (``splitspec build --dtype int4``): which path computes them.

Weights as :mod:`splitspec.models.int4_moe` takes them (the layout of docs/formats.md, "Engine files"): w13 packed
int32 [E_local, 2·I, H/8] with scales [E_local, 2·I, H/G], w2 packed int32 [E_local, H, I/8] with scales
[E_local, H, I/G]; weight = (nibble − 8) · scale, compressed-tensors ``pack-quantized`` as Kimi-K2-Thinking / K2.5
publish it.

On CUDA tensors :func:`kernel_for` picks by token count and shard: up to
:data:`splitspec.models.fused_moe.MAX_TOKENS` tokens :data:`DECODE`, keyed as the FP8 experts' configs are
(:func:`splitspec.models.fused_moe.fp8_class`: one token or many, the rank's experts "narrow" — at most
:data:`splitspec.models.fused_moe.NARROW_I` intermediate rows, the TP8 shard of Kimi's 2048 — or "wide"); past it
:data:`TABLE` by token count.

- **Decode kernels** (:func:`splitspec.models.int4_moe.int4_experts`, W4A16; variants ``fma``, ``mma``,
  ``mma_asm``): each (token, slot) pair reads its expert's 4-bit weights once.
- **W4A16 grouped kernels** (:func:`splitspec.models.grouped_moe.int4_grouped_experts`; ``grouped``,
  ``grouped_asm``): the pairs sorted by expert, each chosen expert's 4-bit weights read once per block of its pairs
  (batches past the decode kernels: prefill chunks, verifies of more than 16 tokens).
- **Dequantised** (``dequant``, and every CPU engine: Triton's interpreter runs the kernels on CPU tensors, slowly,
  for tests only): the experts the batch chose are dequantised for this call (:func:`splitspec.quant.dequantize_int4`,
  to the activations' dtype) and go through :func:`splitspec.models.grouped_moe.grouped_experts`, :data:`CHUNK`
  experts at a time, the chunks' outputs summed: the transient is one chunk's dequantised weights (Kimi-K2.5 at TP8:
  16 experts' slices, 0.26 GB in bf16), not the chosen experts' (all 384 of them for a 512-token prefill chunk:
  4.2 GB per layer call). Without a host synchronisation (CUDA-graph safe): the chosen experts are gathered into a
  fixed number of slots, min(E_local, T·top_k) — every chosen expert, then unchosen ones as padding — so a call
  reads at most T·top_k experts' packed weights, never the whole stack. Exact and portable.

The tensor-core variants (``mma*``, ``grouped*``) compute in bf16: activations of another dtype (the float32 demo
engines) take ``fma`` up to :data:`splitspec.models.fused_moe.MAX_TOKENS` tokens and ``dequant`` past it.
"""

from __future__ import annotations

import torch

from splitspec import quant
from splitspec.models import fused_moe, grouped_moe, int4_moe
from splitspec.models.grouped_moe import grouped_experts
from splitspec.models.int4_moe import Kernel

NAMES = ("mlp.experts.w13", "mlp.experts.w13.scale", "mlp.experts.w2", "mlp.experts.w2.scale")
CHUNK = 16  # experts dequantised at once by the dequantised path
DEQUANT = Kernel("dequant", (), ())

#: The engine's decode kernels for INT4 experts on a GPU (at most MAX_TOKENS tokens), by
#: :func:`splitspec.models.fused_moe.fp8_class` (one token or many, wide or narrow shard). Set from
#: ``bench/lab/int4_moe_bench.py``, whose output ends with this dict and :data:`TABLE` for the kernels it measured
#: fastest; configs as :class:`splitspec.models.int4_moe.Kernel` says (BLOCK_N, BLOCK_K, warps, stages, split[, form]).
#: One numerics per shard: every row a tensor-core variant (``mma`` / ``mma_asm``, like the grouped ones past
#: MAX_TOKENS: bf16 operands, float32 sums), so a verify of k + 1 tokens and a one-token decode of the same token
#: differ only in the order of float32 sums (the module docstring of :mod:`splitspec.models.int4_moe`). Now:
#: ``mma_asm`` in every class; one token: down's slots split over 8 programs at TP1 and over 4 at the TP8 shard
#: (the fix-up of :mod:`splitspec.models.int4_down`), from ``int4_moe_bench.py --one``
#: (docs/lab/2026-12-04-h200-int4-fixup-fp8-grouped); many tokens: the configuration best over TP1 and the TP8
#: shard together (docs/lab/2026-12-02-h200-int4-fp8-full-depth, section 1).
DECODE: dict[tuple[str, str], Kernel] = {
    ("one", "wide"): Kernel("mma_asm", (16, 512, 1, 4, 1), (16, 256, 1, 3, 8)),
    ("many", "wide"): Kernel("mma_asm", (32, 512, 2, 3, 0), (16, 512, 1, 3, 0)),
    ("one", "narrow"): Kernel("mma_asm", (32, 512, 2, 3, 0), (16, 256, 1, 3, 4)),
    ("many", "narrow"): Kernel("mma_asm", (32, 512, 2, 3, 0), (16, 512, 1, 3, 0)),
}

#: The engine's kernels past MAX_TOKENS, by token count T: the first row whose bound is ≥ T (None: any T).
#: Grouped: (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages). ``grouped_asm`` with the configurations fastest at 64–256
#: and at 1024 tokens (docs/lab/2026-12-02-h200-int4-grouped-full-depth: 1.52× the bound at 64 and 256 tokens at
#: TP1, 120–190× faster than the dequantised path). The dequantised path stays for CPUs and float32 activations.
TABLE: tuple[tuple[int | None, Kernel], ...] = (
    (256, Kernel("grouped_asm", (16, 32, 256, 2, 3), (16, 32, 256, 2, 3))),
    (None, Kernel("grouped_asm", (32, 64, 256, 4, 3), (32, 64, 256, 4, 3))),
)


def kernel_for(tokens: int, dtype: torch.dtype, intermediate: int) -> Kernel:
    """The kernels for ``tokens`` tokens of activations in ``dtype`` through this rank's experts of ``intermediate``
    rows: :data:`DECODE` up to MAX_TOKENS, then :data:`TABLE` (see the module docstring)."""
    if tokens <= fused_moe.MAX_TOKENS:
        kernel = DECODE[fused_moe.fp8_class(tokens, intermediate)]
    else:
        kernel = next((k for bound, k in TABLE if bound is None or tokens <= bound), DEQUANT)
    if dtype != torch.bfloat16 and kernel.variant not in ("fma", "dequant"):
        return int4_moe.DEFAULT if tokens <= fused_moe.MAX_TOKENS else DEQUANT
    return kernel


def chosen_experts(local: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(slots [n] int64: expert ids, every chosen one first; slot-relative ids [T, top_k], -1 where another rank's),
    n = min(num_experts, T·top_k), for ``local`` [T, top_k] ids relative to this rank's first expert."""
    E = num_experts
    mine = (local >= 0) & (local < E)
    n = min(E, local.numel())
    hit = torch.zeros(E + 1, dtype=torch.int32, device=local.device).scatter_(0, torch.where(mine, local, E).flatten().long(),
                                                                              torch.ones(local.numel(), dtype=torch.int32,
                                                                                         device=local.device))[:E]
    slots = torch.argsort(hit, descending=True, stable=True)[:n]
    where = torch.full((E,), -1, dtype=torch.int64, device=local.device).scatter_(
        0, slots, torch.arange(n, dtype=torch.int64, device=local.device))
    return slots, torch.where(mine, where[local.clamp(0, E - 1).long()], -1)


def dequantised_experts(x: torch.Tensor, local: torch.Tensor, weights: torch.Tensor, lw: dict[str, torch.Tensor],
                        group: int) -> torch.Tensor:
    """The dequantised path (module docstring): the chosen experts dequantised, :data:`CHUNK` at a time, as grouped
    GEMMs. Same arguments and result as :func:`routed_experts`."""
    p13, s13, p2, s2 = (lw[n] for n in NAMES)
    slots, sub = chosen_experts(local, p13.shape[0])
    H, I = p13.shape[-1] * 8, p2.shape[-1] * 8
    y = None
    for i in range(0, slots.shape[0], CHUNK):  # ids outside [0, CHUNK) after the shift: another chunk's, skipped
        e = slots[i:i + CHUNK]
        w13 = quant.dequantize_int4(p13[e], s13[e], H, group, x.dtype)
        w2 = quant.dequantize_int4(p2[e], s2[e], I, group, x.dtype)
        part = grouped_experts(x, sub - i, weights, w13, w2)
        y = part if y is None else y + part
    return torch.zeros_like(x) if y is None else y  # no token: no slot


def routed_experts(x: torch.Tensor, local: torch.Tensor, weights: torch.Tensor, lw: dict[str, torch.Tensor],
                   group: int) -> torch.Tensor:
    """Σ over this rank's chosen experts of weight · W2[e] (silu(W_gate[e] x) ⊙ W_up[e] x), INT4 weights from ``lw``
    (:data:`NAMES`). x [T, H] float; local [T, top_k] ids relative to this rank's first expert; weights [T, top_k]
    float32. Returns [T, H] in x's dtype."""
    if x.is_cuda and fused_moe.available():
        kernel = kernel_for(x.shape[0], x.dtype, lw[NAMES[2]].shape[-1] * 8)
        if kernel.variant in grouped_moe.GROUPED_VARIANTS:
            return grouped_moe.int4_grouped_experts(x, local, weights, *(lw[n] for n in NAMES), group=group, kernel=kernel)
        if kernel.variant != "dequant":
            return int4_moe.int4_experts(x, local, weights, *(lw[n] for n in NAMES), group=group, kernel=kernel)
    return dequantised_experts(x, local, weights, lw, group)
