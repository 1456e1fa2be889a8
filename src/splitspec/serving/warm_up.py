"""Warming the engine up before it reports ready: every batch bucket and k a deployment uses, run once, so that on GPUs
compiling and CUDA-graph capture happen during the model load and not at the first requests (:func:`warm_up`)."""

from __future__ import annotations

import time
from typing import Callable

from splitspec.models.batch import BATCH_BUCKETS
from splitspec.runtime.scheduler import SpeculativeEngine
from splitspec.runtime.types import Request


def warm_up_plan(max_batch_size: int, ks: list[int]) -> list[tuple[int, int]]:
    """The ``(batch, k)`` runs of :func:`warm_up`: every batch bucket (:data:`~splitspec.models.batch.BATCH_BUCKETS`)
    below ``max_batch_size``, and ``max_batch_size`` itself (it fills its bucket), for each k of ``ks``."""
    sizes = [b for b in BATCH_BUCKETS if b < max_batch_size] + [max_batch_size]
    return [(b, k) for b in sizes for k in sorted(set(ks))]


def warm_up(eng: SpeculativeEngine, log: Callable[[str], None] = print) -> float:
    """Before serving, run greedy requests through every batch bucket and k the deployment uses; returns the wall time
    in seconds. ``log``: one line per run (the engine process's stdout goes to the server's log).

    On GPUs the first steady cycle compiles the target's layer halves and the drafter's parts (``torch.compile``,
    dynamic shapes: once per half and layer type, once per drafter part), and each (batch bucket, k, placement)
    captures its own CUDA graphs (:mod:`splitspec.engine.graphs`; key window S: 256 tokens for the short prompts a
    first request brings). Done here, before the engine reports
    ready, that cost is paid by the model load instead of by the first requests at each batch size. k: the
    deployment's, or each k of ``tuning.json``'s buckets; with both placements loaded, each bucket drafts with its own
    (the switch is made at once meanwhile). A bucket whose requests do not all fit the KV budget runs as many as fit.
    It leaves no sequence and no KV block held.
    """
    t0 = time.perf_counter()
    prompt = list(range(1, 9))
    ks = sorted(set(eng.k_by_batch.values())) if eng.k_by_batch else [eng.num_draft_tokens]
    switch_after, eng.switch_after = eng.switch_after, 1
    try:
        for batch, k in warm_up_plan(eng.max_batch_size, ks):
            n = max(1, min(4 * (k + 1), eng.max_seq_len - len(prompt) - k - 1))  # a few steady cycles after the first
            per_request = -(-(len(prompt) + n + k + 1) // eng.alloc.block_size)
            fit = max(1, min(batch, eng.alloc.num_blocks // per_request))
            t = time.perf_counter()
            eng.run([Request(list(prompt), n, num_draft_tokens=k, stop_token_ids=set()) for _ in range(fit)])
            log(f"splitspec engine: warm-up batch {fit}{'' if fit == batch else f' (of {batch}: KV budget)'}, "
                f"k {k}: {time.perf_counter() - t:.2f} s")
    finally:
        eng.switch_after = switch_after
    return time.perf_counter() - t0
