"""bench/triton_share.py's analysis (bench/lab/share_stats.py): the split of the served excess into a part per
request and a part per cycle (checked against rows built from a known line), and ``--replot``'s answers to files
that are not its results."""

from __future__ import annotations

import json
import math
import os

import pytest

import triton_share
from lab import pinning, share_stats


def _rows(cycles: list[int], ms_per_cycle: float, per_request: float, per_cycle: float) -> tuple[list[dict], list[dict]]:
    """Engine-alone rows of ``cycles`` at ``ms_per_cycle``, and rows slower by ``per_request + per_cycle · cycles``."""
    engine = [{"cycles": n, "wall_ms": 5.0 + ms_per_cycle * n, "tokens": 4 * n + 1} for n in cycles]
    slower = [{"wall_ms": e["wall_ms"] + per_request + per_cycle * e["cycles"], "tokens": e["tokens"]} for e in engine]
    return slower, engine


def test_excess_split_recovers_a_known_line():
    rows, engine = _rows([2, 6, 27, 31, 35, 38], 3.6, 4.5, 0.08)
    x = share_stats.excess_split(rows, engine)
    assert x["per_request_ms"] == pytest.approx(4.5, abs=1e-9)
    assert x["per_cycle_ms"] == pytest.approx(0.08, abs=1e-9)
    t = sum(e["wall_ms"] for e in engine) / sum(e["cycles"] for e in engine)  # 5 ms per request spread over cycles
    assert x["engine_ms_per_cycle"] == pytest.approx(t)
    assert x["asymptotic_ratio"] == pytest.approx(t / (t + 0.08))
    # a request of n cycles: n·t / (n·t + a + b·n), as the docstring says, tends to the asymptotic ratio
    n = 1e9
    assert n * t / (n * t + 4.5 + 0.08 * n) == pytest.approx(x["asymptotic_ratio"])


@pytest.mark.parametrize("cycles", [[30, 30, 30], [5, 9], [0, 0, 0]])
def test_excess_split_is_undefined_without_spread(cycles):
    rows, engine = _rows(cycles, 3.6, 4.5, 0.08)
    assert set(share_stats.excess_split(rows, engine).values()) == {None}


def test_excess_split_refuses_nan_and_mismatched_rows():
    rows, engine = _rows([2, 6, 27, 31], 3.6, 4.5, 0.08)
    rows[1]["wall_ms"] = math.nan
    assert set(share_stats.excess_split(rows, engine).values()) == {None}
    with pytest.raises(ValueError, match="3 rows against 4"):
        share_stats.excess_split(rows[:3], engine)


def _pairs(load: int, served_ms: float, prompts: int = 8) -> tuple[list[dict], list[dict]]:
    """One load's request pairs: every prompt 100 tokens, 100 ms alone and ``served_ms`` served."""
    served = [{"load": load, "prompt_id": f"p{i}", "tokens": 100, "wall_ms": served_ms} for i in range(prompts)]
    return served, [{"load": load, "prompt_id": f"p{i}", "tokens": 100, "wall_ms": 100.0} for i in range(prompts)]


def test_ratio_interval_resamples_loads_before_prompts():
    # within each load every prompt gives the same ratio; the loads differ (0.90 and 1.00). Resampling prompts alone
    # would give a narrow interval around the pooled 0.947; resampling loads first spans both loads' ratios
    (s1, e1), (s2, e2) = _pairs(0, 100 / 0.9), _pairs(1, 100.0)
    lo, hi = share_stats.ratio_ci95(s1 + s2, e1 + e2)
    assert lo == pytest.approx(0.9) and hi == pytest.approx(1.0)
    # one load: the interval of its prompts only (here none: every prompt alike)
    assert share_stats.ratio_ci95(s1, e1) == pytest.approx([0.9, 0.9])
    # rows without a load (results of one load, written before loads were recorded) read as one load
    assert share_stats.ratio_ci95([{k: v for k, v in r.items() if k != "load"} for r in s2], e2) == pytest.approx([1.0, 1.0])


