#!/usr/bin/env python3
"""Per-kernel profile of the steady draft phase on one GPU: where a draft phase's time goes, kernel by kernel, against
the time reading the drafter's weights alone would take.

A synthetic Kimi-K2-width engine (:func:`splitspec.build.synthetic.write_synthetic_engines`: the published Kimi-K2
EAGLE-3 drafter's size, hidden 7168, 64 heads × 128, intermediate 18432, draft vocabulary 32000, random weights; the
target is one dense layer and is never run) is loaded in a :class:`splitspec.engine.rank.RankRunner`, once per drafter
dtype (``float``: bfloat16; ``fp8``: the drafter's linears quantised to block-scaled FP8 at load,
:func:`splitspec.models.drafters.quantize_drafter`). For each batch B and k it runs the engine's steady draft phase,
:meth:`RankRunner.draft_padded` (extend over k + 1 rows per sequence, then k − 1 single-token steps; one CUDA graph per
(batch bucket, k, window)), every sequence at position ``--position`` with full acceptance (k + 1 extend rows), and
reports per (B, k):

- ``wall_ms``: one draft phase as the engine calls it (host preparation, input copy, graph replay), synchronised,
  median; ``host_ms``: the host's part of it (until the call returns, the work queued); ``event_ms``: between CUDA
  events recorded around the call on the idle stream (the GPU's span, which includes waiting for the host's input
  copy); ``span_ms``: from the phase's first kernel's start to its last one's end (kernels and the gaps between them),
  ``gap_ms`` the gaps summed and ``gaps`` the longest (:func:`gpu_span`);
- ``gpu_ms``: the sum of the device time of every kernel (and memcpy/memset) of one phase under torch.profiler (CUDA
  activity), ``kernels``: their number per phase, ``top``: the 15 names with the most device time (ms and launches
  per phase, share of ``gpu_ms``);
- ``bound_ms``: the drafter weight-bytes bound, the bytes a phase must read once per forward — ``fc`` once (the extend),
  then k × (the layer's weights + ``lm_head``) — over the measured HBM bandwidth (a device-to-device copy,
  read + write bytes per second); ``kv_bytes`` (the K/V window each forward gathers) and ``bound_with_kv_ms`` beside it.

Also the bare drafter step (one single-token :meth:`Eagle3Drafter.draft` over B sequences, a CUDA graph of its own)
with its profile and bound (layer + lm_head bytes). JSON to ``--out``. On one H200 the defaults (B = 1, 4, 16;
k = 1…5; both dtypes) take about two minutes::

    export PYTHONPATH=$PWD/src; python3 bench/lab/draft_profile.py --out draft_profile.json

The batch-1 floor alone (issue 31's target), the compiled drafter as the engine runs it on a GPU::

    python3 bench/lab/draft_profile.py --out draft_profile_b1.json --batches 1 --drafter-dtype float --compile on --reps 50

``--pdl`` compiles the parts with programmatic dependent launch (``ServeConfig.pdl``).

``--small`` runs the same logic at the demo pair's widths (float32), on the CPU when there is no GPU (the profile is
then of CPU operators, self time): ``python3 bench/lab/draft_profile.py --small --out /tmp/p.json``.
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))  # for lab.gpu_kernels, as int4_moe_bench does
from lab.gpu_kernels import capture_graph  # noqa: E402
from splitspec.files import write_json  # noqa: E402
TOP = 15
GAPS = 5  # longest idle gaps between a phase's kernels reported
TARGET = 1.25  # issue 31: the draft phase at batch 1 within 1.25 × its weight-bytes bound


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def bandwidth(device: str, nbytes: int) -> float:
    """Bytes per ms a device-to-device copy of ``nbytes`` moves (read + write), best of 10."""
    x = torch.empty(nbytes, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    best = float("inf")
    for i in range(13):
        sync(device)
        t = time.perf_counter()
        y.copy_(x)
        sync(device)
        if i >= 3:
            best = min(best, time.perf_counter() - t)
    return 2 * nbytes / (best * 1e3)


def profile(fn, device: str, iters: int, eager=None) -> dict:
    """Run ``fn`` ``iters`` times under torch.profiler: device time (ms per call), kernel launches per call and the
    :data:`TOP` kernel names by device time. On the CPU: CPU operators by self time instead. Should the profiler see
    no kernel of a CUDA graph's replay, ``eager`` (the same work without the graph) is profiled instead, and
    ``profiled`` says so."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile as torch_profile

    cuda = device.startswith("cuda")
    fn()
    sync(device)
    with torch_profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(iters):
            fn()
        sync(device)
    rows = []
    for e in prof.key_averages():
        if cuda and e.device_type != DeviceType.CUDA:
            continue  # runtime API calls on the host
        us = (getattr(e, "self_device_time_total", 0) or getattr(e, "self_cuda_time_total", 0)) if cuda else e.self_cpu_time_total
        if us > 0:
            rows.append((e.key, us / 1e3 / iters, e.count / iters))
    if cuda and not rows and eager is not None:
        return profile(eager, device, iters) | {"profiled": "eager (no kernel of the graph replay was traced)"}
    total = sum(ms for _, ms, _ in rows)
    rows.sort(key=lambda r: -r[1])
    return {"profiled": "CUDA graph replay" if cuda and eager is not None else "as called", "gpu_ms": total, "kernels": sum(n for _, _, n in rows), "distinct_kernels": len(rows),
            "top": [{"name": name, "ms": ms, "count": n, "share": ms / total if total else 0.0} for name, ms, n in rows[:TOP]],
            "activity": "cuda" if cuda else "cpu (operators, self time)"}


