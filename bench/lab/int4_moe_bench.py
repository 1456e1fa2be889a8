#!/usr/bin/env python3
"""W4A16 MoE kernels on one GPU at Kimi-K2.5 shapes (384 INT4 experts, 8 per token, hidden 7168, intermediate
2048 / TP, group-32 bf16 scales), every variant and block configuration in one run of a few minutes:

1. copy bandwidth (the bounds' denominator);
2. decode kernels (:mod:`splitspec.models.int4_moe`) at T = 1, 4, 16 tokens, TP1 and TP8-shard shapes: ``fma`` (the
   first kernels), ``mma_asm`` swept over gate_up blocks, then down blocks and forms, then K / slot splits, ``mma`` (no PTX)
   at the best blocks; the bf16 fused kernels on the same experts dequantised (their own bytes and bound);
3. the whole INT4 MoE layer (routing kernels, routed experts, bf16 shared expert) at TP1 and the TP8 shard, T = 1,
   4, 16, with the first kernels and the best decode ones: on one stream, and as the engine runs it (``+side``: the
   shared expert on a side stream, :func:`splitspec.models.int4_layer.moe_layer`);
4. W4A16 grouped kernels (:mod:`splitspec.models.grouped_moe`) at T = 64, 256, 1024 and 4, 16: configs, the
   dequantise-per-call path and bf16 grouped GEMMs on pre-dequantised weights;
5. :data:`splitspec.models.int4_routed.DECODE` (keyed by one token or many and the shard, TP1 "wide" and the TP8
   shard "narrow") and :data:`splitspec.models.int4_routed.TABLE` for the fastest kernels found.

``--one``: one token only, each shard on its own (its own best configuration, the engine keys them apart): gate_up
candidates (among them K slices inside a program), then down candidates (the slot loop with and without slot splits, and the slots side by side in one
dot, ``_down_columns``), then K splits; each kernel of the best alone against its own bound (gate_up, down); then
the whole layer at 1, 4, 16 tokens with the best one-token kernels and :data:`~splitspec.models.int4_routed.DECODE`'s
many-token ones. About 150 s on an H200:

    python3 bench/lab/int4_moe_bench.py --one --out results/int4one

Bound = distinct experts × INT4 bytes (packed + scales) / copy bandwidth (as in
docs/lab/2026-12-02-h200-int4-moe-kernels); ratio = ms / bound. Each timing is a CUDA graph of one call on each of
8 routings (T ≤ 16: different experts in turn, so the TP8 shard's 22 MB per routing do not stay in L2). Every
kernel's output on the first routing is compared with the bf16 kernels on the dequantised experts (``err``: max
|Δ| / max |ref|); a kernel with err > 0.03 is never chosen. The PTX variants' outputs are compared with those of
the same kernels unpacking in bit operations (``mma_asm_vs_mma``, ``grouped_asm_vs_grouped``: 0 expected).
Prints tables and writes ``int4_moe_bench.json``.

    export PYTHONPATH=$PWD/src
    python3 bench/lab/int4_moe_bench.py --out results/int4mma

``--profile``: also the engine's form of the layer at one token on each shard, kernel by kernel (start and
duration in one replay of its CUDA graph, torch.profiler): which branch is the longer and where the gaps are.

``--dry-run``: CPU, Triton's interpreter, small shapes and sweeps: checks the script, measures nothing.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from pathlib import Path

ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
ap.add_argument("--out", default="results/int4mma", help="folder for int4_moe_bench.json")
ap.add_argument("--budget-s", type=float, default=230, help="start no new sweep step after this many seconds")
ap.add_argument("--decode", default=None, metavar="GU/DN",
                help="skip the decode sweeps: time mma_asm with these configs only, e.g. 32,512,2,3,0/16,512,1,3,0")
ap.add_argument("--no-layer", action="store_true", help="skip section 3 (the whole MoE layer)")
ap.add_argument("--one", action="store_true", help="one-token sweeps per shard, kernels alone, the layer at 1/4/16")
ap.add_argument("--profile", action="store_true",
                help="also each shard's one-token layer (the engine's form) kernel by kernel under torch.profiler")
ap.add_argument("--dry-run", action="store_true", help="CPU, Triton's interpreter, small shapes: checks the script")
A = ap.parse_args()
if A.dry_run:
    os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # bench/, for lab.gpu_kernels

import torch  # noqa: E402

from lab.gpu_kernels import bandwidth, graph_timeline, timed_graph  # noqa: E402
from splitspec import quant  # noqa: E402
from splitspec.measure.machine import git_commit  # noqa: E402
from splitspec.models import fused_moe, fused_route, grouped_moe, int4_down, int4_layer, int4_moe, int4_routed  # noqa: E402
from splitspec.models.int4_moe import Kernel  # noqa: E402
from splitspec.models.layers import gated_mlp  # noqa: E402

T0 = time.time()
DRY = A.dry_run
DEV = "cpu" if DRY else "cuda"
H, E, TOP_K, G = (128, 8, 2, 32) if DRY else (7168, 384, 8, 32)
TPS = {1: 128, 8: 64} if DRY else {1: 2048, 8: 256}  # TP size → intermediate width of a shard
DECODE_T, GROUPED_T = ((1, 2), (16,)) if DRY else ((1, 4, 16), (64, 256, 1024))
LAYER_T = DECODE_T
if A.one:
    DECODE_T, GROUPED_T = (1,), ()
ROUTINGS = 1 if DRY else 8
OK = 0.03
GU = [(32, 256, 2, 3, 0)] if DRY else [
    (16, 256, 1, 3, 0), (32, 256, 2, 3, 0), (32, 512, 2, 3, 0), (32, 256, 2, 4, 0), (64, 256, 4, 3, 0), (128, 256, 8, 3, 0)]
DN = [(32, 128, 2, 3, 0)] if DRY else [
    (16, 256, 1, 3, 0), (32, 256, 2, 3, 0), (32, 128, 2, 4, 0), (16, 512, 1, 3, 0), (64, 256, 4, 3, 0),
    (16, 256, 8, 3, 0, 1), (8, 512, 4, 2, 0, 1)]  # the last two: slots side by side (form 1)
SPLITS = [(2, 2)] if DRY else [(g, d) for g in (1, 2, 4, 8) for d in (1, 2, 4)]
# --one: gate_up blocks (fewer stages, a K split or K slices: more warps per multiprocessor), down in its three
# forms (one program per token's rows, slot splits with atomics, all slots side by side in one dot), then K splits
GU1 = [(32, 128, 2, 3, 0), (16, 128, 2, 1, 0, 2)] if DRY else [
    (32, 512, 2, 3, 0), (32, 256, 2, 3, 2), (32, 256, 2, 2, 1), (32, 512, 2, 2, 1), (16, 256, 1, 3, 2),
    (32, 1024, 2, 2, 1), (16, 512, 1, 4, 1), (32, 512, 4, 3, 1, 2), (32, 1024, 8, 2, 1, 4), (16, 512, 4, 3, 1, 4),
    (16, 1024, 8, 2, 1, 8)]  # the last four: each K step in 2-8 slices, one warp group each (a batched dot)
DN1 = [(32, 64, 2, 1, 0), (32, 64, 4, 1, 0, 1), (32, 64, 2, 1, 2)] if DRY else [
    (16, 512, 1, 3, 0), (16, 256, 8, 3, 0, 1), (16, 512, 1, 3, 2), (16, 256, 1, 3, 8), (16, 256, 8, 2, 0, 1),
    (16, 256, 1, 3, 4), (16, 512, 1, 3, 8), (16, 128, 8, 4, 0, 1), (16, 512, 8, 2, 0, 1), (32, 256, 2, 3, 8),
    (16, 128, 1, 4, 8), (16, 256, 1, 4, 4)]
SPLITS1 = [1] if DRY else [1, 2, 4, 8]
GROUPED = [(16, 64, 128, 4, 3)] if DRY else [
    (16, 32, 256, 2, 3), (16, 64, 256, 4, 3), (32, 64, 256, 4, 3), (64, 64, 256, 4, 3), (64, 128, 128, 8, 3)]
OUT = {"machine": {"gpu": "cpu (dry run)" if DRY else torch.cuda.get_device_name(), "torch": torch.__version__,
                   "triton": __import__("triton").__version__, "git": git_commit(), "argv": sys.argv[1:]},
       "rows": [], "layer": []}


def save() -> None:
    out = Path(A.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "int4_moe_bench.json").write_text(json.dumps(OUT, indent=1))


def in_budget(reserve: float = 0.0) -> bool:
    """Whether a new step may start: ``reserve`` seconds kept for the steps after it."""
    return time.time() - T0 < A.budget_s - reserve


def timed(fns) -> float:
    """ms per call of each of ``fns`` (calls on different routings)."""
    if DRY:
        t = time.perf_counter()
        for f in fns:
            f()
        return (time.perf_counter() - t) * 1e3 / len(fns)
    return timed_graph(lambda: [f() for f in fns], reps=2, replays=10) / len(fns)


def experts(I: int, g: torch.Generator):
    """Random INT4 experts (packed, scales ~ an N(0, 1) weight's group absmax / 7) and their bf16 dequantisation."""
    p13 = torch.randint(-2**31, 2**31 - 1, (E, 2 * I, H // 8), dtype=torch.int32, device=DEV, generator=g)
    p2 = torch.randint(-2**31, 2**31 - 1, (E, H, I // 8), dtype=torch.int32, device=DEV, generator=g)
    s13 = (torch.rand(E, 2 * I, H // G, device=DEV, generator=g) * 0.4 * H ** -0.5).to(torch.bfloat16)
    s2 = (torch.rand(E, H, I // G, device=DEV, generator=g) * 0.4 * I ** -0.5).to(torch.bfloat16)
    w13 = torch.empty(E, 2 * I, H, dtype=torch.bfloat16, device=DEV)
    w2 = torch.empty(E, H, I, dtype=torch.bfloat16, device=DEV)
    for i in range(0, E, 32):  # 32 experts at a time: dequantize_int4 works in float32
        w13[i:i + 32] = quant.dequantize_int4(p13[i:i + 32], s13[i:i + 32], H, G)
        w2[i:i + 32] = quant.dequantize_int4(p2[i:i + 32], s2[i:i + 32], I, G)
    return (p13, s13, p2, s2), (w13, w2)


def routing(T: int, g: torch.Generator):
    """T tokens [T, H] bf16, TOP_K distinct experts each [T, TOP_K] int32, routing weights [T, TOP_K] float32."""
    ids = torch.rand(T, E, device=DEV, generator=g).argsort(dim=1)[:, :TOP_K].int()
    return (torch.randn(T, H, device=DEV, generator=g).to(torch.bfloat16), ids,
            torch.rand(T, TOP_K, device=DEV, generator=g))


def err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def run(kernel: Kernel, x, ids, wts, packed):
    if kernel.variant in grouped_moe.GROUPED_VARIANTS:
        return grouped_moe.int4_grouped_experts(x, ids, wts, *packed, group=G, kernel=kernel)
    if kernel.variant == "dequant":
        return int4_routed.dequantised_experts(x, ids, wts, dict(zip(int4_routed.NAMES, packed)), G)
    return int4_moe.int4_experts(x, ids, wts, *packed, group=G, kernel=kernel)


def measure(section: str, kernel: Kernel, T: int, tp: int) -> dict:
    """One row: ``kernel`` (an INT4 Kernel, or Kernel('bf16', ...): the bf16 kernels on the dequantised experts) at T
    tokens on the TP-``tp`` shard, over the routings of T; cached."""
    key = (kernel, T, tp)
    if key in CACHE:
        return CACHE[key]
    packed, (w13, w2) = WEIGHTS[tp]
    probs = PROBLEMS[T]
    per_expert = sum(t[0].nbytes for t in packed) if kernel.variant != "bf16" else w13[0].nbytes + w2[0].nbytes
    if kernel.variant == "bf16":
        fns = [(lambda x=x, i=i, w=w: fused_moe.fused_experts(x, i, w, w13, w2)) if T <= fused_moe.MAX_TOKENS else
               (lambda x=x, i=i, w=w: grouped_moe.grouped_experts(x, i, w, w13, w2)) for x, i, w in probs]
    else:
        fns = [lambda x=x, i=i, w=w: run(kernel, x, i, w, packed) for x, i, w in probs]
    row = {"section": section, "variant": kernel.variant, "gate_up": kernel.gate_up, "down": kernel.down, "tokens": T,
           "tp": tp, "bound_ms": sum(i.unique().numel() for _, i, _ in probs) / len(probs) * per_expert / BW}
    try:
        FIRST[key] = fns[0]()
        row["err"] = err(FIRST[key], reference(T, tp))
        row["ms"] = timed(fns)
        row["ratio"] = row["ms"] / row["bound_ms"]
    except Exception as e:  # a variant that fails to compile or run is reported, not fatal
        row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    row["ok"] = "ms" in row and row["err"] <= OK
    CACHE[key] = row
    OUT["rows"].append(row)
    print(json.dumps(row), flush=True)
    save()
    return row


def score(rows: list[dict]) -> float:
    """Sum of ratios to the bound (inf when a row failed): how the sweeps pick."""
    return sum(r["ratio"] if r["ok"] else float("inf") for r in rows)


def best(section: str, candidates: list[Kernel], shapes) -> Kernel:
    """The candidate with the lowest :func:`score` over ``shapes`` ((T, tp) pairs), measuring while in budget."""
    scored = []
    for k in candidates:
        if not in_budget() and scored:
            break
        scored.append((score([measure(section, k, T, tp) for T, tp in shapes]), k))
    return min(scored, key=lambda s: s[0])[1]


def with_split(k: Kernel, gs: int, ds: int | None) -> Kernel:
    """k with gate_up's split gs and down's ds (None: down as it is)."""
    return Kernel(k.variant, k.gate_up[:4] + (gs,) + k.gate_up[5:], k.down if ds is None else k.down[:4] + (ds,))


BW = 1.0 if DRY else bandwidth()["copy_GBps_read_plus_write"] * 1e6  # bytes per ms
OUT["bandwidth_GBps"] = BW / 1e6
gen = torch.Generator(device=DEV).manual_seed(0)
WEIGHTS = {tp: experts(I, gen) for tp, I in TPS.items()}
PROBLEMS = {T: [routing(T, gen) for _ in range(ROUTINGS if T <= 16 else 1)]
            for T in sorted(set(DECODE_T + LAYER_T + GROUPED_T))}
REFS: dict = {}
CACHE: dict = {}
FIRST: dict = {}  # (kernel, T, tp) → its output on the first routing


def reference(T: int, tp: int) -> torch.Tensor:
    """The bf16 kernels on the dequantised experts, first routing of T (fused decode kernels up to MAX_TOKENS)."""
    if (T, tp) not in REFS:
        (x, ids, wts), (w13, w2) = PROBLEMS[T][0], WEIGHTS[tp][1]
        REFS[(T, tp)] = (fused_moe.fused_experts(x, ids, wts, w13, w2) if T <= fused_moe.MAX_TOKENS
                         else grouped_moe.grouped_experts(x, ids, wts, w13, w2))
    return REFS[(T, tp)]


print(f"setup {time.time() - T0:.0f} s, bandwidth {BW / 1e6:.0f} GB/s", flush=True)
save()

# 2. decode kernels
dshapes = [(T, tp) for T in DECODE_T for tp in TPS]
for T, tp in dshapes:
    if not A.one:
        measure("decode", int4_moe.DEFAULT, T, tp)
    measure("decode", Kernel("bf16", (), ()), T, tp)


def fastest(Ts, tps=TPS, variants=("mma", "mma_asm")) -> Kernel | None:
    """The kernels of ``variants`` measured, and correct, at every (T, tp) for T in Ts, tp in tps with the lowest
    summed ratio to the bound (None: none was, or the budget ran out first)."""
    shapes = [(T, tp) for T in Ts for tp in tps]
    full = {k for k, _, _ in CACHE if k.variant in variants and all(CACHE.get((k, T, tp), {}).get("ok") for T, tp in shapes)}
    return min(full, key=lambda k: score([CACHE[(k, T, tp)] for T, tp in shapes]), default=None)


def per_shard(section: str, candidates) -> dict[int, Kernel]:
    """Each shard's fastest of ``candidates`` (tp → list of Kernels, the same length) at one token, measured in turn
    (both shards per step: a budget cut leaves them the same candidates)."""
    for i in range(len(candidates[next(iter(TPS))])):
        if not in_budget(RESERVE) and i:
            break
        for tp in TPS:
            measure(section, candidates[tp][i], 1, tp)
    return {tp: min((k for k in candidates[tp] if CACHE.get((k, 1, tp), {}).get("ok")), default=candidates[tp][0],
                    key=lambda k: CACHE[(k, 1, tp)]["ratio"]) for tp in TPS}


RESERVE = 45 if A.one else 0  # --one: seconds kept for the kernels alone and the layer
if A.one:  # each shard its own one-token configuration
    top = per_shard("one", {tp: [Kernel("mma_asm", c, DN1[0]) for c in GU1] for tp in TPS})
    top = per_shard("one", {tp: [Kernel("mma_asm", top[tp].gate_up, c) for c in DN1] for tp in TPS})
    top = per_shard("one", {tp: [with_split(top[tp], gs, None) for gs in SPLITS1] for tp in TPS})
    gu, dn = top[1].gate_up, top[1].down
    for tp in TPS:
        measure("one", Kernel("mma", top[tp].gate_up, top[tp].down), 1, tp)
elif A.decode:  # a configuration chosen from an earlier run: no sweep
    gu, dn = (tuple(int(v) for v in part.split(",")) for part in A.decode.split("/"))
    for T, tp in dshapes:
        measure("decode", Kernel("mma_asm", gu, dn), T, tp)
else:
    gu = best("decode", [Kernel("mma_asm", c, DN[0]) for c in GU], dshapes).gate_up
    dn = best("decode", [Kernel("mma_asm", gu, c) for c in DN], dshapes).down
    top = Kernel("mma_asm", gu, dn)
    for gs, ds in SPLITS:
        if in_budget():
            for T, tp in dshapes:
                measure("decode", with_split(top, gs, ds), T, tp)
if not A.one:
    for T, tp in dshapes:
        measure("decode", Kernel("mma", gu, dn), T, tp)


def same_bits(a: Kernel, b: Kernel, shapes) -> dict:
    """max |Δ| between two kernels' outputs on the first routing of each shape: 0 when the PTX unpacking does what the
    bit operations do (the same products, summed in the same order; atomics of 2 partials commute)."""
    out = {}
    for T, tp in shapes:
        if (a, T, tp) in FIRST and (b, T, tp) in FIRST:
            out[f"T{T}_tp{tp}"] = (FIRST[(a, T, tp)].float() - FIRST[(b, T, tp)].float()).abs().max().item()
    print(f"{a.variant} vs {b.variant}, max |difference|: {out}", flush=True)
    return out


OUT["mma_asm_vs_mma"] = same_bits(Kernel("mma_asm", gu, dn), Kernel("mma", gu, dn), dshapes)
save()


def parts(kernel: Kernel, tp: int) -> dict:
    """Each decode kernel of ``kernel`` alone at one token on the TP-``tp`` shard, against its own INT4 bytes: gate_up
    (with ``_silu_mul`` when split) reads w13, down (one launch, split or not) w2."""
    p13, s13, p2, s2 = WEIGHTS[tp][0]
    probs = PROBLEMS[1]
    acts = [int4_moe.gate_up_call(x, i, p13, s13, G, kernel.variant, kernel.gate_up) for x, i, _ in probs]
    distinct = sum(i.unique().numel() for _, i, _ in probs) / len(probs)
    row = {"tp": tp, "tokens": 1, "kernel": str(kernel),
           "gate_up_ms": timed([lambda x=x, i=i: int4_moe.gate_up_call(x, i, p13, s13, G, kernel.variant, kernel.gate_up)
                                for x, i, _ in probs]),
           "gate_up_bound_ms": distinct * (p13[0].nbytes + s13[0].nbytes) / BW,
           "down_ms": timed([lambda a=a, i=i, w=w: int4_down.down_call(a, i, w, p2, s2, torch.bfloat16, G, kernel.variant,
                                                                       kernel.down) for a, (_, i, w) in zip(acts, probs)]),
           "down_bound_ms": distinct * (p2[0].nbytes + s2[0].nbytes) / BW}
    row["gate_up_ratio"], row["down_ratio"] = (row["gate_up_ms"] / row["gate_up_bound_ms"],
                                               row["down_ms"] / row["down_bound_ms"])
    print(json.dumps(row), flush=True)
    return row


decode_best = {(T, tp): fastest([T], [tp]) for T in DECODE_T for tp in TPS}  # decode kernels only, so far
OUT["parts"] = [parts(decode_best[(1, tp)], tp) for tp in TPS if decode_best[(1, tp)] is not None]
save()


def layer_kernels(T: int, tp: int) -> list[tuple[str, Kernel | None]]:
    """(name, routed-expert kernels) to time the layer with: --one: the best one-token ones at T = 1, DECODE's
    many-token row beyond; else the first kernels and the fastest measured at (T, tp)."""
    if A.one:
        cls = fused_moe.fp8_class(T, TPS[tp])
        return [("fastest" if T == 1 else "DECODE", decode_best[(1, tp)] if T == 1 else int4_routed.DECODE[cls])]
    return [("first kernels", int4_moe.DEFAULT), ("fastest", decode_best[(T, tp)])]


# 3. the whole INT4 MoE layer: routing kernels + routed experts + bf16 shared expert (models.target.TargetModel.moe)
for tp, I in ({} if A.no_layer else TPS).items():
    packed = WEIGHTS[tp][0]
    lw = dict(zip(int4_routed.NAMES, packed))
    gate = (torch.randn(E, H, device=DEV, generator=gen) * H ** -0.5).to(torch.bfloat16)
    bias = torch.randn(E, device=DEV, generator=gen) * 0.01
    sw13 = (torch.randn(2 * I, H, device=DEV, generator=gen) * H ** -0.5).to(torch.bfloat16)
    sw2 = (torch.randn(H, I, device=DEV, generator=gen) * I ** -0.5).to(torch.bfloat16)
    for T in LAYER_T:
        probs = PROBLEMS[T]
        chosen = [fused_route.route(x, gate, bias, TOP_K, 2.827, True)[1] for x, _, _ in probs]
        nbytes = (sum(c.unique().numel() for c in chosen) / len(chosen) * sum(t[0].nbytes for t in packed)
                  + sw13.nbytes + sw2.nbytes + gate.nbytes + bias.nbytes)

        def layer(x):  # one stream, eager
            w, ids = fused_route.route(x, gate, bias, TOP_K, 2.827, True)
            return int4_routed.routed_experts(x, ids, w, lw, G) + gated_mlp(x, sw13, sw2)

        def beside(x):  # the engine's form: the shared expert on a side stream (models.int4_layer)
            return int4_layer.moe_layer(x, gate, bias, TOP_K, 2.827, True, 0, tuple(packed), (sw13, sw2), G)

        for (name, kernel), (form, fn) in itertools.product(layer_kernels(T, tp), (("", layer), (" +side", beside))):
            if not in_budget() or kernel is None:
                break
            saved = int4_routed.DECODE
            int4_routed.DECODE = {cls: kernel for cls in saved}
            try:
                row = {"tp": tp, "tokens": T, "routed": name + form, "kernel": str(kernel), "bound_ms": nbytes / BW,
                       "ms": timed([lambda x=x: fn(x) for x, _, _ in probs])}
            finally:
                int4_routed.DECODE = saved
            row["ratio"] = row["ms"] / row["bound_ms"]
            OUT["layer"].append(row)
            print(json.dumps(row), flush=True)
            if A.profile and not DRY and T == 1 and form:  # the engine's form at one token, kernel by kernel
                int4_routed.DECODE = {cls: kernel for cls in saved}
                try:
                    tl_ = graph_timeline(lambda x=probs[0][0]: fn(x))
                finally:
                    int4_routed.DECODE = saved
                OUT.setdefault("timeline", []).append({"tp": tp, "tokens": T, "kernel": str(kernel)} | tl_)
                print(f"layer timeline, TP{tp}, one token: span {tl_.get('span_us', 0):.1f} µs, kernels' sum "
                      f"{tl_.get('busy_us', 0):.1f} µs", flush=True)
                for k in tl_["kernels"]:
                    print(f"  {k['start_us']:>7.1f} {k['us']:>6.1f}  {k['name']}", flush=True)
save()

# 4. grouped kernels
gshapes = [(T, tp) for T in GROUPED_T for tp in TPS]
if gshapes:
    gbest = best("grouped", [Kernel("grouped_asm", c, c) for c in GROUPED], gshapes)
    for T, tp in gshapes:
        for k in (Kernel("grouped", gbest.gate_up, gbest.down), Kernel("bf16", (), ()), int4_routed.DEQUANT):
            if in_budget():
                measure("grouped", k, T, tp)
    for T, tp in dshapes:
        if in_budget():
            measure("grouped", gbest, T, tp)
    OUT["grouped_asm_vs_grouped"] = same_bits(gbest, Kernel("grouped", gbest.gate_up, gbest.down), gshapes)
    save()

# 5. summary and the table
print(f"\n{'T':>5} {'tp':>3} {'variant':<12} {'gate_up':<22} {'down':<22} {'ms':>8} {'bound':>7} {'ratio':>6} {'bf16 ms':>8} "
      f"{'err':>8}")
for T, tp in dshapes + gshapes:
    b16 = CACHE.get((Kernel("bf16", (), ()), T, tp), {}).get("ms", float("nan"))
    rows = sorted((r for r in OUT["rows"] if r["tokens"] == T and r["tp"] == tp and "ms" in r and r["variant"] != "bf16"),
                  key=lambda r: r["ms"])
    firsts = {}
    for r in rows:
        firsts.setdefault(r["variant"], r)  # the fastest row of each variant
    for r in firsts.values():
        print(f"{T:>5} {tp:>3} {r['variant']:<12} {str(r['gate_up']):<22} {str(r['down']):<22} {r['ms']:>8.4f} "
              f"{r['bound_ms']:>7.4f} {r['ratio']:>6.2f} {b16:>8.4f} {r['err']:>8.1e}{'' if r['ok'] else '  FAILED'}")
print(f"\n{'T':>5} {'tp':>3} {'routed experts':<15} {'layer ms':>9} {'bound':>7} {'ratio':>6}")
for r in OUT["layer"]:
    print(f"{r['tokens']:>5} {r['tp']:>3} {r['routed']:<15} {r['ms']:>9.4f} {r['bound_ms']:>7.4f} {r['ratio']:>6.2f}")
print(f"\n{'tp':>3} {'gate_up ms':>10} {'bound':>7} {'ratio':>6} {'down ms':>8} {'bound':>7} {'ratio':>6}  (one token, alone)")
for r in OUT["parts"]:
    print(f"{r['tp']:>3} {r['gate_up_ms']:>10.4f} {r['gate_up_bound_ms']:>7.4f} {r['gate_up_ratio']:>6.2f} "
          f"{r['down_ms']:>8.4f} {r['down_bound_ms']:>7.4f} {r['down_ratio']:>6.2f}")
decode = dict(int4_routed.DECODE)
for tp, I in TPS.items():  # each shard's classes: the fastest measured, else the row as it is (marked)
    for many, Ts in ((False, [1]), (True, [T for T in DECODE_T if T > 1])):
        k = fastest(Ts, [tp]) if Ts else None
        decode[fused_moe.fp8_class(2 if many else 1, I)] = k or decode[fused_moe.fp8_class(2 if many else 1, I)]
rows = [(None, fastest(GROUPED_T, variants=grouped_moe.GROUPED_VARIANTS + ("dequant",)))] if GROUPED_T else []
OUT["table"] = ("DECODE: dict[tuple[str, str], Kernel] = {\n" + "".join(f"    {c!r}: {k!r},\n" for c, k in decode.items())
                + "}\n" + ("TABLE: tuple[tuple[int | None, Kernel], ...] = (\n" + "".join(
                    f"    ({T}, {k!r}),\n" for T, k in rows if k is not None) + ")" if rows else ""))
OUT["seconds"] = round(time.time() - T0, 1)
print("\nsplitspec/models/int4_routed.py, the fastest kernels measured (rows not measured here: as they are):\n"
      + OUT["table"])
print(f"done in {OUT['seconds']} s", flush=True)
save()
