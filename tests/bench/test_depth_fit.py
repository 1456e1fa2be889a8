"""bench/depth_fit.py: the short-depth fit carried to full depth against a canned measurement, the order and time
shares of its measuring (a stub in place of the engine), and the whole script on the CPU with tiny shapes (--dry-run)."""

from __future__ import annotations

import json
import re
import time

import pytest

import cost_model
import depth_fit as df
import full_depth_rank as fdr

FLAT = [(1e3, 10.0), (3e3, 10.0)]  # every collective 10 µs
DIMS = {"hidden": 4, "vocab": 8, "draft_vocab": 4}
# (batch, k, draft_tp) → rank cycle ms = c0 + c1 · (layers − 1), its draft d0 whatever the depth
LINES = {(1, 0, None): (2.0, 0.17, 0.05), (1, 2, 1): (5.0, 0.20, 2.0), (1, 2, 8): (4.0, 0.20, 1.0), (4, 0, None): (2.5, 0.26, 0.07)}


def row(B, k, dtp, L, factor=1.0):
    c0, c1, d0 = LINES[B, k, dtp]
    cycle = c0 + c1 * (L - 1)
    return {"draft_tp": dtp, "batch": B, "k": k, "cycle_ms": cycle / factor, "draft_ms": d0 / factor,
            "verify_ms": (cycle - d0 - 0.2) / factor}


def measured_at(L: int, factors: dict) -> dict:
    """A full_depth_rank.py result at L layers whose rows are the lines' values / factor (error = factor − 1)."""
    rows = [row(*bk, L, f) for bk, f in factors.items()]
    return {"layers": L, "tp": 8, "rows": rows, "full": fdr.full_depth(rows, FLAT, 8, L, DIMS)}


def test_short_depths_carried_to_61_layers_against_a_canned_measurement(tmp_path, capsys):
    res = {"label": "canned", "tp": 8, "target_layers": 61,
           "depths": [{"layers": L, "rows": [row(*bk, L) for bk in LINES]} for L in (2, 4)]}
    meas = measured_at(61, {(1, 0, None): 1.0, (1, 2, 1): 1.25, (1, 2, 8): 0.95})
    meas["rows"].append({"draft_tp": 1, "batch": 4, "k": 1, "cycle_ms": 30.0, "draft_ms": 2.0, "verify_ms": 27.0})
    df.analyse(res, meas, "m.json")
    assert [(c["batch"], c["k"], c["draft_tp"]) for c in res["comparison"]] == [(1, 0, None), (1, 2, 1), (1, 2, 8)]
    c = {df.key(x): x for x in res["comparison"]}
    assert c[1, 2, 1]["cycle_ms"]["predicted"] == pytest.approx(5.0 + 0.2 * 60)
    assert [x["cycle_ms"]["error"] for x in res["comparison"]] == pytest.approx([0.0, 0.25, -0.05])
    assert c[1, 2, 1]["verify_ms"]["error"] == pytest.approx(0.25) and c[1, 0, None]["draft_ms"]["error"] is None
    assert c[1, 2, 1]["verify_per_moe_layer_ms"] == pytest.approx(0.2) and c[1, 2, 1]["depths"] == [2, 4]
    full = {df.key(r): r for r in meas["full"]}[1, 2, 1]  # the measured file's collectives added to the prediction
    assert c[1, 2, 1]["full_cycle_ms"]["predicted"] == pytest.approx(17.0 + full["full_cycle_ms"] - full["rank_cycle_ms"])
    assert c[1, 2, 1]["full_cycle_ms"]["measured"] == pytest.approx(full["full_cycle_ms"])
    assert all("feature_cycle_ms" in x for x in res["comparison"])
    s = {x["model"].split(" (")[0]: x for x in res["summary"] if x["batch"] == 1}
    fit = s["depth fit"]
    assert fit["rows"] == 3 and fit["within"] == 2 and fit["cycle"]["mean"] == pytest.approx(0.2 / 3)
    assert fit["cycle"]["largest"] == pytest.approx(0.25) and fit["draft"]["rows"] == 2
    kimi = s[df.KIMI]
    assert kimi["rows"] == 3 and len(res["kimi_errors"]) == 3 and kimi["verify"] is not None and kimi["cycle"] is None
    text = df.report(res)
    assert "| split (drafter TP1) | 1 | 2 | 5.20 / 5.60 | 0.200 | 2.80 | 17.00 / 14.80 / 2.00 | 0.0% |" in text
    assert "| split (drafter TP1) | 1 | 2 | 17.00 / 13.60 / +25.0% |" in text
    assert "| depth fit (2, 4 layers), rank alone | 1 | 3 | +6.7% / +25.0% | +6.7% / +25.0% |" in text
    assert "not fitted (not measured at every fit depth): [(4, 1, 1)]" in text
    # bench/cost_model.py's full-depth model from the fit: at 61 layers + 2·61 + 1 all-reduces of 13 µs + T·14336 B /
    # 150 GB/s (and 3 per sharded draft step); k = 2 accepts 1 + 0.9 + 0.9·0.85 tokens per cycle
    path = tmp_path / "depth_fit.json"
    path.write_text(json.dumps(res | {"machine": {"gpus": ["canned"]}}))
    cost_model.main([str(path)])
    assert "| 1 | 13.56 | 72 | k=2: 143 (×1.98) | k=2: 150 (×2.08) |" in capsys.readouterr().out
    path.write_text(json.dumps(res | {"fit": []}))
    with pytest.raises(SystemExit, match="no row fitted"):
        cost_model.main([str(path)])


