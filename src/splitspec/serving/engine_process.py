"""The speculative engine in a process of its own (``python -m splitspec.serving.engine_process_main --fd N``, its body
in :mod:`splitspec.serving.engine_process_main`); this module is the host's side.

:class:`EngineProcess` starts it with ``sys.executable`` and talks to it over a socket pair. The Triton
model ``spec_decode`` serves through it rather than running the engine inside Triton's Python backend
stub, for two reasons that each slowed every engine cycle there (measurements:
docs/lab/2026-11-30-triton-share-engine-process/):

- The stub embeds the shared ``libpython3.X.so``. On Debian and Ubuntu that library runs pure Python
  about 20 % slower than their statically linked ``/usr/bin/python3.X``, the interpreter that runs the
  engine alone, the target's worker ranks and now this process. A cycle's host work (batch tables, graph
  launches, acceptance, detokenising) is mostly Python.
- In the stub the engine loop shares one GIL with the threads that answer Triton. Every Triton call
  (``send``, ``is_cancelled``, a metric update) releases the GIL and takes it back; while such a thread
  waits for it, each of the loop's torch calls wakes that thread and now and then loses the GIL to it
  (about 0.2 ms of GIL waits per cycle on a 2-core CPU machine; none with the per-cycle responses off).

Here nothing else competes with the loop for its GIL: the loop thread sends each cycle's events in one
message (a pickle and a socket write), and the main thread receives requests and cancellations and
checks the target's workers. On GPUs that message goes out while the next cycle runs there
(``overlap_output``, :class:`CycleMessages`): a request's first and last events at once, the deltas between
them once the next cycle's GPU work is queued (:attr:`SpeculativeEngine.on_launched`), so writing it no longer
delays the next cycle. A submit is not answered: the engine takes the request at its next cycle,
and a request it refuses comes back as that request's one event, finished with ``finish_reason``
``"rejected"`` (the request can never be served: ``error`` says why) or ``"error"`` (the engine stopped
serving). A request, greedy or sampled, whose next token meets NaN or inf logits also ends with ``"error"``
(``error`` says so), alone. So the host's thread that submits (``spec_decode``'s ``execute``) never waits for the
engine process.

Messages (pickled tuples)::

    host → engine   ("load", ServeConfig, {"cpu_threads": …, "overlap_output": …})
                    ("submit", sid, Request)   ("cancel", sid)   ("stop",)
    engine → host   ("ready", info)   ("load_failed", error class name, message)
                    ("cycle", [event tuple], CycleStats tuple | None, gauges)   one per cycle (with
                                                                      overlap_output, sent during the next), and
                                                                      one per refused submit
                    ("failed", message)   the engine stopped serving (a target worker died); a cycle message
                                          with every open request's final error event follows at once, sent by
                                          the main thread, whose health check noticed: the loop thread may be
                                          blocked in a collective with the dead worker (:meth:`EngineLoop.fail`)

Signals (from ``splitspec serve``'s supervisor, for a graceful stop, :class:`~splitspec.serving.engine_shutdown.ShutdownSignals`): SIGUSR1 stops admitting;
SIGTERM also ends every request in flight with ``finish_reason`` ``"shutdown"``.
With ``ServeConfig.run_dir`` set (by ``splitspec serve``'s server), the loop thread keeps a heartbeat file there, by
which the supervisor tells a stalled engine from an idle one (:mod:`splitspec.serving.heartbeat`).

``sid`` is the host's id of a request. An event crosses as a tuple of plain values (:func:`pack_event`:
``(sid, RequestOutput's fields with its stats as a tuple, finishing)``), a :class:`CycleStats` as the tuple of
its fields, and the engine's messages are pickled with the standard pickler: several times faster than
dataclasses through ``Connection.send`` (``multiprocessing``'s pickler), on the loop thread after every cycle.
``finishing``: the event's request finished in the same cycle (its final event follows in the same message).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection
from typing import Callable, Mapping

from splitspec import errors
from splitspec.engine.plan import EngineError
from splitspec.errors import SplitspecError
from splitspec.serving.engine_messages import unpack_cycle_stats, unpack_event
from splitspec.settings import ServeConfig


def _error(kind: str, message: str) -> SplitspecError:
    """The exception named ``kind`` (a SplitspecError subclass) carrying ``message``; EngineError otherwise."""
    cls = EngineError if kind == "EngineError" else getattr(errors, kind, None)
    if isinstance(cls, type) and issubclass(cls, SplitspecError):
        return cls(message)
    return EngineError(f"{kind}: {message}")


class EngineProcess:
    """The engine in a child process. :meth:`submit` and :meth:`cancel` are thread-safe.

    ``on_cycle(events, cycle_stats)`` and ``on_failed(message)`` run on a reader thread of this process (an exception
    they raise is printed to stderr and the reader goes on; :meth:`submit` from there raises EngineError):
    ``events`` is a list of ``(sid, RequestOutput, finishing)``; ``on_failed`` is called once, when the engine
    stops serving (a worker died, the engine process exited). A request the engine refuses gets one event,
    finished, ``finish_reason`` ``"rejected"`` (``error``: why, e.g. beyond ``max_seq_len``) or ``"error"``
    (the engine stopped serving), and no cycle statistics (``cycle_stats`` None).

    Args:
        cfg: the deployment, sent to the engine process for :meth:`SpeculativeEngine.load` (a frozen dataclass:
            it pickles).
        cpu_threads: intra-op threads of a CPU engine's rank 0 (None: its share of the cores less one,
            which Triton's processes need).
        overlap_output: send a cycle's events while the next cycle runs on the GPU (None: when the target runs on
            GPUs; :class:`CycleMessages` says which wait). A request's first event and its last are sent at once; a
            delta between them leaves once the next cycle's GPU work is queued, later by that cycle's host work up
            to its verify's launch (in an eager cycle, such as a request's first decode, its whole draft phase). The
            message then overlaps the GPU instead of delaying the next cycle, as
            in vLLM's asynchronous output processing.
        env: the engine process's environment (None: this process's).
    Raises:
        the engine's load error (ConfigError, CheckpointError, EngineError, ...) with its message;
        EngineError if the process exits or is not ready within ``start_timeout_s``.
    """

    def __init__(self, cfg: ServeConfig, on_cycle: Callable, on_failed: Callable[[str], None],
                 start_timeout_s: float = 900.0, cpu_threads: int | None = None, env: Mapping[str, str] | None = None,
                 overlap_output: bool | None = None):
        self.on_cycle, self.on_failed = on_cycle, on_failed
        self.closed = False
        self.error: str | None = None  # why the engine stopped serving
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        ours, theirs = socket.socketpair()
        try:
            cmd = [sys.executable, "-m", "splitspec.serving.engine_process_main", "--fd", str(theirs.fileno())]
            self.proc = subprocess.Popen(cmd, pass_fds=(theirs.fileno(),),
                                         env=dict(os.environ if env is None else env, PYTHONUNBUFFERED="1"))
        finally:
            theirs.close()
        self.pid = self.proc.pid
        self.conn = Connection(ours.detach())
        try:
            self._send(("load", cfg, {"cpu_threads": cpu_threads, "overlap_output": overlap_output}))
            self.info: dict = self._wait_ready(start_timeout_s)
        except BaseException:
            self._kill()
            raise
        self.gauges = {"active": 0, "queued": 0, "kv_used": 0, "kv_total": self.info["kv_blocks"]}
        self._reader = threading.Thread(target=self._read, name="splitspec-engine-reader", daemon=True)
        self._reader.start()

    def _send(self, msg) -> None:
        with self._send_lock:
            self.conn.send(msg)

    def _wait_ready(self, timeout_s: float) -> dict:
        deadline = time.monotonic() + timeout_s
        while True:
            if self.conn.poll(0.5):
                try:
                    msg = self.conn.recv()
                except EOFError:
                    msg = ("exited",)
                if msg[0] == "ready":
                    return msg[1]
                if msg[0] == "load_failed":
                    raise _error(msg[1], msg[2])
            if self.proc.poll() is not None:
                raise EngineError(f"the engine process (pid {self.pid}) exited with status {self.proc.returncode} "
                                  "while loading the engines (see the log above)")
            if time.monotonic() > deadline:
                raise EngineError(f"the engine process (pid {self.pid}) did not load the engines in {timeout_s:.0f} s")

    # ------------------------------------------------------------------ requests

    def submit(self, sid: int, req) -> None:
        """Send ``req`` (a :class:`splitspec.runtime.types.Request`) under the host's id ``sid``; its events go to
        ``on_cycle``, a refusal too (a ``"rejected"`` event: see the class). Returns once the request is written,
        without waiting for the engine. Raises EngineError when the engine is known to have stopped serving or its
        process is gone, or when called from ``on_cycle``: the write can wait for the engine process to read, which
        can itself wait for the reader thread that runs ``on_cycle`` (submit from another thread; :meth:`cancel` is
        safe there)."""
        if threading.current_thread() is getattr(self, "_reader", None):
            raise EngineError("EngineProcess.submit called from on_cycle (the reader thread), where it can deadlock; "
                              "submit from another thread")
        if self.error is not None:
            raise EngineError(f"engine is not ready: {self.error}")
        try:
            self._send(("submit", sid, req))
        except OSError as e:
            raise EngineError(f"the engine process (pid {self.pid}) is gone: {e}") from None

    def cancel(self, sid: int) -> None:
        """Cancel request ``sid``; its slot and KV are freed at the start of the engine's next cycle. Never blocks:
        a short-lived thread writes the message, so the reader thread, which ``on_cycle`` may call this from, keeps
        draining the engine's messages even when the socket toward the engine is full (the engine process's main
        thread, which reads it, can itself wait on a full socket toward the reader). A cancellation written before
        its request's submit is ignored; submit's caller cancels again once the engine has it."""
        def write() -> None:
            try:
                self._send(("cancel", sid))
            except OSError:
                pass

        threading.Thread(target=write, name="splitspec-engine-cancel", daemon=True).start()

    def alive(self) -> bool:
        return self.proc.poll() is None

    # ------------------------------------------------------------------ from the engine

    def _read(self) -> None:
        while True:
            try:
                msg = self.conn.recv()
            except (EOFError, OSError):
                break
            kind = msg[0]
            try:
                if kind == "cycle":
                    self.gauges = msg[3]
                    self.on_cycle([unpack_event(t) for t in msg[1]], unpack_cycle_stats(msg[2]))
                elif kind == "failed":
                    self._fail(msg[1])
            except Exception:  # a callback's bug: reported, and the reader keeps draining the engine
                traceback.print_exc()
        if not self.closed:
            try:
                status = self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                status = "unknown (it closed its end of the socket)"
            self._fail(f"the engine process (pid {self.pid}) exited with status {status}")

    def _fail(self, message: str) -> None:
        with self._lock:
            if self.error is not None:
                return
            self.error = message
        self.on_failed(message)

    # ------------------------------------------------------------------ stopping

    def close(self, timeout_s: float = 60.0) -> None:
        """Stop the engine (its worker processes exit) and the process; every message the engine sent has been passed
        on when it returns (unless called from a callback). Idempotent."""
        if self.closed:
            return
        self.closed = True
        if not self._send_lock.acquire(timeout=min(timeout_s, 5.0)):  # a writer stuck on a full socket: kill instead
            self._kill()
            return
        try:
            self.conn.send(("stop",))
        except OSError:
            pass
        finally:
            self._send_lock.release()
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self._kill()
        if threading.current_thread() is not self._reader:  # it reads what the engine sent before it exited
            self._reader.join(timeout=5)
        self.conn.close()

    def _kill(self) -> None:
        self.closed = True
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        self.conn.close()
