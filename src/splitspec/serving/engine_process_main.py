"""The engine process's body (``python -m splitspec.serving.engine_process_main --fd N``, started by
:class:`splitspec.serving.engine_process.EngineProcess`, whose docstring gives the messages): load the engines, run
the loop, relay requests and events until told to stop or the host goes away."""

from __future__ import annotations

import argparse
import os
import pickle
import signal
import sys
import threading
import time
from multiprocessing.connection import Connection
from typing import Callable

from splitspec.engine.plan import EngineError
from splitspec.errors import SplitspecError
from splitspec.runtime.loop import EngineLoop
from splitspec.runtime.scheduler import SpeculativeEngine
from splitspec.runtime.types import RequestOutput
from splitspec.serving.engine_messages import CycleMessages, pack_cycle_stats, pack_event
from splitspec.serving.engine_shutdown import ShutdownSignals
from splitspec.serving.heartbeat import engine_heartbeat
from splitspec.serving.warm_up import warm_up

#: Seconds between two checks of the target's worker processes.
HEALTH_CHECK_S = 0.2


def _worker_failure(eng, loop) -> str | None:
    """Why the engine cannot serve (a dead worker first: clearer than the collective error it caused), or None."""
    try:
        eng.group.check_workers()
    except EngineError as e:
        return str(e)
    if not loop.healthy:
        return loop.error or "the engine loop stopped"
    return None


def serve(conn: Connection) -> int:
    """Body of the engine process: load the engines, run the loop, relay requests and events until told
    to stop or the host goes away."""
    import torch

    _, cfg, kwargs = conn.recv()
    cpu_threads = kwargs.get("cpu_threads")
    overlap = kwargs.get("overlap_output")
    if overlap is None:
        overlap = cfg.on_gpu
    eng = None
    try:
        eng = SpeculativeEngine.load(cfg)
        warm_up_s = warm_up(eng, lambda line: print(line, flush=True)) if cfg.on_gpu else None  # compile before ready, not on the first request
    except BaseException as e:  # reported to the host, which fails the model load
        if eng is not None:
            eng.close()  # a failed warm-up: its worker ranks go with it
        conn.send(("load_failed", type(e).__name__, str(e)))
        return 1
    if not cfg.on_gpu:  # rank 0 on the CPU: leave a core to the serving processes
        world = eng.group.world
        torch.set_num_threads(cpu_threads or max(1, min(torch.get_num_threads(), (os.cpu_count() or 1) // world - 1)))
    send_lock = threading.RLock()  # send_cycle takes and sends under it
    msgs = CycleMessages(overlap)
    rids: dict[int, int] = {}  # sid -> engine request id, while running

    def send(msg) -> None:
        data = pickle.dumps(msg, pickle.HIGHEST_PROTOCOL)  # read by Connection.recv
        with send_lock:
            conn.send_bytes(data)

    def send_cycle(take: Callable[[], tuple | None]) -> None:
        """Send the cycle message of ``take()``'s (events, stats), if any. Taken under the send lock: the loop thread
        and the main thread (a request's final error event, :meth:`EngineLoop.fail`) may both send, and a request's
        events must leave in the order they were taken."""
        with send_lock:
            content = take()
            if content is not None:
                send(("cycle", *content, gauges()))

    def on_event(sid: int, ev) -> None:  # the loop thread
        msgs.add(pack_event(sid, ev, not ev.finished and ev.request_id not in eng.seqs))
        if ev.finished:
            rids.pop(sid, None)

    def gauges() -> dict:
        return {"active": eng.num_active, "queued": eng.num_queued, "kv_used": eng.alloc.used,
                "kv_total": eng.alloc.num_blocks}

    eng.on_cycle = lambda cs: msgs.set_stats(pack_cycle_stats(cs))
    eng.on_launched = lambda: send_cycle(msgs.launched)  # the GPU is busy: what waited goes now
    heart = engine_heartbeat(cfg.run_dir)  # None without a run folder
    loop = EngineLoop(eng, after_step=lambda: send_cycle(lambda: msgs.after_step(eng.has_work())),
                      heartbeat=heart.beat if heart else None)
    failed = False
    stopping = ShutdownSignals()
    try:
        send(("ready", {"max_draft_len": eng.max_draft_len, "max_batch_size": eng.max_batch_size,
                        "max_seq_len": eng.max_seq_len, "vocab_size": eng.vocab_size, "kv_blocks": eng.alloc.num_blocks,
                        "block_size": eng.alloc.block_size, "worker_pids": [p.pid for p in eng.group.procs],
                        "torch_threads": torch.get_num_threads(), "draft_tp": eng.group.draft_tp,
                        "draft_tp_by_batch": eng.draft_tp_by_batch, "k": eng.num_draft_tokens, "k_by_batch": eng.k_by_batch,
                        "warm_up_s": warm_up_s}))
        next_check = time.monotonic() + HEALTH_CHECK_S
        while True:
            if conn.poll(HEALTH_CHECK_S):
                msg = conn.recv()
                if msg[0] == "submit":
                    sid, req = msg[1], msg[2]
                    try:
                        if not stopping.admitting:
                            raise EngineError("the server is shutting down: not admitting new requests")
                        rid = loop.submit(req, lambda ev, sid=sid: on_event(sid, ev))
                    except Exception as e:  # its one event: refused, or the engine stopped serving
                        # (request id -1: it never ran; spec_decode tells such an "error" from a request that failed
                        # alone while the engine serves on)
                        reason = "error" if isinstance(e, EngineError) else "rejected"
                        why = str(e) if isinstance(e, SplitspecError) else f"not a valid request: {type(e).__name__}: {e}"
                        refusal = ([pack_event(sid, RequestOutput(-1, [], "", True, reason, None, why), False)], None)
                        send_cycle(lambda: refusal)
                    else:
                        rids[sid] = rid
                        if rid not in eng.seqs:  # already finished (its final event popped nothing)
                            rids.pop(sid, None)
                elif msg[0] == "cancel":
                    rid = rids.get(msg[1])
                    if rid is not None:
                        loop.cancel(rid)
                elif msg[0] == "stop":
                    break
            if stopping.cancel_now():  # SIGTERM: what is in flight ends now, with a final event
                for rid in list(rids.values()):
                    loop.cancel(rid, "shutdown")
            if not failed and time.monotonic() >= next_check:
                next_check = time.monotonic() + HEALTH_CHECK_S
                reason = _worker_failure(eng, loop)
                if reason is not None:
                    failed = True
                    send(("failed", reason))
                    # every request still open ends now, named after the dead worker, from this thread: the loop
                    # thread may be blocked in a collective with that worker (until the collective timeout if the
                    # worker's sockets outlive it); what its cycle yields later is dropped
                    loop.fail(reason)
                    send_cycle(msgs.take)
    except (EOFError, OSError):  # the host went away
        pass
    finally:
        loop.stop()
        try:  # what was left waiting for a next cycle
            send_cycle(msgs.take)
        except OSError:
            pass
        eng.close()
        if heart is not None:
            heart.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--fd", type=int, required=True, help="this end of the socket pair to the host")
    a = p.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the host stops it (message or closed socket)
    return serve(Connection(a.fd))


if __name__ == "__main__":
    sys.exit(main())
