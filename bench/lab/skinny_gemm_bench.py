#!/usr/bin/env python3
"""The skinny-GEMM kernel (:mod:`splitspec.models.skinny_gemm`) on one GPU at Kimi-K2's linear shapes, in one run:

1. copy bandwidth (the bounds' denominator);
2. per shape (the TP8 shard's ``mlp.w13``, ``attn.fused_qkv_a``, ``mlp.w2``, ``attn.o_proj``, ``attn.q_b_proj`` and
   shared expert, then the TP2 and TP1 shapes of the four large linears) and 1 / 2 / 4 / 8 tokens: torch's
   ``F.linear`` (cuBLAS) and every block configuration of the kernel (both forms), in µs against the weight's
   bytes / bandwidth; a configuration whose output differs from cuBLAS's by more than 2 % of its scale, or that gives
   a token other bits among 8 tokens than alone, is never chosen;
3. per shape class (:func:`splitspec.models.skinny_gemm.shape_class`) the one configuration for every token count —
   or cuBLAS (None) — with the least sum over the class's shapes and the token counts of its time / that shape's and
   count's best time (each alike, whatever its size), printed as lines to paste into ``skinny_gemm.CONFIGS`` (and
   installed for step 4);
4. each TP8-shard product at 1 and 4 tokens alone and with each prologue the target folds (norm, residual add +
   norm, silu · up), then the TP8 shard's dense and MoE layer (compiled, CUDA graph) with the kernel off and on, through
   ``bench/gpu_bench.py``'s ``layer_costs`` (its rows, bounds and profiler tables).

Each timing is a CUDA graph of calls that take turns over enough copies of the weight (≥ 160 MB in all) that no
call finds its weight in L2. Prints tables and writes ``skinny_gemm_bench.json``.

    export PYTHONPATH=$PWD/src
    python3 bench/lab/skinny_gemm_bench.py --out results/skinny

``--dry-run``: CPU, Triton's interpreter, small shapes, a few configurations: checks the script, measures nothing.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys
import time
from pathlib import Path

ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
ap.add_argument("--out", default="results/skinny", help="folder for skinny_gemm_bench.json")
ap.add_argument("--sweep-budget-s", type=float, default=150, help="start no new shape of the sweep after this many seconds")
ap.add_argument("--tokens", default="1,2,4,8", help="comma list: tokens of the sweep")
ap.add_argument("--layer-k", default="0,1,3,5", help="comma list: k of the layer timings (k + 1 tokens of one sequence)")
ap.add_argument("--no-layer", action="store_true", help="skip step 4 (the layers)")
ap.add_argument("--default-config", action="store_true",
                help="step 4 with every class on skinny_gemm.DEFAULT_CONFIG (the multiply-add form, which folds), "
                     "not the sweep's choice")
ap.add_argument("--dry-run", action="store_true", help="CPU, Triton's interpreter, small shapes: checks the script")
A = ap.parse_args()
if A.dry_run:
    os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # bench/, for lab.gpu_kernels and gpu_bench

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from lab.gpu_kernels import bandwidth, timed_graph  # noqa: E402
from splitspec.build.synthetic import kimi_k2_target  # noqa: E402
from splitspec.config import Mapping  # noqa: E402
from splitspec.measure.cost_model import KimiScale  # noqa: E402
from splitspec.measure.machine import git_commit  # noqa: E402
from splitspec.models import skinny_gemm  # noqa: E402
from splitspec.models.shapes import target_shapes  # noqa: E402

T0 = time.time()
DRY = A.dry_run
DEV = "cpu" if DRY else "cuda"
COLD_BYTES = 160e6  # weight copies per timing: more than the H200's 50 MB L2, several times over


def candidates() -> list[tuple[int, int, int, int, int]]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages, form): the float32 multiply-add form (one accumulator tile per
    token: small tiles, or 8 tokens spill registers) and the tensor-core form."""
    if DRY:
        return [(16, 64, 4, 2, skinny_gemm.FMA), (16, 64, 4, 2, skinny_gemm.DOT)]
    fma = [(bn, bk, w, s, skinny_gemm.FMA) for bn, bk, w, s in itertools.product((8, 16, 32), (128, 256, 512), (4, 8), (1, 2))
           if bn * bk <= 8192]
    # the dot form's loads are pipelined through shared memory (num_stages deep); past 227 KB a launch fails and the
    # configuration is dropped
    dot = [(bn, bk, 4, s, skinny_gemm.DOT) for bn, bk, s in itertools.product((16, 32, 64), (128, 256), (2, 3, 4))]
    return fma + dot


