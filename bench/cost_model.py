#!/usr/bin/env python3
"""Fit the cycle cost model to GPU measurements, compare layers with their bounds, and extrapolate to
Kimi-K2 (61 layers, TP8); prints markdown (the tables of docs/performance.md).

    .venv/bin/python bench/cost_model.py docs/lab/2026-11-30-grouped-gemm-engine/h200x2-2026-11-30-eager.json docs/lab/2026-11-30-grouped-gemm-engine/h200x2-2026-11-30-compiled.json
    .venv/bin/python bench/cost_model.py docs/lab/2026-11-30-tuner-grouped-gemm/h200x2-2026-11-30-tune-interleaved.json   # the tuner's score
    .venv/bin/python bench/cost_model.py --png results/ docs/lab/2026-12-01-h200-tp1-cost-model-tuner/h200-2026-12-01-tp1-compiled-sweep-loads4.json   # + plots

    .venv/bin/python bench/cost_model.py results/depth-fit/depth_fit.json   # the full-depth model of a bench/depth_fit.py fit
    .venv/bin/python bench/cost_model.py --context 4096 docs/lab/2026-11-30-fused-moe-kernels/h200x2-2026-11-30-fused-moe.json

Each file is a ``bench/gpu_bench.py`` result. Engine sweeps are fitted per (target TP, draft placement),
over every depth the file holds; the per-layer rows give the bound comparison and calibrate the
full-depth model (overhead + bytes / (bandwidth · efficiency), fitted at the TP8 shard shape). A
``bench/depth_fit.py`` result instead calibrates it with the full-depth rank's own form fitted at short depths
(``KimiScale.from_depth_fit``). ``--context N`` also gives the bytes model's best k by batch with each sequence's
N cached keys read per layer (``KimiScale.context_tokens``); the depth-fit model takes none.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
from pathlib import Path

from splitspec.files import write_png
from splitspec.measure.cost_model import (FEATURES, INT4_G32_BYTES, LATENT_BLOCK_M, MLA_LATENT_ROW_BYTES, KimiScale, best_k,
                                         expected_acceptance_length, fit_cycle_model, fit_layer_costs)
from splitspec.build.synthetic import KIMI_DRAFTER_PROFILE


def sweep_rows(d: dict) -> list[dict]:
    """Engine rows of a result file, one per (tp, depth, placement, B, k) (the first wins)."""
    seen, out = set(), []
    for r in d.get("partial_rows", []):
        key = (r["tp"], r["moe_layers"], r["draft_tp"], r["batch"], r["k"])
        if key not in seen:
            seen.add(key)
            out.append(r)
    return out


def plot_fit(rows: list[dict], fit, title: str, path: Path) -> Path:
    """Cycle ms and tokens/s against k, one column per batch: measured rows as points, the fitted model as
    lines, one colour per depth. Both tokens/s use the rows' acceptance length pooled over k (batch × it /
    cycle ms), so the points differ from the lines by the cycle model's error only."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches, depths = sorted({r["batch"] for r in rows}), sorted({r["moe_layers"] for r in rows})
    fig, axes = plt.subplots(2, len(batches), figsize=(max(4.2 * len(batches), 9), 7), squeeze=False)
    for col, B in enumerate(batches):
        for i, L in enumerate(depths):
            rs = sorted((r for r in rows if r["batch"] == B and r["moe_layers"] == L), key=lambda r: r["k"])
            ks, colour = [r["k"] for r in rs], f"C{i}"
            model = [fit.predict(B, k, L) for k in ks]
            axes[0][col].plot(ks, [r["cycle_ms"] for r in rs], "o", color=colour, label=f"{L} MoE layers, measured")
            axes[0][col].plot(ks, model, "-", color=colour, label=f"{L} MoE layers, model")
            accept = [r.get("expected_acceptance_length", r["acceptance_length"]) for r in rs]  # pooled over k where known
            axes[1][col].plot(ks, [B * al / r["cycle_ms"] * 1e3 for al, r in zip(accept, rs)], "o", color=colour)
            axes[1][col].plot(ks, [B * al / m * 1e3 for al, m in zip(accept, model)], "-", color=colour)
        axes[0][col].set_title(f"batch {B}")
        axes[0][col].set_ylabel("cycle ms")
        axes[1][col].set_ylabel("tokens/s (aggregate, acceptance pooled over k)")
        axes[1][col].set_xlabel("draft tokens k")
        for ax in (axes[0][col], axes[1][col]):
            ax.xaxis.get_major_locator().set_params(integer=True)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return write_png(fig, path)


