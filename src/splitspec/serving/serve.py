"""``splitspec serve``: tritonserver on the model repository under a :class:`~splitspec.serving.supervisor.Supervisor`,
optionally the OpenAI-compatible API beside it, until Ctrl-C or SIGTERM (both stop gracefully: streams in flight
end with a final response, :meth:`Supervisor.shutdown`)."""

from __future__ import annotations

import contextlib
import json
import resource
import signal
import time
from pathlib import Path

from splitspec.errors import ConfigError, SplitspecError
from splitspec.serving.client import ask_grpc, ask_http, merge, stream_http
from splitspec.serving.supervisor import STALL_S, Supervisor
from splitspec.serving.tritonserver import TritonServer, check_port_free, check_repo


def serve_forever(repo: Path, http_port: int = 8000, grpc_port: int = 8001, metrics_port: int = 8002,
                  ask: str | None = None, max_tokens: int = 64, openai_port: int | None = None,
                  served_model_name: str | None = None, admin_key: str | None = None, health_port: int = 8003,
                  drain_s: float = 10.0, restart_limit: int = 5, stable_s: float = 60.0,
                  stall_s: float = STALL_S) -> None:
    """Start tritonserver on ``repo`` under a supervisor and print its endpoints; serve until Ctrl-C or SIGTERM.

    Clients reach tritonserver's HTTP through the supervisor's HTTP guard on ``http_port``, which bounds body size and
    JSON nesting (:mod:`splitspec.serving.http_guard`); tritonserver itself listens on a private loopback port.
    The supervisor restarts the pipeline after a fault and serves readiness and the health metric on ``health_port``
    (:mod:`splitspec.serving.health_endpoint`). The control APIs answer only requests carrying ``admin_key`` (None:
    none; :mod:`splitspec.serving.access`). A stop gives requests in flight ``drain_s`` seconds, then ends the rest
    with ``finish_reason`` ``"shutdown"``. ``restart_limit`` / ``stable_s``: the supervisor's bound on a crash loop
    (:class:`Supervisor` ``max_restarts`` / ``stable_s``; ``restart_limit`` 0: never restart, the first fault ends
    serving with an error); ``stall_s``: its stall limit for the engine's heartbeat. A port of 0 (any of them) is a
    free one picked at start; the endpoints printed show it.

    With ``openai_port``, also serve the OpenAI-compatible API there from this process
    (:class:`~splitspec.serving.openai_api.OpenAIServer`, model ``served_model_name``, default the engines
    folder's name), over tritonserver's gRPC endpoint; it stops with the server.

    With ``ask``, send that prompt over HTTP generate, HTTP generate_stream and gRPC streaming, print
    the three answers (they must be equal) and the acceptance length, then stop the server and
    return (``make demo``).

    Raises:
        ConfigError: the repository is not rendered, a port is taken or outside 0..65535, ``restart_limit`` is
            negative, or ``admin_key`` is not a valid key.
        SplitspecError: the server failed to start (log tail included), answered with an error, or kept failing
            after restarts.
    """
    ports = {"--http-port": http_port, "--grpc-port": grpc_port, "--metrics-port": metrics_port,
             "--health-port": health_port, "--openai-port": openai_port}
    for what, port in ports.items():
        if port is not None and not 0 <= port <= 65535:
            raise ConfigError(f"{what} = {port}: expected a TCP port in 1..65535, or 0 for a free one")
    check_repo(repo)  # before anything starts or is printed
    for what in ("--http-port", "--openai-port", "--health-port"):  # served from this process
        if ports[what]:
            check_port_free(ports[what], what)
    raise_fd_limit()
    sup = Supervisor(repo, http_port=http_port, grpc_port=grpc_port, metrics_port=metrics_port,
                     health_port=health_port, drain_s=drain_s, admin_key=admin_key,
                     max_restarts=restart_limit, stable_s=stable_s, stall_s=stall_s)

    def on_term(signum, frame):  # `kill PID`, service managers: stop as Ctrl-C does
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        print(f"starting tritonserver on {repo} ...", flush=True)
        _serve(sup, ask, max_tokens, openai_port, served_model_name)
    except KeyboardInterrupt:
        print("interrupted; tritonserver stopped", flush=True)
    finally:
        signal.signal(signal.SIGTERM, previous)


