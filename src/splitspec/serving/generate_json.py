"""What the JSON body of an HTTP ``generate`` / ``generate_stream`` request must hold before tritonserver reads it:
checks that only the JSON shows, for whatever reads that JSON before tritonserver (the HTTP guard,
:func:`splitspec.serving.http_bounds.check_generate`). The models check the values themselves
(:mod:`splitspec.serving.requests`).

**Types.** Triton 2.51's generate extension converts each input's JSON to its tensor type and answers a value it
cannot convert with a 500, before any model sees it (``"max_tokens": "ten"``: ``Unable to parse 'data': attempt to
access JSON non-signed-integer as signed-integer``). Measured on it, per type of :data:`INPUT_TYPES`: an INT32 or
INT64 input takes a JSON integer within the signed 64 bits (2.0, ``true`` and 2^63 are refused; an INT32 one wraps
modulo 2^32), a UINT64 one an integer 0..2^64 − 1, an FP32 one any number, a BOOL one ``true`` or ``false`` only (not
0 or 1), a STRING one a string; each also a value in (nested) arrays, which Triton flattens, or an empty array
(Triton's own 400). :func:`check_generate_json` refuses anything else with a 400 naming the input and its type.
"""

from __future__ import annotations

from collections.abc import Mapping

from splitspec.errors import ConfigError

#: The ensemble's inputs and their Triton types, without ``TYPE_`` (``triton_repo/ensemble/config.pbtxt.in``).
INPUT_TYPES = {
    "text_input": "STRING", "max_tokens": "INT32", "stream": "BOOL", "temperature": "FP32", "top_k": "INT32",
    "top_p": "FP32", "seed": "UINT64", "random_seed": "UINT64", "stop_words": "STRING", "bad_words": "STRING",
    "end_id": "INT32", "pad_id": "INT32", "length_penalty": "FP32", "beam_width": "INT32",
    "num_return_sequences": "INT32", "min_tokens": "INT32", "repetition_penalty": "FP32", "presence_penalty": "FP32",
    "frequency_penalty": "FP32", "return_log_probs": "BOOL", "return_context_logits": "BOOL",
    "return_generation_logits": "BOOL", "exclude_input_in_output": "BOOL", "return_perf_metrics": "BOOL",
    "return_num_input_tokens": "BOOL", "return_num_output_tokens": "BOOL", "stop": "STRING",
    "num_draft_tokens": "INT32", "return_token_ids": "BOOL", "return_stats": "BOOL", "apply_chat_template": "BOOL",
    "timeout_ms": "INT64"}
#: Inputs that hold a list of strings (TYPE_STRING, dims [-1]).
STRING_LIST_INPUTS = ("stop", "stop_words", "bad_words")
#: The integers Triton's JSON reader takes as a signed and as an unsigned 64-bit integer.
SIGNED_64, UNSIGNED_64 = range(-2 ** 63, 2 ** 63), range(2 ** 64)
#: Triton type → what JSON value it takes, in words.
EXPECTED = {"STRING": "a string", "BOOL": "true or false", "FP32": "a number", "INT32": "an integer",
            "INT64": "an integer", "UINT64": "a non-negative integer"}


def _json_kind(v) -> str:
    return "null" if v is None else {bool: "a boolean", int: "a number", float: "a number", str: "a string",
                                     list: "an array", dict: "an object"}.get(type(v), type(v).__name__)


def _wrong(v, dtype: str) -> str | None:
    """What the JSON scalar ``v`` is, when an input of Triton type ``dtype`` cannot take it (None: it can)."""
    integer = isinstance(v, int) and not isinstance(v, bool)
    if dtype == "STRING" and isinstance(v, str) or dtype == "BOOL" and isinstance(v, bool) \
            or dtype == "FP32" and (integer or isinstance(v, float)):
        return None
    if dtype in ("INT32", "INT64", "UINT64") and integer:
        bits = UNSIGNED_64 if dtype == "UINT64" else SIGNED_64
        if v in bits:
            return None
        digits = str(v)
        shown = digits if len(digits) <= 24 else f"an integer of {len(digits.lstrip('-'))} digits"
        if v < 0 and dtype == "UINT64":
            return shown
        return f"{shown}, beyond the {'unsigned' if dtype == 'UINT64' else 'signed'} 64-bit integers Triton reads"
    if isinstance(v, float) and dtype != "FP32":
        return "a number with a fraction or exponent"
    return _json_kind(v)


def _check_type(name: str, value, dtype: str) -> None:
    """Refuse ``value`` (a JSON value, or arrays of them at any depth) for the input ``name`` of Triton type
    ``dtype`` where Triton's HTTP front end cannot convert it (module docstring).

    Raises:
        ConfigError: naming the input, the JSON it takes, its type and what it got.
    """
    stack = [value]
    while stack:  # iterative: any nesting is safe
        v = stack.pop()
        if isinstance(v, list):
            stack.extend(reversed(v))
            continue
        got = _wrong(v, dtype)
        if got is not None:
            held = got if v is value else f"an array holding {got}"
            raise ConfigError(f"{name}: expected {EXPECTED[dtype]} ({dtype}), got {held}")


def check_generate_json(body: Mapping) -> None:
    """Check the JSON body of an HTTP ``generate`` / ``generate_stream`` request where Triton does not: each of
    :data:`STRING_LIST_INPUTS` it carries must be a string or a flat array of strings. Triton 2.51 takes a nested
    array's shape from its outer length and its strings in order, so ``"stop_words": [["a"]]`` reaches the models as
    ``["a"]`` and ``[["a"], ["b"]]`` as ``["a", "b"]`` (the same tensors: the models cannot refuse them), and answers
    a number, object or null with a 500 (``Unable to parse JSON bytes array``). Only what reads the JSON before
    tritonserver can apply this; over gRPC, Triton itself refuses a tensor of another rank (INVALID_ARG,
    ``unexpected shape for input 'stop_words'``). Looks one level into each value only: safe at any nesting.

    Every other input of :data:`INPUT_TYPES` it carries must be JSON Triton converts to the input's type (module
    docstring); keys that are not inputs are the models' to refuse.

    Raises:
        ConfigError: naming the input, what it holds and the expected form or type.
    """
    for name in STRING_LIST_INPUTS:
        if name not in body:
            continue
        v = body[name]
        if isinstance(v, list):
            bad = next((i for i, s in enumerate(v) if not isinstance(s, str)), None)
            if bad is None:
                continue
            got = f"an array whose element {bad} is {_json_kind(v[bad])}"
        elif isinstance(v, str):
            continue
        else:
            got = _json_kind(v)
        raise ConfigError(f'{name}: expected a string or an array of strings (e.g. ["\\n\\n", "done"]), got {got}')
    for name, dtype in INPUT_TYPES.items():
        if name in body and name not in STRING_LIST_INPUTS:
            _check_type(name, body[name], dtype)
