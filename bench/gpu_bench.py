#!/usr/bin/env python3
"""GPU benchmark: correctness on GPU, then costs of Kimi-K2-width synthetic engines, in one run.

1. Correctness: tests/gpu/test_gpu.py (demo pair on up to 2 GPUs, float32: greedy speculation with CUDA graphs
   equals target-only greedy for several prompts, k and both draft placements).
2. Memory bandwidth (device copy) and all-reduce latency (NCCL, eager and in a CUDA graph) at the message
   sizes a verify uses: T·7168 bf16 for T = B·(k+1).
3. Synthetic Kimi-K2-width engines (random weights, synthetic acceptance with the published drafter's
   profile — labelled): for each TP size and depth, each draft placement, batch B and k: median steady cycle
   (the mean over ``--sweep-loads`` engine loads of each load's median), draft ms, verify ms, tokens/s,
   through the engine (CUDA graphs on).
4. Distinct experts activated per verify of T tokens (the router on random states).

Sections 2 and 4 and the MoE kernel timings are in bench/lab/gpu_kernels.py. Writes JSON to --out after each
section (a time-out keeps the sections finished before it; an engine sweep's rows come once all its loads have run).

    python bench/gpu_bench.py --out results/ --tp 1,2 --moe-layers 1,3
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path
from unittest.mock import patch

from lab import NO_NVLINK_MULTICAST

os.environ.update(NO_NVLINK_MULTICAST)
import torch
import torch._dynamo

from lab.gpu_kernels import allreduce, bandwidth, distinct_experts, moe_fp8, moe_int4, moe_kernel, timed_graph

from splitspec.measure.cost_model import KimiScale

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


def correctness() -> dict:
    """tests/gpu/test_gpu.py (speculative greedy on GPU = target-only greedy, both placements) in a subprocess, in a
    session of its own so that a time-out also ends its worker ranks. ``passed``: every case ran and passed."""
    import signal
    import subprocess

    repo = Path(__file__).resolve().parent.parent
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(repo / "tests" / "gpu" / "test_gpu.py")],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=repo, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=900)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        out += "\n(killed after 900 s)"
    print(out[-4000:], flush=True)
    summary = out.strip().splitlines()[-1] if out.strip() else ""
    return {"passed": proc.returncode == 0 and " passed" in summary and "skipped" not in summary, "summary": summary}


def layer_costs(tps: list[int], batches: list[int], ks: list[int], bw_GBps: float, allreduce_us: dict,
                skinny: tuple[bool, ...] = (False,), drafter: bool = True,
                profiled: tuple[tuple[int, int], ...] = ((0, 1), (1, 1), (1, 16))) -> dict:
    """Per-layer decode/verify time of one Kimi-width rank (TP-N shard shapes on one GPU, collectives excluded and
    added to the bound from the measured all-reduce), against its bound: weight bytes read / measured bandwidth
    + 2 all-reduces. Also the lm_head and (``drafter``) the TP1 drafter step. Kernel tables from the profiler of the
    ``profiled`` (layer, tokens): layer 0 dense, 1 MoE. Each row and table once per ``skinny`` setting (TargetModel's ``skinny_gemm``; rows say which)."""
    from splitspec.models import fused_moe, skinny_gemm
    from splitspec.config import Mapping
    from splitspec.models.layers import TPComm, rms_norm
    from splitspec.models.batch import padded
    from splitspec.models.drafter import DrafterKVCache, DrafterModel
    from splitspec.models.target import TargetKVCache, TargetModel, noaux_tc_route
    from splitspec.build.synthetic import kimi_k2_drafter, kimi_k2_target
    from splitspec.models.shapes import drafter_shapes, random_weights, target_shapes

    cfg, S, start = kimi_k2_target(2), 256, 100
    rows_out, profiles = [], {}
    bw = bw_GBps * 1e6  # bytes per ms
    seqs_max = max(*batches, 16)  # the profiles below run 16 sequences
    for tp in tps:
        # each TP size compiles afresh, as in an engine (one TP size per process): dynamo caches compiled code per
        # function, and with dynamic shapes a later TP size would otherwise reuse kernels tuned for the first
        torch._dynamo.reset()
        mapping = Mapping(tp)
        w = random_weights(target_shapes(cfg, mapping), torch.bfloat16, "cuda", seed=0)
        model = TargetModel(cfg, mapping, 0, w, TPComm())
        model.compile()
        fast = model.fast
        cache = TargetKVCache(cfg, seqs_max * S + 16, torch.bfloat16, "cuda")
        nb = lambda names: sum(w[n].nbytes for n in names)  # noqa: E731
        attn = nb([n for n in w if n.startswith("layers.0.attn.") or n.startswith("layers.0.") and "layernorm" in n])
        dense = attn + nb(["layers.0.mlp.w13", "layers.0.mlp.w2"])
        per_expert = (w["layers.1.mlp.experts.w13"][0].nbytes + w["layers.1.mlp.experts.w2"][0].nbytes)
        moe_fixed = nb([n for n in w if n.startswith("layers.1.") and "experts." not in n])
        ar = allreduce_us.get(tp, 0.0) if tp > 1 else 0.0
        for B in batches:
            for k in ks:
                n = k + 1
                seqs = [(list(range(b * (S // 16), (b + 1) * (S // 16))), start, [1] * n) for b in range(B)]
                batch = padded(seqs, S, "cuda", scratch_row=seqs_max * S, pad_to=B)
                cos, sin = model.rotary.cos_sin(batch.positions)
                h = torch.randn(B * n, 7168, device="cuda", dtype=torch.bfloat16)
                pend = torch.randn_like(h)  # the previous layer's reduced MLP output (the dense layer 0 has none)
                x = rms_norm(h, w["layers.1.post_attention_layernorm"], 1e-6)
                experts = noaux_tc_route(x, w["layers.1.mlp.gate"], w["layers.1.mlp.e_score_correction_bias"], cfg)[1].unique().numel()
                # (compiled, fused_moe.MAX_TOKENS): the engine's path eager and compiled, then for comparison
                # (compiled) the MoE layer's experts as grouped GEMMs
                variants = [(compiled, fused_moe.MAX_TOKENS) for compiled in ((False, True) if k == 0 else (True,))]
                grouped = [(True, 0)] if B * n <= fused_moe.MAX_TOKENS else []
                for (layer, name, nbytes), on in itertools.product(((0, "dense", dense), (1, "moe", moe_fixed + experts * per_expert)), skinny):
                    prev = pend if layer else None
                    model.skinny_gemm = on
                    for compiled, max_fused in variants + (grouped if layer else []):
                        with patch.object(fused_moe, "MAX_TOKENS", max_fused):
                            model.fast = fast if compiled else None
                            ms = timed_graph(lambda: model.block(layer, h, prev, batch, cache, cos, sin))
                            bound = nbytes / bw + 2 * ar / 1e3
                            routed = ("fused" if B * n <= max_fused else "grouped") if layer else None
                            variant = "grouped GEMMs" if max_fused == 0 else None
                            rows_out.append({"tp": tp, "layer": name, "compiled": compiled, "routed": routed, "skinny_gemm": on,
                                             "comparison": variant is not None, "variant": variant,
                                             "batch": B, "k": k, "tokens": B * n,
                                             "experts": experts if layer else 0, "ms": ms, "weight_bytes": nbytes, "allreduce_us": ar,
                                             "bound_ms": bound, "ms_with_allreduce": ms + 2 * ar / 1e3,
                                             "ratio_to_bound": (ms + 2 * ar / 1e3) / bound})
                            print(json.dumps(rows_out[-1]), flush=True)
                last = torch.randn(B * n, 7168, device="cuda", dtype=torch.bfloat16)
                ms = timed_graph(lambda: torch.nn.functional.linear(last, w["lm_head"]))
                rows_out.append({"tp": tp, "layer": "lm_head", "batch": B, "k": k, "tokens": B * n, "ms": ms,
                                 "weight_bytes": w["lm_head"].nbytes, "bound_ms": w["lm_head"].nbytes / bw,
                                 "ratio_to_bound": ms / (w["lm_head"].nbytes / bw)})
        model.fast = fast
        # every shard shape's kernel table (the TP8 shard's is where small kernels weigh most)
        from torch.profiler import ProfilerActivity, profile

        for (layer, T), on in itertools.product(profiled, skinny):
            if on and T > skinny_gemm.MAX_TOKENS:  # the same kernels as off
                continue
            model.skinny_gemm = on
            batch = padded([(list(range(b * 16, b * 16 + 16)), start, [1]) for b in range(T)], S, "cuda", scratch_row=seqs_max * S)
            cos, sin = model.rotary.cos_sin(batch.positions)
            h = torch.randn(T, 7168, device="cuda", dtype=torch.bfloat16)
            prev = torch.randn_like(h) if layer else None  # the dense layer 0 has no pending add
            model.block(layer, h, prev, batch, cache, cos, sin)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    model.block(layer, h, prev, batch, cache, cos, sin)
                torch.cuda.synchronize()
            name = f"tp{tp}_{'moe' if layer else 'dense'}_T{T}" + ("_skinny" if on else "")
            profiles[name] = prof.key_averages().table(sort_by="cuda_time_total", row_limit=40, max_name_column_width=70)
            print(profiles[name], flush=True)
        del model, w, cache
        torch.cuda.empty_cache()
    if not drafter:
        return {"window": S, "rows": rows_out, "profiles": profiles}
    dcfg = kimi_k2_drafter(2)
    dw = random_weights(drafter_shapes(dcfg), torch.bfloat16, "cuda", seed=1)
    dm = DrafterModel(dcfg, dw)
    dcache = DrafterKVCache(dcfg, max(batches) * S + 16, torch.bfloat16, "cuda")
    step_bytes = sum(t.nbytes for n, t in dw.items() if n not in ("embed_tokens", "fc", "draft_to_target"))
    draft_rows = []
    for B in batches:
        batch = padded([(list(range(b * 16, b * 16 + 16)), start, [1]) for b in range(B)], S, "cuda", scratch_row=max(batches) * S)
        hid = torch.randn(B, 7168, device="cuda", dtype=torch.bfloat16)
        ms = timed_graph(lambda: dm.propose(dm.forward(batch, hid, dcache)[0]))
        draft_rows.append({"batch": B, "ms": ms, "weight_bytes": step_bytes, "bound_ms": step_bytes / bw, "ratio_to_bound": ms * bw / step_bytes})
        print(json.dumps(draft_rows[-1]), flush=True)
    return {"window": S, "rows": rows_out, "drafter_step_tp1": draft_rows, "profiles": profiles}


def engine_sweep(tmp: Path, tp: int, moe_layers: int, batches: list[int], ks: list[int], cycles: int, dry_run: bool = False,
                 placements: list[int] | None = None, loads: int = 1) -> dict:
    """Steady cycles of every placement × B × k on synthetic Kimi-width engines of this TP size and depth
    (16-token prompts), each placement's engines loaded ``loads`` times, alternating (``splitspec.measure.tune.measure``:
    a row's cycle_ms is the mean of its loads' medians, ``cycle_ms_by_load`` keeps them)."""
    from splitspec.build.synthetic import KIMI_DRAFTER_PROFILE, write_synthetic_engines
    from splitspec.measure.tune import measure
    from splitspec.settings import ServeConfig

    torch._dynamo.reset()  # compile for this TP size afresh, as an engine does (see layer_costs)
    eng_dir = write_synthetic_engines(tmp / f"kimi-tp{tp}-m{moe_layers}", num_layers=1 + moe_layers, tp_size=tp,
                                      max_batch_size=max(batches), max_seq_len=1024, tiny=dry_run)
    t0 = time.time()
    cfg = ServeConfig.from_env(engines_dir=eng_dir, target_device_ids=() if dry_run else tuple(range(tp)),
                               synthetic_acceptance=KIMI_DRAFTER_PROFILE)
    measured = measure(cfg, [d for d in placements or sorted({1, tp}) if d in (1, tp)], batches, ks,
                       [[1 + i] * 16 for i in range(max(batches))], 1024, cycles, loads,
                       f"engine sweep TP{tp}, {moe_layers} MoE layers")
    rows = [{"tp": tp, "moe_layers": moe_layers, "layers": 1 + moe_layers} | r | {"synthetic_acceptance": True} for r in measured]
    RESULTS.setdefault("partial_rows", []).extend(rows)  # saved with the section
    return {"loads": loads, "measure_s": time.time() - t0, "rows": rows}


def tune_vs_sweep(tmp: Path, tp: int, moe_layers: int, batches: list[int], ks: list[int], sweep: list[dict], cycles: int,
                  loads: int = 2, dry_run: bool = False) -> dict:
    """Run ``splitspec tune --verify`` on the synthetic engines of one sweep, then score its choice against that
    sweep (an independent, exhaustive measurement of every placement × k, 16-token prompts) as well as against
    the tuner's own second sweep (the evaluation prompts): chosen config's tokens/s over the best."""
    from splitspec.build.synthetic import KIMI_DRAFTER_PROFILE
    from splitspec.measure.tune import score, tune
    from splitspec.settings import ServeConfig

    cfg = ServeConfig.from_env(engines_dir=tmp / f"kimi-tp{tp}-m{moe_layers}",
                               target_device_ids=() if dry_run else tuple(range(tp)), synthetic_acceptance=KIMI_DRAFTER_PROFILE)
    choice = tune(cfg, batches, ks, Path(__file__).resolve().parent.parent / "eval" / "prompts.jsonl",
                  max_seq_len=1024, verify=True, cycles=cycles, loads=loads)
    sc, sc_emitted = score(choice, sweep, batches), score(choice, sweep, batches, "tokens_per_s")
    for B, r in sc.items():
        print(f"tune B={B}: chosen ×{r['chosen_over_best']:.3f} of the sweep's best (draft_tp={r['best']['draft_tp']}, k={r['best']['k']}), "
              f"×{r['chosen_over_no_speculation']:.2f} over no speculation; with each row's own acceptance ×{sc_emitted[B]['chosen_over_best']:.3f}", flush=True)
    return {"choice": {k: v for k, v in choice.items() if k not in ("measured", "verification")}, "tuner_rows": choice["measured"],
            "score": sc, "score_emitted": sc_emitted, "verification": choice["verification"]}


def switch_cost(tmp: Path, tp: int, moe_layers: int, batch: int, k: int, cycles: int, prompt_tokens: int = 256,
                dry_run: bool = False) -> dict:
    """What a change of draft placement costs: both placements loaded on the synthetic engines of one sweep,
    ``batch`` sequences of ``prompt_tokens``-token prompts decoding with k draft tokens; steady cycles drafted
    always by the split drafter, always by the sharded one, and by each in turn — every cycle then first
    moves the drafter K/V rows of all ``batch`` sequences (``RankRunner.switch_placement``). Medians of
    ``cycles`` steady cycles each, the three modes interleaved over 4 passes. ``switch_ms``: alternating minus
    the mean of the two fixed modes, the cost of one switch; ``kv_bytes_moved``: K and V bytes per switch at
    the first steady cycle (a lower bound: the contexts grow by ≥ 1 token per cycle)."""
    import statistics

    from splitspec.engine.group import Group
    from splitspec.models.kv import BLOCK_SIZE
    from splitspec.runtime.scheduler import SpeculativeEngine
    from splitspec.build.synthetic import KIMI_DRAFTER_PROFILE
    from splitspec.measure.tune import steady_round
    from splitspec.settings import ServeConfig

    if tp == 1:
        return {"skipped": "TP1: one placement"}
    cfg = ServeConfig.from_env(engines_dir=tmp / f"kimi-tp{tp}-m{moe_layers}", target_device_ids=() if dry_run else tuple(range(tp)),
                               kv_tokens=batch * 1024, num_draft_tokens=0, max_batch_size=batch,
                               synthetic_acceptance=KIMI_DRAFTER_PROFILE)
    group = Group(cfg, (1, tp))
    modes = {"draft_tp=1": [1], f"draft_tp={tp}": [tp], "alternating": [1, tp]}
    times: dict[str, list[float]] = {m: [] for m in modes}
    with SpeculativeEngine(group) as eng:
        prompts = [[1 + i] * prompt_tokens for i in range(batch)]
        for _ in range(4):
            for mode, turns in modes.items():
                order = itertools.cycle(turns)
                eng.draft_tp_for = lambda b, order=order: next(order)
                times[mode] += [t for t, _ in steady_round(eng, prompts, k, -(-cycles // 4), 3)]
        dcache = group.rank0.slots[tp][1]
        steady = prompt_tokens + 3 * (k + 1)  # a sequence's drafter K/V after the warm-up (≥ 1 token per cycle)
        rows = batch * -(-steady // BLOCK_SIZE) * BLOCK_SIZE  # at least this much, whole blocks
    out = {m: statistics.median(t) for m, t in times.items()} | {"n": {m: len(t) for m, t in times.items()}}
    out |= {"batch": batch, "k": k, "prompt_tokens": prompt_tokens,
            "switch_ms": out["alternating"] - (out["draft_tp=1"] + out[f"draft_tp={tp}"]) / 2,
            "kv_bytes_moved": rows * 2 * dcache.k[0].numel() * tp * dcache.k.element_size()}
    print(json.dumps(out), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--out", default="bench/results/gpu", help="results folder (gpu_bench.json; bench/cost_model.py --png plots its engine sweeps)")
    ap.add_argument("--tp", default="1,2", help="comma list: target TP sizes of the engine sweeps (sizes above the GPUs here are skipped)")
    ap.add_argument("--moe-layers", default="1,3", help="comma list: MoE layers (after one dense layer) of the engine sweeps' depths")
    ap.add_argument("--batches", default="1,4,16", help="comma list: batch sizes of the layer timings and engine sweeps")
    ap.add_argument("-k", default="0,1,2,3,4,5", help="comma list: draft tokens per cycle of the engine sweeps")
    ap.add_argument("--cycles", type=int, default=48, help="steady cycles timed per configuration (sweep and tuner)")
    ap.add_argument("--layer-tp", default="1,2,8", help="comma list: TP shard shapes timed per layer (on one GPU)")
    ap.add_argument("--layer-k", default="0,1,3,5", help="comma list: k values of the per-layer timings")
    ap.add_argument("--layer-skinny-gemm", default="0", help="comma list of 0/1: the per-layer timings with the target's "
                    "skinny-GEMM kernel off and/or on (ServeConfig.skinny_gemm)")
    ap.add_argument("--moe-tp", default="1,2,8", help="comma list: TP shard shapes of the MoE kernel sweep; the block "
                    "configurations fastest summed over them serve the later sections (not run with --dry-run)")
    ap.add_argument("--tune", default="", metavar="TP,MOE_LAYERS", help="after that sweep, run `splitspec tune` on its engines and score it")
    ap.add_argument("--tune-loads", type=int, default=4, help="the tuner's engine loads per placement (`splitspec tune --loads`)")
    ap.add_argument("--sweep-loads", type=int, default=1, help="engine loads per placement of each engine sweep, alternating; "
                    "a row's cycle is the mean of its loads' medians")
    ap.add_argument("--reuse", default="", help="earlier gpu_bench.json: take bandwidth, allreduce and distinct_experts from it")
    ap.add_argument("--skip", default="", help="comma list of sections to skip: correctness, bandwidth, allreduce, experts "
                    "(distinct_experts), moe_kernel, moe_fp8, moe_int4, layers")
    ap.add_argument("--placements", default="1,N", help="draft_tp values to sweep: 1 and/or N (the target's TP size)")
    ap.add_argument("--hang-dump-s", type=float, default=0, help="print every thread's stack if still running after this many s (0: never)")
    ap.add_argument("--dry-run", action="store_true", help="CPU, demo-sized synthetic engines: checks the script, measures nothing useful")
    a = ap.parse_args()
    for name, loads in (("--sweep-loads", a.sweep_loads), ("--tune-loads", a.tune_loads)):
        if not 1 <= loads <= a.cycles:
            ap.error(f"{name} {loads}: expected 1 to --cycles ({a.cycles}), each engine load timing at least one cycle")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    ngpu = torch.cuda.device_count() if not a.dry_run else 2
    skip = set(a.skip.split(","))
    from splitspec.measure.machine import git_commit

    RESULTS["machine"] = {"gpus": [torch.cuda.get_device_name(i) for i in range(ngpu)] if not a.dry_run else ["cpu"],
                          "torch": torch.__version__, "python": sys.version.split()[0], "git": git_commit(),
                          "argv": sys.argv[1:], "splitspec_env": {k: v for k, v in os.environ.items() if k.startswith("SPLITSPEC_")},
                          "inductor_env": {k: v for k, v in os.environ.items() if k.startswith("TORCHINDUCTOR_")}}
    if a.dry_run:
        os.environ["SPLITSPEC_PADDED"] = "1"
        skip |= {"correctness", "bandwidth", "allreduce", "experts"}
    save(out)
    if a.reuse:
        old = json.loads(Path(a.reuse).read_text())
        for name in ("bandwidth", "allreduce", "distinct_experts"):
            if name in old:
                RESULTS[name] = old[name] | {"reused_from": a.reuse}
                skip.add("experts" if name == "distinct_experts" else name)
        if "rows" in RESULTS.get("allreduce", {}):
            RESULTS["allreduce"]["rows"] = {int(n): v for n, v in RESULTS["allreduce"]["rows"].items()}
    tmp = Path(tempfile.mkdtemp(prefix="gpu-bench-"))
    if "correctness" not in skip:
        section("correctness", out)(correctness)()
    if "bandwidth" not in skip:
        section("bandwidth", out)(bandwidth)()
    if "allreduce" not in skip and ngpu > 1:
        section("allreduce", out)(allreduce)(ngpu)
    if "experts" not in skip:
        section("distinct_experts", out)(distinct_experts)()
    bw = RESULTS.get("bandwidth", {}).get("copy_GBps_read_plus_write", KimiScale.hbm_GBps)  # else the cost model's
    if "moe_kernel" not in skip and not a.dry_run:
        section("moe_kernel", out)(moe_kernel)(bw, [int(x) for x in a.moe_tp.split(",")])
    if "moe_fp8" not in skip and not a.dry_run:
        section("moe_fp8", out)(moe_fp8)(bw)
    if "moe_int4" not in skip and not a.dry_run:
        section("moe_int4", out)(moe_int4)(bw, [int(x) for x in a.moe_tp.split(",")])
    if "layers" not in skip and not a.dry_run:
        # the all-reduce of the group it was measured on (a reused one may come from a machine with more GPUs)
        ar = ({RESULTS["allreduce"].get("world", ngpu): RESULTS["allreduce"]["rows"][1]["graph_us"]}
              if "rows" in RESULTS.get("allreduce", {}) else {})
        section("layers", out)(layer_costs)([int(x) for x in a.layer_tp.split(",")], [int(x) for x in a.batches.split(",")],
                                            [int(x) for x in a.layer_k.split(",")], bw, ar,
                                            tuple(x.strip() == "1" for x in a.layer_skinny_gemm.split(",")))
    if a.hang_dump_s:
        import faulthandler

        faulthandler.dump_traceback_later(a.hang_dump_s, exit=True)
    for tp in [int(x) for x in a.tp.split(",") if int(x) <= ngpu]:
        placements = sorted({tp if x == "N" else int(x) for x in a.placements.split(",")})
        for m in [int(x) for x in a.moe_layers.split(",")]:
            section(f"engine_tp{tp}_moe{m}", out)(engine_sweep)(tmp, tp, m, [int(x) for x in a.batches.split(",")],
                                                               [int(x) for x in a.k.split(",")], a.cycles, a.dry_run, placements, a.sweep_loads)
            torch.cuda.empty_cache()
            key = f"engine_tp{tp}_moe{m}"
            if a.tune and (tp, m) == tuple(int(x) for x in a.tune.split(",")) and "rows" in RESULTS.get(key, {}):
                section("tune", out)(tune_vs_sweep)(tmp, tp, m, [int(x) for x in a.batches.split(",")],
                                                    [int(x) for x in a.k.split(",")], RESULTS[key]["rows"], a.cycles, a.tune_loads, a.dry_run)
                section("switch_cost", out)(switch_cost)(tmp, tp, m, max(int(x) for x in a.batches.split(",")), 3, a.cycles,
                                                         dry_run=a.dry_run)
    shutil.rmtree(tmp, ignore_errors=True)
    print("done", flush=True)
    os._exit(0)  # leftover NCCL/gloo threads must not hold the process open


if __name__ == "__main__":
    main()
