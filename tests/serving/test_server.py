"""End-to-end: the rendered model repository served by a real tritonserver (HTTP, gRPC, perf_analyzer).

The server is the session's shared one (tests/conftest.py: target TP2 + TP1 drafter on CPU, on free ports); the
last server test here stops it and checks that no process it started is left (the next module to need it gets a
fresh one).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import time
from pathlib import Path

import pytest
import requests

from splitspec.serving.client import ask_grpc, ask_http
from splitspec.errors import ConfigError, SplitspecError
from splitspec.serving.process_tree import descendants, pipeline_processes
from splitspec.serving.repo import render_repo
from splitspec.serving.triton_install import find_triton, prepare_backend_dir
from splitspec.serving.tritonserver import TritonServer
from splitspec.settings import ServeConfig, parse_ids

PROMPT = "def fibonacci(n):"
CHAT_PROMPT = "How do I read a file line by line in Python?"
MAX_TOKENS = 24
K = 4
CLOSE = {"Connection": "close"}  # an idle kept-alive connection would delay server shutdown


def _runtime_available() -> bool:
    """True when splitspec.runtime.scheduler defines SpeculativeEngine (an import error inside it propagates)."""
    if importlib.util.find_spec("splitspec.runtime.scheduler") is None:
        return False
    return hasattr(importlib.import_module("splitspec.runtime.scheduler"), "SpeculativeEngine")


def _group_members(pgid: int) -> list[int]:
    """Live processes whose process group is ``pgid`` (the server runs in its own group)."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                out.append(int(d.name))
    return out


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _post(url: str, **kw) -> requests.Response:
    return requests.post(url, headers=CLOSE, timeout=120, **kw)


@pytest.fixture(scope="module")
def engines(request) -> Path:
    if not _runtime_available():
        pytest.skip("splitspec.runtime.scheduler.SpeculativeEngine is not available yet")
    try:
        return request.getfixturevalue("built_engines")
    except pytest.FixtureLookupError:
        pytest.skip("the built_engines fixture (tests/conftest.py) is not available yet")


@pytest.fixture
def server(engines, shared_server):
    assert shared_server.num_draft_tokens == K
    return shared_server.get()


@pytest.fixture(scope="module")
def reference(engines):
    """In-process answers: SpeculativeEngine.generate + ChatTokenizer.decode."""
    from splitspec.runtime.scheduler import SpeculativeEngine
    from splitspec.runtime.tokenizer import ChatTokenizer

    tok = ChatTokenizer.from_dir(engines / "target")
    chat_text = tok.apply_chat_template([{"role": "user", "content": CHAT_PROMPT}], add_generation_prompt=True)
    out = {"tok": tok}
    with SpeculativeEngine.load(ServeConfig(engines)) as eng:
        for key, text in (("raw", PROMPT), ("chat", chat_text)):
            res = eng.generate(tok.encode(text), MAX_TOKENS, num_draft_tokens=K, stop_token_ids=set(tok.stop_token_ids))
            out[key] = (tok.decode(res.token_ids, skip_special_tokens=True), res.acceptance_length)
        res0 = eng.generate(tok.encode(PROMPT), MAX_TOKENS, num_draft_tokens=0, stop_token_ids=set(tok.stop_token_ids))
        out["k0"] = tok.decode(res0.token_ids, skip_special_tokens=True)
    return out


# ---------------------------------------------------------------------------------------------
# Without a server
# ---------------------------------------------------------------------------------------------


def test_backend_folder_links_the_matching_stub(tmp_path):
    inst = find_triton()
    backends = prepare_backend_dir(tmp_path)
    py = backends / "python"
    assert (py / "triton_python_backend_stub").resolve() == inst.stub.resolve()
    assert (py / "libtriton_python.so").resolve() == inst.backend_lib.resolve()
    assert (py / "triton_python_backend_utils.py").is_file()
    assert prepare_backend_dir(tmp_path) == backends  # idempotent


def test_client_sends_zero_valued_options():
    from splitspec.serving.client import request_parameters

    a = dict(chat=False, num_draft_tokens=0, temperature=0.0, top_p=None, top_k=0, seed=0, stop=None, stream=True)
    assert request_parameters(**a) == {"return_stats": True, "num_draft_tokens": 0, "temperature": 0.0, "top_k": 0, "seed": 0,
                                 "stream": True}


def test_client_without_a_server_says_how_to_start_one():
    from splitspec.serving.tritonserver import free_ports

    url = f"http://127.0.0.1:{free_ports(1)[0]}/v2/models/ensemble/generate"  # nothing listens there
    with pytest.raises(SplitspecError, match=r"no server answers there \(connection refused\); start one with 'make serve'"):
        ask_http(url, "x", max_tokens=1)


