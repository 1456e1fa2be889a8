"""Serving latency through Triton: time to first token (TTFT), inter-token latency (ITL), and where a
request's time goes — in Triton (queueing, pre-/post-processing, sending responses) or in the engine.

Starts tritonserver on a repository rendered for ``--engines`` (or measures a running server with
``--grpc``/``--http``), then for each concurrency level keeps that many gRPC streams busy
(``stream`` true, one response per engine cycle) until ``--requests`` requests completed, and prints:

- client-side TTFT (send → first response carrying text or tokens) and ITL ((last − first response)
  / (tokens − 1), per request), p50 / p90 / mean, in ms;
- the engine's own times for the same requests (``return_stats``: queue_ms, ttft_ms, e2e_ms, and the
  summed draft / verify time of the cycles the request took part in);
- the difference (client end-to-end − engine end-to-end = time spent outside the engine: request
  parsing, preprocessing, spec_decode's execute, one postprocessing call per response, response
  delivery) and Triton's per-model statistics (``/v2/models/<m>/stats``) over the run, per request.

Usage::

    .venv/bin/python bench/serving_latency.py --engines engines/demo --concurrency 1,16

All times are wall-clock milliseconds on this machine; on a shared machine run it when idle.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from splitspec.measure.server_stats import model_stats, stats_delta
from splitspec.serving.client import stream_grpc
from splitspec.serving.repo import MODELS, render_repo
from splitspec.serving.tritonserver import TritonServer
from splitspec.settings import ServeConfig

PROMPTS = ["def fibonacci(n):", "import os\n\ndef list_files(root):", "class Stack:\n    def push(self, item):",
           "for i in range(10):\n    print(", "# Copyright 2001 Python Software Foundation.\n\"\"\"Path utilities.\"\"\"\n",
           "while True:", "def binary_search(items, target):\n    lo, hi = 0, len(items) - 1\n", "x = "]


def pct(values: list[float], q: float) -> float:
    """The q-quantile (0..1) of ``values`` (nearest rank), or nan for none."""
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def summary(values: list[float]) -> str:
    if not values:
        return "n/a"
    return f"p50 {pct(values, 0.5):8.1f}   p90 {pct(values, 0.9):8.1f}   mean {statistics.fmean(values):8.1f}"


def one_request(grpc: str, prompt: str, max_tokens: int, k: int | None) -> dict:
    """Stream one request; returns client timings (ms) and the engine's statistics."""
    t0 = time.perf_counter()
    arrivals: list[tuple[float, int]] = []  # (ms since send, tokens in the response)
    final: dict = {}
    for ev in stream_grpc(grpc, prompt, max_tokens, num_draft_tokens=k, return_token_ids=True, return_stats=True):
        now = (time.perf_counter() - t0) * 1e3
        n = len(ev.get("output_ids", []))
        if n or ev.get("text_output"):
            arrivals.append((now, n))
        final.update({key: v for key, v in ev.items() if key not in ("output_ids", "text_output")})
    e2e = (time.perf_counter() - t0) * 1e3
    tokens = sum(n for _, n in arrivals)
    first, last = arrivals[0][0], arrivals[-1][0]
    return {"ttft": first, "e2e": e2e, "tokens": tokens, "responses": len(arrivals),
            "itl": (last - first) / (tokens - 1) if tokens > 1 else None, **final}


