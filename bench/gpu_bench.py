#!/usr/bin/env python3
"""GPU benchmark: correctness on GPU, then costs of Kimi-K2-width synthetic engines, in one run.

1. Correctness: demo pair on GPU (float32, TP = all GPUs), greedy speculation (CUDA graphs) equals
   target-only greedy for several prompts and k.
2. Memory bandwidth (device copy) and all-reduce latency (NCCL, eager and in a CUDA graph) at the message
   sizes a verify uses: T·7168 bf16 for T = B·(k+1).
3. Synthetic Kimi-K2-width engines (random weights, synthetic acceptance with the published drafter's
   profile — labelled): for each TP size and depth, each draft placement, batch B and k: mean cycle time,
   draft ms, verify ms, tokens/s, through the engine (CUDA graphs on).
4. Distinct experts activated per verify of T tokens (the router on random states).

Writes JSON to --out as it goes (partial results survive a time-out).

    python bench/gpu_bench.py --out results/ --tp 1,2 --moe-layers 1,3
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

for k, v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ[k] = v
import torch  # noqa: E402

RESULTS: dict = {}


def save(out: Path) -> None:
    (out / "gpu_bench.json").write_text(json.dumps(RESULTS, indent=1))


def section(name: str, out: Path):
    def wrap(fn):
        def run(*a, **kw):
            t0 = time.time()
            print(f"== {name}", flush=True)
            try:
                RESULTS[name] = fn(*a, **kw)
            except Exception as e:  # keep going: other sections still measure
                RESULTS[name] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-3000:]}
                print(RESULTS[name]["trace"], flush=True)
            RESULTS.setdefault("section_s", {})[name] = round(time.time() - t0, 1)
            save(out)
        return run
    return wrap


def correctness(tmp: Path, ngpu: int) -> dict:
    from splitspec.build import build_engines
    from splitspec.convert import convert_pair
    from splitspec.demo import make_demo_models
    from splitspec.runtime import Request, SpeculativeEngine

    make_demo_models(tmp / "demo", seed=0, trained=False)
    convert_pair(tmp / "demo" / "target", tmp / "demo" / "drafter", tmp / "ck", tp_size=ngpu)
    build_engines(tmp / "ck", tmp / "eng", dtype="float32", max_batch_size=8, max_seq_len=512)
    prompts = ["def fibonacci(n):", "import os\nimport sys\n", "class Stack:\n    def push(self, x):", "x = [i * i for i in"]
    res = {}
    for dtp in sorted({1, ngpu}):
        with SpeculativeEngine.load(tmp / "eng", target_device_ids=list(range(ngpu)), draft_tp=dtp, max_batch_size=8) as eng:
            tok = eng.tokenizer
            ids = [tok.encode(p) for p in prompts]
            ref = [r.token_ids for r in eng.run([Request(i, 40, num_draft_tokens=0, stop_token_ids=set()) for i in ids])]
            for k in (1, 3, 5):
                got = [r.token_ids for r in eng.run([Request(i, 40, num_draft_tokens=k, stop_token_ids=set()) for i in ids])]
                res[f"draft_tp={dtp} k={k}"] = {"identical": got == ref, "graphs": len(eng.group.rank0.graphs.graphs)}
                print(res, flush=True)
    return res


def bandwidth() -> dict:
    x = torch.empty(2 * 1024**3, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        y.copy_(x)
    torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / 10
    return {"copy_GBps_read_plus_write": 2 * x.numel() / dt / 1e9}


def allreduce_worker(rank: int, world: int, port: int, sizes: list[int], q) -> None:
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    out = {}
    for n in sizes:
        x = torch.randn(n, 7168, dtype=torch.bfloat16, device="cuda")
        for _ in range(20):
            dist.all_reduce(x)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(200):
            dist.all_reduce(x)
        torch.cuda.synchronize()
        eager = (time.perf_counter() - t0) / 200 * 1e6
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
    sizes = [1, 2, 4, 6, 8, 16, 24, 32, 48, 64, 96]
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
    from splitspec.synthetic import kimi_k2_target
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


def engine_sweep(tmp: Path, tp: int, moe_layers: int, batches: list[int], ks: list[int], cycles: int, dry_run: bool = False,
                 out: Path | None = None, placements: list[int] | None = None) -> dict:
    from splitspec.runtime import Request, SpeculativeEngine
    from splitspec.synthetic import KIMI_DRAFTER_PROFILE, write_synthetic_engines

    eng_dir = write_synthetic_engines(tmp / f"kimi-tp{tp}-m{moe_layers}", num_layers=1 + moe_layers, tp_size=tp,
                                      max_batch_size=max(batches), max_seq_len=1024, tiny=dry_run)
    rows = []
    for dtp in placements or sorted({1, tp}):
        if dtp not in (1, tp):
            continue
        t0 = time.time()
        with SpeculativeEngine.load(eng_dir, target_device_ids=None if dry_run else list(range(tp)), draft_tp=dtp, max_batch_size=max(batches),
                                    kv_tokens=max(batches) * 1024, synthetic_acceptance=KIMI_DRAFTER_PROFILE) as eng:
            load_s = time.time() - t0
            for B in batches:
                for k in ks:
                    stats = []
                    eng.on_cycle = stats.append
                    # enough tokens for warm-up (prefill, first general cycle, graph capture) plus `cycles` steady cycles
                    reqs = [Request([1 + i] * 16, (cycles + 4) * (k + 1) + 8, num_draft_tokens=k, stop_token_ids=set()) for i in range(B)]
                    for r in reqs:
                        eng.submit(r)
                    t_cycles = []
                    while eng.has_work():
                        c0 = time.perf_counter()
                        eng.step()
                        t_cycles.append((time.perf_counter() - c0) * 1e3)
                    steady = [(t, s) for t, s in zip(t_cycles, stats) if s.decode_seqs == B and s.prefill_tokens == 0][3:3 + cycles]
                    if not steady:
                        continue
                    wall = sum(t for t, _ in steady) / len(steady)
                    emitted = sum(sum(s.emitted) for _, s in steady) / len(steady)
                    row = {"tp": tp, "moe_layers": moe_layers, "layers": 1 + moe_layers, "draft_tp": dtp, "batch": B, "k": k,
                           "cycle_ms": wall, "draft_ms": sum(s.draft_ms for _, s in steady) / len(steady),
                           "verify_ms": sum(s.verify_ms for _, s in steady) / len(steady),
                           "tokens_per_cycle": emitted, "tokens_per_s": emitted / wall * 1e3,
                           "acceptance_length": emitted / B, "synthetic_acceptance": True, "n": len(steady)}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                    RESULTS.setdefault("partial_rows", []).append(row)
                    if out:
                        save(out)
        del eng
        import gc

        gc.collect()
        torch.cuda.empty_cache()
    return {"load_s": load_s, "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/results/gpu")
    ap.add_argument("--tp", default="1,2")
    ap.add_argument("--moe-layers", default="1,3")
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("-k", default="0,1,2,3,4,5")
    ap.add_argument("--cycles", type=int, default=12)
    ap.add_argument("--skip", default="", help="comma list of sections to skip")
    ap.add_argument("--placements", default="1,N", help="draft_tp values to sweep: 1 and/or N (the target's TP size)")
    ap.add_argument("--hang-dump-s", type=float, default=0, help="print every thread's stack if still running after this many s")
    ap.add_argument("--dry-run", action="store_true", help="CPU, demo-sized synthetic engines: checks the script, measures nothing useful")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    ngpu = torch.cuda.device_count() if not a.dry_run else 2
    skip = set(a.skip.split(","))
    RESULTS["machine"] = {"gpus": [torch.cuda.get_device_name(i) for i in range(ngpu)] if not a.dry_run else ["cpu"],
                          "torch": torch.__version__, "python": sys.version.split()[0]}
    if a.dry_run:
        os.environ["SPLITSPEC_PADDED"] = "1"
        skip |= {"correctness", "bandwidth", "allreduce", "experts"}
    save(out)
    tmp = Path(tempfile.mkdtemp())
    if "correctness" not in skip:
        section("correctness", out)(correctness)(tmp, ngpu)
    if "bandwidth" not in skip:
        section("bandwidth", out)(bandwidth)()
    if "allreduce" not in skip and ngpu > 1:
        section("allreduce", out)(allreduce)(ngpu)
    if "experts" not in skip:
        section("distinct_experts", out)(distinct_experts)()
    if a.hang_dump_s:
        import faulthandler

        faulthandler.dump_traceback_later(a.hang_dump_s, exit=True)
    for tp in [int(x) for x in a.tp.split(",") if int(x) <= ngpu]:
        placements = [tp if x == "N" else int(x) for x in a.placements.split(",")]
        for m in [int(x) for x in a.moe_layers.split(",")]:
            section(f"engine_tp{tp}_moe{m}", out)(engine_sweep)(tmp, tp, m, [int(x) for x in a.batches.split(",")],
                                                               [int(x) for x in a.k.split(",")], a.cycles, a.dry_run, out, placements)
            torch.cuda.empty_cache()
    print("done", flush=True)


if __name__ == "__main__":
    main()
