"""The engine in a process of its own (what ``spec_decode`` serves through): same tokens as in this process,
cancellation, refused requests, load errors, and a dead target worker reported once and clearly."""

from __future__ import annotations

import os
import signal
import threading

import pytest

from splitspec.engine.plan import EngineError
from splitspec.serving.engine_process import EngineProcess
from splitspec.serving.warm_up import warm_up, warm_up_plan
from splitspec.serving.engine_messages import CycleMessages, pack_cycle_stats, pack_event, unpack_event
from splitspec.errors import CheckpointError
from splitspec.runtime.scheduler import SpeculativeEngine
from splitspec.runtime.types import CycleStats, Request, RequestOutput, RequestStats
from splitspec.runtime.tokenizer import ChatTokenizer
from splitspec.settings import ServeConfig

PROMPTS = ["def fibonacci(n):", "import os\n", "x"]


class Events:
    """Collects what an EngineProcess reports (its reader thread calls in)."""

    def __init__(self):
        self.by_sid: dict[int, list] = {}
        self.done: dict[int, threading.Event] = {}
        self.cycles = 0
        self.failed: list[str] = []

    def on_cycle(self, events, cycle_stats):  # the reader thread: record only (an exception would stop it)
        self.cycles += isinstance(cycle_stats, CycleStats)
        for sid, ev, _finishing in events:
            self.by_sid.setdefault(sid, []).append(ev)
            if ev.finished:
                self.done.setdefault(sid, threading.Event()).set()

    def wait(self, sid, timeout_s=120):
        assert self.done.setdefault(sid, threading.Event()).wait(timeout_s), f"request {sid} did not finish"
        return self.by_sid[sid]


def test_events_and_cycle_stats_cross_as_tuples_unchanged():
    stats = RequestStats(num_prompt_tokens=5, num_output_tokens=9, num_cycles=3, acceptance_length=3.0,
                         accepted_per_position=[3, 2, 1], draft_ms=1.5, verify_ms=2.5, ttft_ms=4.0, e2e_ms=9.5,
                         queue_ms=0.1, synthetic=True)
    events = [RequestOutput(7, [1, 2, 3], "abc", False), RequestOutput(7, [4], "d", True, "length", stats),
              RequestOutput(8, [], "", True, "error", None, "worker died")]
    for i, ev in enumerate(events):
        assert unpack_event(pack_event(40 + i, ev, i == 0)) == (40 + i, ev, i == 0)
    cs = CycleStats(2, 17, 1.25, 3.5, [4, 1], [1, 1, 0], 12, 96, 3, 2, True)
    assert CycleStats(*pack_cycle_stats(cs)) == cs and pack_cycle_stats(None) is None


def _ev(sid: int, finished: bool = False, finishing: bool = False) -> tuple:
    return pack_event(sid, RequestOutput(sid, [] if finished else [7], "", finished, "length" if finished else None), finishing)


def test_cycle_messages_hold_back_only_deltas_between_a_requests_first_and_last_event():
    m = CycleMessages(overlap=True)
    sent = lambda content: [t[0] for t in content[0]] if content else None  # noqa: E731 - sids of the sent events

    assert m.launched() is None  # step 1: request 1's first event goes at once
    m.add(_ev(1))
    m.set_stats(("s1",))
    assert sent(m.after_step(True)) == [1]
    assert m.launched() is None  # step 2: a delta of request 1 waits for the next launch, with its statistics
    m.add(_ev(1))
    m.set_stats(("s2",))
    assert m.after_step(True) is None
    assert m.launched() == ([_ev(1)], ("s2",))  # step 3: sent once the GPU work is queued
    m.add(_ev(1))
    m.add(_ev(2))  # request 2's first event: the whole step's events go at once
    assert sent(m.after_step(True)) == [1, 2]
    assert m.launched() is None  # step 4: request 2 finishes (a finishing delta and its final event)
    m.add(_ev(1))
    m.add(_ev(2, finishing=True))
    m.add(_ev(2, finished=True))
    assert sent(m.after_step(True)) == [1, 2, 2]
    m.launched()
    m.add(_ev(1))
    assert sent(m.after_step(False)) == [1]  # no work left: no next launch to wait for
    m.add(_ev(1))
    assert sent(m.after_step(True)) == [1]  # a step that queued no GPU work (nothing launched)
    m.launched()
    m.add(_ev(1))
    assert m.after_step(True) is None and sent(m.take()) == [1]  # stopping: what waited is taken
    assert m.take() is None

    plain = CycleMessages(overlap=False)
    plain.add(_ev(5))
    plain.after_step(True)
    plain.launched()
    plain.add(_ev(5))
    assert sent(plain.after_step(True)) == [5]


@pytest.fixture(scope="module")
def tok(built_engines):
    return ChatTokenizer.from_dir(built_engines / "target")


