#!/usr/bin/env python3
"""Triton's share at batch 1: output tokens/s through the served ensemble against the engine alone.

Both are loaded side by side, then measured in alternating passes, so that a drift of the machine's speed
(the demo engine's cycle is host-bound: one core's clock) falls on both alike:

1. Engine alone: ``SpeculativeEngine.load`` in this process.
2. Served: a repository rendered for the same engines and settings (k, devices, draft_tp, batch and
   KV limits), tritonserver started; requests streamed over one open gRPC stream (``return_stats``),
   each timed from sending to the final response.
3. After a warm-up of each (a short request per prompt), ``--rounds`` rounds of one pass each (the
   prompts, ``--repeats`` times, one request at a time, greedy, ``max_tokens``); the order within a
   round alternates. While one side runs, the other is idle.

tokens/s = output tokens of all requests / the sum of their wall times. The served path keeps the
tokenizer's end-of-turn tokens (a request cannot turn them off), so both phases stop on them and count
the tokens actually produced; greedy outputs are compared token for token. Per request the served
latency splits into the engine's own submit → finish time inside ``spec_decode`` (``e2e_ms``) and the
rest (outside the engine: gRPC, preprocessing, execute, one postprocessing call per response).

    .venv/bin/python bench/triton_share.py --engines engines/demo --max-tokens 64          # CPU
    /tmp/tsenv/bin/python bench/triton_share.py --engines /tmp/eng --device-ids 0,1        # GPU

On a GPU machine without network: ``make gpu-carry`` here, carry ``.carry`` (and the models or engines),
``bash scripts/gpu_setup.sh`` there, then run with ``/tmp/tsenv/bin/python``.

Prints a table and writes ``results.json`` to ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import hashlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterator

for _k, _v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_k, _v)  # inherited by the engine's workers and by tritonserver

from splitspec.bench import StreamWorker, engine_info, machine_info  # noqa: E402
from splitspec.generate import encode_prompt, run_closed_loop  # noqa: E402
from splitspec.perf import Prompt, load_prompts  # noqa: E402
from splitspec.repo import render_repo  # noqa: E402
from splitspec.runtime import Request, SpeculativeEngine  # noqa: E402
from splitspec.server import TritonServer  # noqa: E402

#: Output tokens of each warm-up request (one per prompt, before measuring).
WARMUP_TOKENS = 8


def _sha(ids: list[int]) -> str:
    """Short SHA-1 of a token id list, as :class:`splitspec.bench.RequestRecord` computes ``output_sha``."""
    return hashlib.sha1(json.dumps(ids).encode()).hexdigest()[:16]


def process_tree(root_pid: int, root_role: str | None = None, prune: str | None = None) -> Iterator[tuple[int, str, str, list[int]]]:
    """The processes under ``root_pid`` (Linux ``/proc``), root first, as ``(pid, role, stat line, thread ids)``.
    role: "engine" (the engine process, or ``root_role`` for the root itself), "target worker ranks", else the
    command name (tritonserver, the backend stubs, ...). A process whose command name is ``prune`` is left out
    with its subtree. Processes and threads that exit while being read are skipped."""
    stack = [root_pid]
    while stack:
        pid = stack.pop()
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            tids = [int(t.name) for t in Path(f"/proc/{pid}/task").iterdir()]
        except (OSError, ValueError):  # the process is gone
            continue
        comm = stat[stat.index("(") + 1:stat.rindex(")")]
        if comm == prune:
            continue
        for tid in tids:  # a thread that exits meanwhile must not hide the process or its other children
            try:
                stack += [int(c) for c in Path(f"/proc/{pid}/task/{tid}/children").read_text().split()]
            except (OSError, ValueError):
                pass
        role = (root_role if pid == root_pid and root_role else "engine" if "splitspec.engine_process" in cmdline else
                "target worker ranks" if "splitspec.worker" in cmdline else comm)
        yield pid, role, stat, tids


def cpu_seconds(root_pid: int, root_role: str | None = None, prune: str | None = None) -> dict[str, float]:
    """User + system CPU seconds so far of the processes of :func:`process_tree`, summed by role."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for _, role, stat, _ in process_tree(root_pid, root_role, prune):
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) ": field 3 (state) onwards
        out[role] = out.get(role, 0.0) + (int(fields[11]) + int(fields[12])) / tick  # utime + stime (fields 14, 15)
    return out


