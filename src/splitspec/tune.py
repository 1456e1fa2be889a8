"""``splitspec tune``: measure draft placement × k per batch bucket on this machine and keep the best.

For each draft placement (draft_tp = 1, the split placement, and draft_tp = N, sharded over the target's
group), each batch bucket B and each k, keeps B requests in flight over the evaluation prompts and measures
aggregate tokens/s (greedy, real acceptance of the engines' drafter — or a synthetic acceptance profile,
labelled). The placement that wins at the smallest bucket is kept (placement is fixed per deployment); for
each bucket the fastest k under that placement is chosen, and k = 0 (speculation off) wherever speculation
does not beat it. Written atomically to ``engines_dir/tuning.json``, which ``SpeculativeEngine.load`` reads.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

from splitspec.engine import read_engine_meta
from splitspec.generate import encode_prompt, read_prompts, run_closed_loop
from splitspec.runtime import Request, SpeculativeEngine


def measure(engines_dir: Path, draft_tp: int, batches: list[int], ks: list[int], prompts: list[str], max_tokens: int,
            device_ids: list[int] | None, synthetic: list[float] | None) -> list[dict]:
    """Aggregate tokens/s for every (B, k) at one placement; one engine load."""
    rows = []
    with SpeculativeEngine.load(engines_dir, target_device_ids=device_ids, draft_tp=draft_tp, num_draft_tokens=0,
                                max_batch_size=max(batches), kv_tokens=max(batches) * 512, synthetic_acceptance=synthetic) as eng:
        tok = eng.tokenizer
        encode = (lambda p: encode_prompt(tok, p)) if tok else (lambda p: [1 + (ord(c) % 200) for c in str(p)])
        run_closed_loop(eng, [Request(encode(prompts[0]), 4, num_draft_tokens=max(ks))], 1)  # warm-up
        for B in batches:
            for k in ks:
                reqs = [Request(encode(prompts[i % len(prompts)]), max_tokens, num_draft_tokens=k, stop_token_ids=set())
                        for i in range(max(B, 2 * B))]
                res, wall = run_closed_loop(eng, reqs, B)
                toks = sum(r.stats.num_output_tokens for r in res)
                cyc = sum(r.stats.num_cycles for r in res)
                rows.append({"draft_tp": draft_tp, "batch": B, "k": k, "tokens_per_s": toks / wall,
                             "acceptance_length": sum(r.stats.acceptance_length * r.stats.num_cycles for r in res) / max(cyc, 1)})
                print(f"  draft_tp={draft_tp} B={B:>3} k={k}: {toks / wall:8.1f} tok/s, acceptance {rows[-1]['acceptance_length']:.2f}",
                      flush=True)
    return rows


def choose(rows: list[dict], batches: list[int]) -> dict:
    """Placement winning at the smallest bucket; per bucket, the fastest k under it (0 if speculation loses)."""
    best = lambda rs: max(rs, key=lambda r: r["tokens_per_s"])  # noqa: E731
    placement = best([r for r in rows if r["batch"] == min(batches)])["draft_tp"]
    k_by_batch, detail = {}, {}
    for B in batches:
        mine = [r for r in rows if r["batch"] == B and r["draft_tp"] == placement]
        top = best(mine)
        off = next(r for r in mine if r["k"] == 0)
        k_by_batch[str(B)] = top["k"] if top["tokens_per_s"] > off["tokens_per_s"] else 0
        exhaustive = best([r for r in rows if r["batch"] == B])
        detail[str(B)] = {"chosen_tokens_per_s": top["tokens_per_s"], "no_speculation_tokens_per_s": off["tokens_per_s"],
                          "exhaustive_best": exhaustive, "chosen_vs_exhaustive": top["tokens_per_s"] / exhaustive["tokens_per_s"]}
    return {"draft_tp": placement, "k_by_batch": k_by_batch, "detail": detail}


def tune(engines_dir: Path, batches: list[int], ks: list[int], prompts_file: Path, max_tokens: int = 32,
         device_ids: list[int] | None = None, synthetic: list[float] | None = None) -> dict:
    """Measure, choose, write ``engines_dir/tuning.json``; return the choice."""
    engines_dir = Path(engines_dir)
    tp = int(read_engine_meta(engines_dir / "target", "target")["mapping"]["tp_size"])
    prompts = read_prompts(prompts_file)
    rows = []
    for dtp in sorted({1, tp}):
        print(f"measuring draft_tp={dtp} ...", flush=True)
        rows += measure(engines_dir, dtp, batches, ks, prompts, max_tokens, device_ids, synthetic)
    choice = choose(rows, batches) | {"measured": rows, "synthetic_acceptance": synthetic,
                                      "date": time.strftime("%Y-%m-%d %H:%M"), "machine": os.uname().machine}
    fd, tmp = tempfile.mkstemp(dir=engines_dir, prefix=".tuning.", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(choice, f, indent=2)
    os.replace(tmp, engines_dir / "tuning.json")
    print(f"tuned: draft_tp={choice['draft_tp']}, k by batch bucket {choice['k_by_batch']} → {engines_dir / 'tuning.json'}")
    return choice
