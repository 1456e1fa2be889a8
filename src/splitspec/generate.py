"""``splitspec generate``: speculative decoding from built engines in this process, with a lossless check."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from splitspec.errors import SplitspecError
from splitspec.runtime import SpeculativeEngine
from splitspec.tokenizer import ChatTokenizer


def main(a: argparse.Namespace) -> None:
    """Print the completion, acceptance length and timings; with ``--check`` also decode target-only
    and raise if the tokens differ."""
    engines = Path(a.engines)
    tok = ChatTokenizer.from_dir(engines / "target")
    text = tok.apply_chat_template([{"role": "user", "content": a.prompt}]) if a.chat else a.prompt
    ids = tok.encode(text)
    device_ids = [int(a.device.split(":")[1] if ":" in a.device else 0)] if a.device.startswith("cuda") else None
    with SpeculativeEngine.load(engines, target_device_ids=device_ids) as eng:
        t0 = time.perf_counter()
        res = eng.generate(ids, a.max_tokens, a.num_draft_tokens, set(tok.stop_token_ids))
        dt = time.perf_counter() - t0
        print(a.prompt + tok.decode(res.token_ids))
        print(f"--\n{len(res.token_ids)} tokens in {dt * 1e3:.0f} ms ({len(res.token_ids) / dt:.1f} tok/s), "
              f"k={a.num_draft_tokens}, acceptance length {res.acceptance_length:.2f} over {res.num_cycles} cycles, "
              f"accepted by position {res.accepted_per_position}, draft {res.stats.draft_ms:.0f} ms, verify {res.stats.verify_ms:.0f} ms")
        if a.check:
            ref = eng.generate(ids, a.max_tokens, 0, set(tok.stop_token_ids))
            if ref.token_ids != res.token_ids:
                raise SplitspecError("speculative output differs from target-only greedy decoding")
            print("check: identical to target-only greedy decoding")
