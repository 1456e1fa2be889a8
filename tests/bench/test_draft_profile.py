"""bench/lab/draft_profile.py at the demo widths on the CPU: the engine's steady draft phase per (B, k) and the bare
drafter step, each with its profile (top names, count, total) and its weight-bytes bound, for a float and an FP8
drafter; refusals name the option."""

from __future__ import annotations

import json

import pytest

from lab import draft_profile


def test_profiles_the_draft_phase_of_both_drafters(tmp_path, capsys):
    out = tmp_path / "p.json"
    assert draft_profile.main(["--small", "--device", "cpu", "--batches", "2", "--ks", "1,3", "--reps", "1", "--iters", "1",
                               "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["meta"]["small"] and r["meta"]["copy_GBps_read_plus_write"] > 0
    parts = {}
    for dtype in ("float", "fp8"):
        d = r["drafters"][dtype]
        p = parts[dtype] = d["weight_bytes_by_part"]
        assert [(x["batch"], x["k"]) for x in d["rows"]] == [(2, 1), (2, 3)] and [x["batch"] for x in d["steps"]] == [2]
        for x in d["rows"] + d["steps"]:
            assert x["gpu_ms"] > 0 and x["kernels"] >= x["distinct_kernels"] >= len(x["top"]) and 0 < len(x["top"]) <= 15
            assert sum(t["ms"] for t in x["top"]) <= x["gpu_ms"] * (1 + 1e-9)
            assert [t["ms"] for t in x["top"]] == sorted((t["ms"] for t in x["top"]), reverse=True)
            assert x["bound_ms"] == pytest.approx(x["weight_bytes"] / (r["meta"]["copy_GBps_read_plus_write"] * 1e6))
        assert all(x["host_ms"] > 0 for x in d["rows"])
        assert all(x["wall_over_bound"] == pytest.approx(x["wall_ms"] / x["bound_ms"]) and
                   x["target_ms"] == pytest.approx(1.25 * x["bound_ms"]) for x in d["rows"])
        for x in d["rows"]:  # fc once, then k forwards of the layer and lm_head
            assert x["weight_bytes"] == p["fc"] + x["k"] * (p["layer"] + p["lm_head"]) and x["window"] == 256
            assert x["kv_bytes"] == x["k"] * 2 * 256 * 8 * 32 * 2 * 4  # B · window · kv heads · head_dim · K,V · float32
        assert d["steps"][0]["weight_bytes"] == p["layer"] + p["lm_head"]
    # FP8 linears: a quarter of float32's bytes plus a scale per 128×128 tile; lm_head stays float
    assert parts["fp8"]["lm_head"] == parts["float"]["lm_head"]
    assert 0.25 < parts["fp8"]["fc"] / parts["float"]["fc"] < 0.251 and parts["fp8"]["layer"] < 0.26 * parts["float"]["layer"]
    printed = capsys.readouterr().out
    assert "steady draft phase, GPU ms (profiler) / weight-bytes bound ms" in printed
    assert "steady draft phase, fp8: ms" in printed and "wall<=target" in printed


def test_refusals_name_the_option(tmp_path, capsys):
    (tmp_path / "a_file").write_text("")  # --trace: a file where the folder would go
    for bad, says in ((["--ks", "9"], "--ks at most 8"), (["--batches", "0"], "--batches"),
                      (["--drafter-dtype", "int4"], "float, fp8"), (["--device", "cpu"], "--small"),
                      (["--device", "cpu", "--compile", "on"], "--compile"), (["--pdl"], "--pdl"),
                      (["--trace", str(tmp_path / "a_file")], "--trace"), (["--pdl", "--compile", "off"], "--pdl"),
                      (["--reps", "0"], "--reps"), (["--out", str(tmp_path / "no" / "p.json")], "--out"),
                      (["--out", str(tmp_path)], "--out")):
        with pytest.raises(SystemExit) as e:
            draft_profile.main(["--out", str(tmp_path / "p.json")] + (["--small"] if "--small" not in says else []) + bad)
        assert e.value.code == 2 and says in capsys.readouterr().err


def test_trace_writes_one_file_per_drafter_and_phase(tmp_path):
    """--trace DIR: each drafter's phases in its own folder (the same phases' names would overwrite each other); on the
    CPU the host's side alone."""
    out, trace = tmp_path / "p.json", tmp_path / "traces"
    assert draft_profile.main(["--small", "--device", "cpu", "--batches", "1", "--ks", "1", "--reps", "1", "--iters", "1",
                               "--out", str(out), "--trace", str(trace)]) == 0
    assert sorted(str(p.relative_to(trace)) for p in trace.rglob("*.json")) == ["float/trace_B1_k1.json", "fp8/trace_B1_k1.json"]
    assert all(json.loads(p.read_text())["traceEvents"] for p in trace.rglob("*.json"))
