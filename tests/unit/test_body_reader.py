"""The body reader both HTTP front ends share, without a server: its Content-Length check, the size bound while
reading, the time bound, a stream's own error passed on with the bytes read before it, and its decoding of gzip and
deflate (bounded; a stream that does not end cleanly refused), other encodings refused; and the OpenAI front end's
side of it, on a Starlette request."""

from __future__ import annotations

import asyncio
import gzip
import zlib

import pytest
from starlette.requests import Request

from splitspec.serving.body_reader import BodyReader
from splitspec.serving.http_bounds import Refusal
from splitspec.serving.openai_errors import APIError
from splitspec.serving.openai_http import error_response, read_body


async def _chunks(*parts: bytes, then: BaseException | None = None, stall_s: float = 0.0):
    for part in parts:
        yield part
    await asyncio.sleep(stall_s)
    if then is not None:
        raise then


def _refusal(coro) -> Refusal:
    with pytest.raises(Refusal) as e:
        asyncio.run(coro)
    return e.value


def test_content_length_is_checked_before_reading():
    body = BodyReader(100, 10)
    for fine in (None, "0", " 100 "):
        body.check_length(fine)
    for bad in ("x", "-1", "1e3", "\u00b2"):  # "²" is a digit to str.isdigit, not to int()
        with pytest.raises(Refusal) as e:
            body.check_length(bad)
        assert (e.value.status, e.value.message) == (400, f"Content-Length: expected a number of bytes, got {bad!r}")
    with pytest.raises(Refusal) as e:
        body.check_length("101")
    assert e.value.status == 413 and e.value.message.startswith("request body of 101 bytes exceeds the limit of 100")
    with pytest.raises(Refusal) as e:
        body.check_length(str(2 ** 64 - 1))  # a count an HTTP parser takes: too large, not malformed
    assert e.value.status == 413
    for absurd in (str(2 ** 64 + 1), "9" * 5000):  # past what aiohttp's parser takes; the second past int()'s too
        with pytest.raises(Refusal) as e:
            body.check_length(absurd)
        shown = repr(absurd) if len(absurd) <= 40 else repr(absurd[:40]) + "..."
        assert (e.value.status, e.value.message) == (400, f"Content-Length: {shown}: more than 2^64 - 1 bytes")


def test_a_body_is_read_whole_within_its_bounds():
    body = BodyReader(10, None)
    assert asyncio.run(body.read(_chunks(b"abcd", b"", b"efghij"))) == b"abcdefghij" and body.size == 10
    over = BodyReader(10, 3)
    e = _refusal(over.read(_chunks(b"abcd", b"efghijk", b"never read")))
    assert (e.status, over.size) == (413, 11)
    assert e.message.startswith("chunked request body exceeds the limit of 10 bytes (the largest JSON a prompt")


def test_a_stalled_body_is_408_and_a_stream_error_passes_with_the_size():
    stalled = BodyReader(100, None, timeout_s=0.05)
    e = _refusal(stalled.read(_chunks(b"abc", stall_s=10.0)))
    assert (e.status, e.message) == (408, "request body incomplete after 0.05 s (3 bytes received): send the whole "
                                          "body at once")
    cut = BodyReader(100, None)
    with pytest.raises(ConnectionResetError):
        asyncio.run(cut.read(_chunks(b"abcde", then=ConnectionResetError())))
    assert cut.size == 5


DOC = b'{"text_input": "def f(x):", "max_tokens": 2}' * 20


def _deflate(data: bytes, wbits: int) -> bytes:
    c = zlib.compressobj(9, zlib.DEFLATED, wbits)
    return c.compress(data) + c.flush()


def _read(encoding: str | None, data: bytes, limit: int = 100_000, step: int = 0) -> bytes:
    """``data`` sent with ``encoding``, whole or in chunks of ``step`` bytes, read back."""
    body = BodyReader(limit, 1000)
    body.check_encoding(encoding)
    parts = [data[i:i + step] for i in range(0, len(data), step)] if step else [data]
    return asyncio.run(body.read(_chunks(*parts)))


@pytest.mark.parametrize("step", [0, 1, 7])  # whole, and every chunk boundary
def test_gzip_and_both_deflates_are_decoded_across_chunks(step):
    assert _read("gzip", gzip.compress(DOC), step=step) == DOC
    assert _read(" GZIP ", gzip.compress(DOC[:10]) + gzip.compress(DOC[10:]), step=step) == DOC  # two members
    assert _read("deflate", zlib.compress(DOC), step=step) == DOC  # RFC 9110's: zlib-wrapped
    assert _read("deflate", _deflate(DOC, -15), step=step) == DOC  # what some clients send: raw
    assert _read("identity", DOC, step=step) == _read(None, DOC, step=step) == _read("", DOC, step=step) == DOC
    assert _read("gzip", b"") == _read("deflate", b"") == b""  # no body, whatever its encoding


