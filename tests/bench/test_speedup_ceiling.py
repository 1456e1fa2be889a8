"""bench/lab/speedup_ceiling.py on hand-made tuner and draft-profile results: the expected tokens per cycle of an
acceptance profile and the speed-up at a multiple of the draft bound, worked out by hand here."""

from __future__ import annotations

import pytest

from lab import speedup_ceiling


def test_expected_tokens_and_ceiling_by_hand():
    assert speedup_ceiling.expected_tokens([0.5, 0.5], 2) == pytest.approx(1 + 0.5 + 0.25)
    row = lambda k, cycle, verify, draft, tps: {"batch": 1, "draft_tp": 1, "k": k, "cycle_ms": cycle,  # noqa: E731
                                                "verify_ms": verify, "draft_ms": draft, "tokens_per_s": tps}
    tune = {"tune": {"choice": {"synthetic_acceptance": [0.5, 0.5]},
                     "tuner_rows": [row(0, 1.0, 0.9, 0.0, 100.0), row(1, 2.0, 1.2, 0.6, 120.0), row(2, 2.5, 1.3, 1.0, 90.0),
                                    row(1, 9.0, 9.0, 0.0, 1.0) | {"draft_tp": 2}]}}
    draft = {"drafters": {"float": {"rows": [{"batch": 1, "k": 1, "bound_ms": 0.4}, {"batch": 1, "k": 2, "bound_ms": 0.7},
                                             {"batch": 4, "k": 1, "bound_ms": 5.0}]}}}
    res = speedup_ceiling.ceilings(tune, draft, 1, [1.0, 2.0])
    free, measured = res["width free"], res["verify as measured"]
    # k 1: rest 2.0 − 1.2 − 0.6 = 0.2; width free: E 1.5 · 1.0 / (0.4 + 0.9 + 0.2); as measured (0.4 + 1.2 + 0.2)
    assert free[0]["×bound 1"] == pytest.approx(1.5 / 1.5) and measured[0]["×bound 1"] == pytest.approx(1.5 / 1.8)
    # k 2: rest 0.2; E 1.75; at 2 × the bound: 1.4 + 1.3 + 0.2
    assert measured[1]["×bound 2"] == pytest.approx(1.75 / 2.9) and free[1]["measured"] == pytest.approx(0.9)
    with pytest.raises(speedup_ceiling.CheckpointError, match="batch 4"):
        speedup_ceiling.ceilings(tune, draft, 4, [1.0])


def test_refuses_ambiguous_or_impossible_inputs():
    row = {"batch": 1, "draft_tp": 1, "k": 0, "cycle_ms": 1.0, "verify_ms": 0.9, "draft_ms": 0.0, "tokens_per_s": 1.0}
    tune = {"tune": {"choice": {"synthetic_acceptance": [0.5]},
                     "tuner_rows": [row, row | {"k": 1, "cycle_ms": 1.0, "verify_ms": 1.2, "draft_ms": 0.5}]}}
    rows = [{"batch": 1, "k": 1, "bound_ms": 0.4}]
    two = {"drafters": {"float": {"rows": rows}, "fp8": {"rows": rows}}}
    with pytest.raises(speedup_ceiling.CheckpointError, match="2 drafters: pick one with --drafter"):
        speedup_ceiling.ceilings(tune, two, 1, [1.0])
    with pytest.raises(speedup_ceiling.CheckpointError, match="k 1: cycle_ms is less than verify_ms"):
        speedup_ceiling.ceilings(tune, two, 1, [1.0], drafter="fp8")
    nan = {"drafters": {"float": {"rows": [rows[0] | {"bound_ms": float("nan")}]}}}
    with pytest.raises(speedup_ceiling.CheckpointError, match="bound_ms: expected a finite number"):
        speedup_ceiling.ceilings(tune, nan, 1, [1.0])
