"""Running the load-testing tools against the served ensemble, one concurrency level at a time:
``perf_analyzer`` (throughput, latency percentiles) and ``genai-perf`` (LLM metrics: time to first
token, inter-token latency, output tokens/s).

``perf_analyzer`` ships as a binary in the manylinux wheel of ``tritonclient==2.50.0`` (later
wheels need a newer glibc or ship none). It links ``libb64.so.0d`` and ``libcudart.so.12``;
both are in ``site-packages/nvidia_pytriton.libs`` under hashed names, so
:func:`perf_lib_dir` links them under their plain names in a cache folder and that folder
goes on ``LD_LIBRARY_PATH``.

Two protocols reach the same ensemble:

* ``grpc``: perf_analyzer's Triton client over gRPC with ``--streaming`` (the ensemble holds a
  decoupled model, so perf_analyzer refuses unary gRPC and KServe HTTP). Requests carry the
  ensemble's own tensors (``text_input``, ``max_tokens``, ``apply_chat_template``, ``stream`` true:
  one response per engine cycle), each value given without the batch dimension, which perf_analyzer
  adds for the batched ensemble (batch size 1: ``[1, 1]``); the latency is the time to the final response.
* ``http``: perf_analyzer's HTTP client (``--service-kind openai``, which posts a JSON payload to any
  path) against Triton's ``/v2/models/ensemble/generate_stream`` (server-sent events, one event per
  engine cycle); the latency is the time until the stream ends.

``genai-perf`` (0.0.16, the ``perf`` extra) drives perf_analyzer itself. It is run with
``--endpoint-type generate --endpoint v2/models/ensemble/generate_stream --streaming``: Triton's
generate extension (``text_input``, ``max_tokens``, ``stream`` → ``text_output``, plain JSON values to which
Triton adds the ensemble's batch dimension), the same path as the ``http`` protocol above. Its Triton gRPC mode
(``--endpoint-type kserve --backend tensorrtllm``) sends the TensorRT-LLM convention's inputs (``text_input``,
``max_tokens``, ``exclude_input_in_output``, ``stream``), which the ensemble also takes, but is not used here. genai-perf counts tokens by re-tokenising the streamed text with the engine's
tokenizer (``--tokenizer``), so its token counts can differ slightly from the engine's.

Every run is bounded: perf_analyzer measures three count windows per concurrency level
(``--measurement-mode count_windows``, ``--measurement-request-count``, ``--max-trials 3`` with a
stability threshold that accepts the first three windows); genai-perf sends a fixed number of
requests (``--request-count``); each level has a hard wall-clock timeout after which its process
group is killed.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from splitspec.errors import ConfigError, SplitspecError
from splitspec.serving.triton_install import find_triton, server_env

#: Output tokens per request (``max_tokens``) of the load tests.
PERF_MAX_TOKENS = 32
PROTOCOLS = ("grpc", "http")
#: Windows perf_analyzer measures per level.
MEASUREMENT_WINDOWS = 3
#: Path of the streaming generate endpoint (server-sent events) of the ensemble.
GENERATE_STREAM_PATH = "v2/models/ensemble/generate_stream"
_LIB_LINKS = {"libb64.so.0d": "libb64-*.so.0d", "libcudart.so.12": "libcudart-*.so.12*"}


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
        cache_dir: where to make it (created; default ``~/.cache/splitspec/perf_libs``); links that
            point elsewhere are renewed.
    Raises:
        SplitspecError: a library is not in ``nvidia_pytriton.libs``.
    """
    libs = find_triton().libs_dir
    out = Path(cache_dir) if cache_dir else Path.home() / ".cache" / "splitspec" / "perf_libs"
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
    """The ``genai-perf`` executable: next to this interpreter (the ``perf`` extra) or on ``PATH``;
    None when it is not installed."""
    candidates = [Path(sys.executable).parent / "genai-perf"]
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


def run_bounded(cmd: list[str], env: dict[str, str], timeout_s: float, log_path: Path,
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


def genai_perf_command(binary: Path, http_address: str, input_file: Path, artifact_dir: Path, tokenizer_dir: Path,
                       concurrency: int, request_count: int, max_tokens: int = PERF_MAX_TOKENS,
                       warmup_requests: int = 0, extra_inputs: dict | None = None,
                       openai_model: str | None = None) -> list[str]:
    """The genai-perf command line: Triton's generate_stream endpoint with our tensor names, or (``openai_model``)
    the OpenAI-compatible front end's streamed chat completions.

    Args:
        http_address: ``host:port`` of the server's HTTP endpoint (of the OpenAI front end with ``openai_model``).
        tokenizer_dir: the target engine's tokenizer (genai-perf counts tokens with it).
        request_count: requests measured (after ``warmup_requests``).
        extra_inputs: further request inputs, e.g. ``{"num_draft_tokens": 0}`` (an extension field of the OpenAI
            front end too).
        openai_model: the served model name: ``--endpoint-type chat`` (genai-perf 0.0.16 takes the service kind,
            openai, from the endpoint type; ``v1/chat/completions``, server-sent events).
    """
    if openai_model:
        target = ["-m", openai_model, "--endpoint-type", "chat"]
    else:
        target = ["-m", "ensemble", "--endpoint-type", "generate", "--endpoint", GENERATE_STREAM_PATH]
    cmd = [str(binary), "profile", *target, "--streaming", "-u", http_address,
           "--input-file", str(input_file), "--tokenizer", str(tokenizer_dir),
           "--output-tokens-mean", str(max_tokens), "--output-tokens-stddev", "0",
           "--concurrency", str(concurrency), "--request-count", str(request_count),
           "--random-seed", "0", "--artifact-dir", str(artifact_dir)]
    if warmup_requests > 0:
        cmd += ["--warmup-request-count", str(warmup_requests)]
    for k, v in (extra_inputs or {}).items():
        cmd += ["--extra-inputs", f"{k}:{json.dumps(v) if isinstance(v, bool) else v}"]
    return cmd
