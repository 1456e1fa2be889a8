"""One concurrency level of one load-testing tool against the served ensemble: run it bounded (its
process group is killed after a hard timeout), and read its figures — perf_analyzer's ``-f`` CSV
(µs in the file, ms here) or genai-perf's ``profile_export_genai_perf.json``.
"""

from __future__ import annotations

import csv
import json
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from splitspec.errors import SplitspecError
from splitspec.measure.perf_tools import (PERF_MAX_TOKENS, find_genai_perf, find_perf_analyzer, genai_perf_command,
                                          perf_command, run_bounded, tool_env)


def read_perf_csv(path: Path) -> list[dict[str, str]]:
    """perf_analyzer's ``-f`` CSV as a list of rows (column name → text)."""
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def _summarise_pa_row(row: dict[str, str]) -> dict:
    """Throughput (requests/s) and latencies (ms) from a perf_analyzer CSV row (µs in the file)."""
    def ms(col: str) -> float | None:
        v = row.get(col)
        return round(float(v) / 1000.0, 2) if v not in (None, "") else None

    out = {"requests_per_s": round(float(row["Inferences/Second"]), 4),
           "latency_avg_ms": ms("Avg latency"), "latency_p50_ms": ms("p50 latency"), "latency_p90_ms": ms("p90 latency"),
           "latency_p95_ms": ms("p95 latency"), "latency_p99_ms": ms("p99 latency")}
    if row.get("Response Throughput"):  # gRPC streaming: responses (one per engine cycle) per second
        out["responses_per_s"] = round(float(row["Response Throughput"]), 4)
    if "response wait" in row:  # HTTP: time until the first bytes of the stream arrived
        out["first_response_ms"] = ms("response wait")
    return out


@dataclass
class LevelResult:
    """One load level of one tool.

    Attributes:
        tool: ``perf_analyzer`` or ``genai-perf``.
        protocol: ``grpc`` or ``http``.
        concurrency: requests kept in flight.
        wall_s: seconds the tool ran.
        metrics: the level's figures (requests/s, latencies in ms; genai-perf: TTFT, ITL, tokens/s).
        error: why the level produced no figures (None when it did).
        files: the tool's output files for the level (relative to the results folder).
    """

    tool: str
    protocol: str
    concurrency: int
    wall_s: float
    metrics: dict
    error: str | None = None
    files: tuple[str, ...] = ()


def run_perf_analyzer_level(protocol: str, concurrency: int, input_data: Path, out_dir: Path, *,
                            grpc_address: str, http_address: str, seconds: float = 3.0,
                            request_count: int | None = None, timeout_s: float = 300.0) -> LevelResult:
    """Run perf_analyzer at one concurrency level; its CSV goes to ``out_dir/<protocol>_c<N>.csv``
    and its output to ``<protocol>_c<N>.log`` beside it.

    Args:
        protocol: ``grpc`` or ``http``.
        concurrency: requests in flight.
        input_data: :func:`write_input_data` file for this protocol.
        seconds: minimum measurement time per level (three windows of ``seconds / 3``).
        request_count: requests per window (default ``max(4, 2 × concurrency)``).
        timeout_s: hard wall-clock limit; the process is killed after it.
    Returns:
        the level (``error`` set when perf_analyzer failed, timed out or wrote no CSV).
    """
    binary = find_perf_analyzer()
    out_dir.mkdir(parents=True, exist_ok=True)
    name = f"{protocol}_c{concurrency}"
    csv_path, log_path = out_dir / f"{name}.csv", out_dir / f"{name}.log"
    csv_path.unlink(missing_ok=True)
    count = request_count or max(4, 2 * concurrency)
    cmd = perf_command(binary, grpc_address, input_data, csv_path, seconds, concurrency, concurrency, protocol=protocol,
                       http_address=http_address, request_count=count, warmup_requests=concurrency)
    t0 = time.monotonic()
    rc, tail = run_bounded(cmd, tool_env(), timeout_s, log_path)
    wall = time.monotonic() - t0
    files = tuple(str(p.relative_to(out_dir.parent)) for p in (csv_path, log_path) if p.exists())
    if rc is None:
        return LevelResult("perf_analyzer", protocol, concurrency, wall, {},
                           f"timed out after {timeout_s:.0f} s (killed)", files)
    if rc != 0 or not csv_path.is_file():
        return LevelResult("perf_analyzer", protocol, concurrency, wall, {},
                           f"perf_analyzer exited with status {rc}: {_last_error(tail)}", files)
    rows = read_perf_csv(csv_path)
    if not rows:
        return LevelResult("perf_analyzer", protocol, concurrency, wall, {}, "perf_analyzer wrote an empty CSV", files)
    return LevelResult("perf_analyzer", protocol, concurrency, wall, _summarise_pa_row(rows[-1]), None, files)


