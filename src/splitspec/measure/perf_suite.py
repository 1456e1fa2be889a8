"""Load-testing the served ensemble: ``perf_analyzer`` (throughput, latency percentiles) and
``genai-perf`` (LLM metrics: time to first token, inter-token latency, output tokens/s).

``perf_analyzer`` ships as a binary in the manylinux wheel of ``tritonclient==2.50.0`` (later
wheels need a newer glibc or ship none). It links ``libb64.so.0d`` and ``libcudart.so.12``;
both are in ``site-packages/nvidia_pytriton.libs`` under hashed names, so
:func:`perf_lib_dir` links them under their plain names in ``.cache/perf_libs/`` and that folder
goes on ``LD_LIBRARY_PATH``.

Two protocols reach the same ensemble:

* ``grpc``: perf_analyzer's Triton client over gRPC with ``--streaming`` (the ensemble holds a
  decoupled model, so perf_analyzer refuses unary gRPC and KServe HTTP). Requests carry the
  ensemble's own tensors (``text_input``, ``max_tokens``, ``apply_chat_template``, ``stream`` true:
  one response per engine cycle); the latency is the time to the final response.
* ``http``: perf_analyzer's HTTP client (``--service-kind openai``, which posts a JSON payload to any
  path) against Triton's ``/v2/models/ensemble/generate_stream`` (server-sent events, one event per
  engine cycle); the latency is the time until the stream ends.

``genai-perf`` (0.0.16, the ``perf`` extra) drives perf_analyzer itself. Its Triton gRPC mode
(``--endpoint-type kserve --backend tensorrtllm|vllm``) adds an input ``exclude_input_in_output``
that our ensemble does not have, and perf_analyzer rejects every unknown input, so it is run with
``--endpoint-type generate --endpoint v2/models/ensemble/generate_stream --streaming``: Triton's
generate extension with our own tensor names (``text_input``, ``max_tokens``, ``stream`` →
``text_output``). genai-perf counts tokens by re-tokenising the streamed text with the engine's
tokenizer (``--tokenizer``), so its token counts can differ slightly from the engine's.

Every run is bounded: perf_analyzer measures three count windows per concurrency level
(``--measurement-mode count_windows``, ``--measurement-request-count``, ``--max-trials 3`` with a
stability threshold that accepts the first three windows); genai-perf sends a fixed number of
requests (``--request-count``); each level has a hard wall-clock timeout after which its process
group is killed. Only the local server is contacted, and a server started here is stopped
afterwards.

Results of :func:`run_perf_suite` (``make perf``) go to ``perf_results/<timestamp>/``:

* ``perf_analyzer/<protocol>_c<N>.csv``: perf_analyzer's own ``-f`` export of each level,
  ``perf_analyzer_<protocol>.csv``: the levels of one protocol in one table (the same columns);
* ``genai_perf/c<N>/``: genai-perf's artifacts (``profile_export_genai_perf.{json,csv}``);
* ``summary.json`` and ``summary.md``: one row per protocol and concurrency level.
"""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import Iterable, Sequence

from splitspec.errors import ConfigError, SplitspecError
from splitspec.files import write_atomic
from splitspec.measure.machine import machine_info, package_version
from splitspec.serving.tritonserver import TritonServer, find_triton, server_env

PROJECT_ROOT = Path(__file__).resolve().parents[3]
#: The held-out evaluation prompts (``{"prompt": ...}`` or ``{"messages": [...]}`` per line).
DEFAULT_PROMPTS = PROJECT_ROOT / "eval" / "prompts.jsonl"
#: Prompts used when no prompt file is available (code completions and one chat question).
PERF_PROMPTS: tuple[tuple[str, bool], ...] = (
    ("def fibonacci(n):", False),
    ("import os\n\ndef list_python_files(root):\n    \"\"\"Return every .py file under root.\"\"\"\n", False),
    ("class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n", False),
    ("def binary_search(items, target):\n    lo, hi = 0, len(items) - 1\n", False),
    ("How do I read a file line by line in Python?", True),
)
#: Output tokens per request (``max_tokens``) of the load tests.
PERF_MAX_TOKENS = 32
#: Concurrency levels of ``make perf``.
DEFAULT_CONCURRENCIES = (1, 2, 4, 8, 16, 32, 64)
PROTOCOLS = ("grpc", "http")
#: Windows perf_analyzer measures per level.
MEASUREMENT_WINDOWS = 3
MAX_CONCURRENCY = 256
#: Path of the streaming generate endpoint (server-sent events) of the ensemble.
GENERATE_STREAM_PATH = "v2/models/ensemble/generate_stream"
_LIB_LINKS = {"libb64.so.0d": "libb64-*.so.0d", "libcudart.so.12": "libcudart-*.so.12*"}