#: Compiles the kernel for some configurations into Triton's cache (run in a process of its own): arguments are the
#: configurations and the token counts, as JSON. The shapes differ from the sweep's but specialise alike (every size
#: and stride a multiple of 16), so the sweep's launches find their kernels in the cache.
WARM = """
import json, sys, torch
from splitspec.models import skinny_gemm
w = torch.randn(64, 1024, device="cuda", dtype=torch.bfloat16)
for cfg in json.loads(sys.argv[1]):
    for T in json.loads(sys.argv[2]):
        try:
            skinny_gemm.launch(torch.randn(T, 1024, device="cuda", dtype=torch.bfloat16), w, config=tuple(cfg))
        except Exception:
            pass
torch.cuda.synchronize()
"""


def precompile(configs: list[tuple[int, ...]], tokens: list[int]) -> None:
    """Compile every configuration for the sweep's token counts, in parallel processes (a Triton compile takes
    seconds and the sweep has ~50 configurations; the multiply-add form compiles once per token count)."""
    import subprocess

    workers = max(1, min(16, (os.cpu_count() or 2) - 1))
    procs = [subprocess.Popen([sys.executable, "-c", WARM, json.dumps(configs[i::workers]), json.dumps(tokens)])
             for i in range(workers)]
    for p in procs:
        p.wait()
    print(f"precompiled {len(configs)} configurations in {workers} processes, {time.time() - T0:.0f} s in", flush=True)


def shapes() -> list[tuple[str, int, int]]:
    """(label, N, K): the TP8 shard's linears, then the four large ones at TP2 and TP1 (distinct shapes only)."""
    if DRY:
        return [("tp8.w2", 72, 40), ("tp8.qkv_a", 24, 96)]
    cfg, out, seen = kimi_k2_target(2), [], set()
    names = {"layers.0.mlp.w13": "w13", "layers.0.attn.fused_qkv_a": "qkv_a", "layers.0.mlp.w2": "w2",
             "layers.0.attn.o_proj": "o_proj", "layers.0.attn.q_b_proj": "q_b", "layers.1.mlp.shared.w13": "shared.w13",
             "layers.1.mlp.shared.w2": "shared.w2"}
    for tp in (8, 2, 1):
        s = target_shapes(cfg, Mapping(tp))
        for name, short in names.items():
            if (tp == 8 or short in ("w13", "qkv_a", "w2", "o_proj")) and s[name] not in seen:
                seen.add(s[name])
                out.append((f"tp{tp}.{short}", *s[name]))
    return out


def timer(fn) -> float:
    """µs of one call of fn: from a CUDA graph (:func:`timed_graph`), or one timed call in a dry run."""
    if DRY:
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e6
    return timed_graph(fn, reps=10, replays=10) * 1e3


def rotating(ws: list[torch.Tensor], call):
    """A no-argument function calling ``call(w)`` on the copies ``ws`` in turn (a graph of several calls then
    reads them all)."""
    turn = itertools.cycle(ws)
    return lambda: call(next(turn))


def invariant(x: torch.Tensor, w: torch.Tensor, cfg) -> bool:
    """Whether ``cfg`` gives each of x's tokens (8) the same bits among them as alone."""
    alone = torch.cat([skinny_gemm.launch(x[i:i + 1], w, config=cfg)[0] for i in range(x.shape[0])])
    return torch.equal(skinny_gemm.launch(x, w, config=cfg)[0], alone)