def test_another_encoding_is_415_before_the_body_is_read():
    for bad in ("zstd", "br", "x-gzip", "gzip, gzip", "gzip, identity", "compress"):
        with pytest.raises(Refusal) as e:
            BodyReader(100, None).check_encoding(bad)
        assert (e.value.status, e.value.message) == (415, f"Content-Encoding: {bad!r}: expected one of identity, "
                                                          "gzip, deflate")


def test_a_compression_bomb_is_413_after_the_limits_worth():
    bomb = gzip.compress(b"\0" * 50_000_000, 9)  # 49 KB
    body = BodyReader(100_000, 1000)
    body.check_encoding("gzip")
    e = _refusal(body.read(_chunks(bomb)))
    assert e.status == 413 and e.message.startswith("decompressed request body exceeds the limit of 100000 bytes")
    empty_blocks = b"\x00\x00\x00\xff\xff" * 30_000  # raw deflate: 150 KB of empty stored blocks, decoding to 0
    body = BodyReader(100_000, None)
    body.check_encoding("deflate")
    e = _refusal(body.read(_chunks(empty_blocks[:80_000], empty_blocks[80_000:])))
    assert e.status == 413 and e.message.startswith("chunked request body exceeds")  # the bytes sent bound it too


def test_a_stream_that_does_not_end_cleanly_is_400_naming_content_encoding():
    gz = gzip.compress(DOC)
    bad_crc = gz[:-8] + bytes(4) + gz[-4:]
    cases = {("gzip", gz[:-8]): "it ends before its gzip stream does (cut short, or its trailer missing)",
             ("gzip", gz[:len(gz) // 2]): "it ends before its gzip stream does (cut short, or its trailer missing)",
             ("deflate", zlib.compress(DOC)[:-4]): "it ends before its deflate stream does (cut short, or its "
                                                   "trailer missing)",
             ("gzip", bad_crc): "not gzip data (Error -3 while decompressing data: incorrect data check)",
             ("gzip", DOC): "not gzip data (Error -3 while decompressing data: incorrect header check)",
             ("gzip", gz + b"GARBAGE"): "bytes after the end of its gzip stream that are not another gzip member",
             ("deflate", zlib.compress(DOC) + b"GARBAGE"): "bytes after the end of its deflate stream"}
    for (encoding, data), why in cases.items():
        for step in (0, 5):
            with pytest.raises(Refusal) as e:
                _read(encoding, data, step=step)
            assert (e.value.status, e.value.message) == (400, f"request body (Content-Encoding: {encoding}): {why}; "
                                                              f"expected one whole {encoding} stream"), step


def _openai_read(body: bytes, *encodings: str) -> bytes:
    """``body`` read by the OpenAI front end's :func:`read_body` from a Starlette request sent with ``encodings``
    (one ``Content-Encoding`` header each)."""
    headers = [(b"content-length", str(len(body)).encode())] + [(b"content-encoding", e.encode()) for e in encodings]
    sent = [{"type": "http.request", "body": body[:3], "more_body": True},
            {"type": "http.request", "body": body[3:], "more_body": False}]

    async def receive():
        return sent.pop(0)

    request = Request({"type": "http", "method": "POST", "path": "/v1/completions", "headers": headers}, receive)
    return asyncio.run(read_body(request, 100_000, 1000))


def test_the_openai_front_end_decodes_gzip_and_deflate_and_refuses_others_in_its_shape():
    assert _openai_read(gzip.compress(DOC), "gzip") == _openai_read(zlib.compress(DOC), "deflate") == DOC
    assert _openai_read(DOC) == DOC
    for encodings, status, code, start in ((("zstd",), 415, "unsupported_media_type", "Content-Encoding: 'zstd': "),
                                           (("gzip", "gzip"), 415, "unsupported_media_type", "Content-Encoding: 'gzip, "),
                                           (("gzip",), 400, None, "request body (Content-Encoding: gzip): not gzip")):
        with pytest.raises(APIError) as e:
            _openai_read(DOC, *encodings)
        error = e.value.body()["error"]
        assert (e.value.status, error["type"], error["param"], error["code"]) == (status, "invalid_request_error",
                                                                                  None, code)
        assert e.value.close and error_response(e.value).headers["connection"] == "close"  # the rest left unread
        assert error["message"].startswith(start), error
