"""The HTTP guard in front of a stand-in for tritonserver (a small aiohttp app in this process): what it forwards
unchanged, what it refuses and how, streams passed on event by event, a client's disconnect reaching upstream,
tritonserver down or breaking off, and a stop that idle keep-alive clients do not hold."""

from __future__ import annotations

import asyncio
import gzip
import json
import re
import socket
import threading
import time
import zlib

import pytest
import requests
from aiohttp import web

from splitspec.errors import ConfigError
from splitspec.serving.guard_server import QuietLog
from splitspec.serving.http_guard import HttpGuard
from splitspec.serving.tritonserver import free_ports

LIMIT = 100_000


class Upstream:
    """A stand-in for tritonserver's HTTP: ``/sse`` streams 50 events 0.1 s apart (``cancelled`` is set when its
    client goes), ``/broken`` sends one event and drops the connection, anything else echoes what it got."""

    def __init__(self, port: int):
        self.port, self.seen, self.cancelled = port, [], threading.Event()
        started = threading.Event()
        threading.Thread(target=self._run, args=(started,), daemon=True).start()
        assert started.wait(10)

    def _run(self, started):
        async def echo(request):
            body = await request.read()
            self.seen.append({"path": request.raw_path, "method": request.method, "headers": dict(request.headers),
                              "body": body})
            return web.json_response({"got": len(body)}, status=201, headers={"X-From": "upstream"})

        async def sse(request):
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            try:
                for i in range(50):
                    await resp.write(f"data: {i}\n\n".encode())
                    await asyncio.sleep(0.1)
            except asyncio.CancelledError:
                self.cancelled.set()
                raise
            return resp

        async def broken(request):
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            await resp.write(b"data: 0\n\n")
            await asyncio.sleep(0.1)
            request.transport.close()
            return resp

        app = web.Application(handler_args={"handler_cancellation": True})
        app.router.add_get("/sse", sse)
        app.router.add_get("/broken", broken)
        app.router.add_route("*", "/{tail:.*}", echo)
        loop = asyncio.new_event_loop()
        runner = web.AppRunner(app)
        loop.run_until_complete(runner.setup())
        loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", self.port).start())
        started.set()
        loop.run_forever()


@pytest.fixture(scope="module")
def upstream():
    return Upstream(free_ports(1)[0])


@pytest.fixture
def guard(upstream):
    with HttpGuard(0, upstream.port, LIMIT, max_prompt_bytes=1000) as g:
        yield g


def test_requests_and_answers_pass_unchanged(guard, upstream):
    """Method, path, query, the admin key and other headers reach upstream; hop-by-hop headers (and one the
    Connection header names) do not; status, headers and body come back as upstream sent them."""
    r = requests.put(f"{guard.url}/v2/repository/index?a=1&b=%20x", data=b'{"k": [1, 2]}',
                     headers={"splitspec-admin-key": "key-1234567890abcdef", "Content-Type": "application/json",
                              "Connection": "keep-alive, X-Hop", "X-Hop": "1", "Keep-Alive": "timeout=5"})
    assert (r.status_code, r.json(), r.headers["X-From"]) == (201, {"got": 13}, "upstream")
    seen = upstream.seen[-1]
    assert (seen["method"], seen["path"], seen["body"]) == ("PUT", "/v2/repository/index?a=1&b=%20x", b'{"k": [1, 2]}')
    assert seen["headers"]["splitspec-admin-key"] == "key-1234567890abcdef"
    assert seen["headers"]["Content-Type"] == "application/json"
    assert not {"X-Hop", "Keep-Alive"} & seen["headers"].keys(), seen["headers"]
    r = requests.get(f"{guard.url}/v2/health/live")
    assert r.status_code == 201 and upstream.seen[-1]["body"] == b"" and upstream.seen[-1]["method"] == "GET"


