"""The engine process's part in a graceful shutdown, driven by signals from ``splitspec serve``'s supervisor
(:meth:`splitspec.serving.supervisor.Supervisor.shutdown`)."""

from __future__ import annotations

import signal


class ShutdownSignals:
    """The engine process's part in a graceful shutdown (``splitspec serve`` signals it before stopping tritonserver):
    SIGUSR1 stops admitting (a new request is refused with ``finish_reason`` ``"error"``, so the client gets
    UNAVAILABLE); SIGTERM also ends every request in flight at the next cycle, each with a final event whose
    ``finish_reason`` is ``"shutdown"`` (and what it generated so far). The process keeps running until the host
    stops it, so those final responses reach their clients."""

    def __init__(self):
        self.admitting, self._cancel = True, False
        signal.signal(signal.SIGUSR1, self._drain)
        signal.signal(signal.SIGTERM, self._term)

    def _drain(self, signum, frame) -> None:
        self.admitting = False

    def _term(self, signum, frame) -> None:
        self.admitting, self._cancel = False, True

    def cancel_now(self) -> bool:
        """True while SIGTERM asks for the requests in flight to end (new ones are refused then anyway)."""
        return self._cancel
