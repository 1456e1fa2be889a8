"""The processes of a measured run, by role: their CPU seconds (Linux ``/proc``) and their pinning to cores.

Roles: "engine" (the engine's process: :mod:`splitspec.serving.engine_process`, or the measuring process itself
when the engine runs in it), "target worker ranks" (:mod:`splitspec.engine.worker`), and the command name of
anything else (tritonserver, its backend stubs). ``--pin`` of bench/triton_share.py gives the engine's process and
its worker ranks a physical core each (:func:`core_plan`, :func:`pin`), so that the phases it compares do not
share those cores with the serving processes."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Collection, Iterator


def process_tree(root_pid: int, root_role: str | None = None, prune: Collection[int] = ()) -> Iterator[tuple[int, str, str, list[int]]]:
    """The processes under ``root_pid`` (Linux ``/proc``), root first, as ``(pid, role, stat line, thread ids)``.
    role: "engine" (the engine process, or ``root_role`` for the root itself), "target worker ranks", else the
    command name (tritonserver, the backend stubs, ...). The processes in ``prune`` (pids) are left out with
    their subtrees. Processes and threads that exit while being read are skipped."""
    stack = [root_pid]
    while stack:
        pid = stack.pop()
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            tids = [int(t.name) for t in Path(f"/proc/{pid}/task").iterdir()]
        except (OSError, ValueError):  # the process is gone
            continue
        if pid in prune:
            continue
        comm = stat[stat.index("(") + 1:stat.rindex(")")]
        for tid in tids:  # a thread that exits meanwhile must not hide the process or its other children
            try:
                stack += [int(c) for c in Path(f"/proc/{pid}/task/{tid}/children").read_text().split()]
            except (OSError, ValueError):
                pass
        role = (root_role if pid == root_pid and root_role else "engine" if "splitspec.serving.engine_process" in cmdline else
                "target worker ranks" if "splitspec.engine.worker" in cmdline else comm)
        yield pid, role, stat, tids


def cpu_seconds(root_pid: int, root_role: str | None = None, prune: Collection[int] = ()) -> dict[str, float]:
    """User + system CPU seconds so far of the processes of :func:`process_tree`, summed by role."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for _, role, stat, _ in process_tree(root_pid, root_role, prune):
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) ": field 3 (state) onwards
        out[role] = out.get(role, 0.0) + (int(fields[11]) + int(fields[12])) / tick  # utime + stime (fields 14, 15)
    return out


def core_plan(rest_cores: int | None = None) -> dict[str, set[int]]:
    """CPUs for ``--pin``: one CPU of a physical core for the engine's process, one of another for its target worker
    ranks (their SMT siblings left idle), and for everything else every CPU of the other physical cores — or of only
    the next ``rest_cores`` of them (physical cores in the order of their first CPU, the first one skipped). Read from
    ``/sys/devices/system/cpu/*/topology``.

    Raises:
        ValueError: fewer than 4 physical cores are allowed to this process, or ``rest_cores`` is not 1 to the number of
            cores left.
    """
    allowed = sorted(os.sched_getaffinity(0))
    cores: dict[str, set[int]] = {}
    for cpu in allowed:
        path = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list")
        key = path.read_text().strip() if path.exists() else str(cpu)
        cores.setdefault(key, set()).add(cpu)
    physical = list(cores.values())
    if len(physical) < 4:
        raise ValueError(f"--pin needs at least 4 physical cores (this process may use {len(physical)}: CPUs {allowed})")
    engine, workers = physical[1], physical[2]  # not the first core, where the system's interrupts tend to land
    if rest_cores is not None and not 1 <= rest_cores <= len(physical) - 3:
        raise ValueError(f"--serving-cores {rest_cores}: expected 1..{len(physical) - 3} (physical cores allowed to this "
                         f"process besides the first, the engine's and its workers')")
    rest = set(allowed) - engine - workers if rest_cores is None else set().union(*physical[3:3 + rest_cores])
    return {"engine": {min(engine)}, "target worker ranks": {min(workers)}, "rest": rest}


def pin(root_pid: int, plan: dict[str, set[int]], root_cpus: set[int] | None = None, prune: Collection[int] = ()) -> None:
    """Set the CPU affinity of every thread of :func:`process_tree` by role (:func:`core_plan`): the engine
    process and the target worker ranks to their cores, all else to ``plan["rest"]``; with ``root_cpus``, the
    root process (all its threads) to those instead.

    Raises:
        PermissionError: affinity may not be changed here.
    """
    for pid, role, _, tids in process_tree(root_pid, prune=prune):
        cpus = root_cpus if pid == root_pid and root_cpus is not None else plan.get(role, plan["rest"])
        for tid in tids:
            try:
                os.sched_setaffinity(tid, cpus)
            except ProcessLookupError:  # the thread exited
                pass


def cpu_spent(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """CPU seconds per role between two :func:`cpu_seconds` readings (a role in only one reading: 0 for the other)."""
    return {k: round(after.get(k, 0.0) - before.get(k, 0.0), 3) for k in sorted(before.keys() | after.keys())}
