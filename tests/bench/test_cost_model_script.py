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


def test_context_option_prints_the_best_k_at_both_contexts(capsys):
    """--context N: the full-depth bytes models' verify and best k by batch at 0 and at N keys per sequence; without it
    no such table. The production-grade engine's batch-16 verify (k = 0) grows by 61 layers × 16 × 4096 keys × 1152 B
    at 70% of the file's 4.27 TB/s: 28.20 → 29.74 ms (a TP8 rank's 8 heads × 1 token: one block of query rows). At
    k 5 (6 tokens: 3 blocks) the rows cost three times that, and the drafter-TP8 best k falls from 6 to 5."""
    from pathlib import Path

    import cost_model

    data = Path(__file__).resolve().parents[2] / "docs" / "lab" / "2026-11-30-fused-moe-kernels" / "h200x2-2026-11-30-fused-moe.json"
    cost_model.main([str(data)])
    assert "cached keys read per layer" not in capsys.readouterr().out
    cost_model.main([str(data)], context=4096)
    out = capsys.readouterr().out
    assert "each sequence's 4096 cached keys read per layer" in out
    assert "| production-grade engine | 16 | 28.20 → 29.74 | k=5: 767 → k=5: 727 | k=6: 811 → k=5: 763 |" in out


def test_context_option_says_when_a_file_has_no_layer_rows_to_carry_it(capsys):
    """A result file without per-layer rows has no full-depth model: --context says so instead of printing nothing."""
    from pathlib import Path

    import cost_model

    data = Path(__file__).resolve().parents[2] / "docs" / "lab" / "2026-12-03-h200-b16-depth-old-new" / "gpu_bench_tune_8f4dcff.json"
    cost_model.main([str(data)], context=4096)
    assert "(--context 4096: this file has no per-layer rows, so no full-depth model to carry it)" in capsys.readouterr().out


def test_a_context_out_of_range_is_refused_in_one_line(tmp_path):
    """--context past 1e9 keys (every figure inf, best k 0 tokens/s), negative or not a number: one parser line, rc 2,
    before any file is read."""
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    for bad in ("1e308", "1e400", "nan", "-1", "--context=-inf"):
        args = [bad] if bad.startswith("--") else ["--context", bad]
        done = subprocess.run([sys.executable, str(repo / "bench" / "cost_model.py"), *args, str(tmp_path / "absent.json")],
                              capture_output=True, text=True, cwd=repo)
        assert done.returncode == 2 and "expected a number of keys ≥ 0 and ≤ 1e+09" in done.stderr, (bad, done.stderr)
        assert len(done.stderr.strip().splitlines()) == 2, done.stderr  # usage + the error
