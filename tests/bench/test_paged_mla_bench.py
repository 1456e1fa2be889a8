"""bench/lab/paged_mla_bench.py on the CPU with tiny shapes (--dry-run): every (TP, batch, k, window) row for the dense
and the MoE layer with both attention paths, the kernel sweep's rows and the plot; ``--replot`` of a written file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


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
