"""The phases of bench/triton_share.py: each way of running the same engines on the same requests, warmed up and
ready to run one request at a time and to read the CPU seconds of its processes.

- :func:`engine_alone`: ``SpeculativeEngine.load`` in this process; two phases on it, cycles stepped on this thread
  (``engine_alone``) or on an :class:`EngineLoop`'s (``engine_loop``);
- :func:`engine_process`: :class:`EngineProcess` started from this process, as ``spec_decode`` starts it;
- :func:`served_engine`: tritonserver on a repository rendered for the same engines and settings, requests streamed
  over gRPC.

Each takes the script's options ``a`` (``engines``, ``k``, ``max_tokens``, ``device_ids``, ``draft_device_id``,
``draft_tp``, ``max_batch_size``, ``kv_tokens``)."""

from __future__ import annotations

import argparse
import contextlib
import gc
import hashlib
import itertools
import json
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from splitspec.measure.closed_loop import run_closed_loop
from splitspec.measure.prompts import Prompt, encode_prompt
from splitspec.measure.server_stats import model_stats, stats_delta
from splitspec.measure.stream_client import StreamWorker
from splitspec.runtime.scheduler import SpeculativeEngine
from splitspec.runtime.loop import EngineLoop
from splitspec.runtime.types import Request, RequestOutput, RequestStats
from splitspec.runtime.tokenizer import ChatTokenizer
from splitspec.serving.engine_process import EngineProcess
from splitspec.serving.repo import render_repo
from splitspec.serving.tritonserver import TritonServer
from splitspec.settings import ServeConfig, parse_id, parse_ids

from lab.pinning import cpu_seconds
from lab.triton_trace import trace_args

#: Seconds one request may take before the benchmark gives up.
REQUEST_TIMEOUT_S = 600.0


@dataclass
class Phase:
    """One way of running the engines. ``run(i)`` runs prompt ``i`` once (greedy, ``max_tokens``) and returns its
    row; ``cpu()`` reads the CPU seconds of the phase's processes by role (:func:`lab.pinning.cpu_seconds`); ``in_process``:
    the engine steps on this process's threads (with ``--pin``, this process then sits on the engine's core)."""

    run: Callable[[int], dict]
    cpu: Callable[[], dict[str, float]]
    in_process: bool = False


def _sha(ids: list[int]) -> str:
    """Short SHA-1 of a token id list, as :class:`splitspec.measure.stream_client.RequestRecord` computes ``output_sha``."""
    return hashlib.sha1(json.dumps(ids).encode()).hexdigest()[:16]


def _row(p: Prompt, token_ids: list[int], stats: RequestStats, finish_reason: str, wall_s: float) -> dict:
    """One request of an in-engine phase: ``tokens``, ``wall_ms`` (submit → finished, seen by this process),
    ``ttft_ms`` and ``e2e_ms`` (the engine's own), ``cycles`` (its decode cycles), ``draft_verify_ms`` (its cycles'
    draft and verify phases, summed), ``acceptance_length``, ``finish_reason``, ``output_sha``."""
    return {"prompt_id": p.id, "tokens": len(token_ids), "wall_ms": wall_s * 1e3, "ttft_ms": stats.ttft_ms,
            "e2e_ms": stats.e2e_ms, "cycles": stats.num_cycles, "draft_verify_ms": stats.draft_ms + stats.verify_ms,
            "acceptance_length": stats.acceptance_length, "finish_reason": finish_reason, "output_sha": _sha(token_ids)}


class _Collector:
    """A request's events (a callback on the engine's side), gathered until its final one."""

    def __init__(self):
        self.tokens: list[int] = []
        self.final = None
        self.done = threading.Event()

    def __call__(self, ev) -> None:
        self.tokens += ev.token_ids
        if ev.finished:
            self.final = ev
            self.done.set()

    def wait(self) -> tuple[list[int], RequestStats, str]:
        """(token ids, stats, finish reason) once finished. Raises RuntimeError on a failed or timed-out request."""
        if not self.done.wait(REQUEST_TIMEOUT_S):
            raise RuntimeError(f"a request did not finish within {REQUEST_TIMEOUT_S:.0f} s")
        if self.final.error:
            raise RuntimeError(f"a request failed: {self.final.error}")
        return self.tokens, self.final.stats, self.final.finish_reason