def fit_report(name: str, rows: list[dict], png: Path | None = None) -> None:
    """Fit the cycle model per (target TP, placement) of ``rows`` and print measured against modelled; with
    ``png`` (a folder), also plot each fit there (:func:`plot_fit`)."""
    for tp in sorted({r["tp"] for r in rows}):
        for dtp in sorted({r["draft_tp"] for r in rows if r["tp"] == tp}):
            rs = [r for r in rows if r["tp"] == tp and r["draft_tp"] == dtp]
            depths = sorted({r["moe_layers"] for r in rs})
            fit = fit_cycle_model(rs)
            each = "a median cycle" if all("cycle_ms_mean" in r for r in rs) else "a mean cycle"  # older files: means
            print(f"\n### {name}: target TP{tp}, drafter TP{dtp}, MoE layers {depths} ({fit.points} configurations, each {each})\n")
            print("| MoE layers | batch | k | measured cycle ms | model ms | error | tokens/s | × k=0 |\n|---|---|---|---|---|---|---|---|")
            for r in rs:
                p = fit.predict(r["batch"], r["k"], r["moe_layers"])
                base = next(x for x in rs if x["moe_layers"] == r["moe_layers"] and x["batch"] == r["batch"] and x["k"] == 0)
                print(f"| {r['moe_layers']} | {r['batch']} | {r['k']} | {r['cycle_ms']:.2f} | {p:.2f} | {abs(p - r['cycle_ms']) / r['cycle_ms']:.1%} | "
                      f"{r['tokens_per_s']:.0f} | ×{r['tokens_per_s'] / base['tokens_per_s']:.2f} |")
            # at one depth the per-MoE-layer terms are not separable from the fixed ones: their split means nothing
            coef = dict(fit.coef)
            if len(depths) == 1:
                L, c = depths[0], coef
                coef = {k: v for k, v in c.items() if "moe_layer" not in k}
                coef["fixed"] += L * c["per_moe_layer"]
                coef["per_verified_token"] += L * c["per_moe_layer_per_verified_token"]
                coef["per_distinct_expert"] = L * c["per_moe_layer_per_distinct_expert"]
            if fit.points <= len(FEATURES):
                print(f"\n(only {fit.points} configurations for {len(FEATURES)} coefficients: the fit passes through them "
                      "and its coefficients mean nothing; sweep more batches, k or depths)")
            print(f"\nin-sample error max {fit.max_error:.1%}, mean {fit.mean_error:.1%}; leave-one-out max {fit.loo_max_error:.1%}, "
                  f"mean {fit.loo_mean_error:.1%}. Coefficients (ms{', one depth: the MoE layers folded into the totals' if len(depths) == 1 else ''}): "
                  + ", ".join(f"{k} {v:.3f}" for k, v in coef.items()))
            if png is not None:
                stem = re.sub(r"[^A-Za-z0-9]+", "-", f"{name.removesuffix('.json')}-tp{tp}-draft-tp{dtp}").strip("-")
                title = (f"{name}: target TP{tp}, drafter TP{dtp}; model in-sample max {fit.max_error:.1%}"
                         + (" (synthetic acceptance)" if any(r.get("synthetic_acceptance") for r in rs) else ""))
                print(f"plot: {plot_fit(rs, fit, title, png / (stem + '.png'))}")