def run_level(grpc: str, http: str, concurrency: int, n_requests: int, max_tokens: int, k: int | None) -> None:
    results: list[dict] = []
    errors: list[str] = []
    lock = threading.Lock()
    counter = iter(range(n_requests))

    def worker():
        while True:
            with lock:
                i = next(counter, None)
            if i is None:
                return
            try:
                r = one_request(grpc, PROMPTS[i % len(PROMPTS)], max_tokens, k)
            except Exception as e:  # reported below
                with lock:
                    errors.append(str(e))
                continue
            with lock:
                results.append(r)

    before = model_stats(http)
    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    delta = stats_delta(before, model_stats(http))
    if errors:
        print(f"  {len(errors)} request(s) failed, e.g. {errors[0]}")
    if not results:
        return
    tokens = sum(r["tokens"] for r in results)
    responses = sum(r["responses"] for r in results)
    print(f"\n=== concurrency {concurrency}: {len(results)} requests x {max_tokens} max tokens in {wall:.1f} s, "
          f"{tokens / wall:.1f} output tokens/s, {tokens / responses:.2f} tokens per response, "
          f"acceptance length {statistics.fmean(r['acceptance_length'] for r in results):.2f}")
    print("client (ms)")
    print(f"  TTFT                         {summary([r['ttft'] for r in results])}")
    print(f"  inter-token latency          {summary([r['itl'] for r in results if r['itl'] is not None])}")
    print(f"  end-to-end                   {summary([r['e2e'] for r in results])}")
    print("engine, same requests (ms)")
    print(f"  queue (submit -> batch)      {summary([r['queue_ms'] for r in results])}")
    print(f"  TTFT (submit -> 1st token)   {summary([r['ttft_ms'] for r in results])}")
    print(f"  end-to-end (submit -> done)  {summary([r['e2e_ms'] for r in results])}")
    print(f"  draft, summed over cycles    {summary([r['draft_ms'] for r in results])}")
    print(f"  verify, summed over cycles   {summary([r['verify_ms'] for r in results])}")
    print("outside the engine (client - engine, ms)")
    print(f"  TTFT                         {summary([r['ttft'] - r['ttft_ms'] for r in results])}")
    print(f"  end-to-end                   {summary([r['e2e'] - r['e2e_ms'] for r in results])}")
    n = len(results)
    print(f"Triton per-model statistics over the run (ms per request; {responses / n:.1f} responses per request)")
    for m in MODELS:
        d = delta[m]
        parts = [f"{phase} {ms / n:7.2f}" for phase, (count, ms) in d.items() if phase != "success" and count]
        calls = d["compute_infer"][0]
        print(f"  {m:15s} {calls / n:5.1f} executions/request   " + "   ".join(parts))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engines", default="engines/demo", help="built engines (a repository is rendered for them)")
    p.add_argument("--grpc", default=None, help="measure a running server: its gRPC host:port")
    p.add_argument("--http", default=None, help="... and its HTTP base URL (for the statistics endpoint)")
    p.add_argument("--concurrency", default="1,16", help="comma-separated concurrency levels")
    p.add_argument("--requests", type=int, default=0, help="requests per level (default: max(8, 3 x concurrency))")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("-k", "--num-draft-tokens", type=int, default=None, help="draft tokens per cycle (default: the server's)")
    p.add_argument("--max-batch-size", type=int, default=64, help="rendered repository: sequences decoded together")
    a = p.parse_args(argv)
    levels = [int(c) for c in a.concurrency.split(",")]
    srv = None
    if a.grpc:
        grpc, http = a.grpc, (a.http or "http://127.0.0.1:8000").rstrip("/")
    else:
        tmp = tempfile.TemporaryDirectory(prefix="serving_latency.")
        cfg = ServeConfig.from_env(engines_dir=Path(a.engines), num_draft_tokens=a.num_draft_tokens or 4,
                                   max_batch_size=a.max_batch_size)
        repo = render_repo(cfg, Path(tmp.name) / "repo")
        srv = TritonServer(repo, exit_timeout_s=10).start()
        grpc, http = srv.grpc_address, srv.http_url
        print(f"tritonserver ready after {srv.startup_s:.1f} s on {repo} (engines {a.engines})")
    try:
        one_request(grpc, "warm up", 8, a.num_draft_tokens)
        for c in levels:
            run_level(grpc, http, c, a.requests or max(8, 3 * c), a.max_tokens, a.num_draft_tokens)
    finally:
        if srv is not None:
            srv.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