def test_refusals_are_triton_errors_and_never_reach_upstream(guard, upstream):
    before = len(upstream.seen)
    r = requests.post(f"{guard.url}/v2/models/ensemble/generate", data=b"x" * (LIMIT + 1))
    assert r.status_code == 413 and r.headers["Connection"] == "close"
    assert r.json() == {"error": f"request body of {LIMIT + 1} bytes exceeds the limit of {LIMIT} bytes (the largest "
                                 "JSON a prompt of max_prompt_bytes = 1000 can take)"}
    sent = []
    chunks = (sent.append(1) or b"y" * 100_000 for _ in range(200))  # chunked: 20 MB if all were read
    r = requests.post(f"{guard.url}/v2/models/ensemble/generate", data=chunks)
    assert r.status_code == 413 and r.json()["error"].startswith("chunked request body exceeds the limit of 100000")
    assert len(sent) < 200, "the rest of the refused body was read: the connection should have closed"
    r = requests.post(f"{guard.url}/v2/models/ensemble/generate", data=b"[" * 40_000 + b"]" * 40_000)
    assert r.status_code == 400 and "nests 40000 levels deep, at most 32" in r.json()["error"]
    for path in ("generate", "generate_stream", "versions/1/generate"):  # Triton would flatten [["a"]] to ["a"]
        r = requests.post(f"{guard.url}/v2/models/ensemble/{path}", json={"text_input": "x", "stop_words": [["a"]]})
        assert r.status_code == 400 and r.json()["error"].startswith("stop_words: expected a string or an array of")
    r = requests.post(f"{guard.url}/v2/models/ensemble/generate", json={"text_input": "hi", "max_tokens": "ten"})
    assert r.status_code == 400 and r.json() == {"error": "max_tokens: expected an integer (INT32), got a string"}
    assert len(upstream.seen) == before  # tritonserver answered that with a 500
    r = requests.post(f"{guard.url}/v2/models/ensemble/generate", json={"text_input": "x", "stop_words": ["a"]})
    assert r.status_code == 201 and len(upstream.seen) == before + 1
    form = {"Content-Type": "application/x-www-form-urlencoded"}  # curl -d: forwarded within the limit
    r = requests.post(f"{guard.url}/v2/models/ensemble/generate", data=b'{"text_input": "x"}', headers=form)
    assert r.status_code == 201 and upstream.seen[-1]["headers"]["Content-Type"] == form["Content-Type"]
    r = requests.post(f"{guard.url}/v2/models/ensemble/generate", data=b"z" * (LIMIT + 1), headers=form)
    assert r.status_code == 413


def test_compressed_bodies_are_bounded_decompressed(guard, upstream):
    """A gzip or deflate body is decompressed here, bounded and scanned as such, and forwarded decompressed: a 2 KB
    body that decompresses to a million levels (or past the limit) is refused; one cut short or with bytes after its
    end is 400 (aiohttp's own decoder forwarded what it had); an encoding tritonserver does not take is 415."""
    gz = {"Content-Encoding": "gzip"}
    doc = b'{"text_input": "hi"}'
    for data, encoding in ((gzip.compress(doc), "gzip"), (zlib.compress(doc), "deflate"),
                           (zlib.compress(doc)[2:-4], "Deflate")):  # raw deflate, as some clients send it
        r = requests.post(f"{guard.url}/x", data=data, headers={"Content-Encoding": encoding})
        assert r.status_code == 201 and upstream.seen[-1]["body"] == doc
        assert "Content-Encoding" not in upstream.seen[-1]["headers"]
    r = requests.post(f"{guard.url}/x", data=gzip.compress(b"[" * 50_000 + b"]" * 50_000), headers=gz)
    assert r.status_code == 400 and "nests 50000 levels" in r.json()["error"]
    r = requests.post(f"{guard.url}/x", data=gzip.compress(b" " * 10_000_000), headers=gz)
    assert r.status_code == 413 and r.json()["error"].startswith("decompressed request body exceeds the limit")
    before = len(upstream.seen)
    for bad in (b"not gzip", gzip.compress(doc)[:-8], gzip.compress(doc)[:12], gzip.compress(doc) + b"GARBAGE"):
        r = requests.post(f"{guard.url}/v2/models/m/infer", data=bad, headers=gz)
        assert r.status_code == 400 and r.json()["error"].startswith("request body (Content-Encoding: gzip): ")
    for encoding in ("br", "zstd", "x-gzip", "gzip, gzip"):
        r = requests.post(f"{guard.url}/x", data=b"{}", headers={"Content-Encoding": encoding})
        assert r.status_code == 415 and r.headers.get("Connection") == "close", (r.text, r.headers)  # body unread
        assert r.json() == {"error": f"Content-Encoding: {encoding!r}: expected one of identity, gzip, deflate"}
    assert len(upstream.seen) == before


