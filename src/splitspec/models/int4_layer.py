"""The MoE layer of an INT4 engine for a few tokens, its bf16 shared expert beside the routed experts on a second stream.

At one token the layer is a chain of small launches, none of which alone keeps HBM busy. The shared expert does not
depend on the routing, so on CUDA it runs on a side stream (its gate/up product, silu · up in one kernel, its down
product) while the router's two kernels and the routed experts' ``gate_up`` run on the caller's stream; the caller's
stream waits for the side one only before the routed experts' ``down``, which adds the shared expert's output in
its own epilogue (:func:`splitspec.models.int4_down.down_call`'s ``add``): no launch after the join. Inside a CUDA
graph the two branches become parallel nodes; both read disjoint weights, so what the layer costs tends to the
bytes of both together rather than the sum of two latency-bound chains.

Numerics are those of the sequential form (:meth:`splitspec.models.target.TargetModel.moe`, compiled): the shared
expert's products in cuBLAS, silu(gate) · up in float32 rounded once to x's dtype (as inductor's fused kernel
does), routed experts and routing by the same kernels; the routed sum rounded, plus the shared one, rounded once
more.

CUDA tensors; on CPU tensors (Triton's interpreter: the tests) the same calls run one after another on the CPU.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from splitspec.models import fused_route, int4_down, int4_moe, int4_routed
from splitspec.models.fused_moe import available, device_index, jit, on_device, tl, triton

_SIDE: dict[int, torch.cuda.Stream] = {}


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """This process's side stream on ``device`` (one per GPU, made on first use)."""
    index = device_index(device)
    if index not in _SIDE:
        _SIDE[index] = torch.cuda.Stream(device=index)
    return _SIDE[index]


@jit
def _swiglu(gu_ptr, out_ptr, n, I, BLOCK: tl.constexpr):
    """out [T, I] = silu(gate) · up in float32, rounded once, from gu [T, 2·I] (gate columns first); n = T·I."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    base = gu_ptr + (i // I) * (2 * I) + i % I
    g = tl.load(base, mask=i < n, other=0.0).to(tl.float32)
    u = tl.load(base + I, mask=i < n, other=0.0).to(tl.float32)
    tl.store(out_ptr + i, (g / (1.0 + tl.exp(-g)) * u).to(out_ptr.dtype.element_ty), mask=i < n)


def shared_swiglu(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, out: torch.Tensor) -> None:
    """out [T, H] = w2 · (silu(gate) ⊙ up) with (gate, up) = x · w13ᵀ [T, 2·I] (gate columns first); silu · up in
    float32, rounded once to x's dtype (one Triton kernel on CUDA). x: [T, H]; w13: [2·I, H]; w2: [H, I], float."""
    gu = F.linear(x, w13)
    if x.is_cuda and available():
        T, I = gu.shape[0], gu.shape[1] // 2
        act = torch.empty(T, I, dtype=x.dtype, device=x.device)
        _swiglu[(triton.cdiv(T * I, 1024),)](gu, act, T * I, I, BLOCK=1024, num_warps=4)
    else:
        gate, up = gu.chunk(2, dim=-1)
        act = (F.silu(gate.float()) * up.float()).to(x.dtype)
    torch.mm(act, w2.t(), out=out)


def routed_plus(x: torch.Tensor, local: torch.Tensor, weights: torch.Tensor, experts: tuple[torch.Tensor, ...],
                group: int, kernel: int4_moe.Kernel, add: torch.Tensor, join) -> torch.Tensor:
    """The routed experts through the decode kernels of ``kernel`` (:data:`splitspec.models.int4_moe.VARIANTS`) plus
    ``add`` [T, H] in x's dtype, added in ``down``'s epilogue; ``join()`` is called between the two launches (the
    caller's stream waits there for the one writing ``add``). local [T, top_k] int32 and weights [T, top_k] float32
    as :func:`splitspec.models.fused_route.route` returns them; experts as :data:`splitspec.models.int4_routed.NAMES`."""
    p13, s13, p2, s2 = (t.contiguous() for t in experts)
    act = int4_moe.gate_up_call(x, local, p13, s13, group, kernel.variant, kernel.gate_up)
    join()
    return int4_down.down_call(act, local, weights, p2, s2, x.dtype, group, kernel.variant, kernel.down, add=add)


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
        weights, local = fused_route.route(x, gate, bias, top_k, scaling, normalize, expert_start)
        kernel = int4_routed.kernel_for(x.shape[0], x.dtype, w2_packed.shape[-1] * 8)
        experts = (w13_packed, w13_scale, w2_packed, w2_scale)
        if not (x.is_cuda and available() and kernel.variant in int4_moe.VARIANTS):  # not the decode kernels
            y = int4_routed.routed_experts(x, local, weights, dict(zip(int4_routed.NAMES, experts)), group)
            if x.is_cuda:
                main.wait_stream(side)
            return y + shared
        return routed_plus(x, local, weights, experts, group, kernel, shared, lambda: main.wait_stream(side))


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
