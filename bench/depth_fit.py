#!/usr/bin/env python3
"""The full-depth rank's cost from short depths of the same engine form: fitted, carried to 61 layers, checked.

Runs the rank of bench/full_depth_rank.py (rank 0 of a TP-N Kimi-K2.5 target at the published shapes, routed experts
INT4, the rest bf16, random weights; fake peers; both draft placements) at a few short depths (``--fit-layers 2,8,16``:
the first layer dense, the rest MoE, as in Kimi; two depths as short as 2 and 8 overstate the batch-16 verify's
per-layer cost at 61, docs/lab/2026-12-03-h200-b16-depth-old-new), then fits each (batch, k, placement)'s rank cycle, verify and draft
ms along depth (``splitspec.measure.cost_model.fit_depth``):

    ms(layers) = fixed + per_moe_layer · (layers − 1)      fixed: the dense first layer, embedding, lm_head, drafter, host

(the draft phase flat: the drafter's work does not depend on the target's depth) and carries it to ``--layers`` (61). With ``--measured`` (a ``full_depth_rank.json`` measured at that depth) it reports
the error per row and its mean / largest by batch for: this fit (rank alone; the full cycle with the measured file's
collectives), the cost model's feature form (``fit_cycle_model``, the same rows, all (batch, k) at once) and
``KimiScale.from_depth_fit`` (the fit with KimiScale's own collectives, what the tuner's model uses).

Order: at every depth first the verifies the fused decode kernels take (up to ``MAX_TOKENS`` tokens: one engine load
per depth), then the larger ones (the grouped INT4 path: a compilation per chunk count, the slowest rows to start),
depth after depth, each depth starting rows until an equal share of what is left of ``--budget-s`` and only those that
every earlier depth has (a row at one depth fits nothing).

    export PYTHONPATH=$PWD/src
    python3 bench/depth_fit.py --fit-layers 2,8,16 --tp 8 --batches 1,4,16 --ks 0-5 --cycles 32 --budget-s 350 \\
        --measured results/full-depth/full_depth_rank.json --out results/depth-fit
    python3 bench/depth_fit.py --from results/depth-fit/depth_fit.json --measured results/full-depth/full_depth_rank.json
    python3 bench/depth_fit.py --dry-run --fit-layers 2,3 --batches 1 --ks 0,1 --out /tmp/df   # CPU check, tiny shapes

Writes OUT/depth_fit.json (after every row) and OUT/depth_fit.md (the printed report).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from pathlib import Path

import numpy as np

import full_depth_rank as fdr
from rank_args import check_rank, parse_grid
from lab import NO_NVLINK_MULTICAST
from splitspec.errors import CheckpointError
from splitspec.files import read_json, write_atomic, write_json
from splitspec.measure.cost_model import DEPTH_QUANTITIES, INT4_G32_BYTES, KimiScale, fit_cycle_model, fit_depth

WITHIN = 0.10  # the bound on a model's error this checks (the full-depth issue's)
KIMI = "KimiScale.from_depth_fit, its own collectives"


def key(r: dict) -> tuple:
    """(batch, k, draft_tp) of a row, draft_tp None at k = 0 (no drafter: one row serves both placements)."""
    return r["batch"], r["k"], r["draft_tp"] if r["k"] else None


def flat_rows(res: dict) -> list[dict]:
    """Every depth's rows, each with its ``layers``."""
    return [{"layers": d["layers"]} | r for d in res["depths"] for r in d["rows"]]


# ------------------------------------------------------------------ measuring (one GPU, or the CPU with --dry-run)

def measure(a, res: dict, save) -> None:
    """Append rows to each ``res["depths"][i]["rows"]`` (``fdr.measure_rows``, one engine load per depth and phase) in
    the order of the module docstring; past ``a.budget_s`` no engine is loaded."""
    def run(i: int, budget_s: float, only) -> None:
        if time.monotonic() - fdr.START < budget_s:
            sub = argparse.Namespace(**(vars(a) | {"layers": res["depths"][i]["layers"], "budget_s": budget_s}))
            fdr.measure_rows(sub, res["depths"][i], save, only=only)

    for i in range(len(res["depths"])):
        run(i, a.budget_s, lambda t: fdr.fused(t[0], t[1]))
    for i in range(len(res["depths"])):
        now = time.monotonic() - fdr.START
        earlier = [{key(r) for r in e["rows"]} for e in res["depths"][:i]]
        run(i, now + max(0.0, a.budget_s - now) / (len(res["depths"]) - i),
            lambda t, earlier=earlier: not fdr.fused(t[0], t[1]) and all(t in e for e in earlier))


