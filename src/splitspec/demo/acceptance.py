"""Measure the demo pair with the real engines: acceptance by draft position, losslessness, held-out loss.

The pair is converted and built (:func:`splitspec.build.engines.build_pair`) and decoded greedily by
:class:`splitspec.runtime.scheduler.SpeculativeEngine` on held-out prompts (:func:`heldout_prompts` after
training; ``eval/prompts.jsonl`` in bench/acceptance.py), each output checked against target-only greedy
decoding (:func:`speculative_acceptance`). :func:`engine_heldout_loss` scores the target engine itself
on the standard-library files held out from training.
"""

from __future__ import annotations

import sys
import time
import zlib
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from splitspec.demo.corpus import CorpusSplit, chat_samples, corpus_split, token_windows
from splitspec.errors import SplitspecError
from splitspec.settings import ServeConfig


def speculative_acceptance(engines_dir: Path, prompts: list[list[int]], max_tokens: int, k: int,
                           stop_ids: list[int], target_device_ids: list[int] | None = None,
                           check_lossless: bool = True, progress: bool = True) -> dict[str, Any]:
    """Greedy speculative decoding of every prompt with ``k`` draft tokens (one sequence at a time).

    Returns:
        ``acceptance_length`` (tokens emitted per target verify forward, over all cycles of all
        prompts; 1.0 = no gain), ``per_position`` (fraction of cycles whose draft i+1 was accepted,
        i = 0..k−1), ``cycles``, ``per_prompt`` (acceptance length, cycles, tokens, accepted per
        position, wall seconds with and without speculation), ``outputs`` (generated token ids),
        ``spec_seconds`` / ``target_only_seconds`` (total wall time), ``lossless`` (True when every
        output was checked equal to target-only greedy decoding, None when not checked).

    Raises:
        SplitspecError: a speculative output differs from target-only greedy decoding.
    """
    from tqdm import tqdm

    from splitspec.runtime.scheduler import SpeculativeEngine

    cycles, emitted, accepted = 0, 0, [0] * k
    per_prompt, outputs = [], []
    spec_s = ref_s = 0.0
    cfg = ServeConfig.from_env(engines_dir=engines_dir, target_device_ids=target_device_ids or (), num_draft_tokens=k)
    with SpeculativeEngine.load(cfg) as eng:
        for ids in tqdm(prompts, desc=f"speculative decoding (k={k})", unit="prompt", disable=not progress,
                        dynamic_ncols=True, file=sys.stdout):
            t = time.perf_counter()
            res = eng.generate(ids, max_tokens, num_draft_tokens=k, stop_token_ids=set(stop_ids))
            dt = time.perf_counter() - t
            spec_s += dt
            ref_dt = None
            if check_lossless:
                t = time.perf_counter()
                ref = eng.generate(ids, max_tokens, num_draft_tokens=0, stop_token_ids=set(stop_ids))
                ref_dt = time.perf_counter() - t
                ref_s += ref_dt
                if ref.token_ids != res.token_ids:
                    raise SplitspecError("speculative output differs from target-only greedy decoding "
                                         f"(prompt of {len(ids)} tokens)")
            cycles += res.num_cycles
            emitted += round(res.acceptance_length * res.num_cycles)
            accepted = [a + b for a, b in zip(accepted, res.accepted_per_position)]
            per_prompt.append({"acceptance_length": res.acceptance_length, "cycles": res.num_cycles,
                               "tokens": len(res.token_ids), "accepted_per_position": res.accepted_per_position,
                               "spec_seconds": dt, "target_only_seconds": ref_dt})
            outputs.append(res.token_ids)
    return {"k": k, "acceptance_length": emitted / max(cycles, 1), "cycles": cycles,
            "per_position": [a / max(cycles, 1) for a in accepted], "per_prompt": per_prompt, "outputs": outputs,
            "spec_seconds": spec_s, "target_only_seconds": ref_s if check_lossless else None,
            "lossless": True if check_lossless else None}


def heldout_prompts(tok: Any, split: CorpusSplit, n: int, prompt_tokens: int = 48) -> list[list[int]]:
    """Prompts from the held-out files: half code (the last ``prompt_tokens`` tokens up to the ``:`` of
    a ``def`` line), half chat questions about their documented functions (chat template applied)."""
    code: list[list[int]] = []
    for rel, text in split.heldout:
        lines = text.splitlines(keepends=True)
        defs = [i for i, ln in enumerate(lines) if ln.lstrip().startswith("def ") and ln.rstrip().endswith(":")]
        if not defs:
            continue
        i = defs[zlib.crc32(rel.encode()) % len(defs)]
        # End on the ':' of the def line, not after its newline: byte-level BPE merges a newline with
        # the next line's indentation, so a prompt ending in a bare "\n" is followed, in training
        # text, by an unindented line, and the model would start a new top-level statement.
        ids = tok.encode("".join(lines[:i + 1]).rstrip("\n"))
        if len(ids) >= prompt_tokens // 2:
            code.append(ids[-prompt_tokens:])
    chats = [tok.encode(tok.apply_chat_template(c[:1], add_generation_prompt=True)) for c in chat_samples(split.heldout)]
    n_code = min(len(code), n - min(len(chats), n // 2))
    return code[:n_code] + chats[:n - n_code]


@torch.inference_mode()
def engine_loss(group: Any, windows: list[list[int]]) -> tuple[float, int]:
    """Mean next-token cross-entropy (nats/token) of a TP1 target engine (``splitspec.engine.group.Group``)
    over token ``windows`` (each one forward from position 0 in the first KV region).
    Returns (loss, tokens scored)."""
    from splitspec.models.batch import ForwardBatch, single_blocks

    r = group.rank0
    blocks = single_blocks(0, group.limits["max_seq_len"])
    total, count = 0.0, 0
    for w in windows:
        if len(w) < 2:
            continue
        logits, _ = r.target.forward(ForwardBatch.build([(blocks, 0, w[:-1])], "all", r.device), r.tcache)
        total += float(F.cross_entropy(logits.float(), torch.tensor(w[1:]), reduction="sum"))
        count += len(w) - 1
    return total / max(count, 1), count


def engine_heldout_loss(engines_dir: Path, tok: Any, heldout_every: int, code_prompts: list[list[int]],
                        max_windows: int = 64, target_device_ids: list[int] | None = None) -> tuple[dict[str, Any], int]:
    """The TP1 target engine's loss (:func:`engine_loss`) on the standard-library files held out from
    training (:func:`splitspec.demo.corpus.corpus_split` with ``heldout_every``; windows of 257 tokens, at
    most ``max_windows``) and on ``code_prompts`` (each one window).

    Returns:
        (``stdlib_heldout_files`` / ``eval_code_prompts``: loss in nats/token, ``stdlib_tokens`` /
        ``eval_code_tokens``: tokens scored; the number of held-out files).
    """
    from splitspec.engine.group import Group

    split = corpus_split(heldout_every)
    windows = token_windows(tok, [text for _, text in split.heldout], 256, max_windows)
    group = Group(ServeConfig.from_env(engines_dir=engines_dir, target_device_ids=target_device_ids or ()))
    try:
        heldout_loss, heldout_tokens = engine_loss(group, windows)
        code_loss, code_tokens = engine_loss(group, code_prompts)
    finally:
        group.close()
    return {"stdlib_heldout_files": heldout_loss, "stdlib_tokens": heldout_tokens,
            "eval_code_prompts": code_loss, "eval_code_tokens": code_tokens}, len(split.heldout)
