"""Requests to the ``spec_decode`` model: reading and checking their inputs, without Triton.

The Triton model hands this module plain values — a mapping from input name to the request's NumPy array
(absent inputs missing or None, :func:`splitspec.serving.triton.read_inputs`) and the request's parameters
as JSON text — and gets back the runtime :class:`~splitspec.runtime.types.Request` and the options that
shape its responses (:class:`StreamOptions`), or a :class:`~splitspec.errors.ConfigError` whose message names
the input. The model answers that error with INVALID_ARG (HTTP 400). The inputs and their types are those of
``triton_repo/spec_decode/config.pbtxt.in``.

Sampling values are range-checked by the engine when it takes the request (``SamplingParams.check``); a
request it refuses comes back as a ``"rejected"`` event.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping

import numpy as np

from splitspec.errors import ConfigError
from splitspec.runtime.sampling import SamplingParams
from splitspec.runtime.types import Request

#: Inputs of the ensemble (named when a request carries an unknown parameter).
ENSEMBLE_INPUTS = ("text_input", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream",
                   "num_draft_tokens", "return_token_ids", "return_stats", "apply_chat_template")
#: Request parameters Triton's front ends may attach themselves (never rejected).
TRITON_PARAMETERS = frozenset({"sequence_id", "sequence_start", "sequence_end", "priority", "timeout",
                               "binary_data_output", "headers"})
#: Inputs ``spec_decode`` reads from a generation request.
SPEC_DECODE_INPUTS = ("input_ids", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream",
                      "num_draft_tokens", "return_token_ids", "return_stats")
#: The control input postprocessing sends to cancel a stream (no other input is read then).
CANCEL_INPUT = "cancel_stream_id"
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256

Inputs = Mapping[str, "np.ndarray | None"]


@dataclasses.dataclass(frozen=True)
class StreamOptions:
    """How a request's responses are sent.

    Attributes:
        stream: one response per engine cycle with the text it adds; False: one response at the end.
        return_token_ids: responses carry ``output_ids``.
        return_stats: the final response carries the request's statistics and engine times.
    """

    stream: bool = False
    return_token_ids: bool = False
    return_stats: bool = False


def scalar(inputs: Inputs, name: str):
    """The single element of optional input ``name``, or None when the request lacks it.

    Raises:
        ConfigError: the input holds more or fewer than one value.
    """
    a = inputs.get(name)
    if a is None:
        return None
    a = np.asarray(a)
    if a.size != 1:
        raise ConfigError(f"{name}: expected one value, got shape {list(a.shape)}")
    return a.reshape(-1)[0]


def strings(inputs: Inputs, name: str) -> list[str]:
    """Input ``name`` (TYPE_STRING, any length) as a list of str; [] when absent.

    Raises:
        ConfigError: an element is bytes that are not UTF-8.
    """
    a = inputs.get(name)
    if a is None:
        return []
    out = []
    for v in np.asarray(a).reshape(-1):
        if isinstance(v, bytes):
            try:
                v = v.decode("utf-8")
            except UnicodeDecodeError:
                raise ConfigError(f"{name}: not valid UTF-8") from None
        out.append(str(v))
    return out


def cancel_stream_id(inputs: Inputs) -> int | None:
    """The stream a control request cancels (input :data:`CANCEL_INPUT`), or None for a generation request."""
    v = scalar(inputs, CANCEL_INPUT)
    return None if v is None else int(v)


def check_parameters(parameters: str | None) -> None:
    """Reject request parameters that are not inputs: HTTP generate turns unknown JSON keys into parameters,
    which would otherwise be ignored without a word. ``parameters``: the request's parameters as JSON text
    (unparsable text counts as none).

    Raises:
        ConfigError: naming the unknown parameters and listing the inputs.
    """
    try:
        params = json.loads(parameters) if parameters else {}
    except ValueError:
        params = {}
    if not isinstance(params, dict):
        params = {}
    unknown = sorted(k for k in params if k not in TRITON_PARAMETERS and not k.startswith("triton_"))
    if unknown:
        names = ", ".join(repr(k) for k in unknown)
        raise ConfigError(f"unknown parameter{'s' if len(unknown) > 1 else ''} {names}: not an input of "
                          f"this model (inputs: {', '.join(ENSEMBLE_INPUTS)})")


def check_stop(stop: list[str]) -> None:
    """Raise ConfigError unless ``stop`` holds at most :data:`MAX_STOP_STRINGS` non-empty strings of at most
    :data:`MAX_STOP_CHARS` characters each."""
    if len(stop) > MAX_STOP_STRINGS:
        raise ConfigError(f"stop: {len(stop)} strings, at most {MAX_STOP_STRINGS}")
    for s in stop:
        if not s:
            raise ConfigError("stop: empty string")
        if len(s) > MAX_STOP_CHARS:
            raise ConfigError(f"stop: a string of {len(s)} characters, at most {MAX_STOP_CHARS}")


def _fp32(v) -> float:
    """The shortest decimal that round-trips an FP32 input (0.7, not 0.699999988)."""
    return float(str(v))


def parse_request(inputs: Inputs, max_tokens_limit: int) -> tuple[Request, StreamOptions]:
    """Read and check a generation request's inputs.

    Args:
        inputs: input name → the request's array (absent inputs missing or None).
        max_tokens_limit: the largest ``max_tokens`` accepted (the model's parameter ``max_tokens_limit``).
    Returns:
        the runtime request and its stream options.
    Raises:
        ConfigError: naming the input that is missing, empty, out of range or not one value.
    """
    ids = inputs.get("input_ids")
    if ids is None:
        raise ConfigError("input_ids: missing")
    prompt = np.asarray(ids).reshape(-1)
    if prompt.size == 0:
        raise ConfigError("input_ids: empty prompt")
    max_tokens = scalar(inputs, "max_tokens")
    if max_tokens is None:
        raise ConfigError("max_tokens: missing")
    max_tokens = int(max_tokens)
    if not 1 <= max_tokens <= max_tokens_limit:
        raise ConfigError(f"max_tokens = {max_tokens}: expected 1..{max_tokens_limit}")

    def opt(name, default, cast):
        v = scalar(inputs, name)
        return default if v is None else cast(v)

    sampling = SamplingParams(temperature=opt("temperature", 0.0, _fp32), top_p=opt("top_p", 1.0, _fp32),
                              top_k=opt("top_k", 0, int), seed=opt("seed", None, int))
    k = opt("num_draft_tokens", None, int)
    stop = strings(inputs, "stop")
    check_stop(stop)
    options = StreamOptions(stream=opt("stream", False, bool), return_token_ids=opt("return_token_ids", False, bool),
                            return_stats=opt("return_stats", False, bool))
    req = Request(prompt_ids=prompt.astype(np.int64).tolist(), max_tokens=max_tokens, sampling=sampling,
                  num_draft_tokens=k, stop=stop)
    return req, options
