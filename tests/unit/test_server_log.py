"""Reading tritonserver's log (splitspec.serving.server_log) and what TritonServer.stop does with it: the exit
timeout's give-up line, and spec_decode unloading itself after an engine failure (a SIGINT in that window makes
tritonserver keep the ensemble live through its exit timeout and exit 1)."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

from splitspec.serving import tritonserver
from splitspec.serving.server_log import SELF_UNLOAD, UNLOADED, LogWatch, unloading

FAILED = (f"E1204 21:40:55.327670 1024 model.py:304] \"{SELF_UNLOAD} target worker rank 1 (pid 1154) exited with "
          "status -9; failing 1 open request(s) and unloading the model\"\n")
DONE = f"I1204 21:40:58.983411 1024 model_lifecycle.cc:624] \"{UNLOADED} version 1\"\n"


def test_unloading_is_said_from_the_failure_until_the_unload(tmp_path):
    log = tmp_path / "tritonserver.log"
    assert not unloading(log)  # no log yet
    log.write_text("I1204 started\n")
    assert not unloading(log)
    with log.open("a") as f:
        f.write(FAILED)
    assert unloading(log)
    with log.open("a") as f:
        f.write(DONE)
    assert not unloading(log)
    with log.open("a") as f:  # loaded again by hand, then failed again
        f.write("I1204 successfully loaded 'spec_decode' version 1\n" + FAILED)
    assert unloading(log)


def test_logwatch_sees_a_line_cut_between_two_reads(tmp_path):
    log = tmp_path / "tritonserver.log"
    log.write_text("before\n")
    watch = LogWatch(log)
    with log.open("a") as f:
        f.write("failed to stop server: Internal - Exit timeout ex")
    assert not watch.says("Exit timeout expired.")
    with log.open("a") as f:
        f.write("pired. Exiting immediately.\n")
    assert watch.says("Exit timeout expired.")
    watch.close()


def test_stop_waits_for_spec_decodes_own_unload_before_the_sigint(tmp_path, monkeypatch):
    """A server whose log says spec_decode is unloading itself gets its SIGINT only once the log says it unloaded."""
    monkeypatch.setattr(tritonserver, "check_repo", lambda repo: tmp_path)
    srv = tritonserver.TritonServer(tmp_path, log_path=tmp_path / "tritonserver.log", exit_timeout_s=10, guard=False)
    srv.log_path.write_text("I1204 started\n" + FAILED)
    got = tmp_path / "sigint_at"
    script = ("import signal, sys, time\n"
              f"def stop(*_):\n    open({str(got)!r}, 'w').write(repr(time.time())); sys.exit(0)\n"
              "signal.signal(signal.SIGINT, stop)\nprint('up', flush=True)\ntime.sleep(60)\n")
    srv.proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, start_new_session=True)
    assert srv.proc.stdout.readline() == b"up\n"  # its handler is in place

    def unload_later():
        time.sleep(0.6)
        unloaded_at.append(time.time())
        with srv.log_path.open("a") as f:
            f.write(DONE)

    unloaded_at: list[float] = []
    t = threading.Thread(target=unload_later)
    t.start()
    assert srv.stop() == 0
    t.join()
    assert float(got.read_text()) >= unloaded_at[0]