def sweep(bw_GBps: float, tokens: list[int]) -> tuple[list[dict], dict]:
    """Step 2 and 3: the rows, and the choice by shape class {key: (config or None, µs summed, cuBLAS µs summed,
    shapes)}."""
    g = torch.Generator(device=DEV).manual_seed(0)
    rows, configs = [], candidates()
    if not DRY:
        precompile(configs, tokens + [skinny_gemm.MAX_TOKENS])
    for label, N, K in shapes():
        if time.time() - T0 > A.sweep_budget_s:
            print(f"sweep budget spent: {label} and later shapes skipped", flush=True)
            break
        copies = 1 if DRY else max(1, math.ceil(COLD_BYTES / (N * K * 2)))
        ws = [torch.randn(N, K, device=DEV, dtype=torch.bfloat16, generator=g) * K ** -0.5 for _ in range(copies)]
        bound_us = N * K * 2 / (bw_GBps * 1e3)
        x8 = torch.randn(skinny_gemm.MAX_TOKENS, K, device=DEV, dtype=torch.bfloat16, generator=g)
        usable, varying = [], []
        for cfg in configs:
            try:
                (usable if invariant(x8, ws[0], cfg) else varying).append(cfg)
            except Exception as e:  # a configuration the compiler refuses (shared memory, registers): not a candidate
                print(f"  {label} {cfg}: {type(e).__name__}: {str(e)[:120]}", flush=True)
        if varying:
            print(f"  {label}: {len(varying)} configurations not batch-invariant, not candidates: {varying}", flush=True)
        for T in tokens:
            x = x8[:T]
            ref = F.linear(x, ws[0]).float()
            scale = ref.abs().max().item()
            row = {"shape": label, "N": N, "K": K, "tokens": T, "class": list(skinny_gemm.shape_class(N, K)),
                   "bound_us": bound_us, "cublas_us": timer(rotating(ws, lambda w: F.linear(x, w))), "kernel": {},
                   "not_invariant": [list(c) for c in varying]}
            for cfg in usable:
                err = (skinny_gemm.launch(x, ws[0], config=cfg)[0].float() - ref).abs().max().item() / scale
                us = timer(rotating(ws, lambda w: skinny_gemm.launch(x, w, config=cfg)))
                if err <= 0.02:
                    row["kernel"][",".join(map(str, cfg))] = us
                else:
                    print(f"  {label} T={T} {cfg}: err {err:.3g}: not a candidate", flush=True)
            best = min(row["kernel"].items(), key=lambda kv: kv[1], default=(None, float("nan")))
            row |= {"best": best[0], "best_us": best[1], "best_vs_bound": best[1] / bound_us,
                    "cublas_vs_bound": row["cublas_us"] / bound_us}
            rows.append(row)
            print(f"{label:>14} N={N:>6} K={K:>6} T={T}: cuBLAS {row['cublas_us']:8.1f} µs ({row['cublas_vs_bound']:.2f}×), "
                  f"kernel {best[1]:8.1f} µs ({row['best_vs_bound']:.2f}×) with {best[0]}; bound {bound_us:.1f} µs", flush=True)
        del ws
    return rows, choose(rows)


def choose(rows: list[dict]) -> dict:
    """Step 3: per shape class, the configuration timed for every (shape, tokens) row of the class — or cuBLAS
    ("cublas", None in CONFIGS) — with the least sum of time / that row's best time (cuBLAS included)."""
    winners = {}
    for key, group in itertools.groupby(sorted(rows, key=lambda r: r["class"]), key=lambda r: tuple(r["class"])):
        group = list(group)
        common = set.intersection(*(set(r["kernel"]) for r in group)) | {"cublas"}

        def us(r, c):
            return r["cublas_us"] if c == "cublas" else r["kernel"][c]

        cfg = min(common, key=lambda c: sum(us(r, c) / min(r["best_us"], r["cublas_us"]) for r in group))
        winners[key] = (None if cfg == "cublas" else tuple(int(v) for v in cfg.split(",")), sum(us(r, cfg) for r in group),
                        sum(r["cublas_us"] for r in group), sorted({r["shape"] for r in group}))
    return winners


