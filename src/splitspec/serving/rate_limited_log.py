"""A log that says one line a second at most, for errors that can repeat many times a second: the HTTP guard's
event-loop errors (each failed accept at the descriptor limit, :class:`~splitspec.serving.http_guard.QuietLog`) and
the supervisor's failed checks of the pipeline, retried every tick (:class:`~splitspec.serving.supervisor.Supervisor`).
"""

from __future__ import annotations

import time
from typing import Callable


class RateLimitedLog:
    """Passes lines to ``write`` one every ``every_s`` seconds at most (by ``time.monotonic``); the lines in between
    are left out, counted in :attr:`left_out`, and the next line written ends with ``(N more since the last line)``.
    For one thread: :meth:`say` takes no lock.

    Args:
        write: where a line goes (one line, no newline), e.g. ``print`` to stderr or the supervisor's ``say``.
        every_s: the shortest time between two lines written, seconds.
    """

    def __init__(self, write: Callable[[str], None], every_s: float = 1.0):
        self.write, self.every_s = write, every_s
        #: when the last line was written (``time.monotonic``; -inf: none yet)
        self.last = float("-inf")
        #: lines left out since the last one written
        self.left_out = 0

    def say(self, line: str) -> None:
        """Write ``line`` (with the count of those left out before it), unless one was written less than
        ``every_s`` seconds ago: then only count it."""
        now = time.monotonic()
        if now - self.last < self.every_s:
            self.left_out += 1
            return
        more = f" ({self.left_out} more since the last line)" if self.left_out else ""
        self.write(line + more)
        self.last, self.left_out = now, 0
