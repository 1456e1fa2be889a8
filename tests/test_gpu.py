"""The engine's GPU path (NCCL tensor parallelism, CUDA graphs per batch bucket): greedy speculative decoding on
GPU gives exactly the tokens of target-only greedy decoding on GPU, for both draft placements, with the
speculative cycles replayed from CUDA graphs. Runs where CUDA exists (the target at TP2 on two GPUs, TP1 on
one, where only the TP1 drafter is a distinct placement); skipped elsewhere. With two GPUs also the TP1 drafter
on a GPU of its own, cycles run by the serving loop's thread (:class:`EngineLoop`)."""

from __future__ import annotations

import threading

import pytest
import torch

from splitspec.runtime import EngineLoop, Request, SpeculativeEngine

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

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


def _own_gpu_runs(engines_dir) -> tuple[list[list[int]], list[tuple[list[int], float]], list[tuple[list[int], float]], bool]:
    """Target TP1 on GPU 1, drafter on GPU 0 (not the target's): target-only greedy tokens, then k = 3 on the loading
    thread and on the serving loop's thread (whose current device starts as GPU 0). Returns ``(reference tokens,
    [(tokens, acceptance)] on the loading thread, the same through the loop, whether the draft graphs live in a
    cache of their own with graphs in it)``."""
    with SpeculativeEngine.load(engines_dir, target_device_ids=[1], draft_device_id=0, draft_tp=1, max_batch_size=2) as eng:
        ids = [eng.tokenizer.encode(p) for p in PROMPTS]
        ref = [r.token_ids for r in eng.run([Request(i, 40, num_draft_tokens=0, stop_token_ids=set()) for i in ids])]
        spec = [(r.token_ids, r.stats.acceptance_length)
                for r in eng.run([Request(i, 40, num_draft_tokens=3, stop_token_ids=set()) for i in ids])]
        runner = eng.group.rank0
        own_graphs = runner.draft_graphs is not runner.graphs and bool(runner.draft_graphs.graphs)
        looped = _through_loop(eng, [Request(i, 40, num_draft_tokens=3, stop_token_ids=set()) for i in ids])
    return ref, spec, looped, own_graphs


def _check_tokens(ref, spec, looped, own_graphs) -> None:
    assert own_graphs, "no draft graph on the drafter's GPU"
    assert [t for t, _ in spec] == ref, "drafter on its own GPU: speculative output differs from target-only greedy"
    assert [t for t, _ in looped] == ref, "through the serving loop: speculative output differs from target-only greedy"


def _stale(spec, looped) -> str | None:
    """Why the drafts look stale (acceptance ~1: a draft graph that recorded nothing replays its capture-time drafts;
    the tokens stay right because the target verifies them), or None."""
    acc = [a for _, a in spec] + [a for _, a in looped]
    return None if min(acc) > 1.5 else f"acceptance lengths {acc} (loading thread, then loop): the drafts look stale"


@pytest.mark.timeout(600)
def test_drafter_on_its_own_gpu(engines_for):
    """First in this file, so the process's first engine with CUDA graphs: the draft graphs are captured on the
    drafter's GPU and the verify graphs on the target's; greedy speculation equals target-only greedy, and the drafts
    are live, on the loading thread and through the serving loop."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    ref, spec, looped, own_graphs = _own_gpu_runs(engines_for(1))
    _check_tokens(ref, spec, looped, own_graphs)
    assert _stale(spec, looped) is None, _stale(spec, looped)


@pytest.mark.timeout(600)  # compiling the layers takes a minute or two; an NCCL hang must not take forever
@pytest.mark.parametrize("placement", ["draft_tp=1", "draft_tp=N"])
def test_speculative_greedy_on_gpu_equals_target_only(engines_for, placement):
    n = min(2, torch.cuda.device_count())
    if placement == "draft_tp=N" and n == 1:
        pytest.skip("one GPU: the sharded drafter is the TP1 drafter")
    draft_tp = 1 if placement == "draft_tp=1" else n
    with SpeculativeEngine.load(engines_for(n), target_device_ids=list(range(n)), draft_tp=draft_tp, max_batch_size=2) as eng:
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
def test_drafter_on_its_own_gpu_after_other_engines(engines_for):
    """Last in this file, after other engines ran in this process: the tokens must still equal target-only greedy.
    Known bug: here the drafts were stale (acceptance 1.0 on both threads, 2 x H200), which this test reports as an
    expected failure until it is fixed (a lead: docs/performance.md, 'What the GPU path does')."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    ref, spec, looped, own_graphs = _own_gpu_runs(engines_for(1))
    _check_tokens(ref, spec, looped, own_graphs)
    if (why := _stale(spec, looped)) is not None:
        pytest.xfail(f"known bug, drafter on its own GPU after other engines in the process: {why}")