def gpu_span(fn, device: str, trace: Path | None = None) -> dict:
    """One call of ``fn`` on the device's timeline (torch.profiler's CUDA activity): ``span_ms``, from the first
    kernel's start to the last one's end (the kernels' time plus the gaps between them, without the host's part before
    the first); ``gap_ms``, the idle time between consecutive kernels summed; ``gaps``, the :data:`GAPS` longest, each
    with its µs and the kernels before and after it (where a phase's fixed cost sits). Empty on the CPU or when the
    profiler sees no kernel. Under PDL a kernel starts before its predecessor ends: overlaps count as no gap.
    ``trace``: also the host's side (CPU activity) of that call, as a Chrome trace file there (when the host launched
    what the GPU waited for); on the CPU that file holds the host's side alone. Tracing the host slows it, so a
    traced call's gaps are wider than an untraced one's: compare traced runs with traced runs."""
    cuda = device.startswith("cuda")
    if not cuda and trace is None:
        return {}
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile as torch_profile

    fn()
    sync(device)
    with torch_profile(activities=[ProfilerActivity.CUDA] * cuda + [ProfilerActivity.CPU] * (trace is not None)) as prof:
        fn()
        sync(device)
    if trace is not None:
        prof.export_chrome_trace(str(trace))
    kernels = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events() if e.device_type == DeviceType.CUDA)
    if not kernels:
        return {}
    gaps, end, last = [], kernels[0][1], kernels[0][2]
    for start, stop, name in kernels[1:]:
        if start > end:
            gaps.append({"us": start - end, "after": last[:80], "before": name[:80]})
        if stop >= end:
            end, last = stop, name
    return {"span_ms": (max(k[1] for k in kernels) - kernels[0][0]) / 1e3, "gap_ms": sum(g["us"] for g in gaps) / 1e3,
            "gaps": sorted(gaps, key=lambda g: -g["us"])[:GAPS]}


def timed(fn, device: str, reps: int) -> tuple[float, float | None, float]:
    """(median wall ms of one synchronised call, median ms between CUDA events around it — None on the CPU, median ms
    the host spends in the call before it returns, i.e. queueing the work without waiting for it)."""
    walls, events, hosts = [], [], []
    for _ in range(reps):
        sync(device)
        t = time.perf_counter()
        if device.startswith("cuda"):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            hosts.append((time.perf_counter() - t) * 1e3)
            b.record()
            b.synchronize()
            events.append(a.elapsed_time(b))
        else:
            fn()
            hosts.append((time.perf_counter() - t) * 1e3)
        walls.append((time.perf_counter() - t) * 1e3)
    return statistics.median(walls), statistics.median(events) if events else None, statistics.median(hosts)


def graphed(fn, device: str):
    """``fn`` (no arguments, static tensors) captured once as a CUDA graph and returned as its replay; on the CPU ``fn``."""
    if not device.startswith("cuda"):
        return fn
    return capture_graph(fn).replay


def weight_bytes(w: dict[str, torch.Tensor]) -> dict[str, int]:
    """Bytes of the drafter's weights read per forward, by part: ``fc`` (with its scales; the extend only), the layer
    (attention, MLP, norms; FP8 scales included) and ``lm_head``; ``embed_tokens`` (rows gathered, not counted)."""
    parts = {"fc": 0, "layer": 0, "lm_head": 0, "embed_tokens": 0}
    for name, t in w.items():
        base = name.removesuffix(".scale_inv")
        if base in ("draft_to_target", "fp8.weight_block_size"):
            continue
        parts[base if base in parts else "layer"] += t.nbytes
    return parts


