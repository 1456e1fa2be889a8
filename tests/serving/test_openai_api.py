"""The OpenAI-compatible front end (serving/openai_api.py) with the official ``openai`` client, over the session's
shared tritonserver (tests/conftest.py): greedy answers equal the direct gRPC answer for the same prompt (the chat
through the server's own template switch: an independent rendering), streaming in OpenAI's chunk format, stop strings,
seeded sampling, errors in OpenAI's error shape while serving goes on, and a client that disconnects mid-stream
freeing its slot in the engine."""

from __future__ import annotations

import json
import time

import pytest
import requests

from splitspec.serving.client import ask_grpc
from splitspec.serving.metrics import metric_value, parse_prometheus
from splitspec.serving.openai_api import OpenAIServer
from splitspec.serving.tritonserver import free_ports

openai = pytest.importorskip("openai")
pytestmark = [pytest.mark.server, pytest.mark.timeout(300)]

PROMPT = "def fibonacci(n):"
N = 12


@pytest.fixture(scope="module")
def served(shared_server):
    srv = shared_server.get()
    with OpenAIServer(srv.repo, srv.grpc_address, port=0, host="127.0.0.1") as api:
        yield srv, api


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[1].url, api_key="unused", max_retries=0, timeout=120)


def _post(api, path: str, body, **kw) -> requests.Response:
    data = body if isinstance(body, (str, bytes)) else json.dumps(body)
    with requests.Session() as s:
        s.trust_env = False
        return s.post(f"{api.url}{path}", data=data, headers={"Content-Type": "application/json", "Connection": "close"},
                      timeout=120, **kw)


def _scrape(srv) -> dict:
    return parse_prometheus(requests.get(srv.metrics_url, timeout=10).text)


def test_models_chat_and_completion_equal_the_grpc_answer(served, client):
    srv, api = served
    name = api.model.name
    assert [m.id for m in client.models.list().data] == [name]
    chat = client.chat.completions.create(model=name, messages=[{"role": "user", "content": PROMPT}], max_tokens=N,
                                          temperature=0)
    direct = ask_grpc(srv.grpc_address, PROMPT, N, apply_chat_template=True, return_stats=True)
    assert chat.choices[0].message.content == direct["text_output"] and chat.choices[0].message.role == "assistant"
    assert chat.choices[0].finish_reason == direct["finish_reason"]
    assert (chat.usage.prompt_tokens, chat.usage.completion_tokens) == (direct["num_input_tokens"], direct["num_output_tokens"])
    assert chat.usage.model_extra["acceptance_length"] >= 1.0 and chat.object == "chat.completion"
    comp = client.completions.create(model=name, prompt=PROMPT, max_tokens=N)
    raw = ask_grpc(srv.grpc_address, PROMPT, N)
    assert comp.choices[0].text == raw["text_output"] and comp.object == "text_completion"
    # a stop string that occurs in the greedy answer cuts it before the stop string
    stop = raw["text_output"][3:6]
    cut = client.completions.create(model=name, prompt=PROMPT, max_tokens=N, stop=[stop])
    assert cut.choices[0].text == raw["text_output"][:raw["text_output"].index(stop)] and cut.choices[0].finish_reason == "stop"


