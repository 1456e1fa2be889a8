"""The auto-tuner's choice and its use by the engine; the cost model's formulas."""

from __future__ import annotations

import json
import shutil

import pytest

from splitspec.perf_model import KimiScale, distinct_experts, expected_acceptance_length, fit_cycle_model
from splitspec.runtime import Request, SpeculativeEngine
from splitspec.tune import choose


def _row(dtp, B, k, tps):
    return {"draft_tp": dtp, "batch": B, "k": k, "tokens_per_s": tps, "acceptance_length": 1.0}


def test_choice_turns_speculation_off_where_it_does_not_pay():
    rows = [_row(1, 1, 0, 10), _row(1, 1, 3, 25), _row(2, 1, 0, 10), _row(2, 1, 3, 20),
            _row(1, 16, 0, 100), _row(1, 16, 3, 90), _row(2, 16, 0, 100), _row(2, 16, 3, 120)]
    c = choose(rows, [1, 16])
    assert c["draft_tp"] == 1 and c["k_by_batch"] == {"1": 3, "16": 0}
    assert c["detail"]["16"]["chosen_vs_exhaustive"] == pytest.approx(100 / 120)


def test_engine_uses_tuned_k_per_batch_bucket(built_engines, tmp_path):
    eng_dir = tmp_path / "e"
    shutil.copytree(built_engines, eng_dir)
    (eng_dir / "tuning.json").write_text(json.dumps({"draft_tp": 1, "k_by_batch": {"1": 3, "2": 0}}))
    with SpeculativeEngine.load(eng_dir) as eng:
        assert eng.group.draft_tp == 1 and eng.default_k() == 3
        a = eng.submit(Request([1, 2, 3], 4, stop_token_ids=set()))
        b = eng.submit(Request([1, 2, 3], 4, stop_token_ids=set()))
        assert eng.seqs[a].k == 3 and eng.seqs[b].k == 0
        while eng.has_work():
            eng.step()


def test_cost_model_formulas_and_fit():
    assert expected_acceptance_length([0.5], 2) == pytest.approx(1.75)
    assert distinct_experts(1) == pytest.approx(8.0) and distinct_experts(16) < 16 * 8
    rows = [{"batch": B, "k": k, "cycle_ms": 1.0 + 0.5 * B + 0.8 * max(k - 1, 0) + 0.3 * (k > 0) + 0.01 * distinct_experts(B * (k + 1))}
            for B in (1, 4, 16) for k in range(6)]
    fit = fit_cycle_model(rows)
    assert fit.max_error < 1e-6 and fit.predict(4, 3) == pytest.approx(rows[9]["cycle_ms"])
    m = KimiScale()
    assert m.bandwidth_bound_ms(1, 0) < m.verify_ms(1, 0)
    assert m.verify_ms(1, 3) > m.verify_ms(1, 0)  # more experts read per verify
    pcie = m.calibrate_allreduce_to_decode(90.0)
    assert pcie.tokens_per_s(1, 0, "tp1", [0.9]) == pytest.approx(90.0, rel=1e-3)
