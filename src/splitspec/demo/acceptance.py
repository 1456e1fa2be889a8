"""Measure the demo pair's speculation with the real engines: acceptance by draft position, losslessness.

The pair is converted and built (:func:`splitspec.build.engines.build_pair`) and decoded greedily by
:class:`splitspec.runtime.scheduler.SpeculativeEngine` on held-out prompts (:func:`heldout_prompts`),
each output checked against target-only greedy decoding.
"""

from __future__ import annotations

import sys
import time
import zlib
from pathlib import Path
from typing import Any

from splitspec.demo.corpus import CorpusSplit, chat_samples
from splitspec.errors import SplitspecError


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
    with SpeculativeEngine.load(engines_dir, target_device_ids=target_device_ids, num_draft_tokens=k) as eng:
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