def _last_error(output: str) -> str:
    """The most telling line of a tool's output (an ``error``/``Error`` line, else the last line)."""
    lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
    # perf_analyzer's own messages first (genai-perf prints them before its traceback), then any error line
    first = [ln for ln in lines if re.match(r"(error|Error|Thread \[\d+\] had error)", ln)]
    hits = first or [ln for ln in lines if re.search(r"\berror\b|failed|exception", ln, re.I)]
    return (hits[-1] if hits else (lines[-1] if lines else "no output"))[:500]


def run_genai_perf_level(concurrency: int, input_file: Path, out_dir: Path, *, http_address: str,
                         tokenizer_dir: Path, max_tokens: int = PERF_MAX_TOKENS, request_count: int | None = None,
                         timeout_s: float = 300.0, binary: Path | None = None,
                         openai_model: str | None = None) -> LevelResult:
    """Run genai-perf at one concurrency level; artifacts go to ``out_dir/c<N>/`` (``out_dir/openai_c<N>/`` against
    the OpenAI front end: ``openai_model`` names the served model, ``http_address`` is the front end's).

    Args:
        request_count: requests measured (default ``max(8, 3 × concurrency)``), after ``concurrency``
            warm-up requests.
        timeout_s: hard wall-clock limit; genai-perf and its perf_analyzer are killed after it.
    Returns:
        the level: TTFT / ITL / latency (ms), output tokens/s (aggregate and per user), requests/s.
    Raises:
        SplitspecError: genai-perf is not installed.
    """
    binary = binary or find_genai_perf()
    if binary is None:
        raise SplitspecError("genai-perf is not installed: make perf-tools (or pip install -e '.[perf]')")
    protocol = "openai" if openai_model else "http"
    level_dir = out_dir / f"{'openai_' if openai_model else ''}c{concurrency}"
    if level_dir.exists():
        shutil.rmtree(level_dir)
    level_dir.mkdir(parents=True)
    count = request_count or max(8, 3 * concurrency)
    cmd = genai_perf_command(binary, http_address, input_file, level_dir, tokenizer_dir, concurrency, count,
                             max_tokens, warmup_requests=concurrency, openai_model=openai_model)
    t0 = time.monotonic()
    rc, tail = run_bounded(cmd, tool_env(), timeout_s, level_dir / "genai_perf.log", cwd=level_dir)
    wall = time.monotonic() - t0
    found = sorted(level_dir.rglob("profile_export_genai_perf.json"))
    files = tuple(str(p.relative_to(out_dir.parent)) for p in [*found, level_dir / "genai_perf.log"] if p.exists())
    if rc is None:
        return LevelResult("genai-perf", protocol, concurrency, wall, {}, f"timed out after {timeout_s:.0f} s (killed)", files)
    if rc != 0 or not found:
        return LevelResult("genai-perf", protocol, concurrency, wall, {},
                           f"genai-perf exited with status {rc}: {_last_error(tail)}", files)
    return LevelResult("genai-perf", protocol, concurrency, wall, parse_genai_perf(found[-1]), None, files)


#: genai-perf metrics copied into the summary: its key → (our key, statistic).
_GENAI_METRICS = {
    "time_to_first_token": ("ttft_ms", ("avg", "p50", "p90", "p99")),
    "inter_token_latency": ("itl_ms", ("avg", "p50", "p90", "p99")),
    "request_latency": ("latency_ms", ("avg", "p50", "p90", "p99")),
    "output_token_throughput": ("output_tokens_per_s", ("avg",)),
    "output_token_throughput_per_user": ("output_tokens_per_s_per_user", ("avg", "p50")),
    "request_throughput": ("requests_per_s", ("avg",)),
    "output_sequence_length": ("output_tokens", ("avg",)),
    "input_sequence_length": ("input_tokens", ("avg",)),
    "request_count": ("requests", ("avg",)),
}


def parse_genai_perf(path: Path) -> dict:
    """The figures of a ``profile_export_genai_perf.json``: ``ttft_ms_avg``, ``itl_ms_p50``,
    ``output_tokens_per_s_avg``, ... (units: ms, tokens/s, requests/s)."""
    data = json.loads(Path(path).read_text())
    out = {}
    for key, (name, stats) in _GENAI_METRICS.items():
        m = data.get(key)
        if not isinstance(m, dict):
            continue
        for s in stats:
            if isinstance(m.get(s), (int, float)):
                out[f"{name}_{s}"] = round(float(m[s]), 3)
    return out
