"""The OpenAI-compatible front end: a FastAPI app over the served ensemble, reached through Triton's gRPC stream.

``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models`` (and ``/v1/models/{id}``). Requests are
checked and answers shaped by :mod:`splitspec.serving.openai_schema`; the app itself only renders chat messages with
the served tokenizer, sends one streaming request to the ensemble per call
(:class:`~splitspec.serving.ensemble_stream.EnsembleStream`) and turns its responses into JSON or server-sent events.

Chat messages are rendered here, with the tokenizer folder the repository's ``preprocessing`` model loads
(``tokenizer_dir``), and sent as plain text (``apply_chat_template`` false): the ensemble's own template switch wraps
a single user message only. The token ids are those the server would make from the same messages.

The ensemble always streams (one response per engine cycle): a streaming client gets one chunk per cycle, a
non-streaming one the folded answer. A request is sent before any byte of the answer, and its first response is
awaited first, so a request the engine refuses gets a proper HTTP error status also when streaming. A client that
disconnects cancels its gRPC stream, and Triton cancels the request in the engine (its slot and KV blocks are freed
within a cycle or two, as for any cancelled gRPC stream).

A body is read only up to the size a prompt of ``max_prompt_bytes`` can take in JSON and within ``body_timeout_s``,
and the app runs behind a gate that refuses new requests while the server stops (:mod:`splitspec.serving.openai_http`);
below it, connections are bounded and ambiguous framing refused (:mod:`splitspec.serving.openai_connection`).
A refusal from the pipeline is answered with ``param`` naming the field its message is about
(:func:`~splitspec.serving.openai_errors.with_param`).

:class:`OpenAIServer` runs the app under uvicorn on a thread of the calling process (``splitspec serve
--openai-port``, the tests, ``bench/openai_overhead.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import socket
import threading
import time
from pathlib import Path
from typing import AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from starlette.exceptions import HTTPException

from splitspec.errors import ConfigError, SplitspecError
from splitspec.files import read_json
from splitspec.runtime.tokenizer import ChatTokenizer
from splitspec.serving import openai_errors as api_errors
from splitspec.serving import openai_schema as schema
from splitspec.serving.client import merge
from splitspec.serving.ensemble_stream import EnsembleStream
from splitspec.serving.openai_connection import (WARNING_LOG_LIMIT, bounded_protocol, limit_warning_log,
                                                  single_framing)
from splitspec.serving.openai_http import BODY_TIMEOUT_S, Gate, error_response, read_body
from splitspec.serving.repo import repo_setting
from splitspec.serving.server_limits import HEADER_TIMEOUT_S, MAX_CONNECTIONS, request_body_limit
from splitspec.settings import PROMPT_BYTES_PER_TOKEN

log = logging.getLogger("splitspec.openai")


@dataclasses.dataclass(frozen=True)
class ServedModel:
    """What the front end knows of the served model: its name, tokenizer and limits."""

    name: str
    tokenizer: ChatTokenizer
    max_seq_len: int
    max_draft_len: int
    max_tokens_limit: int
    created: int
    max_prompt_bytes: int  # preprocessing's limit, checked here too before the front end tokenises a prompt

    @property
    def max_body_bytes(self) -> int:
        """The largest request body read (:func:`~splitspec.serving.server_limits.request_body_limit`)."""
        return request_body_limit(self.max_prompt_bytes)

    @classmethod
    def from_repo(cls, repo: Path, name: str | None = None) -> "ServedModel":
        """Read a rendered repository: the tokenizer (``preprocessing``'s ``tokenizer_dir``), the target engine's
        limits (``engine.json`` of ``spec_decode``'s ``engines_dir``) and ``max_tokens_limit``. ``name``: the
        served model name (default: the engines folder's name, e.g. ``demo`` for ``engines/demo``).

        Raises:
            ConfigError: the repository is not rendered; CheckpointError: a file it names is missing or malformed.
        """
        engines = repo_setting(repo, "spec_decode", "engines_dir")
        tok_dir = repo_setting(repo, "preprocessing", "tokenizer_dir")
        if not engines or not tok_dir:
            raise ConfigError(f"{repo}: not a rendered model repository (run `splitspec repo` first)")
        meta_path = Path(engines) / "target" / "engine.json"
        limits = read_json(meta_path).get("limits")
        if not isinstance(limits, dict) or not all(isinstance(limits.get(k), int) for k in ("max_seq_len", "max_draft_len")):
            raise ConfigError(f"{meta_path}: field 'limits' lacks max_seq_len / max_draft_len")
        limit = int(repo_setting(repo, "spec_decode", "max_tokens_limit") or limits["max_seq_len"])
        prompt_bytes = int(repo_setting(repo, "preprocessing", "max_prompt_bytes")
                           or limits["max_seq_len"] * PROMPT_BYTES_PER_TOKEN)
        return cls(name or Path(engines).resolve().name, ChatTokenizer.from_dir(Path(tok_dir)), limits["max_seq_len"],
                   limits["max_draft_len"], limit, int(time.time()), prompt_bytes)

    def prompt_text(self, req: schema.GenerationRequest) -> str:
        """The text sent as ``text_input``: the completion prompt, or the chat messages rendered with the chat
        template (generation prompt added). Raises APIError (400) for messages the template refuses."""
        if req.messages is None:
            return req.prompt or ""
        try:
            return self.tokenizer.apply_chat_template([dict(m) for m in req.messages], add_generation_prompt=True)
        except ConfigError as e:
            raise api_errors.invalid("messages", f"messages: {e}") from None

    def max_tokens(self, req: schema.GenerationRequest, text: str) -> int:
        """The request's max_tokens, or (none given) what fits beside the prompt."""
        if req.max_tokens is not None:
            return req.max_tokens
        size = len(text.encode("utf-8"))
        if size > self.max_prompt_bytes:  # as preprocessing would: never tokenise what cannot fit
            raise api_errors.invalid("messages" if req.messages is not None else "prompt",
                                     f"prompt of {size} bytes, at most {self.max_prompt_bytes} (max_prompt_bytes)")
        return schema.default_max_tokens(len(self.tokenizer.encode(text)), self.max_seq_len, self.max_draft_len,
                                         self.max_tokens_limit)


async def _first(events: AsyncIterator[dict]) -> dict | None:
    try:
        return await events.__anext__()
    except StopAsyncIteration:
        return None


async def _chain(first: dict | None, events: AsyncIterator[dict]) -> AsyncIterator[dict]:
    if first is not None:
        yield first
        async for ev in events:
            yield ev


async def _sse(req: schema.GenerationRequest, rid: str, created: int, events: AsyncIterator[dict]) -> AsyncIterator[str]:
    """The answer as server-sent events: a role chunk (chat), one chunk per engine cycle with the text it adds, the
    finish reason on the last, a usage chunk when asked for, then ``[DONE]``. An error in mid-stream (after the
    200 status went out) is sent as an event carrying OpenAI's error object."""
    seen: list[dict] = []
    try:
        if req.kind == "chat":
            yield schema.sse(schema.chunk(req, rid, created, role=True))
        async for ev in events:
            seen.append(ev)
            text, reason = ev.get("text_output"), ev.get("finish_reason")
            if text or reason:
                yield schema.sse(schema.chunk(req, rid, created, text, reason))
        if req.include_usage:
            yield schema.sse(schema.usage_chunk(req, rid, created, schema.usage(merge(seen))))
    except api_errors.APIError as e:
        yield schema.sse(e.body())
    yield schema.SSE_DONE


async def _unless_disconnected(request, work):
    """Await ``work`` (a coroutine); if the client disconnects first, cancel it and return None."""
    async def disconnected():
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task, watch = asyncio.ensure_future(work), asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            return None
    return task.result()


def create_app(model: ServedModel, grpc_address: str, ensemble: str = "ensemble", body_timeout_s: float = BODY_TIMEOUT_S):
    """The FastAPI app serving ``model`` through the ensemble at ``grpc_address`` (``host:port``); a request body
    must arrive within ``body_timeout_s`` seconds (:func:`~splitspec.serving.openai_http.read_body`)."""
    backend = EnsembleStream(grpc_address, ensemble)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        await backend.close()

    app = FastAPI(title="splitspec OpenAI-compatible API", lifespan=lifespan, docs_url=None, redoc_url=None)

    @app.exception_handler(HTTPException)
    async def http_error(request, exc):  # unknown paths and methods, in OpenAI's error shape
        return error_response(api_errors.APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                                                  "invalid_request_error", None, None))

    @app.get("/v1/models")
    async def models():
        return schema.models_list(model.name, model.created)

    @app.get("/v1/models/{model_id:path}")
    async def one_model(model_id: str):
        if model_id != model.name:
            return error_response(api_errors.unknown_model(model_id, model.name))
        return schema.models_list(model.name, model.created)["data"][0]

    async def generate(request: Request, parse: Callable[[dict], schema.GenerationRequest]):
        try:
            body = await read_body(request, model.max_body_bytes, model.max_prompt_bytes, body_timeout_s)
            req = parse(schema.parse_json(body))
            if req.model != model.name:
                raise api_errors.unknown_model(req.model, model.name)
            text = model.prompt_text(req)
            events = backend.stream(text, model.max_tokens(req, text), req.ensemble_params())
            try:
                first = await _first(events)  # a refused request fails here, before any byte is sent
            except api_errors.APIError as e:
                raise api_errors.with_param(e, req) from None
            rid, created = schema.response_id(req.kind), int(time.time())
            if req.stream:
                return StreamingResponse(_sse(req, rid, created, _chain(first, events)), media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache"})

            async def rest():
                return [ev async for ev in _chain(first, events)]

            seen = await _unless_disconnected(request, rest())
            if seen is None:  # the client went away; the request was cancelled
                return Response(status_code=499)
            ans = merge(seen)
            return schema.answer(req, rid, created, ans["text_output"], ans.get("finish_reason"), schema.usage(ans))
        except api_errors.APIError as e:
            return error_response(e)
        except Exception as e:  # never let a request take the front end down
            log.exception("openai front end: internal error")
            return error_response(api_errors.APIError(500, f"internal error: {type(e).__name__}: {e}", "server_error",
                                                      None, "internal_error"))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generate(request, schema.parse_chat)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, schema.parse_completion)

    return app


class OpenAIServer:
    """The app under uvicorn on a thread of this process.

    Args:
        repo: the rendered model repository being served (tokenizer and limits are read from it).
        grpc_address: ``host:port`` of tritonserver's gRPC endpoint.
        port: port to listen on (0: any free one; :attr:`port` tells which).
        host: address to bind (default 127.0.0.1 only, as tritonserver; ``"0.0.0.0"``: every interface).
        name: the served model name (default: the engines folder's name).
        body_timeout_s: seconds a request's body may take to arrive before a 408 (> 0).
        header_timeout_s: seconds a connection may take to send a whole request head, from its opening or its
            previous answer, before it is closed; also how long an idle keep-alive connection is kept (> 0).
        max_connections: client connections held at once; one more is closed as soon as it is accepted (>= 1).
    """

    def __init__(self, repo: Path, grpc_address: str, port: int, host: str = "127.0.0.1", name: str | None = None,
                 body_timeout_s: float = BODY_TIMEOUT_S, header_timeout_s: float = HEADER_TIMEOUT_S,
                 max_connections: int = MAX_CONNECTIONS):
        if not 0 <= port <= 65535:
            raise ConfigError(f"--openai-port {port}: expected 0..65535")
        for what, value in (("body_timeout_s", body_timeout_s), ("header_timeout_s", header_timeout_s)):
            if not value > 0:
                raise ConfigError(f"{what} = {value}: expected seconds > 0")
        if max_connections < 1:
            raise ConfigError(f"max_connections = {max_connections}: expected at least 1")
        self.model = ServedModel.from_repo(Path(repo), name)
        self.grpc_address, self.host, self.port = grpc_address, host, port
        self.header_timeout_s, self.max_connections = header_timeout_s, max_connections
        self._server = self._thread = None
        self.gate = Gate(create_app(self.model, grpc_address, body_timeout_s=body_timeout_s))

    @property
    def url(self) -> str:
        """Base URL of the API (``http://127.0.0.1:PORT/v1`` when bound to all interfaces)."""
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        return f"http://{host}:{self.port}/v1"

    def start(self, timeout_s: float = 30.0) -> "OpenAIServer":
        """Bind the port, start serving, return once uvicorn accepts connections.

        Raises:
            ConfigError: the port is taken; SplitspecError: uvicorn did not start within ``timeout_s``.
        """
        import uvicorn

        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.host, self.port))
        except OSError as e:
            sock.close()
            raise ConfigError(f"--openai-port {self.port}: cannot listen on {self.host}:{self.port} ({e.strerror})") from None
        self.port = sock.getsockname()[1]
        # h11, not "auto" (httptools where installed): its 16 KiB bound on the request line and headers holds; the
        # head timeout, connection cap and framing refusals are openai_connection's
        protocol = bounded_protocol(self.header_timeout_s, self.max_connections)
        config = uvicorn.Config(single_framing(self.gate), http=protocol, log_level="warning", lifespan="on",
                                timeout_graceful_shutdown=5, timeout_keep_alive=self.header_timeout_s)
        limit_warning_log()
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, name="openai-frontend",
                                        daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise SplitspecError(f"the OpenAI front end did not start on port {self.port}")
            time.sleep(0.02)
        return self

    def drain(self) -> None:
        """Refuse new requests (503 ``service_unavailable``) from now on; those in flight go on."""
        self.gate.drain()

    def wait_idle(self, timeout_s: float) -> int:
        """Wait up to ``timeout_s`` until no request is in flight (each response complete, a stream's ``[DONE]``
        sent); return how many still are."""
        deadline = time.monotonic() + timeout_s
        while self.gate.active and time.monotonic() < deadline:
            time.sleep(0.02)
        return self.gate.active

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop serving (streams still open are closed, their requests cancelled: :meth:`drain` and
        :meth:`wait_idle` first let them finish). Safe to call twice."""
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout_s)
            WARNING_LOG_LIMIT.flush()  # the counts of uvicorn's warnings left out, not said yet
        self._server = self._thread = None

    def __enter__(self) -> "OpenAIServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
