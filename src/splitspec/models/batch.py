"""The description of one forward over several sequences (tokens concatenated, nano-vllm style)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from splitspec.models.kv import BLOCK_SIZE, slot_mapping


@dataclass
class ForwardBatch:
    """Tokens of several sequences in one flat forward.

    Attributes:
        input_ids: [T] int64, the sequences' new tokens concatenated.
        positions: [T] int64, each token's absolute position in its sequence.
        segments: (start, length) per sequence: ``length`` consecutive tokens at positions start.. .
        slots: per sequence, [start + length] int64 cache rows of its positions 0..start+length−1.
        logits_rows: [R] int64, rows of the flat batch whose logits are wanted (others are skipped).
        table, write_rows: the padded form (every sequence has the same number n of new tokens; see
            :meth:`padded`): table [B, S] int64 cache rows of positions 0..S−1 per sequence, write_rows [B·n]
            the rows the new tokens go to. Shapes then depend only on (B, n, S): CUDA-graph friendly.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    segments: list[tuple[int, int]]
    slots: list[torch.Tensor]
    logits_rows: torch.Tensor
    table: torch.Tensor | None = None
    write_rows: torch.Tensor | None = None

    @staticmethod
    def build(seqs: list[tuple[list[int], int, list[int]]], want: str | list[str] = "last", device="cpu",
              block_size: int = BLOCK_SIZE) -> "ForwardBatch":
        """seqs: (KV blocks, start position, new token ids) per sequence. ``want`` per sequence (or one for
        all): 'last' (one logits row), 'all' (every row) or 'none'."""
        wants = [want] * len(seqs) if isinstance(want, str) else want
        ids, pos, segs, slots, rows, t = [], [], [], [], [], 0
        for (blocks, start, toks), w in zip(seqs, wants):
            n = len(toks)
            ids += toks
            pos += range(start, start + n)
            segs.append((start, n))
            slots.append(slot_mapping(blocks, start + n, block_size, device))
            rows += {"last": [t + n - 1], "all": list(range(t, t + n)), "none": []}[w]
            t += n
        as_t = lambda v: torch.tensor(v, dtype=torch.int64, device=device)  # noqa: E731
        return ForwardBatch(as_t(ids), as_t(pos), segs, slots, as_t(rows))


def padded(seqs: list[tuple[list[int], int, list[int]]], window: int, device="cpu", block_size: int = BLOCK_SIZE,
           scratch_row: int = 0, pad_to: int | None = None) -> ForwardBatch:
    """Padded form of a batch whose sequences all bring n tokens: (blocks, start, tokens) per sequence.

    ``window`` S: key positions visible per sequence (≥ every start + n). ``pad_to``: pad the batch with
    dummy sequences (token 0 at position 0, writing ``scratch_row``) to this many sequences.
    Logits are wanted for every row.
    """
    n = len(seqs[0][2])
    B = pad_to or len(seqs)
    ids = torch.zeros(B, n, dtype=torch.int64)
    pos = torch.zeros(B, n, dtype=torch.int64)
    table = torch.full((B, window), scratch_row, dtype=torch.int64)
    for b, (blocks, start, toks) in enumerate(seqs):
        if len(toks) != n or start + n > window:
            raise ValueError(f"padded batch: sequence {b} brings {len(toks)} tokens at {start} (need {n}, window {window})")
        ids[b] = torch.tensor(toks)
        pos[b] = torch.arange(start, start + n)
        rows = slot_mapping(blocks, min(window, len(blocks) * block_size), block_size)
        table[b, :rows.numel()] = rows
    write = torch.gather(table, 1, pos).flatten()
    write[len(seqs) * n:] = scratch_row
    ids, pos, table, write = to_device(device, ids.flatten(), pos.flatten(), table, write)
    return ForwardBatch(ids, pos, [], [], torch.arange(B * n, device=device), table, write)


def to_device(device, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Host int64 tensors on ``device`` without a host synchronisation (raises TypeError for another dtype or a
    tensor not on the CPU): on CUDA they are packed into one pinned
    host buffer and sent in one non-blocking copy (views of it come back, shapes unchanged); a copy from ordinary
    host memory would wait for the device's stream to drain first. The pinned buffer goes back to PyTorch's caching
    host allocator, which reuses it only once the copy has completed. Returned as they are on the CPU."""
    for i, t in enumerate(tensors):
        if t.dtype != torch.int64 or t.device.type != "cpu":
            raise TypeError(f"to_device: tensor {i} is {t.dtype} on {t.device}, expected int64 on the CPU")
    if not str(device).startswith("cuda"):
        return tensors
    flat = torch.empty(sum(t.numel() for t in tensors), dtype=torch.int64, pin_memory=True)
    torch.cat([t.reshape(-1) for t in tensors], out=flat)
    sent = flat.to(device, non_blocking=True)
    out, at = [], 0
    for t in tensors:
        out.append(sent[at:at + t.numel()].view(t.shape))
        at += t.numel()
    return tuple(out)


def single_blocks(slot: int, max_seq_len: int, block_size: int = BLOCK_SIZE) -> list[int]:
    """Blocks of a fixed region for sequence number ``slot`` (tests and one-off forwards)."""
    per = -(-max_seq_len // block_size)
    return list(range(slot * per, (slot + 1) * per))
