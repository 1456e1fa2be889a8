#!/usr/bin/env python3
"""Steady-cycle time of the engine alone, in this process, at batch 1 (µs per cycle, tokens/s).

Runs every prompt ``--warmup-passes`` times (default 2; CUDA graphs captured), then ``--passes`` times, one
request at a time, each to ``--max-tokens`` greedy tokens with k = ``-k``, stepping the engine on this thread.
Every call of ``SpeculativeEngine.step`` that ran a steady decode cycle (the static-shape, CUDA-graph form) is
timed with the host clock: its distribution (p50, p90, p99, mean, µs) is the figure, with the engine's own split
of those cycles into ``draft_ms`` and ``verify_ms`` (means) and the tokens/s over the passes (prefill and the
first, eager, decode cycle of each request included). ``meta.splitspec`` is the folder the engine was imported
from. On the CPU, steady cycles take their static form only with ``SPLITSPEC_PADDED=1`` (always on GPUs).

To compare two versions of the engine, run this file with each on ``PYTHONPATH`` (it uses only interfaces both
keep), then plot the results together. ``python`` is the image's ``python3`` on a GPU machine, ``.venv/bin/python``
here (engines from ``splitspec convert … --tp 1`` and ``splitspec build --out /tmp/eng``):

    git worktree add /tmp/before <commit>
    PYTHONPATH=/tmp/before/src python bench/engine_step.py --engines /tmp/eng --device-ids 0 --out results/before
    PYTHONPATH=$PWD/src       python bench/engine_step.py --engines /tmp/eng --device-ids 0 --out results/after
    python bench/engine_step.py --plot results/before/results.json results/after/results.json --png results/steps.png
    # on the CPU: SPLITSPEC_PADDED=1 and no --device-ids (the defaults take ~40 s with the demo engines)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path


def measure(a: argparse.Namespace) -> dict:
    """Load the engines, warm up, measure; returns the results (see the module docstring)."""
    import torch

    from splitspec.errors import CheckpointError, ConfigError
    from splitspec.measure.prompts import encode_prompt, read_prompts
    from splitspec.runtime.scheduler import SpeculativeEngine
    from splitspec.runtime.types import Request
    from splitspec.settings import ServeConfig, parse_ids

    cfg = ServeConfig.from_env(engines_dir=Path(a.engines), target_device_ids=parse_ids(a.device_ids, "--device-ids"),
                               draft_tp=a.draft_tp, num_draft_tokens=a.k, max_batch_size=1)
    prompts = read_prompts(Path(a.prompts))[: a.num_prompts or None]
    with SpeculativeEngine.load(cfg) as eng, torch.inference_mode():
        steady, run = [False], eng.group.run

        def noting(plan, *rest):  # whether the step's cycle ran in the steady (CUDA-graph) form
            out = run(plan, *rest)
            steady[0] = plan.padded_k is not None
            return out

        eng.group.run = noting
        if eng.tokenizer is None:
            raise CheckpointError(f"{a.engines}/target: no tokenizer files beside the engine (needed for the prompts)")
        if not prompts:
            raise ConfigError(f"{a.prompts}: no prompts")
        reqs = [encode_prompt(eng.tokenizer, p) for p in prompts]

        def passes(n: int, what: str) -> tuple[list[float], list, int, float]:
            steps, cycles, tokens = [], [], 0
            eng.on_cycle = lambda cs: steady[0] and cycles.append(cs)  # steady[0] is set before a cycle's statistics
            t0 = time.perf_counter()
            for i in range(n * len(reqs)):
                got: list[int] = []
                eng.submit(Request(reqs[i % len(reqs)], a.max_tokens, num_draft_tokens=a.k), lambda ev: got.extend(ev.token_ids))
                while eng.has_work():
                    steady[0] = False
                    t = time.perf_counter()
                    eng.step()
                    if steady[0]:
                        steps.append((time.perf_counter() - t) * 1e6)
                tokens += len(got)
                print(f"\r  {what}: request {i + 1}/{n * len(reqs)}", end="", file=sys.stderr, flush=True)
            print(file=sys.stderr)
            return steps, cycles, tokens, time.perf_counter() - t0

        passes(a.warmup_passes, "warm-up")
        steps, cycles, tokens, wall = passes(a.passes, "measuring")
    if len(steps) < 2:
        if not cfg.on_gpu and not cfg.padded:
            raise ConfigError("no steady cycles to time: on the CPU they take their static form only with SPLITSPEC_PADDED=1")
        raise ConfigError(f"{len(steps)} steady cycles measured, at least 2 needed: raise --max-tokens or --passes")
    q = statistics.quantiles(steps, n=100, method="inclusive")
    return {"steady_step_us": {"p50": statistics.median(steps), "p90": q[89], "p99": q[98], "mean": statistics.mean(steps),
                               "max": max(steps), "n": len(steps)},
            "draft_ms": statistics.mean(c.draft_ms for c in cycles), "verify_ms": statistics.mean(c.verify_ms for c in cycles),
            "split_cycles": len(cycles),
            "tokens_per_s": tokens / wall, "output_tokens": tokens, "steps_us": steps}


def summary(r: dict, label: str) -> str:
    s = r["steady_step_us"]
    return (f"{label}: steady cycle p50 {s['p50']:.0f} µs, p90 {s['p90']:.0f}, p99 {s['p99']:.0f}, mean {s['mean']:.0f} (n = {s['n']}); "
            f"draft {r['draft_ms']:.3f} ms + verify {r['verify_ms']:.3f} ms per cycle; {r['tokens_per_s']:.0f} tok/s")


def read_results(path: Path) -> dict:
    """A results file of this script; ValueError naming the file when it is not one."""
    try:
        r = json.loads(path.read_text())
        summary(r, r["meta"]["label"])  # reads every figure the plot prints
        if not isinstance(r["steps_us"], list) or not r["steps_us"]:
            raise ValueError("no steady-cycle times ('steps_us')")
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, IndexError) as e:
        raise ValueError(f"{path}: not a results file of bench/engine_step.py ({type(e).__name__}: {e})") from None
    return r


def plot(runs: list[dict], png: Path) -> None:
    """Cumulative distributions of the steady-cycle times of several runs (:func:`read_results`), one line each,
    written atomically to ``png``. Raises OSError as writing does."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from splitspec.files import write_png

    fig, ax = plt.subplots(figsize=(7, 4))
    for r in runs:
        steps = sorted(r["steps_us"])
        label = f"{r['meta']['label']}: p50 {r['steady_step_us']['p50']:.0f} µs, {r['tokens_per_s']:.0f} tok/s"
        ax.plot(steps, [(i + 1) / len(steps) for i in range(len(steps))], label=label)
        print(summary(r, r["meta"]["label"]))
    ax.set_xlabel("steady cycle, host wall time (µs)")
    ax.set_ylabel("fraction of cycles")
    ax.set_title("Engine alone, batch 1: steady-cycle time")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    print(f"plot: {write_png(fig, png)}")


