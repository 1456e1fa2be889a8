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
   configuration's cycle moved 5–15% from one load to the next on the GPU (docs/lab/2026-11-30-tuner-per-bucket/), as much as
   Triton's whole share, so one load of each compares two draws of that noise. The figures pool all loads; the
   95% interval resamples loads, then prompts within them; ``loads`` in the summary holds each load's own.

``--also`` adds steps between the two, to find where a difference comes from:

- ``engine_loop``: the same in-process engine driven by :class:`splitspec.runtime.loop.EngineLoop` (cycles on a
  background thread, as in the served engine's process);
- ``engine_process``: :class:`splitspec.serving.engine_process.EngineProcess` started from this process (the served
  engine's own process, its loop thread and its per-cycle messages, without Triton);
- ``engine_process_triton_env``: the same, started with the environment tritonserver gets
  (:func:`splitspec.serving.triton_install.server_env`: its library path first).

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
(:mod:`lab.triton_trace`: gRPC in, preprocessing, ``spec_decode``, the engine, the last postprocessing, gRPC
out), in its row (``path_ms``) and on average (``served_path_ms_per_request``).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from lab import NO_NVLINK_MULTICAST

for _k, _v in NO_NVLINK_MULTICAST.items():
    os.environ.setdefault(_k, _v)  # inherited by the engine's workers and by tritonserver

from splitspec.errors import CheckpointError, SplitspecError  # noqa: E402
from splitspec.files import read_json, write_atomic  # noqa: E402
from splitspec.measure.machine import engine_info, machine_info  # noqa: E402
from splitspec.measure.prompts import Prompt, read_prompts  # noqa: E402
from splitspec.serving.triton_install import server_env  # noqa: E402

from lab.pinning import core_plan, cpu_spent, pin  # noqa: E402
from lab.share_phases import Phase, engine_alone, engine_process, served_engine  # noqa: E402
from lab.share_stats import (PHASES, phase_summary, plot_excess, pool_runs, print_pooled, print_table,  # noqa: E402
                             ratio_ci95, summarize, tokens_per_s)
from lab.triton_trace import load_traces, request_path  # noqa: E402


def trace_paths(path: Path, served: list[dict]) -> None:
    """Give each served row its ``path_ms`` (:func:`lab.triton_trace.request_path`: its latency split by step of
    the ensemble, from the trace files ``path`` of the server that served it). Raises SplitspecError when a row's
    request has no trace or a step's is incomplete."""
    if not served:
        raise SplitspecError("no served requests to split")
    traces = load_traces(path)
    for r in served:
        if r["request_id"] not in traces:
            raise SplitspecError(f"{path}: no trace of request {r['request_id']!r}")
        r["path_ms"] = request_path(traces[r["request_id"]], r["sent_ns"], r["wall_ms"], r["engine_e2e_ms"])


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


def run_summary(a: argparse.Namespace, names: list[str], rows: dict[str, list[dict]], cpu_s: dict[str, dict[str, float]],
                servers: list[dict]) -> dict:
    """The run's summary: :func:`lab.share_stats.summarize` of all rows with the ratio's interval, each round's and
    (with ``a.loads`` > 1) each load's figures, CPU by role per phase, the ``--also`` phases' figures, with ``a.trace``
    the served requests' split by step (:func:`trace_paths`), and Triton's own statistics per served request."""
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
    return s


def build_parser() -> argparse.ArgumentParser:
    """The script's options."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engines", default="engines/demo", help="built engines (target/ + drafter/, tokenizer in target/)")
    p.add_argument("-k", type=int, default=4, help="draft tokens per cycle (default 4)")
    p.add_argument("--max-tokens", type=int, default=128, help="output tokens per request at most (default 128)")
    p.add_argument("--prompts", default="eval/prompts.jsonl", help="JSON-lines prompts (default eval/prompts.jsonl)")
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
                   "(timestamps; <out>/trace/) and split its time by step of the ensemble (lab.triton_trace)")
    p.add_argument("--out", default=None, help="results folder (default bench/results/triton-share-<time>)")
    only = p.add_mutually_exclusive_group()  # either mode ignores the measuring options
    only.add_argument("--replot", default=None, metavar="RESULTS_JSON", help="only draw the plot of an earlier run's "
                      "results.json (beside the file, the same name with .png) and exit")
    only.add_argument("--pool", nargs="+", default=None, metavar="RESULTS_JSON", help="only pool earlier runs' "
                      "results.json files of one configuration (each run's loads counted as loads of their own; a file "
                      "may be given once) and print the ratio, its 95%% interval and each load's")
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    a = p.parse_args(argv)

    def results(path: Path, option: str) -> dict:
        """The JSON object in ``path`` (:func:`splitspec.files.read_json`); exits naming the file when it is not one."""
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
        prompts = read_prompts(Path(a.prompts), engines / "target")
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
    s = run_summary(a, names, rows, cpu_s, servers)
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
