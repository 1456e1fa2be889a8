#!/usr/bin/env python3
"""Where each drafter placement wins: the same GPUs measured with NCCL's peer-to-peer path on and off.

With ``NCCL_P2P_DISABLE=1`` (and, with ``--shm-off``, ``NCCL_SHM_DISABLE=1``) traffic between GPUs of one
host goes through host memory, as on a PCIe box without P2P, so one machine shows both regimes.

    python bench/interconnect.py run --out results/interconnect          # needs >= 2 GPUs; ~15 min at TP2
    python bench/interconnect.py report ON.json OFF.json [--png DIR]     # the tables, from two gpu_bench files

``run`` starts ``bench/gpu_bench.py`` once per setting (all-reduce latency by message size in and out of CUDA
graphs, the Kimi-width synthetic engine sweep at TP-N for both placements, k 0–5, batch 1/4/16, and
``splitspec tune`` on it), then reports. The report gives, per interconnect: all-reduce µs by size, draft ms
per placement, the tuner's choice per batch bucket and its speed-up over no speculation, the cycle model's
error per placement; then the full-depth Kimi-K2 TP8 model (measured α of each interconnect) side by side,
the all-reduce latency at which the drafter on one GPU starts to win (the crossover), and the crossover the
TP-N sweeps imply (the placements' best-rate gap interpolated linearly in α between the two settings).
Acceptance is synthetic (the published drafter's profile), and labelled so.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from splitspec.build.synthetic import KIMI_DRAFTER_PROFILE
from splitspec.files import write_json, write_png
from splitspec.measure.cost_model import KimiScale, allreduce_crossover_us, best_k, fit_cycle_model

SETTINGS = {"p2p_on": {}, "p2p_off": {"NCCL_P2P_DISABLE": "1"}}
SKIP = "correctness,bandwidth,experts,moe_kernel,moe_fp8,layers"


def gpu_bench_command(out: Path, tp: int, moe_layers: int, cycles: int, dry_run: bool) -> list[str]:
    """The gpu_bench.py command line of one setting: all-reduce, the TP-N sweep of both placements, the tuner."""
    cmd = [sys.executable, str(Path(__file__).with_name("gpu_bench.py")), "--out", str(out), "--skip", SKIP,
           "--tp", str(tp), "--moe-layers", str(moe_layers), "--batches", "1,4,16", "-k", "0,1,2,3,4,5",
           "--cycles", str(cycles), "--placements", "1,N", "--tune", f"{tp},{moe_layers}"]
    return cmd + (["--dry-run"] if dry_run else [])


def alpha_us(d: dict) -> float | None:
    """The smallest all-reduce of a gpu_bench file (one row of 7168 bf16, in a CUDA graph), µs."""
    rows = d.get("allreduce", {}).get("rows", {})
    return min(v["graph_us"] for v in rows.values()) if rows else None


def sweep(d: dict) -> list[dict]:
    """The engine rows of the file's largest target TP size (the P2P setting matters only there)."""
    rows = [r for r in d.get("partial_rows", []) if "draft_tp" in r]
    tp = max((r["tp"] for r in rows), default=None)
    return [r for r in rows if r["tp"] == tp]


def best_rates(rows: list[dict]) -> dict[tuple[int, int], tuple[int, float]]:
    """(draft_tp, batch) → (best k, its tokens/s) over k ≥ 1, pooled acceptance where the rows have it."""
    out: dict = {}
    for r in rows:
        if r["k"] == 0:
            continue
        tps = r.get("tokens_per_s_pooled", r["tokens_per_s"])
        key = (r["draft_tp"], r["batch"])
        if key not in out or tps > out[key][1]:
            out[key] = (r["k"], tps)
    return out


def measured_crossover(on: dict, off: dict, batch: int) -> float | None:
    """α (µs) where the sweeps' best sharded and best one-GPU rates meet at ``batch``, linear in α between the two
    settings; None when the same placement wins in both (the crossover lies outside the measured α's)."""
    a_on, a_off = alpha_us(on), alpha_us(off)
    if a_on is None or a_off is None or a_on == a_off:
        return None
    gaps = []
    for d in (on, off):
        b = best_rates(sweep(d))
        tp = max(t for t, B in b if B == batch)
        gaps.append(b[(1, batch)][1] - b[(tp, batch)][1])
    if (gaps[0] > 0) == (gaps[1] > 0):
        return None
    return a_on + (a_off - a_on) * (-gaps[0]) / (gaps[1] - gaps[0])


