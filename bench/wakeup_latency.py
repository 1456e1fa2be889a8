#!/usr/bin/env python3
"""How long one hop between two waiting threads or processes takes on this machine (µs).

A served request crosses about fifteen such hops (gRPC threads, the ensemble's Python-backend stubs, the engine
process); each wakes a thread that was asleep. This times a ping-pong of one byte, round trips halved:

- ``process``: two processes on a socket pair, each blocked in ``recv`` until the other writes;
- ``thread``: two threads of one process handing a token over ``threading.Event`` (on the CPUs this process may use;
  the processes above run on two CPUs of their own);
- ``process-polling``: the same socket pair, both sides polling with ``MSG_DONTWAIT`` instead of blocking (no
  sleep, no wake-up: the floor of the hop).

``--awake`` also runs a busy loop at ``SCHED_IDLE`` priority on every CPU this process may use while it measures:
such a loop yields to any other runnable thread at once, but keeps idle CPUs from halting. The difference to the
plain run is what waking a halted CPU costs (large in virtual machines, where a halted virtual CPU is woken
through the hypervisor).

    .venv/bin/python bench/wakeup_latency.py                 # prints one line per mode
    .venv/bin/python bench/wakeup_latency.py --awake --json out.json
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import signal
import socket
import statistics
import sys
import threading
import time
from pathlib import Path


def _echo(sock: socket.socket, other: socket.socket, n: int, polling: bool, cpu: int | None) -> None:
    other.close()  # the parent's end: once the parent is gone, recv here returns b""
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    try:
        for _ in range(n):
            b = _recv(sock, polling)
            if not b:
                return
            sock.send(b)
    except ConnectionError:  # the parent closed its end mid-exchange (it was stopped)
        return


def _recv(sock: socket.socket, polling: bool) -> bytes:
    if not polling:
        return sock.recv(1)
    while True:
        try:
            return sock.recv(1, socket.MSG_DONTWAIT)
        except BlockingIOError:
            pass


def hops_process(n: int, polling: bool, cpus: tuple[int, int] | None) -> list[float]:
    """One-way hop times in µs (round trip / 2) between this process and a child on a socket pair; with ``cpus``
    this process runs on ``cpus[0]`` and the child on ``cpus[1]`` (this process's CPUs are restored after)."""
    a, b = socket.socketpair()
    child = mp.get_context("fork").Process(target=_echo, args=(b, a, n, polling, cpus[1] if cpus else None), daemon=True)
    child.start()
    b.close()
    before = os.sched_getaffinity(0)
    if cpus:
        os.sched_setaffinity(0, {cpus[0]})
    out = []
    try:
        for _ in range(n):
            t = time.perf_counter_ns()
            a.send(b"x")
            _recv(a, polling)
            out.append((time.perf_counter_ns() - t) / 2e3)
    finally:
        os.sched_setaffinity(0, before)
        a.close()  # a child still waiting sees the end of the socket and exits
        child.join(10)
    return out


def hops_thread(n: int) -> list[float]:
    """One-way hop times in µs between two threads of this process (``threading.Event``)."""
    ping, pong = threading.Event(), threading.Event()

    def echo() -> None:
        for _ in range(n):
            ping.wait()
            ping.clear()
            pong.set()

    th = threading.Thread(target=echo, daemon=True)
    th.start()
    out = []
    for _ in range(n):
        t = time.perf_counter_ns()
        ping.set()
        pong.wait()
        pong.clear()
        out.append((time.perf_counter_ns() - t) / 2e3)
    th.join(10)
    return out


def _spin(cpu: int) -> None:
    parent = os.getppid()
    os.sched_setaffinity(0, {cpu})
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    while os.getppid() == parent:  # a parent killed outright (SIGKILL) cannot stop its loops: they stop themselves
        for _ in range(200_000):
            pass


class Awake:
    """Context manager: a ``SCHED_IDLE`` busy loop per CPU of ``cpus`` (none when ``cpus`` is empty)."""

    def __init__(self, cpus: set[int]):
        self.procs = [mp.get_context("fork").Process(target=_spin, args=(c,), daemon=True) for c in sorted(cpus)]

    def __enter__(self) -> "Awake":
        for p in self.procs:
            p.start()
        time.sleep(0.2)
        return self

    def __exit__(self, *exc) -> None:
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            p.join(5)


def summary(us: list[float]) -> dict:
    """Median, 90th percentile and mean of hop times (µs), the first 5% dropped as warm-up."""
    us = sorted(us[len(us) // 20:])
    return {"median_us": round(statistics.median(us), 1), "p90_us": round(us[int(0.9 * (len(us) - 1))], 1),
            "mean_us": round(statistics.fmean(us), 1), "hops": len(us)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-n", type=int, default=4000, help="round trips per mode (default 4000)")
    p.add_argument("--awake", action="store_true", help="also measure with SCHED_IDLE busy loops on every CPU")
    p.add_argument("--hold-awake-s", type=float, default=0.0,
                   help="only run the busy loops for this many seconds (to measure something else meanwhile)")
    p.add_argument("--cpus", help="with --hold-awake-s: only these CPUs, comma-separated (default: all allowed)")
    p.add_argument("--json", help="write the results here")
    a = p.parse_args(argv)
    cpus = sorted(os.sched_getaffinity(0))
    if a.n < 20:
        p.error(f"-n {a.n}: expected at least 20 round trips")
    if not (a.hold_awake_s >= 0 and math.isfinite(a.hold_awake_s)):
        p.error(f"--hold-awake-s {a.hold_awake_s}: expected a finite number of seconds >= 0")
    for name in ("json", "cpus"):
        if getattr(a, name) == "":
            p.error(f"--{name}: empty")
    if a.json:
        out = Path(a.json)
        if out.is_dir() or not out.parent.is_dir() or not os.access(out.parent, os.W_OK):
            p.error(f"--json {a.json}: expected a file in an existing, writable folder")
    if a.hold_awake_s > 0 and (a.awake or a.json):
        p.error("--hold-awake-s only runs the busy loops: it measures nothing (no --awake, no --json)")
    if a.cpus and not a.hold_awake_s > 0:
        p.error("--cpus chooses where --hold-awake-s runs its busy loops: give --hold-awake-s too")
    hold = set(cpus)
    if a.cpus:
        try:
            hold = {int(c) for c in a.cpus.split(",")}
        except ValueError:
            p.error(f"--cpus {a.cpus!r}: expected CPU numbers like 3,4")
        if not hold <= set(cpus):
            p.error(f"--cpus {a.cpus!r}: CPUs {sorted(hold - set(cpus))} are not allowed to this process (allowed: {cpus})")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a killed run still stops its busy loops (Awake's exit)
    if a.hold_awake_s > 0:
        with Awake(hold):
            time.sleep(a.hold_awake_s)
        return 0
    pair = (cpus[1], cpus[2]) if len(cpus) >= 3 else None
    results = {}
    for awake in ((False, True) if a.awake else (False,)):
        with Awake(set(cpus) if awake else set()):
            for mode in ("process", "thread", "process-polling"):
                if mode == "process-polling" and awake:
                    continue
                us = hops_thread(a.n) if mode == "thread" else hops_process(a.n, mode == "process-polling", pair)
                key = f"{mode}{' (cpus awake)' if awake else ''}"
                results[key] = summary(us)
                print(f"{key:28s} " + "  ".join(f"{k} {v}" for k, v in results[key].items()), flush=True)
    if a.json:
        from splitspec.files import write_atomic

        record = {"cpus": len(cpus), "n": a.n, "process_pair_cpus": list(pair) if pair else None,
                  "thread_cpus": cpus, "results": results}
        try:
            write_atomic(Path(a.json), json.dumps(record, indent=1) + "\n")
        except OSError as e:
            p.exit(2, f"{p.prog}: error: --json {a.json}: cannot write it ({e})\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
