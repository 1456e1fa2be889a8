#!/usr/bin/env python3
"""Triton's share at batch 1: output tokens/s through the served ensemble against the engine alone.

Both are loaded side by side and measured request by request, each request run in every phase back to back,
the order flipped from one request to the next, so that a drift of the machine's speed (the demo engine's
cycle is host-bound: one core's clock; passes of a few seconds drifted by ±7%) falls on every phase alike:

1. Engine alone (``engine_alone``): ``SpeculativeEngine.load`` in this process, cycles stepped on the main
   thread.
2. Served (``served``): a repository rendered for the same engines and settings (k, devices, draft_tp,
   batch and KV limits), tritonserver started; requests streamed over one open gRPC stream
   (``return_stats``), each timed from sending to the final response.
3. After a warm-up of each (every measured request once: each prompt's prefill shape and every key window its
   decode cycles reach, whose CUDA graphs are captured on first use), ``--rounds`` times every prompt (one request at a
   time, greedy, ``max_tokens``). While one phase runs, the others are idle.
4. ``--loads N`` does all of this N times, each time with the engines loaded afresh (the engine alone first, then
   tritonserver; the other way round on every second load). An engine load runs at a speed of its own: the same
   configuration's cycle moved 5–15% from one load to the next on the GPU (docs/performance.md), as much as
   Triton's whole share, so one load of each compares two draws of that noise. The figures pool all loads; the
   95% interval resamples loads, then prompts within them; ``loads`` in the summary holds each load's own.

``--also`` adds steps between the two, to find where a difference comes from:

- ``engine_loop``: the same in-process engine driven by :class:`splitspec.runtime.loop.EngineLoop` (cycles on a
  background thread, as in the served engine's process);
- ``engine_process``: :class:`splitspec.serving.engine_process.EngineProcess` started from this process (the served
  engine's own process, its loop thread and its per-cycle messages, without Triton);
- ``engine_process_triton_env``: the same, started with the environment tritonserver gets
  (:func:`splitspec.serving.tritonserver.server_env`: its library path first).

tokens/s = output tokens of all requests / the sum of their wall times; each phase's ratio is to the engine
alone's, with a 95% bootstrap interval (request pairs grouped by prompt, prompts resampled). The served path keeps the
tokenizer's end-of-turn tokens (a request cannot turn them off), so every phase stops on them and counts
the tokens actually produced; greedy outputs are compared token for token. Per request the served
latency splits into the engine's own submit → finish time inside ``spec_decode`` (``e2e_ms``) and the
rest (outside the engine: gRPC, preprocessing, execute, one postprocessing call per response).

    .venv/bin/python bench/triton_share.py --engines engines/demo --max-tokens 64          # CPU
    /tmp/tsenv/bin/python bench/triton_share.py --engines /tmp/eng --device-ids 0,1        # GPU

On a GPU machine without network: ``make gpu-carry`` here, carry ``.carry`` (and the models or engines),
``bash scripts/gpu_setup.sh`` there, then run with ``/tmp/tsenv/bin/python``.

Prints a table and writes to ``--out``: ``results.json`` (the summary, its ``excess`` split per request and per
cycle, and every request's row), ``results.png`` (that split, plotted; ``--replot RESULTS_JSON`` draws it again
from a file; ``--pool RESULTS_JSON ...`` pools several runs, each run's loads counted as loads of their own) and
``tritonserver.log``. ``--trace`` also keeps Triton's traces of the served requests
(``trace/load-<n>/trace.json.<index>``, one folder per load's server) and splits each served request's latency by step of the ensemble
(:mod:`splitspec.triton_trace`: gRPC in, preprocessing, ``spec_decode``, the engine, the last postprocessing, gRPC
out), in its row (``path_ms``) and on average (``served_path_ms_per_request``).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import hashlib
import itertools
import json
import math
import os
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Collection, Iterator

for _k, _v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_k, _v)  # inherited by the engine's workers and by tritonserver

from splitspec.measure.placement_bench import StreamWorker, engine_info, machine_info, model_stats, stats_delta  # noqa: E402
from splitspec.serving.engine_process import EngineProcess  # noqa: E402
from splitspec.errors import CheckpointError, SplitspecError  # noqa: E402
from splitspec.generate import encode_prompt, run_closed_loop  # noqa: E402
from splitspec.files import read_json, write_atomic  # noqa: E402
from splitspec.measure.perf_suite import Prompt, load_prompts  # noqa: E402
from splitspec.serving.repo import render_repo  # noqa: E402
from splitspec.runtime.scheduler import SpeculativeEngine  # noqa: E402
from splitspec.runtime.loop import EngineLoop
from splitspec.runtime.types import Request, RequestOutput, RequestStats
from splitspec.serving.tritonserver import TritonServer, server_env  # noqa: E402
from splitspec.settings import ServeConfig, parse_id, parse_ids  # noqa: E402
from splitspec.runtime.tokenizer import ChatTokenizer  # noqa: E402
from splitspec.triton_trace import PATH_PARTS, load_traces, request_path, trace_args  # noqa: E402

#: The phases, in the order they are set up (see the module docstring); ``--also`` names those between the first
#: and the last, which always run.
PHASES = ("engine_alone", "engine_loop", "engine_process", "engine_process_triton_env", "served")



def _sha(ids: list[int]) -> str:
    """Short SHA-1 of a token id list, as :class:`splitspec.measure.placement_bench.RequestRecord` computes ``output_sha``."""
    return hashlib.sha1(json.dumps(ids).encode()).hexdigest()[:16]


def process_tree(root_pid: int, root_role: str | None = None, prune: Collection[int] = ()) -> Iterator[tuple[int, str, str, list[int]]]:
    """The processes under ``root_pid`` (Linux ``/proc``), root first, as ``(pid, role, stat line, thread ids)``.
    role: "engine" (the engine process, or ``root_role`` for the root itself), "target worker ranks", else the
    command name (tritonserver, the backend stubs, ...). The processes in ``prune`` (pids) are left out with
    their subtrees. Processes and threads that exit while being read are skipped."""
    stack = [root_pid]
    while stack:
        pid = stack.pop()
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            tids = [int(t.name) for t in Path(f"/proc/{pid}/task").iterdir()]
        except (OSError, ValueError):  # the process is gone
            continue
        if pid in prune:
            continue
        comm = stat[stat.index("(") + 1:stat.rindex(")")]
        for tid in tids:  # a thread that exits meanwhile must not hide the process or its other children
            try:
                stack += [int(c) for c in Path(f"/proc/{pid}/task/{tid}/children").read_text().split()]
            except (OSError, ValueError):
                pass
        role = (root_role if pid == root_pid and root_role else "engine" if "splitspec.serving.engine_process" in cmdline else
                "target worker ranks" if "splitspec.engine.worker" in cmdline else comm)
        yield pid, role, stat, tids


def cpu_seconds(root_pid: int, root_role: str | None = None, prune: Collection[int] = ()) -> dict[str, float]:
    """User + system CPU seconds so far of the processes of :func:`process_tree`, summed by role."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for _, role, stat, _ in process_tree(root_pid, root_role, prune):
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) ": field 3 (state) onwards
        out[role] = out.get(role, 0.0) + (int(fields[11]) + int(fields[12])) / tick  # utime + stime (fields 14, 15)
    return out


