"""The scheduler's admission queue: requests waiting, in arrival order, for a batch slot and KV blocks, and the
queue's time limit (``max_queue_s``, docs/serving.md "Limits and admission").

:class:`~splitspec.runtime.scheduler.SpeculativeEngine` puts every accepted request here (:meth:`AdmissionQueue.put`,
from any thread) and, between cycles on its stepping thread, takes out the cancelled ones, admits from the head
while a slot is free and the head's KV need fits, and ends those that waited longer than the limit.
"""

from __future__ import annotations

import collections
import threading
import time

from splitspec.models.kv import BlockAllocator
from splitspec.runtime.sequence import Sequence


class AdmissionQueue:
    """Sequences waiting for admission, first come first served (the head blocks the rest: no overtaking).

    ``max_queue_s``: a sequence queued longer than this many seconds is taken off by :meth:`expired` (None: no
    limit). Every method is thread-safe.
    """

    def __init__(self, max_queue_s: float | None = None):
        self.max_queue_s = max_queue_s
        self._waiting: collections.deque[Sequence] = collections.deque()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._waiting)

    def put(self, seq: Sequence) -> None:
        """Queue ``seq`` at the tail."""
        with self._lock:
            self._waiting.append(seq)

    def take_cancelled(self) -> list[Sequence]:
        """Take the cancelled sequences off the queue, in queue order; return them."""
        with self._lock:
            gone = [s for s in self._waiting if s.cancelled]
            for s in gone:
                self._waiting.remove(s)
        return gone

    def admit(self, running: list[Sequence], max_batch_size: int, alloc: BlockAllocator) -> None:
        """Move sequences from the head into ``running`` while it holds fewer than ``max_batch_size`` and ``alloc``
        can give the head its whole KV need (:meth:`Sequence.need_tokens`); each gets its blocks and its
        ``stats.queue_ms`` (ms since submission)."""
        with self._lock:
            while self._waiting and len(running) < max_batch_size and alloc.can_allocate(self._waiting[0].need_tokens()):
                seq = self._waiting.popleft()
                seq.blocks = alloc.allocate(seq.need_tokens())
                seq.stats.queue_ms = (time.perf_counter() - seq.t_submit) * 1e3
                running.append(seq)

    def expired(self) -> list[tuple[Sequence, str]]:
        """(sequence, "server busy" message) of those queued longer than ``max_queue_s``, taken off the queue."""
        limit, now = self.max_queue_s, time.perf_counter()
        if limit is None:
            return []
        with self._lock:
            old = [(s, now - s.t_submit) for s in self._waiting if now - s.t_submit > limit]
            for s, _ in old:
                self._waiting.remove(s)
        return [(s, f"server busy: waited {wait:.1f} s for a batch slot, at most max_queue_s = {limit:g} s; retry later")
                for s, wait in old]

    def drain(self) -> list[Sequence]:
        """Take every sequence off the queue; return them in queue order."""
        with self._lock:
            seqs, self._waiting = list(self._waiting), collections.deque()
        return seqs
