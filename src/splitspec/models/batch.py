"""The description of one forward over several sequences (tokens concatenated, nano-vllm style)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from splitspec.models.kv import BLOCK_SIZE, slot_mapping


#: Batch sizes steady cycles are padded to (and capture CUDA graphs at) up to 256; past it, multiples of 256.
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)

#: Logits one call of the leader's sampled decisions filters at most (:func:`splitspec.engine.acceptance.sampled_rows`);
#: their float32 / int64 temporaries (the top-p sort's values and indices, the cumulative sum, masks; a gathered copy
#: of the logits for works not side by side) peaked at 23–31 bytes per logit on a CPU (process RSS, V 150,000 and
#: 163,840, float32 and bfloat16 logits, top-k or not), and a GPU's radix sort adds its double buffers (~12 bytes
#: per logit): SAMPLING_BYTES, which the memory plan holds on GPU 0, allows 40.
SAMPLING_CHUNK = 1 << 22
SAMPLING_BYTES = 40 * SAMPLING_CHUNK


def bucket(batch: int) -> int:
    """The smallest batch bucket holding ``batch`` sequences (padded sequences write scratch rows): a power of two up to
    256, then a multiple of 256 (a bounded set of graphs whatever the batch sizes met)."""
    top = BATCH_BUCKETS[-1]
    return next(b for b in BATCH_BUCKETS if b >= batch) if batch <= top else -(-batch // top) * top


def buckets_upto(bp: int) -> list[int]:
    """Every batch bucket ≤ ``bp``: the batch sizes steady cycles capture graphs at (the memory plan counts them)."""
    top = BATCH_BUCKETS[-1]
    return [b for b in BATCH_BUCKETS if b <= bp] + list(range(2 * top, bp + 1, top))


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


def field_views(flat, shapes: tuple[tuple[int, ...], ...]) -> list:
    """Views of the fields of ``shapes`` laid out back to back (row-major, in order) in the flat buffer ``flat`` (a
    tensor or a numpy array): one buffer holds a static-shape forward's int64 inputs, so they go up in one copy."""
    out, at = [], 0
    for shape in shapes:
        size = math.prod(shape)
        out.append(flat[at:at + size].reshape(shape))
        at += size
    return out


def padded_fields(batch: int, n: int, window: int) -> tuple[tuple[int, ...], ...]:
    """Shapes of the padded form's positions [B, n], row table [B, S] and write rows [B, n] (:func:`fill_rows`)."""
    return (batch, n), (batch, window), (batch, n)