def not_measured(a, res: dict) -> dict:
    """Per depth (str), the (batch, k, draft_tp) of the grid not measured there."""
    return {str(d["layers"]): fdr.todo(a, d["rows"]) for d in res["depths"]}


# ------------------------------------------------------------------ the fit against the full-depth measurement (pure)

def at_depth(line: dict, layers: int) -> float:
    """A fitted line (``fit_depth``'s {"fixed_ms", "per_moe_layer_ms"}) at ``layers``."""
    return line["fixed_ms"] + line["per_moe_layer_ms"] * (layers - 1)


def feature_form(rows: list[dict], layers: int) -> dict:
    """The cost model's feature form (``fit_cycle_model``: fixed, per sequence, per verified token, draft terms, per MoE
    layer, per MoE layer and distinct expert, per MoE layer and verified token) fitted per placement on the fused-kernel
    rows of ``rows`` (every depth; the k = 0 rows in each placement's; the grouped path's cost is no smooth function of
    the tokens), carried to ``layers``: {key: rank cycle ms} for those rows' keys (k = 0 from the first placement's
    fit); {} for fewer than 2 rows."""
    placements = sorted({r["draft_tp"] for r in rows if r["k"]}) or [None]
    out = {}
    for dtp in placements:
        rs = [r | {"moe_layers": r["layers"] - 1} for r in rows if r["draft_tp"] in (dtp, None) and fdr.fused(r["batch"], r["k"])]
        if len(rs) < 2:
            continue
        fit = fit_cycle_model(rs)
        for r in rs:
            if r["k"] or dtp == placements[0]:
                out[key(r)] = fit.predict(r["batch"], r["k"], layers - 1)
    return out


def pair(predicted: float, measured: float, error: bool = True) -> dict:
    return {"predicted": predicted, "measured": measured, "error": (predicted - measured) / measured if error else None}


def compare(fit: list[dict], measured: dict, features: dict | None = None) -> list[dict]:
    """Each row of ``measured`` (a full_depth_rank.py result at ``measured["layers"]``) that ``fit`` has, against the fit
    there: :data:`DEPTH_QUANTITIES` as {"predicted", "measured", "error" = (predicted − measured) / measured} (the draft's
    error None at k = 0: nothing drafted), ``full_cycle_ms`` (the predicted rank cycle plus the collectives the measured
    file added to that row) and ``feature_cycle_ms`` from ``features`` (:func:`feature_form`) where it has the row."""
    L, by = measured["layers"], {key(f): f for f in fit}
    full = {}
    for r in measured.get("full", []):
        full.setdefault(key(r), r)  # a k = 0 row stands under every placement, with the same collectives
    out = []
    for m in measured["rows"]:
        f = by.get(key(m))
        if f is None:
            continue
        c = {"draft_tp": m["draft_tp"], "batch": m["batch"], "k": m["k"], "depths": f["depths"],
             "verify_per_moe_layer_ms": f["verify_ms"]["per_moe_layer_ms"], "verify_fixed_ms": f["verify_ms"]["fixed_ms"]}
        c |= {q: pair(at_depth(f[q], L), m[q], q != "draft_ms" or m["k"] > 0) for q in DEPTH_QUANTITIES}
        comm = full[key(m)]["full_cycle_ms"] - full[key(m)]["rank_cycle_ms"] if key(m) in full else None
        if comm is not None:
            c["full_cycle_ms"] = pair(c["cycle_ms"]["predicted"] + comm, m["cycle_ms"] + comm)
        if features and key(m) in features:
            c["feature_cycle_ms"] = pair(features[key(m)], m["cycle_ms"])
            if comm is not None:
                c["feature_full_cycle_ms"] = pair(features[key(m)] + comm, m["cycle_ms"] + comm)
        out.append(c)
    return out


def kimi_errors(fit: list[dict], measured: dict, tp: int) -> list[dict]:
    """``KimiScale.from_depth_fit(fit)`` (INT4 expert bytes, KimiScale's 2 × H200 all-reduce figures) against the measured
    full cycle and verify with collectives (``fdr.model_errors``), on the rows the fit has."""
    have = {key(f) for f in fit}
    full = [r for r in measured.get("full", []) if key(r) in have]
    model = KimiScale.from_depth_fit(fit, tp=tp, routed_expert_weight_bytes=INT4_G32_BYTES)
    return fdr.model_errors(full, {KIMI: model}, tp, measured["layers"])


