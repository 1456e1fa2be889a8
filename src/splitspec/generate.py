"""``splitspec generate``: speculative decoding from built engines in this process.

One prompt (``--prompt``) or many (``--prompts FILE``, read by :func:`splitspec.measure.prompts.read_prompts`),
kept ``--concurrency`` requests in flight (closed loop). Prints each completion
with its statistics and an aggregate line; ``--check`` also decodes target-only and fails if any greedy
output differs.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from splitspec.errors import ConfigError, SplitspecError
from splitspec.measure.closed_loop import run_closed_loop
from splitspec.measure.prompts import Prompt, encode_prompt, read_prompts
from splitspec.runtime.scheduler import Request, SpeculativeEngine
from splitspec.settings import ServeConfig
from splitspec.runtime.sampling import SamplingParams


def parse_device(text: str, flag: str = "--device") -> list[int] | None:
    """``"cpu"`` → None; ``"cuda:0,1"`` → [0, 1] (one GPU per target rank).

    Raises:
        ConfigError: anything else (names ``flag``).
    """
    if text == "cpu":
        return None
    ids = text.removeprefix("cuda:").split(",")
    if not text.startswith("cuda:") or not all(i.isascii() and i.isdigit() for i in ids):
        raise ConfigError(f"{flag} {text!r}: expected cpu or cuda:0,1,... (one GPU per target rank)")
    return [int(i) for i in ids]


def main(a: argparse.Namespace, cfg: ServeConfig) -> None:
    if a.concurrency < 1:
        raise ConfigError(f"--concurrency = {a.concurrency}, expected ≥ 1")
    engines = Path(a.engines)
    prompts = read_prompts(Path(a.prompts), engines / "target") if a.prompts else [Prompt("prompt", a.prompt)]
    with SpeculativeEngine.load(cfg) as eng:
        tok = eng.tokenizer
        if tok is None:
            raise ConfigError(f"{engines}/target: no tokenizer files beside the engine")
        sp = SamplingParams(a.temperature, a.top_p, a.top_k, a.seed)
        reqs = [Request(encode_prompt(tok, p, a.chat), a.max_tokens, sp, a.num_draft_tokens) for p in prompts]
        placed: list[tuple[int, bool]] = []  # each cycle's (placement that drafted, 0: none; whether it switched)
        eng.on_cycle = lambda cs: placed.append((cs.draft_tp, cs.switched))
        results, wall = run_closed_loop(eng, reqs, a.concurrency)
        eng.on_cycle = None
        for p, r in zip(prompts, results):
            s = r.stats
            print(p.text + r.text if len(prompts) == 1 else f"--- {p.text[:60]!r} → {r.text[:200]!r}")
            print(f"    {s.num_output_tokens} tokens, {s.tokens_per_s:.1f} tok/s, acceptance length {s.acceptance_length:.2f} "
                  f"over {s.num_cycles} cycles, accepted by position {s.accepted_per_position}, ttft {s.ttft_ms:.0f} ms, "
                  f"finish {r.finish_reason}{' [SYNTHETIC]' if s.synthetic else ''}")
        total = sum(r.stats.num_output_tokens for r in results)
        cycles = sum(r.stats.num_cycles for r in results)
        emitted = sum(r.stats.acceptance_length * r.stats.num_cycles for r in results)
        k_used = a.num_draft_tokens if a.num_draft_tokens is not None else (f"by batch {eng.k_by_batch} (tuning.json)" if eng.k_by_batch
                                                                             else eng.num_draft_tokens)
        print(f"== {len(results)} requests, concurrency {a.concurrency}, k={k_used}, draft_tp={eng.draft_tp_by_batch or eng.group.draft_tp}: "
              f"{total} tokens in {wall:.2f} s = {total / wall:.1f} tok/s aggregate; "
              f"mean acceptance length {emitted / max(cycles, 1):.2f}")
        if eng.draft_tp_by_batch:
            by = ", ".join(f"draft_tp={d}: {sum(p == d for p, _ in placed)}" for d in sorted(eng.group.placements))
            print(f"   cycles drafted by placement: {by}; placement switches: {sum(s for _, s in placed)}")
        if a.check:
            if a.temperature > 0:
                raise ConfigError("--check compares greedy outputs: use temperature 0")
            ref, _ = run_closed_loop(eng, [Request(r.prompt_ids, r.max_tokens, sp, 0) for r in reqs], a.concurrency)
            bad = [i for i, (x, y) in enumerate(zip(results, ref)) if x.token_ids != y.token_ids]
            if bad:
                raise SplitspecError(f"speculative output differs from target-only greedy decoding for prompts {bad}")
            print("check: identical to target-only greedy decoding")