class RowFiller:
    """Fills the padded form's row table, positions and write rows (int64 numpy arrays, in place) for sequences whose KV
    blocks are ids below ``num_blocks``, in a few numpy operations per call: the table through one lookup [num_blocks + 1,
    block_size] (row j: the cache rows of block j; the last row, which block id −1 picks, all ``scratch_row``).
    Made once per engine (the lookup holds one int64 per KV row); :func:`fill_rows` is the one-off form."""

    def __init__(self, num_blocks: int, scratch_row: int, block_size: int = BLOCK_SIZE):
        self.block_size, self.scratch_row = block_size, scratch_row
        self.lookup = np.empty((num_blocks + 1, block_size), dtype=np.int64)
        self.lookup[:num_blocks] = np.arange(num_blocks * block_size, dtype=np.int64).reshape(num_blocks, block_size)
        self.lookup[num_blocks] = scratch_row
        self.batch_rows: dict[int, np.ndarray] = {}  # B -> 0 .. B − 1 (:meth:`arange`)

    def table(self, table: np.ndarray, blocks: list[list[int]]) -> None:
        """Row table [B, S]: sequence b's row s is the cache row of its position s (``scratch_row`` past its blocks);
        the rows past ``len(blocks)`` (padding sequences) all ``scratch_row``."""
        B, S = table.shape
        bs = self.block_size
        per = -(-S // bs)
        ids = []  # the first `per` blocks of each sequence, −1 past its blocks and for the padding sequences
        for bl in blocks:
            head = bl[:per]
            ids += head
            ids += [-1] * (per - len(head))
        ids += [-1] * (per * (B - len(blocks)))
        if per * bs == S:
            np.take(self.lookup, np.array(ids, dtype=np.int64).reshape(B, per), axis=0, out=table.reshape(B, per, bs))
        else:
            table[:] = self.lookup[np.array(ids, dtype=np.int64)].reshape(B, per * bs)[:, :S]

    def rows(self, pos: np.ndarray, write: np.ndarray, table: np.ndarray, starts: list[int]) -> None:
        """Positions [B, n] (``starts[b]``.. for the ``len(starts)`` real sequences, 0 for the padding ones) and write
        rows [B, n] (the table's rows at those positions) from a filled ``table`` [B, S].
        Raises ValueError when a sequence's tokens reach past the window S."""
        real, (B, n), S = len(starts), pos.shape, table.shape[1]
        if real and max(starts) + n > S:
            b = next(b for b, s in enumerate(starts) if s + n > S)
            raise ValueError(f"padded batch: sequence {b} brings {n} tokens at {starts[b]} (window {S})")
        if real:
            np.add(np.array(starts, dtype=np.int64)[:, None], self.arange(n), out=pos[:real])
        if real < B:
            pos[real:] = 0
        write[:] = table[self.arange(B)[:, None], pos]

    def arange(self, B: int) -> np.ndarray:
        """0 .. B − 1, int64 (kept per B: positions, the write rows' gather and the draft steps' logits rows)."""
        at = self.batch_rows.get(B)
        if at is None:
            at = self.batch_rows[B] = np.arange(B, dtype=np.int64)
        return at

    def __call__(self, pos: np.ndarray, table: np.ndarray, write: np.ndarray, blocks: list[list[int]],
                 starts: list[int]) -> None:
        """:meth:`table`, then :meth:`rows` for n = pos.shape[1] tokens per sequence from ``starts``."""
        self.table(table, blocks)
        self.rows(pos, write, table, starts)


def fill_rows(pos: np.ndarray, table: np.ndarray, write: np.ndarray, blocks: list[list[int]], starts: list[int],
              scratch_row: int, block_size: int = BLOCK_SIZE) -> None:
    """Fill the padded form's positions [B, n], row table [B, S] and write rows [B, n] (int64 arrays, in place) for
    ``len(blocks)`` ≤ B sequences, sequence b holding KV blocks ``blocks[b]`` and bringing n tokens at positions
    ``starts[b]``.. . Table rows hold the cache rows of positions 0..S−1 (``scratch_row`` past a sequence's blocks);
    the rows past the sequences pad the batch: positions 0, every table entry and write row ``scratch_row``.
    One-off form of :class:`RowFiller` (whose lookup it builds for the blocks given).
    Raises ValueError when a sequence's tokens reach past the window S."""
    per = -(-table.shape[1] // block_size)
    top = max((b for bl in blocks for b in bl[:per]), default=-1)
    RowFiller(top + 1, scratch_row, block_size)(pos, table, write, blocks, starts)


def padded(seqs: list[tuple[list[int], int, list[int]]], window: int, device="cpu", block_size: int = BLOCK_SIZE,
           scratch_row: int = 0, pad_to: int | None = None) -> ForwardBatch:
    """Padded form of a batch whose sequences all bring n tokens: (blocks, start, tokens) per sequence.

    ``window`` S: key positions visible per sequence (≥ every start + n). ``pad_to``: pad the batch with
    dummy sequences (token 0 at position 0, writing ``scratch_row``) to this many sequences.
    Logits are wanted for every row. The inputs go up in one copy (from pinned memory on CUDA: no host wait).
    """
    n = len(seqs[0][2])
    B = pad_to or len(seqs)
    for b, (_, start, toks) in enumerate(seqs):
        if len(toks) != n:
            raise ValueError(f"padded batch: sequence {b} brings {len(toks)} tokens at {start} (need {n}, window {window})")
    shapes = ((B, n), *padded_fields(B, n, window))
    flat = torch.empty(sum(math.prod(s) for s in shapes), dtype=torch.int64, pin_memory=str(device).startswith("cuda"))
    ids, pos, table, write = field_views(flat.numpy(), shapes)
    ids[:len(seqs)] = [toks for _, _, toks in seqs]
    ids[len(seqs):] = 0
    fill_rows(pos, table, write, [bl for bl, _, _ in seqs], [start for _, start, _ in seqs], scratch_row, block_size)
    ids, pos, table, write = field_views(flat.to(device, non_blocking=True), shapes)
    return ForwardBatch(ids.flatten(), pos.flatten(), [], [], torch.arange(B * n, device=device), table, write.flatten())


def single_blocks(slot: int, max_seq_len: int, block_size: int = BLOCK_SIZE) -> list[int]:
    """Blocks of a fixed region for sequence number ``slot`` (tests and one-off forwards)."""
    per = -(-max_seq_len // block_size)
    return list(range(slot * per, (slot + 1) * per))
