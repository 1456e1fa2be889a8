"""The OpenAI front end's HTTP/1.1 connections, below the app: how a request is framed, how long a connection may
wait for one, and how many connections are held. uvicorn's h11 protocol (``uvicorn.Config(http=...)``) does none of
this on its own:

- **Ambiguous framing** (RFC 9112 §6.1). h11 takes a request with both ``Content-Length`` and ``Transfer-Encoding:
  chunked`` by its chunks and keeps the connection open, so whatever the ``Content-Length`` counted past the last
  chunk was answered as a second request (request smuggling: a proxy in front that goes by the length sees one
  request). :func:`single_framing` answers such a request 400 in OpenAI's error shape with ``Connection: close``
  before the app sees it; the bytes after it are never read as a request.
- **Head timeout.** uvicorn arms its keep-alive timer only after an answer, and any byte received disarms it: an idle
  connection, or one whose request head arrives a byte at a time, stayed open for good (100 of them did).
  :class:`BoundedH11Protocol` closes a connection that has not sent a whole request head ``header_timeout_s`` after
  opening or after its previous answer, whatever bytes trickle in; its timer runs only while no request is in flight,
  so a stream is never cut. The keep-alive time of an idle connection is the same (``timeout_keep_alive``).
- **Connection cap.** uvicorn's ``limit_concurrency`` counts connections too, but refuses requests, not connections:
  idle connections up to the limit would have made every real request a 503. :class:`BoundedH11Protocol` instead
  closes a connection past ``max_connections`` as soon as it is accepted, as the HTTP guard does
  (:data:`~splitspec.serving.server_limits.MAX_CONNECTIONS`).

The protocol overrides methods of uvicorn's ``H11Protocol`` (``connection_made``, ``data_received``,
``on_response_complete``) and reads its ``cycle`` and ``connections``: uvicorn's internals (as of uvicorn 0.55), not a
documented API; the tests through sockets (tests/serving/test_openai_connection.py) are what tells when they change.
"""

from __future__ import annotations

import asyncio
import functools

from starlette.responses import JSONResponse
from uvicorn.protocols.http.h11_impl import H11Protocol

from splitspec.serving.openai_errors import APIError
from splitspec.serving.openai_http import CLOSE
from splitspec.serving.server_limits import HEADER_TIMEOUT_S, MAX_CONNECTIONS


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


class BoundedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a head timeout and a connection cap (module docstring); made by
    :func:`bounded_protocol`.

    Args:
        header_timeout_s: seconds a connection may take to send a whole request head, from its opening or its
            previous answer.
        max_connections: connections held at once; one more is closed as soon as it is accepted.
    """

    def __init__(self, config, server_state, app_state, _loop=None, *, header_timeout_s: float = HEADER_TIMEOUT_S,
                 max_connections: int = MAX_CONNECTIONS):
        super().__init__(config, server_state, app_state, _loop)
        self.header_timeout_s, self.max_connections = header_timeout_s, max_connections
        self.head_timer: asyncio.TimerHandle | None = None
        self.refused = False  # closed at once: past the cap

    def connection_made(self, transport) -> None:
        if len(self.connections) >= self.max_connections:
            self.refused = True
            transport.abort()
            return
        super().connection_made(transport)
        self._time_head()

    def connection_lost(self, exc) -> None:
        if self.refused:  # never served: uvicorn's state knows nothing of it
            return
        self._stop_head_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._time_head()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._time_head()

    def _waiting_for_head(self) -> bool:
        """No request in flight: none yet, or the last one answered (a pipelined one started by then counts)."""
        return self.cycle is None or self.cycle.response_complete

    def _time_head(self) -> None:
        """Run the head timer while the connection waits for a request head (started when the wait began, not
        restarted by bytes of a head arriving); stop it while a request is in flight."""
        if self.transport.is_closing() or not self._waiting_for_head():
            self._stop_head_timer()
        elif self.head_timer is None:
            self.head_timer = self.loop.call_later(self.header_timeout_s, self._head_timed_out)

    def _stop_head_timer(self) -> None:
        if self.head_timer is not None:
            self.head_timer.cancel()
            self.head_timer = None

    def _head_timed_out(self) -> None:
        self.head_timer = None
        if self._waiting_for_head() and not self.transport.is_closing():
            self.transport.close()


def bounded_protocol(header_timeout_s: float = HEADER_TIMEOUT_S, max_connections: int = MAX_CONNECTIONS):
    """The protocol factory for ``uvicorn.Config(http=...)``: :class:`BoundedH11Protocol` with these bounds."""
    return functools.partial(BoundedH11Protocol, header_timeout_s=header_timeout_s, max_connections=max_connections)