def write_engines(out: Path, dtype: str, small: bool, max_batch: int) -> Path:
    """Synthetic engines (one target layer) whose drafter is ``dtype`` ("float" or "fp8": its linears quantised at load)."""
    from splitspec.build.synthetic import write_synthetic_engines
    from splitspec.files import read_json, write_json
    from splitspec.models.drafters import FP8_BLOCK, FP8_WEIGHTS

    eng = write_synthetic_engines(out, num_layers=1, tp_size=1, max_batch_size=max_batch, max_seq_len=1024, max_draft_len=8,
                                  tiny=small)
    if dtype == "fp8":
        meta = read_json(eng / "drafter" / "engine.json")
        meta["quantization"] = {"weights": FP8_WEIGHTS, "weight_block_size": list(FP8_BLOCK)}
        write_json(meta, eng / "drafter" / "engine.json")
    return eng


def steady_plan(B: int, k: int, position: int, per_seq_blocks: int):
    """A steady decode cycle: B sequences at ``position``, each extending over k + 1 accepted rows, drafting k."""
    from splitspec.engine.plan import CyclePlan, SeqWork

    work = [SeqWork(sid=b, blocks=list(range(b * per_seq_blocks, (b + 1) * per_seq_blocks)), kind="decode", start=position,
                    tokens=[1 + b], k=k, extend_start=position - k - 1, extend_tokens=[1 + b] * (k + 1), keep_aux=k + 1)
            for b in range(B)]
    return CyclePlan(work, padded_k=k)


def measure_drafter(eng: Path, device: str, batches: list[int], ks: list[int], position: int, bw: float, reps: int,
                    iters: int, compiled: bool, pdl: bool = False, trace: Path | None = None) -> dict:
    """Every (B, k) draft phase and each B's bare step (module docstring); ``trace``: a folder (existing) for one
    Chrome trace per phase (host and device, :func:`gpu_span`), ``trace_B{B}_k{k}[_pdl].json``."""
    from splitspec.models.batch import bucket
    from splitspec.engine.rank import RankRunner
    from splitspec.models.batch import padded
    from splitspec.models.kv import BLOCK_SIZE
    from splitspec.models.layers import TPComm

    rank = RankRunner(eng, 0, 1, TPComm(), device, placements=(1,), compile=compiled, pdl=pdl)
    m, cache = rank.drafter, rank.dcache
    parts = weight_bytes(m.w)
    cfg = m.cfg
    per_seq = rank.limits["max_seq_len"] // BLOCK_SIZE
    rows, steps = [], []
    for B in batches:
        for k in ks:
            plan = steady_plan(B, k, position, per_seq)
            # the last verify's aux states kept as one tensor, as a steady loop hands them over
            Bp = bucket(B)
            rank.aux.keep_batch([w.sid for w in plan.work], torch.randn(Bp * (k + 1), 3 * cfg.target_hidden_size,
                                                                        dtype=m.dtype, device=device), k + 1)
            phase = lambda: rank.draft_padded(plan)  # noqa: E731
            phase()
            phase()  # captured, then replayed
            wall, event, host = timed(phase, device, reps)
            prof = profile(phase, device, iters, eager=lambda: eager_phase(rank, plan))
            S = rank.window_for(plan)
            kv = B * S * cfg.num_key_value_heads * cfg.head_dim * 2 * m.dtype.itemsize
            read = parts["fc"] + k * (parts["layer"] + parts["lm_head"])
            timeline = gpu_span(phase, device, trace and trace / f"trace_B{B}_k{k}{'_pdl' if pdl else ''}.json")
            rows.append({"batch": B, "k": k, "window": S, "wall_ms": wall, "event_ms": event, "host_ms": host,
                         "span_ms": timeline.get("span_ms"), "gap_ms": timeline.get("gap_ms"), "gaps": timeline.get("gaps", []), **prof,
                         "weight_bytes": read, "bound_ms": read / bw, "kv_bytes": k * kv,
                         "bound_with_kv_ms": (read + k * kv) / bw, "gpu_over_bound": prof["gpu_ms"] / (read / bw),
                         "wall_over_bound": wall / (read / bw), "target_ms": TARGET * read / bw})
            print(f"B={B:<3} k={k}  wall {wall:7.3f} ms  event {_ms(event)}  host {host:6.3f} ms  span {_ms(rows[-1]['span_ms'])}  gpu {prof['gpu_ms']:7.3f} ms in "
                  f"{prof['kernels']:.0f} kernels  bound {read / bw:6.3f} ms (+KV {(read + k * kv) / bw:6.3f})", flush=True)
            for t in prof["top"]:
                print(f"      {t['ms']:8.4f} ms {t['count']:5.1f}×  {t['share']:5.1%}  {t['name'][:100]}", flush=True)
            if timeline:
                print(f"      idle between kernels {timeline['gap_ms']:.3f} ms; longest:", flush=True)
            for g in timeline.get("gaps", []):
                print(f"      {g['us']:8.1f} µs  after {g['after'][:50]}  before {g['before'][:50]}", flush=True)
        window = min(rank.window, max(256, 1 << position.bit_length()))  # as RankRunner.window_for
        batch = padded([(list(range(b * per_seq, (b + 1) * per_seq)), position, [1]) for b in range(B)], window, device,
                       scratch_row=rank.scratch_row)
        hidden = torch.randn(B, cfg.hidden_size, dtype=m.dtype, device=device)
        bare = lambda: m.draft(batch, hidden, cache)[0]  # noqa: E731
        step = graphed(bare, device)
        wall, event, host = timed(step, device, reps)
        prof = profile(step, device, iters, eager=bare)
        read = parts["layer"] + parts["lm_head"]
        steps.append({"batch": B, "wall_ms": wall, "event_ms": event, "host_ms": host, **prof, "weight_bytes": read, "bound_ms": read / bw,
                      "gpu_over_bound": prof["gpu_ms"] / (read / bw)})
        print(f"B={B:<3} bare step  wall {wall:7.3f} ms  event {_ms(event)}  gpu {prof['gpu_ms']:7.3f} ms in {prof['kernels']:.0f} kernels  "
              f"bound {read / bw:6.3f} ms", flush=True)
    return {"weight_bytes_by_part": parts, "config": cfg.to_dict(), "rows": rows, "steps": steps}