def stat(errors: list) -> dict | None:
    """Mean and largest (by magnitude, signed) of the errors that are not None; None without any."""
    e = [x for x in errors if x is not None]
    return {"mean": float(np.mean(e)), "largest": float(max(e, key=abs)), "rows": len(e)} if e else None


def summary(cmp: list[dict], kimi: list[dict], depths: list[int]) -> list[dict]:
    """Per model and batch: ``stat`` of each error column and ``within``: rows whose cycle and verify errors (those the
    model has) are all within :data:`WITHIN`."""
    err = lambda c, q: c[q]["error"] if q in c else None  # noqa: E731
    ok = lambda *es: all(abs(e) <= WITHIN for e in es if e is not None)  # noqa: E731
    out = []
    for B in sorted({c["batch"] for c in cmp}):
        cs, ks = [c for c in cmp if c["batch"] == B], [e for e in kimi if e["batch"] == B]
        out.append({"model": f"depth fit ({', '.join(map(str, depths))} layers), rank alone", "batch": B, "rows": len(cs),
                    "cycle": stat([err(c, "cycle_ms") for c in cs]), "verify": stat([err(c, "verify_ms") for c in cs]),
                    "draft": stat([err(c, "draft_ms") for c in cs]), "full_cycle": stat([err(c, "full_cycle_ms") for c in cs]),
                    "within": sum(ok(err(c, "cycle_ms"), err(c, "verify_ms")) for c in cs)})
        fs = [c for c in cs if "feature_cycle_ms" in c]
        if fs:
            out.append({"model": "feature form (fit_cycle_model), the same fused-kernel rows", "batch": B, "rows": len(fs),
                        "cycle": stat([err(c, "feature_cycle_ms") for c in fs]), "verify": None, "draft": None,
                        "full_cycle": stat([err(c, "feature_full_cycle_ms") for c in fs]),
                        "within": sum(ok(err(c, "feature_cycle_ms")) for c in fs)})
        if ks:
            out.append({"model": KIMI + " (verify: with them)", "batch": B, "rows": len(ks), "cycle": None,
                        "verify": stat([e["verify_error"] for e in ks]), "draft": None,
                        "full_cycle": stat([e["cycle_error"] for e in ks]),
                        "within": sum(ok(e["cycle_error"], e["verify_error"]) for e in ks)})
    return out


def report(res: dict) -> str:
    """Markdown: the fitted lines, and with a measurement the rows against it and the errors by batch."""
    tp, L, depths = res["tp"], res["target_layers"], [d["layers"] for d in res["depths"]]
    name = lambda dtp: fdr.placement_name(dtp, tp) if dtp else "no drafter"  # noqa: E731
    at = "/".join(map(str, depths))
    lines = [f"# One rank of TP{tp}: fitted at {at} layers, carried to {L} ({res['label']})", "",
             "Per (batch, k, placement): rank ms = fixed + per MoE layer × (layers − 1) (fixed: the dense first layer, "
             "embedding, lm_head, drafter, host): the verify by least squares over the depths, the draft phase flat (its "
             "mean), the cycle the line of its part besides the draft plus that mean.", "",
             f"| placement | batch | k | rank cycle ms at {at} layers | verify ms per MoE layer | verify fixed ms | "
             f"at {L} layers: cycle / verify / draft ms | largest residual |", "|---|---|---|---|---|---|---|---|"]
    rows = flat_rows(res)
    for f in res["fit"]:
        cyc = " / ".join(f"{r['cycle_ms']:.2f}" for r in sorted((r for r in rows if key(r) == key(f)), key=lambda r: r["layers"]))
        pred = " / ".join(f"{at_depth(f[q], L):.2f}" for q in ("cycle_ms", "verify_ms", "draft_ms"))
        lines.append(f"| {name(f['draft_tp'])} | {f['batch']} | {f['k']} | {cyc} | {f['verify_ms']['per_moe_layer_ms']:.3f} | "
                     f"{f['verify_ms']['fixed_ms']:.2f} | {pred} | {max(f[q]['max_residual'] for q in DEPTH_QUANTITIES):.1%} |")
    if "comparison" in res:
        cell = lambda p: f"{p['predicted']:.2f} / {p['measured']:.2f} / {p['error']:+.1%}" if p and p["error"] is not None else "—"  # noqa: E731
        lines += ["", f"Against the measured {L} layers ({res['measured']['path']}), error = (predicted − measured) / measured:", "",
                  "| placement | batch | k | rank cycle: predicted / measured / error | verify | draft | full cycle | "
                  "feature form: rank cycle |", "|---|---|---|---|---|---|---|---|"]
        lines += [f"| {name(c['draft_tp'])} | {c['batch']} | {c['k']} | {cell(c['cycle_ms'])} | {cell(c['verify_ms'])} | "
                  f"{cell(c['draft_ms'])} | {cell(c.get('full_cycle_ms'))} | {cell(c.get('feature_cycle_ms'))} |"
                  for c in res["comparison"]]
        st = lambda s: f"{s['mean']:+.1%} / {s['largest']:+.1%}" if s else "—"  # noqa: E731
        lines += ["", f"By batch, error mean / largest (full cycle: with the collectives; within {WITHIN:.0%}: rows whose "
                  "cycle and verify errors both are):", "",
                  "| model | batch | rows | rank cycle | verify | draft (k > 0) | full cycle | within |", "|---|---|---|---|---|---|---|---|"]
        lines += [f"| {s['model']} | {s['batch']} | {s['rows']} | {st(s['cycle'])} | {st(s['verify'])} | {st(s['draft'])} | "
                  f"{st(s['full_cycle'])} | {s['within']}/{s['rows']} |" for s in res["summary"]]
        have, fitted = {key(r) for r in res["measured"]["rows"]}, {key(f) for f in res["fit"]}
        if have - fitted:
            lines += ["", f"Measured at {L} layers, not fitted (not measured at every fit depth): {sorted(have - fitted, key=str)}"]
    gaps = {L_: v for L_, v in res.get("not_measured", {}).items() if v}
    if gaps:
        lines += ["", f"Not measured (past --budget-s, or not at an earlier depth), by depth: {gaps}"]
    return "\n".join(lines) + "\n"


