"""The engine's GPU path (NCCL tensor parallelism, CUDA graphs per batch bucket): greedy speculative decoding on
GPU gives exactly the tokens of target-only greedy decoding on GPU, for both draft placements, with the
speculative cycles replayed from CUDA graphs. Runs where CUDA exists (the target at TP2 on two GPUs, TP1 on
one, where only the TP1 drafter is a distinct placement); skipped elsewhere. With two GPUs also the TP1 drafter
on a GPU of its own, cycles run by the serving loop's thread (:class:`EngineLoop`), and both placements loaded
with the drafting one switched every cycle."""

from __future__ import annotations

import threading

import pytest
import torch

from splitspec.runtime.scheduler import SpeculativeEngine
from splitspec.runtime.loop import EngineLoop
from splitspec.runtime.types import Request
from splitspec.settings import ServeConfig

pytestmark = pytest.mark.gpu  # skipped without CUDA (tests/conftest.py)

PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n", "class Stack:\n    def push(self, x):", "x = [i * i for i in"]


def _through_loop(eng: SpeculativeEngine, requests: list[Request]) -> list[tuple[list[int], float]]:
    """Run ``requests`` together on an :class:`EngineLoop` (the serving path's thread); (tokens, acceptance length) each."""
    out: dict[int, list[int]] = {}
    last: dict[int, object] = {}
    done = threading.Semaphore(0)
    loop = EngineLoop(eng)
    try:
        def on_event(i, ev):  # the loop's thread: record only (an exception here would stop the loop)
            out.setdefault(i, []).extend(ev.token_ids)
            if ev.finished:
                last[i] = ev
                done.release()

        for i, req in enumerate(requests):
            loop.submit(req, lambda ev, i=i: on_event(i, ev))
        for _ in requests:
            assert done.acquire(timeout=300), "a request did not finish"
    finally:
        loop.stop()
    assert all(last[i].error is None for i in last), [last[i].error for i in last]
    return [(out[i], last[i].stats.acceptance_length) for i in range(len(requests))]


def _recorded(eng: SpeculativeEngine) -> list[list[list[int]]]:
    """Record every cycle's drafts of ``eng`` (each cycle: the drafts of its sequences in request order)."""
    cycles: list[list[list[int]]] = []
    run = eng.group.run

    def recording(plan, *a):
        out = run(plan, *a)
        cycles.append([out.drafts[sid] for sid in sorted(out.drafts)])
        return out

    eng.group.run = recording
    return cycles


def _runs(engines_dir, draft_device_id: int) -> dict:
    """Target TP1 on GPU 1, the drafter on GPU ``draft_device_id``: target-only greedy tokens (``ref``), then k = 3 on
    the loading thread (``spec``) and on the serving loop's thread, whose current device starts as GPU 0 (``looped``),
    each as (tokens, acceptance length) per prompt; every cycle's drafts of both (``drafts``); whether the draft graphs
    live in a cache of their own with graphs in it (``own_graphs``)."""
    with SpeculativeEngine.load(ServeConfig(engines_dir, target_device_ids=[1], draft_device_id=draft_device_id, draft_tp=1,
                                                max_batch_size=2)) as eng:
        ids = [eng.tokenizer.encode(p) for p in PROMPTS]
        ref = [r.token_ids for r in eng.run([Request(i, 40, num_draft_tokens=0, stop_token_ids=set()) for i in ids])]
        drafts = _recorded(eng)
        spec = [(r.token_ids, r.stats.acceptance_length)
                for r in eng.run([Request(i, 40, num_draft_tokens=3, stop_token_ids=set()) for i in ids])]
        runner = eng.group.rank0
        own_graphs = runner.draft_graphs is not runner.graphs and bool(runner.draft_graphs.graphs)
        looped = _through_loop(eng, [Request(i, 40, num_draft_tokens=3, stop_token_ids=set()) for i in ids])
    return {"ref": ref, "spec": spec, "looped": looped, "drafts": drafts, "own_graphs": own_graphs}


def _check_own_gpu(engines_dir) -> None:
    """The drafter on GPU 0, the target on GPU 1: greedy speculation equals target-only greedy on both threads, the
    draft graphs are captured on the drafter's GPU, and every cycle drafts what the same drafter beside the target
    (GPU 1) drafts. The test pair has random weights, so acceptance stays near 1 either way: the drafts themselves
    show whether the draft graphs compute (a graph that recorded none of its GPU's kernels replays its capture-time
    drafts)."""
    own, beside = _runs(engines_dir, 0), _runs(engines_dir, 1)
    assert own["own_graphs"], "no draft graph on the drafter's GPU"
    assert not beside["own_graphs"], "the drafter beside the target got a graph cache of its own"
    assert [t for t, _ in own["spec"]] == own["ref"], "drafter on its own GPU: speculative output differs from target-only greedy"
    assert [t for t, _ in own["looped"]] == own["ref"], "through the serving loop: speculative output differs from target-only greedy"
    assert own["ref"] == beside["ref"] and own["spec"] == beside["spec"] and own["looped"] == beside["looped"]
    assert len(own["drafts"]) == len(beside["drafts"])
    drafting = [c for c in beside["drafts"] if any(c)]
    # drafts that change from cycle to cycle: a graph replaying its capture-time drafts would repeat one set
    assert len(drafting) > 10 and len({repr(c) for c in drafting}) > 1, f"the drafter beside the target drafted {drafting[:5]}"
    for i, (a, b) in enumerate(zip(own["drafts"], beside["drafts"])):
        assert a == b, f"cycle {i}: drafts on the drafter's own GPU {a} differ from the drafter beside the target {b}"


@pytest.mark.timeout(600)
def test_drafter_on_its_own_gpu(engines_for):
    """First in this file, so the process's first engine with CUDA graphs."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    _check_own_gpu(engines_for(1))


@pytest.mark.timeout(600)  # compiling the layers takes a minute or two; an NCCL hang must not take forever
@pytest.mark.parametrize("placement", ["draft_tp=1", "draft_tp=N", "draft_tp=1, pdl", "draft_tp=1, ahead"])
def test_speculative_greedy_on_gpu_equals_target_only(engines_for, placement):
    """Both placements, and the TP1 drafter with programmatic dependent launch (``ServeConfig.pdl``) or drafting ahead
    (``ServeConfig.draft_ahead``)."""
    n = min(2, torch.cuda.device_count())
    if placement == "draft_tp=N" and n == 1:
        pytest.skip("one GPU: the sharded drafter is the TP1 drafter")
    draft_tp = n if placement == "draft_tp=N" else 1
    with SpeculativeEngine.load(ServeConfig(engines_for(n), target_device_ids=list(range(n)), draft_tp=draft_tp, max_batch_size=2,
                                            pdl=placement.endswith("pdl"), draft_ahead=placement.endswith("ahead"))) as eng:
        ids = [eng.tokenizer.encode(p) for p in PROMPTS]
        ref = [r.token_ids for r in eng.run([Request(i, 40, num_draft_tokens=0, stop_token_ids=set()) for i in ids])]
        assert all(len(r) == 40 for r in ref)
        for k in (1, 3, 5):
            before = len(eng.group.rank0.graphs.graphs)
            got = [r.token_ids for r in eng.run([Request(i, 40, num_draft_tokens=k, stop_token_ids=set()) for i in ids])]
            assert got == ref, f"{placement}, k={k}: speculative output differs from target-only greedy"
            # a new k means new static shapes: its draft and verify cycles were captured as graphs
            assert len(eng.group.rank0.graphs.graphs) > before, f"{placement}, k={k}: no CUDA graph captured"


@pytest.mark.timeout(600)
def test_steady_cycle_waits_for_the_gpu_once(engines_for):
    """A steady cycle (draft graph, then verify graph) makes the host wait for the GPU once: at the copy of its
    verified tokens and drafts. ``torch.cuda.set_sync_debug_mode("warn")`` warns at every call that synchronises
    the host with a device (a synchronise, a copy from ordinary host memory, ``.item()``, ``.tolist()``)."""
    import warnings

    n = min(2, torch.cuda.device_count())
    with SpeculativeEngine.load(ServeConfig(engines_for(n), target_device_ids=list(range(n)), draft_tp=1, max_batch_size=2)) as eng:
        ids = [eng.tokenizer.encode(p) for p in PROMPTS[:2]]
        eng.run([Request(i, 40, num_draft_tokens=3, stop_token_ids=set()) for i in ids])  # captures the graphs
        ref = [r.token_ids for r in eng.run([Request(i, 40, num_draft_tokens=0, stop_token_ids=set()) for i in ids])]
        run, waits, got = eng.group.run, [], {}

        def counted(plan, *a):
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    out = run(plan, *a)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            if plan.padded_k:
                waits.append([f"{w.filename}:{w.lineno}" for w in seen if "synchroniz" in str(w.message)])
            return out

        eng.group.run = counted
        for i, r in enumerate(ids):
            eng.submit(Request(r, 40, num_draft_tokens=3, stop_token_ids=set()), lambda ev, i=i: got.setdefault(i, []).extend(ev.token_ids))
        with torch.inference_mode():
            while eng.has_work():
                eng.step()
    assert [got[i] for i in range(len(ids))] == ref
    assert len(waits) > 5, f"only {len(waits)} steady cycles"
    assert all(len(w) == 1 for w in waits), f"host waits per steady cycle: {waits[:3]}"
    assert len({w[0] for w in waits}) == 1 and "engine/rank.py:" in waits[0][0], waits[:3]  # the one copy's line


@pytest.mark.timeout(600)
def test_switching_placement_every_cycle_on_gpu(engines_for, tmp_path):
    """Both placements loaded (tuning.json per bucket), the drafting one switched every cycle: the drafter K/V moves
    between the TP1 and sharded layouts over NCCL and every cycle drafts what the TP1 drafter alone drafts, in the
    CUDA-graph path; the output is target-only greedy."""
    import itertools
    import json
    import shutil

    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    eng_dir = tmp_path / "e"
    shutil.copytree(engines_for(2), eng_dir)
    (eng_dir / "tuning.json").write_text(json.dumps({"draft_tp_by_batch": {"1": 1, "2": 2}, "k_by_batch": {"1": 3, "2": 3}}))
    runs = {}
    for name, dtp in (("alone", 1), ("switching", None)):
        with SpeculativeEngine.load(ServeConfig(eng_dir, target_device_ids=[0, 1], draft_tp=dtp, max_batch_size=2)) as eng:
            ids = [eng.tokenizer.encode(p) for p in PROMPTS]
            ref = [r.token_ids for r in eng.run([Request(i, 40, num_draft_tokens=0, stop_token_ids=set()) for i in ids])]
            placed, turns = [], itertools.cycle([2, 1])
            if dtp is None:
                assert eng.group.placements == (1, 2)
                eng.draft_tp_for, eng.switch_after = lambda batch: next(turns), 1  # no hysteresis: switch every cycle
                eng.on_cycle = lambda stats: placed.append(eng.group.draft_tp)
            drafts = _recorded(eng)
            got = [r.token_ids for r in eng.run([Request(i, 40, num_draft_tokens=3, stop_token_ids=set()) for i in ids])]
            assert got == ref, f"{name}: speculative output differs from target-only greedy"
            runs[name] = (drafts, placed, len(eng.group.rank0.graphs.graphs))
    (alone, _, _), (switching, placed, graphs) = runs["alone"], runs["switching"]
    assert sum(a != b for a, b in zip(placed, placed[1:])) > 20 and graphs > 0
    assert len([c for c in alone if any(c)]) > 10
    for i, (a, b) in enumerate(zip(switching, alone)):
        assert a == b, f"cycle {i} (draft_tp {placed[i] if i < len(placed) else '?'}): drafts {a} differ from the TP1 drafter alone's {b}"
    assert len(switching) == len(alone)


@pytest.mark.timeout(600)
def test_drafter_on_its_own_gpu_after_other_engines(engines_for):
    """Last in this file: the same, after other engines (TP2, NCCL, their CUDA graphs) ran in this process."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    _check_own_gpu(engines_for(1))
