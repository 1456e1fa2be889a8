"""What the HTTP guard (``serving/http_guard.py``) adds to a request's latency.

Starts tritonserver on a repository rendered for ``--engines`` and an HTTP guard in front of it in a process of its
own (as ``splitspec serve`` runs it: in the supervisor's process, not the client's), then sends ``--requests``
requests to each door in turn — the guard, and tritonserver's own private port — alternating, so that drift of a
shared machine falls on both alike: ``/v2/health/ready`` (no model work: the guard's cost alone) and HTTP
``generate`` of ``--max-tokens`` tokens (greedy). Each once over a kept-alive connection (one session per door, as
tritonclient's pool does) and once on a new connection per request. Prints the median and p99 in ms per door, their
difference, and the guard process's CPU time per request (user + system, from ``/proc``: less sensitive to the
machine's load than wall time).

Usage::

    .venv/bin/python bench/http_guard_latency.py --engines engines/demo --requests 200

Wall-clock ms on this machine; on a shared machine run it when idle.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import tempfile
import time
from pathlib import Path

import requests

from serving_latency import pct
from splitspec.serving.repo import render_repo
from splitspec.serving.server_limits import repo_body_limit
from splitspec.serving.tritonserver import TritonServer, free_ports
from splitspec.settings import ServeConfig

GENERATE = "/v2/models/ensemble/generate"


def run_guard(port: int, upstream_port: int, body_limit: int, ready) -> None:
    """The guard's process: serve until killed."""
    from splitspec.serving.http_guard import HttpGuard

    HttpGuard(port, upstream_port, body_limit).start()
    ready.set()
    while True:
        time.sleep(3600)


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (``/proc/<pid>/stat`` fields 14 and 15)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def compare(doors: dict[str, str], guard_pid: int, path: str, body: dict | None, n: int, close: bool) -> str:
    """``n`` requests to each door, alternating (5 more first, to warm up); one line of results."""
    times: dict[str, list[float]] = {d: [] for d in doors}
    sessions = {d: requests.Session() for d in doors}
    headers = {"Connection": "close"} if close else None
    cpu0 = 0.0
    for i in range(n + 5):
        if i == 5:
            cpu0 = cpu_s(guard_pid)
        for door in (list(doors) if i % 2 else list(doors)[::-1]):
            t0 = time.perf_counter()
            s, url = sessions[door], doors[door] + path
            r = s.post(url, json=body, headers=headers, timeout=60) if body else s.get(url, headers=headers, timeout=60)
            took = (time.perf_counter() - t0) * 1000
            if r.status_code != 200:
                raise SystemExit(f"{url}: HTTP {r.status_code}: {r.text[:200]}")
            if i >= 5:
                times[door].append(took)
    cpu_ms = (cpu_s(guard_pid) - cpu0) * 1000 / n
    p50 = {d: statistics.median(v) for d, v in times.items()}
    p99 = {d: pct(v, 0.99) for d, v in times.items()}
    return (f"{path:30s} {'new connection' if close else 'kept alive':14s}  guard p50 {p50['guard']:6.2f} p99 "
            f"{p99['guard']:6.2f}  direct p50 {p50['direct']:6.2f} p99 {p99['direct']:6.2f}  added p50 "
            f"{p50['guard'] - p50['direct']:+.2f} p99 {p99['guard'] - p99['direct']:+.2f} ms; guard CPU {cpu_ms:.2f} "
            "ms/request")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", type=Path, default=Path("engines/demo"))
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--max-tokens", type=int, default=1)
    a = ap.parse_args(argv)
    body = {"text_input": "def fibonacci(n):", "max_tokens": a.max_tokens, "temperature": 0.0}
    with tempfile.TemporaryDirectory() as tmp:
        repo = render_repo(ServeConfig(a.engines), Path(tmp) / "repo")
        with TritonServer(repo, exit_timeout_s=10, guard=False) as srv:
            ctx = multiprocessing.get_context("spawn")
            ready, port = ctx.Event(), free_ports(1)[0]
            guard = ctx.Process(target=run_guard, args=(port, srv.triton_http_port, repo_body_limit(repo), ready),
                                daemon=True)
            guard.start()
            try:
                if not ready.wait(30):
                    raise SystemExit("the guard did not start")
                doors = {"guard": f"http://127.0.0.1:{port}", "direct": srv.triton_http_url}
                print(f"{a.requests} requests per door and row, alternating; engines {a.engines}", flush=True)
                for close in (False, True):
                    for path, b in (("/v2/health/ready", None), (GENERATE, body)):
                        print(compare(doors, guard.pid, path, b, a.requests, close), flush=True)
            finally:
                guard.kill()


if __name__ == "__main__":
    main()
