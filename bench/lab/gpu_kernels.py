"""Kernel-level GPU measurements of bench/gpu_bench.py at Kimi-K2 widths (hidden 7168, 384 routed experts of
intermediate 2048, 8 per token): device-copy bandwidth, all-reduce latency, distinct experts per verify, and the
routed experts' fused decode kernels (bf16 and block-scaled FP8) against the grouped GEMMs. Each returns the rows
of its section of ``gpu_bench.json``; times in ms unless a key says otherwise."""

from __future__ import annotations

import itertools
import json
import time

import torch


def per_call_s(fn, warm: int, iters: int) -> float:
    """Seconds per call of ``fn`` (no arguments, eager): ``warm`` calls first, then ``iters`` timed between two
    device synchronisations."""
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters


def bandwidth() -> dict:
    x = torch.empty(2 * 1024**3, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    dt = per_call_s(lambda: y.copy_(x), warm=3, iters=10)
    return {"copy_GBps_read_plus_write": 2 * x.numel() / dt / 1e9}


def allreduce_worker(rank: int, world: int, port: int, sizes: list[int], q) -> None:
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    out = {}
    for n in sizes:
        x = torch.randn(n, 7168, dtype=torch.bfloat16, device="cuda")
        eager = per_call_s(lambda: dist.all_reduce(x), warm=20, iters=200) * 1e6
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            dist.all_reduce(x)
        torch.cuda.current_stream().wait_stream(s)
        with torch.cuda.graph(g):
            for _ in range(20):
                dist.all_reduce(x)
        for _ in range(3):
            g.replay()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(20):
            g.replay()
        torch.cuda.synchronize()
        graphed = (time.perf_counter() - t0) / 400 * 1e6
        out[n] = {"bytes": n * 7168 * 2, "eager_us": eager, "graph_us": graphed}
    if rank == 0:
        q.put(out)
    dist.destroy_process_group()


def allreduce(world: int) -> dict:
    import socket

    import torch.multiprocessing as mp

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    sizes = [1, 2, 4, 6, 16, 24, 64, 96]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=allreduce_worker, args=(r, world, port, sizes, q)) for r in range(world)]
    for p in procs:
        p.start()
    res = q.get(timeout=300)
    for p in procs:
        p.join(60)
    return {"world": world, "rows": res}


def distinct_experts() -> dict:
    from splitspec.build.synthetic import kimi_k2_target
    from splitspec.models.target import noaux_tc_route

    cfg = kimi_k2_target(2)
    g = torch.Generator(device="cuda").manual_seed(0)
    gate = torch.randn(384, 7168, device="cuda", generator=g) * 7168 ** -0.5
    bias = torch.randn(384, device="cuda", generator=g) * 0.01
    out = {}
    for T in (1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 24, 32, 48, 64, 96):
        counts = []
        for _ in range(20):
            x = torch.randn(T, 7168, device="cuda", generator=g)
            _, ids = noaux_tc_route(x, gate, bias, cfg)
            counts.append(ids.unique().numel())
        out[T] = sum(counts) / len(counts)
    return out


