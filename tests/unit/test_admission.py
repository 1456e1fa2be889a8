"""The scheduler's admission queue on its own (no engine): first come first served with the head blocking, a batch
slot and the head's whole KV need required, cancelled sequences taken out, the queue's time limit."""

from __future__ import annotations

from splitspec.models.kv import BlockAllocator
from splitspec.runtime.admission import AdmissionQueue
from splitspec.runtime.sequence import Sequence
from splitspec.runtime.types import Request


def seq(sid: int, prompt: int, max_tokens: int = 4, k: int = 3) -> Sequence:
    """A sequence needing prompt + max_tokens + k + 1 KV tokens."""
    return Sequence(sid, Request(list(range(1, prompt + 1)), max_tokens), k, set(), None)


def test_admits_in_order_while_a_slot_and_the_heads_kv_are_free():
    q, alloc, running = AdmissionQueue(), BlockAllocator(4, block_size=16), []
    big, small, last = seq(0, 40), seq(1, 2), seq(2, 2)  # 48 tokens = 3 blocks; 10 tokens = 1 block
    for s in (big, small, last):
        q.put(s)
    q.admit(running, max_batch_size=2, alloc=alloc)
    assert running == [big, small] and len(q) == 1 and alloc.used == 4  # the batch is full: `last` waits
    assert len(big.blocks) == 3 and len(small.blocks) == 1 and big.stats.queue_ms >= 0
    running.clear()
    head = seq(3, 40)
    q2 = AdmissionQueue()
    for s in (head, seq(4, 2)):
        q2.put(s)
    q2.admit(running, max_batch_size=8, alloc=alloc)  # no free block: the head blocks the small one behind it
    assert running == [] and len(q2) == 2


def test_cancelled_are_taken_out_and_drain_empties():
    q = AdmissionQueue()
    a, b, c = seq(0, 2), seq(1, 2), seq(2, 2)
    for s in (a, b, c):
        q.put(s)
    b.cancelled = True
    assert q.take_cancelled() == [b] and len(q) == 2 and q.take_cancelled() == []
    assert q.drain() == [a, c] and len(q) == 0 and not q


def test_time_limit_ends_only_those_past_it():
    old, new = seq(0, 2), seq(1, 2)
    old.t_submit -= 5.0  # submitted five seconds ago
    q = AdmissionQueue(max_queue_s=2.5)
    q.put(old)
    q.put(new)
    (gone, message), = q.expired()
    assert gone is old and len(q) == 1
    assert message.startswith("server busy: waited 5.0 s for a batch slot, at most max_queue_s = 2.5 s")
    unlimited = AdmissionQueue()
    unlimited.put(old)
    assert unlimited.expired() == [] and len(unlimited) == 1
