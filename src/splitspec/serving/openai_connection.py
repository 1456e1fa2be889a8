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
- **Framing refusals.** h11 refuses a malformed request (``Content-Length: -1``, a bad chunk, a head still incomplete
  past 16 KiB) and uvicorn answered it as ``text/plain`` ``Invalid HTTP request received.``;
  :class:`BoundedH11Protocol` answers it in OpenAI's error shape naming h11's reason (and a bad ``Content-Length``'s
  value, which h11's reason leaves out), with the status h11 suggests (400; 431 for a head too long, 501 for a
  transfer coding other than chunked), and closes the connection. uvicorn logs each one as a WARNING:
  :data:`WARNING_LOG_LIMIT` lets one a second through (:func:`limit_warning_log`), as it does each other kind of
  uvicorn warning (a request asking ``Upgrade:`` logged two).

The protocol overrides methods of uvicorn's ``H11Protocol`` (``connection_made``, ``data_received``,
``on_response_complete``, ``send_400_response``) and reads its ``conn`` (the h11 connection), ``cycle`` and
``connections``: uvicorn's internals (as of uvicorn 0.55 and h11 0.16), not a documented API; the tests through
sockets (tests/serving/test_openai_connection.py) are what tells when they change.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import re
import threading

import h11
from h11._connection import DEFAULT_MAX_INCOMPLETE_EVENT_SIZE
from uvicorn.protocols.http.h11_impl import STATUS_PHRASES, H11Protocol

from splitspec.serving.http_bounds import quoted
from splitspec.serving.openai_errors import APIError
from splitspec.serving.openai_http import error_response
from splitspec.serving.rate_limited_log import RateLimitedLog
from splitspec.serving.server_limits import HEADER_TIMEOUT_S, MAX_CONNECTIONS

#: The line uvicorn logs (logger ``uvicorn.error``, WARNING) for each request h11 refuses.
UVICORN_INVALID_REQUEST = "Invalid HTTP request received."


def ambiguous_framing() -> APIError:
    """400 for a request carrying both ``Content-Length`` and ``Transfer-Encoding``, closing the connection."""
    return APIError(400, "the request has both Content-Length and Transfer-Encoding: its body's length is ambiguous "
                         "(RFC 9112 section 6.1); send one of them", "invalid_request_error", None, None, close=True)


def single_framing(app):
    """ASGI middleware around ``app``: an HTTP request with both ``Content-Length`` and ``Transfer-Encoding`` headers
    is answered :func:`ambiguous_framing` with ``Connection: close`` (its body unread, the connection closed after
    the answer) and never reaches ``app``; everything else passes unchanged."""

    async def framed(scope, receive, send) -> None:
        if scope["type"] == "http":
            names = {name for name, _ in scope["headers"]}
            if b"content-length" in names and b"transfer-encoding" in names:
                await error_response(ambiguous_framing())(scope, receive, send)
                return
        await app(scope, receive, send)

    return framed


class _WarningLogLimit(logging.Filter):
    """A filter for the logger ``uvicorn.error`` passing each kind of warning (or worse) once every ``every_s`` seconds
    at most, the next one of a kind passed ending with the count of those left out
    (:class:`~splitspec.serving.rate_limited_log.RateLimitedLog`). A kind is the record's message template
    (``record.msg``: a place in uvicorn's code, never the client's bytes): :data:`UVICORN_INVALID_REQUEST` for every
    request h11 refuses, ``Unsupported upgrade request.`` and the WebSocket-library line for each request asking
    ``Upgrade:`` (two lines per request, pipelined by the hundred, before). Records below WARNING pass unchanged.
    :meth:`flush` logs the counts not said yet (an OpenAI front end's stop calls it)."""

    def __init__(self, every_s: float = 1.0):
        super().__init__()
        self._lock, self._passed = threading.Lock(), []
        self._limit = RateLimitedLog(self._passed.append, every_s)

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING or getattr(record, _FLUSHED, False):
            return True
        with self._lock:  # servers on several threads share it
            self._passed.clear()
            self._limit.say(record.getMessage(), key=str(record.msg)[:80])
            passed = self._passed[-1] if self._passed else None
        if passed is None:
            return False
        record.msg, record.args = passed, ()
        return True

    def flush(self) -> None:
        """Log to ``uvicorn.error`` what was left out and not said yet
        (:meth:`~splitspec.serving.rate_limited_log.RateLimitedLog.flush`), as WARNINGs this filter passes."""
        with self._lock:
            self._passed.clear()
            self._limit.flush()
            lines = list(self._passed)
        for line in lines:
            logging.getLogger("uvicorn.error").warning(line, extra={_FLUSHED: True})