def test_an_empty_generate_body_is_400_here(guard, upstream):
    """tritonserver answers an empty generate body 500 (``document is empty``); elsewhere an empty body passes."""
    before = len(upstream.seen)
    for data, headers in ((b"", {}), (iter([]), {}), (gzip.compress(b""), {"Content-Encoding": "gzip"})):
        r = requests.post(f"{guard.url}/v2/models/ensemble/generate", data=data, headers=headers)
        assert r.status_code == 400 and r.json()["error"].startswith("request body: empty; expected a JSON object")
    assert len(upstream.seen) == before
    assert requests.post(f"{guard.url}/v2/repository/index", data=b"").status_code == 201


def test_a_stream_passes_event_by_event_and_a_disconnect_reaches_upstream(guard, upstream):
    upstream.cancelled.clear()
    t0 = time.monotonic()
    with requests.get(f"{guard.url}/sse", stream=True, timeout=10) as r:
        assert r.headers["Content-Type"] == "text/event-stream"
        events = []
        for line in r.iter_lines():
            if line:
                events.append((line, time.monotonic() - t0))
            if len(events) == 3:
                break
    assert [e for e, _ in events] == [b"data: 0", b"data: 1", b"data: 2"]
    assert events[2][1] < 2.0, events  # the whole stream takes 5 s
    assert upstream.cancelled.wait(5), "upstream's stream went on after its client left"
    assert guard.wait_idle(5) == 0


def test_tritonserver_down_or_breaking_off(upstream):
    with HttpGuard(0, free_ports(1)[0], LIMIT) as g:
        r = requests.get(f"{g.url}/v2/health/ready")
        assert r.status_code == 503 and "not reachable" in r.json()["error"] and "retry later" in r.json()["error"]
    with HttpGuard(0, upstream.port, LIMIT) as g:
        with pytest.raises(requests.exceptions.ChunkedEncodingError):  # cut, not ended as if complete
            with requests.get(f"{g.url}/broken", stream=True, timeout=10) as r:
                list(r.iter_lines())
        assert requests.get(f"{g.url}/x").status_code == 201  # and the guard serves on


def test_stop_is_not_held_by_an_idle_keep_alive_client(upstream):
    g = HttpGuard(0, upstream.port, LIMIT).start()
    with requests.Session() as s:
        assert s.get(f"{g.url}/x").status_code == 201  # its connection stays open, idle
        t0 = time.monotonic()
        g.stop(grace_s=30)
        assert time.monotonic() - t0 < 2.0
        with pytest.raises(requests.ConnectionError):
            s.get(f"{g.url}/x", timeout=2)
    g.stop()  # twice: nothing


def test_a_stalled_body_is_answered_408_and_its_connection_closed(upstream):
    with HttpGuard(0, upstream.port, LIMIT, body_timeout_s=0.3) as g, socket.create_connection(("127.0.0.1", g.port)) as s:
        s.sendall(b"POST /v2/models/ensemble/generate HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n" + b"{" * 10)
        s.settimeout(5)
        answer = b""
        while chunk := s.recv(4096):  # to the end: the guard closes the connection
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 ") and b"Connection: close" in head, answer
    assert json.loads(body) == {"error": "request body incomplete after 0.3 s (10 bytes received): send the whole body "
                                         "at once"}


def test_a_taken_port_is_a_config_error(upstream):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError, match=f"http_port = {port}: cannot listen on 127.0.0.1:{port}"):
            HttpGuard(port, upstream.port, LIMIT).start()


def test_json_error_shape_of_a_bad_binary_header(guard):
    r = requests.post(f"{guard.url}/v2/models/m/infer", data=b'{"inputs": []}',
                      headers={"Inference-Header-Content-Length": "99"})
    assert r.status_code == 400 and json.loads(r.text)["error"].startswith("Inference-Header-Content-Length: '99'")


def _closed_within(s: socket.socket, timeout_s: float) -> bytes:
    """What the guard sent on ``s`` until it closed (or reset) the connection (fails after ``timeout_s``)."""
    s.settimeout(timeout_s)
    got = b""
    try:
        while chunk := s.recv(4096):
            got += chunk
    except ConnectionResetError:
        pass
    return got


