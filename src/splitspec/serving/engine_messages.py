"""The messages between the engine process and its host (:mod:`splitspec.serving.engine_process`): engine events
and cycle statistics as tuples of plain values (cheap to pickle once per cycle), and :class:`CycleMessages`, the rule
for when a cycle's events are sent."""

from __future__ import annotations

import dataclasses
import threading

from splitspec.runtime.types import CycleStats, RequestOutput, RequestStats

_REQUEST_STATS = tuple(f.name for f in dataclasses.fields(RequestStats))
_CYCLE_STATS = tuple(f.name for f in dataclasses.fields(CycleStats))


def pack_event(sid: int, ev: RequestOutput, finishing: bool) -> tuple:
    """An engine event as a tuple of plain values, for the cycle message (undone by :func:`unpack_event`):
    ``(sid, request_id, token_ids, text, finished, finish_reason, stats, error, finishing)``, ``stats`` the tuple
    of the :class:`RequestStats` fields in declaration order, or None."""
    stats = None if ev.stats is None else tuple(getattr(ev.stats, f) for f in _REQUEST_STATS)
    return sid, ev.request_id, ev.token_ids, ev.text, ev.finished, ev.finish_reason, stats, ev.error, finishing


def unpack_event(t: tuple) -> tuple[int, RequestOutput, bool]:
    """``(sid, RequestOutput, finishing)`` from a tuple of :func:`pack_event`."""
    sid, rid, ids, text, finished, reason, stats, error, finishing = t
    return sid, RequestOutput(rid, ids, text, finished, reason, None if stats is None else RequestStats(*stats), error), finishing


def pack_cycle_stats(cs: CycleStats | None) -> tuple | None:
    """A :class:`CycleStats` as the tuple of its fields (:func:`unpack_cycle_stats` undoes it)."""
    return None if cs is None else tuple(getattr(cs, f) for f in _CYCLE_STATS)


def unpack_cycle_stats(t: tuple | None) -> CycleStats | None:
    """The :class:`CycleStats` of a :func:`pack_cycle_stats` tuple."""
    return None if t is None else CycleStats(*t)


class CycleMessages:
    """What the engine process sends after its cycles, and when: the events (:func:`pack_event` tuples) and cycle
    statistics (:func:`pack_cycle_stats`) collected since the last message, handed over by :meth:`take` and the two
    hooks below, which say whether they go now. Thread-safe.

    Without ``overlap`` everything goes after every step. With it (on GPUs) a step's events may wait until the next
    step has queued its GPU work (:meth:`launched`), so the message is written while the GPU computes instead of
    between two cycles: they wait only if the step queued GPU work, the engine has more work (so a next step will
    launch), and every one of them is a delta of a request whose first event has gone and whose last has not come.
    A request's first event (time to first token) and its last (end of the request) are never held back.
    """

    def __init__(self, overlap: bool):
        self.overlap = overlap
        self._lock = threading.Lock()
        self._events: list[tuple] = []
        self._stats: tuple | None = None
        self._started: set[int] = set()  # sids with an event sent and more to come
        self._launched = False  # the running step queued a cycle's GPU work

    def add(self, event: tuple) -> None:
        """Collect one :func:`pack_event` tuple."""
        with self._lock:
            self._events.append(event)

    def set_stats(self, stats: tuple | None) -> None:
        """The statistics of the step's cycle (a :func:`pack_cycle_stats` tuple)."""
        with self._lock:
            self._stats = stats

    def take(self) -> tuple[list[tuple], tuple | None] | None:
        """``(events, stats)`` collected so far, now sent, or None when there is nothing to send."""
        with self._lock:
            events, stats = self._events, self._stats
            self._events, self._stats = [], None
            for t in events:  # t[4]: finished, t[8]: finishing (its final event follows in this message)
                (self._started.discard if t[4] or t[8] else self._started.add)(t[0])
        return (events, stats) if events or stats is not None else None

    def launched(self) -> tuple[list[tuple], tuple | None] | None:
        """A step has queued its cycle's GPU work: what waited goes now (:meth:`take`)."""
        self._launched = True
        return self.take()

    def after_step(self, more_work: bool) -> tuple[list[tuple], tuple | None] | None:
        """A step ended (``more_work``: the engine has requests left): :meth:`take`, or None to let its events wait for
        the next step's :meth:`launched`."""
        ran, self._launched = self._launched, False
        with self._lock:
            can_wait = all(not t[4] and not t[8] and t[0] in self._started for t in self._events)
        if self.overlap and ran and can_wait and more_work:
            return None
        return self.take()