def eager_phase(rank, plan) -> None:
    """The draft phase with the rank's CUDA graphs off (the kernels a graph replays, launched one by one)."""
    on, rank.draft_graphs.on = rank.draft_graphs.on, False
    try:
        rank.draft_padded(plan)
    finally:
        rank.draft_graphs.on = on


def _ms(v: float | None) -> str:
    return "     —   " if v is None else f"{v:7.3f} ms"


def levels(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a comma list of positive integers") from None
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a comma list of positive integers")
    return out


def dtypes(text: str) -> list[str]:
    out = [x.strip() for x in text.split(",") if x.strip()]
    if not out or any(x not in ("float", "fp8") for x in out):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a comma list of float, fp8")
    return out


def summary(result: dict) -> None:
    """Per drafter: one line per (B, k) — wall, host part, GPU time and kernels of the phase against its weight-bytes
    bound and issue 31's target (1.25 × bound); then the GPU time of every drafter dtype side by side."""
    names = list(result["drafters"])
    for n in names:
        print(f"\nsteady draft phase, {n}: ms (wall: synchronised call; host: until the call returns; gpu: kernels)")
        print(f"{'B':>3} {'k':>2} {'wall':>7} {'host':>6} {'gpu':>7} {'kernels':>7} {'bound':>7} {'target':>7} {'wall/bd':>7} "
              f"{'gpu/bd':>6}  wall<=target")
        for x in result["drafters"][n]["rows"]:
            print(f"{x['batch']:>3} {x['k']:>2} {x['wall_ms']:7.3f} {x['host_ms']:6.3f} {x['gpu_ms']:7.3f} {x['kernels']:7.0f} "
                  f"{x['bound_ms']:7.3f} {x['target_ms']:7.3f} {x['wall_over_bound']:7.2f} {x['gpu_over_bound']:6.2f}  "
                  f"{'yes' if x['wall_ms'] <= x['target_ms'] else 'no'}")
    print("\nsteady draft phase, GPU ms (profiler) / weight-bytes bound ms:")
    print(f"{'B':>3} {'k':>2}" + "".join(f"{n + ' gpu':>12}{'bound':>8}{'×':>6}" for n in names))
    base = result["drafters"][names[0]]["rows"]
    for i, r in enumerate(base):
        line = f"{r['batch']:>3} {r['k']:>2}"
        for n in names:
            x = result["drafters"][n]["rows"][i]
            line += f"{x['gpu_ms']:12.3f}{x['bound_ms']:8.3f}{x['gpu_over_bound']:6.1f}"
        print(line)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--batches", type=levels, default=[1, 4, 16])
    ap.add_argument("--ks", type=levels, default=[1, 2, 3, 4, 5], help="draft lengths (at most 8)")
    ap.add_argument("--drafter-dtype", type=dtypes, default=["float", "fp8"],
                    help="comma list of float (the engine's bfloat16; float32 with --small) and fp8 (linears block-scaled FP8)")
    ap.add_argument("--compile", default="off", choices=("off", "on", "both"),
                    help="torch.compile the drafter's parts (as the engine does on a GPU): off (the eager kernels), on, or both")
    ap.add_argument("--pdl", action="store_true", help="programmatic dependent launch for the compiled parts (ServeConfig.pdl)")
    ap.add_argument("--trace", type=Path, default=None,
                    help="folder: one Chrome trace (host and GPU) per drafter and draft phase, DIR/<drafter>/trace_B*_k*.json")
    ap.add_argument("--position", type=int, default=100, help="every sequence's position (tokens known)")
    ap.add_argument("--reps", type=int, default=20, help="timed calls per configuration")
    ap.add_argument("--iters", type=int, default=5, help="profiled calls per configuration")
    ap.add_argument("--small", action="store_true", help="the demo pair's widths, float32 (on the CPU without a GPU)")
    ap.add_argument("--device", default=None, help="cuda:N or cpu (default: cuda:0, else cpu with --small)")
    a = ap.parse_args(argv)
    device = a.device or ("cuda:0" if torch.cuda.is_available() else "cpu")
    if not re.fullmatch(r"cpu|cuda(:\d+)?", device):
        ap.error(f"--device {device}: expected cpu or cuda[:N]")
    if device.startswith("cuda") and not torch.cuda.is_available():
        ap.error(f"--device {device}: no CUDA GPU here (--device cpu --small checks the logic on the CPU)")
    if not device.startswith("cuda") and not a.small:
        ap.error("no GPU here: pass --small to check the logic on the CPU")
    if a.compile != "off" and not device.startswith("cuda"):
        ap.error("--compile: the engine compiles the drafter on GPUs only")
    if max(a.ks) > 8 or max(a.batches) > 16 or not 9 <= a.position <= 1024 - 9:
        ap.error("--ks at most 8, --batches at most 16, --position in 9..1015 (the engines' limits)")
    if a.reps < 1 or a.iters < 1:
        ap.error("--reps and --iters: at least 1")
    out_dir = Path(a.out).resolve().parent
    if not out_dir.is_dir() or not os.access(out_dir, os.W_OK) or Path(a.out).is_dir():
        ap.error(f"--out {a.out}: expected a file path in a writable folder")
    if a.pdl and a.compile == "off":
        ap.error("--pdl: applies to the compiled parts only; pass --compile on or both")
    if a.trace:
        try:
            a.trace.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            ap.error(f"--trace {a.trace}: cannot make that folder ({e.strerror})")
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    t0 = time.time()
    bw = bandwidth(device, (64 if a.small else 2048) * 2 ** 20)
    print(f"device copy: {bw / 1e6:.0f} GB/s (read + write)", flush=True)
    try:
        commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = None
    try:
        import triton
    except ImportError:
        triton = None
    result = {"meta": {"device": torch.cuda.get_device_name(device) if device.startswith("cuda") else platform.processor() or "cpu",
                       "torch": torch.__version__, "triton": triton and triton.__version__, "python": platform.python_version(),
                       "commit": commit, "argv": sys.argv[1:] if argv is None else argv, "small": a.small,
                       "synthetic": "random weights at Kimi-K2 drafter width; outputs meaningless" if not a.small else "demo widths",
                       "copy_GBps_read_plus_write": bw / 1e6},
              "drafters": {}}
    with tempfile.TemporaryDirectory(prefix="draft-profile-") as tmp:
        for dtype in a.drafter_dtype:
            eng = write_engines(Path(tmp) / dtype, dtype, a.small, max(a.batches))
            for compiled in {"off": (False,), "on": (True,), "both": (False, True)}[a.compile]:
                name = dtype + (" compiled" if compiled else "")
                print(f"== drafter {name}", flush=True)
                trace = a.trace and a.trace / name.replace(" ", "-")  # one folder per drafter: the same phases' names
                if trace:
                    trace.mkdir(exist_ok=True)
                result["drafters"][name] = measure_drafter(eng, device, a.batches, a.ks, a.position, bw, a.reps, a.iters,
                                                           compiled, a.pdl and compiled, trace)
                write_json(result, a.out)
                gc.collect()  # the rank and its graphs
                if device.startswith("cuda"):
                    torch.cuda.empty_cache()
    summary(result)
    result["meta"]["seconds"] = time.time() - t0
    write_json(result, a.out)
    print(f"wrote {a.out} in {result['meta']['seconds']:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
