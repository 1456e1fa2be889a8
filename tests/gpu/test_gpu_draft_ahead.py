"""Draft-ahead on a GPU (``ServeConfig.draft_ahead``): the next cycle's draft replayed from a CUDA graph of its own pool
behind this cycle's verify, its acceptance decided on the device. Greedy output stays target-only greedy, most steady
cycles use the drafts launched ahead, and both phases are timed on the GPU's clock; synthetic and sampled requests
accept alike with it on and off."""

from __future__ import annotations

import pytest
import torch

from splitspec.runtime.scheduler import SpeculativeEngine
from splitspec.runtime.types import Request, SamplingParams
from splitspec.settings import ServeConfig

pytestmark = pytest.mark.gpu  # skipped without CUDA (tests/conftest.py)

PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n", "class Stack:\n    def push(self, x):", "x = [i * i for i in"]


@pytest.mark.timeout(600)
def test_draft_ahead_on_gpu_is_lossless_and_used(engines_for):
    with SpeculativeEngine.load(ServeConfig(engines_for(1), target_device_ids=[0], draft_tp=1, max_batch_size=2,
                                            draft_ahead=True)) as eng:
        ids = [eng.tokenizer.encode(p) for p in PROMPTS]
        ref = [r.token_ids for r in eng.run([Request(i, 40, num_draft_tokens=0, stop_token_ids=set()) for i in ids])]
        runner = eng.group.rank0
        take, taken = runner.drafts_ahead, []
        runner.drafts_ahead = lambda plan: (d := take(plan), taken.append(d is not None))[0]
        phases = []
        eng.on_cycle = lambda cs: phases.append((cs.draft_ms, cs.verify_ms))
        for k in (1, 3, 5):
            got = [r.token_ids for r in eng.run([Request(i, 40, num_draft_tokens=k, stop_token_ids=set()) for i in ids])]
            assert got == ref, f"k={k}: speculative output with draft-ahead differs from target-only greedy"
        assert runner.ahead.graphs.graphs, "no draft-ahead graph captured"
        assert sum(taken) > len(taken) // 2, f"drafts launched ahead used in {sum(taken)} of {len(taken)} steady cycles"
        assert all(d >= 0 and v >= 0 for d, v in phases) and max(d for d, _ in phases) > 0
        # synthetic acceptance is drawn before the cycle: the same counts as without draft-ahead, from the same seeds
        counts = []
        for ahead in (True, False):
            eng.group.config = eng.config = eng.config.replace(draft_ahead=ahead)
            eng.synthetic = [0.9, 0.6, 0.4]
            res = eng.run([Request(i, 40, SamplingParams(seed=5 + n), num_draft_tokens=3, stop_token_ids=set())
                           for n, i in enumerate(ids)])
            counts.append([(r.stats.num_cycles, r.stats.accepted_per_position) for r in res])
        assert counts[0] == counts[1]
        # sampled requests: decided on the device in every steady cycle, so the same seeds give the same tokens and
        # acceptance with draft-ahead on and off; with it on, the drafts launched ahead are used
        eng.synthetic, sampled, taken[:] = None, [], []
        for ahead in (True, False):
            eng.group.config = eng.config = eng.config.replace(draft_ahead=ahead)
            res = eng.run([Request(i, 40, SamplingParams(0.8, top_p=0.95, seed=9 + n), num_draft_tokens=3,
                                   stop_token_ids=set()) for n, i in enumerate(ids)])
            sampled.append([(r.token_ids, r.stats.accepted_per_position) for r in res])
            if ahead:
                assert sum(taken) > len(taken) // 2, f"sampled: ahead drafts used in {sum(taken)} of {len(taken)} cycles"
        assert sampled[0] == sampled[1]
    torch.cuda.synchronize()
