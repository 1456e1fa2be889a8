"""Ready means ready on GPUs: the engine process warms up every batch bucket and k before ``spec_decode`` reports
ready (:func:`splitspec.serving.warm_up.warm_up`), so the first request after ready, alone or as a full batch,
takes at most twice as long as the same request once the server is steady (before: 42 s against tens of ms on an
H200, compilation and graph capture running at the first request). Needs CUDA and the served stack (tritonserver
with a stub whose Python has the GPU torch: the project's GPU set-up); skipped elsewhere.

Run on a GPU machine: ``python3 -m pytest -q tests/gpu/test_warmup_latency.py``.
"""

from __future__ import annotations

import concurrent.futures as cf
import statistics
import time

import pytest

from splitspec.serving.client import ask_http
from splitspec.serving.repo import render_repo
from splitspec.serving.tritonserver import TritonServer
from splitspec.settings import ServeConfig

pytestmark = [pytest.mark.gpu, pytest.mark.server, pytest.mark.timeout(900)]

BATCH = 8  # buckets 1, 2, 4 and 8 are warmed up
TOKENS = 32
PROMPT = "def fibonacci(n):"


def _timed(srv: TritonServer, n: int) -> float:
    """Seconds for ``n`` concurrent greedy requests of TOKENS tokens (each its own prompt)."""
    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(max_workers=n) as pool:
        answers = list(pool.map(lambda i: ask_http(srv.generate_url, f"{PROMPT} # {i}", TOKENS, timeout_s=600), range(n)))
    assert all(a["text_output"] for a in answers)
    return time.perf_counter() - t0


def test_first_requests_after_ready_are_as_fast_as_steady_ones(engines_for, tmp_path):
    repo = render_repo(ServeConfig(engines_for(1), target_device_ids=(0,), num_draft_tokens=4, max_batch_size=BATCH),
                       tmp_path / "repo")
    with TritonServer(repo, startup_timeout_s=900) as srv:
        log = srv.log_tail(200_000)
        for b in (1, 2, 4, 8):
            assert f"warm-up batch {b}, k 4" in log, log[-3000:]
        first = _timed(srv, 1)
        first_batch = _timed(srv, BATCH)
        steady = statistics.median(_timed(srv, 1) for _ in range(5))
        steady_batch = statistics.median(_timed(srv, BATCH) for _ in range(3))
    print(f"\nfirst request {first * 1e3:.0f} ms, steady {steady * 1e3:.0f} ms; first batch of {BATCH} "
          f"{first_batch * 1e3:.0f} ms, steady {steady_batch * 1e3:.0f} ms (ready after {srv.startup_s:.1f} s)")
    assert first <= 2 * steady, (first, steady)
    assert first_batch <= 2 * steady_batch, (first_batch, steady_batch)
