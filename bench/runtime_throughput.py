#!/usr/bin/env python3
"""Runtime benchmark: tokens/s at several concurrencies, draft lengths and both draft placements.

Runs in this process (no Triton): for each draft placement (draft_tp = 1 and = the target's TP size),
each k and each concurrency, keeps `concurrency` requests in flight over the evaluation prompts
(closed loop) and reports aggregate tokens/s, mean per-user tokens/s, mean acceptance length,
per-position acceptance and draft / verify ms per cycle. Greedy; every output is checked against
k = 0 output. Writes JSON + PNG plots to bench/results/runtime-<timestamp>/.

    .venv/bin/python bench/runtime_throughput.py --engines engines/demo
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import time
from pathlib import Path

import torch

from splitspec.measure.closed_loop import run_closed_loop
from splitspec.measure.prompts import encode_prompt, read_prompts
from splitspec.runtime.scheduler import SpeculativeEngine
from splitspec.runtime.types import Request
from splitspec.settings import ServeConfig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", default="engines/demo")
    ap.add_argument("--prompts", default="eval/prompts.jsonl")
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("-k", default="0,2,4")
    ap.add_argument("--draft-tp", default=None, help="comma list (default: 1 and the target's TP size)")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--requests-per-level", type=int, default=16, help="requests per measurement (at least the concurrency)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    engines = Path(a.engines)
    tp = json.loads((engines / "target" / "engine.json").read_text())["mapping"]["tp_size"]
    placements = [int(x) for x in a.draft_tp.split(",")] if a.draft_tp else sorted({1, tp})
    ks = [int(x) for x in a.k.split(",")]
    concs = [int(x) for x in a.concurrency.split(",")]
    prompts = read_prompts(Path(a.prompts))
    rows, reference = [], {}
    out = Path(a.out or f"bench/results/runtime-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    for dtp in placements:
        cfg = ServeConfig.from_env(engines_dir=engines, draft_tp=dtp, max_batch_size=max(concs), kv_tokens=max(concs) * 512)
        with SpeculativeEngine.load(cfg) as eng:
            tok = eng.tokenizer
            cycles: list = []
            eng.on_cycle = cycles.append
            run_closed_loop(eng, [Request(encode_prompt(tok, prompts[0]), 8, num_draft_tokens=max(ks))], 1)  # warm-up
            for k in ks:
                for c in concs:
                    n = max(a.requests_per_level, c)
                    reqs = [Request(encode_prompt(tok, prompts[i % len(prompts)]), a.max_tokens, num_draft_tokens=k, stop_token_ids=set())
                            for i in range(n)]
                    cycles.clear()
                    res, wall = run_closed_loop(eng, reqs, c)
                    for i, r in enumerate(res):
                        key = i % len(prompts)
                        if reference.setdefault(key, r.token_ids) != r.token_ids:
                            raise SystemExit(f"greedy output differs from the first run for prompt {key} (k={k}, draft_tp={dtp})")
                    toks = sum(r.stats.num_output_tokens for r in res)
                    ncyc = sum(r.stats.num_cycles for r in res)
                    acc = [sum(r.stats.accepted_per_position[i] for r in res) / max(ncyc, 1) for i in range(k)]
                    dec = [cs for cs in cycles if cs.decode_seqs]
                    row = {"draft_tp": dtp, "k": k, "concurrency": c, "requests": n, "tokens": toks, "wall_s": wall,
                           "tokens_per_s": toks / wall,
                           "tokens_per_s_per_user": sum(r.stats.tokens_per_s for r in res) / n,
                           "acceptance_length": sum(r.stats.acceptance_length * r.stats.num_cycles for r in res) / max(ncyc, 1),
                           "acceptance_by_position": acc,
                           "draft_ms_per_cycle": sum(cs.draft_ms for cs in dec) / max(len(dec), 1),
                           "verify_ms_per_cycle": sum(cs.verify_ms for cs in dec) / max(len(dec), 1),
                           "mean_ttft_ms": sum(r.stats.ttft_ms for r in res) / n}
                    rows.append(row)
                    print(f"draft_tp={dtp} k={k} c={c:>2}: {row['tokens_per_s']:7.1f} tok/s aggregate, "
                          f"{row['tokens_per_s_per_user']:6.1f} tok/s/user, acceptance {row['acceptance_length']:.2f}, "
                          f"draft {row['draft_ms_per_cycle']:.1f} ms + verify {row['verify_ms_per_cycle']:.1f} ms per cycle", flush=True)
    base = {(r["concurrency"]): r["tokens_per_s"] for r in rows if r["k"] == 0 and r["draft_tp"] == placements[0]}
    for r in rows:
        r["speedup_vs_k0"] = r["tokens_per_s"] / base[r["concurrency"]]
    meta = {"machine": platform.processor() or platform.machine(), "cpus": torch.get_num_threads(), "torch": torch.__version__,
            "engine": json.loads((engines / "target" / "engine.json").read_text())["limits"], "target_tp": tp,
            "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip(),
            "date": time.strftime("%Y-%m-%d %H:%M"), "max_tokens": a.max_tokens, "prompts": str(a.prompts)}
    (out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    plot(rows, out / "tokens_per_s.png")
    c1 = {(r["draft_tp"], r["k"]): r for r in rows if r["concurrency"] == min(concs)}
    k0 = c1[(placements[0], 0)]["tokens_per_s"]
    print(f"\nconcurrency {min(concs)}: " + ", ".join(f"draft_tp={d} k={k}: ×{r['tokens_per_s'] / k0:.2f}" for (d, k), r in c1.items()))
    hi = [r for r in rows if r["k"] == 0 and r["draft_tp"] == placements[0]]
    print(f"k=0 aggregate throughput, concurrency {max(concs)} vs {min(concs)}: ×{hi[-1]['tokens_per_s'] / hi[0]['tokens_per_s']:.2f}")
    print(f"results: {out}/results.json, {out}/tokens_per_s.png")


def plot(rows: list[dict], path: Path) -> None:
    """Aggregate tokens/s against k, one line per (placement, concurrency)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for dtp in sorted({r["draft_tp"] for r in rows}):
        for c in sorted({r["concurrency"] for r in rows}):
            pts = sorted((r["k"], r["tokens_per_s"]) for r in rows if r["draft_tp"] == dtp and r["concurrency"] == c)
            ax.plot(*zip(*pts), marker="o", linestyle="-" if dtp == 1 else "--", label=f"draft_tp={dtp}, concurrency {c}")
    ax.set_xlabel("draft tokens per cycle (k)")
    ax.set_ylabel("aggregate tokens/s")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("splitspec runtime throughput (CPU)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
