"""Admission faults through a real tritonserver: oversize bodies and prompts, deeply nested JSON, missing required
inputs, JSON integers beyond INT32, and a saturated wait queue.

Each test is one failure of the served pipeline's fault review (issue 30): an ~8 MB form-typed HTTP body killed
tritonserver (0); a 16 MB prompt was tokenised for tens of seconds and nothing bounded the queue (4); a request
lacking text_input or max_tokens ran without it (8); max_tokens 2^32 + 8 ran 8 tokens (9); and one found later: a
~2 MB JSON body nesting arrays a million deep killed tritonserver in 0.28 s. HTTP clients now reach tritonserver
through the HTTP guard (serving/http_guard.py), which refuses the first and the last by size and depth; tritonserver's
own port (private) is still tested for the first two. The session's shared server serves the first groups; the
queue tests start one small server of their own (max_batch_size 1, one request waiting at most, a short max_queue_s).
"""

from __future__ import annotations

import json
import queue
import threading
import time

import numpy as np
import pytest
import requests

from splitspec.serving.client import grpc_inputs, merge, stream_http
from splitspec.serving.http_guard import HttpGuard
from splitspec.serving.metrics import metric_value, parse_prometheus
from splitspec.serving.server_limits import request_body_limit
from splitspec.settings import PROMPT_BYTES_PER_TOKEN

CLOSE = {"Connection": "close"}
JSON = {"Content-Type": "application/json", **CLOSE}
FORM = {"Content-Type": "application/x-www-form-urlencoded", **CLOSE}  # curl -d's default
MAX_SEQ_LEN = 256  # tests/conftest.py's engines
MAX_PROMPT_BYTES = MAX_SEQ_LEN * PROMPT_BYTES_PER_TOKEN
BODY_LIMIT = request_body_limit(MAX_PROMPT_BYTES)  # the HTTP guard's
GENERATE = "/v2/models/ensemble/generate"
VOCAB_SIZE = 4096  # the demo models' (splitspec.demo.checkpoints.VOCAB_SIZE)
#: An end_id that keeps a request generating to max_tokens: [PAD], the vocabulary's last token, which greedy decoding
#: of these prompts never produces (an id outside the vocabulary is refused).
NEVER_END_ID = VOCAB_SIZE - 1


def _alive(srv) -> bool:
    try:
        return requests.get(f"{srv.http_url}/v2/health/ready", timeout=5, headers=CLOSE).status_code == 200
    except requests.RequestException:
        return False


def _post(url: str, body: bytes | dict, headers=JSON, timeout: float = 120.0) -> requests.Response:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return requests.post(url, data=data, headers=headers, timeout=timeout)


def _grpc(srv, inputs, timeout: float = 60.0) -> list:
    """Send ``inputs`` over a gRPC stream; [(result dict or None, error message or None)] until the final response
    or an error."""
    import tritonclient.grpc as grpcclient

    from splitspec.serving.client import is_final, result_dict

    answers: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(srv.grpc_address)
    out = []
    try:
        client.start_stream(callback=lambda result, error: answers.put((result, error)))
        client.async_stream_infer("ensemble", inputs, enable_empty_final_response=True)
        while True:
            r, e = answers.get(timeout=timeout)
            if e is not None:
                out.append((None, e.message() if hasattr(e, "message") else str(e)))
                return out
            out.append((result_dict(r), None))
            if is_final(r):
                return out
    finally:
        client.stop_stream(cancel_requests=True)
        client.close()


# ---------------------------------------------------------------- 0 and 4: oversize bodies and prompts