def test_render_repo_names_missing_engine(tmp_path):
    (tmp_path / "engines" / "target").mkdir(parents=True)
    with pytest.raises(ConfigError, match=r"target/engine\.json"):
        render_repo(ServeConfig(tmp_path / "engines", num_draft_tokens=4), tmp_path / "repo")
    (tmp_path / "engines" / "target" / "engine.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"drafter/engine\.json"):
        render_repo(ServeConfig(tmp_path / "engines", num_draft_tokens=4), tmp_path / "repo")


def test_render_repo_names_missing_templates(tmp_path):
    """The templates come from the folder the caller names (default: ./triton_repo); a wrong one is named, with what
    to pass, before anything else is read."""
    (tmp_path / "nothing").mkdir()
    with pytest.raises(ConfigError, match=r"preprocessing/config\.pbtxt\.in: model repository template not found; "
                                          r"pass template_dir"):
        render_repo(ServeConfig(tmp_path / "engines"), tmp_path / "repo", template_dir=tmp_path / "nothing")
    assert not (tmp_path / "repo").exists()


def test_server_start_failure_reports_log_and_leaves_nothing(tmp_path):
    """A model that cannot load: start() raises with the log tail, and no process is left."""
    from splitspec.demo.tokenizer_train import train_tokenizer

    eng = tmp_path / "engines"
    train_tokenizer(eng / "target", vocab_size=512, max_corpus_bytes=200_000)
    for kind in ("target", "drafter"):
        (eng / kind).mkdir(parents=True, exist_ok=True)
        (eng / kind / "engine.json").write_text(json.dumps({"kind": kind, "mapping": {"tp_size": 1},
                                                            "limits": {"max_draft_len": 8, "max_seq_len": 256}}))
    repo = render_repo(ServeConfig(eng, num_draft_tokens=4), tmp_path / "repo")
    (eng / "target" / "tokenizer.json").unlink()  # preprocessing, postprocessing and spec_decode now fail
    srv = TritonServer(repo, startup_timeout_s=120)
    with pytest.raises(SplitspecError, match="tokenizer.json"):
        srv.start()
    assert not srv.is_running()
    assert not _group_members(srv.pid)


def test_render_repo_rejects_bad_placement(engines, tmp_path):
    with pytest.raises(ConfigError, match="target_device_ids"):
        render_repo(ServeConfig(engines, num_draft_tokens=K, target_device_ids=parse_ids("0,x", "target_device_ids")),
                    tmp_path / "r")
    with pytest.raises(ConfigError, match="target_device_ids"):
        render_repo(ServeConfig(engines, num_draft_tokens=K, target_device_ids=(0,)), tmp_path / "r")  # TP2 engines
    with pytest.raises(ConfigError, match="num_draft_tokens"):
        render_repo(ServeConfig(engines, num_draft_tokens=-1), tmp_path / "r")
    with pytest.raises(ConfigError, match="max_draft_len"):
        render_repo(ServeConfig(engines, num_draft_tokens=999), tmp_path / "r")


def test_render_repo_refuses_a_folder_of_other_files(engines, tmp_path):
    """A mistyped --out (a checkpoint folder, /) is refused, not filled with the four model folders."""
    (tmp_path / "notes.txt").write_text("keep")
    with pytest.raises(ConfigError, match="holds other files and no model repository"):
        render_repo(ServeConfig(engines, num_draft_tokens=K), tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


@pytest.mark.parametrize("blocker", ["spec_decode", "postprocessing/1", "ensemble/config.pbtxt/"])
def test_render_repo_refuses_a_blocked_destination_before_writing(engines, tmp_path, blocker):
    """A file where a model folder goes (or a folder where a config goes): refused, and nothing written."""
    out = tmp_path / "r"
    (out / blocker.rstrip("/")).parent.mkdir(parents=True, exist_ok=True)
    (out / blocker).mkdir() if blocker.endswith("/") else (out / blocker).touch()
    before = sorted(p.relative_to(out) for p in out.rglob("*"))
    with pytest.raises(ConfigError, match="cannot write the repository there"):
        render_repo(ServeConfig(engines, num_draft_tokens=K), out)
    assert sorted(p.relative_to(out) for p in out.rglob("*")) == before


# ---------------------------------------------------------------------------------------------
# Against one served repository
# ---------------------------------------------------------------------------------------------


@pytest.mark.server
def test_ready(server):
    r = requests.get(f"{server.http_url}/v2/health/ready", headers=CLOSE, timeout=10)
    assert r.status_code == 200
    for model in ("ensemble", "preprocessing", "spec_decode", "postprocessing"):
        assert requests.get(f"{server.http_url}/v2/models/{model}/ready", headers=CLOSE, timeout=10).status_code == 200


@pytest.mark.server
def test_http_grpc_and_in_process_agree(server, reference):
    text, acc = reference["raw"]
    h = ask_http(server.generate_url, PROMPT, MAX_TOKENS, return_stats=True)
    g = ask_grpc(server.grpc_address, PROMPT, MAX_TOKENS, return_stats=True)
    assert h["text_output"] == g["text_output"] == text
    assert float(h["acceptance_length"]) == pytest.approx(acc, rel=1e-6)
    assert g["acceptance_length"] == pytest.approx(acc, rel=1e-6)
    assert acc >= 1.0

    chat_text, _ = reference["chat"]
    assert ask_http(server.generate_url, CHAT_PROMPT, MAX_TOKENS, apply_chat_template=True)["text_output"] == chat_text
    assert ask_grpc(server.grpc_address, CHAT_PROMPT, MAX_TOKENS, apply_chat_template=True)["text_output"] == chat_text
    # greedy speculation is lossless: target-only decoding (k = 0) gives the same text
    assert ask_http(server.generate_url, PROMPT, MAX_TOKENS, num_draft_tokens=0)["text_output"] == reference["k0"] == text
    assert ask_http(server.generate_url, PROMPT, MAX_TOKENS, temperature=0.0, num_draft_tokens=2)["text_output"] == text


@pytest.mark.server
def test_values_survive_the_stub_round_trip(server, reference):
    """int32 ids and UTF-8 strings through the Python stubs (NumPy 1/2 mismatch corrupts them silently)."""
    tok = reference["tok"]
    prompt = "naïve café — 日本語 " + PROMPT
    r = _post(f"{server.http_url}/v2/models/preprocessing/infer",
              json={"inputs": [{"name": "text_input", "shape": [1, 1], "datatype": "BYTES", "data": [prompt]}]})
    assert r.status_code == 200, r.text
    out = {o["name"]: o for o in r.json()["outputs"]}["input_ids"]
    assert out["datatype"] == "INT32"
    assert out["data"] == tok.encode(prompt)
    assert len(set(out["data"])) > 4 and max(out["data"]) > 255

    ids = tok.encode(prompt)
    r = _post(f"{server.http_url}/v2/models/postprocessing/infer",
              json={"inputs": [{"name": "output_ids", "shape": [1, len(ids)], "datatype": "INT32", "data": ids}]})
    assert r.status_code == 200, r.text
    assert r.json()["outputs"][0]["data"] == [prompt]


@pytest.mark.server
@pytest.mark.parametrize("body,status,needle", [
    ({"max_tokens": 8}, 400, "text_input"),
    ({"text_input": PROMPT, "max_tokens": -1}, 400, "max_tokens"),
    ({"text_input": PROMPT, "max_tokens": 5000}, 400, "max_tokens"),
    ({"text_input": PROMPT, "max_tokens": 8, "temperature": -0.7}, 400, "temperature = -0.7"),
    ({"text_input": PROMPT, "max_tokens": 8, "top_p": 1.5}, 400, "top_p = 1.5"),
    ({"text_input": PROMPT, "max_tokens": 8, "bogus": 1}, 400, "unknown parameter 'bogus'"),
    ({"text_input": "", "max_tokens": 8}, 400, "text_input"),
    ({"text_input": PROMPT, "max_tokens": 8, "num_draft_tokens": 999}, 400, "num_draft_tokens"),
    ({"text_input": "x" * 20000, "max_tokens": 8}, 400, "max_seq_len"),
    # JSON that does not parse: the HTTP guard answers 400 (tritonserver itself would answer 500)
    ("{not json", 400, "not valid JSON"),
])
def test_bad_request_gets_an_error_and_server_keeps_serving(server, reference, body, status, needle):
    r = _post(server.generate_url, data=body) if isinstance(body, str) else _post(server.generate_url, json=body)
    assert r.status_code == status, r.text
    assert needle in r.json()["error"]
    assert ask_http(server.generate_url, PROMPT, MAX_TOKENS)["text_output"] == reference["raw"][0]


@pytest.mark.server
def test_grpc_bad_request_gets_an_error(server, reference):
    with pytest.raises(SplitspecError, match=r"temperature = -0\.7"):
        ask_grpc(server.grpc_address, PROMPT, 8, temperature=-0.7)
    assert ask_grpc(server.grpc_address, PROMPT, MAX_TOKENS)["text_output"] == reference["raw"][0]


@pytest.mark.server
def test_metrics_count_requests(server):
    r = requests.get(server.metrics_url, headers=CLOSE, timeout=10)
    assert r.status_code == 200
    assert 'nv_inference_request_success{model="ensemble"' in r.text


@pytest.mark.server
def test_perf_analyzer_short_run(server, tmp_path, capsys):
    from splitspec.measure.perf_suite import run_perf

    t0 = time.monotonic()
    csv = run_perf(server.repo, seconds=2.0, concurrency="1", out_dir=tmp_path / "perf", server=server)
    assert time.monotonic() - t0 < 90
    lines = csv.read_text().splitlines()
    assert lines[0].startswith("Concurrency,Inferences/Second")
    assert len(lines) == 2 and float(lines[1].split(",")[1]) > 0
    assert "Request concurrency: 1" in capsys.readouterr().out
    assert json.loads((tmp_path / "perf" / "perf_input.json").read_text())["data"][0]["max_tokens"] == [32]


@pytest.mark.server
def test_stop_is_clean_and_leaves_no_process(server):
    """Runs last: SIGINT unloads the models (spec_decode closes its engine) and every child exits."""
    before, roles = descendants(server.pid), pipeline_processes(server.pid)
    stubs = [p for p, r in roles.items() if r.endswith(" stub")]
    workers = [p for p, r in roles.items() if r.startswith("target worker")]
    assert len(stubs) == 3, roles
    assert len(workers) == 1, roles  # the target is TP2: the leader in the stub + one worker
    t0 = time.monotonic()
    assert server.stop() == 0, server.log_tail()
    assert time.monotonic() - t0 < 30
    time.sleep(0.2)
    left = [p for p in [server.pid, *before] if _alive(p)]
    assert not left, {p: roles.get(p, "not of the pipeline") for p in left}
    assert not _group_members(server.pid)
    assert "successfully unloaded 'spec_decode'" in server.log_tail(20000)
    assert not os.path.exists(f"/proc/{server.pid}")


def test_free_ports_are_distinct_bindable_and_below_the_ephemeral_range(monkeypatch, tmp_path):
    import socket

    from splitspec.serving import tritonserver as server

    rng = tmp_path / "ip_local_port_range"
    rng.write_text("32768\t60999\n")
    monkeypatch.setattr(server, "EPHEMERAL_RANGE_FILE", rng)
    ports = server.free_ports(3)
    assert len(set(ports)) == 3 and all(server.LOWEST_PICKED_PORT <= p < 32768 for p in ports)
    for p in ports:  # still free after free_ports released them
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", p))
    monkeypatch.setattr(server, "EPHEMERAL_RANGE_FILE", tmp_path / "missing")  # not Linux: the OS picks
    assert len(set(server.free_ports(3))) == 3


STAND_IN = """
import signal, sys, time
log = open(sys.argv[1], "a")
def on_int(*_):
    if sys.argv[2] == "exit":
        sys.exit(3)
    log.write('E1201 main.cc:535] "failed to stop server: Internal - Exit timeout expired. Exiting immediately."\\n')
    log.flush()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    while True:  # tritonserver 2.51 hangs in its exit after that line
        time.sleep(1)
signal.signal(signal.SIGINT, on_int)
log.write("ready\\n"); log.flush()
while True:
    time.sleep(1)
"""


@pytest.mark.parametrize("behaviour", ["hang", "exit"])
def test_stop_kills_a_server_that_gave_up_and_cleans_its_shared_memory(tmp_path, behaviour):
    """stop() against a stand-in for tritonserver (no server needed): one that logs the give-up line on SIGINT and
    hangs is killed at once, not after stop_timeout_s; one that exits by itself keeps its exit status. Either way
    the regions named from its Python backend's prefix (/dev/shm) are gone afterwards."""
    import subprocess
    import sys

    srv = object.__new__(TritonServer)  # only what stop() uses
    srv.log_path, srv.stop_timeout_s, srv.exit_timeout_s, srv.run_dir, srv.guard = tmp_path / "log", 30.0, 10, None, None
    srv.log_path.write_text("")
    srv.shm_prefix = f"splitspec_test_{os.getpid()}_{behaviour}_"
    region = Path("/dev/shm") / f"{srv.shm_prefix}region"
    region.write_bytes(b"x")
    try:
        srv.proc = subprocess.Popen([sys.executable, "-c", STAND_IN, str(srv.log_path), behaviour], start_new_session=True)
        t0 = time.monotonic()
        while "ready" not in srv.log_path.read_text():
            assert time.monotonic() - t0 < 30, "the stand-in did not start"
            time.sleep(0.05)
        t0 = time.monotonic()
        rc = srv.stop()
        took = time.monotonic() - t0
        if behaviour == "hang":
            assert rc == -9 and took < 5, (rc, took)  # 1 s after the line, not stop_timeout_s (30 s)
        else:
            assert rc == 3 and took < 5, (rc, took)
        assert not region.exists()
    finally:
        region.unlink(missing_ok=True)
