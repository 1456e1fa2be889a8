#!/usr/bin/env python3
"""Fit the cycle cost model to GPU measurements and extrapolate to Kimi-K2 (61 layers, TP8); prints markdown.

    .venv/bin/python bench/cost_model.py docs/data/h200x2-2026-11-29.json
"""

from __future__ import annotations

import json
import sys

from splitspec.perf_model import KimiScale, best_k, expected_acceptance_length, fit_cycle_model
from splitspec.synthetic import KIMI_DRAFTER_PROFILE


def main(path: str) -> None:
    d = json.load(open(path))
    rows = [r for r in d.get("partial_rows", []) if r["draft_tp"] == 1]
    print(f"## Fit on {len(rows)} measured cycles ({d['machine']['gpus']}, torch {d['machine']['torch']})\n")
    fit = fit_cycle_model(rows)
    print("| batch | k | measured cycle ms | model ms | error | tokens/s measured | speed-up vs k=0 |\n|---|---|---|---|---|---|---|")
    base = {r["batch"]: r["tokens_per_s"] for r in rows if r["k"] == 0}
    for r in rows:
        p = fit.predict(r["batch"], r["k"])
        print(f"| {r['batch']} | {r['k']} | {r['cycle_ms']:.2f} | {p:.2f} | {abs(p - r['cycle_ms']) / r['cycle_ms']:.1%} | "
              f"{r['tokens_per_s']:.0f} | ×{r['tokens_per_s'] / base[r['batch']]:.2f} |")
    print(f"\nin-sample error: max {fit.max_error:.1%}, mean {fit.mean_error:.1%}; leave-one-out: max {fit.loo_max_error:.1%}, "
          f"mean {fit.loo_mean_error:.1%}\n\ncoefficients (ms): " + ", ".join(f"{k} {v:.3f}" for k, v in fit.coef.items()))
    bw = d.get("bandwidth", {}).get("copy_GBps_read_plus_write", 4200.0)
    ar = d.get("allreduce", {}).get("rows", {})
    alpha = min(v["graph_us"] for v in ar.values()) if ar else 13.0
    nv = KimiScale(hbm_GBps=bw, allreduce_alpha_us=alpha)
    pcie = KimiScale(hbm_GBps=bw).calibrate_allreduce_to_decode(90.0)
    prof = KIMI_DRAFTER_PROFILE
    print(f"\n## Kimi-K2, 61 layers, TP8 (model; acceptance profile {prof[:4]}…, acceptance length at k=3 "
          f"{expected_acceptance_length(prof, 3):.2f})\n")
    print("| machine | batch | bound ms/verify (k=0) | model ms/verify (k=0) | no speculation tok/s | best k, drafter TP1 | best k, drafter TP8 |\n|---|---|---|---|---|---|---|")
    for name, m in (("H200 NVLink (α = %.0f µs, measured)" % alpha, nv), ("PCIe, α fitted to 90 tok/s (α = %.0f µs)" % pcie.allreduce_alpha_us, pcie)):
        for B in (1, 4, 16):
            k0 = m.tokens_per_s(B, 0, "tp1", prof)
            k1, r1 = best_k(m, B, "tp1", prof)
            k8, r8 = best_k(m, B, "tp8", prof)
            print(f"| {name} | {B} | {m.bandwidth_bound_ms(B, 0):.2f} | {m.verify_ms(B, 0):.2f} | {k0:.0f} | "
                  f"k={k1}: {r1:.0f} (×{r1 / k0:.2f}) | k={k8}: {r8:.0f} (×{r8 / k0:.2f}) |")
    # what the seeds' PCIe figures imply for a TP8 draft step
    acc5 = expected_acceptance_length(prof, 5)
    step = (acc5 / 71.0 * 1e3 - pcie.fixed_cycle_ms - pcie.verify_ms(1, 5)) / 5
    print(f"\nThe PCIe deployment's 71 tok/s at k = 5 with a TP8 drafter implies, with this verify model and profile, "
          f"{step:.2f} ms per TP8 draft step (model assumes {pcie.draft_step_ms(1, 'tp8'):.2f} ms; TP1 step {pcie.draft_step_ms(1, 'tp1'):.2f} ms).")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "docs/data/h200x2-2026-11-29.json")