def _device_ids(text: str) -> str:
    if text and not all(x.strip().isdigit() for x in text.split(",")):
        raise argparse.ArgumentTypeError(f"{text!r}: expected GPU ids such as 0 or 0,1")
    return text


def _writable_folder(p: argparse.ArgumentParser, folder: Path, what: str) -> None:
    """Refuse (usage error), before anything is measured, a folder that could not be written or created: its nearest
    existing ancestor must be a writable folder. Nothing is created here."""
    near = folder.absolute()
    while not near.exists() and near != near.parent:
        near = near.parent
    if not near.is_dir():
        p.error(f"{what} {folder}: {near} is a file")
    if not os.access(near, os.W_OK | os.X_OK):
        p.error(f"{what} {folder}: {near} is not writable")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engines", help="built engines (splitspec build)")
    p.add_argument("--device-ids", type=_device_ids, default="", help="GPU ids of the target's ranks (default: CPU)")
    p.add_argument("--draft-tp", type=int, default=1)
    p.add_argument("-k", type=int, default=4, help="draft tokens per cycle")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--prompts", default="eval/prompts.jsonl")
    p.add_argument("--num-prompts", type=int, default=0, help="the first N prompts (0: all)")
    p.add_argument("--warmup-passes", type=int, default=2)
    p.add_argument("--passes", type=int, default=3)
    p.add_argument("--label", default="", help="the run's name in summaries and plots (default: the commit)")
    p.add_argument("--out", type=Path, help="folder for results.json")
    p.add_argument("--plot", nargs="+", type=Path, metavar="RESULTS_JSON", help="plot these results files instead of measuring")
    p.add_argument("--png", type=Path, help="the plot's file (with --plot)")
    a = p.parse_args(argv)
    if a.plot:
        if not a.png or not a.png.name:
            p.error("--plot needs --png FILE")
        if a.png.is_dir():
            p.error(f"--png {a.png}: a folder")
        try:
            runs = [read_results(f) for f in a.plot]
        except ValueError as e:
            p.error(f"--plot: {e}")
        _writable_folder(p, a.png.parent, "--png: folder")
        try:
            plot(runs, a.png)
        except OSError as e:
            print(f"engine_step: {a.png}: {e.strerror or e}", file=sys.stderr)
            return 1
        return 0
    if not a.engines:
        p.error("--engines is required (or --plot)")
    for name in ("k", "max_tokens", "passes", "warmup_passes", "num_prompts"):
        if getattr(a, name) < (0 if name in ("k", "num_prompts", "warmup_passes") else 1):
            p.error(f"{'-k' if name == 'k' else '--' + name.replace('_', '-')} = {getattr(a, name)}: too small")
    if a.out is not None:
        if a.out.exists() and not a.out.is_dir():
            p.error(f"--out {a.out}: a file, expected a folder")
        if (a.out / "results.json").is_dir():
            p.error(f"--out {a.out}: results.json there is a folder")
        _writable_folder(p, a.out, "--out")
    import splitspec
    from splitspec.measure.machine import machine_info
    from splitspec.errors import SplitspecError
    from splitspec.files import write_json

    meta = machine_info()
    meta["splitspec"] = str(Path(splitspec.__file__).resolve().parent)
    meta["label"] = a.label or (meta.get("git") or {}).get("commit", "")[:7] or "engine"
    meta["settings"] = {k: str(v) if isinstance(v, Path) else v for k, v in vars(a).items() if k not in ("plot", "png")}
    try:
        r = measure(a)
        if a.out is not None:
            write_json({"meta": meta, **r}, a.out / "results.json")
    except SplitspecError as e:  # a bad engines folder, prompts file or setting: its message, no traceback
        print(f"engine_step: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"engine_step: {getattr(e, 'filename', None) or a.out}: {e.strerror or e}", file=sys.stderr)
        return 1
    print(summary(r, meta["label"]))
    if a.out is not None:
        print(f"results: {a.out / 'results.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
