"""The supervisor's pieces without a server: telling a stopped process from a running one, faults healed and a crash
loop given up, the engine loop beating only between cycles, keeping old logs, the health endpoint, the request
deadline read from the inputs, shutdown's order, and faults of the machine (no file descriptors) said, not raised.
The process tree and the heartbeat file have their own tests: test_process_tree.py, test_heartbeat.py."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import requests

from splitspec.errors import ConfigError, SplitspecError
from splitspec.runtime.loop import EngineLoop
from splitspec.serving.health_endpoint import HealthEndpoint
from splitspec.serving.heartbeat import Heartbeat, heartbeat_path, read, stall
from splitspec.serving.metrics import metric_value, parse_prometheus
from splitspec.serving.access import remove_shm_regions
from splitspec.serving.process_tree import UNKNOWN, Watched
from splitspec.serving.requests import parse_request, request_timeout
from splitspec.serving.server_log import rotate
from splitspec.serving.supervisor import Supervisor


def test_rotate_keeps_the_previous_logs_and_drops_the_oldest(tmp_path):
    log = tmp_path / "tritonserver.8000.log"
    assert rotate(log) is None  # nothing to keep
    for i in range(7):
        log.write_text(f"run {i}\n")
        assert rotate(log, keep=3) == log.with_name(log.name + ".1")
    assert not log.exists()
    assert [log.with_name(f"{log.name}.{i}").read_text() for i in (1, 2, 3)] == ["run 6\n", "run 5\n", "run 4\n"]
    assert not log.with_name(log.name + ".4").exists()


def test_health_endpoint_serves_probes_and_metrics():
    state = {"ready": True}
    ep = HealthEndpoint("127.0.0.1", 0, lambda: (state["ready"], True, {"splitspec_pipeline_healthy": float(state["ready"]),
                                                                        "splitspec_pipeline_restarts_total": 2}))
    try:
        base = f"http://127.0.0.1:{ep.port}"
        assert requests.get(base + "/v2/health/ready", timeout=5).status_code == 200
        state["ready"] = False
        assert requests.get(base + "/v2/health/ready", timeout=5).status_code == 503
        assert requests.get(base + "/v2/health/live", timeout=5).status_code == 200
        m = parse_prometheus(requests.get(base + "/metrics", timeout=5).text)
        assert ("splitspec_pipeline_healthy", frozenset()) in m and metric_value(m, "splitspec_pipeline_healthy") == 0
        assert metric_value(m, "splitspec_pipeline_restarts_total") == 2
        assert requests.get(base + "/other", timeout=5).status_code == 404
    finally:
        ep.close()


def _inputs(**values):
    return {"input_ids": np.array([[5, 6]]), "max_tokens": np.array([[8]]), **{k: np.array([[v]]) for k, v in values.items()}}


def test_request_deadline_is_the_clients_within_the_servers_cap():
    assert request_timeout({}, 600.0) == 600.0 and request_timeout({}, None) is None
    assert request_timeout({"timeout_ms": np.array([[1500]])}, 600.0) == 1.5
    assert request_timeout({"timeout_ms": np.array([[10**9]])}, 600.0) == 600.0
    assert parse_request(_inputs(timeout_ms=250), 64, 600.0)[0].timeout_s == 0.25
    assert parse_request(_inputs(), 64, 30.0)[0].timeout_s == 30.0
    for bad in (0, -5, 1.5):
        with pytest.raises(ConfigError, match="timeout_ms"):
            request_timeout({"timeout_ms": np.array([[bad]])}, 600.0)


class _FakeServer:
    log_path, pid, run_dir = Path("tritonserver.8000.log"), 1, None

    def kill(self):
        self.killed = True

    def is_running(self):
        return True


@pytest.mark.parametrize("starts_ok, stable", [(True, True), (True, False), (False, True)])
def test_a_fault_now_and_then_is_healed_and_a_crash_loop_given_up(starts_ok, stable):
    lines: list[str] = []
    sup = Supervisor(Path("unused"), backoff_s=0.001, max_restarts=3, stable_s=60.0, say=lines.append)
    sup.endpoint = None

    def start():
        if not starts_ok:
            raise SplitspecError("tritonserver exited with status 1 while starting")
        sup.state, sup._ready_at = "serving", time.monotonic() - (3600 if stable else 0)

    sup._start_server = start
    sup.state, sup.srv, sup._ready_at = "serving", _FakeServer(), time.monotonic() - (3600 if stable else 0)
    for _ in range(5):  # five faults, each after the previous restart
        sup._recover("the spec_decode stub (pid 7) died")
        if sup.failed:
            break
    if starts_ok and stable:
        assert not sup.failed and len(sup.restarts) == 5, lines
    else:  # failing again right after ready, or never starting: a crash loop, given up after 3 in a row
        assert sup.failed and "giving up after 3 failures in a row" in lines[-1], lines


# ---------------------------------------------------------------------------------------------
# Stalls: a stopped process, an engine loop without a heartbeat
# ---------------------------------------------------------------------------------------------


def test_a_stopped_process_is_a_fault_after_stopped_s_and_is_killed_stopped():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        sup = Supervisor(Path("unused"), stopped_s=0.2)
        w = Watched.of(child.pid, "target worker rank 1")
        sup.watched = [w]
        assert sup._fault() is None and not w.stopped()
        os.kill(child.pid, signal.SIGSTOP)
        while w.state() not in ("T", "t"):
            time.sleep(0.01)
        assert w.stopped() and w.alive()
        assert sup._fault() is None  # stopped, but not for stopped_s yet (a profiler's pause)
        time.sleep(0.25)
        fault, grace_s = sup._fault()
        assert fault.startswith(f"the target worker rank 1 (pid {child.pid}) is stopped (/proc state T for 0.")
        assert grace_s == 0.0  # it cannot answer anything: the kill comes at once
        os.kill(child.pid, signal.SIGCONT)
        while w.stopped():
            time.sleep(0.01)
        assert sup._fault() is None and not sup._stopped_since  # running again: the count starts over
        os.kill(child.pid, signal.SIGSTOP)
        w.kill()  # SIGKILL, which needs no SIGCONT
        assert child.wait(5) == -signal.SIGKILL
        assert sup._fault() == (f"the target worker rank 1 (pid {child.pid}) died", sup.error_grace_s)
    finally:
        child.kill()


def test_the_supervisor_names_an_engine_process_whose_heartbeat_stalled(tmp_path):
    sup = Supervisor(Path("unused"), stall_s=0.1)
    sup.srv = _FakeServer()
    sup.srv.run_dir = tmp_path
    sup.watched = [Watched.of(os.getpid(), "engine process")]
    hb = Heartbeat(heartbeat_path(tmp_path, os.getpid()))
    assert sup._fault() is None
    time.sleep(0.15)
    fault, grace_s = sup._fault()
    assert fault.startswith(f"the engine process (pid {os.getpid()}) stalled: its engine loop has not beaten, idle "
                            "then, for 0.") and "stall limit 0.1 s" in fault and grace_s == 0.0
    hb.beat(True)
    assert sup._fault() is None
    hb.close()


class _BlockingEngine:
    """Enough of a SpeculativeEngine for EngineLoop: one cycle that blocks until ``release`` (a collective waiting
    for a stalled rank)."""

    group = SimpleNamespace(devices=["cpu"])

    def __init__(self):
        self.work, self.release = False, threading.Event()

    def has_work(self):
        return self.work

    def submit(self, req, callback):
        self.work = True
        return 1

    def step(self):
        self.release.wait(10)
        self.work = False

    def fail_all(self, error):
        pass


def _until(cond, timeout_s: float = 5.0) -> bool:
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout_s:
            return False
        time.sleep(0.01)
    return True


def test_the_engine_loop_beats_while_idle_and_not_during_a_blocked_cycle(tmp_path):
    path = tmp_path / "engine.heartbeat"
    hb, eng = Heartbeat(path, every_s=0.02), _BlockingEngine()
    loop = EngineLoop(eng, heartbeat=hb.beat, beat_s=0.02)
    try:
        time.sleep(0.3)
        assert stall(path, 0.2) is None and read(path)[1] is False  # idle for 0.3 s, and beating
        loop.submit(None, lambda ev: None)
        assert _until(lambda: read(path)[1] is True)
        time.sleep(0.3)
        assert (stall(path, 0.25) or "").startswith("its engine loop has been in one cycle for 0.")
        eng.release.set()
        assert _until(lambda: read(path)[1] is False)  # the cycle ended: idle, beating again
        time.sleep(0.3)
        assert stall(path, 0.2) is None
    finally:
        eng.release.set()
        loop.stop()
        hb.close()


def test_restart_limit_0_gives_up_at_the_first_fault_and_a_negative_one_is_refused():
    lines: list[str] = []
    sup = Supervisor(Path("unused"), max_restarts=0, stable_s=60.0, say=lines.append)
    sup.endpoint = None
    sup._start_server = lambda: pytest.fail("restarted although the restart limit is 0")
    sup.state, sup.srv, sup._ready_at = "serving", _FakeServer(), time.monotonic() - 3600  # a fault now and then
    sup._recover("the spec_decode stub (pid 7) died")
    assert sup.failed and sup.srv.killed and not sup.restarts
    assert "not restarting" in lines[0] and lines[-1] == ("splitspec serve: giving up at the first fault (restart "
                                                           "limit 0): the spec_decode stub (pid 7) died"), lines
    with pytest.raises(ConfigError, match=r"^--restart-limit = -1: expected 0 \(never restart\) or more$"):
        Supervisor(Path("unused"), max_restarts=-1)


def test_shutdown_drains_the_front_ends_first_and_waits_for_them_before_tritonserver_stops(monkeypatch):
    """The order of a graceful stop: front ends refuse new requests (before not-ready), the engine stops admitting,
    drains, ends the rest, the front ends and the HTTP guard pass the last responses on, the guard stops (its idle
    keep-alive clients closed), then tritonserver stops."""
    calls: list[str] = []

    class Front:
        def drain(self):
            calls.append(f"front drain (state {sup.state})")

        def wait_idle(self, timeout_s):
            calls.append(f"front wait_idle {timeout_s:g}")
            return 0

    class Srv(_FakeServer):
        def is_running(self):
            return True

        def stop(self):
            calls.append("tritonserver stop")

    class Guard:
        def wait_idle(self, timeout_s):
            calls.append(f"guard wait_idle {timeout_s:g}")
            return 0

        def stop(self):
            calls.append("guard stop")

    sup = Supervisor(Path("unused"), drain_s=0.0, flush_s=2.5, say=lambda line: None)
    sup.state, sup.srv, sup.guard = "serving", Srv(), Guard()
    sup.front_ends.append(Front())
    monkeypatch.setattr(sup, "_signal_engines", lambda sig: calls.append(f"engine {signal.Signals(sig).name}"))
    monkeypatch.setattr(sup, "_wait_drained", lambda timeout_s: calls.append("engine drained"))
    sup.shutdown()
    assert calls == ["front drain (state serving)", "engine SIGUSR1", "engine drained", "engine SIGTERM",
                     "engine drained", "front wait_idle 2.5", "guard wait_idle 2.5", "guard stop",
                     "tritonserver stop"], calls
    assert sup.state == "stopped"


@pytest.mark.parametrize("argv, message", [
    (["--http-port", "-1"], "argument --http-port: expected a TCP port in 1..65535, or 0 for a free one, got '-1'"),
    (["--openai-port", "70000"], "argument --openai-port: expected a TCP port in 1..65535, or 0 for a free one, got '70000'"),
    (["--restart-limit", "-1"], "argument --restart-limit: expected an integer ≥ 0, got '-1'"),
])
def test_serve_arguments_out_of_range_are_refused_in_one_line(argv, message, capsys):
    from splitspec.cli_parser import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", *argv])
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0] == f"splitspec serve: error: {message} (see splitspec serve --help)", err
    a = build_parser().parse_args(["serve", "--http-port", "0", "--openai-port", "0", "--restart-limit", "0"])
    assert (a.http_port, a.openai_port, a.restart_limit) == (0, 0, 0)
    help_text = build_parser()._subparsers._group_actions[0].choices["serve"].format_help()
    assert "0 = a free port" in help_text and "0 = never restart" in " ".join(help_text.split())
    assert "guard in front of tritonserver's HTTP" in " ".join(help_text.split())


def test_make_serve_passes_its_port_variables(tmp_path):
    """``make serve HTTP_PORT=... GRPC_PORT=... METRICS_PORT=... HEALTH_PORT=...`` runs ``splitspec serve`` with those
    ports (it could not change them); without them, the CLI's defaults."""
    import shlex

    from splitspec.cli_parser import build_parser

    def serve_args(*variables: str):
        out = subprocess.run(["make", "-n", "serve", f"REPO={tmp_path}", *variables], capture_output=True, text=True,
                             cwd=Path(__file__).parents[2], check=True).stdout
        argv = shlex.split(next(line for line in out.splitlines() if "splitspec.cli serve " in line))
        return build_parser().parse_args(argv[argv.index("serve"):])

    a = serve_args("HTTP_PORT=18000", "GRPC_PORT=18001", "METRICS_PORT=18002", "HEALTH_PORT=18003", "OPENAI_PORT=0")
    assert (a.http_port, a.grpc_port, a.metrics_port, a.health_port, a.openai_port) == (18000, 18001, 18002, 18003, 0)
    a = serve_args()
    assert (a.http_port, a.grpc_port, a.metrics_port, a.health_port, a.openai_port) == (8000, 8001, 8002, 8003, 9000)