def capture_graph(fn, reps: int = 1) -> torch.cuda.CUDAGraph:
    """A CUDA graph of ``reps`` calls of ``fn`` (no arguments, static tensors), after one warm-up call on a side
    stream."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    return g


def timed_graph(fn, reps: int = 10, replays: int = 20) -> float:
    """Median ms of one call of ``fn`` (no arguments, static tensors), from replays of a CUDA graph of ``reps`` calls."""
    g = capture_graph(fn, reps)
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / reps)
    return sorted(times)[len(times) // 2]


def graph_timeline(fn, replays: int = 20) -> dict:
    """Where one call of ``fn`` (no arguments, static tensors) spends its time on the GPU: a CUDA graph of it
    replayed ``replays`` times under torch.profiler. ``span_us``: median first-kernel start to last-kernel end of a
    replay; ``busy_us``: median sum of its kernels' durations (overlapping kernels of parallel branches each count);
    ``kernels``: the median replay's kernels in start order, each with its start (µs from the first) and duration."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile as torch_profile

    g = capture_graph(fn)
    g.replay()
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            g.replay()
            torch.cuda.synchronize()
    ev = sorted(((e.name, e.time_range.start, e.time_range.end) for e in prof.events()
                 if e.device_type == DeviceType.CUDA), key=lambda e: e[1])
    n = len(ev) // replays
    if not n:
        return {"kernels": [], "note": "the profiler saw no kernel of the graph's replays"}
    runs = sorted((ev[i * n:(i + 1) * n] for i in range(replays)), key=lambda r: max(e[2] for e in r) - r[0][1])
    mid = runs[len(runs) // 2]
    t0 = mid[0][1]
    return {"span_us": max(e[2] for e in mid) - t0, "busy_us": sum(e[2] - e[1] for e in mid), "per_replay": n,
            "kernels": [{"name": name[:60], "start_us": round(a - t0, 1), "us": round(b - a, 1)} for name, a, b in mid]}


def kimi_experts(tp: int, g: torch.Generator, n: int = 384) -> tuple[torch.Tensor, torch.Tensor]:
    """Random bf16 experts of one Kimi-K2 rank at expert-TP ``tp``: w13 [n, 4096/tp, 7168], w2 [n, 7168, 2048/tp]
    (n = 384: the routed experts; n = 1: the shared expert)."""
    I = 2048 // tp
    return (torch.randn(n, 2 * I, 7168, dtype=torch.bfloat16, device="cuda", generator=g) * 7168 ** -0.5,
            torch.randn(n, 7168, I, dtype=torch.bfloat16, device="cuda", generator=g) * I ** -0.5)


def routed_tokens(T: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """T random tokens [T, 7168] bf16, each with 8 distinct experts of 384 [T, 8] and routing weights [T, 8]."""
    ids = torch.stack([torch.randperm(384, device="cuda", generator=g)[:8] for _ in range(T)])
    return torch.randn(T, 7168, dtype=torch.bfloat16, device="cuda", generator=g), ids, torch.rand(T, 8, device="cuda", generator=g)


def moe_kernel(bw_GBps: float, tps: list[int]) -> dict:
    """Routed experts alone at Kimi-K2 shapes (384 experts, 8 per token, hidden 7168, intermediate 2048 / TP):
    the fused decode kernels against the grouped GEMMs by token count, both at their bytes (distinct experts
    × expert bytes) over the measured bandwidth. First a sweep of the fused kernels' block sizes at 1 and 4
    tokens, every TP shape — at 1 token with the shared expert in the kernels, as the engine runs them (its 9th
    pair changes how the grid fills the GPU). The best configurations (lowest time summed over the TP shapes:
    gate_up's at 1 token and at 4 tokens, down's over both) then serve the rest of the run; the best per shape is
    reported too."""
    from splitspec.models import fused_moe
    from splitspec.models.target import grouped_experts

    bw = bw_GBps * 1e6  # bytes per ms
    out = {"sweep": [], "rows": []}
    g = torch.Generator(device="cuda").manual_seed(0)
    weights = {tp: kimi_experts(tp, g) for tp in tps}
    shared = {tp: tuple(w[0] for w in kimi_experts(tp, g, 1)) for tp in tps}
    blocks = {"gate_up": [(n, k, w, st) for n in (8, 16, 32) for k in (512, 1024) for w in (4, 8) for st in (3, 4)
                          if n * k <= 16384],
              "down": [(n, k, w, st) for n in (8, 16) for k in (256, 512) for w in (4, 8) for st in (2, 4)]}
    problems = {T: routed_tokens(T, g) for T in (1, 4)}
    for which in ("gate_up", "down"):
        for cfg in blocks[which]:
            row = {"kernel": which, "config": cfg}
            for (T, (x, ids, wts)), tp in itertools.product(problems.items(), tps):
                kw = {"gate_up_config": cfg} if which == "gate_up" else {"down_config": cfg}
                sh = shared[tp] if T == 1 else ()
                row[f"ms_tp{tp}_T{T}"] = timed_graph(lambda: fused_moe.fused_experts(x, ids, wts, *weights[tp], *sh, **kw))
            out["sweep"].append(row)
            print(json.dumps(row), flush=True)

    def fastest(which: str, suffix: str = "") -> tuple[int, int, int, int]:
        """The configuration of ``which`` with the lowest time summed over its ms_* columns ending in ``suffix``."""
        rows = [r for r in out["sweep"] if r["kernel"] == which]
        return min(rows, key=lambda r: sum(v for n, v in r.items() if n.startswith("ms_") and n.endswith(suffix)))["config"]

    fused_moe.GATE_UP_CONFIG_ONE_TOKEN, fused_moe.GATE_UP_CONFIG = fastest("gate_up", "_T1"), fastest("gate_up", "_T4")
    fused_moe.DOWN_CONFIG = fastest("down")
    out["chosen"] = {"gate_up_one_token": fused_moe.GATE_UP_CONFIG_ONE_TOKEN, "gate_up": fused_moe.GATE_UP_CONFIG,
                     "down": fused_moe.DOWN_CONFIG}
    shapes = [f"_tp{tp}_T{T}" for T in problems for tp in tps]
    out["best_by_shape"] = {which: {f"ms{sh}": fastest(which, sh) for sh in shapes} for which in ("gate_up", "down")}
    print("chosen", out["chosen"], "best by shape", out["best_by_shape"], flush=True)
    for tp in tps:
        w13, w2 = weights[tp]
        expert_bytes = w13[0].nbytes + w2[0].nbytes
        for T in (1, 2, 4, 8, 16, 32, 64):
            x, ids, wts = routed_tokens(T, g)
            ref = grouped_experts(x, ids, wts, w13, w2).float()
            got = fused_moe.fused_experts(x, ids, wts, w13, w2).float()
            nbytes = ids.unique().numel() * expert_bytes
            row = {"tp": tp, "tokens": T, "distinct_experts": ids.unique().numel(), "bytes": nbytes, "bound_ms": nbytes / bw,
                   "max_rel_diff_vs_grouped": ((got - ref).abs().max() / ref.abs().max()).item(),
                   "grouped_ms": timed_graph(lambda: grouped_experts(x, ids, wts, w13, w2)),
                   "fused_ms": timed_graph(lambda: fused_moe.fused_experts(x, ids, wts, w13, w2))}
            row |= {"grouped_GBps": nbytes / row["grouped_ms"] / 1e6, "fused_GBps": nbytes / row["fused_ms"] / 1e6,
                    "fused_in_engine": T <= fused_moe.MAX_TOKENS}
            out["rows"].append(row)
            print(json.dumps(row), flush=True)
    del weights, shared
    torch.cuda.empty_cache()
    return out


def moe_fp8(bw_GBps: float) -> dict:
    """Routed experts (Kimi-K2 shapes, TP1) in block-scaled FP8 with 128×128 tiles — the released checkpoint's
    format — read as FP8 by the fused kernels, against the same experts in bf16: time, bytes over bandwidth, and
    the FP8 result's difference from the bf16 one (quantisation error, not kernel error: the kernels' FP8
    arithmetic is tested against dequantised weights in tests/engine/test_fused_moe.py)."""
    from splitspec import quant
    from splitspec.models import fused_moe

    g = torch.Generator(device="cuda").manual_seed(0)
    w13, w2 = kimi_experts(1, g)
    fp8 = []
    for w in (w13, w2):  # expert by expert: the whole stack in float32 at once would not fit beside it
        q = torch.empty(w.shape, dtype=torch.float8_e4m3fn, device="cuda")
        s = torch.empty(w.shape[0], *quant.fp8_scale_shape(tuple(w.shape[1:]), (128, 128)), device="cuda")
        for e in range(w.shape[0]):
            q[e], s[e] = quant.quantize_fp8(w[e], (128, 128))
        fp8.append((q, s))
    (q13, s13), (q2, s2) = fp8
    rows = []
    for T in (1, 4, 16):
        x, ids, wts = routed_tokens(T, g)
        run8 = lambda: fused_moe.fused_experts(x, ids, wts, q13, q2, scales=(s13, s2, None, None), fp8_block=(128, 128))  # noqa: E731
        run16 = lambda: fused_moe.fused_experts(x, ids, wts, w13, w2)  # noqa: E731
        a, b = run8().float(), run16().float()
        distinct = ids.unique().numel()
        nbytes = distinct * (q13[0].nbytes + q2[0].nbytes + s13[0].nbytes + s2[0].nbytes)
        row = {"tokens": T, "distinct_experts": distinct, "fp8_bytes": nbytes, "fp8_ms": timed_graph(run8),
               "bf16_ms": timed_graph(run16), "fp8_vs_bf16_max_rel": ((a - b).abs().max() / b.abs().max()).item()}
        row |= {"fp8_GBps": nbytes / row["fp8_ms"] / 1e6, "fp8_bound_ms": nbytes / (bw_GBps * 1e6)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    del w13, w2, fp8, q13, q2
    torch.cuda.empty_cache()
    return {"rows": rows}


def moe_int4(bw_GBps: float, tps: list[int]) -> dict:
    """Routed experts (Kimi-K2.5 shapes: 384 experts, 8 per token, hidden 7168, intermediate 2048 / TP) kept INT4
    as published (packed int32 + bf16 group-32 scales) and read by splitspec.models.int4_moe's ``fma`` kernels, against
    their bound: distinct experts × (packed + scale bytes) / the measured copy bandwidth. First a sweep of block sizes
    at 1 and 4 tokens over the TP shapes (the best sum serves the rest); then 1, 2, 4, 8, 16 tokens at each shape,
    beside the bf16 fused kernels on the same experts dequantised (their own bytes and bound), and the INT4 result's
    difference from those (kernel error only: the weights are the same numbers). Every variant and the grouped
    kernels: bench/lab/int4_moe_bench.py."""
    from splitspec.models import fused_moe, int4_moe

    bw = bw_GBps * 1e6  # bytes per ms
    g = torch.Generator(device="cuda").manual_seed(0)
    out = {"sweep": [], "rows": []}

    def experts(tp: int):  # random nibbles and scales ~ N(0, 1) weights' group-32 absmax / 7
        I = 2048 // tp
        p13 = torch.randint(-2**31, 2**31 - 1, (384, 2 * I, 7168 // 8), dtype=torch.int32, device="cuda", generator=g)
        p2 = torch.randint(-2**31, 2**31 - 1, (384, 7168, I // 8), dtype=torch.int32, device="cuda", generator=g)
        s13 = (torch.rand(384, 2 * I, 7168 // 32, device="cuda", generator=g) * 0.1 * 7168 ** -0.5).to(torch.bfloat16)
        s2 = (torch.rand(384, 7168, I // 32, device="cuda", generator=g) * 0.1 * I ** -0.5).to(torch.bfloat16)
        return p13, s13, p2, s2

    weights = {tp: experts(tp) for tp in tps}
    problems = {T: routed_tokens(T, g) for T in (1, 4)}
    blocks = [(n, k, w, st) for n in (8, 16, 32, 64) for k in (256, 512, 1024) for w in (4, 8) for st in (3, 4) if n * k <= 32768]
    for which in ("gate_up", "down"):
        for cfg in blocks:
            row = {"kernel": which, "config": cfg}
            d = int4_moe.DEFAULT
            kw = {"kernel": int4_moe.Kernel("fma", cfg + (1,), d.down) if which == "gate_up" else
                  int4_moe.Kernel("fma", d.gate_up, cfg + (1,))}
            for (T, (x, ids, wts)), tp in itertools.product(problems.items(), tps):
                row[f"ms_tp{tp}_T{T}"] = timed_graph(lambda: int4_moe.int4_experts(x, ids, wts, *weights[tp], **kw))
            out["sweep"].append(row)
            print(json.dumps(row), flush=True)
    for which in ("gate_up", "down"):
        best = min((r for r in out["sweep"] if r["kernel"] == which), key=lambda r: sum(v for n, v in r.items() if n.startswith("ms_")))
        out.setdefault("chosen", {})[which] = best["config"]
    chosen = int4_moe.Kernel("fma", tuple(out["chosen"]["gate_up"]) + (1,), tuple(out["chosen"]["down"]) + (1,))
    print("chosen", out["chosen"], flush=True)
    for tp in tps:
        p13, s13, p2, s2 = weights[tp]
        expert_bytes = p13[0].nbytes + s13[0].nbytes + p2[0].nbytes + s2[0].nbytes
        for T in (1, 2, 4, 8, 16):
            x, ids, wts = routed_tokens(T, g)
            used, local = ids.unique(return_inverse=True)  # dequantise only the chosen experts for the bf16 comparison
            w13 = torch.stack([quant_dequant(p13[e], s13[e]) for e in used.tolist()])
            w2 = torch.stack([quant_dequant(p2[e], s2[e]) for e in used.tolist()])
            got = int4_moe.int4_experts(x, ids, wts, p13, s13, p2, s2, kernel=chosen).float()
            ref = fused_moe.fused_experts(x, local, wts, w13, w2).float()
            distinct = used.numel()
            nbytes = distinct * expert_bytes
            row = {"tp": tp, "tokens": T, "distinct_experts": distinct, "int4_bytes": nbytes, "bound_ms": nbytes / bw,
                   "int4_ms": timed_graph(lambda: int4_moe.int4_experts(x, ids, wts, p13, s13, p2, s2, kernel=chosen)),
                   "bf16_ms": timed_graph(lambda: fused_moe.fused_experts(x, local, wts, w13, w2)),
                   "bf16_bound_ms": distinct * (w13[0].nbytes + w2[0].nbytes) / bw,
                   "int4_vs_bf16_max_rel": ((got - ref).abs().max() / ref.abs().max()).item()}
            row["ratio_to_bound"] = row["int4_ms"] / row["bound_ms"]
            out["rows"].append(row)
            print(json.dumps(row), flush=True)
            del w13, w2
    del weights
    torch.cuda.empty_cache()
    return out


def quant_dequant(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """One INT4 expert linear dequantised to bf16 (splitspec.quant.dequantize_int4, group 32)."""
    from splitspec import quant

    return quant.dequantize_int4(packed, scale, packed.shape[-1] * 8, 32, torch.bfloat16)
