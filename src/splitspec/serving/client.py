"""Clients for the served ensemble: HTTP ``generate`` / ``generate_stream`` and gRPC streaming (tritonclient).

Request inputs follow the TensorRT-LLM backend's ensemble (:data:`INPUTS`): ``text_input``, ``max_tokens``,
``stream``, ``temperature``, ``top_k``, ``top_p``, ``seed``, ``stop_words``, ``exclude_input_in_output``,
``return_num_input_tokens``, ``return_num_output_tokens``, ``return_perf_metrics``, ..., and this server's own
``stop``, ``num_draft_tokens``, ``return_token_ids``, ``return_stats``, ``apply_chat_template``. The ensemble is
batched (``max_batch_size`` 1): over gRPC every input travels as ``[1, n]`` (``[1, 1]`` for one value,
:func:`grpc_inputs`); HTTP generate adds that batch dimension itself, so its JSON holds plain values. Responses
carry ``text_output`` — with ``stream`` true, the text each engine cycle adds — and, when asked for,
``output_ids``, token counts (``num_output_tokens``: the tokens each response adds) and, in the final
response, the speculation statistics (``acceptance_rate``, ``acceptance_length``, ``accepted_per_position``,
engine times in ms), with its ``finish_reason``.

The ensemble contains a decoupled model (``spec_decode``), so Triton treats it as decoupled: gRPC's
unary ``ModelInfer`` is refused and requests go over the bidirectional stream
(``start_stream`` / ``async_stream_infer``); HTTP ``generate`` needs exactly one response (``stream``
false, the default), HTTP ``generate_stream`` (server-sent events) takes either.
"""

from __future__ import annotations

import json
import queue
import sys
import time
from typing import Iterator

import requests

from splitspec.errors import ConfigError, SplitspecError

#: One-off requests close their connection: an idle kept-alive connection delays server shutdown.
_CLOSE = {"Connection": "close"}
#: Default server address per protocol (``splitspec serve`` defaults).
DEFAULT_URLS = {"http": "127.0.0.1:8000", "grpc": "127.0.0.1:8001"}
_BOOL, _I32, _F32, _U64 = ("bool", "BOOL", False), ("int32", "INT32", False), ("float32", "FP32", False), \
    ("uint64", "UINT64", False)
_STRINGS = ("object", "BYTES", True)
#: The ensemble's inputs: name -> (numpy dtype name, Triton datatype, is a list); triton_repo/ensemble/config.pbtxt.in.
INPUTS = {
    "text_input": ("object", "BYTES", False), "max_tokens": _I32, "stream": _BOOL,
    "temperature": _F32, "top_k": _I32, "top_p": _F32, "seed": _U64, "random_seed": _U64,
    "stop_words": _STRINGS, "bad_words": _STRINGS, "end_id": _I32, "pad_id": _I32, "length_penalty": _F32,
    "beam_width": _I32, "num_return_sequences": _I32, "min_tokens": _I32, "repetition_penalty": _F32,
    "presence_penalty": _F32, "frequency_penalty": _F32, "return_log_probs": _BOOL, "return_context_logits": _BOOL,
    "return_generation_logits": _BOOL, "exclude_input_in_output": _BOOL, "return_perf_metrics": _BOOL,
    "return_num_input_tokens": _BOOL, "return_num_output_tokens": _BOOL,
    "stop": _STRINGS, "num_draft_tokens": _I32, "return_token_ids": _BOOL, "return_stats": _BOOL,
    "apply_chat_template": _BOOL, "timeout_ms": ("int64", "INT64", False),
}
#: Outputs whose value is a list (the others are single values).
LIST_OUTPUTS = ("output_ids", "accepted_per_position")
#: Outputs a stream's responses each carry a part of (:func:`merge` sums them); the others are per request.
SUMMED_OUTPUTS = ("num_output_tokens",)
#: Outputs of the ensemble.
OUTPUTS = ("text_output", "cum_log_probs", "output_log_probs", "batch_index", "sequence_index", "num_input_tokens",
           "num_output_tokens", "finish_reason", "output_ids", "acceptance_rate", "total_accepted_draft_tokens",
           "total_draft_tokens", "acceptance_length", "accepted_per_position", "queue_ms", "ttft_ms", "e2e_ms",
           "draft_ms", "verify_ms")


