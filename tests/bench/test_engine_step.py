"""bench/engine_step.py: measures steady cycles of the engine alone and plots results files together."""

from __future__ import annotations

import json

import pytest

import engine_step


def test_measures_steady_cycles_and_plots(built_engines, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SPLITSPEC_PADDED", "1")  # steady cycles in the static-shape form, as on GPU
    args = ["--engines", str(built_engines), "--num-prompts", "1", "--warmup-passes", "1", "--passes", "1",
            "--max-tokens", "24", "-k", "3"]
    assert engine_step.main(args + ["--label", "a", "--out", str(tmp_path / "a")]) == 0
    r = json.loads((tmp_path / "a" / "results.json").read_text())
    s = r["steady_step_us"]
    assert s["n"] == len(r["steps_us"]) >= 2 and s["p50"] <= s["p90"] <= s["p99"] <= s["max"]
    assert r["output_tokens"] == 24 and r["tokens_per_s"] > 0 and r["draft_ms"] > 0 and r["verify_ms"] > 0
    # the draft/verify split is of the timed steady cycles, no other
    assert r["split_cycles"] == s["n"] and r["draft_ms"] + r["verify_ms"] <= s["mean"] / 1e3
    assert r["meta"]["label"] == "a" and r["meta"]["settings"]["k"] == 3
    assert engine_step.main(["--plot", str(tmp_path / "a" / "results.json"), "--png", str(tmp_path / "p.png")]) == 0
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"
    assert "a: steady cycle p50" in capsys.readouterr().out


def test_refusals_name_the_problem(tmp_path, capsys):
    assert engine_step.main(["--engines", str(tmp_path)]) == 1
    assert "engine.json" in capsys.readouterr().err
    (tmp_path / "other.json").write_text('{"a": 1}')
    (tmp_path / "a_file").write_text("")
    plot = ["--plot", str(tmp_path / "other.json"), "--png"]
    for bad, says in ((["--engines", "x", "--passes", "0"], "--passes"), (["--engines", "x", "-k", "-1"], "-k = -1"),
                      (["--plot", str(tmp_path / "no.json"), "--png", "p.png"], "No such file"),
                      (plot + [str(tmp_path / "p.png")], "other.json: not a results file"), (plot + [str(tmp_path)], "a folder"),
                      (["--plot", str(tmp_path)], "--png"), ([], "--engines"), (["--engines", "x", "--device-ids", "abc"], "GPU ids"),
                      (["--engines", "x", "--out", str(tmp_path / "a_file")], "a file, expected a folder")):
        with pytest.raises(SystemExit) as e:
            engine_step.main(bad)
        assert e.value.code == 2 and says in capsys.readouterr().err
