#!/usr/bin/env python3
"""One rank of a TP-N Kimi-K2.5 engine at full depth on one GPU, then the full deployment from it.

Measures rank 0 of a synthetic Kimi-K2.5 target (61 layers at the published shapes; routed experts INT4 as K2.5
publishes them — packed int32 words of 8 nibbles, bf16 scales per group of 32 — everything else bf16; random
weights) with the published EAGLE-3 drafter's shape, both draft placements loaded: the drafter whole on this GPU
(draft_tp 1) and its TP-N shard (draft_tp N). The other ranks do not exist: the engine runs with ``fake_peers``
(``splitspec.engine.group``), so every collective returns at once and the figures are one rank's compute. Steady
cycles (CUDA graphs, compiled layers: the engine's normal path) by batch and k, with synthetic acceptance
(KIMI_DRAFTER_PROFILE); each row is written to the JSON as soon as it is measured.

Then, from those rows: the collectives a real TP-N group pays per cycle, from measured all-reduce latencies (the
lab's 2 × H200 NVLink figures by default, or measured here on ≥ 2 GPUs); the full-depth cycle, tokens/s with the
profile's expected acceptance, and each placement's best k against no speculation; and the error of the
full-depth cost model (``splitspec.measure.cost_model.KimiScale``, calibrated on one-layer runs) at this depth.
Everything is labelled synthetic.

    export PYTHONPATH=$PWD/src
    python3 bench/full_depth_rank.py --layers 61 --tp 8 --batches 1,4,16 --ks 0-5 --out results/full-depth
    python3 bench/full_depth_rank.py --dry-run --layers 2 --batches 1 --ks 0,1 --out /tmp/fd   # CPU check, tiny shapes

Writes OUT/full_depth_rank.json (after every row), OUT/full_depth_rank.md (the printed report) and
OUT/full_depth_rank.png.
"""

from __future__ import annotations

import argparse
import atexit
import dataclasses
import functools
import json
import os
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np

from lab import NO_NVLINK_MULTICAST
from rank_args import check_rank, parse_grid
from splitspec.build.synthetic import KIMI_DRAFTER_PROFILE
from splitspec.files import write_atomic, write_json, write_png
from splitspec.measure.cost_model import INT4_G32_BYTES, KimiScale, expected_acceptance_length
from splitspec.models.fused_moe import MAX_TOKENS

START = time.monotonic()
REPO = Path(__file__).resolve().parent.parent
#: The all-reduce latencies used without ≥ 2 GPUs: NCCL in a CUDA graph, 2 × H200 over NVLink, T·7168 bf16
#: (docs/lab/2026-11-30-grouped-gemm-engine, "Measured primitives"; later sweeps reuse this section).
LAB_ALLREDUCE = REPO / "docs/lab/2026-11-30-grouped-gemm-engine/h200x2-2026-11-30-eager.json"
#: The one-layer calibration of the full-depth model docs/performance.md quotes (docs/lab/2026-11-30-kimi-k2-full-depth-model).
LAB_MODEL = REPO / "docs/lab/2026-11-30-fused-moe-kernels/h200x2-2026-11-30-fused-moe.json"
PROMPT_TOKENS, WARMUP = 16, 3
LABEL = ("synthetic: random weights at Kimi-K2.5 shapes, routed experts INT4 (packed int32 + bf16 group-32 scales), the "
         "rest bf16; synthetic acceptance (KIMI_DRAFTER_PROFILE); one rank measured, the other ranks' collectives no-ops, "
         "their cost added from measured all-reduce latencies")


# ------------------------------------------------------------------ collectives of the full group (pure)

def allreduce_points(section: dict) -> list[tuple[float, float]]:
    """(bytes, µs in a CUDA graph) of a ``gpu_bench`` all-reduce section, by size."""
    return sorted((float(v["bytes"]), float(v["graph_us"])) for v in section["rows"].values())


