"""Closed-loop decoding in this process: a fixed number of requests kept in flight on a
:class:`~splitspec.runtime.scheduler.SpeculativeEngine` until every one is done (``splitspec generate`` and
the lab scripts that time the engine without a server).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

from splitspec.errors import ConfigError, SplitspecError
from splitspec.measure.prompts import Prompt, encode_prompt
from splitspec.runtime.sampling import SamplingParams
from splitspec.runtime.scheduler import SpeculativeEngine
from splitspec.runtime.types import GenerationResult, Request
from splitspec.settings import ServeConfig


def run_closed_loop(eng: SpeculativeEngine, requests: list[Request], concurrency: int) -> tuple[list[GenerationResult], float]:
    """Keep ``concurrency`` requests in flight until all are done; return results (in order) and wall seconds."""
    results: dict[int, GenerationResult] = {}
    order, acc = {}, {}
    nxt = 0
    t0 = time.perf_counter()

    def fill():
        nonlocal nxt
        while nxt < len(requests) and len(acc) < concurrency:
            rid = eng.submit(requests[nxt])
            order[rid], acc[rid] = nxt, ([], "")
            nxt += 1

    fill()
    while acc:
        for e in eng.step():
            if e.request_id not in acc:
                continue
            toks, text = acc[e.request_id]
            acc[e.request_id] = (toks + e.token_ids, text + e.text)
            if e.finished:
                toks, text = acc.pop(e.request_id)
                if e.error:
                    raise SplitspecError(f"request {order[e.request_id]} failed: {e.error}")
                results[order[e.request_id]] = GenerationResult(toks, text, e.finish_reason, e.stats)
        fill()
    return [results[i] for i in range(len(requests))], time.perf_counter() - t0


@dataclass
class GenerateRun:
    """What :func:`generate` decoded, for the command to print.

    Attributes:
        prompts, results: each prompt and its completion (in order).
        wall_s: seconds for the whole closed loop.
        k: the draft length used (a number, or the tuning.json buckets it followed).
        draft_tp: the drafter placement (a number, or the tuning.json buckets it followed).
        cycles_by_placement: cycles drafted by each loaded placement (None unless both are loaded).
        switches: placement switches between cycles.
        mismatches: prompts whose output differs from target-only greedy decoding (None: not checked).
    """

    prompts: list[Prompt]
    results: list[GenerationResult]
    wall_s: float
    k: int | str
    draft_tp: int | dict
    cycles_by_placement: dict[int, int] | None = None
    switches: int = 0
    mismatches: list[int] | None = None


def generate(cfg: ServeConfig, prompts: Sequence[Prompt], *, max_tokens: int = 64,
             sampling: SamplingParams | None = None, chat: bool = False, concurrency: int = 1,
             check: bool = False) -> GenerateRun:
    """``splitspec generate``: decode ``prompts`` with ``concurrency`` requests in flight on the engines of
    ``cfg`` (its ``num_draft_tokens`` is each request's k; None: the engine's default or tuning.json).

    Args:
        chat: wrap every text prompt in the chat template (chat prompts always are).
        check: also decode target-only and report the prompts whose greedy tokens differ.
    Raises:
        ConfigError: ``concurrency`` < 1, ``check`` with a temperature above 0, or engines without a tokenizer.
    """
    sampling = sampling or SamplingParams()
    if concurrency < 1:
        raise ConfigError(f"--concurrency = {concurrency}, expected ≥ 1")
    if check and sampling.temperature > 0:
        raise ConfigError("--check compares greedy outputs: use temperature 0")
    with SpeculativeEngine.load(cfg) as eng:
        tok = eng.tokenizer
        if tok is None:
            raise ConfigError(f"{cfg.engines_dir}/target: no tokenizer files beside the engine")
        reqs = [Request(encode_prompt(tok, p, chat), max_tokens, sampling, cfg.num_draft_tokens) for p in prompts]
        placed: list[tuple[int, bool]] = []  # each cycle's (placement that drafted, 0: none; whether it switched)
        eng.on_cycle = lambda cs: placed.append((cs.draft_tp, cs.switched))
        results, wall = run_closed_loop(eng, reqs, concurrency)
        eng.on_cycle = None
        k = cfg.num_draft_tokens if cfg.num_draft_tokens is not None else (
            f"by batch {eng.k_by_batch} (tuning.json)" if eng.k_by_batch else eng.num_draft_tokens)
        run = GenerateRun(list(prompts), results, wall, k, eng.draft_tp_by_batch or eng.group.draft_tp)
        if eng.draft_tp_by_batch:
            run.cycles_by_placement = {d: sum(p == d for p, _ in placed) for d in sorted(eng.group.placements)}
            run.switches = sum(s for _, s in placed)
        if check:
            ref, _ = run_closed_loop(eng, [Request(r.prompt_ids, r.max_tokens, sampling, 0) for r in reqs], concurrency)
            run.mismatches = [i for i, (x, y) in enumerate(zip(results, ref)) if x.token_ids != y.token_ids]
    return run
