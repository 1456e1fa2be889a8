"""The rate-limited log, on a clock of the test's own: one line a second per key, a line of another key never
swallowed, what was left out said on the key's next line or by a flush, and its keys bounded."""

from __future__ import annotations

import pytest

from splitspec.serving import rate_limited_log
from splitspec.serving.rate_limited_log import RateLimitedLog


@pytest.fixture
def clock(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(rate_limited_log.time, "monotonic", lambda: now[0])
    return now


def test_each_key_is_limited_on_its_own_and_says_what_it_left_out(clock):
    lines: list[str] = []
    log = RateLimitedLog(lines.append, every_s=1.0)
    for _ in range(3):
        log.say("a flood")
    log.say("another line")  # not swallowed by the flood
    log.say("bad chunk from 10.0.0.1", key="bad chunk")
    log.say("bad chunk from 10.0.0.2", key="bad chunk")
    assert lines == ["a flood", "another line", "bad chunk from 10.0.0.1"]
    clock[0] += 1.0
    log.say("bad chunk from 10.0.0.3", key="bad chunk")
    log.say("a flood")
    log.say("another line")
    assert lines[3:] == ["bad chunk from 10.0.0.3 (1 more since the last line)",
                         "a flood (2 more since the last line)", "another line"]


def test_keys_are_bounded_and_lines_past_them_counted(clock):
    lines: list[str] = []
    log = RateLimitedLog(lines.append, every_s=1.0, max_keys=2)
    for k in "abcd":  # c and d find both keys within their second: left out, counted
        log.say(k)
    log.say("a")
    assert lines == ["a", "b"] and len(log.keys) == 2 and log.left_out == 2
    clock[0] += 1.0
    log.say("c")  # replaces a, the oldest, whose one line left out becomes "other"
    assert lines[2:] == ["c (3 other lines left out)"] and list(log.keys) == ["b", "c"] and log.left_out == 0
    log.say("d")  # replaces b, whose second is over too
    log.say("e")  # c and d within their second: no room
    assert lines[3:] == ["d"] and list(log.keys) == ["c", "d"] and log.left_out == 1


def test_a_flush_says_what_a_burst_left_out(clock):
    """A burst's count waited for its key's next line: with none, it was never said."""
    lines: list[str] = []
    log = RateLimitedLog(lines.append, every_s=1.0, max_keys=2)
    for i in range(5):
        log.say(f"bad chunk from 10.0.0.{i}", key="bad chunk")
    log.say("once")
    log.flush()
    assert lines == ["bad chunk from 10.0.0.0", "once", "bad chunk from 10.0.0.4 (3 more since the last line)"]
    log.flush()  # nothing left out since
    log.say("bad chunk from 10.0.0.5", key="bad chunk")  # a flushed line counts as written: within its second
    assert lines[3:] == []
    clock[0] += 1.0
    log.say("bad chunk from 10.0.0.6", key="bad chunk")
    assert lines[3:] == ["bad chunk from 10.0.0.6 (1 more since the last line)"]
    for k in "xyz":  # x takes the key "once" had; then no key is free: y and z left out as "other"
        log.say(k)
    log.flush()
    assert lines[4:] == ["x", "z (1 other lines left out)"] and log.left_out == 0