def report(files: dict[str, dict], png: Path | None = None) -> dict:
    """Print the comparison as markdown and return it as a dict (saved beside the inputs by ``run``)."""
    out: dict = {"synthetic_acceptance": True, "settings": {}}
    print("## All-reduce of rows × 7168 bf16, µs (eager / in a CUDA graph)\n")
    names = list(files)
    sizes = sorted({int(n) for d in files.values() for n in d.get("allreduce", {}).get("rows", {})})
    print("| rows | " + " | ".join(names) + " |\n|---|" + "---|" * len(names))
    for n in sizes:
        cells = []
        for d in files.values():
            v = d.get("allreduce", {}).get("rows", {}).get(str(n)) or d.get("allreduce", {}).get("rows", {}).get(n)
            cells.append(f"{v['eager_us']:.1f} / {v['graph_us']:.1f}" if v else "—")
        print(f"| {n} | " + " | ".join(cells) + " |")
    for name, d in files.items():
        rows, s = sweep(d), {"allreduce_alpha_us": alpha_us(d)}
        print(f"\n## {name}: engine sweep (synthetic acceptance)\n")
        print("| drafter TP | batch | draft ms k=1 | per extra step ms | best k | tokens/s | × no speculation |\n|---|---|---|---|---|---|---|")
        best = best_rates(rows)
        for (dtp, B), (k, tps) in sorted(best.items()):
            at = {r["k"]: r for r in rows if r["draft_tp"] == dtp and r["batch"] == B}
            step = (at[5]["draft_ms"] - at[1]["draft_ms"]) / 4 if 5 in at and 1 in at else float("nan")
            base = at[0].get("tokens_per_s_pooled", at[0]["tokens_per_s"])
            print(f"| {dtp} | {B} | {at[1]['draft_ms']:.3f} | {step:.3f} | {k} | {tps:.0f} | ×{tps / base:.2f} |")
            s.setdefault("sweep", []).append({"draft_tp": dtp, "batch": B, "draft_ms_k1": at[1]["draft_ms"], "step_ms": step,
                                              "best_k": k, "tokens_per_s": tps, "speedup": tps / base})
        s["fit"] = {}
        for dtp in sorted({r["draft_tp"] for r in rows}):
            fit = fit_cycle_model([r for r in rows if r["draft_tp"] == dtp])
            s["fit"][dtp] = {"max_error": fit.max_error, "mean_error": fit.mean_error, "loo_max_error": fit.loo_max_error}
            print(f"\ncycle model, drafter TP{dtp}: in-sample max {fit.max_error:.1%}, mean {fit.mean_error:.1%}; "
                  f"leave-one-out max {fit.loo_max_error:.1%}")
        if "choice" in d.get("tune", {}):
            c = d["tune"]["choice"]
            print("\ntuner: " + "; ".join(f"B={B} drafter TP{c['draft_tp_by_batch'][B]}, k={c['k_by_batch'][B]} "
                                          f"(×{d['tune']['score'][B]['chosen_over_no_speculation']:.2f} over no speculation)"
                                          for B in c["k_by_batch"]))
            s["tune"] = {B: {"draft_tp": c["draft_tp_by_batch"][B], "k": c["k_by_batch"][B],
                             "speedup": d["tune"]["score"][B]["chosen_over_no_speculation"]} for B in c["k_by_batch"]}
        out["settings"][name] = s
    prof = KIMI_DRAFTER_PROFILE
    print("\n## Kimi-K2 at full depth, TP8 (model; α measured on each interconnect)\n")
    print("| interconnect | α µs | batch | no speculation tok/s | best, drafter TP1 | best, drafter TP8 |\n|---|---|---|---|---|---|")
    for name, d in files.items():
        a = alpha_us(d)
        if a is None:
            continue
        m = KimiScale(allreduce_alpha_us=a)
        for B in (1, 4, 16):
            k0 = m.tokens_per_s(B, 0, "tp1", prof)
            (k1, r1), (k8, r8) = best_k(m, B, "tp1", prof), best_k(m, B, "tp8", prof)
            print(f"| {name} | {a:.1f} | {B} | {k0:.0f} | k={k1}: ×{r1 / k0:.2f} | k={k8}: ×{r8 / k0:.2f} |")
            out["settings"][name].setdefault("kimi_tp8", {})[B] = {"tp1": [k1, r1 / k0], "tp8": [k8, r8 / k0]}
    print("\n| batch | model crossover α µs (TP8, full depth) | sweeps' crossover α µs (TP-N engine) |\n|---|---|---|")
    out["crossover_us"] = {}
    for B in (1, 4, 16):
        model = allreduce_crossover_us(KimiScale(), B, prof)
        meas = measured_crossover(*files.values(), B) if len(files) == 2 else None
        out["crossover_us"][B] = {"model_tp8": model, "measured_tpN": meas}
        fmt = lambda v: f"{v:.0f}" if v is not None else "none in range"  # noqa: E731
        print(f"| {B} | {fmt(model)} | {fmt(meas)} |")
    if png is not None:
        out["plot"] = str(plot(files, png / "interconnect.png"))
        print(f"\nplot: {out['plot']}")
    return out


