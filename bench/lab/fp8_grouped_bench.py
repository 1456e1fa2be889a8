#!/usr/bin/env python3
"""FP8-kept routed experts past the fused kernels' 16 tokens, on one GPU: the W8A16 grouped kernels
(:mod:`splitspec.models.fp8_grouped`) against what they replace — every expert of the rank dequantised per call, then
``grouped_experts``'s bf16 grouped GEMM — and against that grouped GEMM on weights already in bf16 (twice the bytes,
no dequantisation). Synthetic weights at Kimi-K2's shapes (H 7168, 384 experts × I 2048 sliced ``--tp`` ways, top 8,
128 × 128 tiles), random routing; per token count: median ms of a call (``--reps`` replays of a CUDA graph of two),
the distinct experts chosen, the kernels' effective FP8 bandwidth (bytes of the chosen experts' weights and scales /
time) and the largest relative difference from the dequantised path::

    PYTHONPATH=src python3 bench/lab/fp8_grouped_bench.py --tp 8 --tokens 17,64,256,1024 --out results/fp8_grouped.json

``--sweep``: first time each candidate block configuration of :data:`SWEEP` for the gate/up kernel (down as
configured), then for down (gate/up at the winner), the sum of median ms over ``--sweep-tokens``, and print the two
lines to paste into :mod:`splitspec.models.fp8_grouped` (``GATE_UP`` / ``DOWN``); the table then runs with the winners.

Writes ``--out`` (JSON) and prints a table. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from splitspec import quant
from splitspec.models import fp8_grouped
from splitspec.models.grouped_moe import grouped_experts

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # bench/, for lab.gpu_kernels
from lab.gpu_kernels import timed_graph

H, I_FULL, E, TOP_K, BLOCK = 7168, 2048, 384, 8, (128, 128)
#: --sweep's candidates for each kernel: (BLOCK_M pairs, BLOCK_N rows, BLOCK_K columns, num_warps, num_stages); shared
#: memory per stage at most 2 FP8 weight tiles + one bf16 activation tile (48 KiB at the largest), × stages ≤ 228 KiB.
SWEEP = ((16, 64, 128, 4, 3), (32, 64, 128, 4, 3), (64, 64, 128, 4, 3), (16, 128, 128, 4, 3), (32, 128, 128, 4, 3),
         (64, 128, 128, 8, 3), (32, 64, 64, 4, 4), (64, 128, 64, 8, 4))


def sweep(call, tokens: list[int], reps: int) -> tuple[tuple, tuple, dict]:
    """(gate_up, down): the configurations of :data:`SWEEP` fastest summed over ``tokens`` — gate/up first with down
    as configured, then down with gate/up at its winner — and every timing (ms per call, keyed by kernel and
    configuration). ``call(T, configs)`` returns a function of no argument running T tokens with ``configs``."""
    times: dict = {"gate_up": {}, "down": {}}
    best = [fp8_grouped.GATE_UP, fp8_grouped.DOWN]
    for i, kernel in enumerate(("gate_up", "down")):
        for c in SWEEP:
            configs = (c, best[1]) if i == 0 else (best[0], c)
            times[kernel][str(c)] = sum(timed_graph(call(T, configs), 2, reps) for T in tokens)
            print(f"sweep {kernel} {c}: {times[kernel][str(c)]:.3f} ms over T = {tokens}", flush=True)
        best[i] = min(SWEEP, key=lambda c: times[kernel][str(c)])
    print(f"GATE_UP = {best[0]}\nDOWN = {best[1]}", flush=True)
    return best[0], best[1], times


def random_fp8_experts(I: int, dev: str, g: torch.Generator) -> tuple[torch.Tensor, ...]:
    """w13 [E, 2·I, H], its scale_inv, w2 [E, H, I], its scale_inv: N(0, 0.02) weights quantised to FP8 block
    tiles, 16 experts at a time (the float32 draw of all 384 at TP1 would take 67 GB)."""
    parts = [[quant.quantize_fp8(torch.randn(n, *shape, device=dev, generator=g) * 0.02, BLOCK)
              for n in [min(16, E - e) for e in range(0, E, 16)]] for shape in ((2 * I, H), (H, I))]
    return tuple(torch.cat([p[i] for p in ps]) for ps in parts for i in (0, 1))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, default=8, help="expert-TP ways: each expert's intermediate width I / tp")
    ap.add_argument("--tokens", default="17,64,256,1024", help="comma list of token counts (each > 16)")
    ap.add_argument("--reps", type=int, default=20, help="CUDA-graph replays timed per variant")
    ap.add_argument("--sweep", action="store_true", help="first choose each kernel's block configuration (module docstring)")
    ap.add_argument("--sweep-tokens", default="64,512", help="comma list of token counts the sweep sums over (each > 16)")
    ap.add_argument("--out", type=Path, default=Path("results/fp8_grouped.json"), help="JSON file to write")
    a = ap.parse_args(argv)
    counts = {}
    for name, text in (("--tokens", a.tokens), ("--sweep-tokens", a.sweep_tokens)):
        try:
            counts[name] = [int(t) for t in text.split(",")]
        except ValueError:
            ap.error(f"{name} {text!r}: expected a comma list of integers")
        if min(counts[name]) < 17:
            ap.error(f"{name} {text}: each above 16 (the fused kernels take up to 16)")
    tokens = counts["--tokens"]
    if a.tp < 1 or I_FULL % (a.tp * BLOCK[0]):
        ap.error(f"--tp {a.tp}: expected a split of I = {I_FULL} into whole {BLOCK[0]}-row tiles (1, 2, 4, 8 or 16)")
    if a.reps < 1:
        ap.error(f"--reps {a.reps}: expected at least 1")
    if not torch.cuda.is_available():
        sys.exit("fp8_grouped_bench: needs a CUDA GPU")
    I, dev, g = I_FULL // a.tp, "cuda", torch.Generator(device="cuda").manual_seed(0)
    need = E * 3 * I * H * (1 + 2 + 2 * 2)  # FP8 weights, their bf16 copy, the dequantised path's per-call transients
    free = torch.cuda.mem_get_info()[0]
    if need > 0.95 * free:
        sys.exit(f"fp8_grouped_bench: --tp {a.tp} needs ~{need / 2**30:.0f} GiB on the GPU (FP8 experts, a bf16 copy, "
                 f"the dequantising path's transients), {free / 2**30:.0f} GiB free: take a larger --tp")
    w13, s13, w2, s2 = random_fp8_experts(I, dev, g)
    b13, b2 = (quant.dequantize_fp8(w, s, BLOCK, torch.bfloat16) for w, s in ((w13, s13), (w2, s2)))
    per_expert = 3 * I * H + (s13[0].numel() + s2[0].numel()) * 4
    def inputs(T: int):
        x = torch.randn(T, H, device=dev, generator=g).bfloat16()
        return x, torch.rand(T, E, device=dev, generator=g).topk(TOP_K, 1).indices.int(), torch.rand(T, TOP_K, device=dev, generator=g)

    fixed: dict = {}  # T -> its inputs, the same for every configuration the sweep times

    def call(T: int, configs):
        if T not in fixed:
            fixed[T] = inputs(T)
        x, local, wts = fixed[T]
        return lambda: fp8_grouped.fp8_grouped_experts(x, local, wts, w13, s13, w2, s2, BLOCK, configs)

    configs, swept = (fp8_grouped.GATE_UP, fp8_grouped.DOWN), None
    if a.sweep:
        *configs, swept = sweep(call, counts["--sweep-tokens"], a.reps)
    rows = []
    for T in tokens:
        x, local, wts = inputs(T)

        def dequantised():
            d13, d2 = (quant.dequantize_fp8(w, s, BLOCK, torch.bfloat16) for w, s in ((w13, s13), (w2, s2)))
            return grouped_experts(x, local, wts, d13, d2)

        def kernels():
            return fp8_grouped.fp8_grouped_experts(x, local, wts, w13, s13, w2, s2, BLOCK, configs)

        ref, got = dequantised().float(), kernels().float()
        distinct = int(local.unique().numel())
        row = {"tokens": T, "distinct_experts": distinct, "fp8_grouped_ms": timed_graph(kernels, 2, a.reps),
               "dequantised_ms": timed_graph(dequantised, 2, a.reps),
               "bf16_grouped_ms": timed_graph(lambda: grouped_experts(x, local, wts, b13, b2), 2, a.reps),
               "max_rel_diff": float((got - ref).abs().max() / ref.abs().max())}
        row["fp8_GBps"] = distinct * per_expert / row["fp8_grouped_ms"] / 1e6
        rows.append(row)
        print(f"T {T:5d}: {distinct:3d} experts; fp8 grouped {row['fp8_grouped_ms']:.3f} ms ({row['fp8_GBps']:.0f} GB/s), "
              f"dequantised + grouped {row['dequantised_ms']:.3f} ms, bf16 grouped {row['bf16_grouped_ms']:.3f} ms; "
              f"max rel diff {row['max_rel_diff']:.2e}", flush=True)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "tp": a.tp, "I": I,
                                 "configs": list(configs), "sweep_ms": swept, "rows": rows}, indent=1))
    print(f"→ {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
