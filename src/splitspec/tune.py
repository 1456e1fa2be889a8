"""``splitspec tune``: measure draft placement × k per batch bucket on this machine and keep the best.

For each draft placement (draft_tp = 1, the split placement, and draft_tp = N, sharded over the target's
group), each batch bucket B and each k, keeps B sequences decoding (prompts from the evaluation set, greedy,
real acceptance of the engines' drafter — or a synthetic acceptance profile, labelled) and times steady
cycles: every sequence decoding, no prefill, CUDA graphs captured. k is what a cycle's cost and yield depend
on, so steady cycles are what the choice is about (admission and prefill cost the same whatever k is).
Tokens/s = tokens emitted per cycle / median cycle time. The placement that wins at the smallest bucket is
kept (placement is fixed per deployment); for each bucket the fastest k under that placement is chosen, and
k = 0 (speculation off) wherever speculation does not beat it. ``verify`` measures everything a second time
and scores the choice against that independent exhaustive sweep. Written atomically to
``engines_dir/tuning.json``, which ``SpeculativeEngine.load`` reads.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

from splitspec.engine import read_engine_meta
from splitspec.generate import encode_prompt, read_prompts
from splitspec.runtime import Request, SpeculativeEngine


def steady_cycles(eng: SpeculativeEngine, prompts: list[list[int]], B: int, k: int, cycles: int = 12, warmup: int = 3) -> dict | None:
    """Decode B sequences (``prompts`` token ids, cycled) with k draft tokens; time ``cycles`` steady cycles
    after ``warmup`` ones (graph capture). Returns a row: cycle_ms (median, wall ms of ``eng.step()``),
    cycle_ms_mean, draft_ms / verify_ms (means), tokens_per_cycle, tokens_per_s (aggregate), acceptance_length
    (tokens per sequence per cycle), n (cycles timed); None if no steady cycle happened."""
    stats, prev = [], eng.on_cycle
    eng.on_cycle = stats.append
    # every sequence runs at least cycles + warmup + 3 cycles, whatever is accepted
    max_tokens = (cycles + warmup + 3) * (k + 1) + 8
    try:
        for i in range(B):
            eng.submit(Request(prompts[i % len(prompts)], max_tokens, num_draft_tokens=k, stop_token_ids=set()))
        times = []
        while eng.has_work():
            t0 = time.perf_counter()
            eng.step()
            times.append((time.perf_counter() - t0) * 1e3)
    finally:
        eng.on_cycle = prev
    steady = [(t, s) for t, s in zip(times, stats) if s.decode_seqs == B and s.prefill_tokens == 0][warmup:warmup + cycles]
    if not steady:
        return None
    wall = sorted(t for t, _ in steady)[len(steady) // 2]  # median: host jitter spikes are not the configuration's cost
    emitted = sum(sum(s.emitted) for _, s in steady) / len(steady)
    return {"batch": B, "k": k, "cycle_ms": wall, "cycle_ms_mean": sum(t for t, _ in steady) / len(steady),
            "draft_ms": sum(s.draft_ms for _, s in steady) / len(steady), "verify_ms": sum(s.verify_ms for _, s in steady) / len(steady),
            "tokens_per_cycle": emitted, "tokens_per_s": emitted / wall * 1e3, "acceptance_length": emitted / B, "n": len(steady)}


def measure(engines_dir: Path, draft_tp: int, batches: list[int], ks: list[int], prompts: list[str], max_seq_len: int,
            device_ids: list[int] | None, synthetic: list[float] | None, cycles: int = 12) -> list[dict]:
    """Steady-cycle rows (see :func:`steady_cycles`) for every (B, k) at one placement; one engine load."""
    rows = []
    with SpeculativeEngine.load(engines_dir, target_device_ids=device_ids, draft_tp=draft_tp, num_draft_tokens=0,
                                max_batch_size=max(batches), kv_tokens=max(batches) * max_seq_len, synthetic_acceptance=synthetic) as eng:
        tok = eng.tokenizer
        encode = (lambda p: encode_prompt(tok, p)) if tok else (lambda p: [1 + (ord(c) % 200) for c in str(p)])
        ids = [encode(p)[-(max_seq_len // 2):] for p in prompts]
        for B in batches:
            for k in ks:
                row = steady_cycles(eng, ids, B, k, cycles)
                if row is None:
                    continue
                rows.append({"draft_tp": draft_tp} | row)
                print(f"  draft_tp={draft_tp} B={B:>3} k={k}: {row['tokens_per_s']:8.1f} tok/s, cycle {row['cycle_ms']:.2f} ms, "
                      f"acceptance {row['acceptance_length']:.2f}", flush=True)
    return rows


def choose(rows: list[dict], batches: list[int]) -> dict:
    """Placement winning at the smallest bucket; per bucket, the fastest k under it (0 if speculation loses)."""
    best = lambda rs: max(rs, key=lambda r: r["tokens_per_s"])  # noqa: E731
    placement = best([r for r in rows if r["batch"] == min(batches)])["draft_tp"]
    k_by_batch = {}
    for B in batches:
        mine = [r for r in rows if r["batch"] == B and r["draft_tp"] == placement]
        top, off = best(mine), next(r for r in mine if r["k"] == 0)
        k_by_batch[str(B)] = top["k"] if top["tokens_per_s"] > off["tokens_per_s"] else 0
    return {"draft_tp": placement, "k_by_batch": k_by_batch}


def score(choice: dict, rows: list[dict], batches: list[int]) -> dict:
    """Per bucket, the chosen configuration's tokens/s in ``rows`` over the best of ``rows`` (every placement
    and k) and over no speculation."""
    out = {}
    for B in batches:
        mine = [r for r in rows if r["batch"] == B]
        pick = lambda dtp, k: next(r for r in mine if r["draft_tp"] == dtp and r["k"] == k)  # noqa: E731
        top = max(mine, key=lambda r: r["tokens_per_s"])
        chosen = pick(choice["draft_tp"], int(choice["k_by_batch"][str(B)]))
        out[str(B)] = {"chosen_tokens_per_s": chosen["tokens_per_s"], "best": {k: top[k] for k in ("draft_tp", "k", "tokens_per_s")},
                       "chosen_over_best": chosen["tokens_per_s"] / top["tokens_per_s"],
                       "chosen_over_no_speculation": chosen["tokens_per_s"] / pick(choice["draft_tp"], 0)["tokens_per_s"]}
    return out


def tune(engines_dir: Path, batches: list[int], ks: list[int], prompts_file: Path, max_seq_len: int = 512,
         device_ids: list[int] | None = None, synthetic: list[float] | None = None, verify: bool = False) -> dict:
    """Measure, choose, write ``engines_dir/tuning.json``; return the choice (with ``verification`` when asked).

    Raises ConfigError for an empty batch or k list or a bad prompts file."""
    from splitspec.errors import ConfigError

    if not batches or min(batches) < 1 or not ks or min(ks) < 0 or 0 not in ks:
        raise ConfigError(f"tune: batches must be ≥ 1 and k ≥ 0 with 0 among them (got batches {batches}, k {ks})")
    engines_dir = Path(engines_dir)
    tp = int(read_engine_meta(engines_dir / "target", "target")["mapping"]["tp_size"])
    prompts = read_prompts(prompts_file)

    def sweep(label: str) -> list[dict]:
        rows = []
        for dtp in sorted({1, tp}):
            print(f"{label}: draft_tp={dtp} ...", flush=True)
            rows += measure(engines_dir, dtp, batches, ks, prompts, max_seq_len, device_ids, synthetic)
        return rows

    rows = sweep("measuring")
    choice = choose(rows, batches)
    detail = score(choice, rows, batches)
    for B, s in detail.items():
        if s["chosen_over_best"] < 0.95:
            print(f"note: at batch {B} the kept placement (draft_tp={choice['draft_tp']}, chosen at the smallest bucket) gives "
                  f"×{s['chosen_over_best']:.2f} of this sweep's best (draft_tp={s['best']['draft_tp']}, k={s['best']['k']}); "
                  "on a noisy machine, re-run with --verify")
    result = choice | {"measured": rows, "detail": detail, "synthetic_acceptance": synthetic,
                       "date": time.strftime("%Y-%m-%d %H:%M"), "machine": os.uname().machine}
    if verify:
        again = sweep("verifying (an independent second sweep)")
        result["verification"] = {"measured": again, "score": score(choice, again, batches)}
        for B, s in result["verification"]["score"].items():
            print(f"verify B={B}: chosen {s['chosen_tokens_per_s']:.1f} tok/s = ×{s['chosen_over_best']:.3f} of the sweep's best "
                  f"(draft_tp={s['best']['draft_tp']}, k={s['best']['k']}), ×{s['chosen_over_no_speculation']:.2f} over no speculation")
    fd, tmp = tempfile.mkstemp(dir=engines_dir, prefix=".tuning.", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(result, f, indent=2)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)  # like the engine files (mkstemp makes it private)
    os.replace(tmp, engines_dir / "tuning.json")
    print(f"tuned: draft_tp={choice['draft_tp']}, k by batch bucket {choice['k_by_batch']} → {engines_dir / 'tuning.json'}")
    return result
