"""bench/fp8_bench.py: its dry run (CPU, Triton's interpreter, toy shapes) goes through both sections, checks every
variant against the dequantised weights and prints the lines to paste; bad arguments are refused."""

from __future__ import annotations

import json
import os

import pytest

import fp8_bench

pytest.importorskip("triton")


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the dry run needs Triton's interpreter")
def test_dry_run_times_and_checks_every_variant(tmp_path, capsys):
    assert fp8_bench.main(["--dry-run", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "fp8_bench.json").read_text())
    moe, lin = res["moe"], res["linear"]
    assert len(moe["sweep"]) == 4 and all(isinstance(r[k], float) for r in moe["sweep"] for k in r if k.startswith("ms_"))
    assert [(r["tp"], r["tokens"]) for r in moe["rows"]] == [(1, 1)]
    for r in moe["rows"]:
        assert all(isinstance(r[k], float) for k in ("bf16_ms", "fp8_default_ms", "fp8_chosen_ms"))
        # bf16 output (the interpreter truncates: one ulp, 2⁻⁷) plus the dot modes' f16 rounding of the activations;
        # the w8a8 mode rounds them to e4m3 (2⁻⁴ each)
        w8a8 = any(c[4:5] == [4] for c in r["chosen"].values())
        assert r["chosen_err_vs_dequant"] < (2 ** -3 if w8a8 else 2 ** -7 + 2 ** -9)
    assert moe["paste"][0].startswith("FP8_CONFIGS = {('many', 'narrow'): ((")
    assert [(r["shape"], r["tokens"]) for r in lin["rows"]] == [(n, t) for n in ("fused_qkv_a", "q_b", "mlp_w2") for t in (1, 20)]
    for r in lin["rows"]:
        assert set(r["ms"]) == set(r["err"]) and {"dequant", "engine"} <= set(r["ms"]) and r["best_triton"]
        assert all(isinstance(v, float) for v in r["ms"].values()), r["ms"]
        assert all(v < 2 ** -7 + 2 ** -9 for v in r["err"].values()), r["err"]
    assert lin["paste"] == f"LINEAR_CONFIGS = {{1: {lin['chosen']['1'][6:]}, 1 << 20: (2, 32, 64, 128, 0, 1, 1)}}"
    out = capsys.readouterr().out
    assert "paste into models/fused_moe.py" in out and "paste into models/fp8_linear.py" in out


@pytest.mark.parametrize("bad,says", [(["--sections", "moe,gemm"], "--sections"), (["--moe-tp", "one"], "comma lists")])
def test_bad_arguments_are_refused(bad, says, capsys):
    with pytest.raises(SystemExit) as e:
        fp8_bench.main(bad)
    assert e.value.code == 2 and says in capsys.readouterr().err