def test_measuring_order_fused_rows_first_then_the_rest_in_shares_of_the_budget(monkeypatch):
    """Every depth's fused-kernel rows first, then the grouped path's depth after depth: the first depth until half
    the budget left, the next only the rows the first got (a stub measures, and at depth 2 gets one large row only)."""
    calls = []

    def stub(a, d, save, only):
        todo = [t for t in fdr.todo(a, d["rows"]) if only(t)]
        calls.append((a.layers, a.budget_s, todo))
        for B, k, dtp in todo[:1] if a.layers == 2 and not fdr.fused(*todo[0][:2]) else todo:
            d["rows"].append({"batch": B, "k": k, "draft_tp": dtp})

    monkeypatch.setattr(fdr, "measure_rows", stub)
    monkeypatch.setattr(fdr, "START", time.monotonic() - 100)  # 100 s into the script
    a = fdr.parse_grid(None, type("A", (), {"ks": "0,4", "batches": "1,4"})())
    a.tp, a.budget_s = 8, 300
    res = {"depths": [{"layers": L, "rows": []} for L in (2, 4)]}
    df.measure(a, res, lambda: None)
    small = [(1, 0, None), (1, 4, 1), (1, 4, 8), (4, 0, None)]
    assert [(L, t) for L, _, t in calls] == [(2, small), (4, small), (2, [(4, 4, 1), (4, 4, 8)]), (4, [(4, 4, 1)])]
    assert [b for _, b, _ in calls[:2]] == [300, 300]
    assert calls[2][1] == pytest.approx(200, abs=2) and calls[3][1] == pytest.approx(300, abs=2)
    assert df.not_measured(a, res) == {"2": [(4, 4, 8)], "4": [(4, 4, 8)]}
    calls.clear()
    a.budget_s = 90  # past the budget: no engine loaded at all
    df.measure(a, {"depths": [{"layers": L, "rows": []} for L in (2, 4)]}, lambda: None)
    assert calls == []


def test_dry_run_fits_two_depths_and_reports_against_a_measurement(tmp_path, capsys):
    """The whole script on the CPU (tiny TP8 INT4 engine, rank 0 alone) at 2 and 3 layers, checked against a canned
    5-layer file; --from re-reports the result, --resume keeps its rows; bad arguments are refused before any load."""
    meas = tmp_path / "m.json"
    meas.write_text(json.dumps(measured_at(5, {(1, 0, None): 1.0})))
    out, args = tmp_path / "df", ["--dry-run", "--fit-layers", "3,2", "--batches", "1", "--ks", "0", "--cycles", "1"]
    assert df.main(args + ["--measured", str(meas), "--out", str(out)]) == 0
    res = json.loads((out / "depth_fit.json").read_text())
    assert [(d["layers"], len(d["rows"])) for d in res["depths"]] == [(2, 1), (3, 1)] and res["not_measured"] == {"2": [], "3": []}
    assert [f["depths"] for f in res["fit"]] == [[2, 3]] and res["target_layers"] == 5 and len(res["comparison"]) == 1
    assert "Against the measured 5 layers" in (out / "depth_fit.md").read_text()
    assert df.main(["--from", str(out / "depth_fit.json"), "--out", str(tmp_path / "again")]) == 0
    assert json.loads((tmp_path / "again" / "depth_fit.json").read_text())["fit"] == res["fit"]
    capsys.readouterr()
    assert df.main(args + ["--resume", "--out", str(out)]) == 0
    assert "resuming: 2 rows" in capsys.readouterr().out
    assert json.loads((out / "depth_fit.json").read_text())["depths"] == res["depths"]
    (tmp_path / "tp4.json").write_text(json.dumps(measured_at(5, {(1, 0, None): 1.0}) | {"tp": 4}))
    for bad, says in ((["--fit-layers", "2"], "two or more depths"), (["--fit-layers", "1,2"], "each ≥ 2"),
                      (["--fit-layers", "2,x"], "expected integers"), (["--measured", str(tmp_path / "tp4.json")], "TP4"),
                      (["--resume", "--tp", "4"], "holds TP8"), (["--out", str(meas)], "a file"),
                      (["--cycles", "0"], "--cycles 0: expected ≥ 1"), (["--layers", "1"], "--layers 1: expected ≥ 2")):
        with pytest.raises(SystemExit):
            df.main(args + ["--out", str(out)] + bad)
        assert says in capsys.readouterr().err
    (tmp_path / "rows.json").write_text(json.dumps(measured_at(5, {(1, 0, None): 1.0}) | {"rows": [{"batch": 1}]}))
    (tmp_path / "rows5.json").write_text(json.dumps(measured_at(5, {(1, 0, None): 1.0}) | {"rows": 5}))
    for bad, says in ((["--measured", str(tmp_path / "none.json")], "file not found"), (["--from", str(meas)], "no depths"),
                      (["--measured", str(tmp_path / "rows5.json")], "'rows' = 5, expected a list"),
                      (["--measured", str(tmp_path / "rows.json")], r"rows\[0\] lacks one of draft_tp")):
        with pytest.raises(SystemExit) as e:
            df.main(args + bad)
        assert e.value.code == 2 and re.search(says, capsys.readouterr().err)