# --------------------------------------------------------------------------------------------
# Tools
# --------------------------------------------------------------------------------------------


def find_perf_analyzer() -> Path:
    """Path of the ``perf_analyzer`` binary installed by the ``tritonclient`` wheel.

    Raises:
        SplitspecError: tritonclient is not installed or its wheel holds no perf_analyzer.
    """
    try:
        dist = metadata.distribution("tritonclient")
    except metadata.PackageNotFoundError:
        raise SplitspecError("the Python package 'tritonclient' is missing: "
                             "pip install 'tritonclient[all]==2.50.0'") from None
    for f in dist.files or ():
        if f.name == "perf_analyzer":
            p = Path(os.path.normpath(f.locate()))
            if p.is_file() and os.access(p, os.X_OK):
                return p
    raise SplitspecError(f"tritonclient {dist.version} holds no perf_analyzer binary "
                         "(the manylinux wheel of tritonclient==2.50.0 does)")


def perf_lib_dir(cache_dir: Path | None = None) -> Path:
    """Folder with ``libb64.so.0d`` and ``libcudart.so.12`` linked to the copies in ``nvidia_pytriton.libs``.

    Args:
        cache_dir: where to make it (default ``<project>/.cache/perf_libs``, git-ignored).
    Raises:
        SplitspecError: a library is not in ``nvidia_pytriton.libs``.
    """
    libs = find_triton().libs_dir
    out = Path(cache_dir) if cache_dir else PROJECT_ROOT / ".cache" / "perf_libs"
    out.mkdir(parents=True, exist_ok=True)
    for name, pattern in _LIB_LINKS.items():
        found = sorted(libs.glob(pattern))
        if not found:
            raise SplitspecError(f"{libs}: no {pattern} to provide {name} for perf_analyzer")
        link = out / name
        if link.is_symlink() and os.readlink(link) == str(found[0]):
            continue
        tmp = out / f".{name}.{os.getpid()}.tmp"
        tmp.unlink(missing_ok=True)
        os.symlink(found[0], tmp)
        os.replace(tmp, link)
    return out


def find_genai_perf() -> Path | None:
    """The ``genai-perf`` executable: next to this interpreter (the ``perf`` extra), in
    ``.cache/perf-tools/bin/``, or on ``PATH``; None when it is not installed."""
    candidates = [Path(sys.executable).parent / "genai-perf", PROJECT_ROOT / ".cache" / "perf-tools" / "bin" / "genai-perf"]
    on_path = shutil.which("genai-perf")
    if on_path:
        candidates.append(Path(on_path))
    for c in candidates:
        if c.is_file() and os.access(c, os.X_OK):
            return c
    return None


def tool_env() -> dict[str, str]:
    """Environment for perf_analyzer and genai-perf: this interpreter's ``bin`` first on ``PATH``
    (genai-perf runs the ``perf_analyzer`` found there), the perf_analyzer libraries on
    ``LD_LIBRARY_PATH``, no proxies (localhost only), Hugging Face offline (local tokenizer)."""
    env = server_env(extra_lib_dirs=(perf_lib_dir(),))
    for k in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        env.pop(k, None)
    env["NO_PROXY"] = env["no_proxy"] = "127.0.0.1,localhost"
    env["HF_HUB_OFFLINE"] = "1"
    env["TRANSFORMERS_OFFLINE"] = "1"
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