def changed(r: dict) -> str | None:
    """What a per-layer row changed against the engine's path (None: it is the engine's path)."""
    if "off" in r:  # the skinny-GEMM trial's file: the engine's path is the row without skinny GEMMs
        return ({None: "skinny GEMMs on (dropped)", "skinny": None, "all": "all decode kernels off"}[r["off"]]
                if r.get("skinny") or r["off"] else None)
    return r.get("variant") or ("grouped GEMMs" if r.get("comparison") else None)


def layer_report(d: dict) -> None:
    every = d["layers"]["rows"]
    rows = [r for r in every if changed(r) is None]  # the engine's own path only
    print("\n### Per-layer time against its bound (one rank, TP-N shard shape, CUDA graph; bound = weight bytes / copy bandwidth"
          " + 2 measured all-reduces)\n")
    print("| shard | layer | batch | k | eager ms | compiled ms | bound ms | compiled / bound |\n|---|---|---|---|---|---|---|---|")
    for r in rows:  # rows without a "compiled" key come from runs before compilation existed: eager
        if r["layer"] == "lm_head" or r["k"] not in (0, 3) or r.get("compiled") is False:
            continue
        ar = 2 * r["allreduce_us"] / 1e3
        eager = (next((x["ms"] for x in rows if x["tp"] == r["tp"] and x["layer"] == r["layer"] and x["batch"] == r["batch"]
                       and x["k"] == r["k"] and x.get("compiled") is False), None) if "compiled" in r else r["ms"])
        compiled = r["ms"] if r.get("compiled") else None
        cell = lambda v: f"{v + ar:.3f}" if v is not None else "—"  # noqa: E731
        ratio = f"{r['ratio_to_bound']:.2f}" if compiled is not None else "—"
        print(f"| TP{r['tp']} | {r['layer']} | {r['batch']} | {r['k']} | {cell(eager)} | {cell(compiled)} | {r['bound_ms']:.3f} | {ratio} |")
    other = [r for r in every if changed(r) is not None and r.get("compiled", True)]
    if other:  # files before the fused MLA kernel hold grouped-GEMM rows without a "variant"
        print("\nThe same layers with one thing changed (compiled): a kernel tried and dropped (skinny GEMMs, the fused"
              " MLA attention) switched on, or the MoE layer's"
              " routed experts as grouped GEMMs instead of the fused decode kernels:\n")
        print("| shard | layer | batch | k | changed | ms | engine ms | / bound | engine / bound |\n|---|---|---|---|---|---|---|---|---|")
        for g in other:
            f = next(r for r in rows if r["layer"] == g["layer"] and r.get("compiled")
                     and (r["tp"], r["batch"], r["k"]) == (g["tp"], g["batch"], g["k"]))
            ar = 2 * g["allreduce_us"] / 1e3
            print(f"| TP{g['tp']} | {g['layer']} | {g['batch']} | {g['k']} | {changed(g)} | "
                  f"{g['ms'] + ar:.3f} | {f['ms'] + ar:.3f} | {g['ratio_to_bound']:.2f} | {f['ratio_to_bound']:.2f} |")
    heads = [r for r in rows if r["layer"] == "lm_head"]
    print(f"\nlm_head: {min(r['ratio_to_bound'] for r in heads):.2f}–{max(r['ratio_to_bound'] for r in heads):.2f} × its bound. "
          "Drafter step (TP1): " + ", ".join(f"B={r['batch']} {r['ms']:.2f} ms ({r['ratio_to_bound']:.2f}× bound)"
                                             for r in d["layers"]["drafter_step_tp1"]))


