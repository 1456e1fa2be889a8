"""Security basics of the served pipeline: what a client can reach, where processes listen, who can read what
the server writes, and what a killed server leaves behind.

* The control APIs (model repository: load/unload/index; system and CUDA shared memory; logging; trace) are
  refused over HTTP and gRPC unless the operator set an admin key (``splitspec serve --admin-key``): a client
  can neither load a model with its own ``model.py`` (code run by the server) nor unload the ensemble, nor make
  the server read or write a shared-memory region by name.
* Every listening socket of the server's processes (tritonserver, the Python stubs, the engine process and its
  worker, whose TCPStore and gloo sockets are the engine's rendezvous) is on the loopback interface.
* The Python backend's ``/dev/shm`` regions (they hold request text) are readable by the server's user only, from
  their creation on (watched while the server starts), and so are its log and run folder; none is left once the
  server is stopped, even after tritonserver itself was killed with SIGKILL.

The default-refusal tests use the session's shared server (tests/conftest.py); the others share one server of
this module, started with an admin key, which the last test kills.
"""

from __future__ import annotations

import base64
import datetime
import json
import os
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import requests

from splitspec.serving.client import ask_grpc, ask_http
from splitspec.serving.repo import render_repo
from splitspec.engine.group import loopback_store
from splitspec.errors import ConfigError
from splitspec.serving.access import (ADMIN_HEADER, NO_KEY_HEADER, admin_headers, check_admin_key,
                                      make_stub_region_private)
from splitspec.serving.seccomp import private_fchmod
from splitspec.serving.tritonserver import TritonServer
from splitspec.settings import ServeConfig

pytestmark = [pytest.mark.server, pytest.mark.timeout(300)]

CLOSE = {"Connection": "close"}
ADMIN_KEY = "test-admin-key-0123456789abcdef"
PROMPT = "def fibonacci(n):"
#: A model's config and code as a client would upload them with a repository ``load`` request (Triton's model
#: repository extension: ``parameters`` ``config`` and ``file:<version>/<name>`` base64).
EVIL_CONFIG = {"backend": "python", "max_batch_size": 0,
               "input": [{"name": "X", "data_type": "TYPE_INT32", "dims": [1]}],
               "output": [{"name": "Y", "data_type": "TYPE_INT32", "dims": [1]}]}
EVIL_CODE = """
class TritonPythonModel:
    def initialize(self, args):
        open({marker!r}, "w").write("ran")
    def execute(self, requests):
        return []
"""


def _session() -> requests.Session:
    s = requests.Session()
    s.trust_env = False
    return s


def _shm_regions(prefix: str) -> list[Path]:
    return sorted(Path("/dev/shm").glob(f"{prefix}*"))


def _listening_sockets(pgid: int) -> dict[str, list[int]]:
    """``{"address:port": [pid, ...]}`` of every listening TCP socket (IPv4 and IPv6) held by a process of
    the process group ``pgid`` (tritonserver runs in its own group with every process it starts), from /proc:
    a process's socket inodes (``/proc/<pid>/fd`` links ``socket:[inode]``) matched to the LISTEN rows
    (state ``0A``) of ``/proc/net/tcp`` and ``tcp6``."""
    inodes: dict[str, list[int]] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            if int((d / "stat").read_text().rsplit(")", 1)[1].split()[2]) != pgid:
                continue
            fds = list((d / "fd").iterdir())
        except (OSError, IndexError, ValueError):
            continue
        for fd in fds:
            try:
                link = os.readlink(fd)
            except OSError:  # closed meanwhile (such as the one that listed the folder)
                continue
            if link.startswith("socket:["):
                inodes.setdefault(link[8:-1], []).append(int(d.name))
    out: dict[str, list[int]] = {}
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        for row in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            f = row.split()
            if f[3] != "0A" or f[9] not in inodes:
                continue
            addr_hex, port_hex = f[1].split(":")
            raw = bytes.fromhex(addr_hex)  # 32-bit words in host (little-endian) order
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
            out[f"{socket.inet_ntop(family, raw)}:{int(port_hex, 16)}"] = inodes[f[9]]
    return out


def _is_loopback(address: str) -> bool:
    host = address.rsplit(":", 1)[0]
    return host.startswith("127.") or host in ("::1", "::ffff:127.0.0.1") or host.startswith("::ffff:127.")


# ---------------------------------------------------------------------------------------------
# Without a server
# ---------------------------------------------------------------------------------------------


def test_the_engine_store_listens_on_loopback_only():
    """The leader's TCPStore (the TP group's rendezvous): bound to 127.0.0.1, not ``*:port``, and reachable there."""
    import torch.distributed as dist

    store = loopback_store(2, datetime.timedelta(seconds=10))
    listening = [a for a, pids in _listening_sockets(os.getpgid(0)).items()
                 if os.getpid() in pids and a.endswith(f":{store.port}")]
    assert listening and all(_is_loopback(a) for a in listening), listening
    client = dist.TCPStore("127.0.0.1", store.port, 2, is_master=False, timeout=datetime.timedelta(seconds=10))
    client.set("up/1", "1")
    assert store.get("up/1") == b"1"


