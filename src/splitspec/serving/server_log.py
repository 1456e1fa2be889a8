"""Reading ``tritonserver``'s log: its tail, its error lines, and a watch for one line from now on.

:class:`~splitspec.serving.tritonserver.TritonServer` sends the server's stdout and stderr to one log file; a
failed start is reported with that log's error lines and tail (:func:`start_failure`), :class:`LogWatch`
notices when the server gives up at its exit timeout (:data:`EXIT_GAVE_UP`), and :func:`unloading` when
``spec_decode`` is still unloading itself after its engine failed.
"""

from __future__ import annotations

import os
from pathlib import Path


def tail(path: Path, n_bytes: int = 6000) -> str:
    """The last ``n_bytes`` of the log at ``path`` (``"(no log)"`` when it cannot be read)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - n_bytes))
            return f.read().decode("utf-8", errors="replace")
    except OSError:
        return "(no log)"


#: tritonserver's log line when requests were still in flight at the end of its exit timeout (2.51: "failed to stop
#: server: Internal - Exit timeout expired. Exiting immediately."); it does not exit after it.
EXIT_GAVE_UP = "Exit timeout expired. Exiting immediately."


#: ``spec_decode``'s log line when its engine failed and it began unloading itself (triton_repo's model.py), and
#: tritonserver's when that unload finished.
SELF_UNLOAD = "spec_decode: engine failed:"
UNLOADED = "successfully unloaded 'spec_decode'"


def unloading(path: Path, n_bytes: int = 1 << 20) -> bool:
    """Whether the log (its last ``n_bytes``) says ``spec_decode`` began unloading itself and not yet that it is
    unloaded: a SIGINT is better sent after that unload than into it. (Seen in CI twice: the ensemble that depended
    on it left live through the exit timeout, the server exiting 1 — once with the SIGINT 20 ms into the unload, once
    27 ms after it had finished; since then ``spec_decode`` unloads the ensemble in the same call,
    ``unload_dependents``.)"""
    text = tail(path, n_bytes)
    began = text.rfind(SELF_UNLOAD)
    return began >= 0 and text.find(UNLOADED, began) < 0


class LogWatch:
    """Watches a log for a line from now on: :meth:`says` reads only what was written since its last call (keeping
    enough of the previous read for a line cut between two reads). Never raises; a log that cannot be opened says
    nothing."""

    def __init__(self, path: Path):
        try:
            self.f = open(path, "rb")
            self.f.seek(0, os.SEEK_END)
        except OSError:
            self.f = None
        self.carry = b""

    def says(self, text: str) -> bool:
        if self.f is None:
            return False
        try:
            new = self.carry + self.f.read()
        except OSError:
            return False
        want = text.encode()
        self.carry = new[-(len(want) - 1):] if len(want) > 1 else b""
        return want in new

    def close(self) -> None:
        if self.f is not None:
            self.f.close()


def errors_in_log(path: Path, max_chars: int = 3000) -> str:
    """The log's error lines (``E…`` records and ``error:`` lines, up to ``max_chars``), newest last."""
    try:
        lines = Path(path).read_text(errors="replace").splitlines()
    except OSError:
        return ""
    hits = [ln for ln in lines if ln.startswith("error:") or (ln[:1] == "E" and ln[1:5].isdigit())]
    # CUDA/NVML notices on CPU-only machines are errors in the log but not why a start failed
    hits = [ln for ln in hits if "CUDA driver" not in ln and "CudaDriverHelper" not in ln]
    return "\n".join(hits)[-max_chars:]


def start_failure(what: str, log_path: Path) -> str:
    errors = errors_in_log(log_path)
    head = f"{what} (log {log_path})"
    if errors:
        head += f"\nerrors:\n{errors}"
    return f"{head}\nlog tail:\n{tail(log_path, 3000)}"


#: Earlier logs kept by :func:`rotate` (``<log>.1`` the newest).
KEEP_LOGS = 5


def rotate(path: Path, keep: int = KEEP_LOGS) -> Path | None:
    """Keep the log at ``path`` before a server writes it afresh: ``<path>.1`` … ``<path>.<keep>`` move up by one (the
    oldest is dropped) and ``path`` becomes ``<path>.1``. Returns that name, or None when there was no log (or it was
    empty). A restart (``splitspec serve``'s supervisor) thus never truncates the log of the server that failed."""
    path = Path(path)
    try:
        if path.stat().st_size == 0:
            return None
    except OSError:
        return None
    for i in range(keep - 1, 0, -1):
        older = path.with_name(f"{path.name}.{i}")
        if older.exists():
            os.replace(older, path.with_name(f"{path.name}.{i + 1}"))
    first = path.with_name(f"{path.name}.1")
    os.replace(path, first)
    return first
