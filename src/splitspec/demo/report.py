"""What the demo's training prints and plots: progress lines, text loss curves, PNGs, the summary.

The PNGs land next to the trained models: :data:`LOSS_PNG` (target and drafter training loss, the
drafter's per-draft-step loss and top-1 agreement) and :data:`ACCEPTANCE_PNG` (acceptance by draft
position, measured with the real engines).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

LOSS_PNG = "training_loss.png"
ACCEPTANCE_PNG = "acceptance_by_position.png"


def log(msg: str) -> None:
    """One progress line of ``splitspec demo-models``."""
    print(f"[demo-models] {msg}", flush=True)


def _smooth(values: list[float], window: int) -> np.ndarray:
    v = np.asarray(values, dtype=np.float64)
    if len(v) == 0 or window <= 1:
        return v
    k = np.ones(min(window, len(v))) / min(window, len(v))
    return np.convolve(v, k, mode="valid")


def text_curve(values: list[float], width: int = 60, label: str = "") -> str:
    """A one-line sparkline of ``values`` (smoothed, resampled to ``width``) with first/last values."""
    v = _smooth(values, max(1, len(values) // width))
    if len(v) == 0:
        return f"{label}: (no data)"
    idx = np.linspace(0, len(v) - 1, min(width, len(v))).round().astype(int)
    v = v[idx]
    lo, hi = float(v.min()), float(v.max())
    bars = "▁▂▃▄▅▆▇█"
    line = "".join(bars[int((x - lo) / (hi - lo + 1e-12) * (len(bars) - 1))] for x in v)
    return f"{label:>16} {v[0]:7.3f} {line} {v[-1]:7.3f}"


def _pyplot():
    """matplotlib.pyplot on the Agg backend, or None when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def plot_acceptance(acc: dict[str, Any], prompts: int | str, path: Path) -> bool:
    """Bar chart of acceptance by draft position (``acc`` as :func:`splitspec.demo.acceptance.speculative_acceptance`
    returns it, over ``prompts`` prompts) written to ``path``. Returns False when matplotlib is missing."""
    plt = _pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(6, 4))
    pos = np.arange(1, len(acc["per_position"]) + 1)
    ax.bar(pos, acc["per_position"], color="C2")
    for x, y in zip(pos, acc["per_position"]):
        ax.text(x, y + 0.01, f"{y:.2f}", ha="center")
    ax.set(ylim=(0, 1.05), xticks=pos, xlabel="draft position", ylabel="fraction of cycles accepted",
           title=f"{prompts} held-out prompts, k={acc['k']}: acceptance length {acc['acceptance_length']:.2f}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def save_plots(report: dict[str, Any], folder: Path) -> list[str]:
    """Write :data:`LOSS_PNG` (target and drafter training loss) and :data:`ACCEPTANCE_PNG`
    (acceptance by draft position) into ``folder``. Returns the file names written (none, with a
    notice, when matplotlib is missing)."""
    plt = _pyplot()
    if plt is None:
        log("matplotlib is not installed: skipping the PNG plots (pip install matplotlib)")
        return []
    written = []
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.2))
    t = report["target"]
    w = max(1, len(t["loss"]) // 50)
    axes[0].plot(t["loss"], color="0.8", lw=0.8, label="per step")
    axes[0].plot(np.arange(len(_smooth(t["loss"], w))) + w - 1, _smooth(t["loss"], w), color="C0", label=f"mean of {w}")
    if t.get("heldout_loss") is not None:
        axes[0].axhline(t["heldout_loss"], color="C3", ls="--", label=f"held-out {t['heldout_loss']:.3f}")
    axes[0].set(title="target: next-token cross-entropy", xlabel="step", ylabel="nats / token")
    axes[0].legend()
    d = report["drafter"]
    for ax, key, title, ylabel in ((axes[1], "step_loss", "drafter: cross-entropy vs the target's distribution",
                                    "nats / token (≥ the target's entropy)"),
                                   (axes[2], "step_acc", "drafter: top-1 agreement with the target (training)",
                                    "fraction of rows")):
        v = np.asarray(d[key]) if d[key] else np.zeros((0, 1))
        w = max(1, len(v) // 50)
        for s in range(v.shape[1]):
            ax.plot(np.arange(len(_smooth(list(v[:, s]), w))) + w - 1, _smooth(list(v[:, s]), w), label=f"draft step {s + 1}")
        ax.set(title=title, xlabel="step", ylabel=ylabel)
        ax.legend()
    fig.tight_layout()
    fig.savefig(folder / LOSS_PNG, dpi=100)
    plt.close(fig)
    written.append(LOSS_PNG)
    acc = report.get("acceptance")
    if acc:
        plot_acceptance(acc, acc.get("prompts", ""), folder / ACCEPTANCE_PNG)
        written.append(ACCEPTANCE_PNG)
    return written


def print_summary(report: dict[str, Any]) -> None:
    """Print the loss curves (text sparklines), held-out loss, acceptance and timings of a report."""
    t, d, acc = report["target"], report["drafter"], report.get("acceptance")
    log("loss curves (nats/token, first → last):")
    print(text_curve(t["loss"], label="target"), flush=True)
    print(text_curve(d["loss"], label="drafter (TTT)"), flush=True)
    sl = np.asarray(d["step_loss"])
    for s in range(sl.shape[1] if sl.ndim == 2 else 0):
        print(text_curve(list(sl[:, s]), label=f"  draft step {s + 1}"), flush=True)
    log(f"target: final loss {t['final_loss']:.3f}, held-out loss {t['heldout_loss']:.3f}; drafter: final loss "
        f"{d['final_loss']:.3f}, training accuracy by draft step " + " ".join(f"{a:.2f}" for a in d["final_step_acc"]))
    if acc:
        log(f"speculative decoding on {acc['prompts']} held-out prompts, k={acc['k']}: mean acceptance length "
            f"{acc['acceptance_length']:.2f}; accepted by position " + " ".join(f"{a:.2f}" for a in acc["per_position"]))
    log("timings: " + ", ".join(f"{k[:-2]} {v:.0f} s" for k, v in report["timings"].items()))
