"""The auto-tuner's choice and its use by the engine; the cost model's formulas."""

from __future__ import annotations

import json
import shutil

import pytest

from splitspec.runtime.scheduler import SpeculativeEngine
from splitspec.runtime.types import Request
from splitspec.errors import ConfigError
from splitspec.measure.prompts import Prompt
from splitspec.measure.tune import tune
from splitspec.settings import ServeConfig


def test_engine_uses_tuned_k_per_batch_bucket(built_engines, tmp_path):
    eng_dir = tmp_path / "e"
    shutil.copytree(built_engines, eng_dir)
    (eng_dir / "tuning.json").write_text(json.dumps({"draft_tp": 1, "k_by_batch": {"1": 3, "2": 0}}))  # one placement, older form
    with SpeculativeEngine.load(ServeConfig(eng_dir)) as eng:
        assert eng.group.placements == (1,) and eng.default_k() == 3
        a = eng.submit(Request([1, 2, 3], 4, stop_token_ids=set()))
        b = eng.submit(Request([1, 2, 3], 4, stop_token_ids=set()))
        assert eng.seqs[a].k == 3 and eng.seqs[b].k == 0
        while eng.has_work():
            eng.step()


def test_tune_measures_steady_cycles_and_verifies(built_engines, tmp_path):
    eng_dir = tmp_path / "e"
    shutil.copytree(built_engines, eng_dir)
    prompts = tmp_path / "p.txt"
    prompts.write_text("def f(x):\nclass A:\n")
    (eng_dir / "tuning.json").write_text("not json {")  # a broken earlier file does not stop the tuner that replaces it
    # one engine load per placement and one cycle per row and sweep: every round of steady cycles and every engine
    # load costs about a second here, and this test is about measure → choose → write → verify, not the statistics
    # (the default, 48 cycles over 2 loads, measures; loads alternating and rows averaged over them, and cycles
    # spread over several passes: test_placements_alternate_over_engine_loads). Acceptance 1.0 makes the tokens a
    # cycle emits exact: k + 1 per sequence, whatever the sampling's draws
    res = tune(ServeConfig(eng_dir, synthetic_acceptance=[1.0]), [1, 2], [0, 2], prompts, max_seq_len=128, verify=True,
               cycles=1, loads=1)
    saved = json.loads((eng_dir / "tuning.json").read_text())
    assert saved["k_by_batch"] == res["k_by_batch"] and set(saved["k_by_batch"]) == {"1", "2"}
    rows = saved["measured"]
    assert {(r["draft_tp"], r["batch"], r["k"]) for r in rows} >= {(1, 1, 0), (1, 1, 2), (1, 2, 0), (1, 2, 2)}
    assert all(r["n"] > 0 and r["cycle_ms"] > 0 for r in rows)
    # with every draft accepted, k = 2 emits three tokens per sequence and cycle; k = 0 exactly one
    assert all(r["acceptance_length"] == r["expected_acceptance_length"] == r["k"] + 1 and r["n"] == 1 for r in rows)
    assert all(r["tokens_per_cycle"] == r["batch"] * (r["k"] + 1) for r in rows)
    assert set(saved["verification"]["score"]) == {"1", "2"}
    configs = lambda rows: {(r["draft_tp"], r["batch"], r["k"]) for r in rows}  # noqa: E731
    assert configs(saved["verification"]["measured"]) == configs(rows)
    with pytest.raises(ConfigError):
        tune(ServeConfig(eng_dir), [], [0, 2], prompts)
    with pytest.raises(ConfigError):
        tune(ServeConfig(eng_dir), [1], [2], prompts)


def _tp(engines) -> int:
    return int(json.loads((engines / "target" / "engine.json").read_text())["mapping"]["tp_size"])


def test_tuning_that_does_not_fit_the_engines_is_refused(built_engines, tmp_path):
    from splitspec.runtime.placement import read_tuning

    eng_dir = tmp_path / "e"
    shutil.copytree(built_engines, eng_dir)
    for bad, why in (({"draft_tp": 1, "k_by_batch": {"1": 99}}, "max_draft_len"),
                     ({"draft_tp": _tp(built_engines) + 1, "k_by_batch": {"1": 2}}, "tp_size"),
                     ({"draft_tp_by_batch": {"1": 1, "4": _tp(built_engines) + 1}, "k_by_batch": {"1": 2, "4": 2}}, "tp_size")):
        (eng_dir / "tuning.json").write_text(json.dumps(bad))
        with pytest.raises(ConfigError, match=f"tuning.json.*{why}"):
            read_tuning(eng_dir)
    with pytest.raises(ConfigError, match="max_draft_len"):
        tune(ServeConfig(eng_dir), [1], [0, 99], tmp_path / "none.txt")