def test_a_connection_without_a_whole_request_head_is_closed_and_a_stream_is_not_cut(upstream):
    with HttpGuard(0, upstream.port, LIMIT, header_timeout_s=0.3) as g:
        with socket.create_connection(("127.0.0.1", g.port)) as idle, \
                socket.create_connection(("127.0.0.1", g.port)) as partial:
            partial.sendall(b"GET /x HTTP/1.1\r\nHost: x\r\n")
            t0 = time.monotonic()
            assert _closed_within(idle, 3) == b"" and _closed_within(partial, 3) == b""
            assert 0.25 < time.monotonic() - t0 < 2.0
        with requests.Session() as s:
            with s.get(f"{g.url}/sse", stream=True, timeout=10) as r:  # 1.2 s of events: 4 header timeouts
                events = [line for line, _ in zip(r.iter_lines(), range(24)) if line]
            assert events[-1] == b"data: 11"
            time.sleep(0.6)  # idle after its answer: closed
            assert g.connections == 0


def test_connections_past_the_cap_are_closed_at_once(upstream):
    with HttpGuard(0, upstream.port, LIMIT, max_connections=2) as g:
        held = [socket.create_connection(("127.0.0.1", g.port)) for _ in range(2)]
        try:
            while g.connections < 2:
                time.sleep(0.01)
            with socket.create_connection(("127.0.0.1", g.port)) as more:
                more.sendall(b"GET /x HTTP/1.1\r\nHost: x\r\n\r\n")
                assert _closed_within(more, 3) == b""
            assert g._server.refused == 1
        finally:
            for s in held:
                s.close()
        while g.connections:
            time.sleep(0.01)
        assert requests.get(f"{g.url}/x").status_code == 201  # room again


def test_head_is_asked_as_get_and_answered_without_a_body(guard, upstream):
    r = requests.head(f"{guard.url}/v2/health/live")
    assert (r.status_code, r.content, r.headers["Content-Length"], r.headers["X-From"]) == (201, b"", "10", "upstream")
    assert upstream.seen[-1]["method"] == "GET"
    assert requests.get(f"{guard.url}/x").status_code == 201  # the connection to upstream was not broken


#: Request heads aiohttp's parser refuses before the guard sees them → the reason it gives.
MALFORMED = {b"Content-Length: -1\r\n\r\n{}": "Invalid character in Content-Length: b'Content-Length: -1'",
             b"Content-Length: +2\r\n\r\n{}": "Invalid character in Content-Length: b'Content-Length: +2'",
             "Content-Length: \u00b2\r\n\r\n{}".encode(): "Invalid character in Content-Length: b'Content-Length: "
                                                           "\\xc2\\xb2'",
             b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n": "Transfer-Encoding can't be "
                                                                               "present with Content-Length",
             b"Transfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n": "Invalid character in chunk size: b'zz'",
             b"X-Big: " + b"A" * 8000 + b"\x01\r\nContent-Length: 2\r\n\r\n{}": "Invalid header value char: "
                                                                           "b'X-Big: AAAA"}


def test_malformed_requests_are_one_line_json_errors_logged_one_line_a_second(upstream, capsys, caplog):
    """aiohttp answered these with a text/plain 400 echoing the bytes, and logged each with a traceback: 530 bytes
    of log a request, 16.5 KB for the 8 KB header. Its status line said HTTP/1.0 (the request's version unknown)."""
    with HttpGuard(0, upstream.port, LIMIT) as g:
        g.log.every_s = 60  # one line per kind, however slow the machine
        for head, why in MALFORMED.items():
            for _ in range(5):
                with socket.create_connection(("127.0.0.1", g.port)) as s:
                    s.sendall(b"POST /v2/models/ensemble/generate HTTP/1.1\r\nHost: x\r\n" + head)
                    answer = _closed_within(s, 3)  # the guard closes the connection after it
                status, _, rest = answer.partition(b"\r\n")
                headers, _, body = rest.partition(b"\r\n\r\n")
                assert status == b"HTTP/1.1 400 Bad Request" and b"Content-Type: application/json" in headers, answer
                assert b"Connection: close" in headers, answer
                error = json.loads(body)["error"]
                assert re.match(r"malformed HTTP request \(\w+\): ", error) and why in error and len(error) <= 170, error
        # a reason that is all the client's text (a CONNECT's authority) makes no kind of its own
        for i in range(20):
            with socket.create_connection(("127.0.0.1", g.port)) as s:
                s.sendall(f"CONNECT h{i}{'x' * 110}:99999999 HTTP/1.1\r\nHost: x\r\n\r\n".encode())
                assert _closed_within(s, 3).startswith(b"HTTP/1.1 400 ")
        lines = capsys.readouterr().err.splitlines()
    kinds = [re.search(r"malformed request \((\w+)\): ", line).group(1) for line in lines]
    assert len(kinds) == len(set(kinds)) and 2 <= len(kinds) <= len(MALFORMED) + 1, lines  # one line per kind
    assert not [r for r in caplog.records if r.name.startswith("aiohttp")]
    for line in lines:
        assert line.startswith("splitspec serve: HTTP guard: 400 to 127.0.0.1: malformed request (") and len(line) < 220, line
    assert sum(why in "".join(lines) for why in MALFORMED.values()) >= len(kinds) - 1  # each line names its reason
    # the stop says what was left out since each kind's line: 50 requests in all
    flushed = capsys.readouterr().err.splitlines()
    counts = [re.search(r" \((\d+) more since the last line\)$", line) for line in flushed]
    assert len(lines) + sum(1 + int(m.group(1)) if m else 1 for m in counts) == 5 * len(MALFORMED) + 20, flushed