def core_plan() -> dict[str, set[int]]:
    """CPUs for ``--pin``: one physical core for the engine's process, one for its target worker ranks, the other
    cores (their SMT siblings excluded) for everything else. Read from ``/sys/devices/system/cpu/*/topology``.

    Raises:
        SystemExit: fewer than 4 physical cores are allowed to this process.
    """
    allowed = sorted(os.sched_getaffinity(0))
    cores: dict[str, set[int]] = {}
    for cpu in allowed:
        path = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list")
        key = path.read_text().strip() if path.exists() else str(cpu)
        cores.setdefault(key, set()).add(cpu)
    physical = list(cores.values())
    if len(physical) < 4:
        sys.exit(f"--pin needs at least 4 physical cores (this process may use {len(physical)}: CPUs {allowed})")
    engine, workers = physical[1], physical[2]  # not the first core, where the system's interrupts tend to land
    return {"engine": {min(engine)}, "target worker ranks": {min(workers)},
            "rest": set(allowed) - engine - workers}


def pin(root_pid: int, plan: dict[str, set[int]], root_cpus: set[int] | None = None, prune: str | None = None) -> None:
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


@contextlib.contextmanager
def engine_alone(a: argparse.Namespace, prompts: list[Prompt]) -> Iterator[Callable[[], tuple[list[dict], dict]]]:
    """Load the engine in this process and warm it up (a request of :data:`WARMUP_TOKENS` per prompt); yield a
    function that runs one measured pass: ``a.repeats`` times the prompts, one request at a time, greedy,
    ``a.max_tokens``. The engine is closed (its GPUs freed) on exit.

    A pass returns one dict per request: ``tokens``, ``wall_ms`` (submit → finished, this process), ``ttft_ms`` and
    ``e2e_ms`` (the engine's own), ``draft_verify_ms`` (its cycles' draft and verify phases, summed),
    ``acceptance_length``, ``finish_reason``, ``output_sha``; and ``{"cpu_s": ..., "wall_s": ...}``: CPU seconds of
    this process (role "engine") and its worker ranks during the pass (:func:`cpu_spent`), and the wall seconds.
    """
    ids = [int(x) for x in a.device_ids.split(",")] if a.device_ids else None
    eng = SpeculativeEngine.load(Path(a.engines), target_device_ids=ids, draft_tp=a.draft_tp, num_draft_tokens=a.k,
                                 draft_device_id=int(a.draft_device_id) if a.draft_device_id else None,
                                 max_batch_size=a.max_batch_size, kv_tokens=a.kv_tokens)
    try:
        reqs = [Request(encode_prompt(eng.tokenizer, p.text, p.chat), a.max_tokens, num_draft_tokens=a.k) for p in prompts]
        for req in reqs:  # warm-up: every prompt's prefill shape, a few decode cycles
            run_closed_loop(eng, [Request(req.prompt_ids, WARMUP_TOKENS, num_draft_tokens=a.k)], 1)

        def run_pass() -> tuple[list[dict], dict]:
            out = []
            cpu0, t0 = cpu_seconds(os.getpid(), "engine", prune="tritonserver"), time.perf_counter()
            for p, req in zip(prompts * a.repeats, reqs * a.repeats):
                [r], wall = run_closed_loop(eng, [req], 1)
                out.append({"prompt_id": p.id, "tokens": len(r.token_ids), "wall_ms": wall * 1e3, "ttft_ms": r.stats.ttft_ms,
                            "e2e_ms": r.stats.e2e_ms, "draft_verify_ms": r.stats.draft_ms + r.stats.verify_ms,
                            "acceptance_length": r.stats.acceptance_length,
                            "finish_reason": r.finish_reason, "output_sha": _sha(r.token_ids)})
            return out, {"cpu_s": cpu_spent(cpu0, cpu_seconds(os.getpid(), "engine", prune="tritonserver")), "wall_s": time.perf_counter() - t0}

        yield run_pass
    finally:
        eng.close()
        del eng
        gc.collect()
        if ids:
            import torch  # noqa: PLC0415

            torch.cuda.empty_cache()


