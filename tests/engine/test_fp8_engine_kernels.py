"""The FP8 engine (weights kept FP8 in block-scaled tiles, some ragged) with its FP8 kernels forced on for CPU tensors,
through Triton's interpreter, against the dequantising paths they replace: the fused MoE decode kernels, the FP8
linears' kernel, the W8A16 grouped experts."""

from __future__ import annotations

import os
import threading
from unittest.mock import patch

import pytest

from splitspec.models import fp8_grouped, fp8_linear, fused_moe, fused_route
from splitspec.testing.engine_logits import assert_bf16_close, engine_logits


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" or not fused_moe.available(),
                    reason="runs the CPU engine through Triton's interpreter")
@pytest.mark.parametrize("tp,tokens", [(1, 1), (1, 2)])
def test_fp8_engine_through_the_fused_kernels(built, prompt, tp, tokens):
    """The FP8 engine's MoE layers with FP8 experts read by the fused kernels (forced on for CPU tensors; one
    token: the FP8 shared expert too) against its grouped path, which dequantises them first. Each token is a program
    row of its own in Triton's interpreter, which costs seconds a token: two take the multi-token path (configs
    "many", the shared expert outside the kernels) as twelve would (the prompt's first two positions have top-2 logit
    margins of 0.125 or more, against a fused-vs-grouped |Δ| of 0.04 at most). TP1 only: a TP2 rank's FP8 slices
    are the same kernels on other tensors (test_formats' TP2 test checks the slices)."""
    eng = built("fp8", tp=tp, dtype="fp8")
    ref, _ = engine_logits(eng, prompt[:tokens])
    lock = threading.Lock()  # the interpreter's grid state is global: one launch at a time across the rank threads

    def serial(fn):
        def run(*a, **kw):
            with lock:
                return fn(*a, **kw)
        return run

    with patch.object(fused_moe, "use_fused", lambda x: x.shape[0] <= fused_moe.MAX_TOKENS), \
            patch.object(fused_route, "route", serial(fused_route.route)), \
            patch.object(fused_moe, "fused_experts", serial(fused_moe.fused_experts)):
        got, _ = engine_logits(eng, prompt[:tokens])
    print(f"fp8 TP{tp}, {tokens} tokens: fused vs grouped logits max |Δ| {(got - ref).abs().max():.3g}, mean {(got - ref).abs().mean():.3g}")
    assert_bf16_close(got, ref)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" or not fp8_linear.available(),
                    reason="runs the CPU engine through Triton's interpreter")
@pytest.mark.parametrize("tokens", [4])
def test_fp8_engine_linears_through_the_triton_kernel(built, prompt, tokens):
    """The FP8 engine's attention and dense linears (kept FP8 in 128 × 128 tiles, some ragged) through
    fp8_linear's Triton kernel — forced on for CPU tensors, at the ≤ 16-token configuration (a dot mode) — against
    the dequantising path they replace."""
    eng = built("fp8", dtype="fp8")
    ref, _ = engine_logits(eng, prompt[:tokens])
    calls = []
    op = fp8_linear._linear_op
    with patch.object(fp8_linear, "use_kernels", lambda x: True), \
            patch.object(fp8_linear, "_linear_op", lambda *a: calls.append(tuple(a[-1])) or op(*a)):
        got, _ = engine_logits(eng, prompt[:tokens])
    print(f"fp8 linears, {tokens} tokens: Triton vs dequantised logits max |Δ| {(got - ref).abs().max():.3g}, "
          f"mean {(got - ref).abs().mean():.3g}; configs {sorted(set(calls))}")
    assert len(calls) >= 3 * 4 and set(calls) == {fp8_linear.plan(tokens, 2048, 2048, (128, 128), False)[1]}
    assert_bf16_close(got, ref)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" or not fp8_grouped.available(),
                    reason="runs the CPU engine through Triton's interpreter")
def test_fp8_engine_moe_through_the_grouped_kernels(built, prompt):
    """The FP8 engine's MoE layers on the path past the fused kernels (every CPU forward takes it; a 2-token
    prefill) through the W8A16 grouped kernels against the dequantising path they replace on GPUs."""
    eng = built("fp8", dtype="fp8")
    ref, _ = engine_logits(eng, prompt[:2])
    calls = []
    real = fp8_grouped.unchecked

    def counted(*args):  # the engine's arguments pass the public entry's checks too
        fp8_grouped.check(*args, (fp8_grouped.GATE_UP, fp8_grouped.DOWN))
        calls.append(args[0].shape[0])
        return real(*args)

    with patch.object(fp8_grouped, "use_grouped", lambda x: True), patch.object(fp8_grouped, "unchecked", counted):
        got, _ = engine_logits(eng, prompt[:2])
    print(f"fp8 grouped experts, 2 tokens: vs dequantised logits max |Δ| {(got - ref).abs().max():.3g}, "
          f"mean {(got - ref).abs().mean():.3g}")
    assert calls and set(calls) == {2}
    assert_bf16_close(got, ref)
