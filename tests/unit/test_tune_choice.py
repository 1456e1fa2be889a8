"""The tuner's choice and scoring, its rows, tuning.json checks, prompt files and the cost model's formulas: no engines."""

from __future__ import annotations

import dataclasses
import json
import pytest
from splitspec.measure.cost_model import KimiScale, distinct_experts, expected_acceptance_length, fit_cycle_model
from splitspec.errors import ConfigError
from splitspec.measure.tune import choose, score


def _row(dtp, B, k, tps):
    return {"draft_tp": dtp, "batch": B, "k": k, "tokens_per_s": tps, "tokens_per_s_pooled": tps, "acceptance_length": 1.0}


def test_choice_turns_speculation_off_where_it_does_not_pay():
    rows = [_row(1, 1, 0, 10), _row(1, 1, 3, 25), _row(2, 1, 0, 10), _row(2, 1, 3, 20),
            _row(1, 16, 0, 100), _row(1, 16, 3, 90), _row(2, 16, 0, 100), _row(2, 16, 3, 95)]
    c = choose(rows, [1, 16])
    # batch 16: no speculation wins; its placement is batch 1's, so that nothing switches for it
    assert c == {"draft_tp_by_batch": {"1": 1, "16": 1}, "k_by_batch": {"1": 3, "16": 0}}
    sc = score(c, rows, [1, 16])
    assert sc["16"]["chosen_over_best"] == 1.0 and sc["1"]["chosen_over_no_speculation"] == pytest.approx(2.5)
    # batch 1 does not draft: it takes the nearest drafting bucket's placement, so only the sharded drafter is loaded
    rows = [_row(1, 1, 0, 10), _row(1, 1, 3, 9), _row(2, 1, 0, 10), _row(2, 1, 3, 9),
            _row(1, 4, 0, 40), _row(1, 4, 3, 41), _row(2, 4, 0, 40), _row(2, 4, 3, 45),
            _row(1, 16, 0, 100), _row(1, 16, 3, 110), _row(2, 16, 0, 100), _row(2, 16, 3, 120)]
    assert choose(rows, [1, 4, 16]) == {"draft_tp_by_batch": {"1": 2, "4": 2, "16": 2}, "k_by_batch": {"1": 0, "4": 3, "16": 3}}


def test_pooled_acceptance_rates_by_position():
    from splitspec.measure.tune import pool_acceptance

    # batch 2, 10 cycles each: k = 1 accepted position 1 in 16 of 20 tries; k = 2 in 14 of 20, then 7 of those 14
    rows = [{"batch": 2, "k": 0, "n": 10, "cycle_ms": 1.0, "accepted_by_position": []},
            {"batch": 2, "k": 1, "n": 10, "cycle_ms": 2.0, "accepted_by_position": [16]},
            {"batch": 2, "k": 2, "n": 10, "cycle_ms": 4.0, "accepted_by_position": [14, 7]}]
    pool_acceptance(rows)
    assert rows[0]["pooled_acceptance_rates"] == pytest.approx([30 / 40, 7 / 14])
    assert rows[1]["expected_acceptance_length"] == pytest.approx(1 + 0.75)
    assert rows[2]["expected_acceptance_length"] == pytest.approx(1 + 0.75 + 0.75 * 0.5)
    assert rows[2]["tokens_per_s_pooled"] == pytest.approx(2 * (1 + 0.75 + 0.375) / 4.0 * 1e3)
    assert rows[0]["tokens_per_s_pooled"] == pytest.approx(2 / 1.0 * 1e3)


def test_each_bucket_gets_its_fastest_placement_and_k():
    # the split drafter wins batch 1, the sharded one batch 16; a tie goes to the split one, then the smaller k
    rows = [_row(1, 1, 0, 10), _row(1, 1, 3, 25), _row(2, 1, 0, 10), _row(2, 1, 3, 24),
            _row(1, 16, 0, 100), _row(1, 16, 3, 110), _row(2, 16, 0, 100), _row(2, 16, 3, 120), _row(2, 16, 4, 120),
            _row(1, 4, 0, 50), _row(1, 4, 2, 60), _row(2, 4, 2, 60)]
    c = choose(rows, [1, 4, 16])
    assert c == {"draft_tp_by_batch": {"1": 1, "4": 1, "16": 2}, "k_by_batch": {"1": 3, "4": 2, "16": 3}}
    sc = score(c, rows, [1, 4, 16])
    assert all(s["chosen_over_best"] == 1.0 for s in sc.values())
    assert sc["16"]["chosen_over_no_speculation"] == pytest.approx(1.2)
    # scored against another sweep in which batch 16's placements swapped
    other = [dict(r, tokens_per_s_pooled=130 if (r["draft_tp"], r["batch"], r["k"]) == (1, 16, 3) else r["tokens_per_s_pooled"]) for r in rows]
    assert score(c, other, [16])["16"]["chosen_over_best"] == pytest.approx(120 / 130)


