"""bench/lab/paged_mla_bench.py on the CPU with tiny shapes (--dry-run): every (TP, batch, k, window) row for the dense
and the MoE layer with both attention paths, the kernel sweep's rows and the plot; ``--replot`` of a written file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
NOT_ROWS = "expected a paged_mla_bench.json with 'rows' (a list of row objects)"
ROW = {"tp": 8, "B": 1, "k": 0, "S": 256, "layer": "dense", "gathered_us": 100.0, "paged_us": 105.0}


def test_dry_run_writes_every_row(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"))
    run = subprocess.run([sys.executable, str(REPO / "bench/lab/paged_mla_bench.py"), "--dry-run", "--sweep", "--tp", "8,1",
                          "--batches", "1,2", "--ks", "0,1", "--windows", "32", "--out", str(tmp_path)],
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    r = json.loads((tmp_path / "paged_mla_bench.json").read_text())
    keys = [(x["tp"], x["B"], x["k"], x["S"], x["layer"]) for x in r["rows"]]
    assert keys == [(tp, B, k, 32, layer) for tp in (8, 1) for B in (1, 2) for k in (0, 1) for layer in ("dense", "moe")]
    assert all(x["gathered_us"] > 0 and x["paged_us"] > 0 and x["bound_us"] is None for x in r["rows"])
    assert r["invariant"] == {"8": None, "1": None}  # not checked on the CPU
    assert len(r["sweep"]) == 2 and all(x["us"] > 0 for x in r["sweep"])
    assert "TP8 B 2 k1 S   32 moe" in run.stdout
    assert (tmp_path / "paged_mla_bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_replot_draws_a_written_json_and_refuses_a_bad_one(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"))
    rows = [{"tp": 8, "B": B, "k": k, "S": S, "layer": layer, "gathered_us": 100.0 + S / 10, "paged_us": 105.0 + S / 40}
            for B in (1, 16) for k in (0, 3) for S in (256, 4096) for layer in ("dense", "moe")]
    src = tmp_path / "paged_mla_bench.json"
    src.write_text(json.dumps({"device": "test", "rows": rows}))
    script = [sys.executable, str(REPO / "bench/lab/paged_mla_bench.py"), "--replot"]
    run = subprocess.run([*script, str(src)], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert (tmp_path / "paged_mla_bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (tmp_path / "bad.json").write_text("{}")
    bad = subprocess.run([*script, str(tmp_path / "bad.json")], env=env, capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "expected a paged_mla_bench.json with 'rows'" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1 and not (tmp_path / "bad.png").exists()


@pytest.mark.parametrize("doc, says", [({"rows": {"a": 1}}, NOT_ROWS),
                                       ({"rows": "abc"}, NOT_ROWS),
                                       ([1], NOT_ROWS),
                                       ({"rows": [1]}, "row 0: int, expected an object"),
                                       ({"rows": [{"tp": 8}]}, "row 0: B missing, expected an integer ≥ 1"),
                                       ({"rows": [dict(ROW, gathered_us=None)]}, "row 0: gathered_us = null, expected µs > 0"),
                                       ({"rows": [dict(ROW, S="256")]}, 'row 0: S = "256", expected an integer ≥ 1'),
                                       ({"rows": [dict(ROW, paged_us=-1)]}, "row 0: paged_us = -1, expected µs > 0"),
                                       ({"rows": [dict(ROW, tp=[8])]}, "row 0: tp = [8], expected an integer ≥ 1")])
def test_replot_refuses_rows_it_cannot_draw_in_one_line(tmp_path, doc, says):
    """A JSON whose rows are not what a run writes: one line, no PNG, no traceback."""
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"))
    src = tmp_path / "bad.json"
    src.write_text(json.dumps(doc))
    run = subprocess.run([sys.executable, str(REPO / "bench/lab/paged_mla_bench.py"), "--replot", str(src)], env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 1 and run.stderr.strip() == f"--replot {src}: {says}", run.stderr[-2000:]
    assert list(tmp_path.iterdir()) == [src]


def test_replot_without_device_draws_and_refuses_a_png_or_an_unwritable_plot(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"))
    script = [sys.executable, str(REPO / "bench/lab/paged_mla_bench.py"), "--replot"]
    src = tmp_path / "r.json"
    src.write_text(json.dumps({"rows": [ROW, dict(ROW, S=4096)]}))  # no "device": drawn with "?"
    (tmp_path / "r.png").mkdir()  # where the plot goes: a folder
    run = subprocess.run([*script, str(src)], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 1 and run.stderr.strip() == f"--replot {src}: {tmp_path / 'r.png'} could not be written (a folder, expected a file path)"
    (tmp_path / "r.png").rmdir()
    assert subprocess.run([*script, str(src)], env=env, capture_output=True, text=True, timeout=300).returncode == 0
    assert (tmp_path / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    run = subprocess.run([*script, str(tmp_path / "r.png")], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 1 and "expected the .json" in run.stderr and len(run.stderr.strip().splitlines()) == 1
    assert (tmp_path / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # not written over
