#!/usr/bin/env python3
"""Triton's share at batch 1: output tokens/s through the served ensemble against the engine alone.

1. Engine alone: ``SpeculativeEngine.load`` in this process; after a short warm-up request per
   prompt, each prompt in turn (one request at a time), greedy, ``max_tokens``, k draft tokens per
   cycle. Then the engine is closed (its GPUs freed).
2. Served: a repository rendered for the same engines and settings (k, devices, draft_tp, batch and
   KV limits), tritonserver started; after the same warm-up, the same prompts one at a time, streamed
   over one open gRPC stream (``return_stats``), timed from sending to the final response.

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
import gc
import hashlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

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


def cpu_seconds(root_pid: int, root_role: str | None = None) -> dict[str, float]:
    """User + system CPU seconds so far of the process tree under ``root_pid`` (Linux ``/proc``), summed by role:
    "engine" (the engine process, or ``root_role`` for the root itself), "target worker ranks", else the command
    name (tritonserver, the backend stubs, ...). Processes and threads that exit while being read are skipped."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    stack = [root_pid]
    while stack:
        pid = stack.pop()
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            tasks = list(Path(f"/proc/{pid}/task").iterdir())
        except (OSError, ValueError):  # the process is gone
            continue
        for task in tasks:  # a thread that exits meanwhile must not hide the process or its other children
            try:
                stack += [int(c) for c in (task / "children").read_text().split()]
            except (OSError, ValueError):
                pass
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) ": field 3 (state) onwards
        role = (root_role if pid == root_pid and root_role else "engine" if "splitspec.engine_process" in cmdline else
                "target worker ranks" if "splitspec.worker" in cmdline else stat[stat.index("(") + 1:stat.rindex(")")])
        out[role] = out.get(role, 0.0) + (int(fields[11]) + int(fields[12])) / tick  # utime + stime (fields 14, 15)
    return out


