#!/usr/bin/env python3
"""FP8 executed in FP8, on one GPU in one call (a few minutes): every variant of the FP8 kernels timed against bf16 and
against the FP8 bytes' bound at Kimi-K2 shapes, printed as tables with the lines to paste into the engine's config
tables, and written to ``<out>/fp8_bench.json``.

- ``moe``: the fused MoE decode kernels on FP8 routed experts (bench/lab/fp8_kernels.py, :func:`moe`): every FP8 mode
  × block configuration, then bf16 / FP8 shipped defaults / FP8 chosen at 1, 4 and 16 tokens, per TP shape. Paste
  its ``FP8_*`` lines into src/splitspec/models/fused_moe.py.
- ``linear``: the attention and dense-MLP linears at TP1 and the TP8 shard, 1, 4, 16 and 256 tokens: bf16,
  dequantise-per-call, the engine's path, ``torch._scaled_mm`` W8A8, every Triton configuration. Paste its
  ``LINEAR_CONFIGS`` line into src/splitspec/models/fp8_linear.py (and move ``SCALED_MM_MIN_TOKENS`` where the
  table shows cuBLAS ahead).

    export PYTHONPATH=$PWD/src; python3 bench/fp8_bench.py --out results/fp8

``--dry-run`` runs both sections on CPU through Triton's interpreter at toy shapes (checks the script, measures
nothing). A section past ``--budget-s`` skips its remaining configurations and says so.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

TINY = {"hidden": 128, "experts": 3, "top_k": 1, "moe_i": 128, "q_lora": 128, "kv_a": 64, "heads": 1, "qk_head": 64,
        "v_head": 128, "dense_i": 128}  # --dry-run's shapes: one 128 × 128 tile (or part of one) per weight


def _ms(v) -> str:
    return f"{v:.4f}" if isinstance(v, float) else "err" if isinstance(v, dict) else "-"


def print_moe(res: dict) -> None:
    print("\n== MoE routed experts, FP8 (128 × 128 tiles) vs bf16; T = 1 with the shared expert")
    print(f"{'tp':>3} {'T':>3} {'bf16 ms':>9} {'fp8 dflt':>9} {'fp8 best':>9} {'bf16/fp8':>8} {'GB/s':>6} {'bound':>8} "
          f"{'/bound':>6} {'err':>8}")
    for r in res["rows"]:
        print(f"{r['tp']:>3} {r['tokens']:>3} {_ms(r['bf16_ms']):>9} {_ms(r['fp8_default_ms']):>9} {_ms(r['fp8_chosen_ms']):>9} "
              f"{r.get('bf16_over_fp8', 0):>8.2f} {r.get('fp8_GBps', 0):>6.0f} {r['bound_ms']:>8.4f} "
              f"{r.get('fp8_over_bound', 0):>6.2f} {_ms(r['chosen_err_vs_dequant']):>8}")
    cols = sorted({k for r in res["sweep"] for k in r if k.startswith("ms_")})
    print("\nsweep (config = BLOCK_N, BLOCK_K, warps, stages, mode[, split]):", " ".join(cols))
    for r in res["sweep"]:
        print(f"  {r['kernel']:<8} {str(tuple(r['config'])):<26}", " ".join(f"{_ms(r[c]):>8}" for c in cols))
    print("\nchosen:", res["chosen"], "\npaste into models/fused_moe.py:\n  " + "\n  ".join(res["paste"]))


def print_linear(res: dict) -> None:
    print(f"\n== FP8 linears (128 × 128 tiles); scaled_mm block scaling on this GPU: {res['scaled_mm_supported']}")
    print(f"{'shape':<12} {'tp':>2} {'N':>6} {'K':>6} {'T':>4} {'fp8 bnd':>8} {'bf16':>8} {'dequant':>8} {'engine':>8} "
          f"{'path':<9} {'scl_mm':>8} {'triton':>8} {'/bnd':>5}  best triton")
    for r in res["rows"]:
        ms, best = r["ms"], r.get("best_triton")
        bt = ms.get(best)
        print(f"{r['shape']:<12} {r['tp']:>2} {r['N']:>6} {r['K']:>6} {r['tokens']:>4} {r['fp8_bound_ms']:>8.4f} "
              f"{_ms(r['bf16_ms']):>8} {_ms(ms.get('dequant')):>8} {_ms(ms.get('engine')):>8} {r['engine_path']:<9} "
              f"{_ms(ms.get('scaled_mm')):>8} {_ms(bt):>8} {bt / r['fp8_bound_ms'] if isinstance(bt, float) else 0:>5.2f}  "
              f"{(best or '-')[len('triton'):]}")
    worst = max(((v, r["shape"], r["tokens"], m) for r in res["rows"] for m, v in r["err"].items() if isinstance(v, float)),
                default=None)
    print("largest error vs the dequantised weights (max |Δ| / max |ref|):", worst)
    wins = {}
    for r in res["rows"]:
        sm, bt = r["ms"].get("scaled_mm"), r["ms"].get(r.get("best_triton"))
        if isinstance(sm, float) and isinstance(bt, float):
            w = wins.setdefault(r["tokens"], [0, 0])
            w[0], w[1] = w[0] + (sm < bt), w[1] + 1
    print("shapes where scaled_mm beats the best Triton config, by tokens (set SCALED_MM_MIN_TOKENS from it):",
          {t: f"{a}/{b}" for t, (a, b) in sorted(wins.items())})
    print("\nchosen Triton configs by tokens:", res["chosen"], "\npaste into models/fp8_linear.py:\n  " + res["paste"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="results/fp8", help="folder for fp8_bench.json")
    ap.add_argument("--sections", default="moe,linear", help="comma list of moe, linear")
    ap.add_argument("--moe-tp", default="1,8", help="comma list: expert-TP shard shapes of the MoE section")
    ap.add_argument("--linear-tp", default="1,8", help="comma list: TP shard shapes of the linear section")
    ap.add_argument("--moe-modes", default="0,1,2,3,4", help="comma list: the FP8 modes (fp8_tiles.MODE_NAMES) the MoE "
                    "section sweeps")
    ap.add_argument("--budget-s", type=float, default=280, help="wall-clock budget: later configurations are skipped past it")
    ap.add_argument("--dry-run", action="store_true", help="CPU, Triton's interpreter, toy shapes: checks the script only")
    a = ap.parse_args(argv)
    sections = set(a.sections.split(","))
    if not sections <= {"moe", "linear"}:
        ap.error(f"--sections {a.sections}: expected a comma list of moe, linear")
    try:
        moe_tps, linear_tps, moe_modes = ([int(v) for v in s.split(",")] for s in (a.moe_tp, a.linear_tp, a.moe_modes))
    except ValueError:
        ap.error("--moe-tp / --linear-tp / --moe-modes: expected comma lists of integers")
    if a.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # read when Triton is first imported
    import torch

    from lab import fp8_kernels as fk

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.time()
    deadline = start + a.budget_s
    results = {"machine": {"gpu": torch.cuda.get_device_name(0) if not a.dry_run else "cpu (dry run)",
                           "torch": torch.__version__, "argv": sys.argv[1:] if argv is None else argv}}
    try:
        import triton

        results["machine"]["triton"] = triton.__version__
    except ImportError:
        print("Triton is not importable: the FP8 kernels cannot run", file=sys.stderr)
        return 1
    if a.dry_run:
        bw = 1.0
        kw = {"dims": TINY, "device": "cpu", "timer": fk.wall_ms}
        moe_kw = {"tokens": (1,), "rotate": 1, "sweep": {"gate_up": {3: [(32, 64, 1, 1, 2)], 4: [(32, 128, 1, 1)]},
                                                          "down": {1: [(32, 128, 1, 1)], 4: [(32, 128, 1, 1)]}}}
        lin_kw = {"tokens": (1, 20), "cold_bytes": 1, "names": ("fused_qkv_a", "q_b", "mlp_w2"),
                  "sweep": {1: [(1, 1, 32, 128, 0, 1, 1), (3, 16, 32, 64, 2, 1, 1)], 20: [(2, 32, 64, 128, 0, 1, 1)]}}
        moe_tps, linear_tps = moe_tps[:1], linear_tps[:1]
    else:
        from lab.gpu_kernels import bandwidth

        bw = bandwidth()["copy_GBps_read_plus_write"]
        kw, lin_kw = {}, {}
        moe_kw = {"sweep": {kernel: {m: c for m, c in modes.items() if m in moe_modes} for kernel, modes in fk.MOE_SWEEP.items()}}
    results["bandwidth_GBps"] = bw
    print(f"copy bandwidth {bw:.0f} GB/s (the bounds' denominator)", flush=True)

    def save():
        results["elapsed_s"] = round(time.time() - start, 1)
        (out / "fp8_bench.json").write_text(json.dumps(results, indent=1, default=str))

    if "moe" in sections:
        # the MoE section gets 55% of the budget; the linears what is left
        results["moe"] = fk.moe(bw, moe_tps, deadline=start + 0.55 * a.budget_s, **kw, **moe_kw)
        save()
        print_moe(results["moe"])
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    if "linear" in sections:
        results["linear"] = fk.linears(bw, linear_tps, deadline=deadline, **kw, **lin_kw)
        save()
        print_linear(results["linear"])
    save()
    print(f"\nwrote {out / 'fp8_bench.json'} after {results['elapsed_s']} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
