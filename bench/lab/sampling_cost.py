#!/usr/bin/env python3
"""What the leader's sampled decisions cost a steady cycle: :func:`splitspec.engine.acceptance.sampled_rows` over a
batch of B sampled sequences with k drafts each, on logits [B, k + 1, V] float32 (random, temperature 0.8, top-p
0.95 by default: the filter's sort over the vocabulary is most of it), then the copy of the decisions to the host.

Per (B, k) it prints the median µs of ``--reps`` calls, each from launch to the decisions read on the host (on a GPU:
synchronised, so the kernels' time plus the launches the host makes), and, on a GPU, the device time alone between
CUDA events. ``--json FILE`` writes the rows; ``--profile N`` then prints, per row, the N operators taking the most
device time (CPU time on a CPU) over five calls, from torch.profiler. Kimi's vocabulary is 163,840 tokens::

    PYTHONPATH=src python3 bench/lab/sampling_cost.py --device cuda --batches 1,4,16,64 --ks 1,3,5 --vocab 163840
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))
from splitspec.engine.acceptance import sampled_rows
from splitspec.engine.plan import SeqWork
from splitspec.files import write_json
from splitspec.runtime.sampling import draw_cycle
from splitspec.runtime.types import SamplingParams


def ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a comma list of integers") from None
    if not values or min(values) < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: expected integers ≥ 0")
    return values


def decisions(B: int, k: int, V: int, params: SamplingParams, device: str):
    """A call of one cycle's decisions for B sequences, k drafts, vocabulary V: random logits [B, k + 1, V] float32
    on ``device``, the drafts their argmax, a seeded draw per sequence; returns it (it returns the decisions as a
    list)."""
    g = torch.Generator().manual_seed(B * 100 + k)
    logits = (torch.randn(B, k + 1, V, generator=g) * 3).to(device)
    drafts = logits[:, :k].argmax(-1)
    work = [SeqWork(b, [], "decode", 0, [0], k=k, sampled=draw_cycle(params, k, g)) for b in range(B)]
    return lambda: sampled_rows(work, logits, drafts)[1].tolist()


def time_row(B: int, k: int, V: int, params: SamplingParams, device: str, reps: int) -> dict:
    """Median host-observed and device µs of one cycle's decisions for B sequences, k drafts, vocabulary V."""
    call = decisions(B, k, V, params, device)
    cuda = device.startswith("cuda")
    host, dev = [], []
    for i in range(reps + 3):  # three warm-up calls
        start, end = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) if cuda else (None, None)
        if cuda:
            torch.cuda.synchronize()
            start.record()
        t = time.perf_counter()
        call()
        if i >= 3:
            host.append((time.perf_counter() - t) * 1e6)
            if cuda:
                end.record()
                end.synchronize()
                dev.append(start.elapsed_time(end) * 1e3)
    return {"batch": B, "k": k, "vocab": V, "host_us": statistics.median(host),
            "device_us": statistics.median(dev) if dev else None}


def profile_row(B: int, k: int, V: int, params: SamplingParams, device: str, top: int) -> str:
    """torch.profiler's table of the ``top`` operators by device time (CPU time on a CPU) over five calls."""
    from torch.profiler import ProfilerActivity, profile

    call = decisions(B, k, V, params, device)
    cuda = device.startswith("cuda")
    call()  # warm-up
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        for _ in range(5):
            call()
    return prof.key_averages().table(sort_by="device_time_total" if cuda else "cpu_time_total", row_limit=top)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    ap.add_argument("--batches", type=ints, default=[1, 4, 16])
    ap.add_argument("--ks", type=ints, default=[1, 3, 5])
    ap.add_argument("--vocab", type=int, default=163840, help="vocabulary size V (Kimi: 163840)")
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--reps", type=int, default=20, help="timed calls per row")
    ap.add_argument("--json", type=Path, help="write the rows here")
    ap.add_argument("--profile", type=int, default=0, metavar="N", help="print each row's N costliest operators")
    a = ap.parse_args(argv)
    if a.vocab < 2 or a.reps < 1 or not min(a.batches) >= 1 or a.profile < 0:
        ap.error(f"--vocab {a.vocab}, --reps {a.reps}, --batches {a.batches}, --profile {a.profile}: expected V ≥ 2, "
                 "reps ≥ 1, batches ≥ 1, profile ≥ 0")
    if a.json is not None:  # before minutes of timing, not after
        try:
            tempfile.TemporaryFile(dir=a.json.parent).close()
        except OSError as e:
            ap.error(f"--json {a.json}: cannot write in {a.json.parent} ({e.strerror})")
    params = SamplingParams(a.temperature, a.top_p, a.top_k)
    try:
        params.check()
        if torch.device(a.device).type not in ("cpu", "cuda"):
            raise ValueError(f"--device {a.device}: expected cpu or cuda[:N]")
        torch.empty(0, device=a.device)
    except Exception as e:  # a bad filter value, or a device this machine lacks: one line
        ap.error(f"{e}")
    if params.greedy:
        ap.error("--temperature 0 is greedy: no sampled decisions to time")
    print(f"sampled decisions per cycle on {a.device}, V {a.vocab}, temperature {a.temperature}, top-p {a.top_p}, "
          f"top-k {a.top_k}; median of {a.reps}", flush=True)
    print(f"{'B':>4} {'k':>2} {'host µs':>9} {'device µs':>10}", flush=True)
    rows = []
    for B in a.batches:
        for k in a.ks:
            try:
                r = time_row(B, k, a.vocab, params, a.device, a.reps)
            except (torch.OutOfMemoryError, RuntimeError) as e:  # too large for this machine: one line, not a trace
                print(f"sampling_cost.py: batch {B}, k {k}, V {a.vocab}: {str(e).splitlines()[0]}", file=sys.stderr)
                return 1
            rows.append(r)
            dev = f"{r['device_us']:10.1f}" if r["device_us"] is not None else f"{'—':>10}"
            print(f"{B:>4} {k:>2} {r['host_us']:9.1f} {dev}", flush=True)
            if a.profile > 0:
                print(profile_row(B, k, a.vocab, params, a.device, a.profile), flush=True)
    if a.json:
        write_json({"device": a.device, "params": vars(params), "rows": rows}, a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
