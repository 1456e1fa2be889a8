"""Reading a request body within its size and time bounds, the same for both HTTP front ends: the HTTP guard in
front of tritonserver (:mod:`splitspec.serving.http_guard`, aiohttp) and the OpenAI-compatible API
(:mod:`splitspec.serving.openai_http`, Starlette).

**Size.** A body whose ``Content-Length`` exceeds the limit is refused before a byte of it is read
(:meth:`BodyReader.check_length`); one without a length to trust (chunked, or decompressed while it is read) as soon
as the bytes read pass the limit (:meth:`BodyReader.read`). Both refusals are 413
(:func:`~splitspec.serving.http_bounds.check_length`, :func:`~splitspec.serving.http_bounds.check_read`).

**Time.** Neither aiohttp nor uvicorn bounds how long a body takes to arrive: a client that sent its headers and then
stalled (a ``Content-Length`` never filled, a chunked body never ended) held its request open for good.
:meth:`BodyReader.read` gives the whole body ``timeout_s`` seconds, then refuses it with 408.

A front end hands over its framework's stream of chunks and answers each
:class:`~splitspec.serving.http_bounds.Refusal` in its own protocol's error shape; the errors of its framework's
stream (a client gone, a malformed chunk, compression that does not decompress) are its own to map, with
:attr:`BodyReader.size` the bytes read before them.
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterable

from splitspec.serving.http_bounds import Refusal, check_length, check_read
from splitspec.serving.server_limits import BODY_TIMEOUT_S


class BodyReader:
    """Reads one request body of at most ``limit`` bytes, all of it within ``timeout_s`` seconds.

    Args:
        limit: the largest body read, bytes (:func:`~splitspec.serving.server_limits.request_body_limit`).
        max_prompt_bytes: what ``limit`` was derived from, named in the 413's message (None: not known).
        timeout_s: seconds the whole body may take to arrive, from the start of :meth:`read`.
    """

    def __init__(self, limit: int, max_prompt_bytes: int | None, timeout_s: float = BODY_TIMEOUT_S):
        self.limit, self.max_prompt_bytes, self.timeout_s = limit, max_prompt_bytes, timeout_s
        #: bytes of the body read so far
        self.size = 0

    def check_length(self, header: str | None) -> None:
        """Refuse, before reading it, a body by its ``Content-Length`` ``header`` (None: not sent; :meth:`read` then
        bounds the body as it arrives).

        Raises:
            Refusal: 400, ``header`` is not a number of bytes; 413, it exceeds ``limit``
                (:func:`~splitspec.serving.http_bounds.check_length`).
        """
        if header is None:
            return
        n = header.strip()
        if not (n.isascii() and n.isdigit()):
            raise Refusal(400, f"Content-Length: expected a number of bytes, got {header[:40]!r}")
        check_length(int(n), self.limit, self.max_prompt_bytes)

    async def read(self, chunks: AsyncIterable[bytes], what: str = "chunked request body") -> bytes:
        """The body, joined from ``chunks`` (a framework's stream of it), counting :attr:`size` as they arrive.
        ``what``: the body as the 413 names it (``chunked request body``, or ``decompressed request body`` where the
        stream decompresses it).

        Raises:
            Refusal: 413 once the bytes read pass ``limit`` (:func:`~splitspec.serving.http_bounds.check_read`), the
                rest left unread; 408 when the body is not complete ``timeout_s`` seconds after the start.
            Whatever ``chunks`` raises (its framework's errors, for the caller to map).
        """
        parts = []
        try:
            async with asyncio.timeout(self.timeout_s):
                async for chunk in chunks:
                    self.size += len(chunk)
                    check_read(self.size, self.limit, self.max_prompt_bytes, what)
                    parts.append(chunk)
        except TimeoutError:
            raise Refusal(408, f"request body incomplete after {self.timeout_s:g} s ({self.size} bytes received): "
                               "send the whole body at once") from None
        return b"".join(parts)