@contextlib.contextmanager
def served_engine(a: argparse.Namespace, prompts: list[Prompt], tmp: Path, server: dict) -> Iterator[Callable[[], tuple[list[dict], dict]]]:
    """Serve the same engines with tritonserver (a repository rendered with the same settings) and warm it up as
    :func:`engine_alone`; yield a function that runs one measured pass, streamed over one open gRPC stream
    (``return_stats``), each request timed from sending to its final response. Once started, ``server`` gets
    ``startup_s`` (seconds to ready) and ``pid`` (tritonserver's); on exit the server stops and ``server`` gets
    ``log_tail``.

    A pass returns one dict per request: ``tokens``, ``wall_ms`` (client: sent → final response), ``ttft_ms``
    (client: sent → first tokens), ``engine_e2e_ms`` / ``engine_ttft_ms`` (the engine's own, from
    ``return_stats``), ``draft_verify_ms``, ``responses``, ``acceptance_length``, ``finish_reason``, ``output_sha``;
    and ``{"cpu_s": ..., "wall_s": ...}`` for tritonserver and its process tree, by role (:func:`cpu_spent`).
    """
    repo = render_repo(Path(a.engines), tmp / "repo", num_draft_tokens=a.k, target_device_ids=a.device_ids,
                       draft_device_id=a.draft_device_id, draft_tp=a.draft_tp, max_batch_size=a.max_batch_size,
                       kv_tokens=a.kv_tokens)
    with TritonServer(repo, exit_timeout_s=10) as srv:
        server["startup_s"], server["pid"] = srv.startup_s, srv.pid
        print(f"  tritonserver ready after {srv.startup_s:.1f} s (log {srv.log_path})", flush=True)
        worker = StreamWorker(srv.grpc_address)
        kw = {"draft_tp": a.draft_tp, "concurrency": 1}
        try:
            for p in prompts:  # warm-up, as for the engine alone
                worker.run(p, WARMUP_TOKENS, a.k, block=-1, **kw)

            def run_pass() -> tuple[list[dict], dict]:
                cpu0, t0 = cpu_seconds(srv.pid), time.perf_counter()
                recs = [worker.run(p, a.max_tokens, a.k, block=0, **kw) for p in prompts * a.repeats]
                cpu = {"cpu_s": cpu_spent(cpu0, cpu_seconds(srv.pid)), "wall_s": time.perf_counter() - t0}
                return [{"prompt_id": r.prompt_id, "tokens": r.num_output_tokens, "wall_ms": r.latency_ms,
                         "ttft_ms": r.ttft_ms, "engine_e2e_ms": r.engine_e2e_ms, "engine_ttft_ms": r.engine_ttft_ms,
                         "draft_verify_ms": r.draft_ms + r.verify_ms, "responses": len(r.token_times_ms),
                         "acceptance_length": r.acceptance_length, "finish_reason": r.finish_reason,
                         "output_sha": r.output_sha} for r in recs], cpu

            yield run_pass
        finally:
            worker.close()
            server["log_tail"] = srv.log_tail(20000)


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
    }


