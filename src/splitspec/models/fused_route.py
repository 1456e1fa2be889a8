"""DeepSeek-V3 ``noaux_tc`` routing for a few tokens in two Triton kernels, the first steps of the fused MoE layer
(:mod:`splitspec.models.fused_moe` runs the experts):

1. ``router_logits``: the router's scores x · gateᵀ in float32 ([T, E]).
2. ``route_topk``: one program per token: sigmoid, + correction bias for the choice, top-k by repeated arg-max,
   weights from the unbiased scores, normalised and scaled (one expert group).

CUDA tensors, or CPU ones under ``TRITON_INTERPRET=1`` (the tests)."""

from __future__ import annotations

import torch

from splitspec.models.fused_moe import jit, on_device, tl, triton


@jit
def _router_logits(x_ptr, g_ptr, out_ptr, H, E, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    t = tl.program_id(0)
    e = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    acc = tl.zeros([BLOCK_E, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        xv = tl.load(x_ptr + t * H + k, mask=k < H, other=0.0).to(tl.float32)
        w = tl.load(g_ptr + e[:, None] * H + k[None, :], mask=(e[:, None] < E) & (k[None, :] < H), other=0.0)
        acc += w.to(tl.float32) * xv[None, :]
    tl.store(out_ptr + t * E + e, tl.sum(acc, axis=1), mask=e < E)


@jit
def _route_topk(logits_ptr, bias_ptr, ids_ptr, wt_ptr, E, scaling, start, TOP_K: tl.constexpr, BLOCK_E: tl.constexpr,
                BLOCK_TOP: tl.constexpr, NORMALIZE: tl.constexpr):
    t = tl.program_id(0)
    e = tl.arange(0, BLOCK_E)
    scores = tl.sigmoid(tl.load(logits_ptr + t * E + e, mask=e < E, other=0.0))
    choice = tl.where(e < E, scores + tl.load(bias_ptr + e, mask=e < E, other=0.0).to(tl.float32), float("-inf"))
    slot = tl.arange(0, BLOCK_TOP)
    ids = tl.zeros([BLOCK_TOP], dtype=tl.int32)
    wts = tl.zeros([BLOCK_TOP], dtype=tl.float32)
    for j in tl.static_range(TOP_K):  # highest choice first; the lowest expert id among equals
        best = tl.min(tl.where(choice == tl.max(choice, axis=0), e, BLOCK_E), axis=0)
        ids = tl.where(slot == j, best, ids)
        wts = tl.where(slot == j, tl.sum(tl.where(e == best, scores, 0.0), axis=0), wts)
        choice = tl.where(e == best, float("-inf"), choice)
    if NORMALIZE:
        wts = wts / (tl.sum(wts, axis=0) + 1e-20)
    tl.store(ids_ptr + t * TOP_K + slot, ids - start, mask=slot < TOP_K)
    tl.store(wt_ptr + t * TOP_K + slot, wts * scaling, mask=slot < TOP_K)


@torch.library.custom_op("splitspec::route", mutates_args=())
def _route_op(x: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor, top_k: int, scaling: float,
              normalize: bool, start: int) -> tuple[torch.Tensor, torch.Tensor]:
    with on_device(x):
        T, H = x.shape
        E = gate.shape[0]
        logits = torch.empty(T, E, dtype=torch.float32, device=x.device)
        # two experts' rows per program, each read in one go: the gate is ~5–11 MB, too little to hide load latency in a loop
        _router_logits[(T, triton.cdiv(E, 2))](x.contiguous(), gate.contiguous(), logits, H, E, BLOCK_E=2,
                                               BLOCK_K=min(triton.next_power_of_2(H), 8192), num_warps=8)
        ids = torch.empty(T, top_k, dtype=torch.int32, device=x.device)
        weights = torch.empty(T, top_k, dtype=torch.float32, device=x.device)
        _route_topk[(T,)](logits, bias.contiguous(), ids, weights, E, scaling, start, TOP_K=top_k, BLOCK_E=triton.next_power_of_2(E),
                          BLOCK_TOP=triton.next_power_of_2(top_k), NORMALIZE=normalize,
                          num_warps=1)  # one warp: its reductions need no shared memory
        return weights, ids


@_route_op.register_fake
def _(x, gate, bias, top_k, scaling, normalize, start):
    return x.new_empty(x.shape[0], top_k, dtype=torch.float32), x.new_empty(x.shape[0], top_k, dtype=torch.int32)


def route(x: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor, top_k: int, scaling: float,
          normalize: bool, start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 ``noaux_tc`` routing with one expert group, in two kernels (see the module docstring).

    x: [T, H] float; gate: [E, H] float (any float dtype; products summed in float32); bias: [E] correction bias,
    added for the choice only. Returns (weights [T, top_k] float32: sigmoid scores of the chosen experts,
    divided by their sum + 1e-20 when ``normalize``, × ``scaling``; expert ids [T, top_k] int32, highest biased
    score first), less ``start`` (a rank's first expert: ids relative to it, without a launch of its own). Same
    result as :func:`splitspec.models.target.noaux_tc_route` with ``n_group = 1``, up to the
    order of the float32 sums and, among exactly equal biased scores, which are chosen (here the lowest ids).
    """
    return _route_op(x, gate, bias, top_k, float(scaling), bool(normalize), int(start))
