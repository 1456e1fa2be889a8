"""Load-testing the served ensemble with ``perf_analyzer``.

``perf_analyzer`` ships as a binary in the manylinux wheel of ``tritonclient==2.50.0`` (later
wheels need a newer glibc or ship none). It links ``libb64.so.0d`` and ``libcudart.so.12``;
both are in ``site-packages/nvidia_pytriton.libs`` under hashed names, so
:func:`perf_lib_dir` links them under their plain names in ``.cache/perf_libs/`` and that folder
goes on ``LD_LIBRARY_PATH``.

The ensemble contains a decoupled model, so perf_analyzer talks gRPC with ``--streaming``; the
requests set ``stream`` (one response per engine cycle).
Measurement is bounded: three windows of about ``seconds / 3`` each (``--max-trials 3`` and a
stability threshold that accepts the first three windows), each stretched until a few requests
completed; a subprocess timeout bounds the whole run.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import tempfile
from importlib import metadata
from pathlib import Path

from splitspec.errors import ConfigError, SplitspecError
from splitspec.server import TritonServer, find_triton, server_env

#: Prompts perf_analyzer cycles through (code completions and a chat question), max_tokens 32.
PERF_PROMPTS: tuple[tuple[str, bool], ...] = (
    ("def fibonacci(n):", False),
    ("import os\n\ndef list_python_files(root):\n    \"\"\"Return every .py file under root.\"\"\"\n", False),
    ("class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n", False),
    ("def binary_search(items, target):\n    lo, hi = 0, len(items) - 1\n", False),
    ("How do I read a file line by line in Python?", True),
)
PERF_MAX_TOKENS = 32
#: Windows perf_analyzer measures (each seconds / MEASUREMENT_WINDOWS long).
MEASUREMENT_WINDOWS = 3
MAX_CONCURRENCY = 64
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
        cache_dir: where to make it (default ``<project>/.cache/perf_libs``, git-ignored).
    Raises:
        SplitspecError: a library is not in ``nvidia_pytriton.libs``.
    """
    libs = find_triton().libs_dir
    out = Path(cache_dir) if cache_dir else Path(__file__).resolve().parents[2] / ".cache" / "perf_libs"
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


def _parse_concurrency(value: str) -> tuple[str, int, int]:
    """Check ``N`` or ``start:end[:step]`` (1..MAX_CONCURRENCY, at most 8 levels).

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
    if not (1 <= start <= end <= MAX_CONCURRENCY) or step < 1:
        raise ConfigError(f"concurrency = {value!r}: need 1 <= start <= end <= {MAX_CONCURRENCY} and step >= 1")
    levels = len(range(start, end + 1, step))
    if levels > 8:
        raise ConfigError(f"concurrency = {value!r}: {levels} levels; at most 8 per run")
    return ":".join(map(str, nums)), levels, end


def _write_atomic(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_input_data(path: Path) -> Path:
    """Write perf_analyzer's ``--input-data`` JSON (one entry per prompt of :data:`PERF_PROMPTS`).

    Requests stream (``stream`` true: one response per engine cycle), as an interactive client would;
    perf_analyzer's latency is then the time to the final response.
    """
    data = {"data": [{"text_input": [prompt], "max_tokens": [PERF_MAX_TOKENS], "apply_chat_template": [chat],
                      "stream": [True]}
                     for prompt, chat in PERF_PROMPTS]}
    _write_atomic(path, json.dumps(data, indent=2) + "\n")
    return path


def perf_command(binary: Path, grpc_address: str, input_data: Path, csv_path: Path, seconds: float,
                 concurrency: str, max_concurrency: int = 1) -> list[str]:
    """The perf_analyzer command line (model ``ensemble``, gRPC streaming, bounded windows).

    Count windows: each of the three windows lasts ``seconds / 3`` (at least 0.5 s) and is
    stretched by perf_analyzer until ``2 × max_concurrency`` requests (at least 3) completed, so
    a slow generation (longer than a window) still gets measured instead of failing with
    "No valid requests recorded within time interval".
    """
    window_ms = max(500, int(seconds * 1000 / MEASUREMENT_WINDOWS))
    return [str(binary), "-m", "ensemble", "-i", "grpc", "--streaming", "-u", grpc_address,
            "--input-data", str(input_data), "--concurrency-range", concurrency,
            "--measurement-mode", "count_windows", "--measurement-request-count", str(max(3, 2 * max_concurrency)),
            "--measurement-interval", str(window_ms),
            "--max-trials", str(MEASUREMENT_WINDOWS), "--stability-percentage", "999",
            "-f", str(csv_path), "--verbose-csv"]


def run_perf(repo: Path, seconds: float = 5.0, concurrency: str = "1", out_dir: Path = Path("perf_results"),
             server: TritonServer | None = None) -> Path:
    """Start the server on ``repo``, run perf_analyzer against ``ensemble``, stop the server.

    Writes ``out_dir/perf_input.json`` (the prompts) and ``out_dir/perf_ensemble.csv``
    (perf_analyzer's ``-f`` report) and prints perf_analyzer's summary.

    Args:
        repo: the rendered model repository.
        seconds: measurement time per concurrency level, split over three windows (1..600 s).
        concurrency: ``N`` or ``start:end[:step]`` (perf_analyzer ``--concurrency-range``).
        out_dir: results folder (created).
        server: an already running server to measure instead (not stopped here).
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
    env = server_env(extra_lib_dirs=(perf_lib_dir(),))
    out_dir = Path(out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    input_data = write_input_data(out_dir / "perf_input.json")
    csv_path = out_dir / "perf_ensemble.csv"
    tmp_csv = out_dir / f".perf_ensemble.{os.getpid()}.csv"

    own = server is None
    srv = server or TritonServer(repo)
    if own:
        print(f"starting tritonserver on {srv.repo} ...", flush=True)
        srv.start()
        print(f"ready after {srv.startup_s:.1f} s", flush=True)
    try:
        cmd = perf_command(binary, srv.grpc_address, input_data, tmp_csv, float(seconds), conc, top)
        # per level: warm-up + 3 windows + a stable margin for slow requests at the window's edge
        timeout_s = levels * (float(seconds) * 2 + 60) + 30
        print("$ " + " ".join(cmd), flush=True)
        try:
            proc = subprocess.run(cmd, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                                  timeout=timeout_s)
        except subprocess.TimeoutExpired as e:
            out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            raise SplitspecError(f"perf_analyzer did not finish within {timeout_s:.0f} s:\n{out[-4000:]}") from None
        print(proc.stdout, flush=True)
        if proc.returncode != 0:
            raise SplitspecError(f"perf_analyzer exited with status {proc.returncode}:\n"
                                 f"{(proc.stdout + proc.stderr)[-4000:]}")
        if not tmp_csv.is_file():
            raise SplitspecError(f"perf_analyzer wrote no CSV ({tmp_csv})")
        os.replace(tmp_csv, csv_path)
    finally:
        tmp_csv.unlink(missing_ok=True)
        if own:
            srv.stop()
    print(f"perf_analyzer report: {csv_path}", flush=True)
    return csv_path
