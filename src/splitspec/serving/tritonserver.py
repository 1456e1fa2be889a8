"""Running ``tritonserver`` (from ``nvidia-pytriton``, :mod:`splitspec.serving.triton_install`) on our model
repository.

:class:`TritonServer` starts ``tritonserver`` in its own process group, waits until
``/v2/health/ready`` answers, and stops it (SIGINT, then SIGKILL of the whole group), so that
the model's stubs and the tensor-parallel worker processes the ``spec_decode`` model starts
never outlive it. tritonserver's own HTTP listens on a private port; clients reach it through the HTTP guard
(:mod:`splitspec.serving.http_guard`) on the public one. ``splitspec serve`` runs it under a supervisor
(:mod:`splitspec.serving.serve`), which keeps one guard across restarts.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import requests

from splitspec.errors import ConfigError, SplitspecError
from splitspec.serving.access import SERVER_UMASK, remove_shm_regions, restricted_api_args
from splitspec.serving.http_guard import HttpGuard
from splitspec.serving.repo import MODELS
from splitspec.serving.seccomp import filter_installed, private_fchmod
from splitspec.serving.server_limits import server_stack_bytes, stack_limit
from splitspec.serving.server_log import EXIT_GAVE_UP, LogWatch, rotate, start_failure, tail, unloading
from splitspec.serving.triton_install import BACKENDS_DIRNAME, TritonInstall, find_triton, prepare_backend_dir, server_env
from splitspec.settings import RUN_DIR_ENV

LOCALHOST = "127.0.0.1"
#: Header for our one-off HTTP requests: a kept-alive idle connection delays server shutdown by
#: the whole ``--exit-timeout-secs``.
_CLOSE = {"Connection": "close"}

#: Linux's range of ephemeral ports (outgoing connections and port-0 binds draw from it).
EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
#: Lowest port :func:`free_ports` picks outside the ephemeral range.
LOWEST_PICKED_PORT = 20000


def free_ports(n: int = 1) -> list[int]:
    """``n`` distinct TCP ports on 127.0.0.1 that are free right now.

    Where the kernel's ephemeral range is known (Linux: ``/proc/sys/net/ipv4/ip_local_port_range``), they are
    picked at random below it, from :data:`LOWEST_PICKED_PORT`: a port from that range can be handed to
    another socket — an outgoing connection, the engine's TCPStore or gloo sockets binding port 0 — in the
    seconds before tritonserver, which binds its ports only after loading its models, takes it. Elsewhere
    the OS picks (port 0).
    """
    try:
        low = int(EPHEMERAL_RANGE_FILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 0
    candidates = random.sample(range(LOWEST_PICKED_PORT, low), min(200, low - LOWEST_PICKED_PORT)) if low > LOWEST_PICKED_PORT + n else []
    with contextlib.ExitStack() as stack:  # each socket stays bound until all are picked: distinct ports
        ports: list[int] = []
        for port in [*candidates, *[0] * n]:
            if len(ports) == n:
                break
            s = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            try:
                s.bind((LOCALHOST, port))
            except OSError:
                continue
            ports.append(s.getsockname()[1])
        return ports


def check_port_free(port: int, what: str) -> None:
    """Raise ConfigError naming ``what`` when ``port`` cannot be bound on 127.0.0.1."""
    if not 0 < port < 65536:
        raise ConfigError(f"{what} = {port}: expected a TCP port in 1..65535")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        # as a server binds: a recently closed server's TIME_WAIT connections do not block the port
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((LOCALHOST, port))
        except OSError as e:
            raise ConfigError(f"{what} = {port}: port is in use on {LOCALHOST} ({e.strerror}); "
                              f"stop the other server or pick another port") from None


def check_repo(repo: Path) -> Path:
    """Check that ``repo`` is a rendered model repository; return it resolved.

    Raises:
        ConfigError: the folder or a model's ``config.pbtxt`` is missing (run ``splitspec repo``).
    """
    repo = Path(repo).resolve()
    if not repo.is_dir():
        raise ConfigError(f"{repo}: model repository folder not found (run 'make repo')")
    for m in MODELS:
        cfg = repo / m / "config.pbtxt"
        if not cfg.is_file():
            raise ConfigError(f"{cfg}: missing; render the repository first ('splitspec repo' / 'make repo')")
    return repo


class TritonServer:
    """A ``tritonserver`` process serving a model repository on 127.0.0.1; a context manager.

    Ports of 0 are replaced by free ones. Clients use ``http_port`` (:attr:`http_url`, :attr:`generate_url`, ...):
    there the HTTP guard (:class:`~splitspec.serving.http_guard.HttpGuard`) forwards to tritonserver's own HTTP on
    ``triton_http_port`` (:attr:`triton_http_url`: for health probes of this project, not for clients). The server runs in its own process group, with umask 077 and the seccomp
    filter of :mod:`splitspec.serving.seccomp` (its shared-memory regions private from creation); its log (mode 0600)
    goes to ``log_path`` (default ``<repo>/_backends/tritonserver.<http_port>.log``). ``run_dir``: a private folder
    (mode 0700) made for each start and removed at its stop, named to the server's processes as ``SPLITSPEC_RUN_DIR``
    (the engine process's heartbeat goes there: :mod:`splitspec.serving.heartbeat`). The control APIs (model
    repository, shared memory, logging, trace) answer only requests carrying ``admin_key``
    (:mod:`splitspec.serving.access`).

    Example::

        with TritonServer(Path("triton_repo"), http_port=0, grpc_port=0, metrics_port=0) as srv:
            requests.post(srv.generate_url, json={"text_input": "hi", "max_tokens": 8})

    Args:
        repo: the rendered model repository.
        http_port, grpc_port, metrics_port: TCP ports (0: pick a free one); ``http_port`` is the guard's.
        triton_http_port: tritonserver's own HTTP port, on loopback (0: pick a free one).
        guard: run the HTTP guard on ``http_port`` with this server, started before it and stopped before it
            (False: the caller runs one there, as the supervisor does across restarts).
        log_path: where the server's stdout/stderr go.
        startup_timeout_s: seconds to wait for ``/v2/health/ready`` (model loading included).
        exit_timeout_s: tritonserver ``--exit-timeout-secs``: after SIGINT, how long it waits for
            in-flight requests and open client connections before unloading the models.
        stop_timeout_s: seconds to wait after SIGINT before SIGKILL (default: exit_timeout_s + 30); the kill comes
            sooner when the server gives up on requests still in flight at its exit timeout (:meth:`stop`).
        log_verbose: tritonserver ``--log-verbose`` level.
        extra_args: further tritonserver arguments.
        admin_key: the key that opens the control APIs (None: they are refused to every request).

    Raises:
        ConfigError: the repository is not rendered, or ``admin_key`` is not a valid key.
    """

    def __init__(self, repo: Path, *, http_port: int = 0, grpc_port: int = 0, metrics_port: int = 0,
                 log_path: Path | None = None, startup_timeout_s: float = 600.0, exit_timeout_s: int = 30,
                 stop_timeout_s: float | None = None,
                 log_verbose: int = 0, extra_args: tuple[str, ...] = (), admin_key: str | None = None,
                 triton_http_port: int = 0, guard: bool = True):
        self.repo = check_repo(repo)
        self.restrict_args = restricted_api_args(admin_key)
        picked = iter(free_ports(4))  # distinct, also from each other
        self.http_port = http_port or next(picked)
        self.triton_http_port = triton_http_port or next(picked)
        self.own_guard = guard
        self.guard: HttpGuard | None = None
        self.grpc_port = grpc_port or next(picked)
        self.metrics_port = metrics_port or next(picked)
        default_log = self.repo / BACKENDS_DIRNAME / f"tritonserver.{self.http_port}.log"
        self.log_path = Path(log_path) if log_path else default_log
        self.startup_timeout_s = startup_timeout_s
        self.exit_timeout_s = int(exit_timeout_s)
        self.stop_timeout_s = stop_timeout_s if stop_timeout_s is not None else self.exit_timeout_s + 30.0
        self.log_verbose = log_verbose
        #: the Python backend's shared-memory regions (/dev/shm) are named from this, one server's own
        self.shm_prefix = f"splitspec_{os.getpid()}_{self.http_port}_"
        self.extra_args = tuple(extra_args)
        self.proc: subprocess.Popen | None = None
        self.startup_s: float | None = None
        self.run_dir: Path | None = None
        self.private_fchmod: bool | None = None  # whether the seccomp filter is in place (known once started)

    # -- endpoints --------------------------------------------------------------------------
    @property
    def http_url(self) -> str:
        """``http://127.0.0.1:<http_port>``: the HTTP guard, where clients send their requests."""
        return f"http://{LOCALHOST}:{self.http_port}"

    @property
    def triton_http_url(self) -> str:
        """``http://127.0.0.1:<triton_http_port>``: tritonserver's own HTTP, unguarded (this project's probes)."""
        return f"http://{LOCALHOST}:{self.triton_http_port}"

    @property
    def generate_url(self) -> str:
        """HTTP generate endpoint of the ensemble."""
        return f"{self.http_url}/v2/models/ensemble/generate"

    @property
    def generate_stream_url(self) -> str:
        """HTTP generate_stream endpoint of the ensemble (server-sent events)."""
        return f"{self.http_url}/v2/models/ensemble/generate_stream"

    def model_url(self, model: str = "ensemble") -> str:
        """``http://127.0.0.1:<http_port>/v2/models/<model>`` (append ``/ready``, ``/stats``, ``/config``)."""
        return f"{self.http_url}/v2/models/{model}"

    @property
    def grpc_address(self) -> str:
        """``127.0.0.1:<grpc_port>`` (tritonclient.grpc ``url``)."""
        return f"{LOCALHOST}:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        """Prometheus metrics endpoint."""
        return f"http://{LOCALHOST}:{self.metrics_port}/metrics"

    @property
    def pid(self) -> int | None:
        """Process id of ``tritonserver`` (also its process group id), or None when not started."""
        return self.proc.pid if self.proc else None

    def command(self, backend_dir: Path, install: TritonInstall) -> list[str]:
        """The tritonserver command line."""
        return [
            str(install.server_bin),
            "--model-repository", str(self.repo),
            "--backend-directory", str(backend_dir),
            # explicit: load exactly our models (the repository also holds _backends/, not a model)
            "--model-control-mode", "explicit", *[f"--load-model={m}" for m in MODELS],
            "--http-address", LOCALHOST, "--http-port", str(self.triton_http_port),
            "--grpc-address", LOCALHOST, "--grpc-port", str(self.grpc_port),
            "--allow-metrics", "true", "--metrics-address", LOCALHOST, "--metrics-port", str(self.metrics_port),
            "--strict-readiness", "true", "--exit-on-error", "true",
            "--exit-timeout-secs", str(self.exit_timeout_s),
            "--backend-config", f"python,shm-region-prefix-name={self.shm_prefix}",
            *self.restrict_args,
            "--log-verbose", str(self.log_verbose),
            *self.extra_args,
        ]

    # -- life cycle -------------------------------------------------------------------------
    def start(self) -> "TritonServer":
        """Start the HTTP guard (when it is this server's own), then the server, and wait until it is ready.

        Raises:
            ConfigError: a port is taken.
            SplitspecError: the server exited or was not ready within ``startup_timeout_s``
                (the message holds the tail of its log).
        """
        if self.proc is not None:
            raise SplitspecError("TritonServer.start: already started")
        ports = ((self.http_port, "http_port"),) if self.own_guard else ()
        for port, what in (*ports, (self.triton_http_port, "triton_http_port"), (self.grpc_port, "grpc_port"),
                           (self.metrics_port, "metrics_port")):
            check_port_free(port, what)
        if self.own_guard:
            self.guard = HttpGuard.for_repo(self.repo, self.http_port, self.triton_http_port, LOCALHOST).start()
        try:
            self._start_server()
        except BaseException:
            self.stop()
            raise
        return self

    def _start_server(self) -> None:
        install = find_triton()
        backend_dir = prepare_backend_dir(self.repo, install)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        rotate(self.log_path)  # an earlier server's log (e.g. one that failed) is kept, not truncated
        t0 = time.monotonic()
        self.run_dir = Path(tempfile.mkdtemp(prefix=f"splitspec-{self.http_port}-"))  # mode 0700
        env = dict(server_env(install), **{RUN_DIR_ENV: str(self.run_dir)})
        log_fd = os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # it may hold request text
        with open(log_fd, "wb") as log, stack_limit(server_stack_bytes(self.repo)):  # server_limits.py
            self.proc = subprocess.Popen(self.command(backend_dir, install), stdin=subprocess.DEVNULL,
                                         stdout=log, stderr=subprocess.STDOUT, env=env, cwd=str(self.repo),
                                         start_new_session=True, umask=SERVER_UMASK, preexec_fn=private_fchmod())
        self.private_fchmod = filter_installed(self.proc.pid)
        self._wait_ready(t0)
        self.startup_s = time.monotonic() - t0

    def _wait_ready(self, t0: float) -> None:
        url = f"{self.triton_http_url}/v2/health/ready"
        with requests.Session() as s:
            s.trust_env = False  # localhost only: never through a proxy
            while True:
                code = self.proc.poll()
                if code is not None:
                    raise SplitspecError(start_failure(f"tritonserver exited with status {code} while starting",
                                                        self.log_path))
                try:
                    if s.get(url, timeout=2, headers=_CLOSE).status_code == 200:
                        return
                except requests.RequestException:
                    pass
                if time.monotonic() - t0 > self.startup_timeout_s:
                    raise SplitspecError(start_failure(f"tritonserver not ready after {self.startup_timeout_s:.0f} s",
                                                        self.log_path))
                time.sleep(0.25)

    def is_running(self) -> bool:
        """True while the server process is alive."""
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> int | None:
        """Stop this server's own HTTP guard (requests in flight through it get ``exit_timeout_s``, as tritonserver
        gives them, 0 s from :meth:`kill`; idle clients are closed at once), then the server: SIGINT (models unload;
        ``spec_decode`` stops its workers) — after ``spec_decode``'s own unload, should it be unloading itself after
        an engine failure (at most ``exit_timeout_s``: :func:`splitspec.serving.server_log.unloading`) —, then SIGKILL after
        ``stop_timeout_s``, or 1 s after the log says the server gave up on requests still in flight at its exit
        timeout (:data:`EXIT_GAVE_UP`: tritonserver 2.51 then crashes in its exit and hangs instead of exiting);
        finally SIGKILL whatever is left in its process group. Then the Python backend's shared-memory regions of this
        server (``/dev/shm/<shm_prefix>*``) that are left, after a kill by this method or by anyone, are removed.

        Returns:
            the server's exit status (None when it was never started). Safe to call twice.
        """
        if self.guard is not None:
            self.guard.stop(grace_s=min(self.exit_timeout_s, self.stop_timeout_s))
            self.guard = None
        if self.proc is None:
            return None
        pgid = self.proc.pid
        try:
            if self.proc.poll() is None:
                settle = time.monotonic() + self.exit_timeout_s
                while unloading(self.log_path) and self.proc.poll() is None and time.monotonic() < settle:
                    time.sleep(0.1)
                log = LogWatch(self.log_path)  # from before the SIGINT on
                try:
                    with contextlib.suppress(ProcessLookupError):
                        self.proc.send_signal(signal.SIGINT)
                    deadline, gave_up = time.monotonic() + self.stop_timeout_s, False
                    while self.proc.poll() is None and time.monotonic() < deadline and not gave_up:
                        with contextlib.suppress(subprocess.TimeoutExpired):
                            self.proc.wait(timeout=0.25)
                        gave_up = log.says(EXIT_GAVE_UP)
                finally:
                    log.close()
                if gave_up:
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        self.proc.wait(timeout=1.0)  # in case it does exit after all
                if self.proc.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(pgid, signal.SIGKILL)
                    self.proc.wait()
        except KeyboardInterrupt:  # a second Ctrl-C: do not wait for a graceful unload
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
            self.proc.wait()
            raise
        finally:
            # stubs or workers that outlived the server (its process group keeps their id)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, signal.SIGKILL)
            remove_shm_regions(self.shm_prefix)  # a killed Python backend leaves its regions behind
            if self.run_dir is not None:
                shutil.rmtree(self.run_dir, ignore_errors=True)
        return self.proc.returncode

    def kill(self) -> int | None:
        """Stop at once, for a server that cannot be trusted to stop itself (a dead stub, a wedged server): SIGKILL
        of its whole process group after the SIGINT, and its shared-memory regions removed (:meth:`stop`). Its
        clients' connections drop (gRPC: UNAVAILABLE)."""
        self.stop_timeout_s = 0.0
        return self.stop()

    def __enter__(self) -> "TritonServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def log_tail(self, n_bytes: int = 6000) -> str:
        """The last ``n_bytes`` of the server log."""
        return tail(self.log_path, n_bytes)