def test_replot_draws_results_and_names_what_is_wrong(tmp_path, capsys):
    served, engine = _rows([2, 6, 27, 31, 35], 3.6, 4.5, 0.08)
    good = tmp_path / "run.json"
    good.write_text(json.dumps({"meta": {"settings": {"k": 4, "max_tokens": 128, "device_ids": "0,1"}},
                                "engine": engine, "served": served, "engine_process": engine}))
    assert triton_share.main(["--replot", str(good)]) == 0
    assert (tmp_path / "run.png").stat().st_size > 1000
    cases = {"missing.json": (None, "missing.json: file not found"), "bad.json": ("nope", "bad.json: not valid JSON"),
             "list.json": ("[1, 2]", "expected a JSON object"),
             "old.json": (json.dumps({"engine": [{"wall_ms": 1.0, "tokens": 3}], "served": []}), "no 'cycles'"),
             "short.json": (json.dumps({"engine": engine, "served": served[:2]}), "'served': 2 rows, but the engine alone has 5"),
             "no_served.json": (json.dumps({"engine": engine}), "'served': missing")}
    for name, (text, why) in cases.items():
        if text is not None:
            (tmp_path / name).write_text(text)
        with pytest.raises(SystemExit) as e:
            triton_share.main(["--replot", str(tmp_path / name)])
        assert e.value.code == 2
        assert why in capsys.readouterr().err, name


def test_bad_prompts_and_a_used_trace_folder_are_refused_before_loading(built_engines, tmp_path, capsys):
    bad = tmp_path / "prompts.jsonl"
    bad.write_text('{"id": "a", "text": "no prompt key"}\n')
    used = tmp_path / "out"
    (used / "trace").mkdir(parents=True)
    (used / "trace" / "trace.json.0").write_text("[]")
    fifo = tmp_path / "prompts.fifo"
    os.mkfifo(fifo)  # reading it would block forever
    for argv, why in ((["--prompts", str(bad)], "--prompts: " + str(bad) + ":1: expected a non-empty 'prompt' string"),
                      (["--prompts", str(fifo)], f"--prompts: {fifo}: not a regular file"),
                      (["--trace", "--out", str(used)], f"--trace: {used / 'trace'} holds files of an earlier run"),
                      (["--serving-cores", "2"], "--serving-cores places the processes that --pin places: give --pin too")):
        with pytest.raises(SystemExit) as e:
            triton_share.main(["--engines", str(built_engines), *argv])
        assert e.value.code == 2
        assert why in capsys.readouterr().err
    assert not (used / "results.json").exists()  # nothing measured, nothing written


def test_pool_counts_each_runs_loads_and_names_a_bad_file(tmp_path, capsys):
    (s1, e1), (s2, e2) = _pairs(0, 100 / 0.9), _pairs(1, 100.0)
    two = tmp_path / "two.json"  # a run of two loads
    two.write_text(json.dumps({"engine": e1 + e2, "served": s1 + s2}))
    one = tmp_path / "one.json"  # a run of one load, its rows written before loads were recorded
    s3, e3 = _pairs(0, 100 / 0.95)
    one.write_text(json.dumps({"engine": e3, "served": [{k: v for k, v in r.items() if k != "load"} for r in s3]}))
    x = share_stats.pool_runs([("two", json.loads(two.read_text())), ("one", json.loads(one.read_text()))])
    assert [(ld["run"], ld["load"], round(ld["ratio"], 6)) for ld in x["loads"]] == [("two", 0, 0.9), ("two", 1, 1.0), ("one", 2, 0.95)]
    assert x["ratio"] == pytest.approx(300 / (100 / 0.9 + 100 + 100 / 0.95))
    lo, hi = x["ratio_ci95"]
    assert lo < 0.93 and hi > 0.97  # three loads resampled: the interval spans them
    assert triton_share.main(["--pool", str(two), str(one)]) == 0
    assert "3 engine loads pooled" in capsys.readouterr().out
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"engine": e1, "served": s1[:3]}))
    with pytest.raises(SystemExit) as e:
        triton_share.main(["--pool", str(two), str(bad)])
    assert e.value.code == 2
    assert f"--pool {bad}: 'served': 3 rows, but the engine alone has 8" in capsys.readouterr().err


