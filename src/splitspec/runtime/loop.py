"""Serving from a thread: :class:`EngineLoop` runs the scheduler's cycles in the background while other threads
submit and cancel requests."""

from __future__ import annotations

import threading
from typing import Callable

import torch

from splitspec.engine.plan import EngineError
from splitspec.runtime.scheduler import SpeculativeEngine
from splitspec.runtime.types import Request, RequestOutput


#: Seconds a failed cycle looks for a dead worker to name (its sockets close a moment before it can be reaped).
DEAD_WORKER_WAIT_S = 1.0


class EngineLoop:
    """Runs :meth:`SpeculativeEngine.step` in a background thread; :meth:`submit`, :meth:`cancel` and :meth:`fail`
    are thread-safe. Callbacks run on the loop thread (and, for the final error events, on the thread that calls
    :meth:`fail`). If the engine fails (a cycle raises: a worker died, the group broke; or :meth:`fail` is called),
    every active and queued request gets one final error event, :attr:`healthy` turns False, and later submits raise
    EngineError.

    ``after_step``: called on the loop thread after every cycle (after its callbacks), e.g. to pass the
    cycle's events on in one message. ``heartbeat(busy)``: called on the loop thread before every cycle (True) and,
    while the loop waits for work, at least every ``beat_s`` seconds (False), so that a watcher can tell a loop that
    stalled (no calls) from an idle one (:mod:`splitspec.serving.heartbeat`).
    """

    def __init__(self, engine: SpeculativeEngine, after_step: Callable[[], None] | None = None,
                 heartbeat: Callable[[bool], None] | None = None, beat_s: float = 0.25):
        self.engine = engine
        self.after_step = after_step
        self.heartbeat, self.beat_s = heartbeat, beat_s
        self.healthy, self.error = True, None
        self._wake = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="splitspec-engine-loop", daemon=True)
        self._thread.start()

    def submit(self, req: Request, callback: Callable[[RequestOutput], None]) -> int:
        """Queue ``req``; ``callback`` receives its events. Raises ConfigError / EngineError at once."""
        if not self.healthy:
            raise EngineError(f"engine is not ready: {self.error}")
        with self._wake:
            rid = self.engine.submit(req, callback)
            self._wake.notify()
        return rid

    def cancel(self, request_id: int, reason: str = "cancelled") -> None:
        """Cancel a request; its final event carries ``finish_reason`` ``reason``."""
        self.engine.cancel(request_id, reason)
        with self._wake:
            self._wake.notify()

    def fail(self, message: str) -> None:
        """Stop serving: every active and queued request ends now with one final error event carrying ``message``
        (:meth:`SpeculativeEngine.fail_requests`), without waiting for the loop thread, which may be blocked in a
        cycle (a collective with a worker that died, until the collective timeout): what that cycle yields when it
        returns or raises is dropped, and the loop thread then exits. The first failure's message is kept."""
        with self._wake:
            if self.healthy:
                self.healthy, self.error = False, message
            self._wake.notify()
        self.engine.fail_requests(self.error)

    def _why(self, e: Exception) -> str:
        """What a failed cycle says: a dead worker first (clearer than the collective error it caused)."""
        if isinstance(e, EngineError):
            return str(e)
        try:
            self.engine.group.check_workers(wait_s=DEAD_WORKER_WAIT_S)
        except EngineError as dead:
            return str(dead)
        return f"{type(e).__name__}: {e}"

    def _run(self) -> None:
        device = self.engine.group.devices[0]
        if device.startswith("cuda"):  # a new thread's current device is GPU 0, whatever the loading thread set
            torch.cuda.set_device(device)
        beat = self.heartbeat or (lambda busy: None)
        while True:
            with self._wake:
                while not self._stop and self.healthy and not self.engine.has_work():
                    beat(False)
                    self._wake.wait(self.beat_s if self.heartbeat else None)
                if self._stop:
                    return
            if not self.healthy:  # failed from another thread: its requests have had their final events
                self.engine.fail_all(self.error)
                return
            beat(True)
            try:
                self.engine.step()
                if self.after_step is not None:
                    self.after_step()
            except Exception as e:  # a dead worker or broken group: fail everything, stop serving
                self.fail(self._why(e))
                self.engine.fail_all(self.error)
                return

    def stop(self) -> None:
        """Stop the loop thread (the engine stays open; call ``engine.close()``). After a failure the loop thread may
        still be blocked in a cycle: it is given a second, not 30."""
        with self._wake:
            self._stop = True
            self._wake.notify()
        self._thread.join(timeout=30 if self.healthy else 1)
