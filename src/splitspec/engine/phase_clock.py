"""How long a cycle's draft and verify phases took, without waiting for the GPU between them."""

from __future__ import annotations

import time

import torch

from splitspec.engine.graphs import current_stream
from splitspec.models.fused_moe import device_index


class PhaseClock:
    """Splits a steady cycle's wall time (ms) into its draft part and its verify part without waiting for the GPU
    in between: on CUDA the phases' ends are CUDA events recorded on the device's current stream, read after the
    cycle's one device-to-host copy (when they have completed); on the CPU host clocks.

    A cycle that drafts itself: ``draft_ms`` from :meth:`start` (on CUDA: when the device reached the start event,
    right away when idle) to :meth:`draft_done`; ``verify_ms`` the rest of the wall time up to :meth:`split` — with a
    TP1 drafter in a group, sending the plan and the drafts to the workers too. GPU work queued before :meth:`start`
    and not waited for (a placement switch's scatter or gather) delays the start event, so it counts as verify time;
    on the CPU the host time of a draft this cycle launches ahead does not.

    A cycle whose drafts were launched ahead, by the cycle before (:meth:`ahead_start` / :meth:`ahead_done` there,
    :meth:`start` with ``ahead`` here): ``draft_ms`` is that launch's time on the GPU's clock (its two events, on the
    drafter's device), and ``verify_ms`` this cycle's from :meth:`start` to :meth:`verify_done` — on the GPU's clock too
    on CUDA, so a cycle's wall time less the two is what the GPU waited for the host; on the CPU the host time of this
    cycle less that of the draft it launches ahead."""

    def __init__(self, device: str):
        self.device, self.cuda = device, device.startswith("cuda")
        self.index = device_index(device) if self.cuda else None
        self.events = self._pair(self.index) if self.cuda else ()
        self.t0 = self.t1 = 0.0
        self.ahead: tuple | None = None  # the draft launched ahead in this cycle: (events or host ms, its device)
        self.taken: tuple | None = None  # the one this cycle verifies, launched by the cycle before
        self.spare: dict[int, tuple] = {}  # a free event pair per drafter device (two alternate: launched, taken)
        self.ahead_ms = 0.0

    @staticmethod
    def _pair(index: int) -> tuple:
        with torch.cuda.device(index):
            return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def start(self, ahead: bool = False) -> None:
        """A cycle begins; ``ahead``: its drafts are the ones the cycle before launched (:meth:`ahead_done`)."""
        self.t0 = self.t1 = time.perf_counter()
        self.taken, self.ahead, self.ahead_ms = (self.ahead if ahead else None), None, 0.0
        if self.cuda:
            self.events[0].record(current_stream(self.index))

    def draft_done(self) -> None:
        if self.cuda:
            self.events[1].record(current_stream(self.index))
        else:
            self.t1 = time.perf_counter()

    verify_done = draft_done  # an ahead cycle's second mark: its verify's end

    def ahead_start(self, device: str) -> None:
        """The next cycle's draft is being launched now, on ``device`` (the drafter's)."""
        self.t_ahead = time.perf_counter()
        if device.startswith("cuda"):
            index = device_index(device)
            old = self.taken[0] if self.taken and self.taken[1] == index else None
            pair = self.spare.get(index) or self._pair(index)
            self.spare[index] = old if old is not None else self._pair(index)
            pair[0].record(current_stream(index))
            self.ahead = (pair, index)
        else:
            self.ahead = (None, None)

    def ahead_done(self) -> None:
        pair, index = self.ahead
        if pair is not None:
            pair[1].record(current_stream(index))
        else:
            self.ahead_ms = (time.perf_counter() - self.t_ahead) * 1e3
            self.ahead = (self.ahead_ms, None)

    def split(self) -> tuple[float, float]:
        """(draft_ms, verify_ms); call after the host has waited for the work recorded since :meth:`start`."""
        total = (time.perf_counter() - self.t0) * 1e3
        if self.taken is not None:
            pair, _ = self.taken
            if isinstance(pair, tuple):
                return pair[0].elapsed_time(pair[1]), self.events[0].elapsed_time(self.events[1])
            return pair, max(0.0, total - self.ahead_ms)
        draft = self.events[0].elapsed_time(self.events[1]) if self.cuda else (self.t1 - self.t0) * 1e3
        return draft, max(0.0, total - draft - self.ahead_ms)