# ---------------------------------------------------------------------------------------------
# Out of file descriptors: unknown is not dead, and the supervising thread does not die silently
# ---------------------------------------------------------------------------------------------


def _emfile(*args, **kwargs):
    raise OSError(errno.EMFILE, "Too many open files")


def test_an_unreadable_proc_entry_is_unknown_not_a_death(monkeypatch):
    sup = Supervisor(Path("unused"))
    sup.watched = [Watched(os.getpid(), "engine process", Watched.of(os.getpid(), "x").started)]
    monkeypatch.setattr(Path, "read_text", _emfile)
    assert sup.watched[0].state() == UNKNOWN and sup.watched[0].alive() and not sup.watched[0].stopped()
    assert sup._fault() is None


def test_shared_memory_cleanup_that_cannot_list_is_said_not_raised(tmp_path, monkeypatch, capsys):
    (tmp_path / "splitspec_1_a").write_bytes(b"x" * 10)
    assert remove_shm_regions("splitspec_1_", tmp_path) == 10 and not list(tmp_path.iterdir())
    monkeypatch.setattr(Path, "glob", _emfile)
    assert remove_shm_regions("splitspec_1_", tmp_path) == 0
    assert "cannot list" in capsys.readouterr().err


def test_a_kill_that_fails_in_a_recovery_is_said_and_the_restart_goes_on():
    lines: list[str] = []
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a pid (and process group) that no longer exists
    sup = Supervisor(Path("unused"), say=lines.append)
    sup.endpoint = None
    sup._start_server = lambda: setattr(sup, "state", "serving")
    sup.state, sup.srv, sup._ready_at = "serving", SimpleNamespace(kill=_emfile, pid=gone.pid, log_path=Path("t.log")), 0.0
    sup._recover("the spec_decode stub (pid 7) died")
    assert sup.state == "serving" and len(sup.restarts) == 1
    assert f"stopping tritonserver (pid {gone.pid}) failed (OSError: [Errno 24] Too many open files)" in lines[1], lines