def _http_base(url: str) -> str:
    url = url.strip().rstrip("/")
    if not url:
        raise ConfigError("--url is empty: expected host:port, e.g. localhost:8000")
    return url if url.startswith(("http://", "https://")) else f"http://{url}"


def request_body(prompt: str, max_tokens: int, **params) -> dict:
    """The JSON body of a generate request (``None`` values are left out)."""
    return {"text_input": prompt, "max_tokens": max_tokens, **{k: v for k, v in params.items() if v is not None}}


def normalize(answer: dict) -> dict:
    """Make list outputs lists: HTTP generate renders a one-element tensor as a bare value."""
    for k in LIST_OUTPUTS:
        if k in answer and not isinstance(answer[k], list):
            answer[k] = [answer[k]]
    return answer


def merge(events) -> dict:
    """Fold a stream's responses into one: ``text_output`` and ``output_ids`` concatenated,
    ``num_output_tokens`` summed, every other output taken from the last response that carries it;
    ``num_responses`` counts the responses that carried text or ids."""
    out: dict = {"text_output": "", "num_responses": 0}
    for ev in events:
        if "text_output" in ev or "output_ids" in ev:
            out["num_responses"] += 1
        for k, v in ev.items():
            if k == "text_output":
                out[k] += v
            elif k == "output_ids":
                out.setdefault(k, []).extend(v)
            elif k in SUMMED_OUTPUTS:
                out[k] = out.get(k, 0) + v
            else:
                out[k] = v
    return out


# --------------------------------------------------------------------------------------------
# HTTP
# --------------------------------------------------------------------------------------------


def _raise_http(url: str, r: requests.Response) -> None:
    try:
        data = r.json()
    except ValueError:
        data = {"error": r.text}
    msg = data.get("error", data) if isinstance(data, dict) else data
    raise SplitspecError(f"{url}: HTTP {r.status_code}: {msg}")


def _unreachable(url: str, e: requests.RequestException) -> SplitspecError:
    """One line for a request that got no answer: a refused connection says how to start a server."""
    if isinstance(e, requests.ConnectionError) and "refused" in str(e).lower():
        return SplitspecError(f"{url}: no server answers there (connection refused); start one with 'make serve' or "
                              "'splitspec serve --repo triton_repo', or give its address with --url")
    return SplitspecError(f"{url}: request failed ({type(e).__name__}: {' '.join(str(e).split())[:200]})")


def ask_http(generate_url: str, prompt: str, max_tokens: int = 64, timeout_s: float = 300.0, **params) -> dict:
    """POST one (non-streaming) request to a ``generate`` URL and return its JSON answer.

    Args:
        generate_url: e.g. ``http://127.0.0.1:8000/v2/models/ensemble/generate``.
        params: further inputs (see :data:`INPUTS`); ``None`` values are left out.
        timeout_s: seconds to wait for the answer.
    Returns:
        the JSON answer (``text_output``, ``finish_reason``, and what ``return_*`` asked for).
    Raises:
        SplitspecError: the server answered with an error (its message is included) or is unreachable.
    """
    try:
        with requests.Session() as s:
            s.trust_env = False  # localhost: never through a proxy
            r = s.post(generate_url, json=request_body(prompt, max_tokens, **params), timeout=timeout_s, headers=_CLOSE)
    except requests.RequestException as e:
        raise _unreachable(generate_url, e) from None
    if r.status_code != 200:
        _raise_http(generate_url, r)
    data = r.json()
    if "error" in data:
        raise SplitspecError(f"{generate_url}: {data['error']}")
    return normalize(data)


def stream_http(generate_stream_url: str, prompt: str, max_tokens: int = 64, timeout_s: float = 300.0,
                **params) -> Iterator[dict]:
    """POST a request to a ``generate_stream`` URL (``stream`` defaults to true) and yield each
    server-sent event's JSON object as it arrives. Closing the generator early drops the connection,
    which cancels the request on the server.

    Args:
        timeout_s: seconds to wait for the connection and between two events.
    Raises:
        SplitspecError: the server answered with an error (also in the middle of a stream) or is unreachable.
    """
    params.setdefault("stream", True)
    s = requests.Session()
    s.trust_env = False
    try:
        try:
            r = s.post(generate_stream_url, json=request_body(prompt, max_tokens, **params), timeout=timeout_s,
                       headers=_CLOSE, stream=True)
        except requests.RequestException as e:
            raise _unreachable(generate_stream_url, e) from None
        with r:
            if r.status_code != 200:
                _raise_http(generate_stream_url, r)
            try:
                for line in r.iter_lines(chunk_size=None, decode_unicode=False):
                    if not line.startswith(b"data:"):
                        continue
                    ev = json.loads(line[5:].decode("utf-8"))
                    if "error" in ev:
                        raise SplitspecError(f"{generate_stream_url}: {ev['error']}")
                    yield normalize(ev)
            except requests.RequestException as e:
                raise SplitspecError(f"{generate_stream_url}: stream broken ({e})") from None
    finally:
        s.close()


