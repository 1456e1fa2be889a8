"""The HTTP guard's aiohttp server (:mod:`splitspec.serving.http_guard`): a cap on the connections it holds, and
errors that are answered and logged in one line each.

**Connections.** :class:`CappedServer` holds at most ``max_connections`` client connections at once; one past that
is closed as soon as it is accepted.

**Malformed requests.** aiohttp's parser refuses a malformed request head or chunk (``Content-Length: -1``, ``+44``
or ``²``; a chunk size ``zz``; ``Content-Length`` with ``Transfer-Encoding``) before the guard sees it, and aiohttp
then logged ``Error handling request`` with a 10-line traceback through its own ``aiohttp.server`` logger, unthrottled
and echoing the offending line (up to 8 KiB of a header): 500–560 bytes of log per request, 16.5 KB for an 8 KB
header with a bad byte. Its answer was a ``text/plain`` 400 of several lines echoing the bytes with a caret. The
guard's handler (:class:`_CappedHandler`) answers these as Triton's errors instead — 400 ``{"error": "malformed HTTP
request (<kind>): <reason>"}``, the connection closed after it — and logs each as one line with the client's
address, ``splitspec serve: HTTP guard: 400 to <address>: malformed request (<kind>): <reason>``, no traceback,
through :class:`QuietLog` (one line a second per kind; the kind is the parser's error class, e.g. ``BadHttpMessage``,
``InvalidURLError``, never text the client chose). A reason quoting the client's bytes shows at most
:data:`SHOWN_CHARS` characters of it, non-printable ones as ``?``. An error inside the guard's own handler (a fault
of its own, not the client's) is answered 500 and logged the same way, as are aiohttp's other errors.

**A body going bad.** When a chunked body goes bad after it started (a malformed chunk in a later packet than the
head), aiohttp's C parser drops the body without ending it and queues the error as a request of its own, behind the
one whose body it was: that request waited for its body until the 408 of the body timeout (30 s). The handler ends
such a body with the parser's error (:meth:`_CappedHandler.data_received`), which the guard answers 400 at once.
"""

from __future__ import annotations

import asyncio
import json
import sys
from http import HTTPStatus

from aiohttp import HttpVersion11, web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestHandler, _ErrInfo

from splitspec.serving.rate_limited_log import RateLimitedLog
from splitspec.serving.server_limits import MAX_CONNECTIONS

#: The most characters of a reason (which may quote the client's bytes) put in a log line or an answer.
SHOWN_CHARS = 120


def error_response(status: int, message: str, close: bool = False) -> web.Response:
    """Triton's HTTP error shape: ``{"error": message}`` with ``status``; ``close``: end the connection after it."""
    resp = web.Response(status=status, text=json.dumps({"error": message}), content_type="application/json")
    if close:
        resp.force_close()
    return resp


def shown(text: str, most: int = SHOWN_CHARS) -> str:
    """``text`` as one line of printable ASCII (runs of white space as one space, other characters as ``?``), cut to
    ``most`` characters (the cut marked ``...``)."""
    line = "".join(c if c.isascii() and c.isprintable() else "?" for c in " ".join(text[:4 * most].split()))
    return line if len(line) <= most else line[:most - 3] + "..."


def reason(exc: BaseException | None, message: str | None) -> str:
    """What aiohttp's parser said of a malformed request (``exc``'s message, else ``message``), in one line: its
    caret lines left out (:func:`shown`)."""
    text = exc.message if isinstance(exc, HttpProcessingError) else message or (str(exc) if exc else "")
    lines = [line.strip() for line in str(text).splitlines()]
    return shown(" ".join(line for line in lines if line.strip("^")) or "no reason given")


class QuietLog(RateLimitedLog):
    """The guard's error log: each error one line (no traceback) to stderr, each kind of line one every ``every_s``
    seconds at most (:class:`~splitspec.serving.rate_limited_log.RateLimitedLog`). Also the event loop's exception
    handler (called as ``(loop, context)``): at the descriptor limit the loop reports each failed accept."""

    def __init__(self, every_s: float = 1.0):
        super().__init__(lambda line: print(line, file=sys.stderr, flush=True), every_s)

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict) -> None:
        exc = context.get("exception")
        self.say(f"splitspec serve: HTTP guard: {context.get('message', 'error')}"
                 + (f": {type(exc).__name__}: {exc}" if exc is not None else ""),
                 key=f"{str(context.get('message', 'error'))[:60]} {type(exc).__name__ if exc is not None else ''}")