def calibrated_models(d: dict) -> dict | None:
    """The full-depth models calibrated on a ``bench/gpu_bench.py`` result ``d``: its compiled MoE layer rows at the
    TP8 shard shape fitted as overhead + bytes / (efficiency × its copy bandwidth), its smallest all-reduce in a
    graph as α. Returns {"ours": KimiScale with those layer costs, "ideal": a production-grade layer (70% of
    bandwidth, 10 µs), "alpha_us", "overhead_ms", "efficiency", "fit_error", "bw_GBps"}, or None when the file holds
    rows at fewer than the 3 token counts the fit needs."""
    bw = d.get("bandwidth", {}).get("copy_GBps_read_plus_write", KimiScale.hbm_GBps)
    ar = d.get("allreduce", {}).get("rows", {})
    alpha = min(v["graph_us"] for v in ar.values()) if ar else KimiScale.allreduce_alpha_us
    moe8 = [r for r in d.get("layers", {}).get("rows", [])
            if r["tp"] == 8 and r["layer"] == "moe" and r.get("compiled") and not r.get("comparison")]
    if len({r["tokens"] for r in moe8}) < 3:  # overhead and efficiency need rows at several token counts
        return None
    overhead, eff, err = fit_layer_costs(moe8, bw)
    return {"ours": KimiScale(hbm_GBps=bw, allreduce_alpha_us=alpha, efficiency=eff, layer_overhead_us=overhead * 1e3),
            "ideal": KimiScale(hbm_GBps=bw, allreduce_alpha_us=alpha), "alpha_us": alpha, "overhead_ms": overhead,
            "efficiency": eff, "fit_error": err, "bw_GBps": bw}


def kimi_report(d: dict, context: float = 0) -> None:
    """The full-depth models of :func:`calibrated_models` by batch; with ``context`` > 0 (cached keys per sequence)
    also each one's verify and best k there beside context 0."""
    cal = calibrated_models(d)
    if cal is None:
        print("\n(compiled TP8-shape MoE rows at fewer than the 3 token counts a fit of overhead and efficiency needs in "
              "this file: no full-depth model from it)")
        return
    bw, alpha, ours, ideal = cal["bw_GBps"], cal["alpha_us"], cal["ours"], cal["ideal"]
    print(f"\n## Kimi-K2, 61 layers, TP8 (model)\n\nCalibration: MoE layer at the TP8 shard shape = {cal['overhead_ms'] * 1e3:.0f} µs + "
          f"bytes / ({cal['efficiency']:.2f} × {bw / 1e3:.2f} TB/s) (fit max error {cal['fit_error']:.0%}); all-reduce α = {alpha:.1f} µs "
          "(2 GPUs, in a graph);"
          f" drafter step {KimiScale.draft_step_tp1_ms:.2f} ms at TP1, {KimiScale.draft_step_shard_ms:.2f} ms per TP8 shard + 3 collectives.")
    pcie = ideal.calibrate_allreduce_to_decode(90.0)
    prof = KIMI_DRAFTER_PROFILE
    print(f"Synthetic acceptance profile {prof[:4]}… (acceptance length {expected_acceptance_length(prof, 3):.2f} at k=3).\n")
    print("| machine and engine | batch | bound ms/verify (k=0) | model ms/verify (k=0) | no speculation tok/s | best k, drafter TP1 | best k, drafter TP8 |\n"
          "|---|---|---|---|---|---|---|")
    for name, m in ((f"H200 NVLink, this engine's measured layer costs (α = {alpha:.0f} µs)", ours),
                    (f"H200 NVLink, a production-grade engine ({ideal.efficiency:.0%} of bandwidth, {ideal.layer_overhead_us:.0f} µs "
                     f"per layer; α = {alpha:.0f} µs)", ideal),
                    (f"PCIe, production-grade engine, α fitted to 90 tok/s (α = {pcie.allreduce_alpha_us:.0f} µs)", pcie)):
        for B in (1, 4, 16):
            k0 = m.tokens_per_s(B, 0, "tp1", prof)
            k1, r1 = best_k(m, B, "tp1", prof)
            k8, r8 = best_k(m, B, "tp8", prof)
            print(f"| {name} | {B} | {m.bandwidth_bound_ms(B, 0):.2f} | {m.verify_ms(B, 0):.2f} | {k0:.0f} | "
                  f"k={k1}: {r1:.0f} (×{r1 / k0:.2f}) | k={k8}: {r8:.0f} (×{r8 / k0:.2f}) |")
    if context:
        print(f"\nThe same models with each sequence's {context:g} cached keys read per layer ({MLA_LATENT_ROW_BYTES} B each, every rank, once per block of {LATENT_BLOCK_M} query rows) "
              "against none:\n\n| machine and engine | batch | model ms/verify (k=0), 0 → context | best k, drafter TP1, 0 → context | "
              "best k, drafter TP8, 0 → context |\n|---|---|---|---|---|")
        for name, m in (("this engine's layer costs", ours), ("production-grade engine", ideal), ("PCIe, production-grade", pcie)):
            long = dataclasses.replace(m, context_tokens=context)
            for B in (1, 4, 16):
                cells = [f"k={k0}: {r0:.0f} → k={k1}: {r1:.0f}" for (k0, r0), (k1, r1) in
                         ((best_k(m, B, p, prof), best_k(long, B, p, prof)) for p in ("tp1", "tp8"))]
                print(f"| {name} | {B} | {m.verify_ms(B, 0):.2f} → {long.verify_ms(B, 0):.2f} | {cells[0]} | {cells[1]} |")
    acc5 = expected_acceptance_length(prof, 5)
    step = (acc5 / 71.0 * 1e3 - pcie.fixed_cycle_ms - pcie.verify_ms(1, 5)) / 5
    print(f"\nThe PCIe deployment's 71 tok/s at k = 5 with a TP8 drafter implies, with this verify model and profile, "
          f"{step:.2f} ms per TP8 draft step (model: {pcie.draft_step_ms(1, 'tp8'):.2f} ms; TP1 step {pcie.draft_step_ms(1, 'tp1'):.2f} ms).")


