"""models.batch.RowFiller: the steady phases' row tables, positions and write rows, against an element-by-element
reference (padding sequences, windows that do not end on a block, short block lists), and its refusal."""

from __future__ import annotations

import random

import numpy as np
import pytest

from splitspec.models.batch import RowFiller, fill_rows


def reference(B: int, n: int, S: int, blocks, starts, scratch: int, bs: int):
    table = np.full((B, S), scratch, dtype=np.int64)
    for b, bl in enumerate(blocks):
        for s in range(min(S, len(bl) * bs)):
            table[b, s] = bl[s // bs] * bs + s % bs
    pos = np.zeros((B, n), dtype=np.int64)
    for b, s in enumerate(starts):
        pos[b] = range(s, s + n)
    return pos, table, table[np.arange(B)[:, None], pos]


def test_fills_what_the_reference_fills():
    rng = random.Random(0)
    filler = RowFiller(64, 9999, 4)
    for _ in range(200):
        real = rng.randint(0, 4)
        B, n, S = real + rng.randint(0, 3) or 1, rng.randint(1, 5), rng.choice([8, 10, 24])
        blocks = [rng.sample(range(64), rng.randint(0, 8)) for _ in range(real)]
        starts = [rng.randint(0, S - n) for _ in range(real)]
        want = reference(B, n, S, blocks, starts, 9999, 4)
        for fill in (filler, lambda *a: fill_rows(*a, 9999, 4)):
            got = [np.full((B, n), -7), np.full((B, S), -7), np.full((B, n), -7)]
            fill(got[0], got[1], got[2], blocks, starts)
            assert all(np.array_equal(g, w) for g, w in zip(got, want)), (blocks, starts, S)
    steps, rows = np.full((3, 2), -7), np.full((3, 2), -7)  # transposed views, as the draft's step fields lie
    table = np.full((2, 8), -7)
    filler.table(table, [[5, 6]])
    filler.rows(steps.T, rows.T, table, [3])
    assert steps.T.tolist() == [[3, 4, 5], [0, 0, 0]] and rows.T.tolist() == [[23, 24, 25], [9999] * 3]


def test_refuses_tokens_past_the_window():
    with pytest.raises(ValueError, match="sequence 1 brings 3 tokens at 7 \\(window 8\\)"):
        RowFiller(8, 99, 4)(np.zeros((2, 3), np.int64), np.zeros((2, 8), np.int64), np.zeros((2, 3), np.int64),
                            [[0, 1], [2, 3]], [0, 7])
