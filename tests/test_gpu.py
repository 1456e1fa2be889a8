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


@pytest.fixture(scope="module")
def own_gpu_runs(engines_for):
    """Target TP1 on GPU 1, drafter on GPU 0 (not the target's, and not the first-captured device): target-only
    greedy tokens, then k = 3 on the loading thread and on the serving loop's thread (whose current device starts
    as GPU 0). Returns ``(reference tokens, [(tokens, acceptance)] loading thread, same through the loop, whether
    the draft graphs live on their own cache with graphs in it)``."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    with SpeculativeEngine.load(engines_for(1), target_device_ids=[1], draft_device_id=0, draft_tp=1, max_batch_size=2) as eng:
        ids = [eng.tokenizer.encode(p) for p in PROMPTS]
        ref = [r.token_ids for r in eng.run([Request(i, 40, num_draft_tokens=0, stop_token_ids=set()) for i in ids])]
        spec = [(r.token_ids, r.stats.acceptance_length)
                for r in eng.run([Request(i, 40, num_draft_tokens=3, stop_token_ids=set()) for i in ids])]
        runner = eng.group.rank0
        own_graphs = runner.draft_graphs is not runner.graphs and bool(runner.draft_graphs.graphs)
        looped = _through_loop(eng, [Request(i, 40, num_draft_tokens=3, stop_token_ids=set()) for i in ids])
    return ref, spec, looped, own_graphs


@pytest.mark.timeout(600)
def test_drafter_on_its_own_gpu(own_gpu_runs):
    """The draft graphs are captured on the drafter's GPU and the verify graphs on the target's; greedy
    speculation equals target-only greedy on the loading thread and through the serving loop."""
    ref, spec, looped, own_graphs = own_gpu_runs
    assert own_graphs, "no draft graph on the drafter's GPU"
    assert [t for t, _ in spec] == ref, "drafter on its own GPU: speculative output differs from target-only greedy"
    assert [t for t, _ in looped] == ref, "through the serving loop: speculative output differs from target-only greedy"


@pytest.mark.timeout(600)
@pytest.mark.xfail(strict=False, reason="known bug: acceptance 1.0 (stale drafts) when this process ran other engines "
                   "before (this file run in full on 2 x H200); 2.29 / 2.60 / 3.25 / 2.79 on both threads as the "
                   "process's first engine")
def test_drafter_on_its_own_gpu_drafts_live(own_gpu_runs):
    """The drafts are live on both threads: a draft graph that recorded nothing replays its capture-time drafts,
    whose acceptance is ~1 (the tokens stay right: the target verifies them)."""
    _, spec, looped, _ = own_gpu_runs
    assert min(a for _, a in spec) > 1.5, f"acceptance lengths {[a for _, a in spec]}: the drafts look stale"
    assert min(a for _, a in looped) > 1.5, f"through the serving loop: acceptance lengths {[a for _, a in looped]}"