@pytest.mark.parametrize("megabytes", [8, 22])
def test_large_form_body_does_not_kill_the_server(shared_server, megabytes):
    """Failure 0: an ~8 MB (and 22 MB) body sent as application/x-www-form-urlencoded crashed tritonserver 2.51
    (SIGSEGV in its HTTP library, which copies such a body onto a thread's stack). The HTTP guard refuses it by its
    Content-Length (413); sent to tritonserver's own port, its larger stack holds and preprocessing refuses it naming
    text_input and the limit; the server keeps serving."""
    srv = shared_server.get()
    body = json.dumps({"text_input": "hello world " * (megabytes * 1_000_000 // 12), "max_tokens": 4}).encode()
    r = _post(srv.generate_url, body, headers=FORM)
    assert r.status_code == 413 and f"request body of {len(body)} bytes exceeds the limit of {BODY_LIMIT}" in r.json()["error"]
    try:
        r = _post(srv.triton_http_url + GENERATE, body, headers=FORM)
        answer = (r.status_code, r.text[:300])
    except requests.RequestException as e:
        answer = ("no response", type(e).__name__)
    assert srv.is_running() and _alive(srv), f"tritonserver died on a {len(body)}-byte form body: {answer}"
    assert answer[0] == 400 and "text_input" in answer[1] and f"at most {MAX_PROMPT_BYTES}" in answer[1], answer


def test_oversize_prompt_is_refused_before_tokenising(shared_server):
    """Failure 4: a 16 MB prompt kept preprocessing busy tokenising (tens of seconds, GiBs); now it is refused by
    size first: its body by the HTTP guard, the prompt by preprocessing over tritonserver's own HTTP and gRPC (and
    through the guard, a prompt just over the limit in a body under it)."""
    srv = shared_server.get()
    big = "def fibonacci(n): " * (16_000_000 // 18)
    t0 = time.monotonic()
    r = _post(srv.generate_url, {"text_input": big, "max_tokens": 4})
    assert r.status_code == 413 and time.monotonic() - t0 < 2.0, r.text[:300]
    t0 = time.monotonic()
    r = _post(srv.triton_http_url + GENERATE, {"text_input": big, "max_tokens": 4})
    http_s = time.monotonic() - t0
    assert r.status_code == 400, r.text[:300]
    msg = r.json()["error"]
    assert f"text_input: {len(big.encode())} bytes, at most {MAX_PROMPT_BYTES}" in msg, msg
    assert http_s < 8.0, f"a 16 MB prompt took {http_s:.1f} s to refuse"
    r = _post(srv.generate_url, {"text_input": "x" * (MAX_PROMPT_BYTES + 1), "max_tokens": 4})
    assert r.status_code == 400 and f"at most {MAX_PROMPT_BYTES}" in r.json()["error"], r.text[:300]
    t0 = time.monotonic()
    got = _grpc(srv, grpc_inputs(big[:2_000_000], 4, stream=True))
    assert got[-1][1] is not None and f"at most {MAX_PROMPT_BYTES}" in got[-1][1], got
    assert time.monotonic() - t0 < 5.0
    # at the limit exactly: tokenised (and then refused by the engine for its length, not by size)
    r = _post(srv.generate_url, {"text_input": "x" * MAX_PROMPT_BYTES, "max_tokens": 4})
    assert r.status_code == 400 and "max_seq_len" in r.json()["error"], r.text[:300]
    assert _post(srv.generate_url, {"text_input": "def f(x):", "max_tokens": 4}).status_code == 200


# ---------------------------------------------------------------- deep JSON, and the guard's other bounds


def test_deeply_nested_json_is_refused_and_tritonserver_serves_on(shared_server):
    """A ~2 MB body nesting arrays a million deep killed tritonserver 2.51 in 0.28 s (its JSON parser recurses per
    level). HTTP clients reach it only through the guard: here that body is refused by size (413: the test engines'
    limit is BODY_LIMIT), 50,000 levels under the limit by depth (400); a guard with a large deployment's limit
    (max_prompt_bytes 4 MB: a 128K-token context), in front of the same tritonserver, refuses the million levels by
    depth. tritonserver (the same process) answers a normal request right after each, and streams through the guard."""
    srv = shared_server.get()
    pid, guard = srv.pid, srv.guard
    assert guard is not None and srv.generate_url.startswith(guard.url + "/") and guard.port != srv.triton_http_port

    def serves() -> None:
        assert srv.pid == pid and srv.is_running(), "tritonserver was replaced or died"
        r = _post(srv.generate_url, {"text_input": "def f(x):", "max_tokens": 4})
        assert r.status_code == 200 and r.json()["text_output"], r.text[:300]

    million = b"[" * 1_000_000 + b"]" * 1_000_000
    r = _post(srv.generate_url, million)
    assert r.status_code == 413 and f"exceeds the limit of {BODY_LIMIT} bytes" in r.json()["error"], r.text[:300]
    serves()
    r = _post(srv.generate_url, b"[" * 50_000 + b"]" * 50_000)
    assert r.status_code == 400 and r.json() == {"error": "request JSON nests 50000 levels deep, at most 32 (Triton's "
                                                 "requests nest 4; deeper nesting crashes tritonserver's JSON parser)"}
    serves()
    with HttpGuard(0, srv.triton_http_port, request_body_limit(4_000_000), 4_000_000) as large:
        t0 = time.monotonic()
        r = _post(large.url + GENERATE, million)
        assert r.status_code == 400 and "nests 1000000 levels deep, at most 32" in r.json()["error"], r.text[:300]
        assert time.monotonic() - t0 < 2.0
        r = _post(large.url + GENERATE, {"text_input": "def f(x):", "max_tokens": 4})
        assert r.status_code == 200 and r.json()["text_output"]
    serves()
    answer = merge(stream_http(srv.generate_stream_url, "def f(x):", max_tokens=6, end_id=NEVER_END_ID))
    assert answer["num_responses"] >= 2 and answer["text_output"] and answer["finish_reason"], answer


def test_over_limit_chunked_body_is_refused_as_it_arrives(shared_server):
    """A chunked body (no Content-Length) is refused with 413 once what was read passes the limit; the rest of it is
    never read (the connection closes), and the server serves on."""
    srv = shared_server.get()
    sent = [0]

    def chunks():
        for _ in range(200):  # 20 MB if all were read
            sent[0] += 1
            yield b'{"text_input": "' + b"x" * 100_000

    r = requests.post(srv.generate_url, data=chunks(), headers=CLOSE, timeout=60)
    assert r.status_code == 413 and r.json()["error"].startswith(f"chunked request body exceeds the limit of {BODY_LIMIT}")
    assert sent[0] < 200, "the whole body was sent"
    assert _post(srv.generate_url, {"text_input": "def f(x):", "max_tokens": 4}).status_code == 200


# ---------------------------------------------------------------- 8: missing required inputs

MISSING = [
    ({"max_tokens": 4, "stream": True}, "text_input"),
    ({"max_tokens": 4, "temperature": 0.0}, "text_input"),
    ({"text_input": "def f(x):", "stream": True}, "max_tokens"),
    ({"text_input": "def f(x):", "temperature": 0.0}, "max_tokens"),
]


@pytest.mark.parametrize("body, missing", MISSING)
def test_missing_required_input_is_refused_in_every_door(shared_server, body, missing):
    """Failure 8: with two inputs present and a required one absent, SSE answered 200 with an empty body, gRPC one
    empty final response and /generate a misleading message; now every door refuses naming the input."""
    srv = shared_server.get()
    want = f"{missing}: missing"
    if not body.get("stream"):
        r = _post(srv.generate_url, body)
        assert r.status_code == 400 and want in r.json().get("error", ""), (r.status_code, r.text[:300])
    r = _post(srv.generate_stream_url, body)
    assert r.status_code == 400 and want in r.text, (r.status_code, r.text[:300])
    full = grpc_inputs("def f(x):", 4, **{k: v for k, v in body.items() if k not in ("text_input", "max_tokens")})
    got = _grpc(srv, [t for t in full if t.name() != missing])
    assert got[-1][1] is not None and want in got[-1][1], got


# ---------------------------------------------------------------- 9: integers beyond INT32 over HTTP


def test_json_integers_beyond_int32(shared_server):
    """Failure 9: Triton 2.51's HTTP front end wraps a JSON integer modulo 2^32 into an INT32 input. The inputs stay
    INT32 (the TensorRT-LLM convention's type, which gRPC clients send); what happens is documented
    (docs/serving.md) and pinned here: a value that wraps out of range is refused with a hint, one that wraps into
    range runs with the wrapped value."""
    srv = shared_server.get()
    r = _post(srv.generate_url, {"text_input": "def f(x):", "max_tokens": 2**31 + 5})
    assert r.status_code == 400, r.text[:300]
    assert f"max_tokens = {2**31 + 5 - 2**32}" in r.json()["error"] and "modulo 2^32" in r.json()["error"], r.text
    r = _post(srv.generate_url, {"text_input": "def f(x):", "max_tokens": 2**32 + 8, "return_num_output_tokens": True,
                                 "end_id": NEVER_END_ID})
    assert r.status_code == 200, r.text[:300]
    assert r.json()["num_output_tokens"] == 8  # 2^32 + 8 wraps to 8: not detectable in the model (documented)
    for bad in (2**64 + 1, 1e3, "8"):  # beyond 64 bits, a float, a string: Triton's 500, the guard's 400 before it
        r = _post(srv.generate_url, {"text_input": "def f(x):", "max_tokens": bad})
        assert r.status_code == 400 and r.json()["error"].startswith("max_tokens: expected an integer (INT32), got "), \
            r.text[:300]


def test_token_ids_beyond_the_vocabulary_are_refused_in_every_door(shared_server):
    """end_id (and pad_id) must be tokens of the served vocabulary: beyond it, HTTP generate, generate_stream and gRPC
    answer 400 / INVALID_ARG naming the input and the vocabulary's size (before, end_id = 10^6 ran as "no end")."""
    from splitspec.errors import SplitspecError
    from splitspec.serving.client import ask_grpc

    srv = shared_server.get()
    for name in ("end_id", "pad_id"):
        want = f"{name} = {VOCAB_SIZE}: outside the vocabulary of the served model (token ids 0..{VOCAB_SIZE - 1}, vocab_size {VOCAB_SIZE})"
        for url in (srv.generate_url, srv.generate_stream_url):
            r = _post(url, {"text_input": "def f(x):", "max_tokens": 4, name: VOCAB_SIZE})
            refused = r.status_code == 400 or (url == srv.generate_stream_url and r.text.startswith('data: {"error"'))
            assert refused and want in r.text, (url, r.status_code, r.text[:300])
        with pytest.raises(SplitspecError, match="INVALID_ARG|outside the vocabulary") as e:
            ask_grpc(srv.grpc_address, "def f(x):", 4, **{name: VOCAB_SIZE})
        assert want in str(e.value), e.value
    r = _post(srv.generate_url, {"text_input": "def f(x):", "max_tokens": 4, "end_id": NEVER_END_ID, "pad_id": 0})
    assert r.status_code == 200 and r.json()["finish_reason"] == "length", r.text[:300]


# ---------------------------------------------------------------- 4: the bounded wait queue


@pytest.fixture(scope="module")
def busy_server(engines_for, tmp_path_factory):
    """A server decoding one request at a time, with one waiting at most, for at most ``MAX_QUEUE_S`` (TP1 engines:
    no worker process to start and stop). Every cycle drafts K tokens and accepts none (benchmark mode), so a request
    takes one slow cycle per token: a long one holds the batch slot for seconds on any machine."""
    from splitspec.serving.repo import render_repo
    from splitspec.serving.tritonserver import TritonServer
    from splitspec.settings import ServeConfig

    cfg = ServeConfig(engines_for(1), num_draft_tokens=K, synthetic_acceptance=(0.0,) * K, max_batch_size=1,
                      max_queue_len=1, max_queue_s=MAX_QUEUE_S)
    repo = render_repo(cfg, tmp_path_factory.mktemp("busy") / "repo")
    with TritonServer(repo, exit_timeout_s=5, startup_timeout_s=300) as srv:
        yield srv


K = 8
MAX_QUEUE_S = 2.0
#: The HTTP status of Triton 2.51's generate endpoints for any error response of a model, UNAVAILABLE included.
TRITON_MODEL_ERROR_STATUS = 400
SHORT = {"text_input": "def f(x):", "max_tokens": 4}


class _Holder(threading.Thread):
    """A streaming request that decodes (up to 240 tokens, no end-of-sequence token) until :meth:`release` closes its
    connection, which cancels it."""

    def __init__(self, srv):
        super().__init__(daemon=True)
        self.srv, self.started, self.stop, self.events = srv, threading.Event(), threading.Event(), 0

    def run(self):
        body = {"text_input": "def f(x):", "max_tokens": 240, "end_id": NEVER_END_ID, "stream": True}
        with requests.post(self.srv.generate_stream_url, json=body, headers=CLOSE, stream=True, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith(b"data:"):
                    self.events += 1
                    self.started.set()
                if self.stop.is_set():
                    return

    def release(self):
        self.stop.set()
        self.join(timeout=30)


def _gauge(srv, name: str) -> float:
    return metric_value(parse_prometheus(requests.get(srv.metrics_url, timeout=5, headers=CLOSE).text), name)


def _until(predicate, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def test_full_queue_refuses_at_once_and_waiting_is_bounded(busy_server):
    """Failure 4: with the batch full and the queue full, a request is refused at once with "server busy" (HTTP, SSE
    and gRPC); one that waits longer than max_queue_s is ended the same way; both are counted in
    splitspec_refused_requests_total. The models send the error as UNAVAILABLE, but Triton 2.51's generate endpoints
    answer every error response of a model with HTTP 400 and its gRPC streams carry only the text (measured;
    docs/serving.md): the OpenAI front end turns "server busy" into 503."""
    srv = busy_server
    holder = _Holder(srv)
    holder.start()
    try:
        assert holder.started.wait(60), "the long request never started"
        waiting: dict = {}

        def wait_in_queue():
            t0 = time.monotonic()
            r = _post(srv.generate_url, SHORT)
            waiting["answer"] = (r.status_code, r.text, time.monotonic() - t0)

        waiter = threading.Thread(target=wait_in_queue, daemon=True)
        waiter.start()
        assert _until(lambda: _gauge(srv, "splitspec_queued_requests") >= 1), "the second request never queued"
        t0 = time.monotonic()
        r = _post(srv.generate_url, SHORT)
        refused_s = time.monotonic() - t0
        assert r.status_code == TRITON_MODEL_ERROR_STATUS and "server busy: 2 requests open" in r.json()["error"], r.text
        assert refused_s < 1.0, f"refusal took {refused_s:.2f} s"
        r = _post(srv.generate_stream_url, {**SHORT, "stream": True})
        assert r.status_code == TRITON_MODEL_ERROR_STATUS and "server busy" in r.text, (r.status_code, r.text[:300])
        got = _grpc(srv, grpc_inputs("def f(x):", 4, stream=True))
        assert got[-1][1] is not None and "server busy" in got[-1][1], got
        waiter.join(timeout=30)
        status, text, waited_s = waiting["answer"]
        assert status == TRITON_MODEL_ERROR_STATUS and "server busy: waited" in text and "max_queue_s" in text, text
        assert MAX_QUEUE_S <= waited_s < MAX_QUEUE_S + 2.0, waited_s
        assert holder.is_alive(), "the long request ended before the queued one timed out"
    finally:
        holder.release()
    assert _until(lambda: _gauge(srv, "splitspec_active_sequences") == 0), "the cancelled request kept its slot"
    assert _until(lambda: _gauge(srv, "splitspec_refused_requests_total") == 4, 2.0)
    m = parse_prometheus(requests.get(srv.metrics_url, timeout=10, headers=CLOSE).text)
    assert metric_value(m, "splitspec_refused_requests_total", reason="queue_full") == 3
    assert metric_value(m, "splitspec_refused_requests_total", reason="queue_timeout") == 1
    assert _post(srv.generate_url, SHORT).status_code == 200  # the queue drained: served again


def test_prompt_bytes_limit_of_the_rendered_repository(busy_server):
    """The byte limit is the engine's max_seq_len × PROMPT_BYTES_PER_TOKEN, written into preprocessing's config."""
    from splitspec.serving.repo import repo_setting

    assert repo_setting(busy_server.repo, "preprocessing", "max_prompt_bytes") == str(MAX_PROMPT_BYTES)
    assert np.isclose(float(repo_setting(busy_server.repo, "spec_decode", "max_queue_s")), MAX_QUEUE_S)
