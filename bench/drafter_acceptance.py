#!/usr/bin/env python3
"""Acceptance of an FP8 drafter against the float one on the demo pair: greedy and sampled, for each k.

The pair (``--models``, Hugging Face folders as ``splitspec demo-models`` writes them) is converted once at TP1 and
built once per variant, float32 throughout (what CPU engines run):

- ``float``: the drafter as trained (float32);
- ``fp8``: ``splitspec build --drafter-dtype fp8``, its linears quantised at build to block-scaled FP8 (128×128 tiles),
  embedding and lm_head float32;
- ``fp8-checkpoint``: an FP8 drafter checkpoint (the drafter's linears stored float8_e4m3fn + ``weight_scale_inv`` as
  Kimi-K2-Instruct stores its own, :mod:`splitspec.testing.fp8_drafter`) converted and built with ``--drafter-dtype
  fp8``: its tiles kept.

For every prompt of ``--prompts`` (eval/prompts.jsonl: held-out code completions and chat questions), target-only
greedy decoding once (the reference); then, per variant and k, greedy speculative decoding — each output checked
token for token against the reference (the drafter only proposes) — and sampled speculative decoding (temperature
``--temperature``, the same ``--seeds`` seeds per prompt for every variant, so the comparison is paired), both through
:class:`splitspec.runtime.scheduler.SpeculativeEngine` as :mod:`splitspec.demo.acceptance` runs it. Reports the
acceptance length (tokens emitted per target verify forward, pooled over prompts), per-position acceptance, the
engine's draft and verify ms per cycle (greedy runs), and for sampled decoding the mean per-prompt difference to
the float drafter with its standard error. Writes ``results.json`` into ``--out``::

    .venv/bin/python bench/drafter_acceptance.py --models models/demo --out bench/results/fp8-drafter
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP (see splitspec.cli)

VARIANTS = ("float", "fp8", "fp8-checkpoint")


def build_variants(models: Path, tmp: Path, variants: list[str], max_seq_len: int) -> dict[str, Path]:
    """Engines folder per variant (TP1, float32; see the module docstring)."""
    from splitspec.build.engines import build_engines
    from splitspec.convert.pair import convert_pair
    from splitspec.testing.fp8_drafter import write_fp8_drafter

    out = {}
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        if {"float", "fp8"} & set(variants):
            convert_pair(models / "target", models / "drafter", tmp / "ckpt", tp_size=1, progress=False)
        for v in variants:
            ckpt = tmp / "ckpt"
            if v == "fp8-checkpoint":
                write_fp8_drafter(models / "drafter", tmp / "drafter-fp8")
                ckpt = tmp / "ckpt-fp8"
                convert_pair(models / "target", tmp / "drafter-fp8", ckpt, tp_size=1, progress=False)
            out[v] = build_engines(ckpt, tmp / f"engines-{v}", max_batch_size=1, max_seq_len=max_seq_len, progress=False,
                                   float_dtype="float32", drafter_dtype=None if v == "float" else "fp8")
    return out


def pooled(results: list) -> dict:
    """Acceptance over ``results`` (GenerationResult): pooled length, per-position rates, ms per cycle."""
    cycles = sum(r.num_cycles for r in results)
    emitted = sum(round(r.acceptance_length * r.num_cycles) for r in results)
    k = max(len(r.accepted_per_position) for r in results)
    per = [sum(r.accepted_per_position[i] for r in results if len(r.accepted_per_position) > i) / cycles for i in range(k)]
    return {"acceptance_length": emitted / cycles, "cycles": cycles, "per_position": per,
            "draft_ms_per_cycle": sum(r.stats.draft_ms for r in results) / cycles,
            "verify_ms_per_cycle": sum(r.stats.verify_ms for r in results) / cycles,
            "tokens": sum(len(r.token_ids) for r in results)}


def run_variant(engines: Path, ids: list[list[int]], reference: list[list[int]] | None, ks: list[int], max_tokens: int,
                temperature: float, seeds: list[int], stop: set[int]) -> tuple[dict, list[list[int]]]:
    """Greedy and sampled speculative decoding of every prompt at each k with the engines of one variant. Returns
    (results by k, the target-only greedy outputs of these engines). Raises SplitspecError when a greedy speculative
    output differs from ``reference`` (or from these engines' own target-only output when ``reference`` is None)."""
    from splitspec.errors import SplitspecError
    from splitspec.runtime.sampling import SamplingParams
    from splitspec.runtime.scheduler import SpeculativeEngine
    from splitspec.settings import ServeConfig

    out = {}
    with SpeculativeEngine.load(ServeConfig(engines, num_draft_tokens=max(ks))) as eng:
        own = [eng.generate(p, max_tokens, num_draft_tokens=0, stop_token_ids=stop).token_ids for p in ids]
        want = reference or own
        if own != want:
            raise SplitspecError(f"{engines}: target-only greedy output differs from the float build's")
        for k in ks:
            t = time.perf_counter()
            greedy = [eng.generate(p, max_tokens, num_draft_tokens=k, stop_token_ids=stop) for p in ids]
            wall = time.perf_counter() - t
            bad = [i for i, (g, w) in enumerate(zip(greedy, want)) if g.token_ids != w]
            if bad:
                raise SplitspecError(f"{engines}: greedy speculative output at k = {k} differs from target-only greedy "
                                     f"decoding for prompt {bad[0]} (and {len(bad) - 1} more)")
            sampled = [[eng.generate(p, max_tokens, num_draft_tokens=k, stop_token_ids=stop,
                                     sampling=SamplingParams(temperature=temperature, seed=s)) for s in seeds] for p in ids]
            out[k] = {"greedy": pooled(greedy) | {"wall_s": wall, "lossless": True},
                      "sampled": pooled([r for rs in sampled for r in rs]),
                      "sampled_per_prompt": [pooled(rs)["acceptance_length"] for rs in sampled],
                      "greedy_per_prompt": [r.acceptance_length for r in greedy]}
            print(f"  k={k}: greedy {out[k]['greedy']['acceptance_length']:.3f} (lossless), sampled "
                  f"{out[k]['sampled']['acceptance_length']:.3f}; draft {out[k]['greedy']['draft_ms_per_cycle']:.2f} ms, "
                  f"verify {out[k]['greedy']['verify_ms_per_cycle']:.2f} ms per cycle", flush=True)
    return out, own


def paired(a: list[float], b: list[float]) -> dict:
    """Mean of b − a over prompts and its standard error."""
    d = [y - x for x, y in zip(a, b)]
    return {"mean": statistics.fmean(d), "se": statistics.stdev(d) / math.sqrt(len(d)) if len(d) > 1 else None}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=str(ROOT / "models" / "demo"), help="folder with target/ and drafter/ (Hugging Face)")
    ap.add_argument("--prompts", default=str(ROOT / "eval" / "prompts.jsonl"))
    ap.add_argument("--ks", default="1,2,3,4,5", help="comma list of draft lengths")
    ap.add_argument("--variants", default="float,fp8", help=f"comma list of {', '.join(VARIANTS)} (float first: the baseline)")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--seeds", type=int, default=2, help="sampled runs per prompt and k (seeds 0..N-1, the same for every variant)")
    ap.add_argument("--num-prompts", type=int, default=0, help="the first N prompts (0: all)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "drafter-acceptance"))
    a = ap.parse_args(argv)
    variants = [v.strip() for v in a.variants.split(",") if v.strip()]
    try:
        ks = [int(k) for k in a.ks.split(",")]
    except ValueError:
        ap.error(f"--ks {a.ks!r}: expected a comma list of integers")
    if not ks or min(ks) < 1 or max(ks) > 8:
        ap.error(f"--ks {a.ks!r}: each k in 1..8")
    if not variants or variants[0] != "float" or any(v not in VARIANTS for v in variants):
        ap.error(f"--variants {a.variants!r}: a comma list of {', '.join(VARIANTS)}, float first")
    if a.seeds < 1 or a.max_tokens < 1 or not 0 < a.temperature <= 100:
        ap.error("--seeds and --max-tokens at least 1, --temperature in (0, 100]")

    import torch

    from splitspec.errors import SplitspecError
    from splitspec.measure.prompts import encode_prompt, read_prompts
    from splitspec.runtime.tokenizer import ChatTokenizer

    models = Path(a.models)
    if not (models / "target" / "config.json").is_file() or not (models / "drafter" / "config.json").is_file():
        ap.error(f"--models {models}: no target/ and drafter/ checkpoints; run 'make demo-models' first")
    tok = ChatTokenizer.from_dir(models / "target")
    prompts = read_prompts(Path(a.prompts), models / "target")[: a.num_prompts or None]
    ids = [encode_prompt(tok, p) for p in prompts]
    torch.set_num_threads(os.cpu_count() or 1)
    info = models / "training.json"
    git = lambda *args: subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True).stdout.strip()  # noqa: E731
    result = {"commit": git("rev-parse", "--short", "HEAD"), "dirty": bool(git("status", "--porcelain", "--", "src", "bench")),
              "models": str(models.resolve()), "training_key": json.loads(info.read_text()).get("key") if info.is_file() else None,
              "prompts": [p.id for p in prompts], "ks": ks, "max_tokens": a.max_tokens, "temperature": a.temperature,
              "seeds": list(range(a.seeds)), "torch": torch.__version__, "threads": torch.get_num_threads(), "variants": {}}
    t0 = time.time()
    try:
        with tempfile.TemporaryDirectory(prefix="splitspec-fp8-drafter-") as tmp:
            engines = build_variants(models, Path(tmp), variants, max(1024, max(len(i) for i in ids) + a.max_tokens + 16))
            reference = None
            for v in variants:
                print(f"== {v} drafter", flush=True)
                result["variants"][v], own = run_variant(engines[v], ids, reference, ks, a.max_tokens, a.temperature,
                                                         list(range(a.seeds)), set(tok.stop_token_ids))
                reference = reference or own
    except SplitspecError as e:
        print(f"bench/drafter_acceptance.py: error: {e}", file=sys.stderr)
        return 2
    base = result["variants"]["float"]
    for v in variants[1:]:
        for k in ks:
            r = result["variants"][v][k]
            r["sampled_vs_float"] = paired(base[k]["sampled_per_prompt"], r["sampled_per_prompt"])
            r["greedy_vs_float"] = paired(base[k]["greedy_per_prompt"], r["greedy_per_prompt"])
    result["seconds"] = time.time() - t0
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"\n{'k':>2}" + "".join(f"{v + ' greedy':>22}{v + ' sampled':>22}" for v in variants))
    for k in ks:
        print(f"{k:>2}" + "".join(f"{result['variants'][v][k]['greedy']['acceptance_length']:22.3f}"
                                  f"{result['variants'][v][k]['sampled']['acceptance_length']:22.3f}" for v in variants))
    print(f"wrote {out / 'results.json'} ({result['seconds']:.0f} s; every greedy output equals target-only greedy)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
