"""Clients for the served ensemble: HTTP ``/v2/models/ensemble/generate`` and gRPC (tritonclient).

The ensemble contains a decoupled model (``spec_decode``), so Triton treats the ensemble as
decoupled: the unary gRPC ``ModelInfer`` call is refused ("doesn't support models with decoupled
transaction policy") and gRPC requests go over the bidirectional stream instead
(``start_stream`` / ``async_stream_infer``), reading responses until the one flagged final.
HTTP ``generate`` accepts a decoupled model as long as it sends exactly one response, which
``spec_decode`` does in this version.
"""

from __future__ import annotations

import argparse
import queue
import time

import requests

from splitspec.errors import ConfigError, SplitspecError

#: One-off requests close their connection: an idle kept-alive connection delays server shutdown.
_CLOSE = {"Connection": "close"}
#: Default server address per protocol (``splitspec serve`` defaults).
DEFAULT_URLS = {"http": "127.0.0.1:8000", "grpc": "127.0.0.1:8001"}


def _http_base(url: str) -> str:
    url = url.strip().rstrip("/")
    if not url:
        raise ConfigError("--url is empty: expected host:port, e.g. localhost:8000")
    return url if url.startswith(("http://", "https://")) else f"http://{url}"


def ask_http(generate_url: str, prompt: str, max_tokens: int = 64, timeout_s: float = 300.0,
             **params) -> dict:
    """POST ``{"text_input": prompt, "max_tokens": max_tokens, **params}`` to a generate URL.

    Args:
        generate_url: e.g. ``http://127.0.0.1:8000/v2/models/ensemble/generate``.
        params: further ensemble inputs (``temperature``, ``num_draft_tokens``, ``apply_chat_template``).
        timeout_s: seconds to wait for the answer.
    Returns:
        the JSON answer (``text_output``, ``acceptance_length``, ``model_name`` ...).
    Raises:
        SplitspecError: the server answered with an error (its message is included) or is unreachable.
    """
    body = {"text_input": prompt, "max_tokens": max_tokens, **params}
    try:
        with requests.Session() as s:
            s.trust_env = False  # localhost: never through a proxy
            r = s.post(generate_url, json=body, timeout=timeout_s, headers=_CLOSE)
    except requests.RequestException as e:
        raise SplitspecError(f"{generate_url}: request failed ({e})") from None
    try:
        data = r.json()
    except ValueError:
        data = {"error": r.text}
    if r.status_code != 200 or "error" in data:
        msg = data.get("error", data) if isinstance(data, dict) else data
        raise SplitspecError(f"{generate_url}: HTTP {r.status_code}: {msg}")
    return data


