"""The OpenAI front end's connections through real sockets (serving/openai_connection.py): a request with both
Content-Length and Transfer-Encoding refused and the request hidden behind it never answered.

Each test runs its own :class:`OpenAIServer` over the session's rendered repository; the Triton server behind it is
never started (its gRPC address is a free port)."""

from __future__ import annotations

import json
import socket

import pytest

from splitspec.serving.openai_api import OpenAIServer
from splitspec.serving.tritonserver import free_ports

pytestmark = pytest.mark.timeout(120)

BODY = b'{"model":"demo","prompt":"def f(x):","max_tokens":2}'
HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"


def _server(shared_server, **bounds) -> OpenAIServer:
    return OpenAIServer(shared_server.repo, f"127.0.0.1:{free_ports(1)[0]}", port=0, host="127.0.0.1", **bounds)


def _connect(api: OpenAIServer, timeout_s: float = 10) -> socket.socket:
    return socket.create_connection(("127.0.0.1", api.port), timeout=timeout_s)


def _read_until_closed(sock: socket.socket) -> tuple[bytes, bool]:
    """Everything the server sends until it closes the connection, and whether it did (False: the socket's timeout
    passed first)."""
    got = b""
    try:
        while chunk := sock.recv(65536):
            got += chunk
    except socket.timeout:
        return got, False
    except ConnectionResetError:
        pass
    return got, True


def _length(raw: bytes) -> int:
    return int(raw.lower().split(b"content-length: ")[1].split(b"\r\n")[0])


def _answer(raw: bytes) -> tuple[bytes, dict]:
    """The status line and headers (lower case) of the first answer in ``raw``, and its JSON body."""
    head, _, body = raw.partition(b"\r\n\r\n")
    return head.lower(), json.loads(body[:_length(head)])


def test_both_lengths_are_refused_and_the_hidden_request_is_never_answered(shared_server):
    """RFC 9112 §6.1: a body framed both by Content-Length and chunks was read by its chunks and the connection kept,
    so a request inside the bytes the Content-Length counted was answered too (two 200s on one connection)."""
    chunked = b"%x\r\n" % len(BODY) + BODY + b"\r\n0\r\n\r\n"
    hidden = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"
    with _server(shared_server) as api, _connect(api, 5) as sock:
        sock.sendall(HEAD + b"Content-Length: %d\r\nTransfer-Encoding: chunked\r\n\r\n" % len(chunked + hidden)
                     + chunked + hidden)
        raw, closed = _read_until_closed(sock)
    head, body = _answer(raw)
    assert closed and raw.count(b"HTTP/1.1 ") == 1 and b'"object":"list"' not in raw, raw
    assert head.startswith(b"http/1.1 400") and b"connection: close" in head and b"application/json" in head
    assert "both Content-Length and Transfer-Encoding" in body["error"]["message"]
    assert body["error"]["type"] == "invalid_request_error"
