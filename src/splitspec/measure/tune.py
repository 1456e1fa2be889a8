"""``splitspec tune``: measure draft placement × k per batch bucket on this machine and keep the best.

For each draft placement (draft_tp = 1, the split placement, and draft_tp = N, sharded over the target's
group), each batch bucket B and each k, keeps B sequences decoding (prompts from the evaluation set, greedy,
real acceptance of the engines' drafter — or a synthetic acceptance profile, labelled) and times steady
cycles: every sequence decoding, no prefill, CUDA graphs captured. k is what a cycle's cost and yield depend
on, so steady cycles are what the choice is about (admission and prefill cost the same whatever k is).
Tokens/s = tokens emitted per cycle / median cycle time; the configurations are timed in interleaved passes,
and each placement's engines are loaded several times, alternating with the other placement's (an engine
load's own speed varies by several percent).
Each bucket gets its fastest (placement, k), k = 0 (speculation off) wherever speculation does not beat
it; where the buckets' placements differ the engine loads both drafters and each cycle drafts with its
bucket's (:meth:`splitspec.engine.rank.RankRunner.switch_placement` moves the drafter K/V on a change).
``verify`` measures everything a second time and scores the choice against that independent exhaustive
sweep. Written atomically to ``engines_dir/tuning.json``, which
``SpeculativeEngine.load`` reads.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from splitspec.engine.engine_files import read_engine_meta
from splitspec.measure.prompts import Prompt, encode_prompt, read_prompts
from splitspec.files import write_atomic
from splitspec.runtime.scheduler import SpeculativeEngine
from splitspec.runtime.types import Request
from splitspec.settings import ServeConfig


#: What configurations are compared by: tokens/s with acceptance pooled over k (:func:`pool_acceptance`).
METRIC = "tokens_per_s_pooled"


def steady_round(eng: SpeculativeEngine, used: list[list[int]], k: int, n: int, warmup: int) -> list[tuple]:
    """One round: ``used`` (B prompts) decode with k draft tokens to their end; returns up to ``n``
    ``(wall ms of eng.step(), CycleStats)`` of steady cycles (every sequence decoding, no prefill) after
    the first ``warmup`` of them."""
    stats, times, prev = [], [], eng.on_cycle
    eng.on_cycle = stats.append
    try:
        # every sequence runs at least n + warmup + 3 cycles, whatever is accepted
        for p in used:
            eng.submit(Request(p, (n + warmup + 3) * (k + 1) + 8, num_draft_tokens=k, stop_token_ids=set()))
        while eng.has_work():
            t0 = time.perf_counter()
            eng.step()
            times.append((time.perf_counter() - t0) * 1e3)
    finally:
        eng.on_cycle = prev
    return [(t, s) for t, s in zip(times, stats) if s.decode_seqs == len(used) and s.prefill_tokens == 0][warmup:warmup + n]


def row(B: int, k: int, by_load: list[list[tuple]]) -> dict:
    """One configuration's row from its steady ``(wall ms, CycleStats)`` samples, one list per engine load:
    cycle_ms is the mean over loads of each load's median (a median: host jitter spikes are not the
    configuration's cost; a mean over loads: each load counts alike), cycle_ms_by_load those medians."""
    steady = [x for load in by_load for x in load]
    by_load_ms = [sorted(t for t, _ in load)[len(load) // 2] for load in by_load if load]
    wall = sum(by_load_ms) / len(by_load_ms)
    emitted = sum(sum(s.emitted) for _, s in steady) / len(steady)
    accepted = [sum(s.accepted_by_position[j] for _, s in steady) for j in range(k)]
    return {"batch": B, "k": k, "cycle_ms": wall, "cycle_ms_mean": sum(t for t, _ in steady) / len(steady),
            "cycle_ms_by_load": by_load_ms,
            "draft_ms": sum(s.draft_ms for _, s in steady) / len(steady), "verify_ms": sum(s.verify_ms for _, s in steady) / len(steady),
            "tokens_per_cycle": emitted, "tokens_per_s": emitted / wall * 1e3, "acceptance_length": emitted / B, "n": len(steady),
            "accepted_by_position": accepted}


def pool_acceptance(rows: list[dict]) -> list[dict]:
    """Add ``expected_acceptance_length`` and ``tokens_per_s_pooled`` to rows of one engine (same drafter and
    prompts): per-position conditional acceptance rates pooled over every row — the draft at position j is
    the same whatever k is, so all rows with k ≥ j measure it — then 1 + Σ_{j≤k} Π_{i≤j} rate_i per
    sequence and cycle (:func:`splitspec.measure.cost_model.expected_acceptance_length`), over the row's median
    cycle. Comparing k by this shares one acceptance estimate among them instead of each k's own few
    hundred draws (a row's acceptance alone is ±5% at 64 cycles of batch 1). Returns ``rows`` (amended);
    the rates are also stored in each row (``pooled_acceptance_rates``).
    """
    from splitspec.measure.cost_model import expected_acceptance_length

    depth = max((r["k"] for r in rows), default=0)
    rates = []
    for j in range(depth):
        tried = sum(r["accepted_by_position"][j - 1] if j else r["n"] * r["batch"] for r in rows if r["k"] > j)
        took = sum(r["accepted_by_position"][j] for r in rows if r["k"] > j)
        rates.append(took / tried if tried else 0.0)
    for r in rows:
        al = expected_acceptance_length(rates, r["k"]) if r["k"] else 1.0
        r.update(expected_acceptance_length=al, tokens_per_s_pooled=al * r["batch"] / r["cycle_ms"] * 1e3,
                 pooled_acceptance_rates=rates)
    return rows


def _gather(eng: SpeculativeEngine, prompts: list[list[int]], batches: list[int], ks: list[int], cycles: int,
            passes: int, warmup: int, max_seq_len: int | None) -> dict[tuple, list]:
    """Steady ``(wall ms, CycleStats)`` samples of every (B, k) on one loaded engine: B sequences (``prompts``
    token ids, cycled) decoding with k draft tokens, every sequence decoding and no prefill, CUDA graphs captured.

    ``cycles`` samples per (B, k) are gathered in ``passes`` interleaved passes over all (B, k) — each a fresh
    round of B sequences, its first ``warmup`` cycles skipped — so that a slow stretch of the machine (host
    jitter, clocks) lands on every configuration alike instead of on whichever ran then; a pass runs as many
    rounds as its share needs within ``max_seq_len`` tokens per sequence (default: the engine's; pass the KV
    budget's share per sequence). Many cycles matter more than long ones: the tokens a cycle emits vary with
    what is accepted (≈ 3% standard error of the mean at 12 cycles of batch 16), most of the noise when two
    k are compared. Raises ConfigError when not even one steady cycle fits in max_seq_len after the longest
    prompt."""
    from splitspec.errors import ConfigError

    limit = min(max_seq_len or eng.max_seq_len, eng.max_seq_len)
    plan = {}
    for B in batches:
        used = [prompts[i % len(prompts)] for i in range(B)]
        for k in ks:
            per_round = (limit - max(map(len, used)) - k - 9) // (k + 1) - warmup - 3
            if per_round < 1:
                raise ConfigError(f"steady cycles: prompts of {max(map(len, used))} tokens leave no room for a steady "
                                  f"cycle at k = {k} within max_seq_len = {limit}")
            plan[B, k] = (used, per_round)
    samples: dict[tuple, list] = {key: [] for key in plan}
    for i in range(passes):
        for (B, k), (used, per_round) in plan.items():
            want = cycles * (i + 1) // passes  # cumulative share after this pass
            while len(samples[B, k]) < want:
                got = steady_round(eng, used, k, min(per_round, want - len(samples[B, k])), warmup)
                if not got:
                    break
                samples[B, k] += got
    return samples


def measure(cfg: ServeConfig, placements: list[int], batches: list[int], ks: list[int], prompts: list[Prompt] | list[list[int]],
            max_seq_len: int, cycles: int = 48, loads: int = 2, label: str = "measuring") -> list[dict]:
    """Steady-cycle rows (see :func:`_gather`) of the deployment ``cfg`` (its engines, devices, switches and
    synthetic acceptance; draft_tp, k and the batch and KV limits are set here) for every placement (draft_tp)
    × B × k, each placement's engines loaded ``loads`` times in the order A B B A A B … (reversed every other
    time): each load gathers its share of the ``cycles`` (in 8 / loads interleaved passes), and a row's cycle_ms
    is the mean of its loads' medians. An engine load's own speed varies — the same configuration's median
    cycle, even k = 0, moves by several percent from one load to the next (docs/lab/) — and a slow stretch of
    the machine would otherwise land on one placement only; alternating loads shares both between the
    placements compared.
    ``prompts``: prompts (encoded with the engines' tokenizer) or token-id lists (taken as they are).
    Returns one row per (placement, B, k), in order (:func:`row`): draft_tp, batch, k, cycle_ms (the mean of
    the loads' median wall ms of ``eng.step()``), cycle_ms_by_load, cycle_ms_mean, draft_ms / verify_ms
    (means), tokens_per_cycle, tokens_per_s (aggregate: tokens per cycle / cycle_ms), acceptance_length
    (tokens per sequence per cycle), n (cycles timed), accepted_by_position, and the pooled estimate
    (:func:`pool_acceptance`, per placement): expected_acceptance_length, tokens_per_s_pooled — what the
    tuner compares."""
    share = lambda i: cycles * (i + 1) // loads - cycles * i // loads  # noqa: E731
    by_load: dict[tuple, list] = {}
    ids: list[list[int]] = []
    for i in range(loads):
        for dtp in placements if i % 2 == 0 else placements[::-1]:
            print(f"{label}: draft_tp={dtp}, engine load {i + 1} of {loads} ...", flush=True)
            with SpeculativeEngine.load(cfg.replace(draft_tp=dtp, num_draft_tokens=0, max_batch_size=max(batches),
                                                    kv_tokens=max(batches) * max_seq_len)) as eng:
                if not ids:
                    tok = eng.tokenizer
                    encode = (lambda p: encode_prompt(tok, p)) if tok else (lambda p: [1 + (ord(c) % 200) for c in p.text])
                    ids = [(p if isinstance(p, list) else encode(p))[-(max_seq_len // 2):] for p in prompts]
                got = _gather(eng, ids, batches, ks, share(i), max(1, 8 // loads), 3, max_seq_len)
            del eng  # the closed engine goes now, not once the next load has taken its own memory beside it
            for (B, k), samples in got.items():
                by_load.setdefault((dtp, B, k), []).append(samples)
    rows = []
    for dtp in placements:
        mine = pool_acceptance([row(B, k, s) for (d, B, k), s in by_load.items() if d == dtp and any(s)])
        for r in mine:
            print(f"  draft_tp={dtp} B={r['batch']:>3} k={r['k']}: {r['tokens_per_s_pooled']:8.1f} tok/s "
                  f"(acceptance pooled over k {r['expected_acceptance_length']:.2f}; this row's own {r['acceptance_length']:.2f}: "
                  f"{r['tokens_per_s']:.1f} tok/s), cycle {r['cycle_ms']:.2f} ms "
                  f"(by load {' '.join(f'{t:.2f}' for t in r['cycle_ms_by_load'])})", flush=True)
        rows += [{"draft_tp": dtp} | r for r in mine]
    return rows


def choose(rows: list[dict], batches: list[int]) -> dict:
    """Per bucket, the fastest (placement, k) of ``rows``; ties go to the smaller draft_tp, then the smaller
    k. Where k = 0 (no speculation) wins, the bucket does not draft: its placement is the nearest drafting
    bucket's (the smaller one on a tie; the smallest placement if no bucket drafts), so that it neither loads
    a drafter nor switches for nothing. Returns ``{"draft_tp_by_batch": {"B": draft_tp}, "k_by_batch": {"B": k}}``."""
    top = {B: max((r for r in rows if r["batch"] == B), key=lambda r: (r[METRIC], -r["draft_tp"], -r["k"])) for B in sorted(batches)}
    drafting = [B for B, r in top.items() if r["k"]]
    fallback = min(r["draft_tp"] for r in rows)
    return {"draft_tp_by_batch": {str(B): top[min(drafting, key=lambda d: (abs(d - B), d))]["draft_tp"] if drafting else fallback
                                  for B in top},
            "k_by_batch": {str(B): r["k"] for B, r in top.items()}}


def score(choice: dict, rows: list[dict], batches: list[int], metric: str = METRIC) -> dict:
    """Per bucket, the chosen configuration's tokens/s (``metric`` of ``rows``: pooled by default, or
    ``tokens_per_s`` as emitted) over the best of ``rows`` (every placement and k) and over no speculation."""
    out = {}
    for B in batches:
        mine = [r for r in rows if r["batch"] == B]
        pick = lambda dtp, k: next(r for r in mine if r["draft_tp"] == dtp and r["k"] == k)  # noqa: E731
        top = max(mine, key=lambda r: r[metric])
        dtp = int(choice["draft_tp_by_batch"][str(B)])
        chosen = pick(dtp, int(choice["k_by_batch"][str(B)]))
        out[str(B)] = {"chosen_tokens_per_s": chosen[metric], "best": {"draft_tp": top["draft_tp"], "k": top["k"], "tokens_per_s": top[metric]},
                       "chosen_over_best": chosen[metric] / top[metric],
                       "chosen_over_no_speculation": chosen[metric] / pick(dtp, 0)[metric]}
    return out


def tune(cfg: ServeConfig, batches: list[int], ks: list[int], prompts_file: Path, max_seq_len: int = 512,
         verify: bool = False, cycles: int = 48, loads: int = 2) -> dict:
    """Measure the deployment ``cfg`` (engines, devices, switches, synthetic acceptance), choose, write
    ``engines_dir/tuning.json``; return the choice (with ``verification`` when asked).

    ``cycles``: steady cycles timed per (placement, batch, k) (see :func:`_gather`), spread over
    ``loads`` engine loads per placement, alternating between placements (see :func:`measure`).
    Raises ConfigError, before measuring, for an empty batch or k list, a batch, k or max_seq_len above the
    engines' limits, loads < 1, cycles < loads, a bad prompts file, or an engines folder where tuning.json cannot be written."""
    from splitspec.errors import ConfigError

    if loads < 1 or cycles < loads:
        raise ConfigError(f"tune: cycles = {cycles} over loads = {loads}, expected loads ≥ 1 and at least one cycle per load")
    if not batches or min(batches) < 1 or not ks or min(ks) < 0 or 0 not in ks:
        raise ConfigError(f"tune: batches must be ≥ 1 and k ≥ 0 with 0 among them (got batches {batches}, k {ks})")
    engines_dir = cfg.engines_dir
    synthetic = None if cfg.synthetic_acceptance is None else list(cfg.synthetic_acceptance)
    meta = read_engine_meta(engines_dir / "target", "target")
    tp = int(meta["mapping"]["tp_size"])
    limits, where = meta["limits"], engines_dir / "target" / "engine.json"
    for name, value, limit in (("k", max(ks), "max_draft_len"), ("batch", max(batches), "max_batch_size"),
                               ("max_seq_len", max_seq_len, "max_seq_len")):
        if value > int(limits[limit]):
            raise ConfigError(f"tune: {name} = {value} exceeds the engines' {limit} {limits[limit]} ({where})")
    if not os.access(engines_dir, os.W_OK):
        raise ConfigError(f"tune: {engines_dir} is not writable: tuning.json could not be written there")
    prompts = read_prompts(prompts_file, engines_dir / "target")

    def sweep(label: str) -> list[dict]:
        return measure(cfg, sorted({1, tp}), batches, ks, prompts, max_seq_len, cycles, loads, label)

    rows = sweep("measuring")
    choice = choose(rows, batches)
    detail = score(choice, rows, batches)
    result = choice | {"measured": rows, "detail": detail, "synthetic_acceptance": synthetic,
                       "date": time.strftime("%Y-%m-%d %H:%M"), "machine": os.uname().machine}
    if verify:
        again = sweep("verifying (an independent second sweep)")
        result["verification"] = {"measured": again, "score": score(choice, again, batches),
                                  "score_emitted": score(choice, again, batches, "tokens_per_s")}
        for B, s in result["verification"]["score"].items():
            print(f"verify B={B}: chosen {s['chosen_tokens_per_s']:.1f} tok/s = ×{s['chosen_over_best']:.3f} of the sweep's best "
                  f"(draft_tp={s['best']['draft_tp']}, k={s['best']['k']}), ×{s['chosen_over_no_speculation']:.2f} over no speculation; "
                  f"with each row's own acceptance ×{result['verification']['score_emitted'][B]['chosen_over_best']:.3f}")
    try:
        write_atomic(engines_dir / "tuning.json", json.dumps(result, indent=2), mode=None)  # mode like the engine files
    except OSError as e:
        raise ConfigError(f"tune: could not write {engines_dir / 'tuning.json'} ({e.strerror or e})") from None
    print(f"tuned: by batch bucket, draft_tp {choice['draft_tp_by_batch']} and k {choice['k_by_batch']} → {engines_dir / 'tuning.json'}")
    return result
