"""The description of one forward over several sequences (tokens concatenated, nano-vllm style)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ForwardBatch:
    """Tokens of several sequences in one flat forward.

    Attributes:
        input_ids: [T] int64, the sequences' new tokens concatenated.
        positions: [T] int64, each token's absolute position in its sequence.
        segments: list of (slot, start, length): sequence in KV-cache slot ``slot`` contributes
            ``length`` consecutive tokens at positions start..start+length-1.
        logits_rows: [R] int64, rows of the flat batch whose logits are wanted (others are skipped).
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    segments: list[tuple[int, int, int]]
    logits_rows: torch.Tensor

    @staticmethod
    def build(seqs: list[tuple[int, int, list[int]]], want: str = "last", device="cpu") -> "ForwardBatch":
        """seqs: (slot, start position, new token ids) per sequence. ``want``: 'last' (one row per
        sequence) or 'all' (every row)."""
        ids, pos, segs, rows, t = [], [], [], [], 0
        for slot, start, toks in seqs:
            n = len(toks)
            ids += toks
            pos += range(start, start + n)
            segs.append((slot, start, n))
            rows += [t + n - 1] if want == "last" else list(range(t, t + n))
            t += n
        as_t = lambda v: torch.tensor(v, dtype=torch.int64, device=device)  # noqa: E731
        return ForwardBatch(as_t(ids), as_t(pos), segs, as_t(rows))