def plot(files: dict[str, dict], path: Path) -> Path:
    """All-reduce µs against rows (both interconnects), and each placement's speed-up by batch."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    for i, (name, d) in enumerate(files.items()):
        rows = sorted((int(n), v["graph_us"]) for n, v in d.get("allreduce", {}).get("rows", {}).items())
        if rows:
            a1.plot(*zip(*rows), "o-", color=f"C{i}", label=name)
        best = best_rates(sweep(d))
        for j, dtp in enumerate(sorted({t for t, _ in best})):
            pts = sorted((B, tps) for (t, B), (_, tps) in best.items() if t == dtp)
            base = {r["batch"]: r.get("tokens_per_s_pooled", r["tokens_per_s"]) for r in sweep(d) if r["k"] == 0 and r["draft_tp"] == dtp}
            a2.plot([B for B, _ in pts], [t / base[B] for B, t in pts], "os"[j] + "-", color=f"C{i}", label=f"{name}, drafter TP{dtp}")
    a1.set(xscale="log", yscale="log", xlabel="rows of 7168 bf16", ylabel="all-reduce µs (CUDA graph)")
    a2.set(xscale="log", xlabel="batch", ylabel="best speed-up over no speculation (synthetic acceptance)")
    for a in (a1, a2):
        a.legend(fontsize=8)
        a.grid(alpha=0.3)
    return write_png(fig, path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="measure both settings with bench/gpu_bench.py, then report")
    r.add_argument("--out", type=Path, default=Path("bench/results/interconnect"))
    r.add_argument("--tp", type=int, default=2, help="target TP size of the sweeps (GPUs used)")
    r.add_argument("--moe-layers", type=int, default=1)
    r.add_argument("--cycles", type=int, default=48)
    r.add_argument("--shm-off", action="store_true", help="also NCCL_SHM_DISABLE=1 in the P2P-off setting (socket transport)")
    r.add_argument("--dry-run", action="store_true", help="CPU, demo-sized engines: checks the pipeline, measures nothing useful")
    p = sub.add_parser("report", help="the tables from two gpu_bench.py files (P2P on, then off)")
    p.add_argument("on", type=Path)
    p.add_argument("off", type=Path)
    for x in (r, p):
        x.add_argument("--png", type=Path, help="folder for interconnect.png")
    a = ap.parse_args()
    if a.cmd == "report":
        files = {}
        for name, path in (("p2p_on", a.on), ("p2p_off", a.off)):
            try:
                files[name] = json.loads(path.read_text(encoding="utf-8"))
            except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
                sys.exit(f"{path}: not a bench/gpu_bench.py result ({type(e).__name__}: {e})")
        report(files, a.png)
        return
    if not a.dry_run:
        import torch

        if torch.cuda.device_count() < a.tp:
            sys.exit(f"interconnect run: needs {a.tp} GPUs for --tp {a.tp}, found {torch.cuda.device_count()}")
    files = {}
    for name, env in SETTINGS.items():
        env = dict(env) | ({"NCCL_SHM_DISABLE": "1"} if a.shm_off and env else {})
        out = a.out / name
        print(f"== {name} {env or '(NCCL defaults)'}", flush=True)
        subprocess.run(gpu_bench_command(out, a.tp, a.moe_layers, a.cycles, a.dry_run), env=os.environ | env, check=True)
        files[name] = json.loads((out / "gpu_bench.json").read_text()) | {"nccl_env": env}
    result = report(files, a.png or a.out)
    write_json(result | {"tp": a.tp, "moe_layers": a.moe_layers, "nccl_env": {n: d["nccl_env"] for n, d in files.items()}},
               a.out / "interconnect.json")


if __name__ == "__main__":
    main()