def core_plan(rest_cores: int | None = None) -> dict[str, set[int]]:
    """CPUs for ``--pin``: one CPU of a physical core for the engine's process, one of another for its target worker
    ranks (their SMT siblings left idle), and for everything else every CPU of the other physical cores — or of only
    the next ``rest_cores`` of them (physical cores in the order of their first CPU, the first one skipped). Read from
    ``/sys/devices/system/cpu/*/topology``.

    Raises:
        ValueError: fewer than 4 physical cores are allowed to this process, or ``rest_cores`` is not 1 to the number of
            cores left.
    """
    allowed = sorted(os.sched_getaffinity(0))
    cores: dict[str, set[int]] = {}
    for cpu in allowed:
        path = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list")
        key = path.read_text().strip() if path.exists() else str(cpu)
        cores.setdefault(key, set()).add(cpu)
    physical = list(cores.values())
    if len(physical) < 4:
        raise ValueError(f"--pin needs at least 4 physical cores (this process may use {len(physical)}: CPUs {allowed})")
    engine, workers = physical[1], physical[2]  # not the first core, where the system's interrupts tend to land
    if rest_cores is not None and not 1 <= rest_cores <= len(physical) - 3:
        raise ValueError(f"--serving-cores {rest_cores}: expected 1..{len(physical) - 3} (physical cores allowed to this "
                         f"process besides the first, the engine's and its workers')")
    rest = set(allowed) - engine - workers if rest_cores is None else set().union(*physical[3:3 + rest_cores])
    return {"engine": {min(engine)}, "target worker ranks": {min(workers)}, "rest": rest}


def pin(root_pid: int, plan: dict[str, set[int]], root_cpus: set[int] | None = None, prune: Collection[int] = ()) -> None:
    """Set the CPU affinity of every thread of :func:`process_tree` by role (:func:`core_plan`): the engine
    process and the target worker ranks to their cores, all else to ``plan["rest"]``; with ``root_cpus``, the
    root process (all its threads) to those instead.

    Raises:
        PermissionError: affinity may not be changed here.
    """
    for pid, role, _, tids in process_tree(root_pid, prune=prune):
        cpus = root_cpus if pid == root_pid and root_cpus is not None else plan.get(role, plan["rest"])
        for tid in tids:
            try:
                os.sched_setaffinity(tid, cpus)
            except ProcessLookupError:  # the thread exited
                pass