@pytest.mark.parametrize("key", ["short", "a" * 15 + "=", "key with spaces in it", "ключ" * 5])
def test_an_unusable_admin_key_is_refused_in_one_line(key):
    with pytest.raises(ConfigError, match=r"^--admin-key: expected 16 or more characters") as e:
        check_admin_key(key)
    assert "\n" not in str(e.value) and key not in str(e.value)
    assert check_admin_key(ADMIN_KEY) == ADMIN_KEY


def test_a_stub_makes_the_region_on_its_command_line_private(tmp_path):
    """A stub's command line (``triton_python_backend_stub <model.py> <region> <sizes> ...``): its region, created
    0644 by the backend, becomes 0600; arguments that name no region (or a path) are left alone."""
    shm = tmp_path / "shm"
    shm.mkdir()
    region, other = shm / "splitspec_1_2_abc", shm / "splitspec_1_2_other"
    for f in (region, other):
        f.write_bytes(b"prompt")
        f.chmod(0o644)
    cmdline = tmp_path / "cmdline"
    cmdline.write_bytes(b"\0".join([b"/x/triton_python_backend_stub", b"/repo/m/1/model.py", region.name.encode(),
                                      b"1048576", str(shm).encode(), b"m_0_0", b""]))
    assert make_stub_region_private(cmdline, shm) == [region]
    assert stat.S_IMODE(region.stat().st_mode) == 0o600 and stat.S_IMODE(other.stat().st_mode) == 0o644
    assert make_stub_region_private(tmp_path / "missing", shm) == []


FCHMODS = """
import os, stat, sys
path = sys.argv[1]
fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o666)
modes = [stat.S_IMODE(os.fstat(fd).st_mode)]
for mode in (0o644, 0o640, 0o700, 0o755, 0o600):
    os.fchmod(fd, mode)
    modes.append(stat.S_IMODE(os.fstat(fd).st_mode))
os.chmod(path, 0o644)  # by path (fchmodat): not filtered
modes.append(stat.S_IMODE(os.fstat(fd).st_mode))
print(" ".join(oct(m) for m in modes))
"""


@pytest.mark.skipif(private_fchmod() is None, reason="seccomp filter: x86-64 and AArch64 only")
def test_the_server_filter_keeps_fchmod_from_opening_a_data_file_to_others(tmp_path):
    """What the Python backend does to each region it creates (fchmod 0644 after shm_open) changes nothing under the
    filter tritonserver starts with; a private or executable mode, and chmod by path, still apply."""
    run = [sys.executable, "-c", FCHMODS]
    plain = subprocess.run(run + [str(tmp_path / "a")], umask=0o077, capture_output=True, text=True, check=True)
    filtered = subprocess.run(run + [str(tmp_path / "b")], umask=0o077, preexec_fn=private_fchmod(),
                              capture_output=True, text=True, check=True)
    assert plain.stdout.split() == ["0o600", "0o644", "0o640", "0o700", "0o755", "0o600", "0o644"]
    assert filtered.stdout.split() == ["0o600", "0o600", "0o600", "0o700", "0o755", "0o600", "0o644"]


# ---------------------------------------------------------------------------------------------
# The session's shared server: no admin key
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def server(shared_server):
    return shared_server.get()


