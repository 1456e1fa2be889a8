"""A log that says each kind of line once a second at most, for errors that can repeat many times a second: the HTTP
guard's event-loop errors (each failed accept at the descriptor limit) and the requests aiohttp refuses before they
reach it (a malformed request head or chunk, :mod:`splitspec.serving.guard_server`), the OpenAI front end's requests
that h11 refuses (:mod:`splitspec.serving.openai_connection`), and the supervisor's failed checks of the pipeline,
retried every tick (:class:`~splitspec.serving.supervisor.Supervisor`).

Lines are limited per key (by default the line itself), so a line of another kind is never swallowed by one that
floods; what was left out of a key is said on that key's next line written. Its memory is bounded: at most
``max_keys`` keys are kept, a new key past that replacing the key written longest ago once that one's second is over;
until then (more than ``max_keys`` kinds of line within a second) the new line is left out, counted as "other" and
said on the next line written.

A burst's count would wait for the key's next line, which may never come: :meth:`RateLimitedLog.flush` says what is
still left out (each key's last line left out, with the count of those before it), and the servers call it when they
stop (the HTTP guard, the OpenAI front end's uvicorn warnings, the supervisor's failed checks).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Callable

#: Keys remembered at once (each costs its key string and two numbers).
MAX_KEYS = 64


class RateLimitedLog:
    """Passes lines to ``write``, of each key one every ``every_s`` seconds at most (by ``time.monotonic``); the lines
    of that key in between are left out and counted, and the key's next line written ends with ``(N more since the
    last line)`` (the last of its key). Lines left out because ``max_keys`` keys were all within their ``every_s``
    are counted in :attr:`left_out` and said on the next line written of any key (``N other lines left out``).
    :meth:`flush` says what is left out still. For one thread: :meth:`say` takes no lock.

    Args:
        write: where a line goes (one line, no newline), e.g. ``print`` to stderr or the supervisor's ``say``.
        every_s: the shortest time between two lines of one key written, seconds.
        max_keys: keys remembered at once (:data:`MAX_KEYS`).
    """

    def __init__(self, write: Callable[[str], None], every_s: float = 1.0, max_keys: int = MAX_KEYS):
        self.write, self.every_s, self.max_keys = write, every_s, max_keys
        #: key → [when its last line was written (``time.monotonic``), its lines left out since, the last of them],
        #: oldest write first
        self.keys: OrderedDict[str, list] = OrderedDict()
        #: lines left out without a key of their own to count them (every key kept was within its ``every_s``)
        self.left_out = 0
        #: the last of those
        self.last_other: str | None = None

    def say(self, line: str, key: str | None = None) -> None:
        """Write ``line`` (with the count of its key's lines left out before it), unless a line of ``key`` (default:
        ``line`` itself) was written less than ``every_s`` seconds ago: then only count it."""
        key = line if key is None else key
        now = time.monotonic()
        kept = self.keys.get(key)
        if kept is not None and now - kept[0] < self.every_s:
            kept[1] += 1
            kept[2] = line
            return
        if kept is None and len(self.keys) >= self.max_keys:
            oldest = next(iter(self.keys.values()))
            if now - oldest[0] < self.every_s:  # every key kept is still within its time: no room
                self.left_out += 1
                self.last_other = line
                return
            self.left_out += oldest[1]  # its own count now has no key to be said with
            self.last_other = self.last_other or oldest[2]
            self.keys.popitem(last=False)
        self._write(line, kept[1] if kept is not None else 0)
        self.keys[key] = [now, 0, None]
        self.keys.move_to_end(key)

    def flush(self) -> None:
        """Write what is left out and not said yet: of each key with lines left out, the last of them (ending with
        the count of those before it), and the last line counted in :attr:`left_out` if no key's line carried that
        count. Call it when the log's lines stop (a server stopping)."""
        now = time.monotonic()
        for kept in self.keys.values():
            if kept[1]:
                self._write(kept[2], kept[1] - 1)
                kept[:] = [now, 0, None]
        if self.left_out:  # then last_other is the last of them
            self.left_out -= 1
            self._write(self.last_other, 0)

    def _write(self, line: str, more: int) -> None:
        """Write ``line``, ending with ``more`` lines of its key left out before it and the other lines left out."""
        counts = [f"{more} more since the last line"] if more else []
        if self.left_out:
            counts.append(f"{self.left_out} other lines left out")
        self.write(line + (f" ({'; '.join(counts)})" if counts else ""))
        self.left_out, self.last_other = 0, None