# --------------------------------------------------------------------------------------------
# gRPC
# --------------------------------------------------------------------------------------------


def grpc_inputs(prompt: str, max_tokens: int, **params) -> list:
    """tritonclient.grpc ``InferInput`` list for a request: each input named by its keyword (:data:`INPUTS`;
    ``None`` values are left out), shaped ``[1, n]`` — the batch dimension of the batched ensemble, then the
    value (``[1, 1]``) or the list's ``n`` strings.

    Raises:
        ConfigError: an input name the ensemble does not have, or an integer its type cannot hold (``top_k`` =
            3000000000 for an INT32), named as given: NumPy 1.x would wrap it modulo 2^32 without a word.
    """
    import numpy as np
    import tritonclient.grpc as grpcclient

    out = []
    for name, value in request_body(prompt, max_tokens, **params).items():
        if name not in INPUTS:
            raise ConfigError(f"{name}: not an input of the ensemble (inputs: {', '.join(INPUTS)})")
        dtype, ttype, is_list = INPUTS[name]
        values = list(value) if is_list else [value]
        if dtype == "object":
            values = [v.encode("utf-8") if isinstance(v, str) else v for v in values]
        elif dtype.startswith(("int", "uint")):
            bits = np.iinfo(dtype)
            for v in values:
                if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                    raise ConfigError(f"{name} = {v!r}: expected an integer ({ttype})")
                if not bits.min <= int(v) <= bits.max:
                    raise ConfigError(f"{name} = {int(v)}: beyond {ttype}, the input's type ({bits.min}..{bits.max})")
        arr = np.array(values, dtype=dtype).reshape(1, len(values))
        t = grpcclient.InferInput(name, list(arr.shape), ttype)
        t.set_data_from_numpy(arr)
        out.append(t)
    return out


def is_final(result) -> bool:
    """Whether a gRPC stream response is its request's last (``triton_final_response``, sent when the request
    enables empty final responses)."""
    params = result.get_response().parameters
    return "triton_final_response" in params and params["triton_final_response"].bool_param


def result_dict(result) -> dict:
    """A gRPC response's outputs as Python values (strings decoded, lists for list outputs)."""
    out = {}
    for o in result.get_response().outputs:
        a = result.as_numpy(o.name)
        if a is None:
            continue
        vals = [v.decode("utf-8") if isinstance(v, bytes) else v.item() for v in a.reshape(-1)]
        out[o.name] = vals if o.name in LIST_OUTPUTS else (vals[0] if vals else None)
    return out


def stream_grpc(address: str, prompt: str, max_tokens: int = 64, timeout_s: float = 300.0,
                model: str = "ensemble", **params) -> Iterator[dict]:
    """Send one request over a gRPC stream (tritonclient) and yield each response's outputs until
    the final one. ``stream`` defaults to true. Closing the generator early cancels the request.

    Args:
        address: ``host:port`` of the gRPC endpoint.
        timeout_s: seconds to wait for the next response.
    Raises:
        SplitspecError: the server answered with an error, is unreachable, or timed out.
    """
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    params.setdefault("stream", True)
    inputs = grpc_inputs(prompt, max_tokens, **params)
    answers: queue.Queue = queue.Queue()

    def message(error) -> str:
        return error.message() if hasattr(error, "message") else str(error)

    try:
        client = grpcclient.InferenceServerClient(address)
    except InferenceServerException as e:
        raise SplitspecError(f"grpc {address}: {e.message()}") from None
    finished = False
    try:
        try:
            client.start_stream(callback=lambda result, error: answers.put((result, error)))
            client.async_stream_infer(model, inputs, enable_empty_final_response=True)
        except InferenceServerException as e:
            raise SplitspecError(f"grpc {address}: cannot send the request ({e.message()})") from None
        while True:
            try:
                result, error = answers.get(timeout=timeout_s)
            except queue.Empty:
                raise SplitspecError(f"grpc {address}: no response within {timeout_s:.0f} s") from None
            if error is not None:
                finished = True
                raise SplitspecError(f"grpc {address}: {message(error)}")
            ev = result_dict(result)
            final = is_final(result)
            if ev:
                yield ev
            if final:
                finished = True
                return
    finally:
        try:
            client.stop_stream(cancel_requests=not finished)
        except Exception:
            pass
        client.close()