def test_pool_refuses_rows_it_cannot_group(tmp_path):
    s1, e1 = _pairs(0, 100.0)
    for rows, why in (([{k: v for k, v in r.items() if k != "prompt_id"} for r in s1], "row 0: expected a string 'prompt_id'"),
                      ([r | {"load": [1]} for r in s1], "row 0 is load \\[1\\], the engine alone's row 0 0"),
                      ([r | {"wall_ms": float("nan")} for r in s1], "row 0: wall_ms = nan, expected a finite number > 0"),
                      ([r | {"tokens": True} for r in s1], "row 0: tokens = True, expected an integer"),
                      ([r | {"engine_e2e_ms": 1e9} for r in s1], "row 0: engine_e2e_ms = 1000000000.0, expected a finite number within"),
                      (s1[::-1], "'served' row 0 is prompt_id 'p7', the engine alone's row 0 'p0'")):
        with pytest.raises(ValueError, match=why):
            share_stats.pool_runs([("run", {"engine": e1, "served": rows})])
    halves = lambda rows: [r | {"load": i % 2} for i, r in enumerate(rows)]  # noqa: E731  two loads, 4 prompts each
    with pytest.raises(ValueError, match="load 2 ran 4 prompts, not the 4 of run's first load"):
        share_stats.pool_runs([("run", {"engine": halves(e1), "served": halves(s1)})])
    with pytest.raises(ValueError, match="an integer 'load'"):  # both phases' rows alike, but no integer
        share_stats.pool_runs([("run", {"engine": [r | {"load": "0"} for r in e1], "served": [r | {"load": "0"} for r in s1]})])
    # two runs of different settings do not pool
    a = {"meta": {"settings": {"k": 4, "max_tokens": 128}}, "engine": e1, "served": s1}
    with pytest.raises(ValueError, match=r"b: its settings differ from a's in k \(3 against 4\)"):
        share_stats.pool_runs([("a", a), ("b", a | {"meta": {"settings": {"k": 3, "max_tokens": 128}}})])
    # nor runs whose serving processes were placed on other CPUs (--serving-cores)
    with pytest.raises(ValueError, match=r"b: its settings differ from a's in serving_cores \(2 against None\)"):
        share_stats.pool_runs([("a", a), ("b", a | {"meta": {"settings": {"k": 4, "max_tokens": 128, "serving_cores": 2}}})])


def test_core_plan_keeps_the_serving_processes_on_the_cores_asked(monkeypatch):
    monkeypatch.setattr(pinning.os, "sched_getaffinity", lambda pid: set(range(8)))
    monkeypatch.setattr(pinning, "Path", lambda p: type("P", (), {"exists": lambda self: False})())  # no topology: 8 cores
    assert pinning.core_plan() == {"engine": {1}, "target worker ranks": {2}, "rest": {0, 3, 4, 5, 6, 7}}
    assert pinning.core_plan(2) == {"engine": {1}, "target worker ranks": {2}, "rest": {3, 4}}
    for bad in (0, 6):
        with pytest.raises(ValueError, match=f"--serving-cores {bad}: expected 1..5"):
            pinning.core_plan(bad)
    # two threads per core (CPU c and c + 8): the engine and its workers on one CPU each, their siblings idle
    monkeypatch.setattr(pinning.os, "sched_getaffinity", lambda pid: set(range(16)))
    siblings = lambda p: type("P", (), {"exists": lambda self: True, "read_text": lambda self: (  # noqa: E731
        lambda c: f"{c % 8},{c % 8 + 8}\n")(int(str(p).split("/cpu")[-1].split("/")[0]))})()
    monkeypatch.setattr(pinning, "Path", siblings)
    assert pinning.core_plan() == {"engine": {1}, "target worker ranks": {2}, "rest": set(range(16)) - {1, 9, 2, 10}}
    assert pinning.core_plan(2)["rest"] == {3, 11, 4, 12}


def test_pool_and_replot_refuse_files_they_cannot_use(tmp_path, capsys):
    s1, e1 = _pairs(0, 100.0)
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"engine": e1, "served": s1}))
    (tmp_path / "copy.json").write_text(good.read_text())
    os.mkfifo(tmp_path / "fifo.json")  # a read would block forever
    (tmp_path / "deep.json").write_text("[" * 100000 + "]" * 100000)
    (tmp_path / "plot.png").write_text(good.read_text())
    for argv, why in ((["--pool", str(good), str(tmp_path / "copy.json")], "the same results as"),
                      (["--pool", str(tmp_path / "fifo.json")], "fifo.json: cannot be read (not a regular file)"),
                      (["--pool", str(tmp_path / "deep.json")], "deep.json: not valid JSON (RecursionError"),
                      (["--replot", str(tmp_path / "plot.png")], "the plot would overwrite it"),
                      (["--pool", str(good), "--replot", str(good)], "not allowed with argument"),
                      (["--engines", str(tmp_path)], "no target/engine.json")):
        with pytest.raises(SystemExit) as e:
            triton_share.main(argv)
        assert e.value.code == 2, argv
        assert why in capsys.readouterr().err, argv
