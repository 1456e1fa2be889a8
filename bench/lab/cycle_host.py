#!/usr/bin/env python3
"""Host time of a steady cycle's two phases: what :meth:`RankRunner.draft_padded` and :meth:`RankRunner.verify_padded`
cost the CPU before (and around) their CUDA-graph replays, per call and per function.

A synthetic engine at the demo pair's widths (:func:`splitspec.build.synthetic.write_synthetic_engines`, ``tiny``,
float32) is loaded in a :class:`splitspec.engine.rank.RankRunner` on the CPU. Its graph caches are replaced by
:class:`HostOnlyGraphs`, which does what :meth:`GraphCache.run` does on the host at a replay — copy the device inputs
the host copies (not the staging buffer, whose copy up is inside the graph, nor the aux hand-off, read in place) and
return the captured outputs — but runs no model: the first call per key computes the outputs once, eagerly, and
later calls only copy. What remains of a call is the host's preparation (padded inputs, row tables, aux states, the
staging buffer's fill) plus those copies: on a GPU the part during which the device waits for the host. The
CUDA-only pieces (pinned allocation, events, the graph launch) are not in it, and a copy is a CPU memcpy here, not a
launch.

For each batch B the script builds a steady plan (every sequence at ``--position``, k + 1 accepted rows, distinct
blocks of ``--max-seq-len`` tokens each), runs the two phases a few times, then reports the median µs per call of each
(``--reps`` timed calls), and with ``--profile`` a cProfile table of the functions with the most own time::

    PYTHONPATH=src python3 bench/lab/cycle_host.py --batches 1,4,16 --ks 1,5 --profile

``--steps N``: whole scheduler steps instead (:meth:`SpeculativeEngine.step`: admission, the plan, both phases,
acceptance, emitting), B greedy requests of N new tokens each through the same host-only graphs, µs per step for
each k (0: no speculation): the host's part of a steady cycle, which on a GPU is the time between cycles plus the
phases' preparation. The CPU row includes the verify's argmax over [B · (k + 1), V] logits (a kernel on a GPU)::

    PYTHONPATH=src python3 bench/lab/cycle_host.py --steps 300 --batches 1,16 --ks 0,1,3

``--temperature T`` (with ``--steps``): sampled requests (seeded, top_p 0.95), their acceptance decided on the device.
``--ahead`` (with ``--steps``): draft-ahead on, its steps launching the next cycle's draft after the verify instead of
preparing their own draft first; on a GPU that draft then runs while the host does the rest of the step.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from splitspec.engine.graphs import GraphCache

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for lab.draft_profile, as draft_profile does
from lab.draft_profile import levels, steady_plan


class HostOnlyGraphs(GraphCache):
    """A CPU :class:`GraphCache` whose replay runs no model: per key, the inputs' static copies and the outputs of one
    eager run at the first call; every call then does the host's part of a GPU replay — copies the inputs the host
    copies there (not a staging buffer, whose copy up is inside the graph, nor a shared buffer, read in place) — and
    returns those outputs. Shared buffers are handed out as on a GPU, so the verify → draft hand-off of aux states
    (:meth:`RankRunner.handoff`) runs its bookkeeping and copies as there."""

    def __init__(self):
        super().__init__("cpu")

    def shared(self, name, shape, dtype):
        return self._buffer(name, shape, dtype)

    def run(self, key, fn, *inputs):
        entry = self.graphs.get(key)
        if entry is None:  # the key's staging buffer and shared buffers stand for themselves: never copied after
            own = [e[0] for e in self.host.values()] + list(self.buffers.values())
            static = [x if any(x is b for b in own) else x.clone() for x in inputs]
            entry = self.graphs[key] = (static, fn(*static))
        static, outputs = entry
        for buf, x in zip(static, inputs):
            if x is not buf:
                buf.copy_(x, non_blocking=True)
        return outputs


def tiny_engines(tmp: Path, max_batch: int, max_seq_len: int) -> Path:
    """Tiny synthetic engines (one layer, TP1, the demo pair's widths) in ``tmp``; their folder."""
    from splitspec.build.synthetic import write_synthetic_engines

    return write_synthetic_engines(tmp, num_layers=1, tp_size=1, max_batch_size=max_batch, max_seq_len=max_seq_len,
                                   max_draft_len=8, tiny=True)


def host_only(rank):
    """``rank`` (a :class:`RankRunner`) with one :class:`HostOnlyGraphs` for the target and every drafter slot."""
    rank.graphs = HostOnlyGraphs()
    rank.slots = {tp: (m, c, rank.graphs) for tp, (m, c, _) in rank.slots.items()}
    rank._use(rank.draft_tp)
    if rank.ahead is not None:  # draft-ahead's graphs too, reading the verify's hand-off in place as on a GPU
        rank.ahead.graphs = HostOnlyGraphs()
        rank.ahead.graphs.buffers = rank.graphs.buffers
    return rank


def runner(tmp: Path, max_batch: int, max_seq_len: int):
    """A CPU :class:`RankRunner` over tiny synthetic engines, its graph caches host-only."""
    from splitspec.engine.rank import RankRunner
    from splitspec.models.layers import TPComm

    eng = tiny_engines(tmp, max_batch, max_seq_len)
    return host_only(RankRunner(eng, 0, 1, TPComm(), "cpu", placements=(1,), compile=False))


def draft_lengths(text: str) -> list[int]:
    """--ks: a comma list of integers ≥ 0 (0 only with --steps, checked in :func:`main`)."""
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        out = []
    if not out or min(out) < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a comma list of integers ≥ 0")
    return out


STEPS_PROMPT = list(range(5, 40))  # --steps: every request's prompt


def engine_steps(tmp: Path, batches: list[int], ks: list[int], tokens: int, max_seq_len: int = 4096,
                 ahead: bool = False, temperature: float = 0.0) -> None:
    """Print µs per :meth:`SpeculativeEngine.step` for B greedy requests of ``tokens`` new tokens (the module docstring),
    every step of a run timed (prefill steps included: ``tokens`` ≫ 1 makes them rare), on engines of ``max_seq_len``
    (at least :data:`STEPS_PROMPT`'s length + ``tokens`` + max(ks) + 1, checked in :func:`main`). ``ahead``: with
    draft-ahead (``ServeConfig.draft_ahead``), whose steps launch the next draft instead of preparing their own.
    ``temperature`` > 0: sampled requests instead (seeded, top_p 0.95)."""
    from splitspec.runtime.scheduler import SpeculativeEngine
    from splitspec.runtime.types import Request, SamplingParams
    from splitspec.settings import ServeConfig

    eng_dir = tiny_engines(tmp, max(batches), max_seq_len)
    with SpeculativeEngine.load(ServeConfig(eng_dir, padded=True, max_batch_size=max(batches), draft_ahead=ahead)) as eng:
        host_only(eng.group.rank0)
        kind = f"sampled at temperature {temperature}" if temperature else "greedy"
        print(f"host µs per scheduler step, {kind}, {tokens} tokens per request" + (", draft-ahead" if ahead else ""), flush=True)
        print(f"{'B':>3} {'k':>2} {'steps':>6} {'µs per step':>12}", flush=True)
        for B in batches:
            for k in ks:
                sampling = lambda i: SamplingParams(temperature, top_p=0.95, seed=i) if temperature else SamplingParams()  # noqa: E731
                requests = lambda: [Request(list(STEPS_PROMPT), tokens, sampling(i), num_draft_tokens=k,  # noqa: E731
                                            stop_token_ids=set()) for i in range(B)]
                eng.run(requests())  # graphs (here: first outputs) for every shape the run meets
                times, step = [], eng.step

                def timed_step():
                    t = time.perf_counter()
                    out = step()
                    times.append(time.perf_counter() - t)
                    return out

                eng.step = timed_step
                try:
                    eng.run(requests())
                finally:
                    eng.step = step
                print(f"{B:>3} {k:>2} {len(times):>6} {statistics.median(times) * 1e6:12.1f}", flush=True)


def phases(rank, plan):
    """(draft, verify): the two phases of ``plan`` as callables of no argument; the drafts come from one draft."""
    drafts = rank.draft_padded(plan)
    return (lambda: rank.draft_padded(plan)), (lambda: rank.verify_padded(plan, drafts))


def per_call_us(fn, reps: int) -> float:
    """Median µs of one call of ``fn`` over ``reps`` calls (after three untimed ones)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6


def profile_table(fn, calls: int, top: int) -> str:
    """cProfile of ``calls`` calls of ``fn``: the ``top`` functions by own time (µs per call of ``fn``)."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    stats = pstats.Stats(prof, stream=io.StringIO())
    rows = sorted(((tt, ct, nc, f) for f, (_, nc, tt, ct, _) in stats.stats.items()), key=lambda r: -r[0])
    lines = [f"    {'own µs':>8} {'cum µs':>8} {'calls':>6}  function"]
    for tt, ct, nc, (file, line, name) in rows[:top]:
        where = f"{Path(file).name}:{line}" if line else file
        lines.append(f"    {tt / calls * 1e6:8.1f} {ct / calls * 1e6:8.1f} {nc / calls:6.1f}  {name} ({where})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=levels, default=[1, 4, 16])
    ap.add_argument("--ks", type=draft_lengths, default=[1, 5], help="draft lengths (at most 8; 0 with --steps)")
    ap.add_argument("--position", type=int, default=100, help="every sequence's position (tokens known)")
    ap.add_argument("--max-seq-len", type=int, default=4096, help="the engine's max_seq_len: blocks per sequence")
    ap.add_argument("--reps", type=int, default=200, help="timed calls per phase")
    ap.add_argument("--profile", action="store_true", help="also a cProfile table per phase")
    ap.add_argument("--top", type=int, default=12, help="functions per profile table")
    ap.add_argument("--steps", type=int, default=0, metavar="N", help="whole scheduler steps instead, requests of N tokens")
    ap.add_argument("--ahead", action="store_true", help="with --steps: draft-ahead on (ServeConfig.draft_ahead)")
    ap.add_argument("--temperature", type=float, default=0.0, help="with --steps: sampled requests at this temperature")
    a = ap.parse_args(argv)
    if a.reps < 1 or a.top < 1:
        ap.error(f"--reps {a.reps}, --top {a.top}: expected at least 1 each")
    if max(a.ks) > 8 or min(a.ks) < (0 if a.steps else 1):
        ap.error("--ks at most 8 (at least 1 without --steps)")
    if (a.ahead or a.temperature) and not a.steps:
        ap.error("--ahead and --temperature go with --steps (whole scheduler steps)")
    if not 0 <= a.temperature <= 100:
        ap.error(f"--temperature {a.temperature}: expected 0 (greedy) .. 100")
    if a.steps < 0:
        ap.error(f"--steps {a.steps}: expected N ≥ 1 new tokens per request (0: the phases instead)")
    if a.steps and len(STEPS_PROMPT) + a.steps + max(a.ks) + 1 > a.max_seq_len:
        ap.error(f"--steps {a.steps}: a request's {len(STEPS_PROMPT)} prompt tokens + N + max(--ks) + 1 exceed "
                 f"--max-seq-len {a.max_seq_len}")
    if not a.steps and not a.max_seq_len - 9 >= a.position >= 9:
        ap.error("--position in 9 .. max_seq_len − 9")
    torch.set_num_threads(1)
    from splitspec.models.kv import BLOCK_SIZE

    if a.steps:
        with tempfile.TemporaryDirectory(prefix="cycle-host-") as tmp:
            engine_steps(Path(tmp), a.batches, a.ks, a.steps, a.max_seq_len, a.ahead, a.temperature)
        return 0
    with tempfile.TemporaryDirectory(prefix="cycle-host-") as tmp, torch.inference_mode():
        rank = runner(Path(tmp), max(a.batches), a.max_seq_len)
        per_seq = -(-a.max_seq_len // BLOCK_SIZE)
        print(f"host µs per call (median of {a.reps}), position {a.position}, max_seq_len {a.max_seq_len}", flush=True)
        print(f"{'B':>3} {'k':>2} {'window':>6} {'draft µs':>9} {'verify µs':>10}", flush=True)
        for B in a.batches:
            for k in a.ks:
                plan = steady_plan(B, k, a.position, per_seq)
                for w in plan.work:
                    rank.aux[w.sid] = torch.zeros(k + 1, 3 * rank.drafter.cfg.target_hidden_size)
                draft, verify = phases(rank, plan)
                d, v = per_call_us(draft, a.reps), per_call_us(verify, a.reps)
                print(f"{B:>3} {k:>2} {rank.window_for(plan):>6} {d:9.1f} {v:10.1f}", flush=True)
                if a.profile:
                    print(f"  draft_padded, B={B} k={k}:\n{profile_table(draft, a.reps, a.top)}", flush=True)
                    print(f"  verify_padded, B={B} k={k}:\n{profile_table(verify, a.reps, a.top)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