def test_streaming_chunks_fold_to_the_answer(served, client):
    srv, api = served
    messages = [{"role": "system", "content": "Answer in code."}, {"role": "user", "content": PROMPT}]
    whole = client.chat.completions.create(model=api.model.name, messages=messages, max_tokens=N)
    chunks = list(client.chat.completions.create(model=api.model.name, messages=messages, max_tokens=N, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant" and all(c.object == "chat.completion.chunk" for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert reasons == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert len({c.id for c in chunks}) == 1
    # on the wire: server-sent events ending with [DONE] (completions stream too)
    r = _post(api, "/completions", {"model": api.model.name, "prompt": PROMPT, "max_tokens": 4, "stream": True})
    events = [ln for ln in r.text.split("\n\n") if ln]
    assert r.headers["content-type"].startswith("text/event-stream") and events[-1] == "data: [DONE]"
    assert all(json.loads(e[6:])["object"] == "text_completion" for e in events[:-1])


def test_seeded_sampling_is_reproducible(served, client):
    name = served[1].model.name
    ask = lambda seed: client.completions.create(model=name, prompt=PROMPT, max_tokens=N, temperature=1.0,  # noqa: E731
                                                 top_p=0.95, seed=seed).choices[0].text
    a, b = ask(7), ask(7)
    assert a == b
    assert len({a, ask(8), ask(9)}) > 1  # the seed matters (random-weight model: near-uniform sampling)


BAD = [
    # (path, body, status, param or None, text in the message)
    ("/chat/completions", "{not json", 400, None, "JSON"),
    ("/chat/completions", {"model": "NAME", "messages": [{"role": "user", "content": "x"}], "max_tokens": "ten"}, 400,
     "max_tokens", "integer"),
    ("/chat/completions", {"model": "NAME", "messages": [{"role": "user", "content": "x"}], "n": 2}, 400, "n", "n = 2"),
    ("/chat/completions", {"model": "NAME", "messages": [{"role": "user", "content": "x"}], "logprobs": True}, 400,
     "logprobs", "not supported"),
    ("/chat/completions", {"model": "NAME", "messages": [{"role": "user", "content": "x"}], "foo": 1}, 400, "foo",
     "unrecognized"),
    # refused by the pipeline: param names the field the model's message is about
    ("/chat/completions", {"model": "NAME", "messages": [{"role": "user", "content": "x " * 400}]}, 400, "messages",
     "max_seq_len"),
    ("/completions", {"model": "NAME", "prompt": "x " * 400, "max_tokens": 4, "stream": True}, 400, "prompt",
     "max_seq_len"),
    ("/chat/completions", {"model": "NAME", "messages": [{"role": "user", "content": "x" * 20000}]}, 400, "messages",
     "bytes, at most 8192"),  # refused by the front end: without max_tokens it would tokenise the prompt
    ("/completions", {"model": "NAME", "prompt": "x" * 20000, "max_tokens": 4}, 400, "prompt", "at most 8192"),  # models
    ("/chat/completions", {"model": "NAME", "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 5000},
     400, "max_completion_tokens", "max_tokens = 5000: expected 1.."),
    ("/completions", {"model": "NAME", "prompt": "x", "max_tokens": 2, "temperature": 0.0005}, 400, "temperature",
     "temperature = 0.0005"),
    # lone surrogates (were 500), nesting past 64 (50,000 deep was a 500), two max_tokens (the second was ignored)
    ("/chat/completions", '{"model": "NAME", "messages": [{"role": "user", "content": "a\\ud800"}]}', 400,
     "messages[0].content", "messages[0].content: a lone UTF-16 surrogate at character 1"),
    ("/completions", '{"model": "NAME", "prompt": "x", "stop": ["\\udfff"]}', 400, "stop[0]", "lone UTF-16 surrogate"),
    ("/completions", '{"model": "NAME", "prompt": ' + "[" * 50_000 + "]" * 50_000 + "}", 400, None,
     "nests arrays and objects 50001 levels deep, at most 64"),
    ("/chat/completions", {"model": "NAME", "messages": [{"role": "user", "content": "x"}], "max_tokens": 4,
                           "max_completion_tokens": 5}, 400, "max_tokens", "two different limits"),
    ("/completions", {"model": "gpt-4", "prompt": "x"}, 404, "model", "gpt-4"),
    ("/nowhere", {}, 404, None, "Not Found"),
]


def test_errors_have_openai_shape_and_serving_continues(served, client):
    srv, api = served
    for path, body, status, param, needle in BAD:
        body = body.replace("NAME", api.model.name) if isinstance(body, str) else json.loads(
            json.dumps(body).replace('"NAME"', json.dumps(api.model.name)))
        r = _post(api, path, body)
        err = r.json()["error"]
        assert (r.status_code, err["param"]) == (status, param), (path, body, r.text)
        assert needle in err["message"] and set(err) == {"message", "type", "param", "code"}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=api.model.name, messages=[{"role": "user", "content": "x"}], n=2)
    assert e.value.body["param"] == "n"
    ok = client.completions.create(model=api.model.name, prompt="x", max_tokens=2)
    assert ok.usage.completion_tokens == 2


def test_unreachable_server_is_503(served):
    srv, _ = served
    with OpenAIServer(srv.repo, f"127.0.0.1:{free_ports(1)[0]}", port=0, host="127.0.0.1") as dead:
        r = _post(dead, "/completions", {"model": dead.model.name, "prompt": "x", "max_tokens": 2})
    assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_mid_request_frees_the_engine(served, stream):
    """A client that goes away (mid-stream, or while waiting for a whole answer) cancels its request in the engine:
    counted as cancelled (a finished one would count as length), its slot and KV blocks freed."""
    srv, api = served
    cancelled = lambda m: metric_value(m, "splitspec_requests_total", finish_reason="cancelled")  # noqa: E731
    before = _scrape(srv)
    body = {"model": api.model.name, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 200, "stream": stream}
    with requests.Session() as s:
        s.trust_env = False
        if stream:
            r = s.post(f"{api.url}/chat/completions", stream=True, timeout=60, json=body)
            lines = r.iter_lines()
            got = [next(lines) for _ in range(6)]  # role chunk, a few cycles' text (blank separators between)
            assert any(b"content" in ln for ln in got)
            r.close()
        else:
            with pytest.raises(requests.Timeout):
                s.post(f"{api.url}/chat/completions", timeout=(5, 0.4), json=body)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        m = _scrape(srv)
        if metric_value(m, "splitspec_active_sequences") == 0 and cancelled(m) > cancelled(before):
            break
        time.sleep(0.1)
    else:
        raise AssertionError("the disconnected client's request was not cancelled in the engine")
    assert metric_value(m, "splitspec_kv_used_blocks") == 0


def _raw_request(api, head: str, body_parts=(), timeout_s: float = 10) -> tuple[bytes, float]:
    """Send ``head`` (the request line and headers) and ``body_parts`` on a socket of their own; return the answer's
    bytes (read until the server closes) and the seconds from the last byte sent to the answer's first."""
    import socket

    with socket.create_connection(("127.0.0.1", api.port), timeout=timeout_s) as sock:
        sock.sendall(head.encode())
        for part in body_parts:
            sock.sendall(part)
        t0, got = time.monotonic(), b""
        took = None
        while chunk := sock.recv(65536):
            took = time.monotonic() - t0 if took is None else took
            got += chunk
    return got, took


def test_an_oversized_body_is_refused_before_it_is_read(served, client):
    """A body beyond the largest a prompt of max_prompt_bytes can take in JSON is refused with 413 in OpenAI's error
    shape: by its Content-Length before any of it is sent, and a chunked one as soon as its chunks pass the limit;
    the front end keeps serving."""
    from splitspec.serving.server_limits import request_body_limit

    srv, api = served
    limit = request_body_limit(api.model.max_prompt_bytes)
    assert api.model.max_body_bytes == limit and limit == 6 * 8192 + 65536
    size = 200 * 10**6
    answer, took = _raw_request(api, f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                                     f"Content-Length: {size}\r\n\r\n")  # nothing of the body is ever sent
    status, _, body = answer.partition(b"\r\n\r\n")
    print(f"\n200 MB Content-Length refused after {took * 1000:.1f} ms")
    assert status.startswith(b"HTTP/1.1 413") and b"connection: close" in status.lower(), answer[:300]
    err = json.loads(body)["error"]
    assert err["code"] == "request_too_large" and err["type"] == "invalid_request_error"
    assert f"request body of {size} bytes exceeds the limit of {limit} bytes" in err["message"]
    assert "max_prompt_bytes = 8192" in err["message"] and took < 1.0
    # chunked: every chunk up to just past the limit is read, then the answer comes without the rest
    piece = b"x" * 16384
    chunks = [b"%x\r\n%s\r\n" % (len(piece), piece)] * (limit // len(piece) + 1)
    t0 = time.monotonic()
    answer, _ = _raw_request(api, "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                                  "Transfer-Encoding: chunked\r\n\r\n", chunks)
    print(f"chunked body of {len(chunks) * len(piece)} bytes refused after {(time.monotonic() - t0) * 1000:.1f} ms")
    assert answer.startswith(b"HTTP/1.1 413"), answer[:300]
    assert "chunked request body exceeds the limit" in json.loads(answer.partition(b"\r\n\r\n")[2])["error"]["message"]
    # a body at the limit is read (and refused for what it holds), and serving goes on
    r = _post(api, "/completions", b'{"model": "x", "prompt": "' + b" " * (limit - 40) + b'"}')
    assert r.status_code == 404 and r.json()["error"]["param"] == "model", r.text[:300]
    assert client.completions.create(model=api.model.name, prompt="x", max_tokens=2).usage.completion_tokens == 2


def test_a_stalled_body_is_answered_408_and_a_malformed_one_400(served, caplog):
    """A client that sends its headers and then stalls (a Content-Length never filled, a chunked body never ended)
    gets 408 ``request_timeout`` once ``body_timeout_s`` has passed, and the connection is closed; before, each held
    its request open for good. A malformed chunk is refused by uvicorn's h11 parser at once (400)."""
    srv, _ = served
    head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    with OpenAIServer(srv.repo, f"127.0.0.1:{free_ports(1)[0]}", port=0, host="127.0.0.1", body_timeout_s=1) as api:
        for extra, part, received in (("Content-Length: 100\r\n\r\n", b'{"model": "x"', 13),
                                      ("Transfer-Encoding: chunked\r\n\r\n", b'5\r\n{"a":\r\n', 5)):
            answer, took = _raw_request(api, head + extra, [part])
            status, _, body = answer.partition(b"\r\n\r\n")
            print(f"\nstalled body ({extra.split(':')[0]}) answered after {took:.2f} s")
            assert status.startswith(b"HTTP/1.1 408") and b"connection: close" in status.lower(), answer[:300]
            err = json.loads(body)["error"]
            assert err["code"] == "request_timeout" and err["type"] == "invalid_request_error"
            assert err["message"].startswith(f"request body incomplete after 1 s ({received} bytes received)")
            assert 0.9 < took < 3
        answer, took = _raw_request(api, head + "Transfer-Encoding: chunked\r\n\r\n", [b"zz\r\n"])
        assert answer.startswith(b"HTTP/1.1 400") and took < 1, answer[:300]
    assert "internal error" not in caplog.text


def test_draining_refuses_new_requests_and_lets_open_streams_finish(served, monkeypatch):
    """The front end's part in a graceful stop, against a stand-in ensemble that streams for ~1 s: after drain() a
    new request gets 503 in OpenAI's error shape at once, the open stream still gets its last chunk and [DONE], and
    wait_idle() returns once it has (tests/serving/test_faults_supervision.py runs the whole order under serve)."""
    from splitspec.serving.ensemble_stream import EnsembleStream

    async def stand_in(self, text, max_tokens, params):
        import asyncio

        for _ in range(20):
            await asyncio.sleep(0.05)
            yield {"text_output": "a"}
        yield {"text_output": "b", "finish_reason": "length", "num_input_tokens": 3, "num_output_tokens": 21}

    monkeypatch.setattr(EnsembleStream, "stream", stand_in)
    srv, _ = served
    with OpenAIServer(srv.repo, f"127.0.0.1:{free_ports(1)[0]}", port=0, host="127.0.0.1") as api:
        body = {"model": api.model.name, "prompt": PROMPT, "max_tokens": 21, "stream": True}
        with requests.Session() as s:
            s.trust_env = False
            r = s.post(f"{api.url}/completions", json=body, stream=True, timeout=30)
            lines = r.iter_lines()
            assert next(ln for ln in lines if ln).startswith(b"data: {")  # streaming
            api.drain()
            refused = _post(api, "/completions", {**body, "stream": False})
            left_now, left = api.gate.active, api.wait_idle(10)
            events = [ln for ln in lines if ln]
        assert refused.status_code == 503 and refused.headers["connection"] == "close", refused.text
        assert refused.json()["error"] == {"message": "the server is shutting down: not admitting new requests",
                                           "type": "service_unavailable", "param": None, "code": "service_unavailable"}
        assert (left_now, left) == (1, 0)
        assert events[-1] == b"data: [DONE]" and json.loads(events[-2][6:])["choices"][0]["finish_reason"] == "length"