def cpu_spent(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """CPU seconds per role between two :func:`cpu_seconds` readings (a role in only one reading: 0 for the other)."""
    return {k: round(after.get(k, 0.0) - before.get(k, 0.0), 3) for k in sorted(before.keys() | after.keys())}


def engine_phase(a: argparse.Namespace, prompts: list[Prompt]) -> tuple[list[dict], dict]:
    """Run the prompts through the engine in this process, one request at a time: a warm-up request of
    :data:`WARMUP_TOKENS` per prompt, then ``a.repeats`` measured passes of ``a.max_tokens``.

    Returns:
        one dict per request: ``tokens``, ``wall_ms`` (submit → finished, this process), ``ttft_ms`` and
        ``e2e_ms`` (the engine's own), ``draft_verify_ms`` (its cycles' draft and verify phases, summed),
        ``acceptance_length``, ``finish_reason``, ``output_sha``; and ``{"cpu_s": ..., "wall_s": ...}``: CPU seconds
        of this process (role "engine") and its worker ranks while measuring (:func:`cpu_spent`), and the wall seconds.
    """
    ids = [int(x) for x in a.device_ids.split(",")] if a.device_ids else None
    eng = SpeculativeEngine.load(Path(a.engines), target_device_ids=ids, draft_tp=a.draft_tp, num_draft_tokens=a.k,
                                 draft_device_id=int(a.draft_device_id) if a.draft_device_id else None,
                                 max_batch_size=a.max_batch_size, kv_tokens=a.kv_tokens)
    try:
        reqs = [Request(encode_prompt(eng.tokenizer, p.text, p.chat), a.max_tokens, num_draft_tokens=a.k) for p in prompts]
        for req in reqs:  # warm-up: every prompt's prefill shape, a few decode cycles
            run_closed_loop(eng, [Request(req.prompt_ids, WARMUP_TOKENS, num_draft_tokens=a.k)], 1)
        out = []
        cpu0, t0 = cpu_seconds(os.getpid(), "engine"), time.perf_counter()
        for p, req in zip(prompts * a.repeats, reqs * a.repeats):
            [r], wall = run_closed_loop(eng, [req], 1)
            out.append({"prompt_id": p.id, "tokens": len(r.token_ids), "wall_ms": wall * 1e3, "ttft_ms": r.stats.ttft_ms,
                        "e2e_ms": r.stats.e2e_ms, "draft_verify_ms": r.stats.draft_ms + r.stats.verify_ms,
                        "acceptance_length": r.stats.acceptance_length,
                        "finish_reason": r.finish_reason, "output_sha": _sha(r.token_ids)})
        return out, {"cpu_s": cpu_spent(cpu0, cpu_seconds(os.getpid(), "engine")), "wall_s": time.perf_counter() - t0}
    finally:
        eng.close()
        del eng
        gc.collect()
        if ids:
            import torch  # noqa: PLC0415

            torch.cuda.empty_cache()


def served_phase(a: argparse.Namespace, prompts: list[Prompt], tmp: Path) -> tuple[list[dict], dict]:
    """Serve the same engines with tritonserver and stream the prompts over gRPC, one request at a time
    (warm-up and passes as in :func:`engine_phase`).

    Returns:
        (one dict per request: ``tokens``, ``wall_ms`` (client: sent → final response), ``ttft_ms``
        (client: sent → first tokens), ``engine_e2e_ms`` / ``engine_ttft_ms`` (the engine's own, from
        ``return_stats``), ``draft_verify_ms``, ``responses``, ``acceptance_length``, ``finish_reason``, ``output_sha``;
        server facts: ``startup_s`` (seconds to ready), ``cpu_s`` (CPU seconds of tritonserver and its process tree
        while measuring, by role: :func:`cpu_spent`), ``wall_s``, ``log_tail``).
    """
    repo = render_repo(Path(a.engines), tmp / "repo", num_draft_tokens=a.k, target_device_ids=a.device_ids,
                       draft_device_id=a.draft_device_id, draft_tp=a.draft_tp, max_batch_size=a.max_batch_size,
                       kv_tokens=a.kv_tokens)
    with TritonServer(repo, exit_timeout_s=10) as srv:
        print(f"  tritonserver ready after {srv.startup_s:.1f} s (log {srv.log_path})", flush=True)
        worker = StreamWorker(srv.grpc_address)
        try:
            kw = {"draft_tp": a.draft_tp, "concurrency": 1}
            for p in prompts:  # warm-up, as in engine_phase
                worker.run(p, WARMUP_TOKENS, a.k, block=-1, **kw)
            cpu0, t0 = cpu_seconds(srv.pid), time.perf_counter()
            recs = [worker.run(p, a.max_tokens, a.k, block=0, **kw) for p in prompts * a.repeats]
            cpu = {"cpu_s": cpu_spent(cpu0, cpu_seconds(srv.pid)), "wall_s": time.perf_counter() - t0}
        finally:
            worker.close()
        log = srv.log_tail(20000)
    out = [{"prompt_id": r.prompt_id, "tokens": r.num_output_tokens, "wall_ms": r.latency_ms, "ttft_ms": r.ttft_ms,
            "engine_e2e_ms": r.engine_e2e_ms, "engine_ttft_ms": r.engine_ttft_ms, "draft_verify_ms": r.draft_ms + r.verify_ms,
            "responses": len(r.token_times_ms),
            "acceptance_length": r.acceptance_length, "finish_reason": r.finish_reason, "output_sha": r.output_sha}
           for r in recs]
    return out, {"startup_s": srv.startup_s, **cpu, "log_tail": log}


def summarize(engine: list[dict], served: list[dict]) -> dict:
    """Aggregate figures of both phases (tokens/s; ms per request, means over requests)."""
    def tps(rows):
        return sum(r["tokens"] for r in rows) / (sum(r["wall_ms"] for r in rows) / 1e3)

    mean = statistics.fmean
    e_tps, s_tps = tps(engine), tps(served)
    return {
        "engine_tokens_per_s": e_tps, "served_tokens_per_s": s_tps, "ratio_served_to_engine": s_tps / e_tps,
        "engine_tokens": sum(r["tokens"] for r in engine), "served_tokens": sum(r["tokens"] for r in served),
        "engine_ms_per_request": mean(r["wall_ms"] for r in engine),
        "served_ms_per_request": mean(r["wall_ms"] for r in served),
        "served_engine_e2e_ms_per_request": mean(r["engine_e2e_ms"] for r in served),
        "outside_engine_ms_per_request": mean(r["wall_ms"] - r["engine_e2e_ms"] for r in served),
        "engine_slower_inside_triton_ms_per_request": mean(s["engine_e2e_ms"] - e["wall_ms"] for s, e in zip(served, engine)),
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
    print(f"\n{'batch 1, ' + str(n) + ' requests':28s} {'engine alone':>14s} {'served (gRPC)':>14s}")
    for name, e, v in rows:
        print(f"{name:28s} {e:>14s} {v:>14s}")
    print(f"ratio served / engine: {s['ratio_served_to_engine']:.3f}  (Triton's share of the time: "
          f"{1 - s['ratio_served_to_engine']:.1%})")
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
    p.add_argument("-k", type=int, default=4, help="draft tokens per cycle")
    p.add_argument("--max-tokens", type=int, default=128, help="output tokens per request at most")
    p.add_argument("--prompts", default=None, help="JSON-lines prompts (default eval/prompts.jsonl)")
    p.add_argument("--device-ids", default="", help="GPU ids of the target's ranks, e.g. 0 or 0,1 (default: CPU)")
    p.add_argument("--draft-device-id", default="", help="GPU of a TP1 drafter (default: target rank 0's)")
    p.add_argument("--draft-tp", type=int, default=1, help="drafter TP size: 1 or the target's")
    p.add_argument("--repeats", type=int, default=1, help="measured passes over the prompts (each phase)")
    p.add_argument("--max-batch-size", type=int, default=None, help="engine batch slots (default the engine's)")
    p.add_argument("--kv-tokens", type=int, default=None, help="KV budget in tokens (default the engine's)")
    p.add_argument("--out", default=None, help="results folder (default bench/results/triton-share-<time>)")
    a = p.parse_args(argv)
    engines = Path(a.engines).resolve()
    a.engines = str(engines)
    prompts = load_prompts(Path(a.prompts) if a.prompts else None, engines / "target")
    out = Path(a.out or f"bench/results/triton-share-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    print(f"{len(prompts)} prompts x {a.repeats}, max_tokens {a.max_tokens}, k={a.k}, draft_tp={a.draft_tp}, "
          f"devices {a.device_ids or 'cpu'}, engines {engines}", flush=True)
    t0 = time.monotonic()
    print("engine alone ...", flush=True)
    engine, alone = engine_phase(a, prompts)
    print("served ...", flush=True)
    with tempfile.TemporaryDirectory(prefix="triton_share.") as tmp:
        served, server = served_phase(a, prompts, Path(tmp))
    s = summarize(engine, served)
    for name, phase, rows in (("engine_alone", alone, engine), ("served", server, served)):
        tokens = sum(r["tokens"] for r in rows)
        s[f"cores_busy_{name}"] = {k: round(v / phase["wall_s"], 3) for k, v in phase["cpu_s"].items()}
        s[f"cpu_ms_per_output_token_{name}"] = {k: round(1e3 * v / tokens, 3) for k, v in phase["cpu_s"].items()}
    print_table(s, len(engine))
    result = {"meta": {**machine_info(), "engines": engine_info(engines), "settings": vars(a),
                       "wall_s": round(time.monotonic() - t0, 1), "startup_s": server["startup_s"]},
              "summary": s, "engine": engine, "served": served}
    (out / "results.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "tritonserver.log").write_text(server["log_tail"])
    print(f"results: {out / 'results.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
