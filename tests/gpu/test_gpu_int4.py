"""INT4 routed experts on the GPU: the demo target with its experts written INT4 as Kimi-K2.5 publishes them,
built as ``build_pair`` builds an INT4 target (experts packed, the rest float32), target TP1 on GPU 0 with CUDA graphs and the
fused W4A16 kernels: greedy speculation gives exactly the tokens of target-only greedy decoding."""

from __future__ import annotations

import pytest

from splitspec.files import read_json
from splitspec.testing import fixtures

pytestmark = pytest.mark.gpu  # skipped without CUDA (tests/conftest.py)

PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n", "class Stack:\n    def push(self, x):", "x = [i * i for i in"]


def test_int4_engine_greedy_speculation_is_lossless_on_gpu(demo_models, tmp_path, monkeypatch):
    from splitspec.build.engines import build_pair
    from splitspec.models import int4_moe
    from splitspec.runtime.scheduler import SpeculativeEngine
    from splitspec.runtime.types import Request
    from splitspec.settings import ServeConfig

    models = tmp_path / "models"
    fixtures.write_int4_copy(demo_models / "target", models / "target")
    (models / "drafter").symlink_to(demo_models / "drafter", target_is_directory=True)
    engines = build_pair(models, tmp_path / "out", tp_size=1, max_batch_size=4, max_seq_len=256, quiet=True)
    assert read_json(engines / "target" / "engine.json")["dtype"] == "int4"
    calls = []
    fused = int4_moe.gate_up_call  # the decode kernels' first launch, alone or inside the INT4 MoE layer
    monkeypatch.setattr(int4_moe, "gate_up_call", lambda *a, **kw: calls.append(1) or fused(*a, **kw))
    with SpeculativeEngine.load(ServeConfig(engines, target_device_ids=[0], draft_device_id=0, max_batch_size=4)) as eng:
        ids = [eng.tokenizer.encode(p) for p in PROMPTS]
        ref = [r.token_ids for r in eng.run([Request(i, 40, num_draft_tokens=0, stop_token_ids=set()) for i in ids])]
        for k in (1, 3, 5):
            spec = [r.token_ids for r in eng.run([Request(i, 40, num_draft_tokens=k, stop_token_ids=set()) for i in ids])]
            assert spec == ref, k
    assert calls, "the fused INT4 kernels should serve decode batches on the GPU"