# --------------------------------------------------------------------------------------------
# Prompts and input files
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Prompt:
    """One evaluation prompt.

    Attributes:
        id: identifier from the prompt file (``code-01``) or its line number.
        text: ``text_input`` as sent.
        chat: True: the server wraps ``text`` as one user message in the chat template
            (``apply_chat_template``).
    """

    id: str
    text: str
    chat: bool = False


def load_prompts(path: Path | None = None, tokenizer_dir: Path | None = None) -> list[Prompt]:
    """Read evaluation prompts from a JSON-lines file.

    Each line is ``{"prompt": str}`` (sent as is; ``"chat": true`` wraps it in the chat template) or
    ``{"messages": [{"role": ..., "content": ...}, ...]}``: a single user message is sent with
    ``apply_chat_template``; a longer conversation is rendered here with the tokenizer's chat template
    (``tokenizer_dir`` needed) and sent as text. Blank lines are skipped.

    Args:
        path: the file (default ``eval/prompts.jsonl``; when that file is missing the built-in
            :data:`PERF_PROMPTS` are used).
        tokenizer_dir: folder with ``tokenizer.json`` (only for multi-message prompts).
    Raises:
        ConfigError: the file is missing (an explicit path), a line is not such an object, or it holds
            no prompt (the message names the file and line).
    """
    if path is None:
        if not DEFAULT_PROMPTS.is_file():
            return [Prompt(f"builtin-{i + 1}", t, c) for i, (t, c) in enumerate(PERF_PROMPTS)]
        path = DEFAULT_PROMPTS
    path = Path(path)
    if path.exists() and not path.is_file():  # a FIFO would block the read forever
        raise ConfigError(f"{path}: not a regular file (expected a JSON-lines prompt file)")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise ConfigError(f"{path}: prompt file not found") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot read the prompt file ({e})") from None
    out: list[Prompt] = []
    tok = None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            d = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{where}: not valid JSON ({e.msg})") from None
        if not isinstance(d, dict):
            raise ConfigError(f"{where}: expected a JSON object with 'prompt' or 'messages'")
        pid = str(d.get("id", f"line-{n}"))
        if isinstance(d.get("prompt"), str) and d["prompt"]:
            out.append(Prompt(pid, d["prompt"], bool(d.get("chat", False))))
            continue
        msgs = d.get("messages")
        if not isinstance(msgs, list) or not msgs or not all(
                isinstance(m, dict) and isinstance(m.get("content"), str) and isinstance(m.get("role"), str) for m in msgs):
            raise ConfigError(f"{where}: expected a non-empty 'prompt' string or 'messages' "
                              "(a list of {\"role\": ..., \"content\": ...})")
        if len(msgs) == 1 and msgs[0]["role"] == "user":
            out.append(Prompt(pid, msgs[0]["content"], True))
            continue
        if tok is None:
            tok = _tokenizer(tokenizer_dir, where)
        out.append(Prompt(pid, tok.apply_chat_template(msgs, add_generation_prompt=True), False))
    if not out:
        raise ConfigError(f"{path}: no prompts")
    return out


def _tokenizer(tokenizer_dir: Path | None, why: str):
    from splitspec.runtime.tokenizer import ChatTokenizer  # noqa: PLC0415

    if tokenizer_dir is None or not (Path(tokenizer_dir) / "tokenizer.json").is_file():
        raise ConfigError(f"{why}: a multi-message prompt needs the tokenizer (tokenizer_dir = {tokenizer_dir})")
    return ChatTokenizer.from_dir(Path(tokenizer_dir))


def rendered_text(prompts: Sequence[Prompt], tokenizer_dir: Path) -> list[str]:
    """The text the model sees for each prompt: chat prompts rendered with the tokenizer's chat
    template (special-token strings in it encode to the same ids as ``apply_chat_template``)."""
    tok = None
    out = []
    for p in prompts:
        if p.chat:
            tok = tok or _tokenizer(tokenizer_dir, f"prompt {p.id}")
            out.append(tok.apply_chat_template([{"role": "user", "content": p.text}], add_generation_prompt=True))
        else:
            out.append(p.text)
    return out