def cpu_spent(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """CPU seconds per role between two :func:`cpu_seconds` readings (a role in only one reading: 0 for the other)."""
    return {k: round(after.get(k, 0.0) - before.get(k, 0.0), 3) for k in sorted(before.keys() | after.keys())}


#: Seconds one request may take before the benchmark gives up.
REQUEST_TIMEOUT_S = 600.0


@dataclass
class Phase:
    """One way of running the engines. ``run(i)`` runs prompt ``i`` once (greedy, ``max_tokens``) and returns its
    row; ``cpu()`` reads the CPU seconds of the phase's processes by role (:func:`cpu_seconds`); ``in_process``:
    the engine steps on this process's threads (with ``--pin``, this process then sits on the engine's core)."""

    run: Callable[[int], dict]
    cpu: Callable[[], dict[str, float]]
    in_process: bool = False


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
    return [Request(encode_prompt(tok, p.text, p.chat), a.max_tokens, num_draft_tokens=a.k) for p in prompts]


def _serve_config(a: argparse.Namespace) -> ServeConfig:
    """The deployment the settings in ``a`` describe (the engine switches from ``SPLITSPEC_*``)."""
    return ServeConfig.from_env(engines_dir=Path(a.engines), target_device_ids=parse_ids(a.device_ids, "--device-ids"),
                                draft_device_id=parse_id(a.draft_device_id, "--draft-device-id"), draft_tp=a.draft_tp,
                                num_draft_tokens=a.k, max_batch_size=a.max_batch_size, kv_tokens=a.kv_tokens)


@contextlib.contextmanager
def engine_alone(a: argparse.Namespace, prompts: list[Prompt], others: dict[str, int]) -> Iterator[dict[str, Phase]]:
    """Load the engine in this process and warm it up (every measured request once); yield two
    phases on it: ``"engine_alone"`` steps its cycles on this thread (:func:`splitspec.generate.run_closed_loop`),
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
            import torch  # noqa: PLC0415

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
    ``<trace_file>.<index>`` (:mod:`splitspec.triton_trace`; each request's file is written once it is complete).
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


def trace_paths(path: Path, served: list[dict]) -> None:
    """Give each served row its ``path_ms`` (:func:`splitspec.triton_trace.request_path`: its latency split by step of
    the ensemble, from the trace files ``path`` of the server that served it). Raises SplitspecError when a row's
    request has no trace or a step's is incomplete."""
    if not served:
        raise SplitspecError("no served requests to split")
    traces = load_traces(path)
    for r in served:
        if r["request_id"] not in traces:
            raise SplitspecError(f"{path}: no trace of request {r['request_id']!r}")
        r["path_ms"] = request_path(traces[r["request_id"]], r["sent_ns"], r["wall_ms"], r["engine_e2e_ms"])


def tokens_per_s(rows: list[dict]) -> float:
    """Output tokens of ``rows`` / the sum of their ``wall_ms``, in tok/s."""
    return sum(r["tokens"] for r in rows) / (sum(r["wall_ms"] for r in rows) / 1e3)


def summarize(engine: list[dict], served: list[dict]) -> dict:
    """Aggregate figures of both phases (tokens/s; ms per request, means over requests)."""
    mean = statistics.fmean
    e_tps, s_tps = tokens_per_s(engine), tokens_per_s(served)
    return {
        "engine_tokens_per_s": e_tps, "served_tokens_per_s": s_tps, "ratio_served_to_engine": s_tps / e_tps,
        "engine_tokens": sum(r["tokens"] for r in engine), "served_tokens": sum(r["tokens"] for r in served),
        "engine_ms_per_request": mean(r["wall_ms"] for r in engine),
        "served_ms_per_request": mean(r["wall_ms"] for r in served),
        "served_engine_e2e_ms_per_request": mean(r["engine_e2e_ms"] for r in served),
        "outside_engine_ms_per_request": mean(r["wall_ms"] - r["engine_e2e_ms"] for r in served),
        "engine_slower_inside_triton_ms_per_request": mean(s["engine_e2e_ms"] - e["e2e_ms"] for s, e in zip(served, engine)),
        # the engine's own time split: its cycles' draft + verify phases, and the rest (host work between them)
        "engine_draft_verify_ms_per_request": mean(r["draft_verify_ms"] for r in engine),
        "served_draft_verify_ms_per_request": mean(r["draft_verify_ms"] for r in served),
        "engine_rest_ms_per_request": mean(r["e2e_ms"] - r["draft_verify_ms"] for r in engine),
        "served_rest_ms_per_request": mean(r["engine_e2e_ms"] - r["draft_verify_ms"] for r in served),
        "engine_ttft_ms": mean(r["ttft_ms"] for r in engine), "served_ttft_ms": mean(r["ttft_ms"] for r in served),
        "served_responses_per_request": mean(r["responses"] for r in served),
        "acceptance_length": mean(r["acceptance_length"] for r in engine),
        "outputs_differing": sum(e["output_sha"] != s["output_sha"] for e, s in zip(engine, served)),
        "excess": excess_split(served, engine),
    }


def prompts_by_load(rows: list[dict]) -> dict:
    """The ``prompt_id`` values of ``rows`` by their ``load`` (0 for rows without one), loads in order of appearance."""
    out: dict = {}
    for r in rows:
        out.setdefault(r.get("load", 0), set()).add(r["prompt_id"])
    return out


def settings_of(result: dict) -> dict:
    """``result["meta"]["settings"]`` (the run's options), or {} where a results file has none or not an object."""
    meta = result.get("meta")
    settings = meta.get("settings") if isinstance(meta, dict) else None
    return settings if isinstance(settings, dict) else {}


def ratio_ci95(rows: list[dict], engine: list[dict], resamples: int = 2000, seed: int = 0) -> list[float]:
    """95% bootstrap interval of tokens_per_s(rows) / tokens_per_s(engine) (percentile method). The request pairs
    (row i, engine i: the same prompt, run back to back) are grouped by prompt, and the prompts resampled with
    replacement ``resamples`` times: a prompt's requests in different rounds are alike, not independent draws. Rows
    of several engine loads (their ``load``) are resampled in two stages, loads first, then prompts within each drawn
    load: a load runs at a speed of its own, so its requests are not independent draws either. With few loads the
    interval is coarse (with two, it runs from one load's ratio to the other's).

    Raises:
        ValueError: the loads did not all run the same prompts.
    """
    import numpy as np  # noqa: PLC0415

    loads = sorted({r.get("load", 0) for r in rows})
    ids = sorted({r["prompt_id"] for r in rows})
    by_load = prompts_by_load(rows)
    if any(v != set(ids) for v in by_load.values()):
        raise ValueError("the loads ran different prompts: " + "; ".join(
            f"load {x + 1}: {len(v)} of {len(ids)}" for x, v in by_load.items()) + " (an interval over loads needs the same prompts in each)")
    at_l, at_p = {x: i for i, x in enumerate(loads)}, {p: i for i, p in enumerate(ids)}
    sums = np.zeros((len(loads), len(ids), 4))  # per load and prompt: tokens and wall ms of rows, then of engine
    for r, e in zip(rows, engine):
        sums[at_l[r.get("load", 0)], at_p[r["prompt_id"]]] += (r["tokens"], r["wall_ms"], e["tokens"], e["wall_ms"])
    rng = np.random.default_rng(seed)
    li = rng.integers(0, len(loads), size=(resamples, len(loads))) if len(loads) > 1 else np.zeros((resamples, 1), int)
    pi = rng.integers(0, len(ids), size=(resamples, len(loads), len(ids)))
    t = sums[li[:, :, None], pi].sum(axis=(1, 2))  # (resamples, 4)
    ratio = (t[:, 0] / t[:, 1]) / (t[:, 2] / t[:, 3])
    return [float(x) for x in np.percentile(ratio, [2.5, 97.5])]


def excess_split(rows: list[dict], engine: list[dict]) -> dict:
    """How much longer ``rows``' requests took than the engine alone's (the same requests, pairwise), split by least
    squares into a part per request and a part per decode cycle: ``wall_ms - engine wall_ms ≈ per_request_ms +
    per_cycle_ms · cycles`` (cycles: the engine alone's count; greedy outputs are the same). With
    ``engine_ms_per_cycle`` (the engine alone's wall time per cycle, request time included) the ratio of a request of
    ``n`` cycles follows as ``n·t / (n·t + per_request_ms + n·per_cycle_ms)``; ``asymptotic_ratio`` is its limit.

    The intercept rests on the spread of the requests' lengths: with the demo prompts most requests run to
    ``max_tokens`` and only a few prompts stop early, so those few prompts set it. All four values are None when the
    split is undefined (fewer than 3 requests, no cycles, all requests of one length, values not finite);
    ``asymptotic_ratio`` also when ``t + per_cycle_ms`` is not positive.

    Raises:
        ValueError: ``rows`` and ``engine`` differ in length.
    """
    import numpy as np  # noqa: PLC0415

    if len(rows) != len(engine):
        raise ValueError(f"excess_split: {len(rows)} rows against {len(engine)} of the engine alone")
    none = {"per_request_ms": None, "per_cycle_ms": None, "engine_ms_per_cycle": None, "asymptotic_ratio": None}
    n = np.array([e["cycles"] for e in engine], dtype=float)
    extra = np.array([r["wall_ms"] - e["wall_ms"] for r, e in zip(rows, engine)], dtype=float)
    if len(n) < 3 or n.sum() <= 0 or not (np.isfinite(n).all() and np.isfinite(extra).all()) or np.ptp(n) == 0:
        return none
    t = float(sum(e["wall_ms"] for e in engine) / n.sum())
    (a, b), *_ = np.linalg.lstsq(np.stack([np.ones_like(n), n], axis=1), extra, rcond=None)
    return {"per_request_ms": float(a), "per_cycle_ms": float(b), "engine_ms_per_cycle": t,
            "asymptotic_ratio": t / (t + b) if t + b > 0 else None}


def phase_summary(rows: list[dict], engine: list[dict]) -> dict:
    """Figures of an in-engine phase of ``--also`` against the engine alone's rows (same requests, same order):
    tokens/s, their ratio and its 95% interval (:func:`ratio_ci95`); ms per request (means): wall, the engine's own
    e2e, its draft + verify and the rest, and how much longer its e2e was than alone's; the excess split
    (:func:`excess_split`); how many greedy outputs differ."""
    mean = statistics.fmean
    tps = tokens_per_s(rows)
    return {"tokens_per_s": tps, "ratio_to_engine_alone": tps / tokens_per_s(engine), "ratio_ci95": ratio_ci95(rows, engine),
            "ms_per_request": mean(r["wall_ms"] for r in rows), "e2e_ms_per_request": mean(r["e2e_ms"] for r in rows),
            "draft_verify_ms_per_request": mean(r["draft_verify_ms"] for r in rows),
            "rest_ms_per_request": mean(r["e2e_ms"] - r["draft_verify_ms"] for r in rows),
            "slower_than_alone_ms_per_request": mean(r["e2e_ms"] - e["e2e_ms"] for r, e in zip(rows, engine)),
            "excess": excess_split(rows, engine),
            "outputs_differing": sum(r["output_sha"] != e["output_sha"] for r, e in zip(rows, engine))}


def excess_text(x: dict) -> str:
    """One line for :func:`excess_split`'s figures."""
    if x["per_request_ms"] is None:
        return "excess over alone not split (too few requests, or all of one length)"
    limit = "—" if x["asymptotic_ratio"] is None else f"{x['asymptotic_ratio']:.3f}"
    return (f"excess over alone ≈ {x['per_request_ms']:+.2f} ms per request {x['per_cycle_ms']:+.3f} ms per cycle "
            f"(alone: {x['engine_ms_per_cycle']:.2f} ms per cycle; ratio for long requests → {limit})")


def print_table(s: dict, n: int) -> None:
    """Print the summary of :func:`summarize` for ``n`` requests."""
    rows = [("output tokens/s", f"{s['engine_tokens_per_s']:.1f}", f"{s['served_tokens_per_s']:.1f}"),
            ("ms per request (mean)", f"{s['engine_ms_per_request']:.1f}", f"{s['served_ms_per_request']:.1f}"),
            ("TTFT ms (mean)", f"{s['engine_ttft_ms']:.1f}", f"{s['served_ttft_ms']:.1f}"),
            ("output tokens", str(s["engine_tokens"]), str(s["served_tokens"]))]
    print(f"\n{'batch 1, ' + str(n) + ' requests each':28s} {'engine alone':>14s} {'served (gRPC)':>14s}")
    for name, e, v in rows:
        print(f"{name:28s} {e:>14s} {v:>14s}")
    lo, hi = s["ratio_ci95"]
    share = 1 - s["ratio_served_to_engine"]
    print(f"ratio served / engine: {s['ratio_served_to_engine']:.3f}, 95% interval {lo:.3f}–{hi:.3f} (Triton's share of "
          f"the time: {share:.1%}{', served ran faster' if share < 0 else ''}); per round: "
          f"{', '.join(f'{x:.3f}' for x in (r['ratio'] for r in s['rounds']))} (median {s['ratio_median_of_rounds']:.3f}); "
          f"median over request pairs {s['request_ratio_median']:.3f}")
    if "loads" in s:
        print("per engine load: " + ", ".join(f"{x['ratio_served_to_engine']:.3f} ({x['engine_tokens_per_s']:.0f} / "
                                              f"{x['served_tokens_per_s']:.0f} tok/s alone / served, outside the engine "
                                              f"{x['outside_engine_ms_per_request']:.1f} ms)" for x in s["loads"]))
    print(f"per request: outside the engine {s['outside_engine_ms_per_request']:.1f} ms, engine slower inside "
          f"Triton than alone {s['engine_slower_inside_triton_ms_per_request']:+.1f} ms; "
          f"{s['served_responses_per_request']:.1f} responses/request, acceptance length {s['acceptance_length']:.2f}; "
          f"greedy outputs differing: {s['outputs_differing']}")
    print(f"served: {excess_text(s['excess'])}")
    if path := s.get("served_path_ms_per_request"):
        print("served, ms per request by step (Triton's traces): " + " → ".join(f"{k} {path[k]:.2f}" for k in PATH_PARTS)
              + f"; round trips to a stub with its execute: preprocessing's {path['preprocessing_execute']:.2f}, "
              f"postprocessing's of the first response {path['first_postprocessing_execute']:.2f} and of the last "
              f"{path['last_postprocessing_execute']:.2f}; {path['responses']:.1f} responses")
    print(f"inside the engine, per request: draft + verify {s['engine_draft_verify_ms_per_request']:.1f} ms alone, "
          f"{s['served_draft_verify_ms_per_request']:.1f} ms served; the rest of its time {s['engine_rest_ms_per_request']:.1f} "
          f"ms alone, {s['served_rest_ms_per_request']:.1f} ms served")
    fmt = lambda d: ", ".join(f"{k} {v:.2f}" for k, v in d.items())  # noqa: E731
    print(f"CPU cores busy while measuring: alone (this process and its workers): {fmt(s['cores_busy_engine_alone'])}; "
          f"served (tritonserver and its process tree): {fmt(s['cores_busy_served'])}")
    print(f"CPU ms per output token: alone: {fmt(s['cpu_ms_per_output_token_engine_alone'])}; "
          f"served: {fmt(s['cpu_ms_per_output_token_served'])}")
    for m, d in s.get("triton_models_per_request", {}).items():
        print(f"  Triton, per served request: {m:15s} {d['executions']:5.1f} executions, " + ", ".join(
            f"{k.removesuffix('_ms')} {v:.2f} ms" for k, v in d.items() if k != "executions"))
    for name, ph in s["phases"].items():
        print(f"{name}: {ph['tokens_per_s']:.1f} tok/s, ratio to alone {ph['ratio_to_engine_alone']:.3f} "
              f"({ph['ratio_ci95'][0]:.3f}–{ph['ratio_ci95'][1]:.3f}); per request "
              f"e2e {ph['e2e_ms_per_request']:.1f} ms ({ph['slower_than_alone_ms_per_request']:+.1f} against alone: draft + "
              f"verify {ph['draft_verify_ms_per_request']:.1f}, rest {ph['rest_ms_per_request']:.1f}); CPU ms per output "
              f"token {fmt(s['cpu_ms_per_output_token_' + name])}; outputs differing {ph['outputs_differing']}; "
              f"{excess_text(ph['excess'])}")


#: Settings that runs pooled by ``--pool`` must share (from each file's ``meta.settings``; a file without them is
#: compared as having None).
POOL_SAME = ("k", "max_tokens", "device_ids", "draft_device_id", "draft_tp", "max_batch_size", "kv_tokens", "prompts", "pin",
             "serving_cores")


def pool_runs(runs: list[tuple[str, dict]]) -> dict:
    """Pool several runs' results (``[(name, results.json contents)]``): each run's loads become loads of their own
    (numbered in the order given; rows of a run without ``load`` are one load). Returns ``ratio`` (served tokens/s
    over alone's, all rows), ``ratio_ci95`` (:func:`ratio_ci95`, loads then prompts resampled), ``loads`` (each load's
    run and ratio) and ``outside_engine_ms_per_request`` (mean over the served rows that carry the engine's e2e).

    Raises:
        ValueError: a run's rows are malformed (:func:`_phase_rows`; served rows also need a string ``prompt_id`` and
            an integer ``load`` where they have one), its settings differ from the first run's (:data:`POOL_SAME`),
            or one of its loads ran other prompts than the first run's first load; the message starts with its
            name.
    """
    engine, served, loads = [], [], []
    for name, result in runs:
        try:
            e_rows = _phase_rows(result, "engine", cycles=False)
            s_rows = _phase_rows(result, "served", e_rows)
            for i, r in enumerate(s_rows):
                if not isinstance(r.get("prompt_id"), str) or type(r.get("load", 0)) is not int:
                    raise ValueError(f"'served' row {i}: expected a string 'prompt_id' and an integer 'load' (if any)")
            settings = {k: settings_of(result).get(k) for k in POOL_SAME}
            if not loads:
                first_name, first_settings = name, settings
            differ = [k for k in POOL_SAME if settings.get(k) != first_settings.get(k)]
            if differ:
                raise ValueError(f"its settings differ from {first_name}'s in " + ", ".join(
                    f"{k} ({settings.get(k)!r} against {first_settings.get(k)!r})" for k in differ)
                    + ": only runs of one configuration pool")
            prompts = prompts_by_load(s_rows)
            if not loads:
                first_prompts = next(iter(prompts.values()))
            for x, v in prompts.items():
                if v != first_prompts:
                    raise ValueError(f"load {x + 1} ran {len(v)} prompts, not the {len(first_prompts)} of {first_name}'s "
                                     "first load: an interval over loads needs the same prompts in each")
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from None
        ids = sorted({r.get("load", 0) for r in s_rows})
        renum = {x: len(loads) + i for i, x in enumerate(ids)}
        for x in ids:
            pick = [i for i, r in enumerate(s_rows) if r.get("load", 0) == x]
            loads.append({"run": name, "load": renum[x],
                          "ratio": tokens_per_s([s_rows[i] for i in pick]) / tokens_per_s([e_rows[i] for i in pick])})
        served += [r | {"load": renum[r.get("load", 0)]} for r in s_rows]
        engine += e_rows
    outside = [r["wall_ms"] - r["engine_e2e_ms"] for r in served if isinstance(r.get("engine_e2e_ms"), (int, float))]
    return {"ratio": tokens_per_s(served) / tokens_per_s(engine), "ratio_ci95": ratio_ci95(served, engine),
            "loads": loads, "outside_engine_ms_per_request": statistics.fmean(outside) if outside else None}


def print_pooled(x: dict) -> None:
    """Print :func:`pool_runs`' figures."""
    lo, hi = x["ratio_ci95"]
    out = x["outside_engine_ms_per_request"]
    print(f"{len(x['loads'])} engine loads pooled: served / alone {x['ratio']:.3f}, 95% interval {lo:.3f}–{hi:.3f}"
          + ("" if out is None else f"; outside the engine {out:.2f} ms per request"))
    for ld in x["loads"]:
        print(f"  load {ld['load'] + 1}: {ld['ratio']:.3f}  ({ld['run']})")


def _real(v) -> bool:
    """A finite int or float, not a bool."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _phase_rows(result: dict, name: str, like: list[dict] | None = None, cycles: bool = True) -> list[dict]:
    """``result[name]``: request rows with a finite ``wall_ms`` > 0 and an integer ``tokens`` ≥ 0 (some > 0), an
    integer ``cycles`` ≥ 0 too for the engine alone's unless ``cycles`` is False, and where a row has
    ``engine_e2e_ms``, a finite one within 0 .. ``wall_ms``. With ``like`` (the engine alone's rows) as many rows,
    each the same request as its partner (the same ``prompt_id``, ``load`` and ``round`` where both rows have them).

    Raises:
        ValueError: naming the phase, the row and the field that is wrong.
    """
    rows = result.get(name)
    if not isinstance(rows, list) or not rows:
        raise ValueError(f"'{name}': expected a non-empty list of request rows")
    for i, r in enumerate(rows):
        if not isinstance(r, dict):
            raise ValueError(f"'{name}' row {i}: expected an object, got {type(r).__name__}")
        if name == "engine" and cycles and "cycles" not in r:
            raise ValueError("'engine': its rows have no 'cycles' (results written before cycle counts were recorded)")
        if not (_real(r.get("wall_ms")) and r["wall_ms"] > 0):
            raise ValueError(f"'{name}' row {i}: wall_ms = {r.get('wall_ms')!r:.40}, expected a finite number > 0")
        for k in ("tokens", "cycles") if name == "engine" and cycles else ("tokens",):
            v = r.get(k)
            if type(v) is not int or not 0 <= v < 2 ** 53:
                raise ValueError(f"'{name}' row {i}: {k} = {v!r:.40}, expected an integer ≥ 0")
        e2e = r.get("engine_e2e_ms")
        if e2e is not None and not (_real(e2e) and 0 <= e2e <= r["wall_ms"]):
            raise ValueError(f"'{name}' row {i}: engine_e2e_ms = {e2e!r:.40}, expected a finite number within 0 .. "
                             f"its wall_ms {r['wall_ms']}")
    if not sum(r["tokens"] for r in rows):
        raise ValueError(f"'{name}': no tokens in any row")
    if like is not None:
        if len(rows) != len(like):
            raise ValueError(f"'{name}': {len(rows)} rows, but the engine alone has {len(like)}")
        for i, (r, e) in enumerate(zip(rows, like)):
            for k in ("prompt_id", "load", "round"):
                if k in r and k in e and r[k] != e[k]:
                    raise ValueError(f"'{name}' row {i} is {k} {r[k]!r:.40}, the engine alone's row {i} "
                                     f"{e[k]!r:.40}: the rows are not the same requests pairwise")
    return rows


def plot_excess(result: dict, path: Path) -> Path | None:
    """Scatter of each phase's excess over the engine alone (ms per request) against the request's cycles, with the
    :func:`excess_split` line, as PNG at ``path``; from the request rows of a ``results.json`` (``engine``, ``served``
    and any ``--also`` phases). Returns None (and says why) without matplotlib (the GPU image may lack it:
    ``--replot`` draws it later).

    Raises:
        ValueError: ``result`` is not this script's results (a phase's rows missing or malformed).
    """
    if not isinstance(result, dict):
        raise ValueError(f"expected a JSON object with the request rows, got {type(result).__name__}")
    engine = _phase_rows(result, "engine")
    phases = {name: _phase_rows(result, name, engine) for name in [*PHASES[1:-1], "served"] if name in result}
    if "served" not in phases:
        raise ValueError("'served': missing")
    try:
        import matplotlib  # noqa: PLC0415

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError:
        print(f"no matplotlib here: no plot (bench/triton_share.py --replot {path.with_suffix('.json')} draws it)")
        return None
    n = [e["cycles"] for e in engine]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, rows in phases.items():
        x = excess_split(rows, engine)
        pts = ax.scatter(n, [r["wall_ms"] - e["wall_ms"] for r, e in zip(rows, engine)], s=8, alpha=0.5, label=name)
        if x["per_cycle_ms"] is not None:
            ax.plot([0, max(n)], [x["per_request_ms"], x["per_request_ms"] + x["per_cycle_ms"] * max(n)],
                    color=pts.get_facecolor()[0][:3],
                    label=f"{name}: {x['per_request_ms']:+.2f} ms {x['per_cycle_ms']:+.3f} ms/cycle")
    ax.axhline(0, color="grey", lw=0.5)
    meta = settings_of(result)
    ratio = tokens_per_s(phases["served"]) / tokens_per_s(engine)
    ax.set(xlabel="decode cycles of the request (engine alone)", ylabel="wall time over the engine alone's (ms)",
           title=f"Triton's share at batch 1: ratio {ratio:.3f} (k={meta.get('k', '?')}, max_tokens "
                 f"{meta.get('max_tokens', '?')}, devices {meta.get('device_ids') or 'cpu'})")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def measure_load(a: argparse.Namespace, prompts: list[Prompt], names: list[str], load: int,
                 plan: dict[str, set[int]] | None, start_cpus: set[int], rows: dict[str, list[dict]],
                 cpu_s: dict[str, dict[str, float]]) -> dict:
    """Load every phase's engines once (load number ``load``: the engine alone first when it is even, tritonserver
    first when it is odd, so that neither always gets the GPU memory first), warm each up, then run ``a.rounds``
    rounds of every prompt. Appends each request's row (with its ``round`` and ``load``) to ``rows[phase]`` and the
    CPU seconds by role to ``cpu_s[phase]``; returns the server's record (:func:`served_engine`). All is unloaded on
    return. With ``plan`` (``--pin``) this process first gets ``start_cpus`` back (its CPUs at start), so that what it
    starts is not confined to the core the last load left it on."""
    if plan:  # this process may sit on the engine's core since the last load: what it starts now inherits its
        os.sched_setaffinity(0, start_cpus)  # affinity (threads sized from it), so back to all its CPUs first
    server: dict = {}
    others: dict[str, int] = {}
    trace_file = Path(a.trace_dir) / f"load-{load + 1}" / "trace.json" if a.trace_dir else None
    if trace_file:
        trace_file.parent.mkdir(parents=True, exist_ok=True)
        server["trace_file"] = trace_file
    with tempfile.TemporaryDirectory(prefix="triton_share.") as tmp, contextlib.ExitStack() as stack:
        phases: dict[str, Phase] = {}

        def alone() -> None:
            print("engine alone: loading, warm-up ...", flush=True)
            phases.update(stack.enter_context(engine_alone(a, prompts, others)))
            for name in a.also:
                if name.startswith("engine_process"):
                    print(f"{name}: starting the engine process, warm-up ...", flush=True)
                    env = server_env() if name == "engine_process_triton_env" else None
                    phases[name] = stack.enter_context(engine_process(a, prompts, env, others, name))

        def served() -> None:
            print("served: starting tritonserver, warm-up ...", flush=True)
            phases["served"] = stack.enter_context(served_engine(a, prompts, Path(tmp), others, server, trace_file))
            if plan:  # the served engine's process and worker rank to their cores, tritonserver and its stubs elsewhere
                pin(server["pid"], plan)

        for start in ((alone, served) if load % 2 == 0 else (served, alone)):
            start()
        here = None  # where this process is pinned: True on the engine's core
        for r in range(a.rounds):
            for i in range(len(prompts)):
                # each request in every phase back to back, the order flipped from one request to the next: a
                # drift of the machine's speed falls on every phase alike
                for name in names[::-1 if (r + i) % 2 else 1]:
                    ph = phases[name]
                    if plan and here is not ph.in_process:  # the in-process engine on its core, the client elsewhere
                        # (an engine process started from here keeps its core: role "engine")
                        pin(os.getpid(), plan, plan["engine"] if ph.in_process else plan["rest"], prune={server["pid"]})
                        here = ph.in_process
                    before = ph.cpu()
                    row = ph.run(i)
                    for k, v in cpu_spent(before, ph.cpu()).items():
                        cpu_s[name][k] = cpu_s[name].get(k, 0.0) + v
                    rows[name].append(row | {"round": r, "load": load})
            got = {n: tokens_per_s(rows[n][-len(prompts):]) for n in names}
            print(f"round {r + 1}/{a.rounds}: " + ", ".join(f"{n} {got[n]:.1f} tok/s" for n in names)
                  + f"; served / alone {got['served'] / got['engine_alone']:.3f}", flush=True)
    return server


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engines", default="engines/demo", help="built engines (target/ + drafter/, tokenizer in target/)")
    p.add_argument("-k", type=int, default=4, help="draft tokens per cycle (default 4)")
    p.add_argument("--max-tokens", type=int, default=128, help="output tokens per request at most (default 128)")
    p.add_argument("--prompts", default=None, help="JSON-lines prompts (default eval/prompts.jsonl)")
    p.add_argument("--device-ids", default="", help="GPU ids of the target's ranks, e.g. 0 or 0,1 (default: CPU)")
    p.add_argument("--draft-device-id", default="", help="GPU of a TP1 drafter (default: target rank 0's)")
    p.add_argument("--draft-tp", type=int, default=1, help="drafter TP size: 1 or the target's")
    p.add_argument("--rounds", type=int, default=3, help="times every prompt is run in every phase per load (default 3)")
    p.add_argument("--loads", type=int, default=1, help="times the engines are loaded, alone and served alike, each load "
                   "measuring --rounds rounds; the order of loading alternates (default 1). An engine load runs at a speed "
                   "of its own (5–15%% apart on the GPU), which more loads average out")
    p.add_argument("--also", default="", help="phases measured besides engine_alone and served, comma-separated: "
                   f"{', '.join(PHASES[1:-1])} (see the module docstring)")
    p.add_argument("--pin", action="store_true", help="pin the engine's process and its worker ranks to a physical core "
                   "each, everything else (tritonserver, its stubs, the client) to the other cores; every phase alike "
                   "(needs ≥ 4 physical cores)")
    p.add_argument("--serving-cores", type=int, default=None, help="with --pin: tritonserver, its stubs and the client "
                   "on this many physical cores only (default: every core but the engine's and its workers')")
    p.add_argument("--max-batch-size", type=int, default=None, help="engine batch slots (default the engine's)")
    p.add_argument("--kv-tokens", type=int, default=None, help="KV budget in tokens (default the engine's)")
    p.add_argument("--trace", action="store_true", help="trace every served request with Triton's trace API "
                   "(timestamps; <out>/trace/) and split its time by step of the ensemble (splitspec.triton_trace)")
    p.add_argument("--out", default=None, help="results folder (default bench/results/triton-share-<time>)")
    only = p.add_mutually_exclusive_group()  # either mode ignores the measuring options
    only.add_argument("--replot", default=None, metavar="RESULTS_JSON", help="only draw the plot of an earlier run's "
                      "results.json (beside the file, the same name with .png) and exit")
    only.add_argument("--pool", nargs="+", default=None, metavar="RESULTS_JSON", help="only pool earlier runs' "
                      "results.json files of one configuration (each run's loads counted as loads of their own; a file "
                      "may be given once) and print the ratio, its 95%% interval and each load's")
    a = p.parse_args(argv)

    def results(path: Path, option: str) -> dict:
        """The JSON object in ``path`` (:func:`splitspec.convert.safetensors.read_json`); exits naming the file when it is not one."""
        try:
            return read_json(path)
        except CheckpointError as e:
            p.error(f"{option} {e}")

    if a.replot:
        path = Path(a.replot)
        png = path.with_suffix(".png")
        if png.resolve() == path.resolve():
            p.error(f"--replot {path}: the plot would overwrite it; give the results' .json file")
        try:
            done = plot_excess(results(path, "--replot"), png)
        except ValueError as e:  # not this script's results
            p.error(f"--replot {path}: {e}")
        except OSError as e:
            p.error(f"--replot: cannot write the plot {png} ({e})")
        if done:
            print(f"plot: {done}")
        return 0 if done else 1
    if a.pool:
        runs, seen = [], {}
        for name in a.pool:
            result = results(Path(name), "--pool")
            key = hashlib.sha256(json.dumps(result, sort_keys=True).encode()).hexdigest()
            if key in seen:
                p.error(f"--pool {name}: the same results as {seen[key]}; each run may be pooled once")
            seen[key] = name
            runs.append((name, result))
        try:
            print_pooled(pool_runs(runs))
        except ValueError as e:  # a file that is not this script's results, or unlike runs
            p.error(f"--pool {e}")
        return 0
    for name in ("rounds", "loads"):
        if getattr(a, name) < 1:
            p.error(f"--{name} must be at least 1 (got {getattr(a, name)})")
    also = {x for x in a.also.split(",") if x}
    if bad := sorted(also - set(PHASES[1:-1])):
        p.error(f"--also: unknown phase(s) {', '.join(bad)}; expected some of {', '.join(PHASES[1:-1])}")
    a.also = [x for x in PHASES if x in also]  # each once, in the order they are set up
    if a.serving_cores is not None and not a.pin:
        p.error("--serving-cores places the processes that --pin places: give --pin too")
    machine = machine_info()  # before --pin moves this process (its usable CPUs) and the run loads the machine
    try:
        plan = core_plan(a.serving_cores) if a.pin else None  # before anything is loaded or written
    except ValueError as e:
        p.error(str(e))
    engines = Path(a.engines).resolve()
    a.engines = str(engines)
    for part in ("target", "drafter"):
        if not (engines / part / "engine.json").is_file():
            p.error(f"--engines {engines}: no {part}/engine.json (expected the folder `splitspec build` wrote)")
    try:
        prompts = load_prompts(Path(a.prompts) if a.prompts else None, engines / "target")
    except SplitspecError as e:
        p.error(f"--prompts: {e}")
    out = Path(a.out or f"bench/results/triton-share-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    a.trace_dir = None
    if a.trace:
        trace_dir = out / "trace"
        trace_dir.mkdir(exist_ok=True)
        if any(trace_dir.iterdir()):  # trace ids restart with each server: two runs' files do not mix
            p.error(f"--trace: {trace_dir} holds files of an earlier run; give another --out or remove them")
        a.trace_dir = str(trace_dir.resolve())  # load n's server traces into trace/load-<n>/
    print(f"{len(prompts)} prompts x {a.rounds} rounds x {a.loads} load(s), max_tokens {a.max_tokens}, k={a.k}, draft_tp={a.draft_tp}, "
          f"devices {a.device_ids or 'cpu'}, engines {engines}", flush=True)
    t0 = time.monotonic()
    names = ["engine_alone", *a.also, "served"]
    rows: dict[str, list[dict]] = {name: [] for name in names}
    cpu_s: dict[str, dict[str, float]] = {name: {} for name in names}
    if plan:
        print(f"--pin: engine process on CPU {sorted(plan['engine'])}, its target worker ranks on "
              f"{sorted(plan['target worker ranks'])}, everything else on {sorted(plan['rest'])}", flush=True)
    servers, start_cpus = [], os.sched_getaffinity(0)
    for load in range(a.loads):
        if a.loads > 1:
            print(f"load {load + 1}/{a.loads}", flush=True)
        servers.append(measure_load(a, prompts, names, load, plan, start_cpus, rows, cpu_s))
    engine, served = rows["engine_alone"], rows["served"]
    s = summarize(engine, served)
    rounds = [{"load": ld, "round": r, **{f"{n}_tokens_per_s": tokens_per_s([x for x in rows[n] if (x["load"], x["round"]) == (ld, r)])
                                          for n in names}} for ld in range(a.loads) for r in range(a.rounds)]
    for x in rounds:
        x["ratio"] = x["served_tokens_per_s"] / x["engine_alone_tokens_per_s"]
    ratios = [x["ratio"] for x in rounds]
    s |= {"ratio_ci95": ratio_ci95(served, engine), "rounds": rounds, "ratio_median_of_rounds": statistics.median(ratios),
          "ratio_min": min(ratios), "ratio_max": max(ratios),
          "request_ratio_median": statistics.median(e["wall_ms"] / v["wall_ms"] for e, v in zip(engine, served))}
    if a.loads > 1:  # each load's own figures: how far apart the loads ran
        s["loads"] = [{"load": ld, "startup_s": servers[ld].get("startup_s"),
                       **{k: v for k, v in summarize([e for e in engine if e["load"] == ld],
                                                     [v for v in served if v["load"] == ld]).items() if k != "excess"}}
                      for ld in range(a.loads)]
    for name in names:
        tokens, wall_s = sum(r["tokens"] for r in rows[name]), sum(r["wall_ms"] for r in rows[name]) / 1e3
        s[f"cores_busy_{name}"] = {k: round(v / wall_s, 3) for k, v in cpu_s[name].items()}
        s[f"cpu_ms_per_output_token_{name}"] = {k: round(1e3 * v / tokens, 3) for k, v in cpu_s[name].items()}
    s["phases"] = {name: phase_summary(rows[name], engine) for name in a.also}
    if a.trace:
        try:
            for ld, srv in enumerate(servers):
                trace_paths(srv["trace_file"], [v for v in served if v["load"] == ld])
            s["served_path_ms_per_request"] = {k: statistics.fmean(v["path_ms"][k] for v in served) for k in served[0]["path_ms"]}
        except SplitspecError as e:  # the measurements stand without it
            s["served_path_error"] = str(e)
            print(f"--trace: no split by step: {e}", flush=True)
    if all("model_stats" in srv for srv in servers):  # per served request: executions and ms by phase of each model
        total: dict[str, dict[str, list[float]]] = {}
        for srv in servers:
            for m, d in srv["model_stats"].items():
                for ph, (n, ms) in d.items():
                    acc = total.setdefault(m, {}).setdefault(ph, [0, 0.0])
                    acc[0], acc[1] = acc[0] + n, acc[1] + ms
        s["triton_models_per_request"] = {m: {"executions": d["compute_infer"][0] / len(served),
                                              **{f"{ph}_ms": ms / len(served) for ph, (_, ms) in d.items() if ph != "success"}}
                                          for m, d in total.items()}
    print_table(s, len(engine))
    result = {"meta": {**machine, "engines": engine_info(engines), "settings": vars(a),
                       "wall_s": round(time.monotonic() - t0, 1), "startup_s": [srv.get("startup_s") for srv in servers],
                       "pinned": {k: sorted(v) for k, v in plan.items()} if plan else None},
              "summary": s, "engine": engine, "served": served, **{name: rows[name] for name in a.also}}
    write_atomic(out / "results.json", json.dumps(result, indent=1) + "\n")
    write_atomic(out / "tritonserver.log", "".join(f"===== load {ld + 1}: the end of tritonserver's log =====\n{srv.get('log_tail', '')}\n"
                                                  for ld, srv in enumerate(servers)))
    print(f"results: {out / 'results.json'}")
    if done := plot_excess(result, out / "results.png"):
        print(f"plot: {done}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