class _CappedHandler(RequestHandler):
    """aiohttp's connection handler, which closes its connection at once when its server holds its cap already, and
    answers and logs errors in one line each (module docstring)."""

    __slots__ = ("log", "_body")

    def connection_made(self, transport) -> None:
        server = self._manager
        if len(server.connections) >= server.max_connections:
            server.refused += 1
            self._manager = None  # so connection_lost does nothing: the connection was never the server's
            transport.abort()
            return
        super().connection_made(transport)

    def data_received(self, data: bytes) -> None:
        """aiohttp's, then: a parse error met in the body being read ends that body with it (module docstring)."""
        parsed = len(self._messages)
        super().data_received(data)
        for message, payload in list(self._messages)[parsed:]:
            if not isinstance(message, _ErrInfo):
                self._body = payload  # the body the parser reads next
            elif getattr(self, "_body", None) is not None and not self._body.is_eof():
                error = web.RequestPayloadError(message.message)
                error.__cause__ = message.exc
                self._body.set_exception(error, message.exc)
                self._body = None

    def handle_error(self, request: web.BaseRequest, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        """The answer to a request aiohttp could not hand to the guard (a malformed one: 400) or that the guard's
        handler failed on (500; 504 for a TimeoutError): Triton's error shape, the connection closed after it, in an
        HTTP/1.1 status line."""
        if status < 500:
            # the kind: the parser's error class (a place in aiohttp, never the client's bytes, which the reason
            # may quote: a CONNECT's authority is its whole message), named in the answer too
            kind = type(exc).__name__ if exc is not None else "refusal"
            why = reason(exc, message)
            said, key, answer = f"malformed request ({kind}): {why}", f"{status} {kind}", \
                f"malformed HTTP request ({kind}): {why}"
        else:
            said = f"{type(exc).__name__}: {shown(str(exc))}" if exc is not None else HTTPStatus(status).phrase
            key, answer = f"{status} {said[:60]}", f"{HTTPStatus(status).phrase} in the HTTP guard"
        self.log.say(f"splitspec serve: HTTP guard: {status} to {request.remote}: {said}", key=key)
        if request.writer.output_size > 0:  # as aiohttp's own: part of an answer went out, another cannot follow
            raise ConnectionError("an answer was under way: no error answer can follow it")
        # the stand-in aiohttp makes for a request it could not parse says HTTP/1.0 (the version is not known), and
        # its answer's status line would; the guard's answers are HTTP/1.1
        request._cache["version"] = HttpVersion11
        return error_response(status, answer, close=True)

    def log_exception(self, *args, **kw) -> None:
        """aiohttp's other error logs (``Unhandled exception``, an answer that is not one): one line, no traceback."""
        exc = kw.get("exc_info")
        what = shown(str(args[0]) if args else "error")
        if isinstance(exc, BaseException):
            what += f": {type(exc).__name__}: {shown(str(exc))}"
        self.log.say(f"splitspec serve: HTTP guard: {what}",
                     key=f"{shown(str(args[0]) if args else 'error', 60)} {type(exc).__name__ if exc else ''}")


class CappedServer(web.Server):
    """aiohttp's low-level server holding at most ``max_connections``
    (:data:`~splitspec.serving.server_limits.MAX_CONNECTIONS`) client connections at once (those refused counted in
    :attr:`refused`), its errors logged to ``log`` (:class:`QuietLog`; a new one if None)."""

    def __init__(self, handler, *, max_connections: int = MAX_CONNECTIONS, log: QuietLog | None = None, **kwargs):
        super().__init__(handler, **kwargs)
        self.max_connections, self.refused = max_connections, 0
        self.log = log if log is not None else QuietLog()

    def __call__(self) -> RequestHandler:
        handler = _CappedHandler(self, loop=self._loop, **self._kwargs)
        handler.log = self.log
        return handler
