"""What the OpenAI-compatible front end adds to a request's latency: the same prompts served directly over Triton's
gRPC stream and through ``/v1/completions``, one request at a time, alternating.

Starts ``splitspec serve --openai-port`` (tritonserver plus the front end in one process, as ``make serve`` runs it)
on a rendered repository, then for each prompt and round sends the same greedy request (``max_tokens``, the server's
k) over gRPC streaming (tritonclient) and over the OpenAI endpoint (server-sent events, read with ``requests``), and
prints per path: time to the first text and to the end of the answer (p50 / mean, ms), and the front end's added
latency = the median of the paired differences (OpenAI − gRPC). The texts of both paths must be equal.

Usage::

    .venv/bin/python bench/openai_overhead.py --repo triton_repo --rounds 3 --max-tokens 16

Wall-clock milliseconds on this machine; on a shared machine run it when idle.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import requests

from splitspec.serving.client import stream_grpc
from splitspec.serving.tritonserver import free_ports

PROMPTS = ["def fibonacci(n):", "import os\n\ndef list_files(root):", "class Stack:\n    def push(self, item):",
           "for i in range(10):\n    print(", "while True:", "def binary_search(items, target):\n", "x = ",
           "# Copyright 2001 Python Software Foundation.\n"]


def via_grpc(address: str, prompt: str, max_tokens: int) -> tuple[float, float, str]:
    """(ms to the first text, ms to the end, text) of one gRPC streaming request."""
    t0, first, text = time.perf_counter(), None, ""
    for ev in stream_grpc(address, prompt, max_tokens):
        if ev.get("text_output") and first is None:
            first = time.perf_counter()
        text += ev.get("text_output", "")
    end = time.perf_counter()
    return ((first or end) - t0) * 1e3, (end - t0) * 1e3, text


def via_openai(session: requests.Session, url: str, model: str, prompt: str, max_tokens: int) -> tuple[float, float, str]:
    """(ms to the first text, ms to the end, text) of one streaming ``/v1/completions`` request."""
    t0, first, text = time.perf_counter(), None, ""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True}
    with session.post(f"{url}/completions", json=body, stream=True, timeout=120) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            piece = json.loads(line[6:])["choices"][0]["text"]
            if piece and first is None:
                first = time.perf_counter()
            text += piece
    end = time.perf_counter()
    return ((first or end) - t0) * 1e3, (end - t0) * 1e3, text


def start_server(repo: Path, ports: list[int], log: Path) -> subprocess.Popen:
    http, grpc, metrics, api = ports
    cmd = [sys.executable, "-m", "splitspec.cli", "serve", "--repo", str(repo), "--http-port", str(http), "--grpc-port",
           str(grpc), "--metrics-port", str(metrics), "--openai-port", str(api)]
    return subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)


def wait_ready(proc: subprocess.Popen, url: str, timeout_s: float = 300) -> str:
    """The served model's name, once ``/v1/models`` answers (the front end starts after tritonserver is ready)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"splitspec serve exited with status {proc.returncode}")
        try:
            return requests.get(f"{url}/models", timeout=2).json()["data"][0]["id"]
        except (requests.RequestException, ValueError, KeyError):
            time.sleep(0.5)
    raise SystemExit(f"{url} did not answer within {timeout_s:.0f} s")


def row(name: str, values: list[float]) -> str:
    return f"{name:<28} p50 {statistics.median(values):8.1f}   mean {statistics.fmean(values):8.1f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repo", default="triton_repo", help="a rendered model repository (make repo)")
    ap.add_argument("--rounds", type=int, default=3, help="passes over the prompts")
    ap.add_argument("--max-tokens", type=int, default=16)
    a = ap.parse_args()
    ports = free_ports(4)
    url, grpc = f"http://127.0.0.1:{ports[3]}/v1", f"127.0.0.1:{ports[1]}"
    log = Path(a.repo) / "_backends" / "openai_overhead.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    proc = start_server(Path(a.repo), ports, log)
    try:
        model = wait_ready(proc, url)
        times: dict[str, list[float]] = {k: [] for k in ("grpc_ttft", "grpc_e2e", "openai_ttft", "openai_e2e")}
        with requests.Session() as s:
            s.trust_env = False
            via_grpc(grpc, PROMPTS[0], a.max_tokens), via_openai(s, url, model, PROMPTS[0], a.max_tokens)  # warm-up
            for _ in range(a.rounds):
                for p in PROMPTS:
                    g, o = via_grpc(grpc, p, a.max_tokens), via_openai(s, url, model, p, a.max_tokens)
                    if g[2] != o[2]:
                        raise SystemExit(f"answers differ for {p!r}: gRPC {g[2]!r}, OpenAI {o[2]!r}")
                    for key, v in zip(("grpc_ttft", "grpc_e2e", "openai_ttft", "openai_e2e"), (*g[:2], *o[:2])):
                        times[key].append(v)
        n = len(times["grpc_e2e"])
        print(f"{n} request pairs, max_tokens {a.max_tokens}, model {model!r}, one at a time (ms)")
        for key, v in times.items():
            print(row(key, v))
        for what in ("ttft", "e2e"):
            diffs = [o - g for o, g in zip(times[f"openai_{what}"], times[f"grpc_{what}"])]
            print(f"added by the front end, {what:<4}  p50 {statistics.median(diffs):8.2f}   "
                  f"mean {statistics.fmean(diffs):8.2f}  (paired: OpenAI − gRPC, same prompt)")
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


if __name__ == "__main__":
    main()