def raise_fd_limit() -> None:
    """Raise this process's soft limit on open files to its hard one (often 1,024 of 524,288): the HTTP guard holds
    up to 1,024 client connections, the OpenAI API and tritonserver (which inherits it) their own."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def print_endpoints(srv: TritonServer, openai_url: str | None = None, model_name: str = "",
                    health_url: str | None = None) -> None:
    """Print the server's endpoints (and the OpenAI-compatible API's base URL, when it runs) and a curl example."""
    print(f"  HTTP generate        : {srv.generate_url}", flush=True)
    print(f"  HTTP generate_stream : {srv.generate_stream_url}  (server-sent events)", flush=True)
    print(f"  gRPC                 : {srv.grpc_address}  (model 'ensemble', streaming: stream_infer)", flush=True)
    if openai_url:
        print(f"  OpenAI API           : {openai_url}  (model '{model_name}': chat/completions, completions, models)",
              flush=True)
    print(f"  metrics (Prometheus) : {srv.metrics_url}", flush=True)
    print(f"  readiness            : {srv.model_url('spec_decode')}/ready", flush=True)
    if health_url:
        print(f"  supervisor           : {health_url}/v2/health/ready, {health_url}/metrics (splitspec_pipeline_healthy)",
              flush=True)
    print(f"  per-model statistics : {srv.model_url('ensemble')}/stats", flush=True)
    print(f"  try: curl -N -X POST {srv.generate_stream_url} "
          """-d '{"text_input": "def fibonacci(n):", "max_tokens": 32, "stream": true}'""", flush=True)
    if openai_url:
        print(f"  try: curl {openai_url}/chat/completions -H 'Content-Type: application/json' "
              f"""-d '{{"model": "{model_name}", "messages": [{{"role": "user", "content": "def fibonacci(n):"}}], """
              """"max_tokens": 32}'""", flush=True)


def _ask(srv: TritonServer, ask: str, max_tokens: int) -> None:
    """Send ``ask`` through the three doors and print the answers (``make demo``); they must be equal."""
    t = time.monotonic()
    h = ask_http(srv.generate_url, ask, max_tokens=max_tokens, return_stats=True)
    t_http = time.monotonic() - t
    t = time.monotonic()
    s = merge(stream_http(srv.generate_stream_url, ask, max_tokens=max_tokens))
    t_stream = time.monotonic() - t
    t = time.monotonic()
    g = ask_grpc(srv.grpc_address, ask, max_tokens=max_tokens, stream=True)
    t_grpc = time.monotonic() - t
    print(f"prompt: {ask!r}")
    print(f"HTTP answer ({t_http * 1000:.0f} ms): {json.dumps(h['text_output'])}")
    print(f"HTTP stream ({t_stream * 1000:.0f} ms, {s['num_responses']} responses): {json.dumps(s['text_output'])}")
    print(f"gRPC stream ({t_grpc * 1000:.0f} ms, {g['num_responses']} responses): {json.dumps(g['text_output'])}")
    print(f"acceptance length: {float(h['acceptance_length']):.2f} tokens per target forward")
    if not h["text_output"] == s["text_output"] == g["text_output"]:
        raise SplitspecError("HTTP, HTTP-stream and gRPC-stream answers differ for the same greedy request")
    print("HTTP, HTTP stream and gRPC stream: the same text")


def _serve(sup: Supervisor, ask: str | None, max_tokens: int, openai_port: int | None = None,
           model_name: str | None = None) -> None:
    """Serve until a stop. The OpenAI front end stops after the supervisor's graceful stop, in which it refuses new
    requests and passes the last responses of those in flight on before tritonserver stops (:meth:`Supervisor.shutdown`)."""
    front = None
    try:
        with sup:
            srv = sup.srv
            print(f"ready after {srv.startup_s:.1f} s (log {srv.log_path})", flush=True)
            if openai_port is not None:
                from splitspec.serving.openai_api import OpenAIServer  # FastAPI: only when asked for

                front = OpenAIServer(srv.repo, srv.grpc_address, openai_port, name=model_name)
                front.start()
                sup.front_ends.append(front)
            print_endpoints(srv, front.url if front else None, front.model.name if front else "", sup.health_url)
            if ask is not None:
                _ask(srv, ask, max_tokens)
                return
            print("serving; Ctrl-C stops the server", flush=True)
            try:
                while not sup.failed:
                    time.sleep(0.5)
            except KeyboardInterrupt:
                print("\nstopping: draining requests in flight, then tritonserver ...", flush=True)
                return
            gave_up = ("the pipeline failed and the restart limit is 0" if not sup.max_restarts
                       else "the pipeline kept failing; gave up after restarts")
            raise SplitspecError(f"{gave_up} (log {sup.srv.log_path}):\n{sup.srv.log_tail()}")
    finally:
        if front is not None:
            front.stop()