def collective_us(points: list[tuple[float, float]], nbytes: float) -> float:
    """All-reduce µs of ``nbytes``: interpolated between the measured sizes, the smallest's below them, and past the
    largest extended along the last two points' slope (the bandwidth term)."""
    xs, ys = zip(*points)
    if nbytes <= xs[-1] or len(xs) < 2:
        return float(np.interp(nbytes, xs, ys))
    return ys[-1] + (nbytes - xs[-1]) * max(0.0, (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]))


def comm_ms(points, tp: int, layers: int, B: int, k: int, draft_tp: int | None, dims: dict) -> dict:
    """Collective ms per cycle a TP-``tp`` group adds to one rank's compute (the engine's own collectives,
    docs/architecture.md). Verify: 2 all-reduces per layer and one for the embedding over T = B·(k+1) rows of
    hidden bf16, and the all-gather of float32 logits [T, vocab]. Draft (k > 0): sharded (draft_tp = tp), per forward
    (the extend over B·(k+1) rows, then k − 1 steps over B) 2 all-reduces and the all-gather of draft-vocabulary
    logits of B rows; split (draft_tp 1, the drafter on a GPU of its own), the aux states' hop to that GPU and the
    drafts' broadcast, each costed as a collective of its bytes. An all-gather of S output bytes is costed as an
    all-reduce of S/2 (the same traffic per GPU on a ring)."""
    if tp == 1:
        return {"verify_ms": 0.0, "draft_ms": 0.0}
    H, T, ar = dims["hidden"], B * (k + 1), functools.partial(collective_us, points)
    verify = (2 * layers + 1) * ar(T * H * 2) + ar(T * dims["vocab"] * 4 / 2)
    draft = 0.0
    if k and draft_tp == 1:
        draft = ar(T * 3 * H * 2) + ar(B * k * 8)
    elif k:
        gather = ar(B * dims["draft_vocab"] * 4 / 2)
        draft = 2 * ar(T * H * 2) + gather + (k - 1) * (2 * ar(B * H * 2) + gather)
    return {"verify_ms": verify / 1e3, "draft_ms": draft / 1e3}


# ------------------------------------------------------------------ the full deployment from the rank's rows (pure)

def placement_name(draft_tp: int | None, tp: int) -> str:
    return "none" if draft_tp is None else "split (drafter TP1)" if draft_tp == 1 else f"sharded (drafter TP{tp})"


def full_depth(rows: list[dict], points, tp: int, layers: int, dims: dict, profile=KIMI_DRAFTER_PROFILE) -> list[dict]:
    """Each placement's rows (the k = 0 row under both) with the group's collectives added: ``comm_ms``,
    ``full_cycle_ms``, ``tokens_per_s`` (B × the profile's expected acceptance length / full cycle) and
    ``speedup`` over the same batch's k = 0."""
    out = []
    for dtp in sorted({r["draft_tp"] for r in rows if r["k"]}) or [None]:  # [None]: no drafting row yet
        for r in sorted((r for r in rows if r["draft_tp"] in (dtp, None)), key=lambda r: (r["batch"], r["k"])):
            c = comm_ms(points, tp, layers, r["batch"], r["k"], dtp if r["k"] else None, dims)
            full = r["cycle_ms"] + c["verify_ms"] + c["draft_ms"]
            al = expected_acceptance_length(profile, r["k"])
            out.append({"draft_tp": dtp, "batch": r["batch"], "k": r["k"], "rank_cycle_ms": r["cycle_ms"],
                        "rank_draft_ms": r["draft_ms"], "rank_verify_ms": r["verify_ms"], "comm_verify_ms": c["verify_ms"],
                        "comm_draft_ms": c["draft_ms"], "full_cycle_ms": full, "expected_acceptance_length": al,
                        "tokens_per_s": r["batch"] * al / full * 1e3})
    for r in out:
        k0 = next((x for x in out if x["draft_tp"] == r["draft_tp"] and x["batch"] == r["batch"] and x["k"] == 0), None)
        r["speedup"] = r["tokens_per_s"] / k0["tokens_per_s"] if k0 else None
    return out


