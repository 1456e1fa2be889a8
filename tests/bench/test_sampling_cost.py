"""bench/lab/sampling_cost.py on the CPU: a row per (batch, k), the JSON beside, and refusals in one line."""

from __future__ import annotations

import pytest

from lab import sampling_cost
from splitspec.files import read_json


def test_rows_are_timed_and_written(capsys, tmp_path):
    assert sampling_cost.main(["--batches", "1,3", "--ks", "0,2", "--vocab", "64", "--reps", "2",
                               "--json", str(tmp_path / "cost.json")]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.split() and line.split()[0].isdigit()]
    assert [r[:2] for r in rows] == [["1", "0"], ["1", "2"], ["3", "0"], ["3", "2"]]
    assert all(float(r[2]) > 0 and r[3] == "—" for r in rows)
    doc = read_json(tmp_path / "cost.json")
    assert [(r["batch"], r["k"]) for r in doc["rows"]] == [(1, 0), (1, 2), (3, 0), (3, 2)]
    assert doc["params"]["top_p"] == 0.95 and all(r["device_us"] is None for r in doc["rows"])


@pytest.mark.parametrize("args, says", [(["--temperature", "0"], "greedy"), (["--top-p", "2"], "top_p = 2.0"),
                                        (["--device", "cuda:7"], ""), (["--vocab", "1"], "--vocab 1"),
                                        (["--batches", "0"], "batches"), (["--ks", "a"], "'a'"),
                                        (["--profile", "-1"], "--profile -1"), (["--device", "meta"], "--device meta"),
                                        (["--json", "/nonexistent/cost.json"], "cannot write in /nonexistent")])
def test_bad_options_are_one_line(capsys, args, says):
    with pytest.raises(SystemExit) as e:
        sampling_cost.main(args + ["--reps", "1", "--vocab", "64"] if "--vocab" not in args else args)
    err = capsys.readouterr().err
    assert e.value.code == 2 and says in err and "Traceback" not in err


def test_profile_prints_the_costliest_operators(capsys):
    assert sampling_cost.main(["--batches", "1", "--ks", "1", "--vocab", "64", "--reps", "1", "--profile", "3"]) == 0
    out = capsys.readouterr().out
    table = out[out.index("Name"):]
    assert table.count("aten::") == 3 and "Self CPU time total" in out


def test_a_size_too_large_for_memory_is_one_line(capsys):
    assert sampling_cost.main(["--batches", "1", "--ks", "1", "--vocab", str(10**12), "--reps", "1"]) == 1
    err = capsys.readouterr().err
    assert "batch 1, k 1, V 1000000000000" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
