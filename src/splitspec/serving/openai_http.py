"""The OpenAI front end's HTTP edge, before a request's JSON is read: the body size limit, and the gate that counts
requests in flight and refuses new ones once the server is shutting down.

**Body limit.** A body longer than :func:`~splitspec.serving.server_limits.request_body_limit` of the served
``max_prompt_bytes`` cannot carry a prompt the server accepts, so :func:`read_body` refuses it with 413 before reading
it: by its ``Content-Length`` at once, a chunked body as soon as the bytes read pass the limit. Until the route reads
it, uvicorn holds at most 64 KiB of a body (its flow control stops reading the socket). The refusal carries
``Connection: close``: the rest of the body is never read, the connection is closed instead.

**Body time.** uvicorn bounds neither how long a body takes to arrive nor the gaps between its chunks, so
:func:`read_body` gives the whole body :data:`BODY_TIMEOUT_S` (``OpenAIServer``'s ``body_timeout_s``) and answers a
slower one 408 ``request_timeout``, closing the connection. The request line and headers are bounded by uvicorn's
h11 parser: a head still incomplete past 16 KiB (``h11_max_incomplete_event_size``) is refused (431), and so is a
malformed chunk (400), connection closed (:mod:`~splitspec.serving.openai_connection`); the route then sees the
connection gone.

Both bounds are :class:`~splitspec.serving.body_reader.BodyReader`'s, shared with the HTTP guard; :func:`read_body`
is its Starlette side, answering its refusals in OpenAI's error shape.

**Gate.** :class:`Gate` wraps the app (ASGI): it counts the HTTP requests in flight, each until its response is
complete (a stream until its ``[DONE]``) or its client left, and after :meth:`Gate.drain` answers every new request
503 ``service_unavailable`` at once. ``splitspec serve`` drains it when it starts stopping and waits for
:attr:`Gate.active` to reach 0 before tritonserver stops (:meth:`splitspec.serving.supervisor.Supervisor.shutdown`).
"""

from __future__ import annotations

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse

from splitspec.serving.body_reader import BodyReader
from splitspec.serving.http_bounds import Refusal
from splitspec.serving.openai_errors import APIError
from splitspec.serving.server_limits import BODY_TIMEOUT_S

#: Headers of an answer after which the connection is closed (the request's body may be left unread).
CLOSE = {"Connection": "close"}


def shutting_down() -> APIError:
    """503 for a request that arrives while the server stops."""
    return APIError(503, "the server is shutting down: not admitting new requests", "service_unavailable", None,
                    "service_unavailable")


#: OpenAI's error ``code`` of each body refusal (:class:`~splitspec.serving.body_reader.BodyReader`) that has one.
REFUSAL_CODES = {408: "request_timeout", 413: "request_too_large", 415: "unsupported_media_type"}


async def read_body(request: Request, limit: int, max_prompt_bytes: int, timeout_s: float = BODY_TIMEOUT_S) -> bytes:
    """The request's body, at most ``limit`` bytes, all of it within ``timeout_s`` seconds, decoded from its
    ``Content-Encoding`` (gzip, deflate; Starlette decodes none) (:class:`~splitspec.serving.body_reader.BodyReader`,
    its refusals in OpenAI's error shape).

    Raises:
        APIError: 413 ``request_too_large`` when ``Content-Length`` exceeds ``limit`` (nothing of the body is read)
            or, without one, once the chunks read (or what they decompress to) pass it; 400 for a ``Content-Length``
            that is not a number; 415 ``unsupported_media_type`` for a ``Content-Encoding`` other than identity,
            gzip and deflate (``zstd`` was read as plain text before); 400 for a compressed body that does not
            decode or is cut short; 408 ``request_timeout`` when the body is not complete within ``timeout_s``; 400
            when the connection closed before the body ended (an answer nobody reads, but no internal error).
            Each with ``close`` set: the connection ends after the answer.
    """
    body = BodyReader(limit, max_prompt_bytes, timeout_s)
    try:
        body.check_length(request.headers.get("content-length"))
        body.check_encoding(", ".join(request.headers.getlist("content-encoding")) or None)
        return await body.read(request.stream())
    except Refusal as e:  # the rest of the body unread: the connection closes after the answer
        raise APIError(e.status, e.message, "invalid_request_error", None, REFUSAL_CODES.get(e.status),
                       close=True) from None
    except ClientDisconnect:  # the client left, or h11 refused a malformed chunk (400) and closed the connection
        raise APIError(400, f"request body cut off after {body.size} bytes: the connection closed",
                       "invalid_request_error", None, None, close=True) from None


def error_response(e: APIError) -> JSONResponse:
    """``e`` as a JSON answer in OpenAI's error shape; the connection closed after it when ``e.close`` (a refusal
    while reading the body: 408, 413, 415, a body that does not decode)."""
    return JSONResponse(e.body(), status_code=e.status, headers=CLOSE if e.close else None)


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
