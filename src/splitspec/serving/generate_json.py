"""What the JSON body of an HTTP ``generate`` / ``generate_stream`` request must hold before tritonserver reads it:
checks that only the JSON shows, for whatever reads that JSON before tritonserver (the HTTP guard,
:func:`splitspec.serving.http_bounds.check_generate`). The models check the values themselves
(:mod:`splitspec.serving.requests`).
"""

from __future__ import annotations

from collections.abc import Mapping

from splitspec.errors import ConfigError

#: Inputs that hold a list of strings (TYPE_STRING, dims [-1]).
STRING_LIST_INPUTS = ("stop", "stop_words", "bad_words")


def _json_kind(v) -> str:
    return "null" if v is None else {bool: "a boolean", int: "a number", float: "a number", str: "a string",
                                     list: "an array", dict: "an object"}.get(type(v), type(v).__name__)


def check_generate_json(body: Mapping) -> None:
    """Check the JSON body of an HTTP ``generate`` / ``generate_stream`` request where Triton does not: each of
    :data:`STRING_LIST_INPUTS` it carries must be a string or a flat array of strings. Triton 2.51 takes a nested
    array's shape from its outer length and its strings in order, so ``"stop_words": [["a"]]`` reaches the models as
    ``["a"]`` and ``[["a"], ["b"]]`` as ``["a", "b"]`` (the same tensors: the models cannot refuse them), and answers
    a number, object or null with a 500 (``Unable to parse JSON bytes array``). Only what reads the JSON before
    tritonserver can apply this; over gRPC, Triton itself refuses a tensor of another rank (INVALID_ARG,
    ``unexpected shape for input 'stop_words'``). Looks one level into each value only: safe at any nesting.

    Raises:
        ConfigError: naming the input, what it holds and the expected form.
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
