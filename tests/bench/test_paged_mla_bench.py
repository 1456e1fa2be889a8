"""bench/lab/paged_mla_bench.py on the CPU with tiny shapes (--dry-run): every (TP, batch, k, window) row for the dense
and the MoE layer with both attention paths, and the kernel sweep's rows."""

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