def prologue_costs(tokens: list[int]) -> list[dict]:
    """Step 4a: µs of each TP8-shard product with :data:`skinny_gemm.CONFIGS`'s configuration alone and with each
    prologue the target folds (norm; residual add + norm; silu · up, x then [T, 2·K]); cuBLAS beside."""
    g = torch.Generator(device=DEV).manual_seed(1)
    rows = []
    for label, N, K in shapes():
        if not label.startswith("tp8.") and not DRY or skinny_gemm.config_for(N, K) is None:
            continue
        copies = 1 if DRY else max(1, math.ceil(COLD_BYTES / (N * K * 2)))
        ws = [torch.randn(N, K, device=DEV, dtype=torch.bfloat16, generator=g) * K ** -0.5 for _ in range(copies)]
        norm = torch.rand(K, device=DEV, dtype=torch.bfloat16, generator=g)
        for T in tokens:
            x, r, xa = (torch.randn(T, k, device=DEV, dtype=torch.bfloat16, generator=g) for k in (K, K, 2 * K))
            calls = {"plain": lambda w: skinny_gemm.launch(x, w), "norm": lambda w: skinny_gemm.launch(x, w, None, norm, 1e-6),
                     "add+norm": lambda w: skinny_gemm.launch(x, w, r, norm, 1e-6),
                     "silu·up": lambda w: skinny_gemm.launch(xa, w, act=True), "cuBLAS": lambda w: F.linear(x, w)}
            row = {"shape": label, "tokens": T, "config": skinny_gemm.config_for(N, K)}
            row |= {name: timer(rotating(ws, call)) for name, call in calls.items()}
            rows.append(row)
            print(f"{label:>14} T={T} {row['config']}: " + "  ".join(f"{n} {row[n]:.1f}" for n in calls), flush=True)
        del ws
    return rows


def main() -> None:
    out = Path(A.out)
    out.mkdir(parents=True, exist_ok=True)
    res = {"machine": {"gpu": "cpu (dry run)" if DRY else torch.cuda.get_device_name(), "torch": torch.__version__,
                       "git": git_commit(), "argv": sys.argv[1:]}}
    bw = KimiScale.hbm_GBps if DRY else bandwidth()["copy_GBps_read_plus_write"]
    res["bandwidth_GBps"] = bw
    print(f"copy bandwidth {bw:.0f} GB/s", flush=True)
    rows, winners = sweep(bw, [int(t) for t in A.tokens.split(",")])
    res["sweep"] = rows
    print("\n# skinny_gemm.CONFIGS (sweep winners by shape class; summed kernel vs cuBLAS µs over the class's shapes)")
    for key, (cfg, us, cublas, labels) in winners.items():
        print(f"    {key!r}: {cfg!r},  # {us:.1f} vs {cublas:.1f} µs: {', '.join(labels)}")
    res["winners"] = {repr(k): {"config": v[0], "kernel_us": v[1], "cublas_us": v[2], "shapes": v[3]} for k, v in winners.items()}
    skinny_gemm.CONFIGS.update({k: v[0] for k, v in winners.items()})
    if A.default_config:
        skinny_gemm.CONFIGS.clear()
    print(f"\n== prologues (µs; TP8 shard, CONFIGS), {time.time() - T0:.0f} s in", flush=True)
    res["prologues"] = prologue_costs([1, 4])
    (out / "skinny_gemm_bench.json").write_text(json.dumps(res, indent=1))
    if A.no_layer or DRY:
        return
    import gpu_bench

    print(f"\n== layers (TP8 shard, skinny_gemm off / on), {time.time() - T0:.0f} s in", flush=True)
    res["layers"] = gpu_bench.layer_costs([8], [1], [int(k) for k in A.layer_k.split(",")], bw, {}, skinny=(False, True),
                                          drafter=False, profiled=((0, 1), (1, 1)))
    print("\n| layer | tokens | compiled | skinny_gemm | µs | bound µs | ratio |\n|---|---|---|---|---|---|---|")
    for r in res["layers"]["rows"]:
        if r["layer"] != "lm_head" and not r["comparison"]:
            print(f"| {r['layer']} | {r['tokens']} | {r['compiled']} | {r['skinny_gemm']} | {r['ms'] * 1e3:.1f} | "
                  f"{r['bound_ms'] * 1e3:.1f} | {r['ratio_to_bound']:.2f} |")
    res["seconds"] = round(time.time() - T0, 1)
    (out / "skinny_gemm_bench.json").write_text(json.dumps(res, indent=1))
    print(f"done in {res['seconds']} s", flush=True)


if __name__ == "__main__":
    main()
