"""The target's hidden states a rank keeps per sequence for the drafter's next extend (EAGLE-3's fused features)."""

from __future__ import annotations

import torch


class AuxStates:
    """Per sequence id, the target's aux hidden states [rows, 3·H] of its latest verified (or prefilled) tokens.

    A dict of tensors, plus the steady cycle's form: :meth:`keep_batch` keeps a whole verify's states [B_pad·n, 3·H]
    as one tensor, each sequence's n rows a slice of it made only when asked for, and :meth:`batch_for` hands that
    tensor back as it is when the next draft's sequences are the same ones in the same order, untouched since — no
    per-sequence view, copy or concatenation in a steady loop."""

    def __init__(self):
        self.own: dict[int, torch.Tensor] = {}
        self.whole: torch.Tensor | None = None  # the last verify's states, padding rows zero
        self.order: tuple[int, ...] = ()  # its sequences, row block b = sequence order[b]
        self.index: dict[int, int] = {}  # sid -> its row block in whole, for sids not replaced since
        self.n = 0

    def __contains__(self, sid: int) -> bool:
        return sid in self.own or sid in self.index

    def __getitem__(self, sid: int) -> torch.Tensor:
        if sid in self.own:
            return self.own[sid]
        b = self.index[sid]
        return self.whole[b * self.n:(b + 1) * self.n]

    def __setitem__(self, sid: int, rows: torch.Tensor) -> None:
        self.index.pop(sid, None)
        self.own[sid] = rows

    def pop(self, sid: int, default=None):
        rows = self[sid] if sid in self else default
        self.own.pop(sid, None)
        self.index.pop(sid, None)
        return rows

    def rows(self, sid: int) -> int:
        """How many rows ``sid`` holds (KeyError when none)."""
        if sid in self.own:
            return self.own[sid].shape[0]
        if sid in self.index:
            return self.n
        raise KeyError(sid)

    def keep_batch(self, sids: list[int], whole: torch.Tensor, n: int) -> None:
        """Keep ``whole`` [B_pad·n, 3·H]: sequence ``sids[b]``'s n rows at b·n.. (rows past len(sids)·n zero). A
        sequence of the batch kept before and not of this one keeps its rows (a slice of that batch's tensor)."""
        index = {sid: b for b, sid in enumerate(sids)}
        for sid in self.index.keys() - index.keys():
            self.own[sid] = self[sid]
        for sid in sids:
            self.own.pop(sid, None)
        self.whole, self.order, self.n, self.index = whole, tuple(sids), n, index

    def batch_for(self, sids: list[int], total: int, device: torch.device) -> torch.Tensor:
        """The states of ``sids`` concatenated on ``device`` and padded with zero rows to ``total`` rows: the kept
        batch itself when it is exactly that."""
        if self.whole is not None and self.whole.shape[0] == total and tuple(sids) == self.order and self.index.keys() >= set(sids):
            return self.whole.to(device)
        aux = torch.cat([self[sid] for sid in sids]).to(device)
        return torch.cat((aux, aux.new_zeros(total - aux.shape[0], aux.shape[1])))
