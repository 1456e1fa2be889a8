"""The target's layers with MLA attention through the gathered window and through the latent paged kernel
(``TargetModel.paged_kernel``, :func:`splitspec.models.paged_attention.attend_latent`), one Kimi-K2-width rank on one
GPU: TP-N shard shapes, random bf16 weights, compiled layer halves replayed from a CUDA graph (collectives excluded).

Per (TP size, batch B, k, key window S): the dense and the MoE layer's µs with the kernel off and on, and each
layer's bytes bound: its weights plus the latent cache rows its sequences' queries see (B · (position + 1) · (latent
+ rope) · 2 bytes), over the measured copy bandwidth. The sequences sit at 3/4 of the window (position 3S/4 + k), as
a decode deep into a window of that size does. Also checks, once per TP size, that a token's layer output is the same
bits decoded alone as verified among k others (B 1) with the kernel on.

    python3 bench/lab/paged_mla_bench.py --out results/paged_mla --tp 8,1 --batches 1,16 --ks 0,3 --windows 256,4096
    python3 bench/lab/paged_mla_bench.py --dry-run        # CPU, Triton's interpreter, tiny shapes: checks the script
    python3 bench/lab/paged_mla_bench.py --replot results/paged_mla/paged_mla_bench.json   # the plot again

Writes OUT/paged_mla_bench.json and OUT/paged_mla_bench.png (µs per layer against the key window, both paths, one
panel per TP size and batch; without matplotlib no plot, and ``--replot`` draws it later).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
ap.add_argument("--out", default="results/paged_mla", help="folder for paged_mla_bench.json")
ap.add_argument("--tp", default="8,1", help="comma list: TP sizes whose rank-0 shard shapes run")
ap.add_argument("--batches", default="1,16", help="comma list of batch sizes")
ap.add_argument("--ks", default="0,3", help="comma list of draft lengths (k + 1 tokens per sequence)")
ap.add_argument("--windows", default="256,4096", help="comma list of key windows S")
ap.add_argument("--budget-s", type=float, default=400, help="start no new row after this many seconds")
ap.add_argument("--sweep", action="store_true", help="time the kernel alone over its configurations first "
                "(LATENT_CONFIG, LATENT_SPLIT_KEYS) at Kimi's TP8 / TP1 shapes")
ap.add_argument("--no-layers", action="store_true", help="skip the layer timings")
ap.add_argument("--dry-run", action="store_true", help="CPU, Triton's interpreter, tiny shapes: checks the script")
ap.add_argument("--replot", metavar="JSON", help="draw the plot of a written paged_mla_bench.json beside it; nothing else")
A = ap.parse_args()
if A.dry_run:
    os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # bench/, for lab.gpu_kernels

import torch  # noqa: E402

from splitspec.build.synthetic import kimi_k2_target  # noqa: E402
from splitspec.config import Mapping  # noqa: E402
from splitspec.measure.machine import git_commit  # noqa: E402
from splitspec.models.batch import padded  # noqa: E402
from splitspec.models.layers import TPComm  # noqa: E402
from splitspec.models.shapes import random_weights, target_shapes  # noqa: E402
from splitspec.models.target import TargetKVCache, TargetModel  # noqa: E402

DEVICE = "cpu" if A.dry_run else "cuda"
BLOCK = 16  # cache rows per block of the tables built here


def config():
    cfg = kimi_k2_target(2)
    if A.dry_run:
        cfg = dataclasses.replace(cfg, vocab_size=64, hidden_size=96, intermediate_size=80, moe_intermediate_size=24,
                                  num_attention_heads=8, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
                                  topk_group=1, q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16,
                                  qk_rope_head_dim=16, v_head_dim=16, rope=dataclasses.replace(cfg.rope, dim=16))
    return cfg


def timed(fn) -> float:
    """ms per call: CUDA-graph replays on a GPU, one eager call on the CPU (dry run)."""
    if A.dry_run:
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    from lab.gpu_kernels import timed_graph

    return timed_graph(fn)


def main() -> None:
    t0 = time.perf_counter()
    tps, batches, ks, windows = ([int(v) for v in s.split(",")] for s in (A.tp, A.batches, A.ks, A.windows))
    if A.dry_run:
        windows, batches = sorted({min(S, 64) for S in windows}), sorted({min(B, 2) for B in batches})
    bw = 0.0
    if not A.dry_run:
        from lab.gpu_kernels import bandwidth

        bw = bandwidth()["copy_GBps_read_plus_write"]
    res = {"git": git_commit(), "device": torch.cuda.get_device_name() if not A.dry_run else "cpu (dry run)",
           "bandwidth_GBps": bw, "rows": [], "invariant": {}}
    cfg = config()
    if A.sweep:
        res["sweep"] = sweep(cfg)
    if A.no_layers:
        tps = []
    row_bytes = (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 2
    dtype = torch.float32 if A.dry_run else torch.bfloat16
    H = cfg.hidden_size
    for tp in tps:
        torch._dynamo.reset()
        mapping = Mapping(tp)
        w = random_weights(target_shapes(cfg, mapping), dtype, DEVICE, seed=0)
        model = TargetModel(cfg, mapping, 0, w, TPComm())
        if not A.dry_run:
            model.compile()
        cache = TargetKVCache(cfg, max(batches) * max(windows) + BLOCK, dtype, DEVICE)
        cache.kv.copy_(torch.randn(cache.kv.shape, device=DEVICE).to(dtype))
        nb = lambda names: sum(w[n].nbytes for n in names)  # noqa: E731
        weights = {0: nb([n for n in w if n.startswith("layers.0.")]),
                   1: nb([n for n in w if n.startswith("layers.1.") and "experts." not in n])
                   + cfg.num_experts_per_tok * (w["layers.1.mlp.experts.w13"][0].nbytes + w["layers.1.mlp.experts.w2"][0].nbytes)}
        for B in batches:
            for k in ks:
                for S in windows:
                    if time.perf_counter() - t0 > A.budget_s:
                        print(f"budget: row TP{tp} B{B} k{k} S{S} and later not run", flush=True)
                        continue
                    n, start = k + 1, 3 * S // 4
                    batch = padded([(list(range(b * S // BLOCK, (b + 1) * S // BLOCK)), start, [1] * n) for b in range(B)],
                                   S, DEVICE, BLOCK, scratch_row=max(batches) * max(windows), pad_to=B)
                    cos, sin = model.rotary.cos_sin(batch.positions)
                    h = torch.randn(B * n, H, device=DEVICE).to(dtype)
                    pend = torch.randn_like(h)
                    kv_bytes = B * (start + n) * row_bytes
                    for layer, name in ((0, "dense"), (1, "moe")):
                        us = {}
                        for on in (False, True):
                            model.paged_kernel = on
                            us[on] = 1e3 * timed(lambda: model.block(layer, h, pend if layer else None, batch, cache, cos, sin))
                        bound = (weights[layer] + kv_bytes) / (bw * 1e3) if bw else None  # µs
                        row = {"tp": tp, "B": B, "k": k, "S": S, "layer": name, "gathered_us": round(us[False], 1),
                               "paged_us": round(us[True], 1), "bound_us": bound and round(bound, 1),
                               "kv_MB": round(kv_bytes / 1e6, 2), "weights_MB": round(weights[layer] / 1e6, 1)}
                        res["rows"].append(row)
                        ratio = f"  {us[False] / bound:.2f}× → {us[True] / bound:.2f}× bound" if bound else ""
                        print(f"TP{tp} B{B:>2} k{k} S{S:>5} {name:5}: gathered {us[False]:8.1f} µs  paged "
                              f"{us[True]:8.1f} µs{ratio}", flush=True)
        # on the CPU (dry run) the products' own sums follow the row count, so only a GPU's answer means anything
        res["invariant"][tp] = None if A.dry_run else invariant(model, cache, cfg, dtype, max(windows), max(ks))
        print(f"TP{tp}: a token's attention half alone == among {max(ks) + 1} tokens (paged kernel on): "
              f"{res['invariant'][tp]}", flush=True)
    out = Path(A.out)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / "paged_mla_bench.json.tmp"
    tmp.write_text(json.dumps(res, indent=1))
    tmp.replace(out / "paged_mla_bench.json")
    try:
        plot(res, out / "paged_mla_bench.png")
    except OSError as e:  # the JSON is written: --replot draws the plot later
        print(f"no plot: {out / 'paged_mla_bench.png'} could not be written ({e.strerror or e})")
    print(f"wrote {out / 'paged_mla_bench.json'} in {time.perf_counter() - t0:.0f} s")


PLOT_KEYS = {"tp": int, "B": int, "k": int, "S": int, "layer": str, "gathered_us": float, "paged_us": float}


def plot_problem(res) -> str | None:
    """Why :func:`plot` cannot draw ``res`` (a paged_mla_bench.json read back), or None: a dict whose "rows" is a list
    of objects with :data:`PLOT_KEYS` (tp, B, S > 0 and k ≥ 0 integers, a layer name, µs > 0 on a log scale)."""
    rows = res.get("rows") if isinstance(res, dict) else None
    if not isinstance(rows, list):
        return "expected a paged_mla_bench.json with 'rows' (a list of row objects)"
    for i, r in enumerate(rows):
        if not isinstance(r, dict):
            return f"row {i}: {type(r).__name__}, expected an object"
        for key, kind in PLOT_KEYS.items():
            v = r.get(key)
            if kind is str:
                ok = isinstance(v, str)
            elif kind is int:
                ok = isinstance(v, int) and not isinstance(v, bool) and v >= (0 if key == "k" else 1)
            else:
                ok = isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < float("inf")
            if not ok:
                want = {str: "a name", int: "an integer ≥ 0" if key == "k" else "an integer ≥ 1"}.get(kind, "µs > 0")
                got = "missing" if key not in r else f"= {json.dumps(v)[:40]}"
                return f"row {i}: {key} {got}, expected {want}"
    return None


def plot(res: dict, path: Path) -> Path | None:
    """µs per layer against the key window S (log scale), gathered (dashed) and paged (solid) per layer and k, one panel
    per (TP size, batch) of ``res["rows"]``. Returns None (and says why) without rows or matplotlib."""
    panels = sorted({(r["tp"], r["B"]) for r in res["rows"]}, key=lambda p: (-p[0], p[1]))
    if not panels:
        return None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        print(f"no matplotlib here: no plot (--replot {path.with_suffix('.json')} draws it)")
        return None
    from splitspec.files import write_png

    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.8), squeeze=False)
    for ax, (tp, B) in zip(axes[0], panels):
        rows = [r for r in res["rows"] if (r["tp"], r["B"]) == (tp, B)]
        for i, (layer, k) in enumerate(sorted({(r["layer"], r["k"]) for r in rows})):
            pts = sorted((r["S"], r["gathered_us"], r["paged_us"]) for r in rows if (r["layer"], r["k"]) == (layer, k))
            S = [p[0] for p in pts]
            ax.plot(S, [p[2] for p in pts], "o-", color=f"C{i}", label=f"{layer}, k {k}: paged")
            ax.plot(S, [p[1] for p in pts], "x--", color=f"C{i}", label=f"{layer}, k {k}: gathered")
        ax.set(xscale="log", yscale="log", xlabel="key window S", ylabel="µs per layer", title=f"TP{tp} shard, batch {B}")
        windows = sorted({r["S"] for r in rows})
        ax.set_xticks(windows, [str(S) for S in windows])
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.grid(alpha=0.3, which="both")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"MLA attention: gathered window vs latent paged kernel ({res.get('device', '?')})", fontsize=9)
    fig.tight_layout()
    return write_png(fig, path)


def sweep(cfg) -> list[dict]:
    """µs of :func:`attend_latent` alone (CUDA graph) per (BLOCK_N, warps, stages, share keys) at TP8 (8 heads) and TP1
    (64 heads) shapes; prints each shape's best and the sum over shapes per configuration."""
    import itertools
    from unittest.mock import patch

    from splitspec.models import paged_attention as pa

    width, latent = cfg.kv_lora_rank + cfg.qk_rope_head_dim, cfg.kv_lora_rank
    shapes = [(8, 1, 1, 256), (8, 1, 4, 256), (8, 1, 1, 4096), (8, 16, 1, 4096), (8, 16, 4, 4096), (64, 1, 1, 256),
              (64, 1, 4, 1024)]
    configs = list(itertools.product((32, 64), (4, 8), (2,), (64, 128, 256)))
    if A.dry_run:
        shapes, configs = [(8, 1, 2, 64)], [(*pa.LATENT_CONFIG, pa.LATENT_SPLIT_KEYS), (64, 4, 2, 16)]
    rows = []
    for heads, B, n, S in shapes:
        cache = torch.randn(B * S + 16, width, device=DEVICE).to(torch.bfloat16 if not A.dry_run else torch.float32)
        table = torch.arange(B * S, device=DEVICE).view(B, S)
        pos = (3 * S // 4 + torch.arange(n, device=DEVICE)).expand(B, n).contiguous()
        q = torch.randn(B, n, heads, width, device=DEVICE).to(cache.dtype)
        for bn, warps, stages, share in configs:
            with patch.multiple(pa, LATENT_CONFIG=(bn, warps, stages), LATENT_SPLIT_KEYS=share):
                try:
                    us = 1e3 * timed(lambda: pa.attend_latent(q, cache, table, pos, 0.07, latent))
                except Exception as e:  # out of shared memory or registers: not a candidate
                    us = None
                    print(f"  {heads}h B{B} n{n} S{S} {(bn, warps, stages, share)}: {type(e).__name__}: {e}", flush=True)
            rows.append({"heads": heads, "B": B, "n": n, "S": S, "config": [bn, warps, stages, share], "us": us})
        ok = [r for r in rows if r["us"] is not None and (r["heads"], r["B"], r["n"], r["S"]) == (heads, B, n, S)]
        best = min(ok, key=lambda r: r["us"])
        now = next((r["us"] for r in ok if r["config"] == [*pa.LATENT_CONFIG, pa.LATENT_SPLIT_KEYS]), float("nan"))
        print(f"sweep {heads}h B{B:>2} n{n} S{S:>5}: shipped {now:.1f} µs, best {best['us']:.1f} µs at {best['config']}", flush=True)
    total = {}
    for r in rows:
        if r["us"] is not None:
            total.setdefault(tuple(r["config"]), []).append(r["us"])
    full = {c: sum(v) for c, v in total.items() if len(v) == len(shapes)}
    for c in sorted(full, key=full.get)[:5]:
        print(f"sweep sum over shapes {full[c]:.1f} µs at {list(c)}", flush=True)
    return rows


def invariant(model, cache, cfg, dtype, S: int, k: int) -> bool:
    """The attention half's output (before its all-reduce) for the last of k + 1 tokens of one sequence equals (bits)
    that of the token alone, the earlier k tokens' cache rows written by the verify first: the whole half, its
    products included, as the engine runs it with the kernel on."""
    model.paged_kernel = True
    attention = model.fast[0] if model.fast else TargetModel.attention_half
    n, start = k + 1, 3 * S // 4
    blocks = list(range(S // BLOCK))
    h = torch.randn(n, cfg.hidden_size, device=DEVICE).to(dtype)
    verify = padded([(blocks, start, [1] * n)], S, DEVICE, BLOCK, scratch_row=cache.kv.shape[0] - 1, pad_to=1)
    alone = padded([(blocks, start + k, [1])], S, DEVICE, BLOCK, scratch_row=cache.kv.shape[0] - 1, pad_to=1)
    _, many = attention(model, model.layer_w[0], h, None, verify, cache.kv[0], *model.rotary.cos_sin(verify.positions))
    _, one = attention(model, model.layer_w[0], h[k:], None, alone, cache.kv[0], *model.rotary.cos_sin(alone.positions))
    return bool(torch.equal(many[-1], one[0]))


if __name__ == "__main__":
    if A.replot:
        src = Path(A.replot)
        if src.suffix == ".png":
            sys.exit(f"--replot {src}: expected the .json (the plot is written beside it, as .png)")
        try:
            written = json.loads(src.read_text())
        except (OSError, ValueError) as e:
            sys.exit(f"--replot {src}: expected a paged_mla_bench.json with 'rows' ({type(e).__name__}: {e})")
        problem = plot_problem(written)
        if problem:
            sys.exit(f"--replot {src}: {problem}")
        if not written["rows"]:
            print(f"--replot {src}: no layer rows to plot")
            sys.exit(0)
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            sys.exit(f"--replot {src}: no matplotlib here to draw it with")
        try:
            print(f"wrote {plot(written, src.with_suffix('.png'))}")
        except OSError as e:
            sys.exit(f"--replot {src}: {src.with_suffix('.png')} could not be written ({e.strerror or e})")
    else:
        main()