def depth_fit_report(d: dict) -> None:
    """The full-depth model of a ``bench/depth_fit.py`` result: ``KimiScale.from_depth_fit`` (one rank's compute as
    fitted at short depths, KimiScale's 2 × H200 collectives), no speculation and the best k of each placement by
    batch, k among those the fit has for it."""
    tp, L, fit, prof = d["tp"], d["target_layers"], d["fit"], KIMI_DRAFTER_PROFILE
    m = KimiScale.from_depth_fit(fit, tp=tp, routed_expert_weight_bytes=INT4_G32_BYTES)
    depths = sorted({x for f in fit for x in f["depths"]})
    print(f"\n## Kimi-K2, {L} layers, TP{tp} (model: one rank fitted at {depths} layers, all-reduce α = "
          f"{m.allreduce_alpha_us:.0f} µs)\n\n| batch | model ms/verify (k=0) | no speculation tok/s | best k, drafter TP1 | "
          f"best k, drafter TP{tp} |\n|---|---|---|---|---|")
    for B in sorted({f["batch"] for f in fit}):
        k0, cells = m.tokens_per_s(B, 0, "tp1", prof, L), []
        for p in ("tp1", f"tp{tp}"):
            ks = sorted({f["k"] for f in fit if f["batch"] == B and (f["k"] == 0 or (f["draft_tp"] == 1) == (p == "tp1"))})
            k, r = max(((k, m.tokens_per_s(B, k, p, prof, L)) for k in ks), key=lambda kr: kr[1])
            cells.append(f"k={k}: {r:.0f} (×{r / k0:.2f})")
        print(f"| {B} | {m.verify_ms(B, 0, L):.2f} | {k0:.0f} | {cells[0]} | {cells[1]} |")