def _requests(a: argparse.Namespace, tok, prompts: list[Prompt]) -> list[Request]:
    """The measured requests (greedy, ``a.max_tokens``, k = ``a.k``), one per prompt; each phase runs them all once
    to warm up."""
    return [Request(encode_prompt(tok, p), a.max_tokens, num_draft_tokens=a.k) for p in prompts]


def _serve_config(a: argparse.Namespace) -> ServeConfig:
    """The deployment the settings in ``a`` describe (the engine switches from ``SPLITSPEC_*``)."""
    return ServeConfig.from_env(engines_dir=Path(a.engines), target_device_ids=parse_ids(a.device_ids, "--device-ids"),
                                draft_device_id=parse_id(a.draft_device_id, "--draft-device-id"), draft_tp=a.draft_tp,
                                num_draft_tokens=a.k, max_batch_size=a.max_batch_size, kv_tokens=a.kv_tokens)


@contextlib.contextmanager
def engine_alone(a: argparse.Namespace, prompts: list[Prompt], others: dict[str, int]) -> Iterator[dict[str, Phase]]:
    """Load the engine in this process and warm it up (every measured request once); yield two
    phases on it: ``"engine_alone"`` steps its cycles on this thread (:func:`splitspec.measure.closed_loop.run_closed_loop`),
    ``"engine_loop"`` on the thread of an :class:`EngineLoop` started for the request (before its clock starts)
    and stopped after it. The engine is closed (its GPUs freed) on exit.

    Their CPU seconds are this process's (role "engine": all its threads, the gRPC client's and engine processes'
    reader threads too, idle then) and its worker ranks', without the processes whose pids are the values of
    ``others`` (tritonserver, engine processes) and their subtrees.
    """
    cfg = _serve_config(a)
    eng = SpeculativeEngine.load(cfg)
    try:
        reqs = _requests(a, eng.tokenizer, prompts)
        for req in reqs:
            run_closed_loop(eng, [req], 1)

        def cpu() -> dict[str, float]:
            return cpu_seconds(os.getpid(), "engine", prune=set(others.values()))

        def stepped(i: int) -> dict:
            [r], wall = run_closed_loop(eng, [reqs[i]], 1)
            return _row(prompts[i], r.token_ids, r.stats, r.finish_reason, wall)

        def looped(i: int) -> dict:
            loop, c = EngineLoop(eng), _Collector()
            try:
                t = time.perf_counter()
                loop.submit(reqs[i], c)
                tokens, stats, reason = c.wait()
                return _row(prompts[i], tokens, stats, reason, time.perf_counter() - t)
            finally:
                loop.stop()

        yield {"engine_alone": Phase(stepped, cpu, True), "engine_loop": Phase(looped, cpu, True)}
    finally:
        eng.close()
        eng = None  # the passes hold it through their closures: let its GPU tensors go
        gc.collect()
        if cfg.on_gpu:
            import torch

            torch.cuda.empty_cache()


