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
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))
from splitspec.errors import CheckpointError
from splitspec.files import read_json, write_json


def expected_tokens(profile: list[float], k: int) -> float:
    """1 + Σ_{i=1..k} Π_{j≤i} p_j: tokens per cycle with conditional acceptance p_j at draft position j."""
    total, run = 1.0, 1.0
    for p in profile[:k]:
        run *= p
        total += run
    return total


def _number(value, where: str) -> float:
    """``value`` as a finite float, else CheckpointError naming ``where``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise CheckpointError(f"{where}: expected a finite number, got {value!r}")
    return float(value)


def bounds_of(draft: dict, drafter: str | None) -> dict[tuple[int, int], float]:
    """{(batch, k): bound_ms} of one drafter of a draft_profile.py result (``drafter``: its name; None: the only one)."""
    drafters = draft.get("drafters")
    if not isinstance(drafters, dict) or not drafters:
        raise CheckpointError("the draft file has no 'drafters' object (expected a draft_profile.py result)")
    if drafter is None and len(drafters) > 1:
        raise CheckpointError(f"the draft file profiles {len(drafters)} drafters: pick one with --drafter "
                              f"({', '.join(map(repr, drafters))})")
    name = drafter if drafter is not None else next(iter(drafters))
    if name not in drafters:
        raise CheckpointError(f"--drafter {name!r}: the draft file has {', '.join(map(repr, drafters))}")
    return {(r["batch"], r["k"]): _number(r["bound_ms"], f"draft {name!r} batch {r['batch']} k {r['k']} bound_ms")
            for r in drafters[name]["rows"]}


def ceilings(tune: dict, draft: dict, batch: int, ratios: list[float], drafter: str | None = None) -> dict:
    """{"width free" | "verify as measured": [{"k", "E", "×bound r": speed-up, …}]} (see the module docstring);
    "measured" is the row's pooled tokens/s over the k = 0 row's (the tuner's own ratio)."""
    rows = {r["k"]: r for r in tune["tune"]["tuner_rows"] if r["batch"] == batch and r["draft_tp"] == 1}
    profile = [_number(p, "synthetic_acceptance") for p in tune["tune"]["choice"]["synthetic_acceptance"]]
    bounds = {k: b for (b_, k), b in bounds_of(draft, drafter).items() if b_ == batch}
    ks = sorted(set(rows) & set(bounds) - {0})
    if 0 not in rows or not ks:
        raise CheckpointError(f"batch {batch}: the tune file needs its k = 0 row and a k > 0 that the draft file bounds "
                              f"(tune k {sorted(rows)}, draft k {sorted(bounds)})")

    def measured(k: int) -> dict[str, float]:
        """The tuner row's figures this uses, each checked once: finite, > 0 (draft_ms ≥ 0), the cycle ≥ its parts."""
        r, got = rows[k], {}
        for name in ("cycle_ms", "verify_ms", "draft_ms", "tokens_per_s_pooled"):
            v = _number(r.get(name, r.get("tokens_per_s")) if name == "tokens_per_s_pooled" else r[name],
                        f"tune batch {batch} k {k} {name}")
            if v < 0 or (v == 0 and name != "draft_ms"):
                raise CheckpointError(f"tune batch {batch} k {k} {name}: expected > 0, got {v}")
            got[name] = v
        if got["cycle_ms"] < got["verify_ms"] + got["draft_ms"]:
            raise CheckpointError(f"tune batch {batch} k {k}: cycle_ms is less than verify_ms + draft_ms")
        return got

    m = {k: measured(k) for k in (0, *ks)}
    base = m[0]
    out = {}
    for form in ("width free", "verify as measured"):
        table = []
        for k in ks:
            r = m[k]
            rest = r["cycle_ms"] - r["verify_ms"] - r["draft_ms"]
            verify = base["verify_ms"] if form == "width free" else r["verify_ms"]
            e = expected_tokens(profile, k)
            table.append({"k": k, "E": e, "draft_bound_ms": bounds[k], "verify_ms": verify, "rest_ms": rest,
                          "measured": r["tokens_per_s_pooled"] / base["tokens_per_s_pooled"]}
                         | {f"×bound {q:g}": e * base["cycle_ms"] / (q * bounds[k] + verify + rest) for q in ratios})
        out[form] = table
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tune", required=True, help="bench/gpu_bench.py --tune result (JSON)")
    ap.add_argument("--draft", required=True, help="bench/lab/draft_profile.py result (JSON) at the same batch")
    ap.add_argument("--drafter", help="the draft file's drafter to take the bounds of (needed when it holds several)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--ratios", default="1,1.25", help="comma list: the draft phase at these multiples of its bound")
    ap.add_argument("--json", help="write the tables here")
    a = ap.parse_args()
    try:
        ratios = [float(q) for q in a.ratios.split(",")]
        if not all(math.isfinite(q) and q > 0 for q in ratios):
            raise ValueError
    except ValueError:
        sys.exit(f"speedup_ceiling: --ratios {a.ratios!r}: expected a comma list of positive numbers")
    try:
        res = ceilings(read_json(Path(a.tune)), read_json(Path(a.draft)), a.batch, ratios, a.drafter)
    except CheckpointError as e:
        sys.exit(f"speedup_ceiling: {e}")
    except (KeyError, TypeError, AttributeError) as e:
        sys.exit(f"speedup_ceiling: {a.tune} / {a.draft}: not a gpu_bench.py --tune result and a draft_profile.py "
                 f"result ({type(e).__name__}: {e})")
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
        try:
            write_json(res, Path(a.json))
        except OSError as e:
            sys.exit(f"speedup_ceiling: --json {a.json}: cannot write ({e.strerror or e})")


if __name__ == "__main__":
    main()