def tune_report(t: dict) -> None:
    """The tuner's choice scored against the file's exhaustive sweep and against its own second sweep."""
    c = t["choice"]
    # files of the tuner that kept one placement for all buckets have draft_tp instead of draft_tp_by_batch
    dtp = {B: c["draft_tp_by_batch"][B] if "draft_tp_by_batch" in c else c["draft_tp"] for B in c["k_by_batch"]}
    print(f"\n### Tuner: by batch bucket, drafter TP {dtp}, k {c['k_by_batch']}\n")
    print("Scores use tokens/s with acceptance pooled over k (splitspec.measure.tune.pool_acceptance); in brackets, with each "
          "row's own acceptance (the sweep table above).\n")
    print("| batch | tuner's choice | sweep's best | chosen / best | chosen / no speculation | second sweep: chosen / best |")
    print("|---|---|---|---|---|---|")
    for B, r in t["score"].items():
        v, e, ve = t["verification"]["score"][B], t["score_emitted"][B], t["verification"]["score_emitted"][B]
        print(f"| {B} | TP{dtp[B]}, k = {c['k_by_batch'][B]} | TP{r['best']['draft_tp']}, k = {r['best']['k']} | "
              f"{r['chosen_over_best']:.3f} ({e['chosen_over_best']:.3f}) | ×{r['chosen_over_no_speculation']:.2f} "
              f"(×{e['chosen_over_no_speculation']:.2f}) | {v['chosen_over_best']:.3f} ({ve['chosen_over_best']:.3f}) |")


def main(paths: list[str], png: Path | None = None, context: float = 0) -> None:
    for path in paths:
        try:
            d = json.loads(open(path, encoding="utf-8").read())
            if "fit" in d and "depths" in d:  # a bench/depth_fit.py result
                print(f"## {path} ({d.get('machine', {}).get('gpus')}, {d['label']})")
                depth_fit_report(d)
                if context:
                    print(f"\n(--context {context:g}: the depth-fit model holds the context it was measured at; not modelled)")
                continue
            print(f"## {path} ({d['machine']['gpus']}, torch {d['machine']['torch']})")
            rows = sweep_rows(d)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            sys.exit(f"{path}: not a bench/gpu_bench.py or bench/depth_fit.py result ({type(e).__name__}: {e})")
        if rows:
            fit_report(path.rsplit("/", 1)[-1], rows, png)
        if "rows" in d.get("layers", {}):
            layer_report(d)
            kimi_report(d, context)
        elif context:
            print(f"\n(--context {context:g}: this file has no per-layer rows, so no full-depth model to carry it)")
        if "verification" in d.get("tune", {}):
            tune_report(d["tune"])
            if all("cycle_ms_by_load" in r for r in d["tune"]["tuner_rows"]):  # each row over several engine loads
                tp, moe_layers = (int(x) for x in d["machine"]["argv"][d["machine"]["argv"].index("--tune") + 1].split(","))
                for label, key in (("the tuner's sweep", "tuner_rows"), ("its second sweep", "verification")):
                    rs = d["tune"][key] if key == "tuner_rows" else d["tune"][key]["measured"]
                    loads = len(rs[0]["cycle_ms_by_load"])
                    fit_report(f"{label} ({loads} engine loads per placement, the evaluation prompts)",
                               [{"tp": tp, "moe_layers": moe_layers} | r for r in rs])


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("paths", nargs="*", default=["docs/lab/2026-11-30-grouped-gemm-engine/h200x2-2026-11-30-eager.json", "docs/lab/2026-11-30-grouped-gemm-engine/h200x2-2026-11-30-compiled.json"],
                    help="bench/gpu_bench.py result files")
    ap.add_argument("--png", type=Path, help="folder: also plot each engine sweep's fit there (cycle ms and tokens/s against k)")
    ap.add_argument("--context", type=float, default=0.0,
                    help="cached keys per sequence a verify attends over, for the full-depth bytes model (default 0: weights only)")
    a = ap.parse_args()
    try:  # the model's own check, before any file is read
        KimiScale(context_tokens=a.context)
    except ValueError as e:
        ap.error(f"--context {a.context:g}: {str(e).split(', ', 1)[-1]}")
    if a.png is not None:
        try:
            a.png.mkdir(parents=True, exist_ok=True)
            if not os.access(a.png, os.W_OK):
                raise PermissionError("not writable")
        except OSError as e:
            ap.error(f"--png {a.png}: not a folder the plots can be written to ({e.strerror or e})")
    main(a.paths, a.png, a.context)
