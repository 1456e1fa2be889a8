"""Keeping the served pipeline up: ``splitspec serve``'s supervisor.

tritonserver alone turns several faults into silent outages: a Python backend stub that dies leaves its in-flight
requests hanging and the server and models "ready"; a dead engine process or worker unloads ``spec_decode`` while
``/v2/health/ready`` stays 200; a wedged server answers nothing. :class:`Supervisor` runs a
:class:`~splitspec.serving.tritonserver.TritonServer` and watches it from outside:

- every ``check_s`` whether each process of the pipeline seen at ready still lives
  (:mod:`splitspec.serving.process_tree`: tritonserver, each model's stub, the engine process, the target's workers),
  whether one has been stopped (``/proc`` state ``T``/``t``: SIGSTOP, a debugger) for ``stopped_s``, and whether the
  engine process's loop has beaten within ``stall_s`` (:mod:`splitspec.serving.heartbeat`: a cycle blocked in a
  collective by a stalled worker, or a wedged engine, stops the beats);
- every ``probe_s``, from a thread of its own, ``/v2/health/live`` (``live_timeout_s`` each) and the ensemble's
  readiness: ``live_failures`` probes in a row without an answer, or the models not ready, is a fault too.

On a fault it turns not-ready at once (its own endpoint, :mod:`splitspec.serving.health_endpoint`: the health metric
drops to 0 and stays exported), logs what died or stalled, kills the server's whole process group and every process
it watched (SIGKILL: a stopped process needs no SIGCONT for it; clients' connections drop:
gRPC UNAVAILABLE, HTTP a cut stream or the guard's 502; after an engine or worker death first ``error_grace_s`` for ``spec_decode``
to answer its requests with UNAVAILABLE itself), and starts it again on the same ports, the old log kept
(:func:`~splitspec.serving.server_log.rotate`). A fault now and then is always healed; a crash loop is bounded: a start
that fails, or a pipeline that fails again within ``stable_s`` of ready, counts as a failure in a row, each retried
after ``backoff_s`` doubling up to ``max_backoff_s``, and after ``max_restarts`` in a row it gives up
(:attr:`failed`) and ``splitspec serve`` exits with an error. ``max_restarts`` 0: never restart, the first fault is
given up at once.

:meth:`shutdown` is the graceful stop (SIGTERM / Ctrl-C): the front ends in :attr:`Supervisor.front_ends` (the
OpenAI-compatible API) refuse new requests, not-ready, the engine stops admitting (SIGUSR1 to the engine process),
in-flight requests get up to ``drain_s`` to finish, then the rest end with ``finish_reason`` ``"shutdown"`` (SIGTERM
to the engine process); the front ends get up to ``flush_s`` to pass those last responses on, and tritonserver stops
with nothing left in flight.

The supervising thread does not die silently: an error it did not expect while checking (a fault's check that
raised) is logged, one line a second at most for each kind of error
(:class:`~splitspec.serving.rate_limited_log.RateLimitedLog`), and the check retried at the next tick; one escaping
a recovery (the server half killed, half started) is logged and turns the supervisor :attr:`failed`, so ``splitspec
serve`` exits with an error for a service manager to restart it. A failed kill during a recovery is logged and the
server's process group killed regardless; a ``/proc`` entry that cannot be read (``EMFILE``) is no death
(:data:`~splitspec.serving.process_tree.UNKNOWN`).

The HTTP guard (:mod:`splitspec.serving.http_guard`) on the public HTTP port is the supervisor's, not each server's:
it forwards to the private port every restart keeps, answers 503 while the server is down, and passes the last
responses on before tritonserver stops (like a front end, within ``flush_s``). The probes ask tritonserver's private
port directly.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from pathlib import Path
from typing import Callable

import requests

from splitspec.errors import ConfigError, SplitspecError
from splitspec.serving.health_endpoint import HealthEndpoint
from splitspec.serving.heartbeat import heartbeat_path, stall
from splitspec.serving.http_guard import HttpGuard
from splitspec.serving.metrics import metric_value, parse_prometheus
from splitspec.serving.process_tree import STOPPED, UNKNOWN, Watched, watch
from splitspec.serving.rate_limited_log import RateLimitedLog
from splitspec.serving.tritonserver import LOCALHOST, TritonServer, free_ports

_CLOSE = {"Connection": "close"}
#: Roles whose death ``spec_decode`` notices itself, failing its requests with UNAVAILABLE before the kill.
ENGINE_ROLES = ("engine process", "target worker")
#: Default stall limit, seconds: the longest the engine loop may go without a heartbeat. Longer than any cycle after
#: the engine's warm-up (a key window's first CUDA-graph capture takes seconds; an unwarmed first compile took
#: 24–50 s on an H200), shorter than ``collective_timeout_s`` (300 s), after which a rank gives up by itself.
STALL_S = 60.0


class Supervisor:
    """Runs and heals a :class:`TritonServer` on ``repo``; a context manager (``with`` ends in :meth:`shutdown`).

    Ports of 0 are replaced by free ones once, then kept across restarts, tritonserver's private HTTP port too (the
    :class:`~splitspec.serving.http_guard.HttpGuard` on ``http_port``, :attr:`guard`, forwards there). ``say``: where its log lines go.
    ``admin_key``: passed to each :class:`TritonServer` (the control APIs' key; None: they are refused).
    ``stall_s``: the stall limit (:data:`STALL_S`); ``stopped_s``: how long a process may stay stopped before that is
    a fault (long enough for a sampling profiler's pause, short against a SIGSTOP: 0.5 s).
    ``max_restarts``: failures in a row given up after (≥ 0; 0: never restart). :attr:`front_ends`: servers in this
    process that answer clients through tritonserver, each with ``drain()`` (refuse new requests) and
    ``wait_idle(timeout_s)`` (wait for those in flight); :meth:`shutdown` drains them first and waits for them (up to
    ``flush_s``) before tritonserver stops.
    """

    def __init__(self, repo: Path, *, http_port: int = 0, grpc_port: int = 0, metrics_port: int = 0,
                 health_port: int = 0, exit_timeout_s: int = 30, startup_timeout_s: float = 600.0,
                 drain_s: float = 10.0, check_s: float = 0.1, probe_s: float = 0.5, live_timeout_s: float = 1.5,
                 live_failures: int = 3, error_grace_s: float = 0.5, backoff_s: float = 1.0,
                 max_backoff_s: float = 30.0, max_restarts: int = 5, stable_s: float = 60.0,
                 stall_s: float = STALL_S, stopped_s: float = 0.5, admin_key: str | None = None, flush_s: float = 5.0,
                 say: Callable[[str], None] = lambda line: print(line, flush=True)):
        if max_restarts < 0:
            raise ConfigError(f"--restart-limit = {max_restarts}: expected 0 (never restart) or more")
        picked = iter(free_ports(5))
        self.ports = {"http_port": http_port or next(picked), "triton_http_port": next(picked),
                      "grpc_port": grpc_port or next(picked), "metrics_port": metrics_port or next(picked)}
        self.health_port = health_port or next(picked)
        self.repo, self.exit_timeout_s, self.startup_timeout_s = repo, exit_timeout_s, startup_timeout_s
        self.drain_s, self.check_s, self.probe_s = drain_s, check_s, probe_s
        self.live_timeout_s, self.live_failures, self.error_grace_s = live_timeout_s, live_failures, error_grace_s
        self.backoff_s, self.max_backoff_s, self.max_restarts, self.stable_s = backoff_s, max_backoff_s, max_restarts, stable_s
        self.stall_s, self.stopped_s = stall_s, stopped_s
        self._stopped_since: dict[int, float] = {}  # pid -> time.monotonic() it was first seen stopped
        self._failing = 0  # failures in a row: starts that failed, or a pipeline failed again within stable_s of ready
        self._ready_at = float("-inf")  # time.monotonic() of the last ready
        self.say = say
        self.admin_key, self.flush_s = admin_key, flush_s
        self.front_ends: list = []
        self.srv: TritonServer | None = None
        self.state = "starting"  # serving | restarting | failed | stopping | stopped
        self.watched: list[Watched] = []
        self.restarts: list[dict] = []  # per restart: fault, noticed (time.time()), recovery_s
        self._lock = threading.Lock()
        self._generation = 0  # of the server the probes speak of
        self._probe_misses = 0
        self._unready = 0
        self._stop = threading.Event()
        self.endpoint: HealthEndpoint | None = None
        self.guard: HttpGuard | None = None
        self._threads: list[threading.Thread] = []

    # -- life cycle --------------------------------------------------------------------------
    def start(self) -> "Supervisor":
        """Start the health endpoint, the HTTP guard, the server (a failure here raises: nothing is retried before the
        first ready) and the watching threads."""
        self.endpoint = HealthEndpoint(LOCALHOST, self.health_port, self._health)
        try:
            self.guard = HttpGuard.for_repo(self.repo, self.ports["http_port"], self.ports["triton_http_port"],
                                            LOCALHOST).start()
            self._start_server()
        except BaseException:
            if self.guard is not None:
                self.guard.stop()
            self.endpoint.close()
            raise
        for name, fn in (("splitspec-supervisor", self._watch), ("splitspec-prober", self._probe)):
            t = threading.Thread(target=fn, name=name, daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def _start_server(self) -> None:
        srv = TritonServer(self.repo, **self.ports, exit_timeout_s=self.exit_timeout_s, guard=False,
                           startup_timeout_s=self.startup_timeout_s, admin_key=self.admin_key)
        if self._stop.is_set():
            raise SplitspecError("the supervisor is stopping")
        self.srv = srv
        srv.start()
        if self._stop.is_set():  # shutdown() came while this one started: it may have missed it
            srv.stop()
            raise SplitspecError("the supervisor is stopping")
        watched = watch(srv.pid)
        with self._lock:
            self.watched, self._probe_misses, self._unready = watched, 0, 0
            self._stopped_since = {}
            self._generation += 1
            self._ready_at = time.monotonic()
            if self.state in ("starting", "restarting"):
                self.state = "serving"

    def __enter__(self) -> "Supervisor":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.shutdown()

    @property
    def failed(self) -> bool:
        """True once it gave up restarting."""
        return self.state == "failed"

    @property
    def health_url(self) -> str:
        return f"http://{LOCALHOST}:{self.health_port}"

    def _health(self) -> tuple[bool, bool, dict[str, float]]:
        ready = self.state == "serving" and self._probe_misses == 0 and self._unready == 0
        values = {"splitspec_pipeline_healthy": 1.0 if ready else 0.0,
                  "splitspec_pipeline_restarts_total": float(len(self.restarts)),
                  "splitspec_pipeline_last_recovery_seconds": self.restarts[-1]["recovery_s"] if self.restarts else 0.0}
        return ready, self.state != "failed", values

    # -- noticing ----------------------------------------------------------------------------
    def _fault(self) -> tuple[str, float] | None:
        """What went wrong with the running server, and the seconds ``spec_decode`` gets to fail its requests with
        UNAVAILABLE itself before the kill (``error_grace_s`` after an engine or worker death, else 0); or None."""
        srv = self.srv
        if srv is not None and not srv.is_running():
            return f"tritonserver (pid {srv.pid}) exited with status {srv.proc.returncode}", 0.0
        now, run_dir = time.monotonic(), getattr(srv, "run_dir", None)
        for w in self.watched:
            state = w.state()
            if state in (None, "Z", "X"):
                return f"{w} died", self.error_grace_s if w.role.startswith(ENGINE_ROLES) else 0.0
            if state in STOPPED:
                since = self._stopped_since.setdefault(w.pid, now)
                if now - since >= self.stopped_s:
                    return f"{w} is stopped (/proc state {state} for {now - since:.1f} s: SIGSTOP, or a debugger)", 0.0
            elif state != UNKNOWN:  # not read this time: neither stopped nor running is known
                self._stopped_since.pop(w.pid, None)
            if w.role == "engine process" and run_dir is not None:
                why = stall(heartbeat_path(run_dir, w.pid), self.stall_s, now)
                if why is not None:
                    return f"{w} stalled: {why}", 0.0
        if self._probe_misses >= self.live_failures:
            return (f"tritonserver (pid {srv.pid}) is wedged: {self._probe_misses} liveness probes in a row got no "
                    f"answer within {self.live_timeout_s:g} s"), 0.0
        if self._unready >= 2:
            return "tritonserver is live but the ensemble is not ready (a model unloaded itself)", 0.0
        return None

    def _watch(self) -> None:
        check_failed = RateLimitedLog(self.say)  # a check that raised is retried every tick: said once a second
        try:
            self._watch_with(check_failed)
        finally:
            check_failed.flush()  # the failures it left out and had not said yet

    def _watch_with(self, check_failed: RateLimitedLog) -> None:
        while not self._stop.wait(self.check_s):
            if self.state != "serving":
                continue
            try:
                fault = self._fault()
            except Exception as e:  # retried at the next tick
                check_failed.say(f"splitspec serve: checking the pipeline failed ({type(e).__name__}: {e}); retrying",
                                 key=type(e).__name__)  # one line a second per kind of failure, whatever its text
                continue
            if fault is None:
                continue
            try:
                self._recover(*fault)
            except Exception as e:  # a half-done recovery cannot be trusted: give up, so serve exits with an error
                with self._lock:
                    self.state = "failed"
                self.say(f"splitspec serve: recovering from '{fault[0]}' failed ({type(e).__name__}: {e}); giving up")
                return

    def _probe(self) -> None:
        with requests.Session() as s:
            s.trust_env = False
            while not self._stop.wait(self.probe_s):
                gen, srv = self._generation, self.srv
                if self.state != "serving" or srv is None:
                    continue
                try:
                    live = s.get(f"{srv.triton_http_url}/v2/health/live", headers=_CLOSE, timeout=self.live_timeout_s).ok
                    ready = live and s.get(f"{srv.triton_http_url}/v2/models/ensemble/ready", headers=_CLOSE,
                                           timeout=self.live_timeout_s).ok
                except requests.RequestException:
                    live = ready = False
                with self._lock:
                    if gen != self._generation or self.state != "serving":
                        continue  # the server this probe spoke of was replaced meanwhile
                    self._probe_misses = 0 if live else self._probe_misses + 1
                    self._unready = 0 if ready or not live else self._unready + 1

    # -- healing -----------------------------------------------------------------------------
    def _recover(self, fault: str, grace_s: float = 0.0) -> None:
        noticed, t0 = time.time(), time.monotonic()
        with self._lock:
            if self.state != "serving":
                return
            self.state = "restarting"
        # a crash loop, not a fault now and then: the pipeline failed again within stable_s of being ready
        self._failing = self._failing + 1 if t0 - self._ready_at < self.stable_s else 0
        self.say(f"splitspec serve: {fault}; the pipeline is not ready; failing what was in flight"
                 + (" and restarting it" if self.max_restarts else " (restart limit 0: not restarting)")
                 + (f" (failed again {t0 - self._ready_at:.0f} s after ready: {self._failing} in a row, at most "
                    f"{self.max_restarts})" if self._failing else ""))
        time.sleep(grace_s)  # after an engine or worker death spec_decode answers its open requests meanwhile
        old = self.srv
        try:
            old.kill()
        except Exception as e:  # EMFILE reading its log, say: its process group is killed regardless
            self.say(f"splitspec serve: stopping tritonserver (pid {old.pid}) failed ({type(e).__name__}: {e}); "
                     "killing its process group")
            with contextlib.suppress(OSError):
                os.killpg(old.pid, signal.SIGKILL)
        for w in self.watched:  # any that left the server's process group, stopped ones too
            w.kill()
        self.say(f"splitspec serve: tritonserver stopped; its log is kept as {old.log_path.name}.1 once it restarts")
        while self._failing < self.max_restarts and not self._stop.is_set():
            if self._failing:  # back-off: 1, 2, 4 ... s before the next try of a crash loop
                self._stop.wait(min(self.backoff_s * 2 ** (self._failing - 1), self.max_backoff_s))
            try:
                self._start_server()
            except (SplitspecError, OSError) as e:  # OSError: EMFILE starting it, say
                self._failing += 1
                self.say(f"splitspec serve: restart failed ({self._failing} in a row): {str(e).splitlines()[0]}")
                continue
            took = time.monotonic() - t0
            self.restarts.append({"fault": fault, "noticed": noticed, "recovery_s": took})
            self.say(f"splitspec serve: ready again {took:.1f} s after the fault ({len(self.restarts)} restart(s) so far)")
            return
        if self._stop.is_set():
            return
        with self._lock:
            self.state = "failed"
        if not self.max_restarts:
            self.say(f"splitspec serve: giving up at the first fault (restart limit 0): {fault}")
            return
        self.say(f"splitspec serve: giving up after {self._failing} failures in a row (a start that failed, or a "
                 f"pipeline that failed again within {self.stable_s:g} s of ready); the last fault: {fault}")

    # -- stopping ----------------------------------------------------------------------------
    def in_flight(self) -> float | None:
        """Requests the engine holds (active + queued), from tritonserver's metrics; None when they cannot be read."""
        try:
            r = requests.get(self.srv.metrics_url, headers=_CLOSE, timeout=2)
            m = parse_prometheus(r.text)
        except (requests.RequestException, AttributeError):
            return None
        return metric_value(m, "splitspec_active_sequences") + metric_value(m, "splitspec_queued_requests")

    def _signal_engines(self, sig: int) -> None:
        for w in self.watched:
            if w.role == "engine process" and w.alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(w.pid, sig)

    def _wait_drained(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            n = self.in_flight()
            if not n:
                return
            time.sleep(0.1)

    def shutdown(self) -> None:
        """Graceful stop (module docstring): within ``drain_s`` plus a cycle, ``flush_s`` at most for the front ends
        and tritonserver's own stop. A second Ctrl-C (KeyboardInterrupt) meanwhile kills the server instead. Safe to
        call twice."""
        if self.state in ("stopping", "stopped"):
            return
        t0, marks = time.monotonic(), []
        for front in self.front_ends:  # before not-ready: a client that sees not-ready is refused by them too
            front.drain()
        with self._lock:
            was, self.state = self.state, "stopping"
        self._stop.set()
        for t in self._threads:
            t.join(timeout=self.live_timeout_s + 1)
        try:
            if was == "serving" and self.srv is not None and self.srv.is_running():
                self.say(f"splitspec serve: stopping: not admitting new requests; {self.drain_s:g} s for those in flight")
                self._signal_engines(signal.SIGUSR1)
                self._wait_drained(self.drain_s)
                self._signal_engines(signal.SIGTERM)  # the rest end now, with finish_reason "shutdown"
                self._wait_drained(5.0)
                marks.append(f"engine drained after {time.monotonic() - t0:.1f} s")
                passing_on = [*self.front_ends, *([self.guard] if self.guard is not None else [])]
                for front in passing_on:  # their clients get those final responses before tritonserver stops
                    if left := front.wait_idle(self.flush_s):
                        self.say(f"splitspec serve: {left} request(s) of a front end still open after "
                                 f"{self.flush_s:g} s; stopping anyway")
                if passing_on:
                    marks.append(f"front ends done after {time.monotonic() - t0:.1f} s")
            self._stop_guard()  # its idle keep-alive clients go now; it holds no connection to tritonserver then
            if self.srv is not None:
                self.srv.stop()
                if marks:
                    self.say(f"splitspec serve: stopped after {time.monotonic() - t0:.1f} s ({', '.join(marks)})")
        except KeyboardInterrupt:
            if self.srv is not None:
                self.srv.kill()
            raise
        finally:
            self.state = "stopped"
            self._stop_guard()
            if self.endpoint is not None:
                self.endpoint.close()

    def _stop_guard(self) -> None:
        if self.guard is not None:
            self.guard.stop()
            self.guard = None
