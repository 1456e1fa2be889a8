"""The cost model's calibration from short depths of one engine form: fit_depth's lines along depth and
KimiScale.from_depth_fit carrying them to 61 layers, on canned numbers (no engines)."""

from __future__ import annotations

import dataclasses

import pytest

from splitspec.build.synthetic import KIMI_DRAFTER_PROFILE
from splitspec.measure.cost_model import KimiScale, allreduce_crossover_us, best_k, fit_depth

# (batch, k, draft_tp) → (fixed ms, ms per MoE layer) of cycle, draft, verify: a made-up rank, depth-linear
LINES = {(1, 0, None): ((2.0, 0.17), (0.05, 0.0), (1.6, 0.17)),
         (1, 1, 1): ((3.5, 0.19), (1.4, 0.0), (1.8, 0.19)), (1, 1, 8): ((3.0, 0.19), (1.0, 0.0), (1.8, 0.19)),
         (1, 3, 1): ((5.0, 0.23), (3.0, 0.0), (1.8, 0.23)), (1, 3, 8): ((4.0, 0.23), (1.8, 0.0), (1.9, 0.23)),
         (4, 0, None): ((2.5, 0.26), (0.07, 0.0), (2.2, 0.26)), (4, 1, 1): ((4.5, 0.38), (2.0, 0.0), (2.3, 0.38))}


def rows_at(depths, noise=None):
    """Rows as bench/full_depth_rank.py measures them, at each depth; ``noise(i)``: a factor on row i's costs."""
    out = []
    for L in depths:
        for (B, k, dtp), lines in LINES.items():
            f = noise(len(out)) if noise else 1.0
            out.append({"layers": L, "batch": B, "k": k, "draft_tp": dtp} |
                       {q: (c0 + c1 * (L - 1)) * f for q, (c0, c1) in zip(("cycle_ms", "draft_ms", "verify_ms"), lines)})
    return out


def test_fit_depth_recovers_each_rows_line_and_leaves_single_depths_out():
    rows = rows_at((2, 4)) + [{"layers": 3, "batch": 16, "k": 0, "draft_tp": None, "cycle_ms": 5.0, "draft_ms": 0.1,
                               "verify_ms": 4.0}]  # one depth only: nothing to fit
    fit = fit_depth(rows)
    assert [(f["batch"], f["k"], f["draft_tp"]) for f in fit] == [(1, 0, None), (4, 0, None), (1, 1, 1), (1, 3, 1), (4, 1, 1),
                                                                   (1, 1, 8), (1, 3, 8)]
    for f in fit:
        lines = LINES[f["batch"], f["k"], f["draft_tp"]]
        for q, (c0, c1) in zip(("cycle_ms", "draft_ms", "verify_ms"), lines):
            assert f[q]["fixed_ms"] == pytest.approx(c0) and f[q]["per_moe_layer_ms"] == pytest.approx(c1)
            assert f[q]["max_residual"] == 0.0
        assert f["depths"] == [2, 4]
    # three depths, the middle one 5% slow: least squares, the residual reported
    noisy = fit_depth(rows_at((2, 3, 4), noise=lambda i: 1.05 if len(LINES) <= i < 2 * len(LINES) else 1.0))
    assert all(0.01 < f["verify_ms"]["max_residual"] < 0.05 and f["depths"] == [2, 3, 4] for f in noisy)


def test_fit_depth_keeps_the_draft_flat_along_depth():
    """The draft phase does not depend on the target's depth: two depths' draft times that differ by noise give their
    mean at every depth (not a slope carried to 61 layers), and the cycle is the rest's line plus that mean."""
    rows = [{"layers": L, "batch": 16, "k": 1, "draft_tp": 1, "draft_ms": d, "verify_ms": 1.0 + 0.5 * (L - 1),
             "cycle_ms": d + 1.0 + 0.5 * (L - 1) + 0.25} for L, d in ((2, 2.4), (8, 1.8))]
    (f,) = fit_depth(rows)
    assert f["draft_ms"]["fixed_ms"] == pytest.approx(2.1) and f["draft_ms"]["per_moe_layer_ms"] == 0.0
    assert f["draft_ms"]["max_residual"] == pytest.approx(0.3 / 1.8)
    assert f["cycle_ms"]["per_moe_layer_ms"] == pytest.approx(0.5) and f["cycle_ms"]["fixed_ms"] == pytest.approx(1.25 + 2.1)
    assert f["verify_ms"]["per_moe_layer_ms"] == pytest.approx(0.5)


