"""Side-by-side serving benchmark (``make bench``): no speculation against EAGLE-3 with the drafter
on its own (TP1, split placement) and EAGLE-3 with the drafter sharded over the target's group
(draft_tp = N, the layout every major engine uses), each for several draft lengths k, through the
served ensemble.

One server runs per draft placement (the placement is a deployment setting); k is a request input
(``num_draft_tokens``), so every k is measured on the same server. No speculation is k = 0 (the
drafter is then not run), measured on every server beside its placement's k: the first server's is
the headline baseline, and each placement's ratios are to the k = 0 requests of its own server.
Requests are greedy, stream over gRPC and ask for ``return_stats`` and ``return_token_ids``; the
client timestamps every response.

Measurement is interleaved to be fair on a machine whose load drifts: the requests of one
concurrency level are cut into blocks of ``concurrency`` requests (all sent at once, each worker
with its own gRPC stream), and every block is run once per k, in an order rotated from block to
block. Per configuration (placement, k, concurrency):

* tokens/s per user: a request's output tokens / its latency at the client (sent → final response,
  so it includes time to first token), averaged over requests;
* aggregate tokens/s: output tokens of all requests / summed wall time of their blocks;
* acceptance length: tokens emitted per target verify forward, Σ(n_output − 1) / Σ cycles (the first
  token comes from prefill); cycles of a request = (n_output − 1) / its acceptance length;
* per-position acceptance: cycles whose draft token i was accepted / cycles;
* draft ms and verify ms per cycle: the request's summed draft / verify time (``return_stats``) /
  its cycles, averaged over all request-cycles;
* TTFT (client, first response carrying tokens), request latency, time per output token after the
  first ((t_last − t_first) / (n − 1)), percentiles over requests;
* ratios to no speculation at the same concurrency on the same server;
* greedy outputs that differ from no speculation's for the same prompt (speculation is lossless:
  expect 0).

The server's Prometheus counters are read before and after each placement (cycles, draft / verify
histogram sums) as a cross-check. Results go to ``bench/results/<timestamp>/``: ``results.json``
(machine, versions, engine configuration, git commit, every row and every request),
``summary.md``, and the plots ``tokens_per_s.png``, ``acceptance_by_position.png`` and
``latency_cdf.png``.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import shutil
import statistics
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Iterable, Sequence

from splitspec.errors import ConfigError
from splitspec.files import make_dir, write_atomic
from splitspec.measure.machine import engine_info, machine_info
from splitspec.measure.placement_report import placement_label, plot_results, summary_markdown
from splitspec.measure.prompts import Prompt, read_prompts
from splitspec.measure.server_stats import scrape_metrics, triton_version
from splitspec.measure.stream_client import PlacementRun, StreamWorker
from splitspec.serving.tritonserver import TritonServer

DEFAULT_KS = (1, 2, 3, 4, 5)
DEFAULT_CONCURRENCIES = (1, 8)
DEFAULT_MAX_TOKENS = 48


# --------------------------------------------------------------------------------------------
# Measuring one placement
# --------------------------------------------------------------------------------------------


def request_blocks(prompts: Sequence[Prompt], n_requests: int, concurrency: int) -> list[list[Prompt]]:
    """``n_requests`` prompts (cycled) cut into blocks of ``concurrency``, the last filled up by cycling."""
    n = -(-n_requests // concurrency) * concurrency
    seq = [prompts[i % len(prompts)] for i in range(n)]
    return [seq[i:i + concurrency] for i in range(0, n, concurrency)]


def measure_placement(srv: TritonServer, draft_tp: int, ks: Sequence[int], prompts: Sequence[Prompt],
                      concurrencies: Sequence[int], max_tokens: int, requests_per_level: int | None,
                      timeout_s: float = 300.0, log=print) -> PlacementRun:
    """Run every k at every concurrency on a running server (interleaved blocks, see the module doc).

    Args:
        requests_per_level: requests per (k, concurrency); default the number of prompts, rounded up to
            a multiple of the concurrency.
    """
    run = PlacementRun(draft_tp, list(ks))
    top = max(concurrencies)
    workers = [StreamWorker(srv.grpc_address, timeout_s) for _ in range(top)]
    before = scrape_metrics(srv.metrics_url)
    try:
        with cf.ThreadPoolExecutor(max_workers=top) as pool:
            log(f"  warm-up: one short request per k ({', '.join(map(str, ks))})")
            for k in ks:
                workers[0].run(prompts[0], min(8, max_tokens), k, draft_tp=draft_tp, concurrency=1, block=-1)
            for c in concurrencies:
                blocks = request_blocks(prompts, requests_per_level or len(prompts), c)
                t_level = time.monotonic()
                for b, block in enumerate(blocks):
                    order = [ks[(b + i) % len(ks)] for i in range(len(ks))]
                    parts = []
                    for k in order:
                        t0 = time.perf_counter()
                        futs = [pool.submit(workers[i].run, p, max_tokens, k, draft_tp=draft_tp, concurrency=c, block=b)
                                for i, p in enumerate(block)]
                        recs = [f.result() for f in futs]
                        wall = time.perf_counter() - t0
                        run.records += recs
                        run.wall_s[(k, c)] = run.wall_s.get((k, c), 0.0) + wall
                        toks = sum(r.num_output_tokens for r in recs)
                        parts.append(f"k{k} {toks / wall:5.1f}")
                    done = time.monotonic() - t_level
                    eta = done / (b + 1) * (len(blocks) - b - 1)
                    log(f"  draft_tp={draft_tp} concurrency {c} block {b + 1}/{len(blocks)}: "
                        f"{', '.join(parts)} tok/s  (eta {eta:.0f} s)")
    finally:
        for w in workers:
            w.close()
    time.sleep(0.5)  # the engine exports its metrics every 0.2 s
    after = scrape_metrics(srv.metrics_url)
    run.metrics_delta = {k: round(after[k] - before.get(k, 0.0), 3) for k in after}
    return run


# --------------------------------------------------------------------------------------------
# Aggregation
# --------------------------------------------------------------------------------------------


def _pct(values: Sequence[float], q: float) -> float | None:
    vals = sorted(v for v in values if v is not None)
    if not vals:
        return None
    i = (len(vals) - 1) * q
    lo, hi = int(i), min(int(i) + 1, len(vals) - 1)
    return vals[lo] + (vals[hi] - vals[lo]) * (i - lo)


def aggregate(runs: Sequence[PlacementRun]) -> list[dict]:
    """One row per (placement, k, concurrency) with the figures of the module doc and ratios to k = 0.

    Each placement's ratios are to the k = 0 requests measured on its own server, interleaved with it
    (the same load conditions); a server without k = 0 requests is compared to the first server's.
    """
    rows = []
    first_tp = runs[0].draft_tp if runs else None
    reference: dict[tuple[int, str], str] = {}
    for run in runs:
        for r in run.records:
            if r.k == 0:
                reference.setdefault((r.concurrency, r.prompt_id), r.output_sha)
    for run in runs:
        for (k, c), wall in sorted(run.wall_s.items(), key=lambda x: (x[0][1], x[0][0])):
            recs = [r for r in run.records if r.k == k and r.concurrency == c]
            if not recs:
                continue
            cycles = sum(r.cycles for r in recs)
            emitted = sum(max(r.num_output_tokens - 1, 0) for r in recs)
            toks = sum(r.num_output_tokens for r in recs)
            acc_pos = [sum(r.accepted_per_position[i] for r in recs if i < len(r.accepted_per_position)) / max(cycles, 1)
                       for i in range(k)]
            tps_user = [r.tokens_per_s for r in recs]
            mism = sum(1 for r in recs if (c, r.prompt_id) in reference and reference[(c, r.prompt_id)] != r.output_sha)
            rows.append({
                "configuration": placement_label(run.draft_tp, k, first_tp), "draft_tp": run.draft_tp, "k": k,
                "concurrency": c,
                "requests": len(recs), "output_tokens": toks, "wall_s": round(wall, 3),
                "tokens_per_s": toks / wall if wall else 0.0,
                "tokens_per_s_per_user": statistics.fmean(tps_user),
                "tokens_per_s_per_user_p50": _pct(tps_user, 0.5),
                "acceptance_length": emitted / cycles if cycles else 1.0,
                "acceptance_by_position": acc_pos,
                "draft_ms_per_cycle": sum(r.draft_ms for r in recs) / cycles if cycles else 0.0,
                "verify_ms_per_cycle": sum(r.verify_ms for r in recs) / cycles if cycles else 0.0,
                "ttft_ms_p50": _pct([r.ttft_ms for r in recs], 0.5),
                "engine_ttft_ms_p50": _pct([r.engine_ttft_ms for r in recs], 0.5),
                "latency_ms_p50": _pct([r.latency_ms for r in recs], 0.5),
                "latency_ms_p90": _pct([r.latency_ms for r in recs], 0.9),
                "tpot_ms_p50": _pct([r.tpot_ms for r in recs], 0.5),
                "finish_reasons": {f: sum(1 for r in recs if r.finish_reason == f) for f in {r.finish_reason for r in recs}},
                "outputs_differing_from_no_speculation": mism,
            })
    base = {(r["draft_tp"], r["concurrency"]): r for r in rows if r["k"] == 0}
    for r in rows:
        b = base.get((r["draft_tp"], r["concurrency"])) or base.get((first_tp, r["concurrency"]))
        r["ratio_per_user"] = r["tokens_per_s_per_user"] / b["tokens_per_s_per_user"] if b else None
        r["ratio_aggregate"] = r["tokens_per_s"] / b["tokens_per_s"] if b else None
    return rows


# --------------------------------------------------------------------------------------------
# make bench
# --------------------------------------------------------------------------------------------


def run_bench(engines: Path, *, out_dir: Path | None = None, ks: Iterable[int] = DEFAULT_KS,
              concurrencies: Iterable[int] = DEFAULT_CONCURRENCIES, draft_tps: Iterable[int] | None = None,
              max_tokens: int = DEFAULT_MAX_TOKENS, prompts_path: Path | None = None,
              requests_per_level: int | None = None, target_device_ids: str = "", draft_device_id: str = "",
              synthetic_acceptance: list[float] | None = None, timeout_s: float = 300.0) -> Path:
    """Benchmark no speculation, the TP1 drafter and the drafter sharded over the target's group.

    Args:
        engines: built engines (``target/`` + ``drafter/``).
        out_dir: results folder (default ``bench/results/<timestamp>`` under the current directory).
        ks: draft lengths measured with speculation (each 1..the engines' max_draft_len).
        concurrencies: requests in flight, in the order given (duplicates dropped); the first is the headline.
        draft_tps: draft placements (default 1 and the target's TP size; 1 only when the target is TP1).
        max_tokens: output tokens per request.
        prompts_path: prompt file (:func:`~splitspec.measure.prompts.read_prompts`; None: the built-in prompts).
        requests_per_level: requests per (placement, k, concurrency) (default: one per prompt, rounded
            up to a multiple of the concurrency).
        target_device_ids, draft_device_id: GPU placement (empty: CPU), as for ``splitspec repo``.
        synthetic_acceptance: BENCHMARK ONLY — accept draft position i with this probability regardless
            of its value (outputs are then not the target's; the results are labelled).
        timeout_s: longest wait for one response.
    Returns:
        the results folder.
    Raises:
        ConfigError: a bad argument or missing engines.
        SplitspecError: a server failed to start or a request failed.
    """
    from splitspec.serving.repo import render_repo
    from splitspec.settings import ServeConfig, parse_id, parse_ids

    engines = Path(engines).resolve()
    info = engine_info(engines)
    tp = int((info["target"].get("mapping") or {}).get("tp_size") or 1)
    max_draft = int((info["drafter"].get("limits") or {}).get("max_draft_len") or 8)
    ks = sorted(set(int(k) for k in ks))
    if not ks or any(not 1 <= k <= max_draft for k in ks):
        raise ConfigError(f"k = {ks}: each must be in 1..{max_draft} (the engines' max_draft_len); k = 0 is always measured")
    concs = list(dict.fromkeys(int(c) for c in concurrencies))
    if not concs or min(concs) < 1:
        raise ConfigError(f"concurrency = {concs}: expected one or more levels ≥ 1")
    placements = sorted(set(int(x) for x in draft_tps)) if draft_tps is not None else sorted({1, tp})
    for d in placements:
        if d not in (1, tp):
            raise ConfigError(f"draft_tp = {d}: expected 1 or the target's TP size {tp}")
    if not 1 <= max_tokens <= 4096:
        raise ConfigError(f"max_tokens = {max_tokens}: expected 1..4096")
    prompts = read_prompts(prompts_path, engines / "target")
    out = Path(out_dir) if out_dir else Path("bench", "results", time.strftime("%Y%m%d-%H%M%S"))
    out = out.resolve()
    make_dir(out, "--out")
    meta = {"date": time.strftime("%Y-%m-%d %H:%M:%S %z"), **machine_info(), "engines": info, "max_tokens": max_tokens,
            "prompts": str(prompts_path or "built-in"), "num_prompts": len(prompts), "ks": ks,
            "concurrencies": concs, "draft_tps": placements, "synthetic_acceptance": synthetic_acceptance,
            "requests_per_level": requests_per_level, "client": "gRPC streaming (tritonclient), greedy"}
    if tp == 1:
        print("note: the target is TP1, so the sharded-drafter placement is the same as TP1; measuring TP1 only",
              flush=True)
    print(f"benchmark: placements draft_tp {placements}, k 0 + {ks}, concurrency {concs}, {len(prompts)} prompts, "
          f"max_tokens {max_tokens} → {out}", flush=True)

    runs: list[PlacementRun] = []
    t_start = time.monotonic()
    for n, d in enumerate(placements):
        run_ks = [0] + ks
        with tempfile.TemporaryDirectory(prefix=f"splitspec-bench-tp{d}-") as tmp:
            repo = render_repo(ServeConfig.from_env(
                engines_dir=engines, num_draft_tokens=max(ks), draft_tp=d,
                target_device_ids=parse_ids(target_device_ids, "target_device_ids"),
                draft_device_id=parse_id(draft_device_id, "draft_device_id") if d == 1 else None,
                max_batch_size=max(concs), kv_tokens=max(concs) * 512 + 1024,
                synthetic_acceptance=synthetic_acceptance), Path(tmp) / "repo")
            srv = TritonServer(repo, exit_timeout_s=10)
            print(f"[{n + 1}/{len(placements)}] draft_tp={d}: starting tritonserver ...", flush=True)
            srv.start()
            try:
                print(f"  ready after {srv.startup_s:.1f} s", flush=True)
                meta.setdefault("tritonserver", triton_version(srv.http_url))
                run = measure_placement(srv, d, run_ks, prompts, concs, max_tokens, requests_per_level, timeout_s,
                                        log=lambda s: print(s, flush=True))
                run.startup_s = srv.startup_s
            finally:
                srv.stop()
                if srv.log_path.exists():
                    shutil.copyfile(srv.log_path, out / f"tritonserver_draft_tp{d}.log")
            runs.append(run)
    meta["wall_s"] = round(time.monotonic() - t_start, 1)
    meta["load_average_end"] = machine_info()["load_average"]
    rows = aggregate(runs)
    result = {"meta": meta, "rows": rows,
              "placements": [{"draft_tp": r.draft_tp, "ks": r.ks, "startup_s": r.startup_s,
                              "prometheus_delta": r.metrics_delta} for r in runs],
              "requests": [asdict(x) | {"cycles": x.cycles} for r in runs for x in r.records]}
    write_atomic(out / "results.json", json.dumps(result, indent=1) + "\n")
    md = summary_markdown(meta, rows)
    write_atomic(out / "summary.md", md)
    files = plot_results(rows, runs, out)
    print("\n" + md, flush=True)
    print(f"results: {out / 'results.json'}, {out / 'summary.md'}, " + ", ".join(str(f.name) for f in files), flush=True)
    return out

