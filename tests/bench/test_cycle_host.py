"""bench/lab/cycle_host.py on the CPU: the two phases' host time per (B, k), and with --steps whole scheduler steps
for each k including 0 (every step of the run timed, each row's step count that of its requests' tokens)."""

from __future__ import annotations

import pytest

from lab import cycle_host


def _rows(text: str) -> list[list[str]]:
    return [line.split() for line in text.splitlines() if line.split() and line.split()[0].isdigit()]


def test_phases_and_steps_are_timed(capsys):
    assert cycle_host.main(["--batches", "2", "--ks", "1", "--reps", "3", "--max-seq-len", "256"]) == 0
    (row,) = _rows(capsys.readouterr().out)
    assert row[:2] == ["2", "1"] and float(row[3]) > 0 and float(row[4]) > 0
    assert cycle_host.main(["--steps", "12", "--batches", "2", "--ks", "0,2"]) == 0
    rows = _rows(capsys.readouterr().out)
    assert [r[:2] for r in rows] == [["2", "0"], ["2", "2"]]
    # k 0: one prefill step, then one token per step; k 2: fewer steps (each accepts at least its target token)
    assert int(rows[0][2]) == 12 and 1 < int(rows[1][2]) <= 12 and all(float(r[3]) > 0 for r in rows)
    # draft-ahead: the same steps (its drafts are the ones the host-only graphs return either way), timed alike
    assert cycle_host.main(["--steps", "12", "--batches", "2", "--ks", "2", "--ahead"]) == 0
    out = capsys.readouterr().out
    assert "draft-ahead" in out and [r[:3] for r in _rows(out)] == [rows[1][:3]]
    # sampled requests, drafted ahead too
    assert cycle_host.main(["--steps", "12", "--batches", "2", "--ks", "2", "--ahead", "--temperature", "0.8"]) == 0
    out = capsys.readouterr().out
    assert "sampled at temperature 0.8" in out and [r[:2] for r in _rows(out)] == [["2", "2"]]


def test_k0_only_with_steps_and_at_least_one_rep():
    with pytest.raises(SystemExit):
        cycle_host.main(["--ks", "0"])
    with pytest.raises(SystemExit):
        cycle_host.main(["--reps", "0"])


def test_steps_refusals_name_the_option(capsys):
    """--steps N < 0, or N too long for --max-seq-len (the engine's limit, which --steps uses), is a usage error, not a
    ConfigError's stack trace from the first request."""
    for bad, says in ((["--steps", "-5"], "--steps -5"), (["--steps", "5000"], "--max-seq-len 4096"),
                      (["--steps", "100", "--max-seq-len", "128"], "--max-seq-len 128"), (["--ks", "9"], "--ks"),
                      (["--ahead"], "--ahead and --temperature go with --steps"),
                      (["--temperature", "0.5"], "go with --steps"),
                      (["--steps", "4", "--temperature", "-1"], "--temperature -1.0")):
        with pytest.raises(SystemExit) as e:
            cycle_host.main(["--batches", "1", "--ks", "1"] + bad)
        assert e.value.code == 2 and says in capsys.readouterr().err
    # --position does not apply to --steps; --max-seq-len does
    assert cycle_host.main(["--steps", "4", "--batches", "1", "--ks", "1", "--max-seq-len", "128", "--position", "500"]) == 0