def _same_token_requests(tok) -> list[Request]:
    return [Request(tok.encode(p), 16, num_draft_tokens=3, stop_token_ids=set()) for p in PROMPTS]


@pytest.fixture(scope="module")
def expected(built_engines, tok) -> list[list[int]]:
    """The tokens of :func:`_same_token_requests` from the engine in this process."""
    with SpeculativeEngine.load(ServeConfig(built_engines, num_draft_tokens=3)) as eng:
        return [r.token_ids for r in eng.run(_same_token_requests(tok))]


@pytest.mark.parametrize("overlap", [False, True])
def test_same_tokens_cancel_refusal_and_close(built_engines, tok, expected, overlap):
    """``overlap``: events sent while the next cycle runs (the GPU default; here forced on the CPU)."""
    reqs = _same_token_requests(tok)
    ev = Events()
    proc = EngineProcess(ServeConfig(built_engines, num_draft_tokens=3), ev.on_cycle, ev.failed.append, overlap_output=overlap)
    try:
        assert proc.info["kv_blocks"] == proc.gauges["kv_total"] > 0 and len(proc.info["worker_pids"]) == 1
        for sid, r in enumerate(reqs, start=1):
            proc.submit(sid, r)
        for sid, want in enumerate(expected, start=1):
            got = ev.wait(sid)
            assert [t for e in got for t in e.token_ids] == want
            assert got[-1].finish_reason == "length" and got[-1].stats.num_output_tokens == len(want)
        assert ev.cycles > 0

        proc.submit(10, Request(tok.encode(PROMPTS[0]), 200, stop_token_ids=set()))
        proc.cancel(10)
        assert ev.wait(10)[-1].finish_reason == "cancelled"
        proc.submit(11, Request(tok.encode("x"), 100_000))  # never servable: refused as its one event
        [refused] = ev.wait(11)
        assert refused.finish_reason == "rejected" and "max_seq_len" in refused.error and refused.stats is None
        proc.submit(12, Request(tok.encode("x"), 4, stop_token_ids=5))  # malformed: refused, the engine keeps serving
        proc.submit(13, "not a request")
        assert "stop_token_ids" in ev.wait(12)[-1].error and "not a valid request" in ev.wait(13)[-1].error
        assert proc.gauges["active"] == 0 and not ev.failed
    finally:
        proc.close()
    assert not proc.alive()


def test_callbacks_cannot_stop_the_reader(built_engines, tok):
    """An on_cycle that raises, or that submits (refused there: it could deadlock), leaves the reader draining."""
    ev, refused = Events(), []

    def on_cycle(events, cycle_stats):
        ev.on_cycle(events, cycle_stats)
        for sid, e, _ in events:
            if sid == 1 and e.finished:
                try:
                    proc.submit(99, Request(tok.encode("x"), 2))
                except EngineError as err:
                    refused.append(str(err))
            if sid == 2:
                raise RuntimeError("a bug in the callback")

    proc = EngineProcess(ServeConfig(built_engines, num_draft_tokens=3), on_cycle, ev.failed.append)
    try:
        for sid in (1, 2, 3):
            proc.submit(sid, Request(tok.encode(PROMPTS[sid - 1]), 6, stop_token_ids=set()))
        for sid in (1, 2, 3):
            assert ev.wait(sid)[-1].finish_reason == "length"
        assert len(refused) == 1 and "on_cycle" in refused[0] and 99 not in ev.by_sid and not ev.failed
    finally:
        proc.close()


def test_a_corrupt_engine_json_is_named_with_its_field(built_engines, tmp_path):
    import json

    from splitspec.engine.engine_files import read_engine_meta

    good = json.loads((built_engines / "target" / "engine.json").read_text())
    for change, says in (({"config": {}}, "field 'rope' missing"), ({"limits": dict(good["limits"], max_seq_len="lots")}, "limits.max_seq_len"),
                         ({"mapping": {}}, "field 'tp_size' missing"), ({"kind": "drafter"}, "expected 'target'")):
        (tmp_path / "engine.json").write_text(json.dumps(dict(good, **change)))
        with pytest.raises(CheckpointError, match=says):
            read_engine_meta(tmp_path, "target")
    (tmp_path / "engine.json").write_text("[1, 2]")
    with pytest.raises(CheckpointError, match="expected a JSON object"):
        read_engine_meta(tmp_path, "target")


def test_load_error_is_the_engines(tmp_path):
    with pytest.raises(CheckpointError, match="engine.json"):
        EngineProcess(ServeConfig(tmp_path), lambda *a: None, lambda m: None)