def test_rendered_repository_follows_tuning_unless_told(built_engines, tmp_path):
    from splitspec.serving.engine_process import EngineProcess
    from splitspec.serving.repo import render_repo, repo_setting

    eng_dir = tmp_path / "e"
    shutil.copytree(built_engines, eng_dir)
    tp = _tp(built_engines)
    (eng_dir / "tuning.json").write_text(json.dumps({"draft_tp": tp, "k_by_batch": {"1": 3, "4": 0}}))
    setting = lambda repo, key: repo_setting(repo, "spec_decode", key)  # noqa: E731
    repo = render_repo(ServeConfig(eng_dir), tmp_path / "r1")
    assert setting(repo, "draft_tp") == str(tp) and setting(repo, "num_draft_tokens") == ""
    repo = render_repo(ServeConfig(eng_dir, num_draft_tokens=2), tmp_path / "r2")
    assert setting(repo, "draft_tp") == str(tp) and setting(repo, "num_draft_tokens") == "2"
    if tp > 1:  # tuned for the sharded drafter: with the split one, k is the default
        repo = render_repo(ServeConfig(eng_dir, draft_tp=1), tmp_path / "r3")
        assert setting(repo, "draft_tp") == "1" and setting(repo, "num_draft_tokens") == "4"
    # what spec_decode does with an empty num_draft_tokens: the engine (in its process) follows tuning.json
    proc = EngineProcess(ServeConfig(eng_dir, draft_tp=tp, num_draft_tokens=None), lambda *a: None, lambda m: None)
    try:
        assert proc.info["k_by_batch"] == {1: 3, 4: 0} and proc.info["draft_tp"] == tp
    finally:
        proc.close()
    # tuned per bucket with both placements: the engine loads both and follows the file
    (eng_dir / "tuning.json").write_text(json.dumps({"draft_tp_by_batch": {"1": 1, "4": tp}, "k_by_batch": {"1": 3, "4": 2}}))
    repo = render_repo(ServeConfig(eng_dir), tmp_path / "r5")
    assert setting(repo, "draft_tp") == ("" if tp > 1 else "1") and setting(repo, "num_draft_tokens") == ""
    repo = render_repo(ServeConfig(eng_dir, draft_tp=tp), tmp_path / "r6")
    assert setting(repo, "draft_tp") == str(tp) and setting(repo, "num_draft_tokens") == ("4" if tp > 1 else "")
    proc = EngineProcess(ServeConfig(eng_dir, draft_tp=None, num_draft_tokens=None), lambda *a: None, lambda m: None)  # what "" gives
    try:
        assert proc.info["draft_tp_by_batch"] == ({1: 1, 4: tp} if tp > 1 else {}) and proc.info["k_by_batch"] == {1: 3, 4: 2}
    finally:
        proc.close()
    (eng_dir / "tuning.json").unlink()
    repo = render_repo(ServeConfig(eng_dir), tmp_path / "r4")
    assert setting(repo, "draft_tp") == "1" and setting(repo, "num_draft_tokens") == "4"


def test_tune_refuses_what_the_engines_cannot_do_before_measuring(built_engines, tmp_path):
    prompts = tmp_path / "p.txt"
    prompts.write_text("x\n")
    with pytest.raises(ConfigError, match="max_batch_size"):
        tune(ServeConfig(built_engines), [1, 10_000], [0, 1], prompts)
    with pytest.raises(ConfigError, match="max_seq_len"):
        tune(ServeConfig(built_engines), [1], [0, 1], prompts, max_seq_len=100_000)


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
                        lambda cfg: order.append(cfg.draft_tp) or real_load(cfg))
    rows = tune_mod.measure(ServeConfig(built_engines, synthetic_acceptance=[0.9]), [1, 2], [1], [0, 1],
                            [Prompt("p", "def f(x):")], 64,
                            cycles=4, loads=3)  # shared 1, 1, 2 over the loads
    assert order == [1, 2, 2, 1, 1, 2]
    assert {(r["draft_tp"], r["k"]) for r in rows} == {(1, 0), (1, 1), (2, 0), (2, 1)}
    for r in rows:
        assert r["n"] == 4 and len(r["cycle_ms_by_load"]) == 3
        assert r["cycle_ms"] == pytest.approx(sum(r["cycle_ms_by_load"]) / 3)
    with pytest.raises(ConfigError, match="loads = 3"):
        tune(ServeConfig(built_engines), [1], [0, 1], tmp_path / "none.txt", cycles=2, loads=3)


@pytest.mark.parametrize("command", ["tune", "generate"])
@pytest.mark.parametrize("device", ["foo", "cuda:x", "cuda:", "cuda:0,,1", "gpu:0"])
def test_bad_device_is_refused_naming_it(built_engines, capsys, command, device):
    from splitspec.cli import main as cli_main

    assert cli_main([command, "--engines", str(built_engines), "--device", device]) == 2
    assert f"argument --device: {device!r}: expected cpu or cuda:0,1,..." in capsys.readouterr().err


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
        rows = tune_mod.measure(ServeConfig(built_engines), [1], [1], [0, 1], [[5, 6, 7, 8]], 64, cycles=2, loads=2)
    finally:
        gc.enable()
    assert alive_at_load == [False, False] and {r["k"] for r in rows} == {0, 1}