def test_cost_model_formulas_and_fit():
    assert expected_acceptance_length([0.5], 2) == pytest.approx(1.75)
    assert distinct_experts(1) == pytest.approx(8.0) and distinct_experts(16) < 16 * 8
    def truth(B, k, L):
        return (1.0 + 0.5 * B + 0.8 * max(k - 1, 0) + 0.3 * (k > 0)
                + L * (0.2 + 0.01 * distinct_experts(B * (k + 1)) + 0.002 * B * (k + 1)))
    rows = [{"batch": B, "k": k, "moe_layers": L, "cycle_ms": truth(B, k, L)} for L in (1, 3) for B in (1, 4, 16) for k in range(6)]
    fit = fit_cycle_model(rows)
    assert fit.max_error < 1e-6 and fit.predict(4, 3, 3) == pytest.approx(truth(4, 3, 3))
    assert fit.coef["per_moe_layer"] == pytest.approx(0.2) and fit.predict(1, 0, 60) == pytest.approx(truth(1, 0, 60))
    m = KimiScale()
    assert m.bandwidth_bound_ms(1, 0) < m.verify_ms(1, 0)
    assert m.verify_ms(1, 3) > m.verify_ms(1, 0)  # more experts read per verify
    pcie = m.calibrate_allreduce_to_decode(90.0)
    assert pcie.tokens_per_s(1, 0, "tp1", [0.9]) == pytest.approx(90.0, rel=1e-3)
    # draft-ahead: the host's part (0.3 ms) hides behind k TP1 draft steps; not for k 0 nor the sharded drafter
    ahead = dataclasses.replace(m, draft_ahead=True)
    assert ahead.cycle_ms(1, 3, "tp1") == pytest.approx(m.cycle_ms(1, 3, "tp1") - m.fixed_cycle_ms)
    assert ahead.cycle_ms(1, 0, "tp1") == m.cycle_ms(1, 0, "tp1") and ahead.cycle_ms(1, 3, "tp8") == m.cycle_ms(1, 3, "tp8")
    slow_host = dataclasses.replace(ahead, fixed_cycle_ms=5.0)  # a host slower than the draft: it decides
    assert slow_host.cycle_ms(1, 1, "tp1") == pytest.approx(5.0 + m.verify_ms(1, 1))


@pytest.mark.parametrize("bad", [{"draft_tp": "x", "k_by_batch": {"1": 2}}, {"draft_tp": 1, "k_by_batch": {"a": 2}},
                                 {"draft_tp": 1, "k_by_batch": {"1": -3}}, {"draft_tp": 1, "k_by_batch": []}, [1, 2],
                                 {"draft_tp": 1, "k_by_batch": {"²": 2}}, {"draft_tp": 1, "k_by_batch": {"1": 2, "01": 3}},
                                 {"draft_tp_by_batch": {"1": 1}, "k_by_batch": {"1": 2, "4": 3}},
                                 {"draft_tp_by_batch": {"1": 0}, "k_by_batch": {"1": 2}}, {"draft_tp_by_batch": [1], "k_by_batch": {"1": 2}},
                                 {"k_by_batch": {"1": 2}}, {"draft_tp": 1, "draft_tp_by_batch": {"1": 1}, "k_by_batch": {"1": 2}},
                                 {"draft_tp": 1, "k_by_batch": {"9" * 5000: 2}}])