def analyse(res: dict, measured: dict | None, path: Path | None) -> None:
    """``res["fit"]`` from its rows and, with a ``measured`` full_depth_rank.py result (from ``path``), the comparison,
    KimiScale's errors and the summary."""
    rows = flat_rows(res)
    res["fit"] = fit_depth(rows)
    res["target_layers"] = measured["layers"] if measured else res["target_layers"]
    if measured:
        cmp = compare(res["fit"], measured, feature_form(rows, measured["layers"]))
        kimi = kimi_errors(res["fit"], measured, res["tp"]) if res["fit"] else []
        res |= {"measured": {"path": str(path), "layers": measured["layers"], "rows": [
            {q: r[q] for q in ("draft_tp", "batch", "k")} for r in measured["rows"]]},
                "comparison": cmp, "kimi_errors": kimi, "summary": summary(cmp, kimi, [d["layers"] for d in res["depths"]])}


def load(ap: argparse.ArgumentParser, path: Path, what: str, keys: tuple, row_keys: tuple = ()) -> dict:
    """A JSON result with ``keys`` whose ``rows`` (if ``row_keys``) are a list each holding ``row_keys``, or
    ``ap.error`` with one line naming the file and what was expected."""
    try:
        d = read_json(path, what)
        missing = [k for k in keys if k not in d]
        if missing:
            raise CheckpointError(f"{path}: no {', '.join(missing)} (expected {what})")
        if not isinstance(d.get("rows", []), list):
            raise CheckpointError(f"{path}: 'rows' = {d['rows']!r:.60}, expected a list (expected {what})")
        bad = next((i for i, r in enumerate(d.get("rows", [])) if row_keys and not (isinstance(r, dict) and set(row_keys) <= r.keys())), None)
        if bad is not None:
            raise CheckpointError(f"{path}: rows[{bad}] lacks one of {', '.join(row_keys)} (expected {what})")
        return d
    except CheckpointError as e:
        ap.error(str(e))


