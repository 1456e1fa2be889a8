"""The engine's GPU path (NCCL tensor parallelism, CUDA graphs per batch bucket): greedy speculative decoding on
GPU gives exactly the tokens of target-only greedy decoding on GPU, for both draft placements, with the
speculative cycles replayed from CUDA graphs. Runs where CUDA exists (the target at TP2 on two GPUs, TP1 on
one, where only the TP1 drafter is a distinct placement); skipped elsewhere."""

from __future__ import annotations

import pytest
import torch

from splitspec.runtime import Request, SpeculativeEngine

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