def write_input_data(path: Path, prompts: Sequence[Prompt] | None = None, max_tokens: int = PERF_MAX_TOKENS,
                     protocol: str = "grpc") -> Path:
    """Write perf_analyzer's ``--input-data`` JSON: one entry per prompt, cycled through in order.

    Requests stream (``stream`` true: one response per engine cycle), as an interactive client would.

    Args:
        prompts: default :func:`load_prompts` ``()``.
        max_tokens: output tokens per request.
        protocol: ``grpc``: the ensemble's tensors (``{"text_input": [..], "max_tokens": [..], ...}``);
            ``http``: perf_analyzer's payload form, the JSON body posted to ``generate_stream``.
    """
    prompts = list(prompts) if prompts is not None else load_prompts()
    if protocol == "grpc":
        data = [{"text_input": [p.text], "max_tokens": [max_tokens], "apply_chat_template": [p.chat], "stream": [True]}
                for p in prompts]
    elif protocol == "http":
        data = [{"payload": [{"text_input": p.text, "max_tokens": max_tokens, "apply_chat_template": p.chat,
                              "stream": True}]} for p in prompts]
    else:
        raise ConfigError(f"protocol = {protocol!r}: expected one of {', '.join(PROTOCOLS)}")
    write_atomic(Path(path), json.dumps({"data": data}, indent=2, ensure_ascii=False) + "\n")
    return Path(path)


def write_genai_perf_input(path: Path, prompts: Sequence[Prompt], tokenizer_dir: Path) -> Path:
    """Write genai-perf's ``--input-file`` (JSON lines ``{"text": ...}``); chat prompts are rendered
    here (genai-perf has no per-prompt ``apply_chat_template``)."""
    lines = [json.dumps({"text": t}, ensure_ascii=False) for t in rendered_text(prompts, tokenizer_dir)]
    write_atomic(Path(path), "\n".join(lines) + "\n")
    return Path(path)


# --------------------------------------------------------------------------------------------
# Running one level
# --------------------------------------------------------------------------------------------


def _run_bounded(cmd: list[str], env: dict[str, str], timeout_s: float, log_path: Path,
                 cwd: Path | None = None) -> tuple[int | None, str]:
    """Run ``cmd`` in its own process group, output to ``log_path``; kill the group after ``timeout_s``.

    Returns:
        (exit status, or None when it timed out; the last 4000 characters of its output).
    """
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as log:
        log.write(("$ " + " ".join(cmd) + "\n").encode())
        log.flush()
        proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                cwd=str(cwd) if cwd else None, start_new_session=True)
        try:
            rc: int | None = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            rc = None
        except BaseException:  # Ctrl-C: leave nothing behind
            _kill_group(proc)
            raise
        finally:
            _kill_group(proc)
    return rc, log_path.read_text(errors="replace")[-4000:]


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


def perf_command(binary: Path, grpc_address: str, input_data: Path, csv_path: Path, seconds: float,
                 concurrency: str | int, max_concurrency: int = 1, *, protocol: str = "grpc",
                 http_address: str | None = None, request_count: int | None = None,
                 warmup_requests: int = 0) -> list[str]:
    """The perf_analyzer command line for the ensemble (bounded count windows).

    Each of the three windows lasts at least ``seconds / 3`` (0.5 s minimum) and is stretched by
    perf_analyzer until ``request_count`` requests (default ``2 × max_concurrency``, at least 3)
    completed, so a generation longer than a window is still measured.

    Args:
        protocol: ``grpc`` (``grpc_address``, streaming) or ``http`` (``http_address``, generate_stream).
        concurrency: ``N`` or perf_analyzer's ``start:end[:step]``.
        warmup_requests: requests sent before measuring (0: none).
    """
    window_ms = max(500, int(seconds * 1000 / MEASUREMENT_WINDOWS))
    count = request_count or max(3, 2 * max_concurrency)
    if protocol == "grpc":
        conn = ["-i", "grpc", "--streaming", "-u", grpc_address]
    elif protocol == "http":
        if not http_address:
            raise ConfigError("protocol http needs http_address (host:port of the HTTP endpoint)")
        conn = ["--service-kind", "openai", "-i", "http", "--endpoint", GENERATE_STREAM_PATH, "-u", http_address]
    else:
        raise ConfigError(f"protocol = {protocol!r}: expected one of {', '.join(PROTOCOLS)}")
    cmd = [str(binary), "-m", "ensemble", "--async", *conn,
           "--input-data", str(input_data), "--concurrency-range", str(concurrency),
           "--measurement-mode", "count_windows", "--measurement-request-count", str(count),
           "--measurement-interval", str(window_ms),
           "--max-trials", str(MEASUREMENT_WINDOWS), "--stability-percentage", "999",
           "-f", str(csv_path), "--verbose-csv"]
    if warmup_requests > 0:
        cmd += ["--warmup-request-count", str(warmup_requests)]
    return cmd


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
    rc, tail = _run_bounded(cmd, tool_env(), timeout_s, log_path)
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


