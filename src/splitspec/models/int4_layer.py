"""The MoE layer of an INT4 engine for a few tokens, its bf16 shared expert beside the routed experts on a second stream.

At one token the layer is a chain of small launches: the router's two kernels, the routed experts' two
(:mod:`splitspec.models.int4_moe`), the shared expert's two products and its silu · up, the final add. None of
them alone keeps HBM busy; the shared expert does not depend on the routing, so here it runs on a side CUDA stream
while the routing and the routed experts run on the caller's stream, joined before the sum (inside a CUDA graph the
two branches become parallel nodes). Both branches read disjoint weights; what the layer costs tends to the bytes of
both together rather than the sum of two latency-bound chains.

Numerics are those of the sequential form (:meth:`splitspec.models.target.TargetModel.moe`, compiled): the shared
expert's products in cuBLAS, silu(gate) · up in float32 rounded once to x's dtype (as inductor's fused kernel
does), routed experts and routing by the same kernels; the routed sum plus the shared one rounded once more.

CUDA tensors; on CPU tensors (Triton's interpreter: the tests) the same calls run one after another on the CPU.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from splitspec.models import fused_route, int4_routed
from splitspec.models.fused_moe import device_index, on_device

_SIDE: dict[int, torch.cuda.Stream] = {}


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """This process's side stream on ``device`` (one per GPU, made on first use)."""
    index = device_index(device)
    if index not in _SIDE:
        _SIDE[index] = torch.cuda.Stream(device=index)
    return _SIDE[index]


def shared_swiglu(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, out: torch.Tensor) -> None:
    """out [T, H] = w2 · (silu(gate) ⊙ up) with (gate, up) = x · w13ᵀ [T, 2·I] (gate columns first); silu · up in
    float32, rounded once to x's dtype. x: [T, H]; w13: [2·I, H]; w2: [H, I], float."""
    gate, up = F.linear(x, w13).chunk(2, dim=-1)
    torch.mm((F.silu(gate.float()) * up.float()).to(x.dtype), w2.t(), out=out)


@torch.library.custom_op("splitspec::int4_moe_layer", mutates_args=())
def _layer_op(x: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor, top_k: int, scaling: float, normalize: bool,
              expert_start: int, w13_packed: torch.Tensor, w13_scale: torch.Tensor, w2_packed: torch.Tensor,
              w2_scale: torch.Tensor, shared_w13: torch.Tensor, shared_w2: torch.Tensor, group: int) -> torch.Tensor:
    with on_device(x):
        x = x.contiguous()
        shared = torch.empty_like(x)  # allocated on the caller's stream, written on the side one
        if x.is_cuda:
            main, side = torch.cuda.current_stream(x.device), side_stream(x.device)
            side.wait_stream(main)
            branch = torch.cuda.stream(side)
        else:
            branch = contextlib.nullcontext()
        with branch:
            shared_swiglu(x, shared_w13, shared_w2, shared)
        weights, ids = fused_route.route(x, gate, bias, top_k, scaling, normalize)
        lw = dict(zip(int4_routed.NAMES, (w13_packed, w13_scale, w2_packed, w2_scale)))
        y = int4_routed.routed_experts(x, ids - expert_start, weights, lw, group)
        if x.is_cuda:
            main.wait_stream(side)
        return y + shared


@_layer_op.register_fake
def _(x, gate, bias, top_k, scaling, normalize, expert_start, w13_packed, w13_scale, w2_packed, w2_scale, shared_w13,
      shared_w2, group):
    return torch.empty_like(x)


def moe_layer(x: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor, top_k: int, scaling: float, normalize: bool,
              expert_start: int, experts: tuple[torch.Tensor, ...], shared: tuple[torch.Tensor, torch.Tensor],
              group: int) -> torch.Tensor:
    """This rank's MoE output [T, H] (before the all-reduce): routed INT4 experts plus the shared expert.

    x: [T, H] float; gate: router [E, H]; bias: [E] correction bias; top_k, scaling, normalize: DeepSeek-V3's
    ``noaux_tc`` with one expert group (:func:`splitspec.models.fused_route.route`); expert_start: this rank's first
    expert id; experts: (w13 packed, w13 scale, w2 packed, w2 scale) as :data:`splitspec.models.int4_routed.NAMES`;
    shared: (w13 [2·I_s, H], w2 [H, I_s]) bf16; group: INT4 group size."""
    return _layer_op(x, gate, bias, int(top_k), float(scaling), bool(normalize), int(expert_start), *experts, *shared,
                     int(group))
