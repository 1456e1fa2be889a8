"""The auto-tuner's choice and its use by the engine; the cost model's formulas."""

from __future__ import annotations

import json
import shutil

import pytest

from splitspec.measure.cost_model import KimiScale, distinct_experts, expected_acceptance_length, fit_cycle_model
from splitspec.runtime.scheduler import Request, SpeculativeEngine
from splitspec.errors import ConfigError
from splitspec.measure.tune import choose, score, tune


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


def test_engine_uses_tuned_k_per_batch_bucket(built_engines, tmp_path):
    eng_dir = tmp_path / "e"
    shutil.copytree(built_engines, eng_dir)
    (eng_dir / "tuning.json").write_text(json.dumps({"draft_tp": 1, "k_by_batch": {"1": 3, "2": 0}}))  # one placement, older form
    with SpeculativeEngine.load(eng_dir) as eng:
        assert eng.group.placements == (1,) and eng.default_k() == 3
        a = eng.submit(Request([1, 2, 3], 4, stop_token_ids=set()))
        b = eng.submit(Request([1, 2, 3], 4, stop_token_ids=set()))
        assert eng.seqs[a].k == 3 and eng.seqs[b].k == 0
        while eng.has_work():
            eng.step()


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


def test_tune_measures_steady_cycles_and_verifies(built_engines, tmp_path):
    eng_dir = tmp_path / "e"
    shutil.copytree(built_engines, eng_dir)
    prompts = tmp_path / "p.txt"
    prompts.write_text("def f(x):\nclass A:\n")
    (eng_dir / "tuning.json").write_text("not json {")  # a broken earlier file does not stop the tuner that replaces it
    # 8 cycles per row (the default, 48, measures; 8 still spreads over both loads and their passes)
    res = tune(eng_dir, [1, 2], [0, 2], prompts, max_seq_len=128, synthetic=[0.9], verify=True, cycles=8)
    saved = json.loads((eng_dir / "tuning.json").read_text())
    assert saved["k_by_batch"] == res["k_by_batch"] and set(saved["k_by_batch"]) == {"1", "2"}
    rows = saved["measured"]
    assert {(r["draft_tp"], r["batch"], r["k"]) for r in rows} >= {(1, 1, 0), (1, 1, 2), (1, 2, 0), (1, 2, 2)}
    assert all(r["n"] > 0 and r["cycle_ms"] > 0 for r in rows)
    # with acceptance 0.9, k = 2 emits more than one token per sequence and cycle; k = 0 exactly one
    assert all((r["acceptance_length"] > 1.5) == (r["k"] == 2) for r in rows)
    assert all((r["expected_acceptance_length"] > 1.5) == (r["k"] == 2) and r["n"] == 8 for r in rows)
    assert set(saved["verification"]["score"]) == {"1", "2"}
    with pytest.raises(ConfigError):
        tune(eng_dir, [], [0, 2], prompts)
    with pytest.raises(ConfigError):
        tune(eng_dir, [1], [2], prompts)


@pytest.mark.parametrize("bad", [{"draft_tp": "x", "k_by_batch": {"1": 2}}, {"draft_tp": 1, "k_by_batch": {"a": 2}},
                                 {"draft_tp": 1, "k_by_batch": {"1": -3}}, {"draft_tp": 1, "k_by_batch": []}, [1, 2],
                                 {"draft_tp": 1, "k_by_batch": {"²": 2}}, {"draft_tp": 1, "k_by_batch": {"1": 2, "01": 3}},
                                 {"draft_tp_by_batch": {"1": 1}, "k_by_batch": {"1": 2, "4": 3}},
                                 {"draft_tp_by_batch": {"1": 0}, "k_by_batch": {"1": 2}}, {"draft_tp_by_batch": [1], "k_by_batch": {"1": 2}},
                                 {"k_by_batch": {"1": 2}}, {"draft_tp": 1, "draft_tp_by_batch": {"1": 1}, "k_by_batch": {"1": 2}},
                                 {"draft_tp": 1, "k_by_batch": {"9" * 5000: 2}}])