def genai_perf_command(binary: Path, http_address: str, input_file: Path, artifact_dir: Path, tokenizer_dir: Path,
                       concurrency: int, request_count: int, max_tokens: int = PERF_MAX_TOKENS,
                       warmup_requests: int = 0, extra_inputs: dict | None = None) -> list[str]:
    """The genai-perf command line: Triton's generate_stream endpoint with our tensor names.

    Args:
        http_address: ``host:port`` of the server's HTTP endpoint.
        tokenizer_dir: the target engine's tokenizer (genai-perf counts tokens with it).
        request_count: requests measured (after ``warmup_requests``).
        extra_inputs: further request inputs, e.g. ``{"num_draft_tokens": 0}``.
    """
    cmd = [str(binary), "profile", "-m", "ensemble", "--endpoint-type", "generate",
           "--endpoint", GENERATE_STREAM_PATH, "--streaming", "-u", http_address,
           "--input-file", str(input_file), "--tokenizer", str(tokenizer_dir),
           "--output-tokens-mean", str(max_tokens), "--output-tokens-stddev", "0",
           "--concurrency", str(concurrency), "--request-count", str(request_count),
           "--random-seed", "0", "--artifact-dir", str(artifact_dir)]
    if warmup_requests > 0:
        cmd += ["--warmup-request-count", str(warmup_requests)]
    for k, v in (extra_inputs or {}).items():
        cmd += ["--extra-inputs", f"{k}:{json.dumps(v) if isinstance(v, bool) else v}"]
    return cmd