def test_loop_errors_are_logged_one_line_a_second_at_most(capsys):
    log = QuietLog(every_s=60)
    for _ in range(3):
        log(None, {"message": "socket.accept() out of system resource", "exception": OSError(24, "Too many open files")})
    log.keys[next(iter(log.keys))][0] -= 61
    log(None, {"message": "socket.accept() out of system resource", "exception": OSError(24, "Too many open files")})
    lines = capsys.readouterr().err.splitlines()
    line = "splitspec serve: HTTP guard: socket.accept() out of system resource: OSError: [Errno 24] Too many open files"
    assert lines == [line, f"{line} (2 more since the last line)"]


#: Chunked bodies going bad after a first good chunk, in a later packet → the parser's reason.
BROKEN_LATER = {b"zz\r\n{}\r\n0\r\n\r\n": "Invalid character in chunk size",
                b"2\r\n{}XX0\r\n\r\n": "Expected LF after chunk data",
                b"2\r\n{}\r\n0\r\n\x01bad\r\n\r\n": "Invalid header token"}


def test_a_chunk_going_bad_in_a_later_packet_is_400_at_once(upstream):
    """aiohttp's C parser dropped a body whose chunk went bad after it had started, without ending it: the request
    waited for the 408 of the body timeout (30 s)."""
    with HttpGuard(0, upstream.port, LIMIT, body_timeout_s=20) as g:
        for later, why in BROKEN_LATER.items():
            with socket.create_connection(("127.0.0.1", g.port)) as s:
                s.sendall(b"POST /v2/models/ensemble/generate HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                          b"2\r\n{}\r\n")
                time.sleep(0.1)  # the body has started when the bad bytes arrive
                t0 = time.monotonic()
                s.sendall(later)
                answer = _closed_within(s, 5)
                assert time.monotonic() - t0 < 2
            head, _, body = answer.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 400 ") and b"Connection: close" in head, answer
            error = json.loads(body)["error"]
            assert error.startswith("request body: ") and why in error and "\n" not in error, error


def test_an_absurd_content_length_is_400_naming_the_value(guard):
    """As at the OpenAI front end (tests/serving/test_openai_connection.py): 2^64 + 1 and longer are 400, not 413."""
    for value in ("-1", str(2 ** 64 + 1), "9" * 300, "1e3", "5, 6"):
        with socket.create_connection(("127.0.0.1", guard.port)) as s:
            s.sendall(b"POST /x HTTP/1.1\r\nHost: x\r\nContent-Length: %s\r\n\r\n{}" % value.encode())
            answer = _closed_within(s, 3)
        assert answer.startswith(b"HTTP/1.1 400 "), answer
        error = json.loads(answer.partition(b"\r\n\r\n")[2])["error"]
        assert "Content-Length" in error and value[:40] in error and len(error) < 170, error
    with socket.create_connection(("127.0.0.1", guard.port)) as s:
        s.sendall(b"POST /x HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n{}" % (2 ** 64 - 1))
        assert _closed_within(s, 3).startswith(b"HTTP/1.1 413 ")  # a count the parser takes: too large
