"""Closed-loop decoding in this process: a fixed number of requests kept in flight on a
:class:`~splitspec.runtime.scheduler.SpeculativeEngine` until every one is done (``splitspec generate`` and
the lab scripts that time the engine without a server).
"""

from __future__ import annotations

import time

from splitspec.errors import SplitspecError
from splitspec.runtime.scheduler import GenerationResult, Request, SpeculativeEngine


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
