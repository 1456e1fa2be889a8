"""Naming the pipeline's processes from /proc: roles from command lines, a dead process told from a live one and from a
reused pid, the children of a process found by role."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from splitspec.serving.process_tree import Watched, pipeline_processes, role_of


@pytest.mark.parametrize("cmdline, role", [
    ("/r/_backends/python/triton_python_backend_stub /r/spec_decode/1/model.py splitspec_1_2_x 1048576 1048576 9 "
     "/r/_backends/python 336 spec_decode_0_0 DEFAULT", "spec_decode stub"),
    ("/r/_backends/python/triton_python_backend_stub /r/post processing/1/model.py", None),  # not a model folder name
    ("/v/bin/python3 -m splitspec.serving.engine_process_main --fd 5", "engine process"),
    ("/v/bin/python3 -m splitspec.engine.worker --engines /e --rank 3 --world 4", "target worker rank 3"),
    ("/site-packages/pytriton/tritonserver/bin/tritonserver --model-repository /r", "tritonserver"),
    ("/usr/bin/python3 -m pytest", None),
])
def test_roles_from_command_lines(cmdline, role):
    assert role_of(cmdline) == role


def test_a_dead_process_is_told_from_a_live_one_and_from_a_reused_pid():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        w = Watched.of(child.pid, "engine process")
        assert w is not None and w.alive() and str(w) == f"the engine process (pid {child.pid})"
        assert not Watched(child.pid, "engine process", "1").alive()  # same pid, another start time: not ours
        child.kill()
        child.wait()
        assert not w.alive()
    finally:
        child.kill()


def test_pipeline_processes_names_the_children_it_knows():
    code = "import subprocess, sys, time; subprocess.Popen(sys.argv[1:]); time.sleep(60)"
    parent = subprocess.Popen([sys.executable, "-c", code, sys.executable, "-c", "import time; time.sleep(60)",
                               "splitspec.serving.engine_process_main"])
    try:
        for _ in range(100):
            found = pipeline_processes(parent.pid)
            if found:
                break
            time.sleep(0.05)
        assert list(found.values()) == ["engine process"], found
    finally:
        for pid in pipeline_processes(parent.pid):
            subprocess.run(["kill", "-9", str(pid)])
        parent.kill()
