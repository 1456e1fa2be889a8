"""bench/cost_model.py: fits a committed sweep and plots it."""

from __future__ import annotations



def test_cost_model_script_fits_a_committed_sweep_and_plots_it(tmp_path):
    """bench/cost_model.py on the one-H200 sweep of its lab entry prints the fit docs/performance.md quotes and
    writes its plot; a --png that is a file is refused before anything is read."""
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    data = repo / "docs" / "lab" / "2026-12-01-h200-tp1-cost-model-tuner" / "h200-2026-12-01-tp1-compiled-sweep-loads4.json"
    script = [sys.executable, str(repo / "bench" / "cost_model.py")]
    done = subprocess.run(script + ["--png", str(tmp_path / "plots"), str(data)], capture_output=True, text=True, cwd=repo)
    assert done.returncode == 0, done.stderr
    assert "MoE layers [1, 2, 3] (54 configurations" in done.stdout and "in-sample error max 7.5%, mean 2.1%" in done.stdout
    assert (tmp_path / "plots" / "h200-2026-12-01-tp1-compiled-sweep-loads4-tp1-draft-tp1.png").read_bytes()[:4] == b"\x89PNG"
    (tmp_path / "f").write_text("")
    refused = subprocess.run(script + ["--png", str(tmp_path / "f"), str(data)], capture_output=True, text=True, cwd=repo)
    assert refused.returncode == 2 and "not a folder" in refused.stderr