def test_http_control_api_is_refused_without_an_admin_key(server, tmp_path):
    """A repository load with an uploaded model.py (code the server would run), an unload of the ensemble, and
    system / CUDA shared-memory registration are all refused (403) and change nothing: the ensemble still serves."""
    marker = tmp_path / "model_ran"
    body = {"parameters": {"config": json.dumps(EVIL_CONFIG),
                           "file:1/model.py": base64.b64encode(EVIL_CODE.format(marker=str(marker)).encode()).decode()}}
    u = server.http_url
    with _session() as s:
        calls = [("POST", "/v2/repository/models/evil/load", body),
                 ("POST", "/v2/repository/models/ensemble/unload", {"parameters": {"unload_dependents": True}}),
                 ("POST", "/v2/repository/index", {}),
                 ("POST", "/v2/systemsharedmemory/region/peek/register", {"key": "/peek", "offset": 0, "byte_size": 64}),
                 ("GET", "/v2/systemsharedmemory/status", None),
                 ("POST", "/v2/cudasharedmemory/region/peek/register",
                  {"raw_handle": {"b64": "AAAA"}, "device_id": 0, "byte_size": 64}),
                 ("POST", "/v2/logging", {"log_verbose_level": 1}),
                 ("POST", "/v2/trace/setting", {"trace_level": ["TENSORS"]})]
        got = {path: s.request(method, u + path, json=payload, headers=CLOSE, timeout=30) for method, path, payload in calls}
        refused = {p: r.status_code for p, r in got.items() if r.status_code != 403 or "restricted" not in r.text}
        assert not refused, {p: (got[p].status_code, got[p].text[:200]) for p in refused}
        # the answer says how to open them (it named a header 'splitspec-admin-key:unset', like a placeholder)
        assert got["/v2/repository/index"].json() == {"error": f"This API is restricted, expecting header '{NO_KEY_HEADER}'"}
        assert "start splitspec serve with --admin-key" in NO_KEY_HEADER
        assert not marker.exists(), "the uploaded model.py ran"
        assert s.get(f"{u}/v2/models/ensemble/ready", headers=CLOSE, timeout=10).status_code == 200
        assert s.get(f"{u}/v2/models/evil/ready", headers=CLOSE, timeout=10).status_code != 200
        # what stays open: health, metadata, config, statistics, inference
        for path in ("/v2/health/ready", "/v2/models/ensemble", "/v2/models/ensemble/config", "/v2/models/ensemble/stats"):
            assert s.get(u + path, headers=CLOSE, timeout=10).status_code == 200, path
    assert ask_http(server.generate_url, PROMPT, max_tokens=4)["text_output"]


def test_grpc_control_api_is_refused_without_an_admin_key(server, tmp_path):
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    marker = tmp_path / "model_ran"
    client = grpcclient.InferenceServerClient(server.grpc_address)
    calls = {
        "load": lambda: client.load_model("evil", config=json.dumps(EVIL_CONFIG),
                                          files={"file:1/model.py": EVIL_CODE.format(marker=str(marker)).encode()}),
        "unload": lambda: client.unload_model("ensemble", unload_dependents=True),
        "index": lambda: client.get_model_repository_index(),
        "system_shm": lambda: client.register_system_shared_memory("peek", "/peek", 64),
        "cuda_shm": lambda: client.register_cuda_shared_memory("peek", b"AAAA", 0, 64),
        "log_settings": lambda: client.update_log_settings({"log_verbose_level": 1}),
        "trace_settings": lambda: client.update_trace_settings(settings={"trace_level": ["TENSORS"]}),
    }
    answered = {}
    for name, call in calls.items():
        try:
            call()
            answered[name] = "accepted"
        except InferenceServerException as e:
            if "restricted" not in (e.message() or "") or "--admin-key" not in e.message():
                answered[name] = e.message()
    try:
        assert not answered, answered
        assert not marker.exists(), "the uploaded model.py ran"
        assert client.is_model_ready("ensemble")
    finally:
        client.close()
    assert ask_grpc(server.grpc_address, PROMPT, max_tokens=4, stream=True)["text_output"]


# ---------------------------------------------------------------------------------------------
# This module's server: started with an admin key; the last test kills it
# ---------------------------------------------------------------------------------------------


class _ModesWatch:
    """Polls, from a thread, the modes of what a starting server creates for itself: its ``/dev/shm`` regions, its run
    folder and what is in it, its log. ``seen``: path → the modes seen."""

    def __init__(self, srv: TritonServer):
        self.srv, self.seen, self._stop = srv, {}, threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while not self._stop.is_set():
            run_dir = self.srv.run_dir
            found = [*_shm_regions(self.srv.shm_prefix), self.srv.log_path]
            if run_dir is not None:
                found += [run_dir, *run_dir.glob("*")]
            for path in found:
                try:
                    self.seen.setdefault(path, set()).add(stat.S_IMODE(path.stat().st_mode))
                except OSError:  # not there yet, or gone
                    pass
            time.sleep(0.002)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


@pytest.fixture(scope="module")
def keyed(built_engines, tmp_path_factory):
    cfg = ServeConfig(built_engines, num_draft_tokens=4, max_batch_size=4)
    repo = render_repo(cfg, tmp_path_factory.mktemp("secure") / "repo")
    srv = TritonServer(repo, exit_timeout_s=5, startup_timeout_s=300, admin_key=ADMIN_KEY)
    srv.modes_at_start = _ModesWatch(srv)
    try:
        srv.start()
    finally:
        srv.modes_at_start.stop()
    yield srv
    srv.stop()