def ask_grpc(address: str, prompt: str, max_tokens: int = 64, timeout_s: float = 300.0,
             model: str = "ensemble", temperature: float | None = None,
             num_draft_tokens: int | None = None, apply_chat_template: bool | None = None) -> dict:
    """Send one request to ``model`` over a gRPC stream (tritonclient) and return its outputs.

    Args:
        address: ``host:port`` of the gRPC endpoint.
        timeout_s: seconds to wait for the final response.
    Returns:
        ``{"text_output": str, "acceptance_length": float}`` (from the last response holding data).
    Raises:
        SplitspecError: the server answered with an error, is unreachable, or timed out.
    """
    import numpy as np
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    def tensor(name, value, dtype, triton_type):
        t = grpcclient.InferInput(name, [1], triton_type)
        t.set_data_from_numpy(np.array([value], dtype=dtype))
        return t

    inputs = [tensor("text_input", prompt.encode("utf-8"), np.object_, "BYTES"),
              tensor("max_tokens", max_tokens, np.int32, "INT32")]
    if temperature is not None:
        inputs.append(tensor("temperature", temperature, np.float32, "FP32"))
    if num_draft_tokens is not None:
        inputs.append(tensor("num_draft_tokens", num_draft_tokens, np.int32, "INT32"))
    if apply_chat_template is not None:
        inputs.append(tensor("apply_chat_template", bool(apply_chat_template), np.bool_, "BOOL"))
    outputs = [grpcclient.InferRequestedOutput("text_output"), grpcclient.InferRequestedOutput("acceptance_length")]

    answers: queue.Queue = queue.Queue()
    answer: dict = {}
    def stream_error() -> str | None:
        """The error the stream callback reported, if any (tritonclient puts the detail there)."""
        while not answers.empty():
            _, error = answers.get_nowait()
            if error is not None:
                return error.message() if hasattr(error, "message") else str(error)
        return None

    try:
        client = grpcclient.InferenceServerClient(address)
    except InferenceServerException as e:
        raise SplitspecError(f"grpc {address}: {e.message()}") from None
    try:
        live = client.is_server_live(client_timeout=min(10.0, timeout_s))
    except InferenceServerException as e:
        client.close()
        raise SplitspecError(f"grpc {address}: cannot reach the server ({e.message()})") from None
    if not live:
        client.close()
        raise SplitspecError(f"grpc {address}: the server is not live")
    try:
        client.start_stream(callback=lambda result, error: answers.put((result, error)))
        try:
            client.async_stream_infer(model, inputs, outputs=outputs, enable_empty_final_response=True)
        except InferenceServerException as e:
            raise SplitspecError(f"grpc {address}: {stream_error() or e.message()}") from None
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise SplitspecError(f"grpc {address}: no final response within {timeout_s:.0f} s")
            try:
                result, error = answers.get(timeout=left)
            except queue.Empty:
                continue
            if error is not None:
                msg = error.message() if hasattr(error, "message") else str(error)
                raise SplitspecError(f"grpc {address}: {msg}")
            text = result.as_numpy("text_output")
            if text is not None:
                out = text.reshape(-1)[0]
                answer["text_output"] = out.decode("utf-8") if isinstance(out, bytes) else str(out)
                answer["acceptance_length"] = float(result.as_numpy("acceptance_length").reshape(-1)[0])
            params = result.get_response().parameters
            if "triton_final_response" in params and params["triton_final_response"].bool_param:
                break
    except InferenceServerException as e:
        raise SplitspecError(f"grpc {address}: {stream_error() or e.message()}") from None
    finally:
        try:
            client.stop_stream()
        finally:
            client.close()
    if "text_output" not in answer:
        raise SplitspecError(f"grpc {address}: the final response carried no text_output")
    return answer


def main(args: argparse.Namespace) -> None:
    """``splitspec client``: send ``args.prompt`` to a running server and print the answer.

    Uses ``args.url`` (``host:port``; the HTTP port for http, the gRPC port for grpc; None:
    127.0.0.1:8000 for http, 127.0.0.1:8001 for grpc),
    ``args.protocol`` (``http`` or ``grpc``), ``args.max_tokens``, and when present
    ``args.chat`` (apply the chat template) and ``args.num_draft_tokens``.

    Raises:
        ConfigError: a bad argument (the message names it).
        SplitspecError: the server is unreachable or answered with an error.
    """
    if not 1 <= args.max_tokens <= 4096:
        raise ConfigError(f"--max-tokens = {args.max_tokens}: expected 1..4096")
    extra: dict = {}
    if getattr(args, "chat", False):
        extra["apply_chat_template"] = True
    if getattr(args, "num_draft_tokens", None) is not None:
        extra["num_draft_tokens"] = args.num_draft_tokens
    url = args.url or DEFAULT_URLS.get(args.protocol, "")
    t0 = time.monotonic()
    if args.protocol == "http":
        url = f"{_http_base(url)}/v2/models/ensemble/generate"
        answer = ask_http(url, args.prompt, max_tokens=args.max_tokens, **extra)
    elif args.protocol == "grpc":
        address = url.split("://", 1)[-1].rstrip("/")
        answer = ask_grpc(address, args.prompt, max_tokens=args.max_tokens, **extra)
    else:
        raise ConfigError(f"--protocol = {args.protocol!r}: expected http or grpc")
    ms = (time.monotonic() - t0) * 1000
    print(answer["text_output"])
    acc = answer.get("acceptance_length")
    if isinstance(acc, list):
        acc = acc[0]
    print(f"[{args.protocol} {ms:.0f} ms, acceptance length {float(acc):.2f}]", flush=True)
