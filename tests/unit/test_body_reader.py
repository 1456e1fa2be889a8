"""The body reader both HTTP front ends share, without a server: its Content-Length check, the size bound while
reading, the time bound, and a stream's own error passed on with the bytes read before it."""

from __future__ import annotations

import asyncio

import pytest

from splitspec.serving.body_reader import BodyReader
from splitspec.serving.http_bounds import Refusal


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


def test_a_body_is_read_whole_within_its_bounds():
    body = BodyReader(10, None)
    assert asyncio.run(body.read(_chunks(b"abcd", b"", b"efghij"))) == b"abcdefghij" and body.size == 10
    over = BodyReader(10, 3)
    e = _refusal(over.read(_chunks(b"abcd", b"efghijk", b"never read"), "decompressed request body"))
    assert (e.status, over.size) == (413, 11)
    assert e.message.startswith("decompressed request body exceeds the limit of 10 bytes (the largest JSON a prompt")


def test_a_stalled_body_is_408_and_a_stream_error_passes_with_the_size():
    stalled = BodyReader(100, None, timeout_s=0.05)
    e = _refusal(stalled.read(_chunks(b"abc", stall_s=10.0)))
    assert (e.status, e.message) == (408, "request body incomplete after 0.05 s (3 bytes received): send the whole "
                                          "body at once")
    cut = BodyReader(100, None)
    with pytest.raises(ConnectionResetError):
        asyncio.run(cut.read(_chunks(b"abcde", then=ConnectionResetError())))
    assert cut.size == 5
