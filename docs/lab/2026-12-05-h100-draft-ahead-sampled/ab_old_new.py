"""Sampled decisions before and after blocked_cumsum, interleaved in one process on a GPU; then the dips of the GPU's
cumulative sums over runs of zero weights. The old module is 9e45e5e's acceptance.py, first written beside:

    git show 9e45e5e:src/splitspec/engine/acceptance.py > .old_acceptance.py
    PYTHONPATH=src python3 docs/lab/2026-12-05-h100-draft-ahead-sampled/ab_old_new.py
"""

import importlib.util
import statistics
import time

import torch

from splitspec.engine import acceptance as new
from splitspec.engine.plan import SeqWork
from splitspec.runtime.sampling import draw_cycle
from splitspec.runtime.types import SamplingParams

spec = importlib.util.spec_from_file_location("old_acceptance", ".old_acceptance.py")
old = importlib.util.module_from_spec(spec)
spec.loader.exec_module(old)
params, V = SamplingParams(0.8, 0.95, 0), 163840


def decide(module, work, logits, drafts):
    return module.sampled_rows(work, logits, drafts)[1].tolist()


print("B k  old_us new_us (median of 5 rounds x 20 calls, interleaved)")
for B, k in [(1, 1), (1, 3), (4, 3), (16, 1), (16, 3), (16, 5), (64, 3)]:
    g = torch.Generator().manual_seed(B * 100 + k)
    logits = (torch.randn(B, k + 1, V, generator=g) * 3).cuda()
    drafts = logits[:, :k].argmax(-1)
    work = [SeqWork(b, [], "decode", 0, [0], k=k, sampled=draw_cycle(params, k, g)) for b in range(B)]
    for module in (old, new):
        for _ in range(3):
            decide(module, work, logits, drafts)
    same = decide(old, work, logits, drafts) == decide(new, work, logits, drafts)
    times = {"old": [], "new": []}
    for _ in range(5):
        for name, module in (("old", old), ("new", new)):
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(20):
                decide(module, work, logits, drafts)
            times[name].append((time.perf_counter() - t) / 20 * 1e6)
    print(B, k, round(statistics.median(times["old"]), 1), round(statistics.median(times["new"]), 1),
          "same decisions" if same else "DIFFERENT", flush=True)

g = torch.Generator().manual_seed(0)
w = torch.rand(64, V, generator=g, dtype=torch.float64) ** 8
w[:, ::3] = 0.0
w = w.cuda()
for name, c in (("torch cumsum, 64 rows", w.cumsum(-1)), ("blocked, 64 rows", new.blocked_cumsum(w)),
                ("torch cumsum, 1 row", w[:1].cumsum(-1)), ("torch cumsum float32, 8 rows", w[:8].float().cumsum(-1))):
    d = c.diff(dim=-1)
    print(f"{name}: {int((d < 0).sum())} dips of {d.numel()}, largest relative "
          f"{float((-d.clamp(max=0) / c[..., 1:].clamp(min=1e-300)).max()):.2e}", flush=True)
