"""Requests to the ``spec_decode`` model: reading and checking their inputs, without Triton.

The Triton model hands this module plain values — a mapping from input name to the request's NumPy array
(absent inputs missing or None, :func:`splitspec.serving.triton.read_inputs`) and the request's parameters
as JSON text — and gets back the runtime :class:`~splitspec.runtime.types.Request` and the options that
shape its responses (:class:`StreamOptions`), or a :class:`~splitspec.errors.ConfigError` whose message names
the input. The model answers that error with INVALID_ARG (HTTP 400), and a
:class:`~splitspec.errors.ServerBusy` (:func:`check_capacity`) with UNAVAILABLE (HTTP 503). The inputs and
their types are those of ``triton_repo/spec_decode/config.pbtxt.in`` (:func:`prompt_text`: preprocessing's
``text_input``); each arrives with a leading batch dimension of 1 (the models are
batched, ``max_batch_size`` 1), which the readers here flatten away.

Input names, types and meanings follow the TensorRT-LLM backend's ensemble
(``all_models/inflight_batcher_llm/ensemble/config.pbtxt`` in triton-inference-server/tensorrtllm_backend, now
``triton_backend/all_models`` in NVIDIA/TensorRT-LLM): ``stop_words`` joins our ``stop`` strings, ``seed`` (older
name ``random_seed``) seeds the sampler, ``end_id`` replaces the end-of-sequence tokens. The controls of that
convention this server does not implement (:data:`UNSUPPORTED`, ``bad_words``) are accepted at their neutral
value and refused, naming the input, at any other.

What only the JSON of an HTTP ``generate`` request shows is checked before tritonserver reads it, by
:mod:`splitspec.serving.generate_json`.

Sampling values are range-checked by the engine when it takes the request (``SamplingParams.check``); a
request it refuses comes back as a ``"rejected"`` event. ``seed`` and ``top_k`` are checked here already, where the
input's own name and its value as Triton delivered it are known: a UINT64 seed of 2^63 or more (the engine's seeds
are 0..2^63 - 1), and an INT32 top_k that Triton's HTTP front end wrapped negative (``"top_k": 3000000000`` arrives
as -1294967296: the message names both).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import numpy as np

from splitspec.errors import ConfigError, ServerBusy
from splitspec.runtime.types import SEED_MAX

if TYPE_CHECKING:  # imported where a request is built: the preprocessing stub reads prompts without loading torch
    from splitspec.runtime.types import Request

#: Controls of the TensorRT-LLM convention not implemented here: name -> (accepted when, what is accepted).
UNSUPPORTED: dict[str, tuple[Callable[[float], bool], str]] = {
    "beam_width": (lambda v: v == 1, "1 (no beam search)"),
    "num_return_sequences": (lambda v: v == 1, "1 (one sequence per request)"),
    "min_tokens": (lambda v: v <= 1, "0 or 1 (no minimum length)"),
    "repetition_penalty": (lambda v: v == 1.0, "1.0 (no penalty)"),
    "presence_penalty": (lambda v: v == 0.0, "0.0 (no penalty)"),
    "frequency_penalty": (lambda v: v == 0.0, "0.0 (no penalty)"),
    "return_log_probs": (lambda v: not v, "false (log probabilities are not computed)"),
    "return_context_logits": (lambda v: not v, "false (logits are not returned)"),
    "return_generation_logits": (lambda v: not v, "false (logits are not returned)"),
}
#: Inputs of the ensemble (named when a request carries an unknown parameter).
ENSEMBLE_INPUTS = ("text_input", "max_tokens", "stream", "temperature", "top_k", "top_p", "seed", "random_seed",
                   "stop_words", "bad_words", "end_id", "pad_id", "length_penalty", *UNSUPPORTED,
                   "exclude_input_in_output", "return_perf_metrics", "return_num_input_tokens",
                   "return_num_output_tokens", "stop", "num_draft_tokens", "return_token_ids", "return_stats",
                   "apply_chat_template", "timeout_ms")
#: Request parameters Triton's front ends may attach themselves (never rejected).
TRITON_PARAMETERS = frozenset({"sequence_id", "sequence_start", "sequence_end", "priority", "timeout",
                               "binary_data_output", "headers"})
#: Inputs ``spec_decode`` reads from a generation request: the ensemble's, with ``input_ids`` (from preprocessing)
#: for ``apply_chat_template``; ``text_input`` is read only to echo the prompt (``exclude_input_in_output`` false).
SPEC_DECODE_INPUTS = ("input_ids", *(n for n in ENSEMBLE_INPUTS if n != "apply_chat_template"))
#: The control input postprocessing sends to cancel a stream (no other input is read then).
CANCEL_INPUT = "cancel_stream_id"
#: Added to an out-of-range INT32 value's error: what the client may have sent (docs/serving.md, "Integer inputs").
INT32_HINT = (" (an INT32 input: Triton's HTTP front end wraps a JSON integer modulo 2^32, so 2^31..2^32-1 arrives "
              "negative)")
#: Largest value of the ensemble's INT32 inputs (max_tokens, top_k, num_draft_tokens).
INT32_MAX = 2**31 - 1
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256

Inputs = Mapping[str, "np.ndarray | None"]


@dataclasses.dataclass(frozen=True)
class StreamOptions:
    """How a request's responses are sent.

    Attributes:
        stream: one response per engine cycle with the text it adds; False: one response at the end.
        return_token_ids: responses carry ``output_ids``.
        return_stats: the final response carries the request's speculation statistics (acceptance_rate,
            total_accepted_draft_tokens, total_draft_tokens, acceptance_length, accepted_per_position) and
            engine times (input ``return_stats`` or ``return_perf_metrics``).
        return_num_input_tokens: every response carries ``num_input_tokens`` (the prompt's tokens).
        return_num_output_tokens: every response carries ``num_output_tokens``: the tokens it adds (all of
            them when not streaming), so a stream's values sum to the request's output length.
        echo: text put before the output of the (non-streamed) response: the prompt, when
            ``exclude_input_in_output`` is false; None: nothing.
    """

    stream: bool = False
    return_token_ids: bool = False
    return_stats: bool = False
    return_num_input_tokens: bool = False
    return_num_output_tokens: bool = False
    echo: str | None = None


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


def prompt_text(inputs: Inputs, max_bytes: int) -> str:
    """The prompt of a request (input ``text_input``, TYPE_STRING [1, 1]) as str, checked before it is tokenised.

    Args:
        inputs: input name → the request's array.
        max_bytes: the longest prompt accepted, in UTF-8 bytes (``ServeConfig.max_prompt_bytes``).
    Raises:
        ConfigError: naming ``text_input``: missing, more than one value, longer than ``max_bytes`` (checked on the
            bytes, before decoding), not UTF-8, or empty.
    """
    raw = scalar(inputs, "text_input")
    if raw is None:
        raise ConfigError("text_input: missing (a required input: the prompt)")
    size = len(raw) if isinstance(raw, bytes) else len(str(raw).encode("utf-8"))
    if size > max_bytes:
        raise ConfigError(f"text_input: {size} bytes, at most {max_bytes} (max_prompt_bytes: a longer prompt cannot "
                          "fit the engine's max_seq_len)")
    if isinstance(raw, bytes):
        try:
            raw = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise ConfigError("text_input: not valid UTF-8") from None
    text = str(raw)
    if not text:
        raise ConfigError("text_input: empty prompt")
    return text


def check_capacity(open_requests: int, max_batch_size: int, max_queue_len: int) -> None:
    """Refuse a new request when ``open_requests`` (accepted and not finished) already fill the batch
    (``max_batch_size``) and the wait queue (``max_queue_len``).

    Raises:
        ServerBusy: saying how many requests are open and the limits.
    """
    if open_requests >= max_batch_size + max_queue_len:
        raise ServerBusy(f"server busy: {open_requests} requests open, at most {max_batch_size} decoding and "
                         f"{max_queue_len} waiting (max_queue_len); retry later")


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


def check_stop(stop: list[str], name: str = "stop") -> None:
    """Raise ConfigError unless ``stop`` holds at most :data:`MAX_STOP_STRINGS` non-empty strings of at most
    :data:`MAX_STOP_CHARS` characters each (``name``: the input named in the message)."""
    if len(stop) > MAX_STOP_STRINGS:
        raise ConfigError(f"{name}: {len(stop)} strings, at most {MAX_STOP_STRINGS}")
    for s in stop:
        if not s:
            raise ConfigError(f"{name}: empty string")
        if len(s) > MAX_STOP_CHARS:
            raise ConfigError(f"{name}: a string of {len(s)} characters, at most {MAX_STOP_CHARS}")



def check_unsupported(inputs: Inputs) -> None:
    """Refuse a request that sets a control this server does not implement (:data:`UNSUPPORTED`, ``bad_words``) to
    anything but its neutral value.

    Raises:
        ConfigError: naming the input, the value and what is accepted.
    """
    for name, (accepted, what) in UNSUPPORTED.items():
        v = scalar(inputs, name)
        if v is not None and not accepted(v.item() if isinstance(v, np.generic) else v):
            shown = str(bool(v)).lower() if isinstance(v, (bool, np.bool_)) else str(v)  # NumPy's shortest decimal: FP32 1.2, not 1.2000000476837158
            raise ConfigError(f"{name} = {shown}: not supported by this server; accepted: {what}")
    bad = [w for w in strings(inputs, "bad_words") if w]
    if bad:
        raise ConfigError(f"bad_words = {bad!r}: not supported by this server; accepted: none (absent, [] or "
                          f"empty strings)")


def _fp32(v) -> float:
    """The shortest decimal that round-trips an FP32 input (0.7, not 0.699999988)."""
    return float(str(v))


def _seed(inputs: Inputs) -> int | None:
    """``seed``, or its older name ``random_seed`` (the same value when both are given).

    Raises:
        ConfigError: two different values, or one beyond the engine's seeds, 0..2^63 - 1 (:data:`SEED_MAX`: the
            inputs are UINT64, so 2^63..2^64 - 1 arrives as sent), naming the input.
    """
    seed, old = scalar(inputs, "seed"), scalar(inputs, "random_seed")
    if seed is not None and old is not None and int(seed) != int(old):
        raise ConfigError(f"seed = {int(seed)} and random_seed = {int(old)}: two different seeds (random_seed is "
                          "the older name of seed: give one)")
    name, v = ("seed", seed) if seed is not None else ("random_seed", old)
    if v is None:
        return None
    if not 0 <= int(v) <= SEED_MAX:
        raise ConfigError(f"{name} = {int(v)}: expected 0..{SEED_MAX} (0 ≤ seed < 2^63)")
    return int(v)


def _top_k(inputs: Inputs) -> int:
    """``top_k`` (0 when absent: no limit).

    Raises:
        ConfigError: outside 0..2^31 - 1, naming the input; a negative value with the JSON integer that Triton's HTTP
            front end wraps to it (``"top_k": 3000000000`` arrives as -1294967296).
    """
    v = scalar(inputs, "top_k")
    if v is None:
        return 0
    v = int(v)
    if not 0 <= v <= INT32_MAX:
        wrapped = -2**31 <= v < 0  # what Triton's HTTP front end makes of a JSON integer 2^31..2^32 - 1
        hint = f"{INT32_HINT[:-1]}: {v + 2**32} sent as JSON arrives as {v})" if wrapped else ""
        raise ConfigError(f"top_k = {v}: expected 0..{INT32_MAX} (0 = no limit){hint}")
    return v


#: Inputs that carry one token id (``pad_id`` has no effect here, but a client's id must still be a token).
TOKEN_ID_INPUTS = ("end_id", "pad_id")


def token_id(inputs: Inputs, name: str, vocab_size: int | None) -> int | None:
    """Token-id input ``name`` (:data:`TOKEN_ID_INPUTS`), or None when absent. ``vocab_size``: the target's vocabulary
    size (None: only checked for ≥ 0).

    Raises:
        ConfigError: naming the input: negative, or not below ``vocab_size`` (a token the model can never produce:
            the client's tokenizer is not the served one).
    """
    v = scalar(inputs, name)
    if v is None:
        return None
    if int(v) < 0:
        raise ConfigError(f"{name} = {int(v)}: expected a token id ≥ 0{INT32_HINT}")
    if vocab_size is not None and int(v) >= vocab_size:
        raise ConfigError(f"{name} = {int(v)}: outside the vocabulary of the served model (token ids 0..{vocab_size - 1}, "
                          f"vocab_size {vocab_size})")
    return int(v)


def request_timeout(inputs: Inputs, cap_s: float | None) -> float | None:
    """Seconds the engine gives the request (:attr:`Request.timeout_s`): input ``timeout_ms`` (milliseconds, ≥ 1),
    never more than the server's cap ``cap_s`` (``ServeConfig.request_timeout_s``; None: no cap), the cap without it.
    Triton cannot tell this model that a non-streaming HTTP client went away, so this deadline is what frees its slot.

    Raises:
        ConfigError: ``timeout_ms`` is not one integer ≥ 1.
    """
    v = scalar(inputs, "timeout_ms")
    if v is None:
        return cap_s
    if isinstance(v, (float, np.floating)) or int(v) < 1:
        raise ConfigError(f"timeout_ms = {v}: expected whole milliseconds ≥ 1")
    s = int(v) / 1000.0
    return s if cap_s is None else min(s, cap_s)


def parse_request(inputs: Inputs, max_tokens_limit: int, timeout_cap_s: float | None = None,
                  vocab_size: int | None = None) -> tuple[Request, StreamOptions]:
    """Read and check a generation request's inputs.

    Args:
        inputs: input name → the request's array (absent inputs missing or None).
        max_tokens_limit: the largest ``max_tokens`` accepted (the model's parameter ``max_tokens_limit``).
        timeout_cap_s: the server's cap on a request's time (:func:`request_timeout`).
        vocab_size: the target's vocabulary size: the token-id inputs (:data:`TOKEN_ID_INPUTS`) must lie below it
            (None: unchecked; the prompt's ids are checked by the engine).
    Returns:
        the runtime request and its stream options.
    Raises:
        ConfigError: naming the input that is missing, empty, out of range, not one value, or set to a value
            this server does not support.
    """
    from splitspec.runtime.types import Request, SamplingParams

    ids = inputs.get("input_ids")
    if ids is None:
        raise ConfigError("input_ids: missing")
    prompt = np.asarray(ids).reshape(-1)
    if prompt.size == 0:
        raise ConfigError("input_ids: empty prompt")
    max_tokens = scalar(inputs, "max_tokens")
    if max_tokens is None:
        raise ConfigError(f"max_tokens: missing (a required input: tokens to generate at most, 1..{max_tokens_limit})")
    max_tokens = int(max_tokens)
    if not 1 <= max_tokens <= max_tokens_limit:
        raise ConfigError(f"max_tokens = {max_tokens}: expected 1..{max_tokens_limit}{INT32_HINT if max_tokens < 1 else ''}")
    check_unsupported(inputs)
    end_id = token_id(inputs, "end_id", vocab_size)
    token_id(inputs, "pad_id", vocab_size)  # checked only: no padded outputs here

    def opt(name, default, cast):
        v = scalar(inputs, name)
        return default if v is None else cast(v)

    sampling = SamplingParams(temperature=opt("temperature", 0.0, _fp32), top_p=opt("top_p", 1.0, _fp32),
                              top_k=_top_k(inputs), seed=_seed(inputs))
    k = opt("num_draft_tokens", None, int)
    stop = strings(inputs, "stop")
    check_stop(stop)
    stop += [w for w in strings(inputs, "stop_words") if w]  # TensorRT-LLM's clients send "" for none
    check_stop(stop, "stop and stop_words")
    stream = opt("stream", False, bool)
    stats = opt("return_stats", False, bool)
    echo = None
    if opt("exclude_input_in_output", True, bool) is False and not stream:
        echo = (strings(inputs, "text_input") or [""])[0]
    options = StreamOptions(stream=stream, return_token_ids=opt("return_token_ids", False, bool),
                            return_stats=stats or opt("return_perf_metrics", False, bool),
                            return_num_input_tokens=stats or opt("return_num_input_tokens", False, bool),
                            return_num_output_tokens=stats or opt("return_num_output_tokens", False, bool),
                            echo=echo)
    req = Request(prompt_ids=prompt.astype(np.int64).tolist(), max_tokens=max_tokens, sampling=sampling,
                  num_draft_tokens=k, stop=stop, stop_token_ids=None if end_id is None else {end_id},
                  timeout_s=request_timeout(inputs, timeout_cap_s))
    return req, options