def _hold_sockets(pid: int) -> list[int]:
    """Copies in this process of every socket of process ``pid`` (pidfd_getfd(2)), so that its connections outlive it,
    as when a child it forked still holds them: a peer blocked in a collective with it then waits for the collective
    timeout instead of failing at once. Empty where the kernel refuses (before Linux 5.6, or ptrace not allowed)."""
    import ctypes

    libc, held = ctypes.CDLL(None, use_errno=True), []
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:
        return held
    try:
        for name in os.listdir(f"/proc/{pid}/fd"):
            try:
                if not os.readlink(f"/proc/{pid}/fd/{name}").startswith("socket:"):
                    continue
            except OSError:
                continue
            fd = libc.syscall(438, pidfd, int(name), 0)  # SYS_pidfd_getfd (x86-64 and arm64 alike)
            if fd < 0:
                break
            held.append(fd)
    finally:
        os.close(pidfd)
    return held


@pytest.mark.parametrize("overlap", [False, True])
def test_dead_worker_fails_the_engine_once_with_its_pid(built_engines, tok, overlap):
    """The worker dies while rank 0 waits for it inside a collective, and its sockets stay open (held here): the
    engine process fails the request at once, naming the worker, not after the collective timeout; once the
    collective fails too (the sockets closed), the loop's own error events for it are dropped."""
    ev = Events()
    proc = EngineProcess(ServeConfig(built_engines, num_draft_tokens=3), ev.on_cycle, ev.failed.append, overlap_output=overlap)
    held: list[int] = []
    try:
        proc.submit(1, Request(tok.encode(PROMPTS[0]), 200, stop_token_ids=set()))
        pid = proc.info["worker_pids"][0]
        for _ in range(3000):  # its first token: rank 0 now runs a cycle after another with the worker
            if ev.by_sid.get(1):
                break
            threading.Event().wait(0.01)
        os.kill(pid, signal.SIGSTOP)  # rank 0 blocks in the cycle's next collective with it
        held = _hold_sockets(pid)
        threading.Event().wait(0.2)
        os.kill(pid, signal.SIGKILL)
        last = ev.wait(1, timeout_s=30)[-1]
        why = f"target worker rank 1 (pid {pid}) exited with status -9"
        assert last.finish_reason == "error" and last.error == why and ev.failed == [why]
        with pytest.raises(EngineError, match="exited with status -9"):
            proc.submit(2, Request(tok.encode("x"), 4))
        for fd in held:  # the blocked collective fails now
            os.close(fd)
        held = []
    finally:
        for fd in held:
            os.close(fd)
        proc.close()
    assert not proc.alive()
    assert [e.finished for e in ev.by_sid[1]].count(True) == 1 and ev.by_sid[1][-1] is last


def test_dead_engine_process_is_reported_once_and_takes_its_workers(built_engines, tok):
    ev = Events()
    proc = EngineProcess(ServeConfig(built_engines, num_draft_tokens=3), ev.on_cycle, ev.failed.append)
    try:
        workers = proc.info["worker_pids"]
        proc.submit(1, Request(tok.encode(PROMPTS[0]), 200, stop_token_ids=set()))
        os.kill(proc.pid, signal.SIGKILL)
        for _ in range(200):  # the reader sees the socket close
            if ev.failed:
                break
            threading.Event().wait(0.05)
        assert ev.failed == [f"the engine process (pid {proc.pid}) exited with status -9"]
        with pytest.raises(EngineError, match="exited with status -9"):
            proc.submit(2, Request(tok.encode("x"), 4))
    finally:
        proc.close()
    for _ in range(200):  # its worker ranks end too (their group broke)
        if not any(os.path.exists(f"/proc/{pid}") and open(f"/proc/{pid}/stat").read().split()[2] != "Z" for pid in workers):
            break
        threading.Event().wait(0.1)
    else:
        pytest.fail(f"worker processes {workers} outlived their engine process")


def test_warm_up_runs_every_batch_bucket_and_k_and_leaves_the_engine_empty(built_engines):
    """The requests run before ready on GPUs (so that compiling and graph capture are not the first clients' wait):
    one run per batch bucket up to max_batch_size and per k in use, each logged; they hold nothing after."""
    assert warm_up_plan(64, [4, 2, 4]) == [(b, k) for b in (1, 2, 4, 8, 16, 32, 64) for k in (2, 4)]
    assert warm_up_plan(3, [0]) == [(1, 0), (2, 0), (3, 0)]
    lines: list[str] = []
    with SpeculativeEngine.load(ServeConfig(built_engines, num_draft_tokens=2, max_batch_size=3)) as eng:
        assert warm_up(eng, lines.append) > 0
        assert not eng.has_work() and eng.num_active == 0 and eng.num_queued == 0 and eng.alloc.used == 0
    assert [line.split(":")[1] for line in lines] == [" warm-up batch 1, k 2", " warm-up batch 2, k 2",
                                                      " warm-up batch 3, k 2"], lines