def test_bad_tuning_file_is_refused_naming_it(tmp_path, bad):
    from splitspec.errors import SplitspecError
    from splitspec.runtime.placement import read_tuning

    (tmp_path / "tuning.json").write_text(json.dumps(bad))
    with pytest.raises(SplitspecError, match="tuning.json"):
        read_tuning(tmp_path)
    (tmp_path / "tuning.json").unlink()
    (tmp_path / "tuning.json").mkdir()
    with pytest.raises(SplitspecError, match="tuning.json: cannot be read"):
        read_tuning(tmp_path)
    (tmp_path / "tuning.json").rmdir()
    (tmp_path / "tuning.json").symlink_to(tmp_path / "gone.json")  # dangling: not silently "no tuning"
    with pytest.raises(SplitspecError, match="tuning.json: cannot be read"):
        read_tuning(tmp_path)
    (tmp_path / "tuning.json").unlink()
    (tmp_path / "tuning.json").write_text('{"draft_tp": 1, "k_by_batch": {"1": ' + "9" * 5000 + "}}")  # beyond int()'s digits
    with pytest.raises(SplitspecError, match="tuning.json: not valid JSON"):
        read_tuning(tmp_path)


def test_prompt_file_escapes_keep_other_characters(tmp_path):
    from splitspec.measure.prompts import read_prompts

    f = tmp_path / "p.txt"
    f.write_text("café \\u2192 日本語\\nx\n", encoding="utf-8")
    assert [(p.id, p.text, p.chat) for p in read_prompts(f)] == [("line-1", "café → 日本語\nx", False)]
    f.write_text("ends in a backslash\\\n", encoding="utf-8")
    with pytest.raises(ConfigError, match="p.txt:1"):
        read_prompts(f)


@pytest.mark.parametrize("line, why", [('{"prompt": 5}', "non-empty string"), ('{"prompt": ""}', "non-empty string"),
                                       ('{"prompt": null}', "non-empty string"), ('{"messages": "hi"}', "list of chat"),
                                       ('{"messages": [{"foo": 1}]}', "role"), ('{"messages": []}', "role")])
def test_prompt_file_entries_are_checked_naming_the_line(tmp_path, line, why):
    from splitspec.measure.prompts import read_prompts

    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "ok"}\n' + line + "\n")
    with pytest.raises(ConfigError, match=f"p.jsonl:2: .*{why}"):
        read_prompts(f)


def test_row_is_the_mean_of_each_loads_median():
    from types import SimpleNamespace

    from splitspec.measure.tune import row

    st = lambda e: SimpleNamespace(emitted=[e], accepted_by_position=[e - 1], draft_ms=1.0, verify_ms=2.0)  # noqa: E731
    by_load = [[(10.0, st(2)), (30.0, st(2)), (11.0, st(1))], [(20.0, st(2)), (21.0, st(1))]]
    r = row(1, 1, by_load)
    assert r["cycle_ms_by_load"] == [11.0, 21.0] and r["cycle_ms"] == 16.0  # medians 11 and 21 (upper of two)
    assert r["n"] == 5 and r["tokens_per_cycle"] == pytest.approx(8 / 5) and r["accepted_by_position"] == [3]
    assert r["tokens_per_s"] == pytest.approx(8 / 5 / 16.0 * 1e3)


def test_allreduce_crossover_splits_the_placements_where_their_best_rates_meet():
    """Below the crossover α the sharded drafter's best configuration is faster, above it the TP1 drafter's;
    at it the two best rates agree (bisection to 0.01 µs)."""

    from splitspec.build.synthetic import KIMI_DRAFTER_PROFILE
    from splitspec.measure.cost_model import allreduce_crossover_us, best_k

    m = KimiScale()
    for B in (1, 4, 16):
        a = allreduce_crossover_us(m, B, KIMI_DRAFTER_PROFILE)
        assert a is not None and 0 < a < 2000
        rate = lambda alpha, p: best_k(dataclasses.replace(m, allreduce_alpha_us=alpha), B, p, KIMI_DRAFTER_PROFILE)[1]  # noqa: E731
        assert rate(a * 0.8, "tp8") > rate(a * 0.8, "tp1") and rate(a * 1.25, "tp1") > rate(a * 1.25, "tp8")
        assert rate(a, "tp1") == pytest.approx(rate(a, "tp8"), rel=1e-3)
    # a sharded step that costs more than the TP1 step before any communication: TP1 wins at every α
    assert allreduce_crossover_us(dataclasses.replace(m, draft_step_shard_ms=1.0), 1, KIMI_DRAFTER_PROFILE) is None