def run_genai_perf_level(concurrency: int, input_file: Path, out_dir: Path, *, http_address: str,
                         tokenizer_dir: Path, max_tokens: int = PERF_MAX_TOKENS, request_count: int | None = None,
                         timeout_s: float = 300.0, binary: Path | None = None) -> LevelResult:
    """Run genai-perf at one concurrency level; artifacts go to ``out_dir/c<N>/``.

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
    level_dir = out_dir / f"c{concurrency}"
    if level_dir.exists():
        shutil.rmtree(level_dir)
    level_dir.mkdir(parents=True)
    count = request_count or max(8, 3 * concurrency)
    cmd = genai_perf_command(binary, http_address, input_file, level_dir, tokenizer_dir, concurrency, count,
                             max_tokens, warmup_requests=concurrency)
    t0 = time.monotonic()
    rc, tail = _run_bounded(cmd, tool_env(), timeout_s, level_dir / "genai_perf.log", cwd=level_dir)
    wall = time.monotonic() - t0
    found = sorted(level_dir.rglob("profile_export_genai_perf.json"))
    files = tuple(str(p.relative_to(out_dir.parent)) for p in [*found, level_dir / "genai_perf.log"] if p.exists())
    if rc is None:
        return LevelResult("genai-perf", "http", concurrency, wall, {}, f"timed out after {timeout_s:.0f} s (killed)", files)
    if rc != 0 or not found:
        return LevelResult("genai-perf", "http", concurrency, wall, {},
                           f"genai-perf exited with status {rc}: {_last_error(tail)}", files)
    return LevelResult("genai-perf", "http", concurrency, wall, parse_genai_perf(found[-1]), None, files)


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


# --------------------------------------------------------------------------------------------
# make perf
# --------------------------------------------------------------------------------------------


def parse_levels(value: str | Iterable[int], what: str = "concurrency") -> tuple[int, ...]:
    """``"1,2,4"`` (or ints) → (1, 2, 4), each 1..MAX_CONCURRENCY, distinct, ascending.

    Raises:
        ConfigError: malformed or out of range (names ``what``).
    """
    items = str(value).split(",") if isinstance(value, (str, int)) else list(value)
    levels = []
    for x in items:
        s = str(x).strip()
        if not s.isdigit() or not 1 <= int(s) <= MAX_CONCURRENCY:
            raise ConfigError(f"{what} = {value!r}: expected comma-separated integers in 1..{MAX_CONCURRENCY}")
        levels.append(int(s))
    if not levels:
        raise ConfigError(f"{what} is empty")
    return tuple(sorted(set(levels)))


def repo_setting(repo: Path, model: str, key: str) -> str | None:
    """A ``parameters`` value from ``repo/<model>/config.pbtxt`` (None when absent)."""
    try:
        text = (Path(repo) / model / "config.pbtxt").read_text(encoding="utf-8")
    except OSError:
        return None
    m = re.search(r'key:\s*"' + re.escape(key) + r'"\s*value:\s*\{\s*string_value:\s*"([^"]*)"', text)
    return m.group(1) if m else None


def _timestamp() -> str:
    return time.strftime("%Y%m%d-%H%M%S")


def run_perf_suite(*, engines: Path | None = None, repo: Path | None = None, out_dir: Path | None = None,
                   concurrencies: Iterable[int] = DEFAULT_CONCURRENCIES, protocols: Iterable[str] = PROTOCOLS,
                   max_tokens: int = PERF_MAX_TOKENS, prompts_path: Path | None = None, seconds: float = 3.0,
                   llm_metrics: bool = True, llm_concurrencies: Iterable[int] | None = None,
                   level_timeout_s: float = 300.0, num_draft_tokens: int | None = None, draft_tp: int | None = None,
                   target_device_ids: str = "", draft_device_id: str = "",
                   server: TritonServer | None = None) -> Path:
    """``make perf``: serve the ensemble, sweep concurrency with perf_analyzer (gRPC streaming and
    HTTP generate_stream) and genai-perf, write the results, stop the server.

    Exactly one of ``engines`` (a repository is rendered into ``out_dir/repo`` with max_batch_size =
    the highest concurrency, KV space for every sequence, and the given k / placement — None: the
    engines' tuning.json, else 4 and 1), ``repo`` (an
    already rendered repository; its max_batch_size should reach the highest concurrency) or
    ``server`` (a running server, not stopped here) says what is measured.

    Args:
        out_dir: results folder (default ``perf_results/<timestamp>``).
        concurrencies: perf_analyzer levels (requests in flight).
        protocols: subset of ``grpc``, ``http``.
        max_tokens: output tokens per request.
        prompts_path: JSON-lines prompts (default ``eval/prompts.jsonl``).
        seconds: minimum measurement time per perf_analyzer level.
        llm_metrics: also run genai-perf (skipped with a notice when it is not installed).
        llm_concurrencies: genai-perf levels (default: ``concurrencies``).
        level_timeout_s: hard wall-clock limit of one level of one tool.
    Returns:
        the results folder (``summary.json``, ``summary.md``, the tools' files).
    Raises:
        ConfigError: a bad argument.
        SplitspecError: the server failed to start, or no level of any tool produced figures.
    """
    from splitspec.serving.repo import render_repo  # noqa: PLC0415
    from splitspec.settings import ServeConfig, parse_id, parse_ids  # noqa: PLC0415

    if sum(x is not None for x in (engines, repo, server)) != 1:
        raise ConfigError("run_perf_suite: give exactly one of engines, repo, server")
    levels = parse_levels(concurrencies)
    llm_levels = parse_levels(llm_concurrencies) if llm_concurrencies is not None else levels
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
    out.mkdir(parents=True, exist_ok=True)
    genai = find_genai_perf() if llm_metrics else None
    if llm_metrics and genai is None:
        print("genai-perf is not installed (make perf-tools): LLM metrics skipped", flush=True)

    own = server is None
    if engines is not None:
        top = max(levels + llm_levels)
        repo = render_repo(ServeConfig.from_env(
            engines_dir=Path(engines), num_draft_tokens=num_draft_tokens, draft_tp=draft_tp,
            target_device_ids=parse_ids(target_device_ids, "target_device_ids"),
            draft_device_id=parse_id(draft_device_id, "draft_device_id"), max_batch_size=top, kv_tokens=top * 256 + 1024),
            out / "repo")
    srv = server or TritonServer(Path(repo), exit_timeout_s=10)
    repo_dir = srv.repo
    tokenizer_dir = Path(repo_setting(repo_dir, "preprocessing", "tokenizer_dir") or "")
    prompts = load_prompts(prompts_path, tokenizer_dir)
    batch = repo_setting(repo_dir, "spec_decode", "max_batch_size")
    if batch and int(batch) < max(levels):
        print(f"note: {repo_dir} serves at most {batch} sequences together; levels above queue in the server",
              flush=True)
    inputs = {p: write_input_data(out / f"perf_input_{p}.json", prompts, max_tokens, p) for p in protocols}
    genai_input = write_genai_perf_input(out / "genai_perf_input.jsonl", prompts, tokenizer_dir) if genai else None

    results: list[LevelResult] = []
    t_start = time.monotonic()
    if own:
        print(f"starting tritonserver on {repo_dir} ...", flush=True)
        srv.start()
        print(f"ready after {srv.startup_s:.1f} s (log {srv.log_path})", flush=True)
    try:
        total = len(protocols) * len(levels) + (len(llm_levels) if genai else 0)
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
        if genai:
            for c in llm_levels:
                done += 1
                print(f"[{done}/{total}] genai-perf http concurrency {c} ...", end=" ", flush=True)
                r = run_genai_perf_level(c, genai_input, out / "genai_perf", http_address=f"127.0.0.1:{srv.http_port}",
                                         tokenizer_dir=tokenizer_dir, max_tokens=max_tokens, timeout_s=level_timeout_s,
                                         binary=genai)
                results.append(r)
                print(_level_line(r), flush=True)
                if r.error and "timed out" in r.error:
                    print("  higher genai-perf levels skipped after a timeout", flush=True)
                    break
    finally:
        if own:
            srv.stop()
            if srv.log_path.exists():
                shutil.copyfile(srv.log_path, out / "tritonserver.log")
    for proto in protocols:
        _merge_csvs([out / "perf_analyzer" / f"{proto}_c{c}.csv" for c in levels], out / f"perf_analyzer_{proto}.csv")
    meta = {"date": time.strftime("%Y-%m-%d %H:%M:%S %z"), "repo": str(repo_dir), "max_tokens": max_tokens,
            "prompts": str(prompts_path or DEFAULT_PROMPTS), "num_prompts": len(prompts),
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
        lines += ["### genai-perf (HTTP generate_stream; tokens counted by re-tokenising the text)", "",
                  "| concurrency | output tokens/s | tokens/s per user | requests/s | TTFT p50 / p99 (ms) | "
                  "ITL p50 / p99 (ms) | latency p50 (ms) |", "|---|---|---|---|---|---|---|"]
        for r in gp:
            if r.error:
                lines.append(f"| {r.concurrency} | failed: {r.error[:80]} | | | | | |")
                continue
            m = r.metrics
            lines.append(f"| {r.concurrency} | {_fmt(m.get('output_tokens_per_s_avg'))} | "
                         f"{_fmt(m.get('output_tokens_per_s_per_user_avg'))} | {_fmt(m.get('requests_per_s_avg'), 2)} | "
                         f"{_fmt(m.get('ttft_ms_p50'), 0)} / {_fmt(m.get('ttft_ms_p99'), 0)} | "
                         f"{_fmt(m.get('itl_ms_p50'))} / {_fmt(m.get('itl_ms_p99'))} | {_fmt(m.get('latency_ms_p50'), 0)} |")
        lines.append("")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------
# A single short pass (tests, quick checks)
# --------------------------------------------------------------------------------------------


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
    prompts = load_prompts(prompts_path, Path(tokenizer_dir) if tokenizer_dir else None)
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
        rc, out = _run_bounded(cmd, tool_env(), timeout_s, out_dir / "perf_analyzer.log")
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