def test_bad_tuning_file_is_refused_naming_it(tmp_path, bad):
    from splitspec.errors import SplitspecError
    from splitspec.runtime.scheduler import read_tuning

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
    from splitspec.generate import read_prompts

    f = tmp_path / "p.txt"
    f.write_text("café \\u2192 日本語\\nx\n", encoding="utf-8")
    assert read_prompts(f) == ["café → 日本語\nx"]
    f.write_text("ends in a backslash\\\n", encoding="utf-8")
    with pytest.raises(ConfigError, match="p.txt:1"):
        read_prompts(f)


def _tp(engines) -> int:
    return int(json.loads((engines / "target" / "engine.json").read_text())["mapping"]["tp_size"])


def test_tuning_that_does_not_fit_the_engines_is_refused(built_engines, tmp_path):
    from splitspec.runtime.scheduler import read_tuning

    eng_dir = tmp_path / "e"
    shutil.copytree(built_engines, eng_dir)
    for bad, why in (({"draft_tp": 1, "k_by_batch": {"1": 99}}, "max_draft_len"),
                     ({"draft_tp": _tp(built_engines) + 1, "k_by_batch": {"1": 2}}, "tp_size"),
                     ({"draft_tp_by_batch": {"1": 1, "4": _tp(built_engines) + 1}, "k_by_batch": {"1": 2, "4": 2}}, "tp_size")):
        (eng_dir / "tuning.json").write_text(json.dumps(bad))
        with pytest.raises(ConfigError, match=f"tuning.json.*{why}"):
            read_tuning(eng_dir)
    with pytest.raises(ConfigError, match="max_draft_len"):
        tune(eng_dir, [1], [0, 99], tmp_path / "none.txt")


def test_rendered_repository_follows_tuning_unless_told(built_engines, tmp_path):
    from splitspec.serving.engine_process import EngineProcess
    from splitspec.measure.perf_suite import repo_setting
    from splitspec.serving.repo import render_repo

    eng_dir = tmp_path / "e"
    shutil.copytree(built_engines, eng_dir)
    tp = _tp(built_engines)
    (eng_dir / "tuning.json").write_text(json.dumps({"draft_tp": tp, "k_by_batch": {"1": 3, "4": 0}}))
    setting = lambda repo, key: repo_setting(repo, "spec_decode", key)  # noqa: E731
    repo = render_repo(eng_dir, tmp_path / "r1")
    assert setting(repo, "draft_tp") == str(tp) and setting(repo, "num_draft_tokens") == ""
    repo = render_repo(eng_dir, tmp_path / "r2", num_draft_tokens=2)
    assert setting(repo, "draft_tp") == str(tp) and setting(repo, "num_draft_tokens") == "2"
    if tp > 1:  # tuned for the sharded drafter: with the split one, k is the default
        repo = render_repo(eng_dir, tmp_path / "r3", draft_tp=1)
        assert setting(repo, "draft_tp") == "1" and setting(repo, "num_draft_tokens") == "4"
    # what spec_decode does with an empty num_draft_tokens: the engine (in its process) follows tuning.json
    proc = EngineProcess(eng_dir, lambda *a: None, lambda m: None, draft_tp=tp, num_draft_tokens=None)
    try:
        assert proc.info["k_by_batch"] == {1: 3, 4: 0} and proc.info["draft_tp"] == tp
    finally:
        proc.close()
    # tuned per bucket with both placements: the engine loads both and follows the file
    (eng_dir / "tuning.json").write_text(json.dumps({"draft_tp_by_batch": {"1": 1, "4": tp}, "k_by_batch": {"1": 3, "4": 2}}))
    repo = render_repo(eng_dir, tmp_path / "r5")
    assert setting(repo, "draft_tp") == ("" if tp > 1 else "1") and setting(repo, "num_draft_tokens") == ""
    repo = render_repo(eng_dir, tmp_path / "r6", draft_tp=tp)
    assert setting(repo, "draft_tp") == str(tp) and setting(repo, "num_draft_tokens") == ("4" if tp > 1 else "")
    proc = EngineProcess(eng_dir, lambda *a: None, lambda m: None, draft_tp=None, num_draft_tokens=None)  # what "" gives
    try:
        assert proc.info["draft_tp_by_batch"] == ({1: 1, 4: tp} if tp > 1 else {}) and proc.info["k_by_batch"] == {1: 3, 4: 2}
    finally:
        proc.close()
    (eng_dir / "tuning.json").unlink()
    repo = render_repo(eng_dir, tmp_path / "r4")
    assert setting(repo, "draft_tp") == "1" and setting(repo, "num_draft_tokens") == "4"


