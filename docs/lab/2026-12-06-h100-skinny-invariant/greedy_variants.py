"""bf16 demo pair, target TP1: greedy speculation (k 1, 3, 5) against target-only greedy with skinny_gemm on, every
class left to cuBLAS (only the MoE layer's invariant form changes), and every class on the multiply-add form with its
folds switched off; prints which match and, per prompt, the first differing token. Which part of the engine leaves
target-only greedy with the multiply-add form on (section 3 of this entry). Not run yet:

    PYTHONPATH=src python3 docs/lab/2026-12-06-h100-skinny-invariant/greedy_variants.py models/demo
"""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path
import torch
from splitspec.build.engines import build_pair
from splitspec.models import skinny_gemm
from splitspec.runtime.scheduler import SpeculativeEngine
from splitspec.runtime.types import Request
from splitspec.settings import ServeConfig

engines = build_pair(Path(sys.argv[1]), Path(tempfile.mkdtemp()), max_seq_len=256, quiet=True, dtype="bfloat16")
prompts = ["def fibonacci(n):", "import os\nimport sys\n", "class Stack:\n    def push(self, x):", "x = [i * i for i in"]
variants = {"on, all cuBLAS": (True, None), "on, fma, no folds": (True, (8, 256, 4, 2, 0))}
folds = skinny_gemm.folds
for name, (on, cfg) in variants.items():
    skinny_gemm.CONFIGS.clear()
    skinny_gemm.DEFAULT_CONFIG = cfg  # None: every class stays with cuBLAS
    skinny_gemm.folds = (lambda w: False) if name.endswith("no folds") else folds
    torch._dynamo.reset()
    with SpeculativeEngine.load(ServeConfig(engines, target_device_ids=[0], draft_tp=1, max_batch_size=1, skinny_gemm=on)) as eng:
        ids = [eng.tokenizer.encode(p) for p in prompts]
        ref = [r.token_ids for r in eng.run([Request(i, 48, num_draft_tokens=0, stop_token_ids=set()) for i in ids])]
        out = []
        for k in (1, 3, 5):
            got = [r.token_ids for r in eng.run([Request(i, 48, num_draft_tokens=k, stop_token_ids=set()) for i in ids])]
            first = [next((j for j, (a, b) in enumerate(zip(g, r)) if a != b), None) for g, r in zip(got, ref)]
            out.append(f"k{k}: {'equal' if got == ref else 'first differences at ' + str(first)}")
    print(f"{name:16} {'; '.join(out)}", flush=True)