#: The attribute marking a record :meth:`_WarningLogLimit.flush` logs (passed unlimited).
_FLUSHED = "splitspec_flushed"


#: The one filter every OpenAI front end of this process adds (:func:`limit_warning_log`): one line a second at most
#: per kind of warning.
WARNING_LOG_LIMIT = _WarningLogLimit()


def limit_warning_log() -> None:
    """Add :data:`WARNING_LOG_LIMIT` to the logger ``uvicorn.error`` (once: adding it again does nothing). Call it
    after ``uvicorn.Config`` is made: that configures uvicorn's loggers."""
    logging.getLogger("uvicorn.error").addFilter(WARNING_LOG_LIMIT)


#: A ``Content-Length`` header line of a request head: its value.
_CONTENT_LENGTH = re.compile(rb"^content-length[ \t]*:[ \t]*([^\r\n]*?)[ \t]*\r?$", re.IGNORECASE | re.MULTILINE)


def content_lengths(head: bytes) -> str:
    """The ``Content-Length`` values of the request head that starts ``head`` (raw bytes), joined with ``, ``."""
    head = head.split(b"\r\n\r\n", 1)[0]
    return ", ".join(v.decode("latin-1") for v in _CONTENT_LENGTH.findall(head))


class _Parser(h11.Connection):
    """h11's server side, keeping the last error it found in what the client sent (:attr:`error`) and, when that
    was in a request head, the bytes it was found in (:attr:`head`: h11's errors do not quote them)."""

    error: h11.RemoteProtocolError | None = None
    head: bytes = b""

    def next_event(self):
        waiting = self.their_state is h11.IDLE  # what is buffered starts with a request head
        head = self.trailing_data[0] if waiting else b""
        try:
            return super().next_event()
        except h11.RemoteProtocolError as e:
            self.error, self.head = e, head
            raise


class BoundedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a head timeout, a connection cap and framing refusals in OpenAI's error shape
    (module docstring); made by :func:`bounded_protocol`.

    Args:
        header_timeout_s: seconds a connection may take to send a whole request head, from its opening or its
            previous answer.
        max_connections: connections held at once; one more is closed as soon as it is accepted.
    """

    def __init__(self, config, server_state, app_state, _loop=None, *, header_timeout_s: float = HEADER_TIMEOUT_S,
                 max_connections: int = MAX_CONNECTIONS):
        super().__init__(config, server_state, app_state, _loop)
        self.header_timeout_s, self.max_connections = header_timeout_s, max_connections
        size = config.h11_max_incomplete_event_size
        self.head_limit = size if size is not None else DEFAULT_MAX_INCOMPLETE_EVENT_SIZE
        self.conn = _Parser(h11.SERVER, self.head_limit)
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

    def send_400_response(self, msg: str) -> None:
        """Answer a request h11 refused (``msg``: uvicorn's generic line) in OpenAI's error shape, then close."""
        error = self.conn.error
        status = error.error_status_hint if error is not None else 400
        if status == 431:
            message = f"request line and headers exceed {self.head_limit} bytes"
        else:
            message = f"malformed HTTP request: {error.args[0] if error is not None and error.args else msg}"
            if "Content-Length" in message and (value := content_lengths(self.conn.head)):
                message += f": {quoted(value)}"  # as the HTTP guard's parser quotes it
        body = json.dumps(APIError(status, message, "invalid_request_error", None, None).body()).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close")]
        try:
            for event in (h11.Response(status_code=status, headers=headers, reason=STATUS_PHRASES[status]), h11.Data(data=body), h11.EndOfMessage()):
                self.transport.write(self.conn.send(event))
        except h11.LocalProtocolError:  # an answer was under way already: only closing is left
            pass
        self.transport.close()


def bounded_protocol(header_timeout_s: float = HEADER_TIMEOUT_S, max_connections: int = MAX_CONNECTIONS):
    """The protocol factory for ``uvicorn.Config(http=...)``: :class:`BoundedH11Protocol` with these bounds."""
    return functools.partial(BoundedH11Protocol, header_timeout_s=header_timeout_s, max_connections=max_connections)
