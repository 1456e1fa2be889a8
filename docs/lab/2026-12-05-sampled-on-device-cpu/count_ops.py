"""Count the aten ops (views included) that one steady cycle's sampled decisions dispatch, for B sequences at k 3 over
a 4096-token vocabulary, with the splitspec source tree given as the first argument (before d931553: one verify()
per sequence on the host; from it: sampled_rows for the batch).

    PYTHONPATH=src python3 docs/lab/2026-12-05-sampled-on-device-cpu/count_ops.py src 16
"""

import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, sys.argv[1])
from splitspec.runtime import sampling as S
from splitspec.runtime.types import SamplingParams


class Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


V, B, k = 4096, int(sys.argv[2]), 3
sp = SamplingParams(0.8, top_p=0.95)
g = torch.Generator().manual_seed(0)
logits = torch.randn(B, k + 1, V, generator=g) * 3
drafts = logits[:, :k].argmax(-1)
new = hasattr(S, "draw_cycle")
with Count() as c:
    if new:
        from splitspec.engine.acceptance import sampled_rows
        from splitspec.engine.plan import SeqWork

        work = [SeqWork(b, [], "decode", 0, [0], k=k, sampled=S.draw_cycle(sp, k, g)) for b in range(B)]
        sampled_rows(work, logits, drafts)[1].tolist()
    else:
        for b in range(B):
            S.verify(logits[b], drafts[b].tolist(), sp, g)
print("device decisions" if new else "host verify", f"B {B} k {k}: {c.n} aten ops dispatched")
