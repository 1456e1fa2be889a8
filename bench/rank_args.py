"""Arguments shared by ``bench/full_depth_rank.py`` and ``bench/depth_fit.py`` (one rank of a synthetic Kimi-K2.5
engine), each checked on its own before anything loads: ``ap.error`` names the one that is wrong."""

from __future__ import annotations

import argparse
import math

#: TP sizes the synthetic engines divide by (Kimi's heads, experts and widths, and the dry run's tiny ones).
TP_SIZES = (1, 2, 4, 8)


def parse_grid(ap: argparse.ArgumentParser, a: argparse.Namespace) -> argparse.Namespace:
    """``a.ks`` ("0-5" or "0,2,4") and ``a.batches`` ("1,4,16") as lists of ints, or ``ap.error``."""
    text = a.ks
    try:
        lo, _, hi = text.partition("-")
        a.ks = list(range(int(lo), int(hi) + 1)) if hi else [int(x) for x in text.split(",")]
    except ValueError:
        ap.error(f"--ks {text!r}: expected integers, like 0-5 or 0,2,4")
    try:
        a.batches = [int(x) for x in a.batches.split(",")]
    except ValueError:
        ap.error(f"--batches {a.batches!r}: expected integers, like 1,4,16")
    if not a.ks or 0 not in a.ks or min(a.ks) < 0 or max(a.ks) > 8:
        ap.error(f"--ks {text}: expected draft lengths in 0..8, 0 among them (the no-speculation baseline)")
    if min(a.batches) < 1 or max(a.batches) > 256:
        ap.error(f"--batches {a.batches}: expected batch sizes in 1..256")
    return a


def check_rank(ap: argparse.ArgumentParser, a: argparse.Namespace, prompt_tokens: int) -> None:
    """--layers, --tp, --cycles, --max-seq-len (room for a prompt of ``prompt_tokens`` and two cycles of the largest
    k), --budget-s and --out, or ``ap.error`` naming the first that is wrong."""
    least = prompt_tokens + 2 * (max(a.ks) + 1) + 1
    parent = next((p for p in a.out.parents if p.exists()), None)
    for bad, why in ((a.layers < 2, f"--layers {a.layers}: expected ≥ 2 (one dense layer, then MoE)"),
                     (a.tp not in TP_SIZES, f"--tp {a.tp}: expected one of {', '.join(map(str, TP_SIZES))}"),
                     (a.cycles < 1, f"--cycles {a.cycles}: expected ≥ 1"),
                     (a.max_seq_len < least, f"--max-seq-len {a.max_seq_len}: expected ≥ {least} (the {prompt_tokens}-token "
                                             f"prompts and two cycles of k {max(a.ks)})"),
                     (not (math.isfinite(a.budget_s) and a.budget_s >= 0), f"--budget-s {a.budget_s}: expected seconds ≥ 0"),
                     (a.out.exists() and not a.out.is_dir(), f"--out {a.out}: a file, expected a folder"),
                     (parent is not None and not parent.is_dir(), f"--out {a.out}: {parent} is a file, not a folder")):
        if bad:
            ap.error(why)