@pytest.mark.parametrize("line, why", [('{"prompt": 5}', "non-empty string"), ('{"prompt": ""}', "non-empty string"),
                                       ('{"prompt": null}', "non-empty string"), ('{"messages": "hi"}', "list of chat"),
                                       ('{"messages": [{"foo": 1}]}', "role"), ('{"messages": []}', "role")])
def test_prompt_file_entries_are_checked_naming_the_line(tmp_path, line, why):
    from splitspec.generate import read_prompts

    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "ok"}\n' + line + "\n")
    with pytest.raises(ConfigError, match=f"p.jsonl:2: .*{why}"):
        read_prompts(f)


def test_tune_refuses_what_the_engines_cannot_do_before_measuring(built_engines, tmp_path):
    prompts = tmp_path / "p.txt"
    prompts.write_text("x\n")
    with pytest.raises(ConfigError, match="max_batch_size"):
        tune(built_engines, [1, 10_000], [0, 1], prompts)
    with pytest.raises(ConfigError, match="max_seq_len"):
        tune(built_engines, [1], [0, 1], prompts, max_seq_len=100_000)


@pytest.mark.parametrize("whom", ["group", "leader"])
def test_ctrl_c_during_tune_stops_it_and_its_workers_promptly(built_engines, tmp_path, whom):
    """Rank 0 interrupted mid-cycle leaves the worker inside a collective; it must still end in seconds,
    whether the signal reaches every process (a terminal's Ctrl-C) or rank 0 alone (kill -INT)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    eng_dir = tmp_path / "interrupted-engines"
    shutil.copytree(built_engines, eng_dir)
    prompts = tmp_path / "p.txt"
    prompts.write_text("def f(x):\n")
    p = subprocess.Popen([sys.executable, "-m", "splitspec.cli", "tune", "--engines", str(eng_dir), "--prompts", str(prompts),
                          "--batches", "1,2", "-k", "0,1,2", "--cycles", "400", "--max-seq-len", "256"],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                         # as from a terminal: a test run started in the background (`cmd &` without job control)
                         # hands its children SIGINT ignored, and Python keeps an ignored SIGINT ignored
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert "measuring" in p.stdout.readline()
        time.sleep(2.0)  # inside the sweep: cycles running
        (os.killpg if whom == "group" else os.kill)(p.pid, signal.SIGINT)
        t0 = time.monotonic()
        try:
            out, _ = p.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            pytest.fail(f"still running 60 s after SIGINT; its output:\n{p.communicate()[0][-4000:]}")
        assert time.monotonic() - t0 < 20
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    assert p.returncode == 130 and out.strip().splitlines()[-1] == "splitspec tune: interrupted"
    assert "Traceback" not in out
    time.sleep(0.5)
    left = subprocess.run(["pgrep", "-f", str(eng_dir)], capture_output=True, text=True).stdout.split()
    assert not left, f"processes left: {left}"
    assert not (eng_dir / "tuning.json").exists() and not list(eng_dir.glob(".tuning.*"))


def test_placements_alternate_over_engine_loads(built_engines, tmp_path, monkeypatch):
    """measure loads A B B A A B …; each row's cycle is the mean of its loads' medians over all its cycles."""
    from splitspec.measure import tune as tune_mod

    order, real_load = [], SpeculativeEngine.load
    monkeypatch.setattr(tune_mod.SpeculativeEngine, "load",
                        lambda *a, **kw: order.append(kw["draft_tp"]) or real_load(*a, **kw))
    rows = tune_mod.measure(built_engines, [1, 2], [1], [0, 1], ["def f(x):"], 64, None, [0.9], cycles=7, loads=3)
    assert order == [1, 2, 2, 1, 1, 2]
    assert {(r["draft_tp"], r["k"]) for r in rows} == {(1, 0), (1, 1), (2, 0), (2, 1)}
    for r in rows:
        assert r["n"] == 7 and len(r["cycle_ms_by_load"]) == 3
        assert r["cycle_ms"] == pytest.approx(sum(r["cycle_ms_by_load"]) / 3)
    with pytest.raises(ConfigError, match="loads = 3"):
        tune(built_engines, [1], [0, 1], tmp_path / "none.txt", cycles=2, loads=3)


def test_row_is_the_mean_of_each_loads_median():
    from types import SimpleNamespace

    from splitspec.measure.tune import _row

    st = lambda e: SimpleNamespace(emitted=[e], accepted_by_position=[e - 1], draft_ms=1.0, verify_ms=2.0)  # noqa: E731
    by_load = [[(10.0, st(2)), (30.0, st(2)), (11.0, st(1))], [(20.0, st(2)), (21.0, st(1))]]
    r = _row(1, 1, by_load)
    assert r["cycle_ms_by_load"] == [11.0, 21.0] and r["cycle_ms"] == 16.0  # medians 11 and 21 (upper of two)
    assert r["n"] == 5 and r["tokens_per_cycle"] == pytest.approx(8 / 5) and r["accepted_by_position"] == [3]
    assert r["tokens_per_s"] == pytest.approx(8 / 5 / 16.0 * 1e3)


@pytest.mark.parametrize("command", ["tune", "generate"])
@pytest.mark.parametrize("device", ["foo", "cuda:x", "cuda:", "cuda:0,,1", "gpu:0"])
def test_bad_device_is_refused_naming_it(built_engines, capsys, command, device):
    from splitspec.cli import main as cli_main

    assert cli_main([command, "--engines", str(built_engines), "--device", device]) == 2
    assert f"--device {device!r}: expected cpu or cuda:0,1,..." in capsys.readouterr().err


def test_measure_frees_each_engine_load_before_the_next(built_engines, monkeypatch):
    """Engine loads in turn hold one engine's memory, not two: a load that began while the last one was still
    referenced needed twice the GPU memory (a two-MoE-layer Kimi-width engine fits an H200 once, not twice)."""
    import gc
    import weakref

    from splitspec.measure import tune as tune_mod

    loaded: list = []
    alive_at_load: list[bool] = []
    real_load = SpeculativeEngine.load

    def load(*a, **kw):
        alive_at_load.append(any(ref() is not None for ref in loaded))
        eng = real_load(*a, **kw)
        loaded.append(weakref.ref(eng))
        return eng

    monkeypatch.setattr(tune_mod.SpeculativeEngine, "load", load)
    gc.disable()  # freed by its last reference going, not by a collector run that may or may not come
    try:
        rows = tune_mod.measure(built_engines, [1], [1], [0, 1], [[5, 6, 7, 8]], 64, None, None, cycles=2, loads=2)
    finally:
        gc.enable()
    assert alive_at_load == [False, False] and {r["k"] for r in rows} == {0, 1}


def test_cost_model_script_fits_a_committed_sweep_and_plots_it(tmp_path):
    """bench/cost_model.py on the one-H200 sweep of docs/data prints the fit docs/performance.md quotes and
    writes its plot; a --png that is a file is refused before anything is read."""
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    data = repo / "docs" / "data" / "h200-2026-12-01-tp1-compiled-sweep-loads4.json"
    script = [sys.executable, str(repo / "bench" / "cost_model.py")]
    done = subprocess.run(script + ["--png", str(tmp_path / "plots"), str(data)], capture_output=True, text=True, cwd=repo)
    assert done.returncode == 0, done.stderr
    assert "MoE layers [1, 2, 3] (54 configurations" in done.stdout and "in-sample error max 7.5%, mean 2.1%" in done.stdout
    assert (tmp_path / "plots" / "h200-2026-12-01-tp1-compiled-sweep-loads4-tp1-draft-tp1.png").read_bytes()[:4] == b"\x89PNG"
    (tmp_path / "f").write_text("")
    refused = subprocess.run(script + ["--png", str(tmp_path / "f"), str(data)], capture_output=True, text=True, cwd=repo)
    assert refused.returncode == 2 and "not a folder" in refused.stderr