def print_table(s: dict, n: int) -> None:
    """Print the summary of :func:`summarize` for ``n`` requests."""
    rows = [("output tokens/s", f"{s['engine_tokens_per_s']:.1f}", f"{s['served_tokens_per_s']:.1f}"),
            ("ms per request (mean)", f"{s['engine_ms_per_request']:.1f}", f"{s['served_ms_per_request']:.1f}"),
            ("TTFT ms (mean)", f"{s['engine_ttft_ms']:.1f}", f"{s['served_ttft_ms']:.1f}"),
            ("output tokens", str(s["engine_tokens"]), str(s["served_tokens"]))]
    print(f"\n{'batch 1, ' + str(n) + ' requests each':28s} {'engine alone':>14s} {'served (gRPC)':>14s}")
    for name, e, v in rows:
        print(f"{name:28s} {e:>14s} {v:>14s}")
    print(f"ratio served / engine: {s['ratio_served_to_engine']:.3f}  (Triton's share of the time: "
          f"{1 - s['ratio_served_to_engine']:.1%}; negative: served ran faster); per round: {', '.join(f'{x:.3f}' for x in (r['ratio'] for r in s['rounds']))}"
          f" (median {s['ratio_median_of_rounds']:.3f})")
    print(f"per request: outside the engine {s['outside_engine_ms_per_request']:.1f} ms, engine slower inside "
          f"Triton than alone {s['engine_slower_inside_triton_ms_per_request']:+.1f} ms; "
          f"{s['served_responses_per_request']:.1f} responses/request, acceptance length {s['acceptance_length']:.2f}; "
          f"greedy outputs differing: {s['outputs_differing']}")
    print(f"inside the engine, per request: draft + verify {s['engine_draft_verify_ms_per_request']:.1f} ms alone, "
          f"{s['served_draft_verify_ms_per_request']:.1f} ms served; the rest of its time {s['engine_rest_ms_per_request']:.1f} "
          f"ms alone, {s['served_rest_ms_per_request']:.1f} ms served")
    fmt = lambda d: ", ".join(f"{k} {v:.2f}" for k, v in d.items())  # noqa: E731
    print(f"CPU cores busy while measuring: alone (this process and its workers): {fmt(s['cores_busy_engine_alone'])}; "
          f"served (tritonserver and its process tree): {fmt(s['cores_busy_served'])}")
    print(f"CPU ms per output token: alone: {fmt(s['cpu_ms_per_output_token_engine_alone'])}; "
          f"served: {fmt(s['cpu_ms_per_output_token_served'])}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engines", default="engines/demo", help="built engines (target/ + drafter/, tokenizer in target/)")
    p.add_argument("-k", type=int, default=4, help="draft tokens per cycle (default 4)")
    p.add_argument("--max-tokens", type=int, default=128, help="output tokens per request at most (default 128)")
    p.add_argument("--prompts", default=None, help="JSON-lines prompts (default eval/prompts.jsonl)")
    p.add_argument("--device-ids", default="", help="GPU ids of the target's ranks, e.g. 0 or 0,1 (default: CPU)")
    p.add_argument("--draft-device-id", default="", help="GPU of a TP1 drafter (default: target rank 0's)")
    p.add_argument("--draft-tp", type=int, default=1, help="drafter TP size: 1 or the target's")
    p.add_argument("--repeats", type=int, default=1, help="times the prompts are run in each pass (default 1)")
    p.add_argument("--rounds", type=int, default=3, help="rounds of one pass alone and one served, the order alternating (default 3)")
    p.add_argument("--pin", action="store_true", help="pin the engine's process and its worker ranks to a physical core "
                   "each, everything else (tritonserver, its stubs, the client) to the other cores; both sides alike (needs ≥ 4 "
                   "physical cores)")
    p.add_argument("--max-batch-size", type=int, default=None, help="engine batch slots (default the engine's)")
    p.add_argument("--kv-tokens", type=int, default=None, help="KV budget in tokens (default the engine's)")
    p.add_argument("--out", default=None, help="results folder (default bench/results/triton-share-<time>)")
    a = p.parse_args(argv)
    if a.rounds < 1 or a.repeats < 1:
        p.error(f"--rounds and --repeats must be at least 1 (got {a.rounds}, {a.repeats})")
    plan = core_plan() if a.pin else None  # before anything is loaded or written
    engines = Path(a.engines).resolve()
    a.engines = str(engines)
    prompts = load_prompts(Path(a.prompts) if a.prompts else None, engines / "target")
    out = Path(a.out or f"bench/results/triton-share-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    print(f"{len(prompts)} prompts x {a.repeats}, max_tokens {a.max_tokens}, k={a.k}, draft_tp={a.draft_tp}, "
          f"devices {a.device_ids or 'cpu'}, engines {engines}", flush=True)
    t0 = time.monotonic()
    rows: dict[str, list[dict]] = {"engine_alone": [], "served": []}
    phase = {name: {"cpu_s": {}, "wall_s": 0.0} for name in rows}
    rounds, server = [], {}
    if plan:
        print(f"--pin: engine process on CPU {sorted(plan['engine'])}, its target worker ranks on "
              f"{sorted(plan['target worker ranks'])}, everything else on {sorted(plan['rest'])}", flush=True)
    with tempfile.TemporaryDirectory(prefix="triton_share.") as tmp, contextlib.ExitStack() as stack:
        print("engine alone: loading, warm-up ...", flush=True)
        passes = {"engine_alone": stack.enter_context(engine_alone(a, prompts))}
        print("served: starting tritonserver, warm-up ...", flush=True)
        passes["served"] = stack.enter_context(served_engine(a, prompts, Path(tmp), server))
        if plan:  # the served engine's process and worker rank to their cores, tritonserver and its stubs elsewhere
            pin(server["pid"], plan)
        for r in range(a.rounds):
            order = ["engine_alone", "served"][::-1 if r % 2 else 1]  # alternate who goes first: drift cancels
            tps = {}
            for name in order:
                if plan:  # this process: the engine alone's process on its core, or the client's elsewhere
                    pin(os.getpid(), plan, plan["engine"] if name == "engine_alone" else plan["rest"], prune="tritonserver")
                got, cpu = passes[name]()
                for row in got:
                    row["round"] = r
                rows[name] += got
                phase[name]["wall_s"] += cpu["wall_s"]
                for k, v in cpu["cpu_s"].items():
                    phase[name]["cpu_s"][k] = phase[name]["cpu_s"].get(k, 0.0) + v
                tps[name] = tokens_per_s(got)
            rounds.append({"round": r, "order": order, "engine_tokens_per_s": tps["engine_alone"],
                           "served_tokens_per_s": tps["served"], "ratio": tps["served"] / tps["engine_alone"]})
            print(f"round {r + 1}/{a.rounds}: engine alone {tps['engine_alone']:.1f} tok/s, served {tps['served']:.1f} "
                  f"tok/s, ratio {rounds[-1]['ratio']:.3f}", flush=True)
    engine, served = rows["engine_alone"], rows["served"]
    s = summarize(engine, served)
    ratios = [x["ratio"] for x in rounds]
    s |= {"rounds": rounds, "ratio_median_of_rounds": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios)}
    for name in rows:
        tokens = sum(r["tokens"] for r in rows[name])
        s[f"cores_busy_{name}"] = {k: round(v / phase[name]["wall_s"], 3) for k, v in phase[name]["cpu_s"].items()}
        s[f"cpu_ms_per_output_token_{name}"] = {k: round(1e3 * v / tokens, 3) for k, v in phase[name]["cpu_s"].items()}
    print_table(s, len(engine))
    result = {"meta": {**machine_info(), "engines": engine_info(engines), "settings": vars(a),
                       "wall_s": round(time.monotonic() - t0, 1), "startup_s": server.get("startup_s"),
                       "pinned": {k: sorted(v) for k, v in plan.items()} if plan else None},
              "summary": s, "engine": engine, "served": served}
    (out / "results.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "tritonserver.log").write_text(server.get("log_tail", ""))
    print(f"results: {out / 'results.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