@contextlib.contextmanager
def engine_process(a: argparse.Namespace, prompts: list[Prompt], env: dict[str, str] | None, others: dict[str, int],
                   name: str) -> Iterator[Phase]:
    """Start :class:`EngineProcess` (with ``env``; None: this process's) on the same engines and settings, as
    ``spec_decode`` does, and warm it up as :func:`engine_alone`; yield its phase (``wall_ms``: submit → the final
    event read here). Its CPU seconds are the engine process's (role "engine") and its worker ranks', not this
    process's reader thread (which unpickles the cycle messages; ``served`` counts ``spec_decode``'s stub, which
    does that and more). ``others[name]`` holds its pid while it runs.
    """
    collectors: dict[int, _Collector] = {}

    def on_cycle(events, _stats) -> None:  # the reader thread
        for sid, ev, _ in events:
            c = collectors.get(sid)
            if c is not None:  # None: a request given up on (timed out)
                c(ev)

    def on_failed(message: str) -> None:  # the engine process stopped serving: end every waiting request
        print(f"  {name}: engine failed: {message}", flush=True)
        for sid, c in list(collectors.items()):
            c(RequestOutput(sid, [], "", True, "error", None, message))

    proc = EngineProcess(_serve_config(a), on_cycle, on_failed, env=env)
    others[name] = proc.pid
    try:
        reqs = _requests(a, ChatTokenizer.from_dir(Path(a.engines) / "target"), prompts)
        sids = itertools.count(1)

        def one(req: Request) -> tuple[list[int], RequestStats, str]:
            sid = next(sids)
            collectors[sid] = c = _Collector()
            try:
                proc.submit(sid, req)
                return c.wait()
            finally:
                collectors.pop(sid, None)

        def run(i: int) -> dict:
            t = time.perf_counter()
            tokens, stats, reason = one(reqs[i])
            return _row(prompts[i], tokens, stats, reason, time.perf_counter() - t)

        for req in reqs:
            one(req)
        yield Phase(run, lambda: cpu_seconds(proc.pid))
    finally:
        proc.close()
        others.pop(name, None)


@contextlib.contextmanager
def served_engine(a: argparse.Namespace, prompts: list[Prompt], tmp: Path, others: dict[str, int], server: dict,
                  trace_file: Path | None = None) -> Iterator[Phase]:
    """Serve the same engines with tritonserver (a repository rendered with the same settings) and warm it up as
    :func:`engine_alone`; yield its phase: requests streamed over one open gRPC stream (``return_stats``), each
    timed from sending to its final response; CPU seconds: tritonserver's process tree, by role. Once started,
    ``server`` gets ``startup_s`` (seconds to ready) and ``pid`` (tritonserver's, also ``others["served"]``); on exit
    the server stops and ``server`` gets ``log_tail``.

    A row: ``tokens``, ``wall_ms`` (client: sent → final response), ``ttft_ms`` (client: sent → first tokens),
    ``engine_e2e_ms`` / ``engine_ttft_ms`` (the engine's own, from ``return_stats``), ``draft_verify_ms``,
    ``responses``, ``acceptance_length``, ``finish_reason``, ``output_sha``, ``request_id``, ``sent_ns`` (when it was
    sent: ``time.perf_counter_ns()``). With ``trace_file`` tritonserver traces every request's timestamps into
    ``<trace_file>.<index>`` (:mod:`lab.triton_trace`; each request's file is written once it is complete).
    """
    repo = render_repo(_serve_config(a), tmp / "repo")
    trace = trace_args(trace_file) if trace_file else ()
    with TritonServer(repo, exit_timeout_s=10, extra_args=trace) as srv:
        server["startup_s"], server["pid"] = srv.startup_s, srv.pid
        others["served"] = srv.pid
        print(f"  tritonserver ready after {srv.startup_s:.1f} s (log {srv.log_path})", flush=True)
        worker = StreamWorker(srv.grpc_address)
        kw = {"draft_tp": a.draft_tp, "concurrency": 1}
        try:
            for p in prompts:  # warm-up, as for the engine alone
                worker.run(p, a.max_tokens, a.k, block=-1, **kw)

            def run(i: int) -> dict:
                r = worker.run(prompts[i], a.max_tokens, a.k, block=0, **kw)
                return {"prompt_id": r.prompt_id, "tokens": r.num_output_tokens, "wall_ms": r.latency_ms,
                        "ttft_ms": r.ttft_ms, "engine_e2e_ms": r.engine_e2e_ms, "engine_ttft_ms": r.engine_ttft_ms,
                        "draft_verify_ms": r.draft_ms + r.verify_ms, "responses": len(r.token_times_ms),
                        "acceptance_length": r.acceptance_length, "finish_reason": r.finish_reason,
                        "output_sha": r.output_sha, "request_id": r.request_id, "sent_ns": r.sent_ns}

            before = model_stats(srv.http_url)
            yield Phase(run, lambda: cpu_seconds(srv.pid))
            server["model_stats"] = stats_delta(before, model_stats(srv.http_url))
        finally:
            worker.close()
            server["log_tail"] = srv.log_tail(20000)
            others.pop("served", None)
