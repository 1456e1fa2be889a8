"""Reading a request body within its size and time bounds, decoding its ``Content-Encoding``, the same for both HTTP
front ends: the HTTP guard in front of tritonserver (:mod:`splitspec.serving.http_guard`, aiohttp) and the
OpenAI-compatible API (:mod:`splitspec.serving.openai_http`, Starlette).

**Size.** A body whose ``Content-Length`` exceeds the limit is refused before a byte of it is read
(:meth:`BodyReader.check_length`); one without a length to trust (chunked) as soon as the bytes read pass the limit,
and a compressed one as soon as the bytes it decompresses to do (:meth:`BodyReader.read`). Both refusals are 413
(:func:`~splitspec.serving.http_bounds.check_length`, :func:`~splitspec.serving.http_bounds.check_read`).

**Encoding.** gzip and deflate are decoded here as the body arrives, bounded by the same limit
(:mod:`splitspec.serving.content_encoding`); another ``Content-Encoding`` is refused with 415 before the body is read
(:meth:`BodyReader.check_encoding`), a stream that does not decode or end cleanly with 400.

**Time.** Neither aiohttp nor uvicorn bounds how long a body takes to arrive: a client that sent its headers and then
stalled (a ``Content-Length`` never filled, a chunked body never ended) held its request open for good.
:meth:`BodyReader.read` gives the whole body ``timeout_s`` seconds, then refuses it with 408.

A front end hands over its framework's stream of chunks, as they came (its framework's own decoding off), and
answers each :class:`~splitspec.serving.http_bounds.Refusal` in its own protocol's error shape; the errors of its
framework's stream (a client gone, a malformed chunk) are its own to map, with :attr:`BodyReader.size` the bytes read
before them.
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterable

from splitspec.serving.content_encoding import Decoder, check_encoding
from splitspec.serving.http_bounds import MAX_CONTENT_LENGTH, Refusal, check_length, check_read, quoted
from splitspec.serving.server_limits import BODY_TIMEOUT_S


class BodyReader:
    """Reads one request body of at most ``limit`` bytes (as sent, and decoded from its ``Content-Encoding``), all of
    it within ``timeout_s`` seconds: :meth:`check_length` and :meth:`check_encoding` from its headers, then
    :meth:`read`.

    Args:
        limit: the largest body read, bytes (:func:`~splitspec.serving.server_limits.request_body_limit`).
        max_prompt_bytes: what ``limit`` was derived from, named in the 413's message (None: not known).
        timeout_s: seconds the whole body may take to arrive, from the start of :meth:`read`.
    """

    def __init__(self, limit: int, max_prompt_bytes: int | None, timeout_s: float = BODY_TIMEOUT_S):
        self.limit, self.max_prompt_bytes, self.timeout_s = limit, max_prompt_bytes, timeout_s
        #: bytes of the body read so far, as sent (compressed)
        self.size = 0
        #: the body's ``Content-Encoding`` (:meth:`check_encoding`)
        self.encoding = "identity"

    def check_length(self, header: str | None) -> None:
        """Refuse, before reading it, a body by its ``Content-Length`` ``header`` (None: not sent; :meth:`read` then
        bounds the body as it arrives).

        Raises:
            Refusal: 400, ``header`` is not a number of bytes, or one over
                :data:`~splitspec.serving.http_bounds.MAX_CONTENT_LENGTH` (as the HTTP guard's parser refuses it);
                413, it exceeds ``limit`` (:func:`~splitspec.serving.http_bounds.check_length`).
        """
        if header is None:
            return
        n = header.strip()
        if not (n.isascii() and n.isdigit()):
            raise Refusal(400, f"Content-Length: expected a number of bytes, got {quoted(header)}")
        if len(n) > len(str(MAX_CONTENT_LENGTH)) or int(n) > MAX_CONTENT_LENGTH:
            raise Refusal(400, f"Content-Length: {quoted(n)}: more than 2^64 - 1 bytes")
        check_length(int(n), self.limit, self.max_prompt_bytes)

    def check_encoding(self, header: str | None) -> None:
        """Take the body's ``Content-Encoding`` ``header`` (several headers joined with ``, ``; None: not sent) for
        :meth:`read` to decode, before reading it.

        Raises:
            Refusal: 415, an encoding other than identity, gzip and deflate
                (:func:`~splitspec.serving.content_encoding.check_encoding`).
        """
        self.encoding = check_encoding(header)

    async def read(self, chunks: AsyncIterable[bytes]) -> bytes:
        """The body, joined from ``chunks`` (a framework's stream of it, as sent) and decoded, counting :attr:`size`
        as they arrive.

        Raises:
            Refusal: 413 once the bytes read, or those they decompress to, pass ``limit``
                (:func:`~splitspec.serving.http_bounds.check_read`), the rest left unread; 400 when a compressed
                body does not decode or its stream does not end with the body
                (:class:`~splitspec.serving.content_encoding.Decoder`); 408 when the body is not complete
                ``timeout_s`` seconds after the start.
            Whatever ``chunks`` raises (its framework's errors, for the caller to map).
        """
        decoder = Decoder(self.encoding, self.limit, self.max_prompt_bytes)
        parts = []
        try:
            async with asyncio.timeout(self.timeout_s):
                async for chunk in chunks:
                    self.size += len(chunk)
                    check_read(self.size, self.limit, self.max_prompt_bytes)
                    parts.append(decoder.feed(chunk))
        except TimeoutError:
            raise Refusal(408, f"request body incomplete after {self.timeout_s:g} s ({self.size} bytes received): "
                               "send the whole body at once") from None
        decoder.end()
        return b"".join(parts)
