"""The OpenAI front end's HTTP/1.1 connections, below the app: how a request is framed. uvicorn's h11 protocol
(``uvicorn.Config(http="h11")``) does not check it on its own:

- **Ambiguous framing** (RFC 9112 §6.1). h11 takes a request with both ``Content-Length`` and ``Transfer-Encoding:
  chunked`` by its chunks and keeps the connection open, so whatever the ``Content-Length`` counted past the last
  chunk was answered as a second request (request smuggling: a proxy in front that goes by the length sees one
  request). :func:`single_framing` answers such a request 400 in OpenAI's error shape with ``Connection: close``
  before the app sees it; the bytes after it are never read as a request.
"""

from __future__ import annotations

from starlette.responses import JSONResponse

from splitspec.serving.openai_errors import APIError
from splitspec.serving.openai_http import CLOSE


def ambiguous_framing() -> APIError:
    """400 for a request carrying both ``Content-Length`` and ``Transfer-Encoding``."""
    return APIError(400, "the request has both Content-Length and Transfer-Encoding: its body's length is ambiguous "
                         "(RFC 9112 section 6.1); send one of them", "invalid_request_error", None, None)


def single_framing(app):
    """ASGI middleware around ``app``: an HTTP request with both ``Content-Length`` and ``Transfer-Encoding`` headers
    is answered :func:`ambiguous_framing` with ``Connection: close`` (its body unread, the connection closed after
    the answer) and never reaches ``app``; everything else passes unchanged."""

    async def framed(scope, receive, send) -> None:
        if scope["type"] == "http":
            names = {name for name, _ in scope["headers"]}
            if b"content-length" in names and b"transfer-encoding" in names:
                e = ambiguous_framing()
                await JSONResponse(e.body(), status_code=e.status, headers=CLOSE)(scope, receive, send)
                return
        await app(scope, receive, send)

    return framed
