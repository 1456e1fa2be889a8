"""The HTTP guard: the only way to tritonserver's HTTP endpoint, bounding what reaches it.

tritonserver 2.51 (``nvidia-pytriton`` 0.7.0) takes any HTTP body: no option bounds its size (it is read whole), a
body sent as ``application/x-www-form-urlencoded`` over about half its thread stack crashes it (31 MiB at the
64 MiB :data:`~splitspec.serving.server_limits.SERVER_STACK_MIN_BYTES`), and its JSON parser recurses once per
nesting level: ONE unauthenticated request to ``/v2/models/ensemble/generate`` whose ~2 MB JSON body nests arrays a
million deep killed it in 0.28 s (depth 500,000: a 500). The supervisor restarts it, but a client repeating that
exhausts ``--restart-limit``. An idle keep-alive client also held tritonserver's stop for its whole exit timeout
(``splitspec serve`` took 44 s to exit).

So tritonserver's HTTP listens on a private loopback port, and :class:`HttpGuard` listens on the public one
(``--http-port``) and forwards each request there (aiohttp: server and client; no HTTP parsing of its own). Before
forwarding a request it:

- refuses a body over :func:`~splitspec.serving.server_limits.repo_body_limit` (the largest JSON a prompt of the
  repository's ``max_prompt_bytes`` can take; the stack tritonserver runs with is sized for twice that) with 413: by
  its ``Content-Length`` before reading it, a chunked (or compressed: it is decompressed here, and forwarded
  decompressed) body as soon as what was read passes the limit; the connection is then closed, the rest unread. The
  decoding is :mod:`splitspec.serving.content_encoding`'s, not aiohttp's (turned off: it took a gzip body cut
  short): another encoding than gzip and deflate gets 415, a stream that does not decompress or end cleanly 400;
- answers 408 to a body not complete within ``body_timeout_s`` (30 s: a client that sent its headers and stalls
  would hold its request open for good), closing the connection;
- forwards a form-typed body (``curl -d``'s default: the curl examples use it, and tritonserver reads the body as
  JSON whatever its type) under that same limit, which keeps it far below what crashes tritonserver;
- refuses JSON nesting deeper than :data:`~splitspec.serving.http_bounds.MAX_JSON_DEPTH` (32; Triton's requests nest
  4) with 400, in the whole body or, with the binary-tensor extension, in its JSON part
  (:mod:`splitspec.serving.http_bounds`: a linear scan, no parsing), and an empty ``POST`` to ``generate`` (which
  tritonserver answers 500, ``document is empty``) or one with an input's value of the wrong JSON type (500,
  ``Unable to parse 'data'``; :mod:`splitspec.serving.generate_json`) with 400;
- closes a connection that has not sent a whole request head within ``header_timeout_s`` (10 s) of opening, or of
  its previous answer (keep-alive): aiohttp's keep-alive timer, which fires only while the connection waits for a
  request, never during one (a stream in flight is not cut). Before, idle and half-sent connections stayed open for
  good (aiohttp's own default is an hour): 20,000 of them ran the process out of file descriptors;
- holds at most ``max_connections`` (1024) client connections at once: one past that is closed as soon as it is
  accepted (:class:`~splitspec.serving.guard_server.CappedServer`), and the event loop's own errors
  (``socket.accept() out of system resource``, ``EMFILE``) are logged one line a second at most
  (:class:`~splitspec.serving.guard_server.QuietLog`), not a traceback each;
- answers a request aiohttp's parser refuses (a malformed ``Content-Length`` or chunk size, ``Content-Length`` with
  ``Transfer-Encoding``) 400 in the same JSON shape, closing the connection, and logs it in one line, each kind once
  a second at most (:mod:`splitspec.serving.guard_server`; aiohttp logged a traceback for each);
- answers ``HEAD`` by asking tritonserver ``GET`` (tritonserver answers ``HEAD`` 405 with a body, which breaks the
  connection) and passing its status and headers on without the body;
- answers 503 while tritonserver cannot be reached (starting, or restarting after a fault) and 502 when it closes
  the connection without an answer.

Each refusal is a JSON ``{"error": "..."}`` of one line, Triton's own convention. Everything else passes unchanged
both ways: method, path and query, headers (the admin key of :mod:`splitspec.serving.access` included; hop-by-hop
ones are the connection's own), status, and the response as it arrives (server-sent events of ``generate_stream``
event by event). A client that disconnects cancels its request here, which closes its connection to tritonserver:
a stream's engine slot is freed as before. An answer with a length up to :data:`BUFFERED_ANSWER_BYTES` is sent on in
one write. Connections to tritonserver are kept for the next request (:data:`UPSTREAM_KEEPALIVE_S`: a new one cost
0.3 ms of the guard's CPU per request); :meth:`HttpGuard.stop` closes them and its own idle keep-alive clients at
once, and comes before tritonserver's stop (``TritonServer.stop``, ``Supervisor.shutdown``), so no idle connection
holds that stop.

gRPC (protobuf bodies, fixed 2 GiB receive limit, no JSON) and the metrics port stay direct; the OpenAI-compatible
front end bounds its own bodies (:mod:`splitspec.serving.openai_http`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from pathlib import Path

import aiohttp
from aiohttp import web
from multidict import CIMultiDict
from yarl import URL

from splitspec.errors import ConfigError, SplitspecError
from splitspec.serving.body_reader import BodyReader
from splitspec.serving.guard_server import CappedServer, QuietLog, error_response, reason
from splitspec.serving.http_bounds import JSON_LENGTH_HEADER, MAX_JSON_DEPTH, Refusal, check_body
from splitspec.serving.server_limits import (BODY_TIMEOUT_S, HEADER_TIMEOUT_S, MAX_CONNECTIONS, repo_body_limit,
                                             repo_max_prompt_bytes)

#: Headers of one connection, never forwarded (RFC 9110 7.6.1), and those named by a ``Connection`` header.
HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "proxy-connection",
                        "te", "trailer", "trailers", "transfer-encoding", "upgrade"})
#: Request headers set anew for tritonserver: its address, the body's length, and the body decompressed here.
NOT_FORWARDED_UP = HOP_BY_HOP | {"host", "content-length", "content-encoding", "expect"}
#: Response headers set anew for the client (the length is set again when tritonserver gave one).
NOT_FORWARDED_DOWN = HOP_BY_HOP | {"content-length"}
#: Answers with a Content-Length up to this are read whole and sent on in one write (headers and body together);
#: longer ones, and those without a length (server-sent events), are passed on as they arrive.
BUFFERED_ANSWER_BYTES = 1 << 20
#: Seconds a connection to tritonserver stays open for the next request; all are closed when the guard stops.
UPSTREAM_KEEPALIVE_S = 10.0
#: Bodies at least this long are scanned on a worker thread, off the event loop (the scan's numpy loops release
#: the GIL).
SCAN_OFF_LOOP_BYTES = 1 << 20


def forwarded_headers(headers, drop: frozenset[str]) -> CIMultiDict:
    """``headers`` without those in ``drop`` (lower case) or named by their ``Connection`` header."""
    named = {name.strip().lower() for value in headers.getall("Connection", []) for name in value.split(",")}
    return CIMultiDict((k, v) for k, v in headers.items() if k.lower() not in drop and k.lower() not in named)


class HttpGuard:
    """Serves ``host:port`` by forwarding to tritonserver's HTTP on ``host:upstream_port`` within the bounds of the
    module docstring, from a thread and event loop of its own; a context manager.

    Args:
        port: the public port (0: a free one, in :attr:`port` once started).
        upstream_port: tritonserver's own HTTP port.
        body_limit: the largest body forwarded, bytes (:func:`~splitspec.serving.server_limits.repo_body_limit`).
        max_prompt_bytes: what ``body_limit`` was derived from (named in the 413's message; None: not known).
        max_depth: the deepest JSON nesting forwarded.
        connect_timeout_s: how long to try to reach tritonserver before answering 503.
        body_timeout_s: how long a request's body may take to arrive before it is answered 408.
        header_timeout_s: how long a connection may take to send a whole request head
            (:data:`~splitspec.serving.server_limits.HEADER_TIMEOUT_S`).
        max_connections: client connections held at once (:data:`~splitspec.serving.server_limits.MAX_CONNECTIONS`).
    """

    def __init__(self, port: int, upstream_port: int, body_limit: int, max_prompt_bytes: int | None = None,
                 host: str = "127.0.0.1", max_depth: int = MAX_JSON_DEPTH, connect_timeout_s: float = 5.0,
                 body_timeout_s: float = BODY_TIMEOUT_S, header_timeout_s: float = HEADER_TIMEOUT_S,
                 max_connections: int = MAX_CONNECTIONS):
        self.host, self.port, self.upstream_port = host, port, upstream_port
        self.body_limit, self.max_prompt_bytes, self.max_depth = body_limit, max_prompt_bytes, max_depth
        self.connect_timeout_s, self.body_timeout_s = connect_timeout_s, body_timeout_s
        self.header_timeout_s, self.max_connections = header_timeout_s, max_connections
        self.upstream = f"http://{host}:{upstream_port}"
        #: requests in flight (read on other threads: an int)
        self.active = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: CappedServer | None = None
        self._runner: web.ServerRunner | None = None
        self._site: web.TCPSite | None = None
        self._session: aiohttp.ClientSession | None = None
        #: the guard's error log: the event loop's errors and the requests aiohttp refuses, one line each
        self.log = QuietLog()

    @classmethod
    def for_repo(cls, repo: Path, port: int, upstream_port: int, host: str) -> "HttpGuard":
        """The guard in front of tritonserver serving ``repo``: its body limit and ``max_prompt_bytes`` from the
        repository (:func:`~splitspec.serving.server_limits.repo_body_limit`); not started."""
        return cls(port, upstream_port, repo_body_limit(repo), repo_max_prompt_bytes(repo), host=host)

    @property
    def connections(self) -> int:
        """Client connections open now."""
        return len(self._server.connections) if self._server is not None else 0

    @property
    def url(self) -> str:
        """``http://<host>:<port>``: where clients send their requests."""
        return f"http://{self.host}:{self.port}"

    # -- life cycle (called from other threads) ------------------------------------------------
    def start(self, timeout_s: float = 10.0) -> "HttpGuard":
        """Listen on the port and serve from a thread of its own; return once it accepts connections.

        Raises:
            ConfigError: the port cannot be bound. SplitspecError: it did not start within ``timeout_s``.
        """
        if self._thread is not None:
            raise SplitspecError("HttpGuard.start: already started")
        started: concurrent.futures.Future = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._run, args=(started,), name="splitspec-http-guard", daemon=True)
        self._thread.start()
        try:
            started.result(timeout_s)
        except OSError as e:
            self._thread.join(timeout_s)
            self._thread = None
            raise ConfigError(f"http_port = {self.port}: cannot listen on {self.host}:{self.port} "
                              f"({e.strerror or e}); stop the other server or pick another port") from None
        except concurrent.futures.TimeoutError:
            raise SplitspecError(f"the HTTP guard did not start on {self.host}:{self.port} in {timeout_s:g} s") from None
        return self

    def wait_idle(self, timeout_s: float) -> int:
        """Wait up to ``timeout_s`` until no request is in flight (each response passed on whole); return how many
        still are."""
        deadline = time.monotonic() + timeout_s
        while self.active and time.monotonic() < deadline:
            time.sleep(0.02)
        return self.active

    def stop(self, grace_s: float = 0.0) -> None:
        """Stop listening and close idle keep-alive connections at once; requests in flight get ``grace_s`` seconds
        to finish, then are cancelled (their connections to tritonserver closed). Safe to call twice."""
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        if thread.is_alive():
            closing = asyncio.run_coroutine_threadsafe(self._close(grace_s), loop)
            try:
                closing.result(grace_s + 10.0)
            except Exception:  # a stop does not fail: the loop stops below, and its thread cleans up what is left
                pass
            loop.call_soon_threadsafe(loop.stop)
        thread.join(10.0)
        if not thread.is_alive():  # its log is this thread's now
            self.log.flush()  # what it left out and had not said yet
        self._loop = self._thread = None

    def __enter__(self) -> "HttpGuard":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- the event loop's thread ---------------------------------------------------------------
    def _run(self, started: concurrent.futures.Future) -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        loop.set_exception_handler(self.log)
        try:
            loop.run_until_complete(self._open())
        except BaseException as e:  # handed to start()
            loop.run_until_complete(self._cleanup())
            loop.close()
            started.set_exception(e)
            return
        self._loop = loop
        started.set_result(None)
        try:
            loop.run_forever()
        finally:
            loop.run_until_complete(self._cleanup())
            loop.close()

    async def _open(self) -> None:
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=UPSTREAM_KEEPALIVE_S)
        self._session = aiohttp.ClientSession(
            connector=connector, auto_decompress=False,  # a compressed answer passes on compressed
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.connect_timeout_s),
            skip_auto_headers=("Accept", "Accept-Encoding", "Content-Type", "User-Agent"))  # only the client's own
        # a client gone cancels its request; a body left unread (refused) is not read on: the connection closes;
        # keepalive_timeout is the header timeout (module docstring); bodies come as sent, decoded by BodyReader
        self._server = CappedServer(self._handle, max_connections=self.max_connections, log=self.log,
                                    handler_cancellation=True, lingering_time=0,
                                    keepalive_timeout=self.header_timeout_s, auto_decompress=False)
        self._runner = web.ServerRunner(self._server, shutdown_timeout=0.5)
        await self._runner.setup()
        self._site = web.TCPSite(self._runner, self.host, self.port, reuse_address=True)
        await self._site.start()
        if not self.port:
            self.port = self._runner.addresses[0][1]

    async def _close(self, grace_s: float) -> None:
        if self._site is not None:
            await self._site.stop()  # no new connections
        if self._server is not None:
            self._server.pre_shutdown()  # idle keep-alive connections close now, busy ones after their response
        deadline = time.monotonic() + grace_s
        while self.active and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        await self._cleanup()

    async def _cleanup(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()  # cancels what is still in flight
            self._runner = self._site = None
        if self._session is not None:
            await self._session.close()
            self._session = None

    # -- requests ------------------------------------------------------------------------------
    async def _handle(self, request: web.BaseRequest) -> web.StreamResponse:
        self.active += 1
        try:
            if not request.raw_path.startswith("/"):
                raise Refusal(400, f"request target {request.raw_path[:80]!r}: expected a path starting with '/'")
            try:
                body = await self._read(request)
            except Refusal as e:  # the rest of the body unread: the connection closes after the answer
                return error_response(e.status, e.message, close=True)
            if body or request.method == "POST":  # an empty generate body is refused here: tritonserver's is a 500
                args = (body or b"", request.headers.get(JSON_LENGTH_HEADER), self.max_depth, request.raw_path)
                if len(args[0]) >= SCAN_OFF_LOOP_BYTES:
                    await asyncio.to_thread(check_body, *args)
                else:
                    check_body(*args)
            return await self._forward(request, body)
        except Refusal as e:
            return error_response(e.status, e.message)
        finally:
            self.active -= 1

    async def _read(self, request: web.BaseRequest) -> bytes | None:
        """The body (None: the request has none), within the limit and ``body_timeout_s``, decoded from its
        ``Content-Encoding`` (:class:`~splitspec.serving.body_reader.BodyReader`)."""
        body = BodyReader(self.body_limit, self.max_prompt_bytes, self.body_timeout_s)
        body.check_length(request.headers.get("Content-Length"))
        if not request.body_exists:
            return b"" if request.content_length == 0 else None
        body.check_encoding(", ".join(request.headers.getall("Content-Encoding", [])) or None)
        if request.headers.get("Expect", "").lower() == "100-continue":  # as aiohttp's own routes answer it
            await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        try:
            return await body.read(request.content.iter_any())
        except web.RequestPayloadError as e:  # broken chunks (guard_server: also those the C parser drops)
            raise Refusal(400, f"request body: {reason(e.__cause__, str(e))}") from None

    async def _forward(self, request: web.BaseRequest, body: bytes | None) -> web.StreamResponse:
        head = request.method == "HEAD"  # asked as GET: tritonserver's answer to HEAD has a body, breaking the connection
        try:
            up = await self._session.request("GET" if head else request.method, URL(self.upstream + request.raw_path, encoded=True),
                                             headers=forwarded_headers(request.headers, NOT_FORWARDED_UP), data=body,
                                             allow_redirects=False)
        except aiohttp.ClientConnectorError:
            raise Refusal(503, f"tritonserver is not reachable on {self.host}:{self.upstream_port} (starting, or "
                               "restarting after a fault); retry later") from None
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            raise Refusal(502, f"tritonserver closed the connection without an answer ({type(e).__name__})") from None
        headers = forwarded_headers(up.headers, NOT_FORWARDED_DOWN)
        try:
            if head:  # status and headers only; the connection to tritonserver is closed below, its answer unread
                if up.content_length is not None:
                    headers["Content-Length"] = str(up.content_length)
                return web.Response(status=up.status, reason=up.reason, headers=headers)
            if up.content_length is not None and up.content_length <= BUFFERED_ANSWER_BYTES:
                try:
                    answer = await up.read()
                except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                    raise Refusal(502, f"tritonserver broke off its answer ({type(e).__name__})") from None
                return web.Response(status=up.status, reason=up.reason, headers=headers, body=answer)
            return await self._stream(request, up, headers)
        finally:
            up.close()  # unless it was read to its end (then it went back to the pool): a request still running there
            # is cancelled with its connection

    async def _stream(self, request: web.BaseRequest, up: aiohttp.ClientResponse, headers) -> web.StreamResponse:
        """Pass an answer on as it arrives (``generate_stream``: one server-sent event after another)."""
        resp = web.StreamResponse(status=up.status, reason=up.reason, headers=headers)
        try:
            if up.content_length is not None:
                resp.content_length = up.content_length
            await resp.prepare(request)
            async for chunk in up.content.iter_any():
                await resp.write(chunk)
            await resp.write_eof()
        except (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError):
            # tritonserver broke off (a fault) or the client left: the client's answer cannot end well, so its
            # connection ends without the end of the answer (aiohttp leaves a response cut this way alone)
            if request.transport is not None:
                request.transport.close()
        return resp
