"""The engine process's heartbeat: how ``splitspec serve``'s supervisor tells a stalled engine from a slow one.

A process that stalls without dying — a worker rank stopped or stuck, a collective that never completes, the loop
blocked writing to a host that stopped reading — leaves every watched process alive and the server's readiness 200
while requests hang (a rank would give up only after ``collective_timeout_s``, 300 s). The engine process's loop
thread (:class:`~splitspec.runtime.loop.EngineLoop`) therefore calls :meth:`Heartbeat.beat` before every cycle and,
while idle, every ``beat_s``; :class:`Heartbeat` writes the time (``time.monotonic()``, seconds: CLOCK_MONOTONIC,
one clock for every process of the machine) and whether a cycle is running to a small file in the server's private
run folder (``ServeConfig.run_dir``), at most every ``every_s`` unless that state changed. A cycle that blocks stops
the beats; so does a stopped or wedged engine process.

The file, ``<run_dir>/engine.<pid>.heartbeat``, holds one line of fixed width, rewritten in place (one ``pwrite``):
``"<monotonic seconds, %20.6f> <step|idle>\\n"``. :func:`stall` reads it: a beat older than the supervisor's stall
limit is a stall, described by what the loop was doing.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

#: Seconds between two writes of the same state (a change of state is written at once).
EVERY_S = 0.25
_WIDTH = 20


def heartbeat_path(run_dir: Path, pid: int) -> Path:
    """Where the engine process ``pid`` of a server with run folder ``run_dir`` keeps its heartbeat."""
    return Path(run_dir) / f"engine.{pid}.heartbeat"


class Heartbeat:
    """Writes the heartbeat file ``path`` (created at once, mode 0600; removed by :meth:`close`). :meth:`beat` is
    called from one thread, the engine loop's. Raises OSError when the file cannot be created."""

    def __init__(self, path: Path, every_s: float = EVERY_S):
        self.path, self.every_s = Path(path), every_s
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        self._last, self._busy = float("-inf"), None
        self.beat(False)

    def beat(self, busy: bool) -> None:
        """The loop is alive: ``busy`` True before a cycle, False while it waits for work. Writes when the state
        changed or ``every_s`` passed since the last write; a failed write is skipped (the supervisor sees the beat
        age, never an error of the loop)."""
        now = time.monotonic()
        if busy == self._busy and now - self._last < self.every_s:
            return
        self._last, self._busy = now, busy
        try:
            os.pwrite(self._fd, f"{now:{_WIDTH}.6f} {'step' if busy else 'idle'}\n".encode(), 0)
        except OSError:
            pass

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
            try:
                self.path.unlink()
            except OSError:
                pass


def engine_heartbeat(run_dir: Path | None) -> Heartbeat | None:
    """This (engine) process's heartbeat in the server's run folder ``run_dir``, or None without one, or when it
    cannot be created (said on stderr, which goes to the server's log)."""
    if run_dir is None:
        return None
    try:
        return Heartbeat(heartbeat_path(run_dir, os.getpid()))
    except OSError as e:
        print(f"splitspec engine: no heartbeat ({e}); a stalled engine is then noticed only when a process stops",
              file=sys.stderr, flush=True)
        return None


def read(path: Path) -> tuple[float, bool] | None:
    """``(monotonic time of the last beat, in a cycle then)`` from the file, or None when it is absent or cannot be
    parsed (a torn read: the next read sees the whole line)."""
    try:
        t, state = Path(path).read_bytes().split()
        return float(t), {b"step": True, b"idle": False}[state]
    except (OSError, ValueError, KeyError):
        return None


def stall(path: Path, stall_s: float, now: float | None = None) -> str | None:
    """What the loop has been doing for longer than ``stall_s`` seconds, read from the heartbeat file ``path``
    (``now``: ``time.monotonic()``), or None while its beat is fresh, or the file absent or unreadable."""
    beat = read(path)
    if beat is None:
        return None
    age = (time.monotonic() if now is None else now) - beat[0]
    if age <= stall_s:
        return None
    doing = "been in one cycle for" if beat[1] else "not beaten, idle then, for"
    return f"its engine loop has {doing} {age:.1f} s (stall limit {stall_s:g} s)"
