"""The processes of a served pipeline, read from ``/proc`` (Linux ``proc(5)``): who they are and whether they live.

Below ``splitspec serve`` run ``tritonserver``, one Python backend stub per model instance
(``triton_python_backend_stub <repo>/<model>/1/model.py …``), the engine process that ``spec_decode``'s stub starts
(``python -m splitspec.serving.engine_process_main``) and the target's worker ranks that the engine process starts
(``python -m splitspec.engine.worker … --rank N``). :func:`pipeline_processes` names each by its role;
:class:`Watched` tells a process that died (or became a zombie) from one that lives, and one stopped (SIGSTOP,
SIGTSTP, a debugger: state ``T`` or ``t``, field 3) from one that runs, and is not fooled by a pid reused by a later
process (it compares the start time, field 22 of ``/proc/<pid>/stat``). Only a missing ``/proc`` entry means a
process is gone: another error reading it (``EMFILE`` at the descriptor limit, ``EACCES``) says nothing about the
process, and its state is :data:`UNKNOWN`, never a death.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import signal
from pathlib import Path

PROC = Path("/proc")
_STUB = re.compile(r"triton_python_backend_stub\s+\S*/([^/\s]+)/\d+/model\.py")
_RANK = re.compile(r"--rank\s+(\d+)")
#: ``/proc/<pid>/stat`` states of a process that will not run until it gets SIGCONT (``t``: stopped by a tracer).
STOPPED = ("T", "t")
#: The state of a process whose ``/proc`` entry could not be read for another reason than its absence.
UNKNOWN = "?"


def _stat(pid: int) -> list[str] | None:
    """Fields 3.. of ``/proc/<pid>/stat`` (state first), or None when the process is gone.

    Raises:
        OSError: the entry exists but could not be read (``EMFILE``, ``EACCES``): nothing is known of the process.
    """
    try:
        text = (PROC / str(pid) / "stat").read_text()
    except (FileNotFoundError, ProcessLookupError, ValueError):
        return None
    if ")" not in text:
        return None
    return text[text.rindex(")") + 2:].split()


def _cmdline(pid: int) -> str:
    try:
        return (PROC / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def descendants(root: int) -> list[int]:
    """Every live process below ``root`` (children first, then theirs), from the parent ids in ``/proc``."""
    children: dict[int, list[int]] = {}
    for d in PROC.iterdir():
        if d.name.isdigit():
            try:
                st = _stat(int(d.name))
            except OSError:  # not known now: left out of this look
                continue
            if st is not None:
                children.setdefault(int(st[1]), []).append(int(d.name))
    out, todo = [], [root]
    while todo:
        for c in children.get(todo.pop(0), []):
            out.append(c)
            todo.append(c)
    return out


def role_of(cmdline: str) -> str | None:
    """The pipeline role of a command line: ``"tritonserver"``, ``"<model> stub"``, ``"engine process"``,
    ``"target worker rank N"``; None for anything else."""
    m = _STUB.search(cmdline)
    if m:
        return f"{m.group(1)} stub"
    if "splitspec.serving.engine_process_main" in cmdline:
        return "engine process"
    if "splitspec.engine.worker" in cmdline:
        m = _RANK.search(cmdline)
        return f"target worker rank {m.group(1) if m else '?'}"
    first = cmdline.split(" ", 1)[0]
    if first.endswith("/tritonserver") or first == "tritonserver":
        return "tritonserver"
    return None


def pipeline_processes(root: int) -> dict[int, str]:
    """pid → role (:func:`role_of`) of the pipeline's processes below ``root`` (``root`` itself when it is one)."""
    out = {}
    for pid in [root, *descendants(root)]:
        role = role_of(_cmdline(pid))
        if role is not None:
            out[pid] = role
    return out


@dataclasses.dataclass(frozen=True)
class Watched:
    """A process seen alive: its pid, role and start time (clock ticks since boot)."""

    pid: int
    role: str
    started: str

    @classmethod
    def of(cls, pid: int, role: str) -> "Watched | None":
        st = _stat(pid)
        return None if st is None else cls(pid, role, st[19])

    def state(self) -> str | None:
        """Its ``/proc`` state letter (``R``, ``S``, ``D``, ``T`` …), None once it exited or its pid belongs to a
        later process, or :data:`UNKNOWN` when its entry could not be read (then it counts as alive)."""
        try:
            st = _stat(self.pid)
        except OSError:
            return UNKNOWN
        return st[0] if st is not None and st[19] == self.started else None

    def alive(self) -> bool:
        """False once the process exited, is a zombie, or its pid belongs to a later process."""
        return self.state() not in (None, "Z", "X")

    def stopped(self) -> bool:
        """True while it lives but is stopped (:data:`STOPPED`): it runs nothing until SIGCONT."""
        return self.state() in STOPPED

    def kill(self) -> None:
        """SIGKILL it if it still lives (a stopped process too: SIGKILL needs no SIGCONT, unlike SIGTERM)."""
        if self.alive():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(self.pid, signal.SIGKILL)

    def __str__(self) -> str:
        return f"the {self.role} (pid {self.pid})"


def watch(root: int) -> list[Watched]:
    """The pipeline below ``root`` as :class:`Watched` processes (those that ended meanwhile left out)."""
    found = (Watched.of(pid, role) for pid, role in pipeline_processes(root).items())
    return [w for w in found if w is not None]
