"""The engine loop's heartbeat file: written private, a change of state at once, and its staleness judged (or no
verdict when it is missing or unreadable)."""

from __future__ import annotations

import time

from splitspec.serving.heartbeat import Heartbeat, heartbeat_path, read, stall


def test_heartbeat_file_and_its_staleness(tmp_path):
    path = heartbeat_path(tmp_path, 1234)
    assert path.name == "engine.1234.heartbeat" and stall(path, 1.0) is None  # none yet: nothing to judge
    hb = Heartbeat(path, every_s=10.0)
    t, busy = read(path)
    assert not busy and abs(time.monotonic() - t) < 1.0 and path.stat().st_mode & 0o077 == 0
    assert stall(path, 1.0, now=t + 0.9) is None
    assert stall(path, 1.0, now=t + 2.5) == "its engine loop has not beaten, idle then, for 2.5 s (stall limit 1 s)"
    hb.beat(True)  # a change of state is written at once
    t1, busy = read(path)
    assert busy and t1 >= t
    hb.beat(True)  # the same state within every_s: not written again
    assert read(path) == (t1, True)
    assert stall(path, 60.0, now=t1 + 61) == "its engine loop has been in one cycle for 61.0 s (stall limit 60 s)"
    path.write_bytes(b"12.5 unknown\n")
    assert read(path) is None and stall(path, 1.0, now=1e9) is None  # unreadable: no verdict
    hb.close()
    assert not path.exists()