@pytest.mark.parametrize("where", ["check", "recovery"])
def test_the_supervising_thread_logs_what_it_did_not_expect(where):
    lines: list[str] = []
    sup = Supervisor(Path("unused"), check_s=0.01, say=lines.append)
    sup.state, calls = "serving", []

    def fault():
        calls.append(1)
        if where == "check" and len(calls) < 3:
            _emfile()
        return ("the spec_decode stub (pid 7) died", 0.0) if where == "recovery" else None

    sup._fault, sup._recover = fault, _emfile
    t = threading.Thread(target=sup._watch, daemon=True)
    t.start()
    if where == "check":  # said once, retried at the next tick
        assert _until(lambda: len(calls) >= 5)
        assert lines == ["splitspec serve: checking the pipeline failed (OSError: [Errno 24] Too many open files); "
                         "retrying"] and not sup.failed
        sup._stop.set()
    t.join(5)
    assert not t.is_alive()
    if where == "check":  # the second failure, left out within the first's second, is said as the thread ends
        assert lines[1:] == lines[:1], lines
    if where == "recovery":  # given up: serve exits with an error
        assert sup.failed and lines == ["splitspec serve: recovering from 'the spec_decode stub (pid 7) died' failed "
                                        "(OSError: [Errno 24] Too many open files); giving up"]