def best_k(full: list[dict]) -> list[dict]:
    """Per (placement, batch) with a k = 0 row: the k with the most tokens/s (tuned speculation) and its speed-up."""
    out = []
    for dtp, B in sorted({(r["draft_tp"], r["batch"]) for r in full}):
        mine = [r for r in full if (r["draft_tp"], r["batch"]) == (dtp, B)]
        k0 = next((r for r in mine if r["k"] == 0), None)
        if k0 is not None:
            top = max(mine, key=lambda r: r["tokens_per_s"])
            out.append({"draft_tp": dtp, "batch": B, "k": top["k"], "tokens_per_s": top["tokens_per_s"],
                        "no_speculation_tokens_per_s": k0["tokens_per_s"], "speedup": top["speedup"]})
    return out


def model_errors(full: list[dict], models: dict, tp: int, layers: int) -> list[dict]:
    """Each model's full cycle and verify (with its collectives) against the measured ones: relative error
    (model − measured) / measured. ``models``: name → an object with ``cycle_ms(B, k, placement, layers)`` and
    ``verify_ms(B, k, layers)`` (:class:`KimiScale`); placement "tp1" for the split drafter, else sharded."""
    out = []
    first = min((r["draft_tp"] for r in full), default=None)
    for name, m in models.items():
        for r in full:
            B, k = r["batch"], r["k"]
            if k == 0 and r["draft_tp"] != first:  # the k = 0 row stands under every placement: count it once
                continue
            cyc = m.cycle_ms(B, k, "tp1" if r["draft_tp"] == 1 else f"tp{tp}", layers)
            ver = m.verify_ms(B, k, layers)
            measured_verify = r["rank_verify_ms"] + r["comm_verify_ms"]
            out.append({"model": name, "draft_tp": r["draft_tp"], "batch": B, "k": k, "model_cycle_ms": cyc,
                        "cycle_error": (cyc - r["full_cycle_ms"]) / r["full_cycle_ms"], "model_verify_ms": ver,
                        "verify_error": (ver - measured_verify) / measured_verify})
    return out


def models_from(path: Path | None, tp: int) -> dict:
    """The full-depth models compared: the one-layer calibration of ``path`` (bench/cost_model.py), with bf16
    expert bytes as docs/performance.md quotes it and with INT4 ones, and the production-grade layer with INT4
    ones; without ``path`` the production-grade layer only."""
    from cost_model import calibrated_models

    cal = calibrated_models(json.loads(path.read_text())) if path else None
    int4 = lambda m: dataclasses.replace(m, tp=tp, routed_expert_weight_bytes=INT4_G32_BYTES)  # noqa: E731
    if cal is None:
        return {"production-grade layer, INT4 experts": int4(KimiScale())}
    return {"one-layer fit, bf16 experts (docs/performance.md)": dataclasses.replace(cal["ours"], tp=tp),
            "one-layer fit, INT4 experts": int4(cal["ours"]), "production-grade layer, INT4 experts": int4(cal["ideal"])}