def main(argv: list[str] | None = None) -> int:
    fdr.START = time.monotonic()  # --budget-s counts from here (a caller's process may be old)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--fit-layers", default="2,8,16", help="comma list of the short depths measured (≥ 2 of them, each ≥ 2)")
    ap.add_argument("--layers", type=int, default=61, help="depth predicted (without --measured; with it, the file's)")
    ap.add_argument("--tp", type=int, default=8, help="the target's TP size; rank 0 runs here")
    ap.add_argument("--batches", default="1,4,16", help="comma list of batch sizes")
    ap.add_argument("--ks", default="0-5", help="draft lengths: a comma list or a range A-B (0 must be among them)")
    ap.add_argument("--cycles", type=int, default=16, help="steady cycles timed per row")
    ap.add_argument("--max-seq-len", type=int, default=512, help="the engine's max_seq_len (KV: max batch × this)")
    ap.add_argument("--budget-s", type=float, default=300, help="start no row after this many seconds of the script")
    ap.add_argument("--measured", type=Path, help="a bench/full_depth_rank.py result to check the prediction against")
    ap.add_argument("--from", dest="source", type=Path, help="an earlier OUT/depth_fit.json: report it, measure nothing")
    ap.add_argument("--resume", action="store_true", help="keep the rows of OUT/depth_fit.json (same --tp) and measure "
                    "only the missing ones")
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes: checks the script, measures nothing useful")
    ap.add_argument("--out", type=Path, default=Path("bench/results/depth_fit"), help="results folder")
    a = parse_grid(ap, ap.parse_args(argv))
    try:
        a.fit_layers = sorted({int(x) for x in a.fit_layers.split(",")})
    except ValueError:
        ap.error(f"--fit-layers {a.fit_layers!r}: expected integers, like 2,4")
    if len(a.fit_layers) < 2 or a.fit_layers[0] < 2:
        ap.error(f"--fit-layers {a.fit_layers}: expected two or more depths, each ≥ 2 (one dense layer, then MoE)")
    check_rank(ap, a, fdr.PROMPT_TOKENS)
    measured = load(ap, a.measured, "a bench/full_depth_rank.py result", ("layers", "tp", "rows", "full"),
                    ("draft_tp", "batch", "k", *DEPTH_QUANTITIES)) if a.measured else None
    if measured and measured["tp"] != a.tp:
        ap.error(f"--measured {a.measured}: TP{measured['tp']}, but --tp {a.tp}")
    if a.source:  # report an earlier run: no engine, no GPU
        res = load(ap, a.source, "a bench/depth_fit.py result", ("tp", "depths", "label", "target_layers"))
        try:
            analyse(res, measured, a.measured)
        except (KeyError, TypeError, ValueError) as e:
            ap.error(f"--from {a.source}: not a bench/depth_fit.py result ({type(e).__name__}: {e})")
        text = report(res)
        print(text, flush=True)
        a.out.mkdir(parents=True, exist_ok=True)
        write_json(res, a.out / "depth_fit.json")
        write_atomic(a.out / "depth_fit.md", text)
        return 0
    os.environ.update(NO_NVLINK_MULTICAST)
    from splitspec.measure.machine import machine_info

    res = {"label": fdr.LABEL, "tp": a.tp, "fit_layers": a.fit_layers, "target_layers": a.layers, "dry_run": a.dry_run,
           "argv": sys.argv[1:] if argv is None else argv, "machine": machine_info(),
           "depths": [{"layers": L, "rows": [], "skipped": []} for L in a.fit_layers]}
    earlier = a.out / "depth_fit.json"
    if a.resume and earlier.exists():
        old = load(ap, earlier, "a bench/depth_fit.py result", ("tp", "depths", "dry_run"))
        if (old["tp"], old["dry_run"]) != (a.tp, a.dry_run):
            ap.error(f"--resume: {earlier} holds TP{old['tp']}, dry run {old['dry_run']}")
        for d in res["depths"]:
            d["rows"] = [r for o in old["depths"] if o.get("layers") == d["layers"] for r in o.get("rows", [])
                         if r.get("batch") in a.batches and r.get("k") in a.ks]
        print(f"{fdr.elapsed()} resuming: {sum(len(d['rows']) for d in res['depths'])} rows of {earlier} kept", flush=True)
    a.out.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        res["not_measured"] = not_measured(a, res)
        res["elapsed_s"] = round(time.monotonic() - fdr.START, 1)
        write_json(res, a.out / "depth_fit.json")

    try:
        measure(a, res, save)
    except Exception as e:  # keep what was measured; the report says what stopped it
        res["error"] = f"{type(e).__name__}: {e}"
        res["trace"] = traceback.format_exc()[-3000:]
        print(res["trace"], flush=True)
    analyse(res, measured, a.measured)
    save()
    text = report(res) + (f"\nStopped: {res['error']}\n" if "error" in res else "")
    print(text, flush=True)
    write_atomic(a.out / "depth_fit.md", text)
    print(f"{fdr.elapsed()} done → {a.out / 'depth_fit.json'}", flush=True)
    return 1 if "error" in res or not res["fit"] else 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)  # leftover compile workers must not hold the process open