def ask_grpc(address: str, prompt: str, max_tokens: int = 64, timeout_s: float = 300.0,
             model: str = "ensemble", **params) -> dict:
    """One request over gRPC, its responses folded by :func:`merge` (``stream`` defaults to false).

    Raises:
        SplitspecError: the server answered with an error, is unreachable, or timed out.
    """
    params.setdefault("stream", False)
    return merge(stream_grpc(address, prompt, max_tokens, timeout_s, model, **params))


# --------------------------------------------------------------------------------------------
# splitspec client
# --------------------------------------------------------------------------------------------


def request_parameters(*, chat: bool = False, num_draft_tokens: int | None = None, temperature: float | None = None,
                       top_p: float | None = None, top_k: int | None = None, seed: int | None = None,
                       stop: list[str] | None = None, stream: bool = True) -> dict:
    """The request inputs ``splitspec client`` sends besides the prompt and max_tokens: ``return_stats``,
    ``stream`` and every option given (0 is a value: ``-k 0`` turns speculation off, ``--seed 0`` seeds)."""
    params: dict = {"return_stats": True}
    for key, v in (("apply_chat_template", chat), ("num_draft_tokens", num_draft_tokens), ("temperature", temperature),
                   ("top_p", top_p), ("top_k", top_k), ("seed", seed)):
        if v is not None and v is not False:
            params[key] = v
    if stop:
        params["stop"] = list(stop)
    params["stream"] = stream
    return params


def run_client(prompt: str, *, url: str | None = None, protocol: str = "http", max_tokens: int = 64,
               stream: bool = True, **options) -> None:
    """``splitspec client``: send ``prompt`` to a running server and print the answer as it streams.

    Args:
        url: ``host:port`` (the HTTP port for http, the gRPC port for grpc; None: 127.0.0.1:8000 for
            http, 127.0.0.1:8001 for grpc).
        protocol: ``http`` or ``grpc``.
        stream: one response per engine cycle (False: one at the end).
        options: the request's options (:func:`request_parameters`: ``chat``, ``num_draft_tokens``,
            ``temperature``, ``top_p``, ``top_k``, ``seed``, ``stop``).

    Ends with one line of statistics: time to first text, output tokens per second, acceptance length.

    Raises:
        ConfigError: a bad argument (the message names it).
        SplitspecError: the server is unreachable or answered with an error.
    """
    if not 1 <= max_tokens <= 4096:
        raise ConfigError(f"--max-tokens = {max_tokens}: expected 1..4096")
    params = request_parameters(stream=stream, **options)
    url = url or DEFAULT_URLS.get(protocol, "")
    if protocol == "http":
        base = f"{_http_base(url)}/v2/models/ensemble"
        events = stream_http(f"{base}/generate_stream", prompt, max_tokens, **params)
    elif protocol == "grpc":
        events = stream_grpc(url.split("://", 1)[-1].rstrip("/"), prompt, max_tokens, **params)
    else:
        raise ConfigError(f"--protocol = {protocol!r}: expected http or grpc")
    t0 = time.monotonic()
    first = None
    seen = []
    for ev in events:
        seen.append(ev)
        text = ev.get("text_output", "")
        if text:
            if first is None:
                first = time.monotonic() - t0
            sys.stdout.write(text)
            sys.stdout.flush()
    total = time.monotonic() - t0
    ans = merge(seen)
    n = ans.get("num_output_tokens")
    acc = ans.get("acceptance_length")
    parts = [f"{protocol}{' stream' if stream else ''}", f"{total * 1000:.0f} ms"]
    if first is not None:
        parts.append(f"first text after {first * 1000:.0f} ms")
    if n:
        parts.append(f"{n} tokens, {n / total:.1f} tokens/s")
    if acc is not None:
        parts.append(f"acceptance length {float(acc):.2f}")
    if ans.get("finish_reason"):
        parts.append(f"finish {ans['finish_reason']}")
    print(f"\n[{', '.join(parts)}]", flush=True)