@pytest.mark.parametrize("bad, says", [({"layers": 1}, "≥ 2 layers"), ({"verify_ms": -1.0}, "non-negative"),
                                        ({"cycle_ms": 0.0}, "positive cycle_ms"), ({"k": "x"}, "row 0")])
def test_fit_depth_refuses_a_bad_row_naming_it(bad, says):
    with pytest.raises(ValueError, match=says):
        fit_depth([rows_at((2,))[0] | bad] + rows_at((4,)))
    with pytest.raises(ValueError, match="expected layers"):
        fit_depth([{"layers": 2, "batch": 1}])


def test_kimi_scale_from_depth_fit_carries_the_rank_to_61_layers_and_adds_its_collectives():
    fit = fit_depth(rows_at((2, 4)))
    m = KimiScale.from_depth_fit(fit, tp=8)
    ar = lambda T: m.allreduce_us(T) / 1e3  # noqa: E731
    # measured (B, k): the fitted line at 61 layers, + 2 all-reduces per layer and the embedding's
    assert m.fitted_ms("cycle_ms", 1, 1, "tp1", 61) == pytest.approx(3.5 + 0.19 * 60)
    assert m.verify_ms(1, 0) == pytest.approx(1.6 + 0.17 * 60 + 123 * ar(1))
    assert m.verify_ms(1, 1) == pytest.approx((1.8 + 1.8) / 2 + 0.19 * 60 + 123 * ar(2))  # both placements' verify, averaged
    assert m.cycle_ms(1, 1, "tp1") == pytest.approx(3.5 + 0.19 * 60 + 123 * ar(2))
    assert m.cycle_ms(1, 1, "tp8") == pytest.approx(3.0 + 0.19 * 60 + 123 * ar(2) + 3 * ar(1))  # + 3 per sharded step
    assert m.cycle_ms(1, 0, "tp8") == m.cycle_ms(1, 0, "tp1") == pytest.approx(2.0 + 0.17 * 60 + 123 * ar(1))
    assert m.cycle_ms(1, 1, "tp1", layers=2) == pytest.approx(3.5 + 0.19 + 5 * ar(2))
    # other k: linear between the batch's fitted ks, past them along the last two; other batches: linear in B
    at61 = lambda c0, c1: c0 + c1 * 60  # noqa: E731
    assert m.fitted_ms("cycle_ms", 1, 2, "tp1") == pytest.approx((at61(3.5, 0.19) + at61(5.0, 0.23)) / 2)
    assert m.fitted_ms("cycle_ms", 1, 5, "tp1") == pytest.approx(at61(5.0, 0.23) + (at61(5.0, 0.23) - at61(3.5, 0.19)))
    assert m.fitted_ms("cycle_ms", 2, 0, "tp1") == pytest.approx(at61(2.0, 0.17) + (at61(2.5, 0.26) - at61(2.0, 0.17)) / 3)
    with pytest.raises(ValueError, match="batch 16 outside the fitted batches"):
        m.verify_ms(16, 0)
    with pytest.raises(ValueError, match="batch 4, k 2: fitted k"):  # batch 4, sharded: only its k = 0 row
        m.cycle_ms(4, 2, "tp8")
    with pytest.raises(ValueError, match="no row fitted"):
        KimiScale.from_depth_fit([])
    # the rest of the cost model runs on it; the per-layer bytes model stays the default
    k, rate = best_k(m, 1, "tp8", KIMI_DRAFTER_PROFILE, ks=range(0, 6))
    assert rate == pytest.approx(max(m.tokens_per_s(1, j, "tp8", KIMI_DRAFTER_PROFILE) for j in range(6)))
    a = allreduce_crossover_us(m, 1, KIMI_DRAFTER_PROFILE, ks=range(0, 4))  # the sharded drafter pays 3 α per step
    rate = lambda p: best_k(dataclasses.replace(m, allreduce_alpha_us=a), 1, p, KIMI_DRAFTER_PROFILE, range(4))[1]  # noqa: E731
    assert 13 < a < 1000 and rate("tp1") == pytest.approx(rate("tp8"), rel=1e-3)
    assert KimiScale().depth_fit == () and KimiScale().verify_ms(1, 0) == pytest.approx(
        dataclasses.replace(m, depth_fit=()).verify_ms(1, 0))
