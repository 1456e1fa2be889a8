"""The placement benchmark's report: ``summary.md`` (one table per concurrency, the best k per placement,
the machine and engines it ran on) and the plots ``tokens_per_s.png``, ``acceptance_by_position.png`` and
``latency_cdf.png``, from the rows of :func:`splitspec.measure.placement_bench.aggregate`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from splitspec.measure.stream_client import PlacementRun

#: Label of each placement.
NO_SPEC = "no speculation"


def placement_label(draft_tp: int, k: int, baseline_tp: int | None = None) -> str:
    """``EAGLE-3, drafter TP<draft_tp>`` for k ≥ 1; for k = 0 ``no speculation``, or ``no speculation
    (beside drafter TP<draft_tp>)`` when measured on another server than ``baseline_tp``'s."""
    if k:
        return f"EAGLE-3, drafter TP{draft_tp}"
    return NO_SPEC if baseline_tp in (None, draft_tp) else f"{NO_SPEC} (beside drafter TP{draft_tp})"


def _f(v, nd: int = 1) -> str:
    return "—" if v is None else f"{v:.{nd}f}"


def summary_markdown(meta: dict, rows: Sequence[dict]) -> str:
    """The markdown summary: one table per concurrency, best k per placement, the setup."""
    eng = meta.get("engines", {})
    tgt = eng.get("target", {})
    lines = [f"# Speculation benchmark — {meta.get('date', '')}", "",
             f"- machine: {meta.get('cpu')} × {meta.get('cpu_count')} CPUs, {meta.get('memory_gib')} GiB"
             + (f"; GPUs: {', '.join(meta['gpus'])}" if meta.get("gpus") else "; no GPU")
             + f"; load average at start {meta.get('load_average')}",
             f"- versions: tritonserver {meta.get('tritonserver')}, " + ", ".join(
                 f"{k} {v}" for k, v in meta.get("versions", {}).items() if v),
             f"- commit: {(meta.get('git') or {}).get('commit')}" + (" (uncommitted changes)" if (meta.get("git") or {}).get("dirty") else ""),
             f"- engines: {eng.get('engines_dir')}; target {tgt.get('dtype')}, TP{(tgt.get('mapping') or {}).get('tp_size')}, "
             f"limits {tgt.get('limits')}; {meta.get('num_prompts')} prompts ({meta.get('prompts')}), greedy, "
             f"max_tokens {meta.get('max_tokens')}, gRPC streaming"
             + ("; SYNTHETIC acceptance " + str(meta["synthetic_acceptance"]) if meta.get("synthetic_acceptance") else ""),
             ""]
    for c in sorted({r["concurrency"] for r in rows}):
        lines += [f"## Concurrency {c}", "",
                  "| configuration | k | tokens/s per user | × no spec | aggregate tokens/s | × no spec | acceptance length "
                  "| acceptance by position | draft ms / cycle | verify ms / cycle | TTFT p50 ms | latency p50 ms |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in sorted((r for r in rows if r["concurrency"] == c), key=lambda r: (r["draft_tp"], r["k"])):
            pos = " ".join(f"{a:.2f}" for a in r["acceptance_by_position"]) or "—"
            lines.append(f"| {r['configuration']} | {r['k']} | {r['tokens_per_s_per_user']:.1f} | {_f(r['ratio_per_user'], 2)} | "
                         f"{r['tokens_per_s']:.1f} | {_f(r['ratio_aggregate'], 2)} | {r['acceptance_length']:.2f} | {pos} | "
                         f"{r['draft_ms_per_cycle']:.1f} | {r['verify_ms_per_cycle']:.1f} | {_f(r['ttft_ms_p50'], 0)} | "
                         f"{_f(r['latency_ms_p50'], 0)} |")
        best = {}
        for r in rows:
            if r["concurrency"] == c and r["k"] > 0:
                if r["draft_tp"] not in best or r["tokens_per_s_per_user"] > best[r["draft_tp"]]["tokens_per_s_per_user"]:
                    best[r["draft_tp"]] = r
        if best:
            lines += ["", "Best k per placement: " + "; ".join(
                f"{r['configuration']}: k = {r['k']}, ×{_f(r['ratio_per_user'], 2)} per user" for r in best.values()) + "."]
        lines.append("")
    mism = sum(r["outputs_differing_from_no_speculation"] for r in rows)
    lines += [f"Greedy outputs differing from no speculation (same prompt and concurrency): {mism}.", "",
              "tokens/s per user = a request's output tokens / its latency at the client (including time to first "
              "token), averaged over requests; aggregate = all output tokens / wall time. Acceptance length = tokens "
              "per target verify forward (1.00 = nothing accepted); acceptance by position i = share of cycles whose "
              "i-th draft token was accepted.", ""]
    return "\n".join(lines)


def plot_results(rows: Sequence[dict], runs: Sequence[PlacementRun], out: Path) -> list[Path]:
    """Write ``tokens_per_s.png``, ``acceptance_by_position.png`` and ``latency_cdf.png`` into ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    concs = sorted({r["concurrency"] for r in rows})
    tps = sorted({r["draft_tp"] for r in rows if r["k"] > 0})
    colours = {tp: f"C{i}" for i, tp in enumerate(tps)}

    fig, axes = plt.subplots(2, len(concs), figsize=(5.2 * len(concs), 7.5), squeeze=False)
    for j, c in enumerate(concs):
        for i, (key, label) in enumerate((("tokens_per_s_per_user", "tokens/s per user"),
                                          ("tokens_per_s", "aggregate tokens/s"))):
            ax = axes[i][j]
            for b in sorted((r for r in rows if r["concurrency"] == c and r["k"] == 0), key=lambda r: r["draft_tp"]):
                first = b["configuration"] == NO_SPEC
                ax.axhline(b[key], color="k" if first else colours.get(b["draft_tp"], "grey"),
                           linestyle="--" if first else ":", linewidth=1, label=b["configuration"])
            for tp in tps:
                pts = sorted((r["k"], r[key]) for r in rows if r["concurrency"] == c and r["draft_tp"] == tp and r["k"] > 0)
                if pts:
                    ax.plot(*zip(*pts), marker="o", color=colours[tp], label=placement_label(tp, 1))
            ax.set_xticks(sorted({r["k"] for r in rows if r["k"] > 0}))
            ax.set_xlabel("draft tokens per cycle (k)")
            ax.set_ylabel(label)
            ax.set_title(f"concurrency {c}")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    fig.suptitle("Served ensemble: tokens/s against k, per draft placement")
    fig.tight_layout()
    files.append(out / "tokens_per_s.png")
    fig.savefig(files[-1], dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(1, max(len(tps), 1), figsize=(5.2 * max(len(tps), 1), 4), squeeze=False)
    for j, tp in enumerate(tps):
        ax = axes[0][j]
        for k in sorted({r["k"] for r in rows if r["draft_tp"] == tp and r["k"] > 0}):
            recs = [x for run in runs if run.draft_tp == tp for x in run.records if x.k == k]
            cycles = sum(x.cycles for x in recs)
            if not recs or not cycles:
                continue
            acc = [sum(x.accepted_per_position[i] for x in recs if i < len(x.accepted_per_position)) / cycles
                   for i in range(k)]
            length = sum(max(x.num_output_tokens - 1, 0) for x in recs) / cycles
            ax.plot(range(1, k + 1), acc, marker="o", label=f"k = {k} (acceptance length {length:.2f})")
        ax.set_xticks(range(1, max([r["k"] for r in rows if r["draft_tp"] == tp] + [1]) + 1))
        ax.set_xlabel("draft position")
        ax.set_ylabel("share of cycles accepted")
        ax.set_ylim(0, 1.02)
        ax.set_title(placement_label(tp, 1) + " (all concurrencies)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    files.append(out / "acceptance_by_position.png")
    fig.savefig(files[-1], dpi=110)
    plt.close(fig)

    c0 = concs[0]
    chosen = [(0, None)]
    for tp in tps:
        cand = [r for r in rows if r["concurrency"] == c0 and r["draft_tp"] == tp and r["k"] > 0]
        if cand:
            chosen.append((max(cand, key=lambda r: r["tokens_per_s_per_user"])["k"], tp))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for k, tp in chosen:
        recs = [x for run in runs for x in run.records if x.concurrency == c0 and x.k == k
                and run.draft_tp == (runs[0].draft_tp if tp is None else tp)]
        label = NO_SPEC if k == 0 else f"{placement_label(tp, k)}, k = {k}"
        colour = "k" if k == 0 else colours[tp]
        for ax, vals in ((axes[0], [x.latency_ms for x in recs]), (axes[1], [x.tpot_ms for x in recs if x.tpot_ms])):
            vals = sorted(vals)
            if vals:
                ax.step([vals[0], *vals], [0.0] + [(i + 1) / len(vals) for i in range(len(vals))], where="post",
                        color=colour, label=label)
    axes[0].set_xlabel("request latency at the client (ms)")
    axes[1].set_xlabel("time per output token after the first (ms)")
    for ax in axes:
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"Latency CDF at concurrency {c0} (best k per placement)")
    fig.tight_layout()
    files.append(out / "latency_cdf.png")
    fig.savefig(files[-1], dpi=110)
    plt.close(fig)
    return files
