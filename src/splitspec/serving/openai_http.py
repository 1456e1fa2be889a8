"""The OpenAI front end's HTTP edge, before a request's JSON is read: the body size limit, and the gate that counts
requests in flight and refuses new ones once the server is shutting down.

**Body limit.** A body longer than :func:`~splitspec.serving.server_limits.request_body_limit` of the served
``max_prompt_bytes`` cannot carry a prompt the server accepts, so :func:`read_body` refuses it with 413 before reading
it: by its ``Content-Length`` at once, a chunked body as soon as the bytes read pass the limit. Until the route reads
it, uvicorn holds at most 64 KiB of a body (its flow control stops reading the socket). The refusal carries
``Connection: close``: the rest of the body is never read, the connection is closed instead.

**Body time.** uvicorn bounds neither how long a body takes to arrive nor the gaps between its chunks: a client that
sent its headers and then stalled (a ``Content-Length`` never filled, a chunked body never ended or cut mid-chunk)
held its request open for good. :func:`read_body` gives the whole body :data:`BODY_TIMEOUT_S` (``OpenAIServer``'s
``body_timeout_s``) and answers a slower one 408 ``request_timeout``, closing the connection. The request line and
headers are bounded by uvicorn's h11 parser: at most 16 KiB (``h11_max_incomplete_event_size``) before a 400. A
malformed chunk is refused by h11 itself (400, connection closed); the route then sees the connection gone.

**Gate.** :class:`Gate` wraps the app (ASGI): it counts the HTTP requests in flight, each until its response is
complete (a stream until its ``[DONE]``) or its client left, and after :meth:`Gate.drain` answers every new request
503 ``service_unavailable`` at once. ``splitspec serve`` drains it when it starts stopping and waits for
:attr:`Gate.active` to reach 0 before tritonserver stops (:meth:`splitspec.serving.supervisor.Supervisor.shutdown`).
"""

from __future__ import annotations

import asyncio

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse

from splitspec.serving.openai_errors import APIError
from splitspec.serving.server_limits import BODY_TIMEOUT_S, too_large_message

#: Headers of an answer after which the connection is closed (the request's body may be left unread).
CLOSE = {"Connection": "close"}


def too_large(size: int | None, limit: int, max_prompt_bytes: int) -> APIError:
    """413 for a body of ``size`` bytes (None: chunked, past the limit) over ``limit``."""
    what = f"request body of {size} bytes" if size is not None else "chunked request body"
    return APIError(413, too_large_message(what, limit, max_prompt_bytes), "invalid_request_error", None,
                    "request_too_large")


def shutting_down() -> APIError:
    """503 for a request that arrives while the server stops."""
    return APIError(503, "the server is shutting down: not admitting new requests", "service_unavailable", None,
                    "service_unavailable")


def timed_out(timeout_s: float, size: int) -> APIError:
    """408 for a body not complete ``timeout_s`` seconds after the route started reading it (``size`` bytes read)."""
    return APIError(408, f"request body incomplete after {timeout_s:g} s ({size} bytes received): send the whole body "
                    "at once", "invalid_request_error", None, "request_timeout")


async def read_body(request: Request, limit: int, max_prompt_bytes: int, timeout_s: float = BODY_TIMEOUT_S) -> bytes:
    """The request's body, at most ``limit`` bytes, all of it within ``timeout_s`` seconds.

    Raises:
        APIError: 413 (:func:`too_large`) when ``Content-Length`` exceeds ``limit`` (nothing of the body is read) or,
            without one, once the chunks read pass it; 400 for a ``Content-Length`` that is not a number; 408
            (:func:`timed_out`) when the body is not complete within ``timeout_s``; 400 when the connection closed
            before the body ended (an answer nobody reads, but no internal error).
    """
    length = request.headers.get("content-length")
    if length is not None:
        if not length.strip().isdigit():
            raise APIError(400, f"Content-Length: expected a number of bytes, got {length[:40]!r}")
        if int(length) > limit:
            raise too_large(int(length), limit, max_prompt_bytes)
    chunks, size = [], 0
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise too_large(None, limit, max_prompt_bytes)
                chunks.append(chunk)
    except TimeoutError:
        raise timed_out(timeout_s, size) from None
    except ClientDisconnect:  # the client left, or h11 refused a malformed chunk (400) and closed the connection
        raise APIError(400, f"request body cut off after {size} bytes: the connection closed", "invalid_request_error",
                       None, None) from None
    return b"".join(chunks)


def error_response(e: APIError) -> JSONResponse:
    """``e`` as a JSON answer in OpenAI's error shape; a 413 or 408 closes the connection (its body stays unread)."""
    return JSONResponse(e.body(), status_code=e.status, headers=CLOSE if e.status in (408, 413) else None)


class Gate:
    """ASGI middleware around ``app``: :attr:`active` HTTP requests in flight; after :meth:`drain`, a new request is
    answered 503 (:func:`shutting_down`, ``Connection: close``) without reaching the app. Lifespan events pass
    through. ``active`` changes on the event loop's thread; reading it from another thread is safe (an int)."""

    def __init__(self, app):
        self.app, self.draining, self.active = app, False, 0

    def drain(self) -> None:
        """Refuse every request from now on (those in flight go on)."""
        self.draining = True

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.draining:
            e = shutting_down()
            await JSONResponse(e.body(), status_code=e.status, headers=CLOSE)(scope, receive, send)
            return
        self.active += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.active -= 1
