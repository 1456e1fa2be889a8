"""bench/interconnect.py: the P2P-on/off comparison's report, from a committed two-H200 sweep."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ON = REPO / "docs" / "lab" / "2026-11-30-grouped-gemm-engine" / "h200x2-2026-11-30-compiled.json"


def _off_copy(on: dict, alpha_factor: float, shard_factor: float) -> dict:
    """A made-up P2P-off file (test data, not a measurement): all-reduces ``alpha_factor`` slower, the sharded
    drafter's rates scaled by ``shard_factor``."""
    off = json.loads(json.dumps(on))
    for v in off["allreduce"]["rows"].values():
        v["graph_us"] *= alpha_factor
        v["eager_us"] *= alpha_factor
    for r in off["partial_rows"]:
        if r.get("draft_tp", 1) > 1 and r["k"] > 0:
            for key in ("tokens_per_s", "tokens_per_s_pooled"):
                if key in r:
                    r[key] *= shard_factor
    return off


def test_report_tables_and_the_crossover_interpolated_between_the_settings(tmp_path, capsys):
    import interconnect

    measured = json.loads(ON.read_text())
    # measured, the drafter on one GPU wins at every batch on NVLink; the made-up pair puts the crossover between them
    on, off = _off_copy(measured, 1.0, 1.5), _off_copy(measured, 10.0, 0.5)
    out = interconnect.report({"p2p_on": on, "p2p_off": off}, tmp_path)
    text = capsys.readouterr().out
    assert "| 1 | 24.1 / 12.8 | 241.2 / 128.2 |" in text  # one row of 7168 bf16: measured, and the ×10 copy
    a_on, a_off = interconnect.alpha_us(on), interconnect.alpha_us(off)
    assert a_off == pytest.approx(10 * a_on)
    for B in (1, 4, 16):
        gaps = []
        for d in (on, off):
            b = interconnect.best_rates(interconnect.sweep(d))
            gaps.append(b[(1, B)][1] - b[(2, B)][1])
        meas = out["crossover_us"][B]["measured_tpN"]
        if (gaps[0] > 0) == (gaps[1] > 0):
            assert meas is None
        else:  # by hand: where the straight line through (α, gap) of the two settings crosses zero
            assert meas == pytest.approx(a_on - gaps[0] * (a_off - a_on) / (gaps[1] - gaps[0]))
            assert a_on < meas < a_off
        assert out["crossover_us"][B]["model_tp8"] > 0
    assert any(out["crossover_us"][B]["measured_tpN"] is not None for B in (1, 4, 16))
    assert (tmp_path / "interconnect.png").read_bytes()[:4] == b"\x89PNG"
    # the sharded drafter loses half its rate in the made-up P2P-off copy: its speed-up falls accordingly
    s_on = {(r["draft_tp"], r["batch"]): r["speedup"] for r in out["settings"]["p2p_on"]["sweep"]}
    s_off = {(r["draft_tp"], r["batch"]): r["speedup"] for r in out["settings"]["p2p_off"]["sweep"]}
    assert s_off[(2, 1)] == pytest.approx(s_on[(2, 1)] / 3) and s_off[(1, 1)] == pytest.approx(s_on[(1, 1)])


def test_run_refuses_a_machine_with_too_few_gpus_and_builds_the_gpu_bench_command():
    import subprocess
    import sys

    import interconnect
    import torch

    if torch.cuda.device_count() < 2:
        done = subprocess.run([sys.executable, str(REPO / "bench" / "interconnect.py"), "run", "--out", "/nonexistent/x"],
                              capture_output=True, text=True, cwd=REPO)
        assert done.returncode == 1 and done.stderr.strip().startswith("interconnect run: needs 2 GPUs for --tp 2, found")
    cmd = interconnect.gpu_bench_command(Path("o"), 2, 1, 48, False)
    assert cmd[cmd.index("--tune") + 1] == "2,1" and cmd[cmd.index("--placements") + 1] == "1,N" and "allreduce" not in cmd[cmd.index("--skip") + 1]
