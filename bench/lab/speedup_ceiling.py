#!/usr/bin/env python3
"""The speed-up speculation could reach on a measured engine, if its draft phase ran at a given multiple of its
weight-bytes bound: what a target such as "×1.6 at batch 1" asks of the draft phase and of the verify.

Inputs, both measured on the same GPU: a ``bench/gpu_bench.py --tune`` result (its tuner rows at one batch size:
the no-speculation cycle, and per k the verify's ms and the cycle's rest) and a ``bench/lab/draft_profile.py``
result (the draft phase's weight-bytes bound per k at that batch). For each k:

    cycle(k) = r · draft_bound(k) + verify(k) + rest(k)      speed-up(k) = E(k) · cycle(0) / cycle(k)

with rest(k) = cycle − verify − draft of the measured row (sampling, acceptance, host), E(k) = 1 + Σ_{i≤k} Π_{j≤i} p_j
the expected tokens per cycle of the run's synthetic acceptance profile p, and verify(k) either as measured (k + 1
tokens) or as the one-token verify of k = 0 (the verify's extra width for free). r = 1 is the draft phase exactly at
its bound. Prints one table per verify form; ``--json`` writes them.

    python3 bench/lab/speedup_ceiling.py --tune docs/lab/2026-12-03-h200-branches-timed/gpu_bench_tune_tp1_m1.json \\
        --draft docs/lab/2026-12-03-h200-branches-timed/draft_profile_b1.json --batch 1
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))
from splitspec.errors import CheckpointError
from splitspec.files import read_json


def expected_tokens(profile: list[float], k: int) -> float:
    """1 + Σ_{i=1..k} Π_{j≤i} p_j: tokens per cycle with conditional acceptance p_j at draft position j."""
    total, run = 1.0, 1.0
    for p in profile[:k]:
        run *= p
        total += run
    return total


def ceilings(tune: dict, draft: dict, batch: int, ratios: list[float]) -> dict:
    """{"width free" | "verify as measured": [{"k", "E", "r": speed-up, …}]} (see the module docstring)."""
    rows = {r["k"]: r for r in tune["tune"]["tuner_rows"] if r["batch"] == batch and r["draft_tp"] == 1}
    profile = tune["tune"]["choice"]["synthetic_acceptance"]
    bounds = {r["k"]: r["bound_ms"] for d in draft["drafters"].values() for r in d["rows"] if r["batch"] == batch}
    if 0 not in rows or not bounds:
        raise CheckpointError(f"batch {batch}: the tune file needs its k = 0 row and the draft file its bounds")
    base = rows[0]
    out = {}
    for form in ("width free", "verify as measured"):
        table = []
        for k in sorted(set(rows) & set(bounds) - {0}):
            r = rows[k]
            rest = r["cycle_ms"] - r["verify_ms"] - r["draft_ms"]
            verify = base["verify_ms"] if form == "width free" else r["verify_ms"]
            e = expected_tokens(profile, k)
            table.append({"k": k, "E": e, "draft_bound_ms": bounds[k], "verify_ms": verify, "rest_ms": rest,
                          "measured": r["tokens_per_s"] / base["tokens_per_s"]}
                         | {f"×bound {q:g}": e * base["cycle_ms"] / (q * bounds[k] + verify + rest) for q in ratios})
        out[form] = table
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tune", required=True, help="bench/gpu_bench.py --tune result (JSON)")
    ap.add_argument("--draft", required=True, help="bench/lab/draft_profile.py result (JSON) at the same batch")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--ratios", default="1,1.25", help="comma list: the draft phase at these multiples of its bound")
    ap.add_argument("--json", help="write the tables here")
    a = ap.parse_args()
    try:
        ratios = [float(q) for q in a.ratios.split(",")]
    except ValueError:
        sys.exit(f"speedup_ceiling: --ratios {a.ratios!r}: expected a comma list of numbers")
    try:
        res = ceilings(read_json(Path(a.tune)), read_json(Path(a.draft)), a.batch, ratios)
    except CheckpointError as e:
        sys.exit(f"speedup_ceiling: {e}")
    except (KeyError, TypeError) as e:
        sys.exit(f"speedup_ceiling: {a.tune} / {a.draft}: field {e} missing: expected a gpu_bench.py --tune result and a "
                 "draft_profile.py result")
    for form, table in res.items():
        cols = [c for c in table[0] if c.startswith("×bound")]
        print(f"\nbatch {a.batch}, verify {form}: speed-up over no speculation")
        print(f"{'k':>2} {'E(k)':>6} {'draft bound':>11} {'verify':>7} {'rest':>6} {'measured':>9}" + "".join(f"{c:>13}" for c in cols))
        for r in table:
            print(f"{r['k']:>2} {r['E']:>6.3f} {r['draft_bound_ms']:>11.3f} {r['verify_ms']:>7.3f} {r['rest_ms']:>6.3f} "
                  f"{r['measured']:>9.3f}" + "".join(f"{r[c]:>13.3f}" for c in cols))
        for c in cols:
            best = max(table, key=lambda r: r[c])
            print(f"  best with the draft phase at {c[7:]} × its bound: ×{best[c]:.3f} at k {best['k']}")
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
