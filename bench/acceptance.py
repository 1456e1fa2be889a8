"""Acceptance benchmark of the trained demo pair: greedy speculative decoding on held-out prompts.

Builds engines from the trained pair (convert + build at TP1 into a temporary folder), then for
every prompt of ``eval/prompts.jsonl`` (code completions written for this benchmark, not in the
training corpus, and chat questions rendered with the chat template) runs greedy generation with k
draft tokens through :class:`splitspec.runtime.scheduler.SpeculativeEngine` and checks that the output equals
target-only greedy decoding (``num_draft_tokens=0``); the measuring is :mod:`splitspec.demo.acceptance`. Reports:

- mean acceptance length (tokens emitted per target verify forward; no speculation = 1.0) and the
  per-position acceptance rate (fraction of cycles whose draft i was accepted, i = 1..k);
- the target's held-out loss (nats/token, through the engine): on the standard-library files held
  out from training (``splitspec.demo.corpus.corpus_split``) and on the code prompts of the eval set;
- three sample greedy outputs.

Writes ``results.json`` and ``acceptance_by_position.png`` into
``bench/results/acceptance-<timestamp>/``. A benchmark, not a test: run it by hand::

    .venv/bin/python bench/acceptance.py                 # models/demo, k = 4
    .venv/bin/python bench/acceptance.py --models DIR -k 3 --max-tokens 128
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP (see splitspec.cli)

import torch  # noqa: E402

from splitspec.errors import SplitspecError  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=str(ROOT / "models" / "demo"), help="folder with target/ and drafter/ (Hugging Face)")
    ap.add_argument("--prompts", default=str(ROOT / "eval" / "prompts.jsonl"))
    ap.add_argument("-k", "--num-draft-tokens", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--device", default="cpu", help="cpu or cuda[:N] (target and drafter on that GPU)")
    ap.add_argument("--heldout-windows", type=int, default=64, help="held-out stdlib windows of 256 tokens to score")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    a = ap.parse_args(argv)

    from splitspec.build.engines import build_pair
    from splitspec.demo.acceptance import engine_heldout_loss, speculative_acceptance
    from splitspec.demo.report import plot_acceptance
    from splitspec.measure.prompts import encode_prompt, prompt_text, read_prompts
    from splitspec.runtime.tokenizer import ChatTokenizer

    models = Path(a.models)
    if not (models / "target" / "config.json").is_file() or not (models / "drafter" / "config.json").is_file():
        raise SplitspecError(f"{models}: no target/ and drafter/ checkpoints; run 'make demo-models' first")
    info_path = models / "training.json"
    info = json.loads(info_path.read_text()) if info_path.is_file() else None
    if info is None:
        print(f"warning: {models} has no training.json: this is not the trained pair (random weights give "
              "acceptance ≈ 1)", file=sys.stderr)
    tok = ChatTokenizer.from_dir(models / "target")
    prompts = read_prompts(Path(a.prompts), models / "target")
    ids = [encode_prompt(tok, p) for p in prompts]
    dev_ids = [int(a.device.split(":")[1]) if ":" in a.device else 0] if a.device.startswith("cuda") else None
    torch.set_num_threads(os.cpu_count() or 1)

    with tempfile.TemporaryDirectory(prefix="splitspec-bench-") as tmp:
        t0 = time.perf_counter()
        engines = build_pair(models, Path(tmp), tp_size=1, quiet=True)
        print(f"built TP1 engines from {models} in {time.perf_counter() - t0:.1f} s")
        acc = speculative_acceptance(engines, ids, a.max_tokens, a.num_draft_tokens,
                                     tok.stop_token_ids, dev_ids, check_lossless=True)
        code_windows = [tok.encode(p.text) for p in prompts if not p.chat]
        losses, heldout_files = engine_heldout_loss(engines, tok, info["config"]["heldout_every"] if info else 40,
                                                    code_windows, a.heldout_windows, dev_ids)

    outputs = acc.pop("outputs")
    result = {
        "models": str(models.resolve()), "training_key": info and info.get("key"),
        "k": a.num_draft_tokens, "max_tokens": a.max_tokens, "device": a.device,
        "acceptance": acc,
        "heldout_loss": losses,
        "prompts": [{"id": p.id, "kind": "chat" if p.chat else "code", "prompt_tokens": len(i),
                     "output": tok.decode(o, skip_special_tokens=False), **pp}
                    for p, i, o, pp in zip(prompts, ids, outputs, acc["per_prompt"])],
    }
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out_dir = Path(a.out) / f"acceptance-{stamp}"
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.json").write_text(json.dumps(result, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    png = plot_acceptance(acc, len(result["prompts"]), out_dir / "acceptance_by_position.png")

    k = a.num_draft_tokens
    print(f"\n{'prompt':10} {'tokens':>6} {'cycles':>6} {'accept len':>10}   accepted by position")
    for p in result["prompts"]:
        print(f"{p['id']:10} {p['tokens']:6d} {p['cycles']:6d} {p['acceptance_length']:10.2f}   {p['accepted_per_position']}")
    print(f"\nmean acceptance length at k={k}: {acc['acceptance_length']:.2f} tokens per target forward "
          f"({acc['cycles']} cycles over {len(prompts)} held-out prompts; every output equals target-only greedy)")
    print("per-position acceptance rate: " + ", ".join(f"{i + 1}: {r:.2f}" for i, r in enumerate(acc["per_position"])))
    print(f"wall time: speculative {acc['spec_seconds']:.1f} s, target-only {acc['target_only_seconds']:.1f} s (CPU, float32, TP1)")
    print(f"target held-out loss: {losses['stdlib_heldout_files']:.3f} nats/token on {losses['stdlib_tokens']:,} tokens "
          f"of {heldout_files} held-out stdlib files; {losses['eval_code_prompts']:.3f} nats/token on the "
          f"{losses['eval_code_tokens']} tokens of the eval code prompts")
    for p in result["prompts"][:1] + [q for q in result["prompts"] if q["kind"] == "chat"][:1] + result["prompts"][1:2]:
        text = next(prompt_text(tok, q) for q in prompts if q.id == p["id"])
        print(f"\n--- sample {p['id']} (acceptance length {p['acceptance_length']:.2f}) ---\n{text}\033[1m{p['output']}\033[0m")
    print(f"\nwrote {out_dir / 'results.json'}" + (f" and {out_dir / 'acceptance_by_position.png'}" if png else
                                                   " (no PNG: matplotlib missing)"))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except SplitspecError as e:
        print(f"bench/acceptance.py: error: {e}", file=sys.stderr)
        sys.exit(2)
