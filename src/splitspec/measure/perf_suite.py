"""``make perf``: serve the ensemble, sweep concurrency with perf_analyzer (gRPC streaming and HTTP
generate_stream) and genai-perf (:mod:`splitspec.measure.perf_tools`, :mod:`splitspec.measure.perf_levels`),
and report one row per protocol and level. Only the local server is contacted, and a server started here
is stopped afterwards.

Results of :func:`run_perf_suite` (``make perf``) go to ``perf_results/<timestamp>/``:

* ``perf_analyzer/<protocol>_c<N>.csv``: perf_analyzer's own ``-f`` export of each level,
  ``perf_analyzer_<protocol>.csv``: the levels of one protocol in one table (the same columns);
* ``genai_perf/c<N>/``: genai-perf's artifacts (``profile_export_genai_perf.{json,csv}``) against HTTP
  generate_stream, ``genai_perf/openai_c<N>/`` against the OpenAI-compatible front end (streamed chat completions;
  :class:`~splitspec.serving.openai_api.OpenAIServer`, started here on a free port);
* ``summary.json`` and ``summary.md``: one row per protocol and concurrency level.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import time
from dataclasses import asdict
from pathlib import Path
from typing import Iterable, Sequence

from splitspec.errors import ConfigError, SplitspecError
from splitspec.files import make_dir, write_atomic
from splitspec.measure.machine import machine_info, package_version
from splitspec.measure.perf_levels import LevelResult, run_genai_perf_level, run_perf_analyzer_level
from splitspec.measure.perf_tools import (PERF_MAX_TOKENS, PROTOCOLS, find_genai_perf, find_perf_analyzer, perf_command,
                                          run_bounded, tool_env)
from splitspec.measure.prompts import read_prompts, write_genai_perf_input, write_input_data
from splitspec.serving.openai_api import OpenAIServer
from splitspec.serving.repo import render_repo, repo_setting
from splitspec.serving.tritonserver import TritonServer
from splitspec.settings import ServeConfig

#: Concurrency levels of ``make perf``.
DEFAULT_CONCURRENCIES = (1, 2, 4, 8, 16, 32, 64)


def _timestamp() -> str:
    return time.strftime("%Y%m%d-%H%M%S")


def run_perf_suite(cfg: ServeConfig | None = None, *, repo: Path | None = None, server: TritonServer | None = None,
                   out_dir: Path | None = None, concurrencies: Iterable[int] = DEFAULT_CONCURRENCIES,
                   protocols: Iterable[str] = PROTOCOLS, max_tokens: int = PERF_MAX_TOKENS,
                   prompts_path: Path | None = None, seconds: float = 3.0, llm_metrics: bool = True,
                   llm_concurrencies: Iterable[int] | None = None, level_timeout_s: float = 300.0,
                   openai: bool = True) -> Path:
    """``make perf``: serve the ensemble, sweep concurrency with perf_analyzer (gRPC streaming and
    HTTP generate_stream) and genai-perf, write the results, stop the server.

    Exactly one of ``cfg`` (the deployment: a repository is rendered into ``out_dir/repo`` from it, with
    max_batch_size = the highest concurrency and KV space for every sequence), ``repo`` (an already
    rendered repository; its max_batch_size should reach the highest concurrency) or ``server`` (a running
    server, not stopped here) says what is measured.

    Args:
        out_dir: results folder (default ``perf_results/<timestamp>``).
        concurrencies: perf_analyzer levels (requests in flight; measured in ascending order).
        protocols: subset of ``grpc``, ``http``.
        max_tokens: output tokens per request.
        prompts_path: prompt file (:func:`~splitspec.measure.prompts.read_prompts`; None: the built-in prompts).
        seconds: minimum measurement time per perf_analyzer level.
        llm_metrics: also run genai-perf (skipped with a notice when it is not installed).
        openai: with ``llm_metrics``, also run genai-perf against the OpenAI-compatible front end.
        llm_concurrencies: genai-perf levels (default: ``concurrencies``).
        level_timeout_s: hard wall-clock limit of one level of one tool.
    Returns:
        the results folder (``summary.json``, ``summary.md``, the tools' files).
    Raises:
        ConfigError: a bad argument.
        SplitspecError: the server failed to start, or no level of any tool produced figures.
    """
    if sum(x is not None for x in (cfg, repo, server)) != 1:
        raise ConfigError("run_perf_suite: give exactly one of cfg, repo, server")
    levels = sorted(set(int(c) for c in concurrencies))
    llm_levels = sorted(set(int(c) for c in llm_concurrencies)) if llm_concurrencies is not None else levels
    if not levels or min(levels + llm_levels) < 1:
        raise ConfigError(f"concurrency {levels}, {llm_levels}: expected levels ≥ 1")
    protocols = tuple(protocols)
    for p in protocols:
        if p not in PROTOCOLS:
            raise ConfigError(f"protocol = {p!r}: expected one of {', '.join(PROTOCOLS)}")
    if not 1 <= max_tokens <= 4096:
        raise ConfigError(f"max_tokens = {max_tokens}: expected 1..4096")
    if not 1.0 <= float(seconds) <= 600.0:
        raise ConfigError(f"seconds = {seconds}: expected 1..600")
    out = Path(out_dir) if out_dir else Path("perf_results") / _timestamp()
    out = out.resolve()
    make_dir(out, "--out")
    genai = find_genai_perf() if llm_metrics else None
    if llm_metrics and genai is None:
        print("genai-perf is not installed (make perf-tools): LLM metrics skipped", flush=True)

    own = server is None
    if cfg is not None:
        top = max(levels + llm_levels)
        repo = render_repo(cfg.replace(max_batch_size=top, kv_tokens=top * 256 + 1024), out / "repo")
    srv = server or TritonServer(Path(repo), exit_timeout_s=10)
    repo_dir = srv.repo
    tokenizer_dir = Path(repo_setting(repo_dir, "preprocessing", "tokenizer_dir") or "")
    prompts = read_prompts(prompts_path, tokenizer_dir)
    batch = repo_setting(repo_dir, "spec_decode", "max_batch_size")
    if batch and int(batch) < max(levels):
        print(f"note: {repo_dir} serves at most {batch} sequences together; levels above queue in the server",
              flush=True)
    inputs = {p: write_input_data(out / f"perf_input_{p}.json", prompts, max_tokens, p) for p in protocols}
    genai_input = write_genai_perf_input(out / "genai_perf_input.jsonl", prompts, tokenizer_dir) if genai else None
    chat_input = (write_genai_perf_input(out / "genai_perf_chat_input.jsonl", prompts, tokenizer_dir, chat_endpoint=True)
                  if genai and openai else None)

    results: list[LevelResult] = []
    t_start = time.monotonic()
    if own:
        print(f"starting tritonserver on {repo_dir} ...", flush=True)
        srv.start()
        print(f"ready after {srv.startup_s:.1f} s (log {srv.log_path})", flush=True)
    stack = contextlib.ExitStack()
    try:
        llm_runs = [("http", f"127.0.0.1:{srv.http_port}", None, genai_input)] if genai else []
        if chat_input:
            api = stack.enter_context(OpenAIServer(repo_dir, srv.grpc_address, 0, host="127.0.0.1"))
            llm_runs.append(("openai", f"127.0.0.1:{api.port}", api.model.name, chat_input))
        total = len(protocols) * len(levels) + len(llm_levels) * len(llm_runs)
        done = 0
        for proto in protocols:
            for c in levels:
                done += 1
                print(f"[{done}/{total}] perf_analyzer {proto} concurrency {c} ...", end=" ", flush=True)
                r = run_perf_analyzer_level(proto, c, inputs[proto], out / "perf_analyzer", grpc_address=srv.grpc_address,
                                            http_address=f"127.0.0.1:{srv.http_port}", seconds=seconds,
                                            timeout_s=level_timeout_s)
                results.append(r)
                print(_level_line(r), flush=True)
                if r.error and "timed out" in r.error:
                    print(f"  higher {proto} levels skipped after a timeout", flush=True)
                    break
        for label, address, model, input_file in llm_runs:
            for c in llm_levels:
                done += 1
                print(f"[{done}/{total}] genai-perf {label} concurrency {c} ...", end=" ", flush=True)
                r = run_genai_perf_level(c, input_file, out / "genai_perf", http_address=address,
                                         tokenizer_dir=tokenizer_dir, max_tokens=max_tokens, timeout_s=level_timeout_s,
                                         binary=genai, openai_model=model)
                results.append(r)
                print(_level_line(r), flush=True)
                if r.error and "timed out" in r.error:
                    print(f"  higher genai-perf {label} levels skipped after a timeout", flush=True)
                    break
    finally:
        stack.close()  # the OpenAI front end, before the server it talks to
        if own:
            srv.stop()
            if srv.log_path.exists():
                shutil.copyfile(srv.log_path, out / "tritonserver.log")
    for proto in protocols:
        _merge_csvs([out / "perf_analyzer" / f"{proto}_c{c}.csv" for c in levels], out / f"perf_analyzer_{proto}.csv")
    meta = {"date": time.strftime("%Y-%m-%d %H:%M:%S %z"), "repo": str(repo_dir), "max_tokens": max_tokens,
            "prompts": str(prompts_path or "built-in"), "num_prompts": len(prompts),
            "num_draft_tokens_default": repo_setting(repo_dir, "spec_decode", "num_draft_tokens") or "tuning.json's per batch bucket",
            "draft_tp": repo_setting(repo_dir, "spec_decode", "draft_tp") or "tuning.json's per batch bucket", "max_batch_size": batch,
            "concurrencies": list(levels), "llm_concurrencies": list(llm_levels) if genai else [],
            "genai_perf": package_version("genai-perf") if genai else None, "wall_s": round(time.monotonic() - t_start, 1)}
    meta.update(machine_info())
    write_atomic(out / "summary.json", json.dumps({"meta": meta, "levels": [asdict(r) for r in results]}, indent=2) + "\n")
    write_atomic(out / "summary.md", perf_markdown(meta, results))
    print("\n" + perf_markdown(meta, results), flush=True)
    print(f"results: {out}", flush=True)
    if not any(r.error is None for r in results):
        raise SplitspecError(f"no level produced figures; see the logs in {out}")
    return out


def _level_line(r: LevelResult) -> str:
    if r.error:
        return f"FAILED ({r.wall_s:.0f} s): {r.error}"
    m = r.metrics
    if r.tool == "genai-perf":
        return (f"{m.get('output_tokens_per_s_avg', 0):.1f} tok/s, TTFT p50 {m.get('ttft_ms_p50', 0):.0f} ms, "
                f"ITL p50 {m.get('itl_ms_p50', 0):.1f} ms ({r.wall_s:.0f} s)")
    return (f"{m['requests_per_s']:.2f} req/s, latency p50 {m['latency_p50_ms']:.0f} ms, "
            f"p99 {m['latency_p99_ms']:.0f} ms ({r.wall_s:.0f} s)")


def _merge_csvs(parts: list[Path], dest: Path) -> Path | None:
    """Concatenate perf_analyzer CSVs of the same protocol (header once)."""
    header, rows = None, []
    for p in parts:
        if not p.is_file():
            continue
        lines = p.read_text(encoding="utf-8").splitlines()
        if not lines:
            continue
        header = header or lines[0]
        rows += [ln for ln in lines[1:] if ln.strip()]
    if header is None:
        return None
    write_atomic(dest, "\n".join([header, *rows]) + "\n")
    return dest


def _fmt(v, nd: int = 1) -> str:
    return "—" if v is None else f"{v:.{nd}f}"


def perf_markdown(meta: dict, results: Sequence[LevelResult]) -> str:
    """Markdown tables of a :func:`run_perf_suite` run: perf_analyzer per protocol and level, genai-perf per level."""
    lines = [f"## Load test — {meta.get('date', '')}", "",
             f"Machine: {meta.get('cpu', '?')} ({meta.get('cpu_count', '?')} CPUs)"
             + (f", GPUs: {meta['gpus']}" if meta.get("gpus") else "")
             + f"; max_tokens {meta.get('max_tokens')}; {meta.get('num_prompts')} prompts; "
               f"k = {meta.get('num_draft_tokens_default')}, draft_tp = {meta.get('draft_tp')}, "
               f"max_batch_size {meta.get('max_batch_size')}.", ""]
    pa = [r for r in results if r.tool == "perf_analyzer"]
    if pa:
        lines += ["### perf_analyzer (latency = request sent → final response, ms)", "",
                  "| protocol | concurrency | requests/s | output tokens/s (≤) | responses per request | p50 | p90 | p95 "
                  "| p99 | avg |", "|---|---|---|---|---|---|---|---|---|---|"]
        for r in pa:
            if r.error:
                lines.append(f"| {r.protocol} | {r.concurrency} | failed: {r.error[:80]} | | | | | | | |")
                continue
            m = r.metrics
            per_req = m["responses_per_s"] / m["requests_per_s"] if m.get("responses_per_s") and m["requests_per_s"] else None
            lines.append(f"| {r.protocol} | {r.concurrency} | {m['requests_per_s']:.2f} | "
                         f"{m['requests_per_s'] * meta.get('max_tokens', 0):.0f} | {_fmt(per_req)} | "
                         f"{_fmt(m['latency_p50_ms'], 0)} | "
                         f"{_fmt(m['latency_p90_ms'], 0)} | {_fmt(m['latency_p95_ms'], 0)} | "
                         f"{_fmt(m['latency_p99_ms'], 0)} | {_fmt(m['latency_avg_ms'], 0)} |")
        lines += ["", "Output tokens/s (≤) = requests/s × max_tokens: an upper bound, requests that stop early "
                      "emit fewer tokens. Responses per request (gRPC): streamed responses, one per engine cycle "
                      "(max_tokens / this ≈ tokens per cycle).", ""]
    gp = [r for r in results if r.tool == "genai-perf"]
    if gp:
        lines += ["### genai-perf (tokens counted by re-tokenising the text)", "",
                  "| endpoint | concurrency | output tokens/s | tokens/s per user | requests/s | TTFT p50 / p99 (ms) | "
                  "ITL p50 / p99 (ms) | latency p50 (ms) |", "|---|---|---|---|---|---|---|---|"]
        for r in gp:
            where = "OpenAI chat" if r.protocol == "openai" else "generate_stream"
            if r.error:
                lines.append(f"| {where} | {r.concurrency} | failed: {r.error[:80]} | | | | | |")
                continue
            m = r.metrics
            lines.append(f"| {where} | {r.concurrency} | {_fmt(m.get('output_tokens_per_s_avg'))} | "
                         f"{_fmt(m.get('output_tokens_per_s_per_user_avg'))} | {_fmt(m.get('requests_per_s_avg'), 2)} | "
                         f"{_fmt(m.get('ttft_ms_p50'), 0)} / {_fmt(m.get('ttft_ms_p99'), 0)} | "
                         f"{_fmt(m.get('itl_ms_p50'))} / {_fmt(m.get('itl_ms_p99'))} | {_fmt(m.get('latency_ms_p50'), 0)} |")
        lines.append("")
    return "\n".join(lines) + "\n"


def _parse_concurrency(value: str) -> tuple[str, int, int]:
    """Check ``N`` or ``start:end[:step]`` (1..64, at most 8 levels).

    Returns:
        the normalised range, the number of concurrency levels it names, the highest level.
    Raises:
        ConfigError: malformed or out of range (names ``concurrency``).
    """
    m = re.fullmatch(r"\s*(\d+)(?::(\d+)(?::(\d+))?)?\s*", str(value))
    if not m:
        raise ConfigError(f"concurrency = {value!r}: expected N or start:end[:step], e.g. 1 or 1:4:1")
    nums = [int(g) for g in m.groups() if g is not None]
    start, end, step = nums[0], nums[1] if len(nums) > 1 else nums[0], nums[2] if len(nums) > 2 else 1
    if not (1 <= start <= end <= 64) or step < 1:
        raise ConfigError(f"concurrency = {value!r}: need 1 <= start <= end <= 64 and step >= 1")
    levels = len(range(start, end + 1, step))
    if levels > 8:
        raise ConfigError(f"concurrency = {value!r}: {levels} levels; at most 8 per run")
    return ":".join(map(str, nums)), levels, end


def run_perf(repo: Path, seconds: float = 5.0, concurrency: str = "1", out_dir: Path = Path("perf_results"),
             server: TritonServer | None = None, protocol: str = "grpc", max_tokens: int = PERF_MAX_TOKENS,
             prompts_path: Path | None = None) -> Path:
    """One perf_analyzer pass (one protocol, one ``--concurrency-range``) against ``ensemble``.

    Starts the server on ``repo`` unless ``server`` is given, writes ``out_dir/perf_input.json`` (the
    prompts) and ``out_dir/perf_ensemble.csv`` (perf_analyzer's ``-f`` report), prints perf_analyzer's
    summary, and stops a server it started.

    Args:
        repo: the rendered model repository.
        seconds: measurement time per concurrency level, split over three windows (1..600 s).
        concurrency: ``N`` or ``start:end[:step]`` (perf_analyzer ``--concurrency-range``).
        out_dir: results folder (created).
        server: an already running server to measure instead (not stopped here).
        protocol: ``grpc`` (streaming) or ``http`` (generate_stream).
        prompts_path: prompt file (None: the built-in prompts).
    Returns:
        the CSV path.
    Raises:
        ConfigError: ``seconds`` or ``concurrency`` out of range.
        SplitspecError: the server failed to start, perf_analyzer failed or timed out (its
            output is included).
    """
    if not 1.0 <= float(seconds) <= 600.0:
        raise ConfigError(f"seconds = {seconds}: expected 1..600")
    conc, levels, top = _parse_concurrency(concurrency)
    binary = find_perf_analyzer()
    out_dir = Path(out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    own = server is None
    srv = server or TritonServer(repo)
    tokenizer_dir = repo_setting(srv.repo, "preprocessing", "tokenizer_dir")
    prompts = read_prompts(prompts_path, Path(tokenizer_dir) if tokenizer_dir else None)
    input_data = write_input_data(out_dir / "perf_input.json", prompts, max_tokens, protocol)
    csv_path = out_dir / "perf_ensemble.csv"
    tmp_csv = out_dir / f".perf_ensemble.{os.getpid()}.csv"
    if own:
        print(f"starting tritonserver on {srv.repo} ...", flush=True)
        srv.start()
        print(f"ready after {srv.startup_s:.1f} s", flush=True)
    try:
        cmd = perf_command(binary, srv.grpc_address, input_data, tmp_csv, float(seconds), conc, top, protocol=protocol,
                           http_address=f"127.0.0.1:{srv.http_port}")
        # per level: warm-up + 3 windows + a stable margin for slow requests at the window's edge
        timeout_s = levels * (float(seconds) * 2 + 60) + 30
        print("$ " + " ".join(cmd), flush=True)
        rc, out = run_bounded(cmd, tool_env(), timeout_s, out_dir / "perf_analyzer.log")
        print(out, flush=True)
        if rc is None:
            raise SplitspecError(f"perf_analyzer did not finish within {timeout_s:.0f} s:\n{out}")
        if rc != 0:
            raise SplitspecError(f"perf_analyzer exited with status {rc}:\n{out}")
        if not tmp_csv.is_file():
            raise SplitspecError(f"perf_analyzer wrote no CSV ({tmp_csv})")
        os.replace(tmp_csv, csv_path)
    finally:
        tmp_csv.unlink(missing_ok=True)
        if own:
            srv.stop()
    print(f"perf_analyzer report: {csv_path}", flush=True)
    return csv_path
