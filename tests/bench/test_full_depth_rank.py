"""bench/full_depth_rank.py: the full deployment from one rank's rows (collectives, tuned speed-ups, the model's
error) on canned numbers, and the whole script on the CPU with tiny shapes (--dry-run)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

import full_depth_rank as fdr

FLAT = [(1e3, 10.0), (3e3, 10.0)]  # every collective 10 µs
DIMS = {"hidden": 4, "vocab": 8, "draft_vocab": 4}


def test_collectives_interpolate_and_count():
    sloped = [(1e3, 10.0), (3e3, 14.0)]
    assert fdr.collective_us(sloped, 10) == 10.0 and fdr.collective_us(sloped, 2e3) == 12.0
    assert fdr.collective_us(sloped, 5e3) == pytest.approx(18.0)  # past the largest: the last slope
    assert fdr.collective_us([(1e3, 7.0)], 9e9) == 7.0
    # verify: 2 per layer + the embedding's + the logits' all-gather; TP1 pays nothing
    assert fdr.comm_ms(FLAT, 8, 2, 1, 0, None, DIMS) == {"verify_ms": pytest.approx(0.06), "draft_ms": 0.0}
    assert fdr.comm_ms(FLAT, 1, 61, 16, 5, 1, DIMS) == {"verify_ms": 0.0, "draft_ms": 0.0}
    # split drafter: the aux hop and the drafts' broadcast; sharded: 2 all-reduces + 1 all-gather per forward, k forwards
    assert fdr.comm_ms(FLAT, 8, 2, 1, 2, 1, DIMS)["draft_ms"] == pytest.approx(0.02)
    assert fdr.comm_ms(FLAT, 8, 2, 4, 3, 8, DIMS)["draft_ms"] == pytest.approx(0.09)


class StubModel:
    def cycle_ms(self, B, k, placement, layers):
        return 10.0 + 2 * k + (0.5 if placement == "tp1" else 0.0)

    def verify_ms(self, B, k, layers):
        return 11.0


def canned() -> list[dict]:
    return [{"draft_tp": None, "batch": 1, "k": 0, "cycle_ms": 10.0, "draft_ms": 0.0, "verify_ms": 9.0},
            {"draft_tp": 1, "batch": 1, "k": 2, "cycle_ms": 12.0, "draft_ms": 2.0, "verify_ms": 9.5},
            {"draft_tp": 8, "batch": 1, "k": 2, "cycle_ms": 11.0, "draft_ms": 1.0, "verify_ms": 9.5}]


def test_full_depth_speedups_and_model_error_on_canned_rows(tmp_path):
    full = fdr.full_depth(canned(), FLAT, 8, 2, DIMS, profile=[0.5, 0.5])
    by = {(r["draft_tp"], r["k"]): r for r in full}
    assert sorted(by) == [(1, 0), (1, 2), (8, 0), (8, 2)]  # the k = 0 row under both placements
    assert by[1, 0]["full_cycle_ms"] == pytest.approx(10.06) and by[8, 0]["tokens_per_s"] == pytest.approx(1e3 / 10.06)
    assert by[1, 2]["full_cycle_ms"] == pytest.approx(12.08) and by[8, 2]["full_cycle_ms"] == pytest.approx(11.12)
    assert by[1, 2]["expected_acceptance_length"] == pytest.approx(1.75)
    assert by[1, 2]["speedup"] == pytest.approx(1.75 * 10.06 / 12.08) and by[8, 2]["speedup"] == pytest.approx(1.75 * 10.06 / 11.12)
    best = {b["draft_tp"]: b for b in fdr.best_k(full)}
    assert best[1]["k"] == best[8]["k"] == 2 and best[8]["speedup"] == pytest.approx(1.75 * 10.06 / 11.12)
    errs = fdr.model_errors(full, {"stub": StubModel()}, 8, 2)
    assert [(e["draft_tp"], e["k"]) for e in errs] == [(1, 0), (1, 2), (8, 2)]  # k = 0 counted once
    e = {(x["draft_tp"], x["k"]): x for x in errs}
    assert e[1, 0]["cycle_error"] == pytest.approx((10.5 - 10.06) / 10.06)
    assert e[8, 2]["cycle_error"] == pytest.approx((14.0 - 11.12) / 11.12)
    assert e[1, 2]["verify_error"] == pytest.approx((11.0 - 9.56) / 9.56)  # rank verify + the verify's collectives
    res = {"tp": 8, "layers": 2, "label": "canned", "allreduce": {"source": "canned"}, "full": full, "best": fdr.best_k(full),
           "model_errors": errs}
    text = fdr.report(res)
    assert "| sharded (drafter TP8) | 1 | 2 | 11.00 | 1.00 | 9.50 | 0.12 | 11.12 | 157 | ×1.58 |" in text
    assert "| stub | 1 | 10.50 / 10.06 | +17% / +26% | +17% / +21% |" in text
    assert fdr.plot(res, tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"


def test_rows_to_measure_put_large_verifies_last_and_skip_those_kept():
    a = SimpleNamespace(tp=8, batches=[1, 4, 16], ks=[0, 4])
    assert fdr.todo(a, [{"batch": 1, "k": 0, "draft_tp": None}, {"batch": 16, "k": 4, "draft_tp": 1}]) == [
        (1, 4, 1), (1, 4, 8), (4, 0, None), (16, 0, None), (4, 4, 1), (4, 4, 8), (16, 4, 8)]


def test_dry_run_writes_rows_report_and_plot(tmp_path, capsys):
    """The whole script on the CPU: tiny TP8 INT4 engine, rank 0 alone; a row per (k, placement), the collectives of
    the lab's all-reduce file added, the model compared; --resume keeps those rows, and past --budget-s no row starts."""
    out = tmp_path / "fd"
    args = ["--dry-run", "--layers", "2", "--batches", "1", "--cycles", "2", "--allreduce", "lab", "--out", str(out)]
    fdr.START -= 1e4  # an old process (a test worker): --budget-s counts from main(), not from the import
    assert fdr.main(args + ["--ks", "0-1"]) == 0
    res = json.loads((out / "full_depth_rank.json").read_text())
    assert [(r["draft_tp"], r["k"]) for r in res["rows"]] == [(None, 0), (1, 1), (8, 1)]
    assert len(res["full"]) == 4 and {b["draft_tp"] for b in res["best"]} == {1, 8} and res["model_errors"]
    assert res["allreduce"]["world"] == 2 and "grouped-gemm-engine" in res["allreduce"]["source"] and "synthetic" in res["label"]
    assert all(r["comm_verify_ms"] > 0 for r in res["full"]) and (out / "full_depth_rank.png").read_bytes()[:4] == b"\x89PNG"
    assert "Tuned speculation" in (out / "full_depth_rank.md").read_text()
    capsys.readouterr()
    assert fdr.main(args + ["--ks", "0-2", "--resume", "--budget-s", "0"]) == 0
    again = json.loads((out / "full_depth_rank.json").read_text())
    assert again["rows"] == res["rows"] and again["resumed"]["rows"] == 3
    assert again["skipped"] == [{"batch": 1, "k": 2, "draft_tp": 1}, {"batch": 1, "k": 2, "draft_tp": 8}]
    assert "3 rows of" in capsys.readouterr().out
    for bad, says in ((["--ks", "1,2"], "0 among them"), (["--ks", "0-x"], "expected integers"),
                      (["--out", str(out / "full_depth_rank.json")], "a file"),
                      (["--out", str(out / "full_depth_rank.json" / "sub")], "is a file, not a folder"),
                      (["--tp", "3"], "--tp 3: expected one of 1, 2, 4, 8"), (["--max-seq-len", "0"], "--max-seq-len 0"),
                      (["--budget-s", "nan"], "--budget-s nan: expected seconds"),
                      (["--model-from", str(out / "full_depth_rank.md")], "--model-from"),
                      (["--resume", "--out", str(out), "--layers", "3", "--dry-run"], "holds layers 2")):
        with pytest.raises(SystemExit):
            fdr.main(bad)
        assert says in capsys.readouterr().err