def test_the_admin_key_opens_the_control_api(keyed):
    """With ``admin_key``, a request carrying it reaches the repository API (HTTP and gRPC); one without it, or
    with a wrong key, is refused."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    url = f"{keyed.http_url}/v2/repository/index"
    with _session() as s:
        assert s.post(url, headers=CLOSE, timeout=10).status_code == 403
        assert s.post(url, headers={**CLOSE, ADMIN_HEADER: "wrong"}, timeout=10).status_code == 403
        r = s.post(url, headers={**CLOSE, **admin_headers(ADMIN_KEY, "http")}, timeout=10)
        assert r.status_code == 200 and "ensemble" in {m["name"] for m in r.json()}, r.text
    client = grpcclient.InferenceServerClient(keyed.grpc_address)
    try:
        with pytest.raises(InferenceServerException, match="restricted"):
            client.get_model_repository_index()
        index = client.get_model_repository_index(headers=admin_headers(ADMIN_KEY, "grpc"), as_json=True)
        assert "ensemble" in {m["name"] for m in index["models"]}
    finally:
        client.close()


def test_every_listening_socket_of_the_server_is_on_loopback(keyed):
    """tritonserver's HTTP (private: the HTTP guard's port, served from this process, forwards to it), gRPC and
    metrics ports, the guard's, and the engine's TCPStore and gloo sockets (leader in the engine process, one worker:
    the target is TP2), listen on 127.0.0.1 / ::1 only, not on 0.0.0.0 or ::."""
    ask_grpc(keyed.grpc_address, PROMPT, max_tokens=4, stream=True)  # the engine's group is up and has run
    guard = [a for a, pids in _listening_sockets(os.getpgid(0)).items()
             if os.getpid() in pids and a.endswith(f":{keyed.http_port}")]
    assert guard and all(_is_loopback(a) for a in guard), guard
    listening = _listening_sockets(keyed.pid)
    ports = {int(a.rsplit(":", 1)[1]) for a in listening}
    assert {keyed.triton_http_port, keyed.grpc_port, keyed.metrics_port} <= ports, listening
    assert keyed.http_port not in ports, listening
    assert len({p for pids in listening.values() for p in pids} - {keyed.pid}) >= 1, listening  # the engine's too
    exposed = {a: pids for a, pids in listening.items() if not _is_loopback(a)}
    assert not exposed, exposed


def test_the_openai_front_end_listens_on_loopback_by_default(keyed):
    from splitspec.serving.openai_api import OpenAIServer

    with OpenAIServer(keyed.repo, keyed.grpc_address, port=0) as api:
        mine = [a for a, pids in _listening_sockets(os.getpgid(0)).items()
                if os.getpid() in pids and a.endswith(f":{api.port}")]
        assert mine and all(_is_loopback(a) for a in mine), mine
        with _session() as s:
            assert s.get(f"{api.url}/models", headers=CLOSE, timeout=10).status_code == 200


def test_nothing_the_server_made_was_open_to_others_while_it_started(keyed):
    """Polled every few ms from before the start until ready: each shared-memory region (three stubs, and the stubs
    that complete the models' configurations), the run folder and the engine's heartbeat in it, the log."""
    seen = {str(p).replace(keyed.shm_prefix, "<prefix>"): sorted(oct(m) for m in modes)
            for p, modes in keyed.modes_at_start.seen.items()}
    assert keyed.private_fchmod, "tritonserver started without its seccomp filter"
    regions = [p for p in seen if "<prefix>" in p]
    heartbeats = list(keyed.run_dir.glob("engine.*.heartbeat"))
    assert len(regions) >= 3 and heartbeats and str(heartbeats[0]) in seen and str(keyed.run_dir) in seen, seen
    assert all(m & 0o077 == 0 for modes in keyed.modes_at_start.seen.values() for m in modes), seen


def test_shared_memory_regions_are_private_to_the_server_user(keyed):
    """The Python backend's regions (named from the server's ``shm_prefix``) hold request text: mode 0600."""
    ask_http(keyed.generate_url, PROMPT, max_tokens=4)
    regions = _shm_regions(keyed.shm_prefix)
    assert regions, f"no /dev/shm/{keyed.shm_prefix}* region"
    modes = {r.name: oct(stat.S_IMODE(r.stat().st_mode)) for r in regions}
    assert all(stat.S_IMODE(r.stat().st_mode) & 0o077 == 0 for r in regions), modes


def test_no_shared_memory_is_left_after_tritonserver_is_killed(keyed):
    """Runs last in this module: SIGKILL of tritonserver alone (its stubs and engine outlive it, in its process
    group); stop() then kills what is left and removes the regions named from this server's prefix."""
    ask_http(keyed.generate_url, PROMPT, max_tokens=4)
    before = _shm_regions(keyed.shm_prefix)
    assert before
    mib = sum(r.stat().st_size for r in before) / 2**20
    os.kill(keyed.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while keyed.is_running() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert keyed.stop() == -signal.SIGKILL
    left = _shm_regions(keyed.shm_prefix)
    assert not left, f"{len(left)} of {len(before)} regions ({mib:.1f} MiB before the kill) left: {left}"
    assert not keyed.run_dir.exists()