def report(res: dict) -> str:
    """Markdown tables of a result (rows measured so far)."""
    tp, lines = res["tp"], [f"# One rank of TP{res['tp']} at {res['layers']} layers ({res['label']})", "",
                            f"All-reduce: {res['allreduce']['source']}.", ""]
    lines += ["| placement | batch | k | rank cycle ms | draft | verify | + collectives | full cycle ms | tok/s | × k=0 |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["full"]:
        sp = f"×{r['speedup']:.2f}" if r["speedup"] else "—"
        lines.append(f"| {placement_name(r['draft_tp'], tp)} | {r['batch']} | {r['k']} | {r['rank_cycle_ms']:.2f} | "
                     f"{r['rank_draft_ms']:.2f} | {r['rank_verify_ms']:.2f} | {r['comm_verify_ms'] + r['comm_draft_ms']:.2f} | "
                     f"{r['full_cycle_ms']:.2f} | {r['tokens_per_s']:.0f} | {sp} |")
    lines += ["", "Tuned speculation (best k) per placement:", "", "| placement | batch | best k | tok/s | no speculation | speed-up |",
              "|---|---|---|---|---|---|"]
    lines += [f"| {placement_name(b['draft_tp'], tp)} | {b['batch']} | {b['k']} | {b['tokens_per_s']:.0f} | "
              f"{b['no_speculation_tokens_per_s']:.0f} | ×{b['speedup']:.2f} |" for b in res["best"]]
    lines += ["", "Full-depth model against the measurement, error = (model − measured) / measured (verify: with its collectives):",
              "", "| model | batch | k = 0: model / measured cycle ms | cycle error: mean / largest | verify error: mean / largest |",
              "|---|---|---|---|---|"]
    for name in dict.fromkeys(e["model"] for e in res["model_errors"]):
        for B in sorted({e["batch"] for e in res["model_errors"]}):
            es = [e for e in res["model_errors"] if e["model"] == name and e["batch"] == B]
            k0 = next((e for e in es if e["k"] == 0), None)
            meas = next((r["full_cycle_ms"] for r in res["full"] if (r["batch"], r["k"]) == (B, 0)), None)
            cell = f"{k0['model_cycle_ms']:.2f} / {meas:.2f}" if k0 and meas else "—"
            c, v = ([e[key] for e in es] for key in ("cycle_error", "verify_error"))
            lines.append(f"| {name} | {B} | {cell} | {np.mean(c):+.0%} / {max(c, key=abs):+.0%} | "
                         f"{np.mean(v):+.0%} / {max(v, key=abs):+.0%} |")
    return "\n".join(lines) + "\n"


def plot(res: dict, path: Path) -> Path:
    """Per batch: cycle ms against k (the rank alone, points; with the collectives, lines; the first INT4 model,
    dotted) and full-depth tokens/s against k (k = 0 dashed), one colour per placement."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = sorted({r["batch"] for r in res["full"]})
    fig, axes = plt.subplots(2, len(batches), figsize=(max(4.2 * len(batches), 8), 7), squeeze=False)
    model = next((n for n in dict.fromkeys(e["model"] for e in res["model_errors"]) if "INT4" in n), None)
    for col, B in enumerate(batches):
        for i, dtp in enumerate(sorted({r["draft_tp"] for r in res["full"]})):
            rs = [r for r in res["full"] if r["draft_tp"] == dtp and r["batch"] == B]
            ks, c = [r["k"] for r in rs], f"C{i}"
            axes[0][col].plot(ks, [r["rank_cycle_ms"] for r in rs], "o", color=c, label=f"{placement_name(dtp, res['tp'])}: rank")
            axes[0][col].plot(ks, [r["full_cycle_ms"] for r in rs], "-", color=c, label="+ collectives")
            by_k = {e["k"]: e["model_cycle_ms"] for e in res["model_errors"]  # k = 0 is listed under one placement only
                    if e["model"] == model and e["batch"] == B and (e["draft_tp"] == dtp or e["k"] == 0)}
            if model and all(k in by_k for k in ks):
                axes[0][col].plot(ks, [by_k[k] for k in ks], ":", color=c, label=f"model: {model}")
            axes[1][col].plot(ks, [r["tokens_per_s"] for r in rs], "o-", color=c, label=placement_name(dtp, res["tp"]))
            if rs and rs[0]["k"] == 0:
                axes[1][col].axhline(rs[0]["tokens_per_s"], color="grey", ls="--", lw=0.8)
        axes[0][col].set_title(f"batch {B}")
        axes[0][col].set_ylabel("cycle ms")
        axes[1][col].set_ylabel("tokens/s (full depth, TP%d)" % res["tp"])
        axes[1][col].set_xlabel("draft tokens k")
    axes[0][0].legend(fontsize=6)
    axes[1][0].legend(fontsize=7)
    fig.suptitle(f"One rank of TP{res['tp']}, {res['layers']} layers — {res['label']}", fontsize=7, wrap=True)
    fig.tight_layout()
    return write_png(fig, path)


# ------------------------------------------------------------------ measuring (one GPU, or the CPU with --dry-run)

def elapsed() -> str:
    return f"[{time.monotonic() - START:5.0f} s]"


def fused(B: int, k: int) -> bool:
    """Whether a verify of B·(k + 1) tokens takes the fused decode kernels (else the grouped INT4 path)."""
    return B * (k + 1) <= MAX_TOKENS


def todo(a, rows: list[dict]) -> list[tuple[int, int, int | None]]:
    """(batch, k, draft_tp) still to measure, in order: verifies of up to MAX_TOKENS tokens first (the fused decode
    kernels; batch 1's rows, all there for its speed-ups), then the larger ones (a new compilation per chunk count of
    the grouped INT4 path: the slowest rows to start), each by batch and k, k = 0 (no drafter) before each k's
    placements; those of ``rows`` (an earlier run's, ``--resume``) left out."""
    placements = (1, a.tp) if a.tp > 1 else (1,)
    done = {(r["batch"], r["k"], r["draft_tp"]) for r in rows}
    order = sorted(((B, k) for B in a.batches for k in a.ks), key=lambda bk: (not fused(*bk), bk))
    return [(B, k, d) for B, k in order for d in (placements if k else (None,)) if (B, k, d) not in done]


def measure_rows(a, res: dict, save, only=None) -> None:
    """Load the synthetic INT4 engine (rank 0 of TP ``a.tp``, ``a.layers`` deep, fake peers, both placements) and
    append a row per :func:`todo` entry (those ``only`` keeps, if given) to ``res["rows"]`` — B sequences of 16-token
    prompts decoding, steady cycles only (``splitspec.measure.tune.steady_round``) — calling ``save`` after each; no
    row starts after ``a.budget_s`` s of the script's time (those go to ``res["skipped"]``); nothing to do: no load."""
    import torch

    from splitspec.build.synthetic import write_synthetic_engines
    from splitspec.engine.group import Group
    from splitspec.measure.tune import row, steady_round
    from splitspec.runtime.scheduler import SpeculativeEngine
    from splitspec.settings import ServeConfig

    rows_to_do = [t for t in todo(a, res["rows"]) if only is None or only(t)]
    if not rows_to_do:
        return
    B_max, seq = max(a.batches), a.max_seq_len
    tmp = Path(tempfile.mkdtemp(prefix="full-depth-rank-"))
    atexit.register(shutil.rmtree, tmp, True)  # whatever stops the load (the finally below removes it sooner)
    eng_dir = write_synthetic_engines(tmp / "engines", num_layers=a.layers, tp_size=a.tp, dtype="int4",
                                      max_batch_size=B_max, max_seq_len=seq, max_draft_len=max(8, max(a.ks)), tiny=a.dry_run)
    cfg = ServeConfig.from_env(engines_dir=eng_dir, target_device_ids=() if a.dry_run else (0,), padded=a.dry_run,
                               num_draft_tokens=0, max_batch_size=B_max, kv_tokens=B_max * seq,
                               synthetic_acceptance=KIMI_DRAFTER_PROFILE)
    placements = (1, a.tp) if a.tp > 1 else (1,)
    print(f"{elapsed()} {len(rows_to_do)} rows to measure; loading rank 0 of TP{a.tp}, {a.layers} layers, INT4 experts "
          "(weights drawn on the device) ...", flush=True)
    group = Group(cfg, placements, fake_peers=True)
    try:
        if torch.cuda.is_available() and not a.dry_run:
            free, total = (round(b / 2**30, 1) for b in torch.cuda.mem_get_info())
            res["gpu_memory_gib"] = {"allocated": round(torch.cuda.memory_allocated() / 2**30, 1), "free": free, "total": total}
        print(f"{elapsed()} loaded; GPU memory (GiB): {res.get('gpu_memory_gib', 'none')}", flush=True)
        save()
        prompts = [[1 + i] * PROMPT_TOKENS for i in range(B_max)]
        with SpeculativeEngine(group) as eng:
            eng.switch_after = 1  # the row's placement drafts from its first drafting cycle (no K/V to move then)
            for B, k, dtp in rows_to_do:
                if time.monotonic() - START > a.budget_s:
                    res["skipped"].append({"batch": B, "k": k, "draft_tp": dtp})
                    continue
                eng.draft_tp_for = lambda batch, d=dtp or placements[0]: d
                samples = steady_round(eng, prompts[:B], k, a.cycles, WARMUP)
                if not samples:
                    raise RuntimeError(f"batch {B}, k {k}: no steady cycle (--max-seq-len {a.max_seq_len} too small?)")
                r = {"draft_tp": dtp} | row(B, k, [samples])
                res["rows"].append(r)
                print(f"{elapsed()} B={B:>2} k={k} {placement_name(dtp, a.tp):>22}: cycle {r['cycle_ms']:7.2f} ms "
                      f"(draft {r['draft_ms']:.2f}, verify {r['verify_ms']:.2f}; {r['n']} cycles)", flush=True)
                save()
    finally:
        group.close()
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    global START
    START = time.monotonic()  # --budget-s counts from here (a caller's process may be old)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--layers", type=int, default=61, help="target layers (1 dense + MoE)")
    ap.add_argument("--tp", type=int, default=8, help="the target's TP size; rank 0 runs here")
    ap.add_argument("--batches", default="1,4,16", help="comma list of batch sizes")
    ap.add_argument("--ks", default="0-5", help="draft lengths: a comma list or a range A-B (0 must be among them)")
    ap.add_argument("--cycles", type=int, default=16, help="steady cycles timed per row")
    ap.add_argument("--max-seq-len", type=int, default=512, help="the engine's max_seq_len (KV: max batch × this)")
    ap.add_argument("--budget-s", type=float, default=420, help="start no row after this many seconds of the script")
    ap.add_argument("--allreduce", choices=("auto", "lab", "measure"), default="auto",
                    help="collective latencies: measured here (auto: with ≥ 2 GPUs) or the lab's 2 × H200 figures")
    ap.add_argument("--model-from", type=Path, default=LAB_MODEL, help="gpu_bench result calibrating the full-depth model")
    ap.add_argument("--resume", action="store_true", help="keep the rows of OUT/full_depth_rank.json (same --layers, --tp) "
                    "and measure only the missing ones (after a time-out)")
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes: checks the script, measures nothing useful")
    ap.add_argument("--out", type=Path, default=Path("bench/results/full_depth_rank"), help="results folder")
    a = parse_grid(ap, ap.parse_args(argv))
    check_rank(ap, a, PROMPT_TOKENS)
    if a.model_from is not None and (a.model_from != LAB_MODEL or a.model_from.exists()):
        try:
            json.loads(a.model_from.read_text())
        except (OSError, ValueError) as e:
            ap.error(f"--model-from {a.model_from}: expected a bench/gpu_bench.py result ({type(e).__name__}: {e})")
    os.environ.update(NO_NVLINK_MULTICAST)
    import torch

    from splitspec.measure.machine import git_commit

    ngpu = 0 if a.dry_run else torch.cuda.device_count()
    res = {"label": LABEL, "layers": a.layers, "tp": a.tp, "dry_run": a.dry_run, "argv": sys.argv[1:] if argv is None else argv,
           "machine": {"gpus": [torch.cuda.get_device_name(i) for i in range(ngpu)] or ["cpu"], "torch": torch.__version__,
                       "python": sys.version.split()[0], "git": git_commit()},
           "acceptance_profile": KIMI_DRAFTER_PROFILE, "rows": [], "skipped": [], "full": [], "best": [], "model_errors": []}
    earlier = a.out / "full_depth_rank.json"
    if a.resume and earlier.exists():
        try:
            old = json.loads(earlier.read_text())
            kept = [r for r in old["rows"] if r["batch"] in a.batches and r["k"] in a.ks]
        except (OSError, ValueError, KeyError, TypeError) as e:
            ap.error(f"--resume: {earlier} is not a result of this script ({type(e).__name__}: {e})")
        if (old.get("layers"), old.get("tp"), old.get("dry_run")) != (a.layers, a.tp, a.dry_run):
            ap.error(f"--resume: {earlier} holds layers {old.get('layers')}, TP{old.get('tp')}, dry run {old.get('dry_run')}")
        res["rows"], res["resumed"] = kept, {"from": str(earlier), "rows": len(kept), "argv": old.get("argv")}
        print(f"{elapsed()} resuming: {len(kept)} rows of {earlier} kept (from another engine load)", flush=True)
    if a.allreduce == "measure" or (a.allreduce == "auto" and ngpu > 1):
        from lab.gpu_kernels import allreduce

        print(f"{elapsed()} all-reduce on {min(ngpu, a.tp)} GPUs ...", flush=True)
        res["allreduce"] = allreduce(min(ngpu, a.tp)) | {"source": f"measured here, {min(ngpu, a.tp)} GPUs, in a CUDA graph"}
    else:
        section = json.loads(LAB_ALLREDUCE.read_text())["allreduce"]
        res["allreduce"] = section | {"source": f"{section['world']} × H200 NVLink, in a CUDA graph, from "
                                                f"{LAB_ALLREDUCE.relative_to(REPO)} (an 8-GPU all-reduce costs more: a lower bound)"}
    points = allreduce_points(res["allreduce"])
    models = models_from(a.model_from if a.model_from and a.model_from.exists() else None, a.tp)
    a.out.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        from splitspec.build.synthetic import kimi_k2_drafter, kimi_k2_target

        t, d = kimi_k2_target(a.layers), kimi_k2_drafter(a.layers)
        dims = {"hidden": t.hidden_size, "vocab": t.vocab_size, "draft_vocab": d.draft_vocab_size}
        res["full"] = full_depth(res["rows"], points, a.tp, a.layers, dims)
        res["best"], res["model_errors"] = best_k(res["full"]), model_errors(res["full"], models, a.tp, a.layers)
        res["elapsed_s"] = round(time.monotonic() - START, 1)
        write_json(res, a.out / "full_depth_rank.json")

    try:
        measure_rows(a, res, save)
    except Exception as e:  # keep what was measured; the report says what stopped it
        res["error"] = f"{type(e).__name__}: {e}"
        res["trace"] = traceback.format_exc()[-3000:]
        print(res["trace"], flush=True)
    save()
    text = report(res) + (f"\nStopped: {res['error']}\n" if "error" in res else "") + (
        f"\nNot measured (past --budget-s {a.budget_s:.0f}): {res['skipped']}\n" if res["skipped"] else "")
    print(text, flush=True)
    write_atomic(a.out / "full_depth_rank.md", text)
    if res["full"]:
        try:
            print(f"plot: {plot(res, a.out / 'full_depth_rank.png')}")
        except ImportError as e:  # a GPU image without matplotlib: the JSON and the report are written already
            print(f"no plot ({e})")
    print(f"{elapsed()} done → {a.out / 'full_depth_rank.json'}", flush=True)
    return 1 if "error" in res or not res["rows"] else 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)  # leftover compile workers or NCCL threads must not hold the process open
