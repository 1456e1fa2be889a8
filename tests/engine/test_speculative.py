"""Lossless speculation and tensor parallelism: every TP size and every k give target-only greedy output."""

from __future__ import annotations

import random

import pytest
import torch

from splitspec.engine.group import Group
from splitspec.models.batch import single_blocks
from splitspec.runtime.scheduler import SpeculativeEngine
from splitspec.runtime.types import Request
from splitspec.runtime.tokenizer import ChatTokenizer
from splitspec.settings import ServeConfig

PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n\n\nclass Config:\n    def __init__(self"]


@pytest.fixture(scope="module")
def tok(demo_models):
    return ChatTokenizer.from_dir(demo_models / "target")


@pytest.fixture(scope="module")
def reference(engines_for, tok):
    """Target-only greedy tokens and prompt logits from the TP1 engine."""
    out = {}
    with SpeculativeEngine.load(ServeConfig(engines_for(1))) as eng:
        for p in PROMPTS:
            out[p] = eng.generate(tok.encode(p), 24, num_draft_tokens=0, stop_token_ids=set()).token_ids
        for p, logits in zip(PROMPTS, _prompt_logits(eng, [tok.encode(p) for p in PROMPTS])):
            out[p, "logits"] = logits
    return out


class Loaded:
    """``loaded(padded)`` → the default deployment's engine (TP2, ``ServeConfig(engines, padded=padded)``), kept loaded
    for the tests that only send it requests, one after the other (a test that replaces a part of it does so through
    ``monkeypatch``, which puts the part back). A process holds one target group at a time: asking for the other
    ``padded`` closes this one, and :meth:`close` makes way for a test's own group."""

    def __init__(self, engines):
        self.engines, self.loaded = engines, {}

    def __call__(self, padded: bool = False) -> SpeculativeEngine:
        if padded not in self.loaded:
            self.close()
            self.loaded[padded] = SpeculativeEngine.load(ServeConfig(self.engines, padded=padded))
        return self.loaded[padded]

    def close(self) -> None:
        while self.loaded:
            self.loaded.popitem()[1].close()


@pytest.fixture(scope="module")
def loaded(built_engines):
    shared = Loaded(built_engines)
    yield shared
    shared.close()


@pytest.fixture
def own_group(loaded):
    """For a test that makes a target group of its own: the module's loaded engines are closed first."""
    loaded.close()


def _prompt_logits(eng, prompts: list[list[int]]) -> list[torch.Tensor]:
    """Logits of every position of each prompt (token ids) through the whole group: [len(ids), V] per prompt. Cycle p
    prefills token p of every prompt that long, each prompt a sequence of its own (final: one logits row each)."""
    from splitspec.engine.plan import CyclePlan, SeqWork

    blocks = [single_blocks(s, 256) for s in range(len(prompts))]
    rows: list[list[torch.Tensor]] = [[] for _ in prompts]
    with torch.inference_mode():
        for p in range(max(map(len, prompts))):
            live = [s for s, ids in enumerate(prompts) if p < len(ids)]
            logits = eng.group.run(CyclePlan([SeqWork(s, blocks[s], "prefill", p, [prompts[s][p]], final=True) for s in live])).logits
            assert logits.shape[0] == len(live)
            for s, row in zip(live, logits):
                rows[s].append(row)
    return [torch.stack(r) for r in rows]


@pytest.mark.parametrize("tp,ep", [(2, 1), (8, 1), (4, 2), (8, 8)])
def test_tp_engine_equals_tp1(own_group, engines_for, tok, reference, tp, ep):
    """TP-N (expert-TP and expert-parallel splits) gives TP1's logits and greedy tokens, with speculation on (the
    prompts prefilled and decoded together, as TP1's were one at a time)."""
    with SpeculativeEngine.load(ServeConfig(engines_for(tp, ep))) as eng:
        assert len(eng.group.procs) == tp - 1
        prompts = [tok.encode(p) for p in PROMPTS]
        for p, logits in zip(PROMPTS, _prompt_logits(eng, prompts)):
            assert (logits - reference[p, "logits"]).abs().max() < 1e-4
        results = eng.run([Request(ids, 24, num_draft_tokens=3, stop_token_ids=set()) for ids in prompts])
        assert [r.token_ids for r in results] == [reference[p] for p in PROMPTS]
        pids = [q.pid for q in eng.group.procs]
    assert all(not _alive(pid) for pid in pids), "worker processes outlived close()"


def _alive(pid: int) -> bool:
    import os
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("k", [1, 2, 4, 6])
def test_speculative_greedy_equals_target_only(loaded, tok, reference, k):
    eng = loaded()
    for p in PROMPTS:
        res = eng.generate(tok.encode(p), 24, num_draft_tokens=k, stop_token_ids=set())
        assert res.token_ids == reference[p]
        assert 1.0 <= res.acceptance_length <= k + 1


class OracleDrafter:
    """Wraps the real drafter (so its KV cache and positions are exercised) but proposes the target's own
    greedy continuation, corrupted with probability ``p_wrong``: acceptance lengths well above 1."""

    def __init__(self, inner, continuation: list[int], offset: int, p_wrong: float, seed: int):
        self.inner, self.cont, self.offset, self.p_wrong = inner, continuation, offset, p_wrong
        self.rng = random.Random(seed)

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def forward(self, batch, hidden, cache):
        self.rows_pos = batch.positions[batch.logits_rows].tolist()
        return self.inner.forward(batch, hidden, cache)

    def draft(self, batch, hidden, cache):  # the padded draft phase's step: this wrapper's forward and propose
        logits, h = self.forward(batch, hidden, cache)
        return self.propose(logits), h[batch.logits_rows]

    def propose(self, logits):
        out = []
        for p in self.rows_pos:
            idx = p + 2 - self.offset  # drafter row j predicts token j + 2
            right = self.cont[idx] if 0 <= idx < len(self.cont) else 0
            out.append(right if self.rng.random() >= self.p_wrong else (right + 1) % 4096)
        return torch.tensor(out)


@pytest.mark.parametrize("k,p_wrong,padded", [(1, 0.2, False), (3, 0.2, False), (5, 0.1, False), (4, 0.0, False),
                                               (3, 0.2, True), (4, 0.0, True)])
def test_acceptance_paths_are_lossless(loaded, tok, reference, k, p_wrong, padded, monkeypatch):
    """With drafts that are often right, accepted prefixes, bonus tokens and KV overwrite of rejected
    positions still give exactly the target-only tokens; acceptance statistics add up. ``padded``: steady
    cycles run in the static-shape form the GPU path captures in CUDA graphs (here eager, on the CPU)."""
    p = PROMPTS[1]
    ids = tok.encode(p)
    eng = loaded(padded)
    monkeypatch.setattr(eng.group.rank0, "drafter", OracleDrafter(eng.group.rank0.drafter, reference[p], len(ids), p_wrong, seed=k))
    res = eng.generate(ids, 24, num_draft_tokens=k, stop_token_ids=set())
    assert res.token_ids == reference[p]
    assert res.acceptance_length > 1.0 + (k > 1)
    assert res.acceptance_length * res.num_cycles == pytest.approx(24 - 1)  # first token comes from prefill
    # each cycle emits its accepted drafts plus one target token, unless max_tokens cut the last cycle short
    assert sum(res.accepted_per_position) + res.num_cycles in (23, 24)
    assert all(a >= b for a, b in zip(res.accepted_per_position, res.accepted_per_position[1:]))
    if p_wrong == 0.0:
        assert res.acceptance_length == pytest.approx(23 / -(-23 // (k + 1)))


@pytest.mark.parametrize("padded", [True, False])  # True first: the acceptance tests before end with the padded engine
def test_on_launched_runs_once_per_cycle_before_its_events(loaded, tok, padded, monkeypatch):
    """``SpeculativeEngine.on_launched`` (where the engine process sends the previous cycle's events) runs once in
    every step that runs a cycle, before that cycle's events; steady cycles (``padded``) and eager ones alike."""
    order, steady = [], []
    eng = loaded(padded)
    run = eng.group.run
    monkeypatch.setattr(eng.group, "run", lambda plan, *a: (run(plan, *a), steady.append(plan.padded_k is not None))[0])
    monkeypatch.setattr(eng, "on_launched", lambda: order.append("L"))
    eng.submit(Request(tok.encode(PROMPTS[0]), 12, num_draft_tokens=3, stop_token_ids=set()), lambda ev: order.append("E"))
    while eng.has_work():
        order.append("S")
        eng.step()
    steps = "".join(order).split("S")[1:]
    assert steps and all(s.startswith("L") and s.count("L") == 1 for s in steps), steps
    assert "".join(steps).count("E") >= 2 and any(steady) == padded


def test_stop_token_inside_accepted_drafts(loaded, tok, reference, monkeypatch):
    """A stop token among accepted drafts ends output exactly there."""
    p = PROMPTS[1]
    ids, ref = tok.encode(p), reference[p]
    stop = ref[9]
    first = ref.index(stop)
    eng = loaded()
    monkeypatch.setattr(eng.group.rank0, "drafter", OracleDrafter(eng.group.rank0.drafter, ref, len(ids), 0.0, seed=0))
    res = eng.generate(ids, 24, num_draft_tokens=4, stop_token_ids={stop})
    assert res.token_ids == ref[: first + 1] and res.finish_reason == "stop"
    capped = eng.generate(ids, 7, num_draft_tokens=4, stop_token_ids=set())
    assert capped.token_ids == ref[:7] and capped.finish_reason == "length"


def test_request_limits_are_checked(loaded):
    from splitspec.errors import ConfigError

    eng = loaded()
    with pytest.raises(ConfigError, match="max_seq_len"):
        eng.generate([1] * 200, 100, 4)
    with pytest.raises(ConfigError, match="empty"):
        eng.generate([], 10)
    with pytest.raises(ConfigError, match=r"vocabulary \[0, \d+\): 5000 at position 1, -1 at position 2, 7000 at "
                                          r"position 3 and 1 more$"):
        eng.generate([1, 5000, -1, 7000, 9999], 10)
    with pytest.raises(ConfigError, match="num_draft_tokens"):
        eng.generate([1, 2], 10, 99)
    assert len(eng.generate([1, 2, 3], 5, stop_token_ids=set()).token_ids) == 5  # still serving


def test_target_group_reports_dead_worker(own_group, engines_for):
    from splitspec.engine.plan import EngineError

    from splitspec.engine.plan import CyclePlan, SeqWork

    group = Group(ServeConfig(engines_for(2)))
    try:
        group.procs[0].kill()
        group.procs[0].wait()
        with pytest.raises(EngineError, match="rank 1"):
            group.run(CyclePlan([SeqWork(0, [0], "prefill", 0, [1, 2, 3])]))
    finally:
        group.close()


def test_close_after_an_interrupted_plan_broadcast_kills_the_workers(own_group, engines_for):
    """A KeyboardInterrupt between broadcast_object_list's two broadcasts (size, bytes) leaves the worker expecting
    bytes; a shutdown plan would reach it as its size header (UnpicklingError, a traceback). close() kills instead,
    at once, and still leaves the group so that another can be made."""
    import time

    from splitspec.engine.group import SHUTDOWN_WAIT_S
    from splitspec.engine.plan import CyclePlan, SeqWork

    group = Group(ServeConfig(engines_for(2)))
    procs = list(group.procs)
    group.run(CyclePlan([SeqWork(0, [0], "prefill", 0, [1, 2, 3])]))  # the group works
    group._sending_plan = True  # as left by an interrupted _send_plan
    t0 = time.monotonic()
    group.close()
    assert time.monotonic() - t0 < SHUTDOWN_WAIT_S  # no wait for a shutdown plan
    assert [p.returncode for p in procs] == [-9]  # killed, not ended by an error
    Group(ServeConfig(engines_for(2))).close()  # the process group was left: a new one can be made


def _recording_drafts(eng) -> list:
    """Make ``eng`` record every cycle's drafts (``{sequence: [draft ids]}`` as CycleOutput gives them)."""
    seen, run = [], eng.group.run
    eng.group.run = lambda plan, *a: seen.append((out := run(plan, *a)).drafts) or out
    return seen


@pytest.mark.parametrize("padded", [False, True])
def test_switching_draft_placement_every_cycle_keeps_the_drafts(own_group, built_engines, tok, reference, padded, tmp_path):
    """Both placements loaded (per-bucket placement from tuning.json) and the drafting one switched on every
    cycle: the drafter K/V moves between the TP1 and sharded layouts, so every cycle's drafts are those of the
    TP1 drafter alone (the test pair's drafter is untrained: its drafts hang on the K/V it attends, not on
    being right), and the output is target-only greedy — one sequence at a time, then two together with a
    third admitted (prefilled) while they draft, one of them not drafting (k = 0). Then the default
    hysteresis: a placement wanted for fewer than ``switch_after`` cycles in a row never drafts."""
    import itertools
    import json
    import shutil

    eng_dir = tmp_path / "e"
    shutil.copytree(built_engines, eng_dir)
    (eng_dir / "tuning.json").write_text(json.dumps({"draft_tp_by_batch": {"1": 1, "2": 2}, "k_by_batch": {"1": 3, "2": 3}}))
    batch = [Request(tok.encode(p), 24, num_draft_tokens=k, stop_token_ids=set()) for p, k in zip(PROMPTS * 2, (3, 0, 2))]
    with SpeculativeEngine.load(ServeConfig(eng_dir, draft_tp=1, padded=padded)) as eng:
        assert eng.group.placements == (1,) and not eng.draft_tp_by_batch and eng.k_by_batch == {}  # tuned per bucket: not for TP1 alone
        alone = _recording_drafts(eng)
        for p in PROMPTS:
            eng.generate(tok.encode(p), 24, num_draft_tokens=3, stop_token_ids=set())
        batched = [r.token_ids for r in eng.run(batch)]
    with SpeculativeEngine.load(ServeConfig(eng_dir, padded=padded)) as eng:
        assert eng.group.placements == (1, 2) and eng.draft_tp_by_batch == {1: 1, 2: 2} and eng.k_by_batch == {1: 3, 2: 3}
        drafts, placed, turns = _recording_drafts(eng), [], itertools.cycle([2, 1])
        eng.draft_tp_for, eng.switch_after = lambda batch: next(turns), 1
        cycles = []
        eng.on_cycle = lambda stats: cycles.append(stats) or (stats.draft_tp and placed.append(stats.draft_tp))
        for p in PROMPTS:
            assert eng.generate(tok.encode(p), 24, stop_token_ids=set()).token_ids == reference[p]
        assert [r.token_ids for r in eng.run(batch)] == batched
        assert batched[:2] == [reference[p] for p in PROMPTS]
        eng.switch_after, before = 3, len(placed)  # the default: every other cycle wanting a switch is not enough
        eng.generate(tok.encode(PROMPTS[0]), 12, num_draft_tokens=2, stop_token_ids=set())
        assert len(set(placed[before:])) == 1
        eng.draft_tp_for = lambda batch: 3 - eng.group.draft_tp  # always the other: the third drafting cycle switches
        eng.generate(tok.encode(PROMPTS[0]), 12, num_draft_tokens=2, stop_token_ids=set())
        assert len(set(placed[before:])) == 2
    assert placed.count(1) > 10 and placed.count(2) > 10 and sum(a != b for a, b in zip(placed, placed[1:])) > 40
    # what the metrics count: the placement each drafting cycle drafted with, and the cycles where it changed
    assert sum(c.switched for c in cycles) == sum(a != b for a, b in zip(placed, placed[1:])) + (placed[0] != 1)
    assert all(c.draft_tp == 0 for c in cycles if not c.decode_seqs)
    assert [list(d.values()) for d in drafts[:len(alone)]] == [list(d.values()) for d in alone]
    assert sum(len(d) for c in alone for d in c.values()) > 60
