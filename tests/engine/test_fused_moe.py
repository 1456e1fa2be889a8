"""The fused MoE kernels (splitspec.models.fused_moe) against a float64 loop over (token, slot) pairs, against the
grouped-GEMM path and against noaux_tc_route; on CPU through Triton's interpreter, on CUDA where there is one."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")
if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.fail("Triton's interpreter is off: tests/conftest.py sets TRITON_INTERPRET=1 before Triton is imported", pytrace=False)

from splitspec import quant

from splitspec.models import fused_moe, fused_route
from splitspec.models.target import grouped_experts, noaux_tc_route
from splitspec.settings import ServeConfig

# Small shapes that still exercise every mask: H and I not multiples of the blocks, several row blocks,
# several K steps, pairs routed to another rank (ids -1 and E).
T, H, I, E, TOP_K = 3, 40, 24, 5, 3
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the kernels run where the tensors are
# (BLOCK_N, BLOCK_K, num_warps, num_stages): 3 gate/up row blocks, 3 K steps over H, 2 over I. The interpreter
# ignores num_warps and num_stages: on CPU only the block sizes are exercised.
SMALL = (8, 16, 1, 1)


def randn(*shape, g: torch.Generator) -> torch.Tensor:
    return torch.randn(*shape, generator=g).to(DEVICE)


def problem(dtype: torch.dtype, device: str = DEVICE, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(dtype)
    local = torch.tensor([[0, 4, 2], [-1, 1, 4], [3, 5, 0]])  # -1 and 5 = E: another rank's experts
    weights = torch.rand(T, TOP_K, generator=g)
    w13 = (torch.randn(E, 2 * I, H, generator=g) / H ** 0.5).to(dtype)
    w2 = (torch.randn(E, H, I, generator=g) / I ** 0.5).to(dtype)
    return [t.to(device) for t in (x, local, weights, w13, w2)]


def swiglu(x, w13, w2):
    gate, up = (w13 @ x).chunk(2)
    return w2 @ (F.silu(gate) * up)


def loop_reference(x, local, weights, w13, w2, shared_w13=None, shared_w2=None) -> torch.Tensor:
    """y[t] = Σ_j weights[t, j] · W2[e] (silu(W_gate[e] x[t]) ⊙ W_up[e] x[t]) over this rank's slots
    (+ the same with the shared expert's weights, weight 1), in float64."""
    device = x.device
    x, w13, w2 = x.double().cpu(), w13.double().cpu(), w2.double().cpu()
    y = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(local.shape[1]):
            e = int(local[t, j])
            if 0 <= e < w13.shape[0]:
                y[t] += float(weights[t, j]) * swiglu(x[t], w13[e], w2[e])
        if shared_w13 is not None:
            y[t] += swiglu(x[t], shared_w13.double().cpu(), shared_w2.double().cpu())
    return y.to(device)


def run(*args, config=SMALL):
    return fused_moe.fused_experts(*args, gate_up_config=config, down_config=config)


def test_float32_matches_loop_and_grouped_path():
    args = problem(torch.float32)
    out = run(*args)
    ref = loop_reference(*args)
    assert out.dtype == torch.float32 and out.shape == (T, H)
    assert (out.double() - ref).abs().max().item() < 1e-5
    assert (out - grouped_experts(*args)).abs().max().item() < 1e-5
    assert out[1].abs().sum() > 0  # a token with one foreign slot still gets its own experts
    x, local, *rest = args  # int32 expert ids (routing kernels' dtype) give the same result
    assert (out - grouped_experts(x, local.int(), *rest)).abs().max().item() < 1e-5


def test_both_fallbacks_of_the_grouped_path_agree(monkeypatch):
    """Without a grouped GEMM (float32 on the CPU): the pairs expert by expert (the CPU's) and gathered per pair (a
    GPU's, with no host synchronisation) give the same sum over the experts."""
    from splitspec.models import grouped_moe

    args = problem(torch.float32, "cpu")
    by_expert = grouped_experts(*args)
    monkeypatch.setattr(grouped_moe, "pairs_by_expert", grouped_moe.pairs_gathered)
    gathered = grouped_experts(*args)
    assert (gathered - by_expert).abs().max().item() < 1e-5 and by_expert[1].abs().sum() > 0


def test_bfloat16_accumulates_in_float32():
    args = problem(torch.bfloat16)
    out = run(*args)
    ref = loop_reference(*args)  # same bf16 weights and inputs, exact arithmetic
    assert out.dtype == torch.bfloat16
    # only the final conversion to bf16 separates the kernel from the exact result: within one bf16 ulp
    # (relative 2^-7; the interpreter truncates where the GPU rounds to nearest)
    assert ((out.double() - ref).abs() <= ref.abs() * 2 ** -7 + 1e-6).all()


def test_rows_are_batch_invariant():
    x, local, weights, w13, w2 = problem(torch.float32)
    together = run(x, local, weights, w13, w2)
    for t in range(T):
        alone = run(x[t:t + 1], local[t:t + 1], weights[t:t + 1], w13, w2)
        assert torch.equal(alone[0], together[t])


def test_foreign_experts_only_gives_zero():
    x, local, weights, w13, w2 = problem(torch.float32)
    out = run(x, torch.full_like(local, E), weights, w13, w2)
    assert torch.equal(out, torch.zeros_like(out))


@pytest.mark.parametrize("I_s", [I, 2 * I, 8])  # one shared expert; two; a slice narrower than the routed one (EP)
def test_shared_expert_joins_the_sum(I_s):
    args = problem(torch.float32)
    g = torch.Generator().manual_seed(2)
    shared = (randn(2 * I_s, H, g=g) / H ** 0.5, randn(H, I_s, g=g) / I_s ** 0.5)
    out = run(*args, *shared)
    assert (out.double() - loop_reference(*args, *shared)).abs().max().item() < 1e-5
    assert (out - run(*args)).abs().max().item() > 1e-2  # the shared expert did contribute


@pytest.mark.parametrize("fp8,block,I_s", [("all", (8, 16), I), ("w2 only", (8, 16), I), ("shared only", (8, 16), I),
                                           ("all", (4, 16), I), ("all", (16, 16), I), ("all", (8, 16), 8),
                                           ("all", (8, 16), 48)])
def test_fp8_weights_are_scaled_per_tile(fp8, block, I_s):
    """Block-scaled FP8 weights (ragged tiles: H = 40 columns in 16s) read as FP8 and scaled in the kernel equal
    the loop over their dequantised values; any mix of FP8 and float weights. With 8-row program blocks, 8-row
    tiles take the one-scale-per-column-tile path in both kernels; 4-row tiles the per-element one in both;
    16-row tiles (I = 24: up rows start mid-tile) the per-element one for gate/up and the other for down. A shared
    expert narrower or wider than the routed ones leaves some programs of the gate/up grid without rows."""
    x, local, weights, w13, w2 = problem(torch.float32)
    g = torch.Generator().manual_seed(5)
    shared = [randn(2 * I_s, H, g=g) / H ** 0.5, randn(H, I_s, g=g) / I_s ** 0.5]
    which = {"all": (0, 1, 2, 3), "w2 only": (1,), "shared only": (2, 3)}[fp8]
    tensors, scales = [w13, w2, *shared], [None] * 4
    for i in which:
        tensors[i], scales[i] = quant.quantize_fp8(tensors[i], block)
    out = fused_moe.fused_experts(x, local, weights, *tensors, scales=scales, fp8_block=block,
                                  gate_up_config=SMALL, down_config=SMALL)
    dense = [t if s is None else quant.dequantize_fp8(t, s, block) for t, s in zip(tensors, scales)]
    assert (out.double() - loop_reference(x, local, weights, *dense)).abs().max().item() < 1e-5


def test_default_configs_on_larger_shapes(monkeypatch):
    """The shipped block sizes (not SMALL) over shapes that are not multiples of them: two tokens, then one token
    with a shared expert (the batch-1 decode step), which gets GATE_UP_CONFIG_ONE_TOKEN."""
    g = torch.Generator().manual_seed(1)
    x, w13, w2 = randn(2, 300, g=g), randn(4, 2 * 40, 300, g=g) / 300 ** 0.5, randn(4, 300, 40, g=g) / 40 ** 0.5
    shared = randn(2 * 24, 300, g=g) / 300 ** 0.5, randn(300, 24, g=g) / 24 ** 0.5
    local = torch.randint(0, 4, (2, 2), generator=g).to(DEVICE)
    weights = torch.rand(2, 2, generator=g).to(DEVICE)
    used = []
    op = fused_moe._experts_op
    monkeypatch.setattr(fused_moe, "_experts_op", lambda *a: used.append(tuple(a[-2])) or op(*a))
    out = fused_moe.fused_experts(x, local, weights, w13, w2)
    assert (out.double() - loop_reference(x, local, weights, w13, w2)).abs().max().item() < 1e-5
    one = fused_moe.fused_experts(x[:1], local[:1], weights[:1], w13, w2, *shared)
    assert (one.double() - loop_reference(x[:1], local[:1], weights[:1], w13, w2, *shared)).abs().max().item() < 1e-5
    assert used == [fused_moe.GATE_UP_CONFIG, fused_moe.GATE_UP_CONFIG_ONE_TOKEN]


def test_fp8_with_the_shipped_configs():
    """FP8 routed experts through the shipped block sizes (16-row program blocks, 512/256-wide K steps) with
    16 × 128 tiles: the one-scale-per-column-tile path over K steps spanning several tiles and a ragged last one."""
    g = torch.Generator().manual_seed(6)
    x, w13, w2 = randn(2, 300, g=g), randn(4, 2 * 32, 300, g=g) / 300 ** 0.5, randn(4, 300, 32, g=g) / 32 ** 0.5
    local = torch.tensor([[0, 3], [2, 0]], device=DEVICE)
    weights = torch.rand(2, 2, generator=g).to(DEVICE)
    block = (16, 128)
    q, sc = zip(*(quant.quantize_fp8(w, block) for w in (w13, w2)))
    dense = [quant.dequantize_fp8(a, b, block) for a, b in zip(q, sc)]
    for t in (slice(None), slice(0, 1)):  # two tokens, and one (GATE_UP_CONFIG_ONE_TOKEN's 8-row program blocks)
        out = fused_moe.fused_experts(x[t], local[t], weights[t], *q, scales=(*sc, None, None), fp8_block=block)
        assert (out.double() - loop_reference(x[t], local[t], weights[t], *dense)).abs().max().item() < 1e-5


@pytest.mark.parametrize("mode,shared_fp8,split", [(1, True, 2), (3, True, 1), (3, False, 3)])  # mode 2: test_fp8_linear
def test_fp8_modes_match_the_dequantised_loop(monkeypatch, mode, shared_fp8, split):
    """The FP8 modes of splitspec.models.fp8_tiles in both kernels (16 × 16 tiles, 16-row program blocks: each
    program's rows in one tile row; I and I_s whole tiles, H = 40 ragged), FP8 shared expert included, against the
    loop over the dequantised weights; gate/up's H in ``split`` parts (16, 16 and 8 columns of H = 40 for 3).
    Mode 1 (float32 from the byte's bits) is exact up to the order of float32 sums; the dot modes round
    x · scale · 2⁸ to f16 once per kernel (relative 2⁻¹¹), stated as 2⁻⁸ of the largest output. With a float shared
    expert the kernels fall back to mode 0 (one kind of accumulator per kernel)."""
    g = torch.Generator().manual_seed(7)
    i, i_s, block = 32, 16, (16, 16)
    x, local, weights = randn(T, H, g=g), problem(torch.float32)[1], torch.rand(T, TOP_K, generator=g).to(DEVICE)
    tensors = [randn(E, 2 * i, H, g=g) / H ** 0.5, randn(E, H, i, g=g) / i ** 0.5, randn(2 * i_s, H, g=g) / H ** 0.5,
               randn(H, i_s, g=g) / i_s ** 0.5]
    scales = [None] * 4
    for j in (0, 1, 2, 3) if shared_fp8 else (0, 1):
        tensors[j], scales[j] = quant.quantize_fp8(tensors[j], block)
    modes = []
    pick = fused_moe.mode_for
    monkeypatch.setattr(fused_moe, "mode_for", lambda *a: modes.append(pick(*a)) or modes[-1])
    config = (16, 16, 1, 1, mode)
    out = fused_moe.fused_experts(x, local, weights, *tensors, scales=scales, fp8_block=block,
                                  gate_up_config=(*config, split), down_config=config)
    assert modes == ([mode, mode] if shared_fp8 else [0, 0])
    dense = [t if s is None else quant.dequantize_fp8(t, s, block) for t, s in zip(tensors, scales)]
    ref = loop_reference(x, local, weights, *dense)
    tol = 1e-5 if mode == 1 or not shared_fp8 else 2 ** -8 * ref.abs().max().item()
    assert (out.double() - ref).abs().max().item() < tol


def router(n_experts=20, top_k=4, normalize=True, scaling=2.5, seed=3):
    g = torch.Generator().manual_seed(seed)
    x, gate, bias = randn(5, 64, g=g), randn(n_experts, 64, g=g) / 8, randn(n_experts, g=g) * 0.1
    cfg = SimpleNamespace(n_group=1, topk_group=1, num_experts_per_tok=top_k, norm_topk_prob=normalize, routed_scaling_factor=scaling)
    return x, gate, bias, cfg


@pytest.mark.parametrize("n_experts,top_k,normalize", [(20, 4, True), (16, 8, False), (7, 1, True)])
def test_route_matches_noaux_tc_route(n_experts, top_k, normalize):
    x, gate, bias, cfg = router(n_experts, top_k, normalize)
    weights, ids = fused_route.route(x, gate, bias, top_k, cfg.routed_scaling_factor, normalize)
    ref_w, ref_ids = noaux_tc_route(x, gate, bias, cfg)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32 and ids.shape == weights.shape == (5, top_k)
    assert torch.equal(ids.long(), ref_ids)  # same experts, same order (highest biased score first)
    assert (weights - ref_w).abs().max().item() < 1e-6
    _, local = fused_route.route(x, gate, bias, top_k, cfg.routed_scaling_factor, normalize, start=3)
    assert local.dtype == torch.int32 and torch.equal(local.long(), ref_ids - 3)  # relative to a rank's first expert


def test_route_uses_the_bias_for_the_choice_only():
    x, gate, bias, cfg = router()
    bias = torch.zeros_like(bias)
    bias[7] = 100.0  # expert 7 always chosen, its weight from the unbiased score
    weights, ids = fused_route.route(x, gate, bias, 4, 1.0, False)
    assert (ids[:, 0] == 7).all()
    assert torch.allclose(weights[:, 0], torch.sigmoid(x @ gate[7]), atol=1e-6)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs the CPU demo engine through Triton's interpreter")
@pytest.mark.parametrize("tokens", [3, 1])
def test_target_forward_with_fused_kernels(engines_for, demo_models, tokens):
    """The demo target (TP1, shared expert, 4 of 16 experts) through TargetModel.moe's fused path — forced on
    for CPU tensors — gives the grouped path's logits (T ≤ MAX_TOKENS; one token: shared expert in the kernels).
    Every token is a program row of its own, so three take the multi-token path as twelve would (the interpreter's
    time grows with the tokens)."""
    from unittest.mock import patch

    from splitspec.engine.group import Group
    from splitspec.models.batch import ForwardBatch, single_blocks

    ids = list(range(40, 40 + tokens))
    group = Group(ServeConfig(engines_for(1)))
    try:
        runner = group.rank0

        def logits():
            batch = ForwardBatch.build([(single_blocks(0, 256), 0, ids)], "all")
            with torch.inference_mode():
                return runner.target.forward(batch, runner.tcache)[0]

        grouped = logits()
        calls = []
        spy = lambda *a, **kw: calls.append(len(a)) or experts(*a, **kw)  # noqa: E731
        experts = fused_moe.fused_experts
        with patch.object(fused_moe, "use_fused", lambda x: x.shape[0] <= fused_moe.MAX_TOKENS), \
                patch.object(fused_moe, "fused_experts", spy):
            fused = logits()
        cfg = runner.target.cfg
        moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    finally:
        group.close()
    # one call per MoE layer, positional arguments x, ids, weights, w13, w2 (+ shared w13, w2 for a single token)
    assert calls == [7 if tokens == 1 else 5] * moe_layers and moe_layers > 0
    assert (fused - grouped).abs().max().item() < 1e-4
    assert torch.equal(fused.argmax(-1), grouped.argmax(-1))
