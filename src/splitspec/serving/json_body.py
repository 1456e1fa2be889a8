"""Checks on a JSON request body that Python's ``json`` module does not make: how deeply it nests, and strings that
are not Unicode text.

**Nesting.** ``json.loads`` recurses once per level of ``[`` / ``{`` and raises RecursionError near the interpreter's
recursion limit (about 1,000 levels); a 50,000-deep body sent to the OpenAI front end came back as a 500.
:func:`nesting_depth` measures the depth without parsing and without recursion: it removes the string literals with
one regular expression (brackets inside strings do not nest), keeps the four bracket bytes and takes the running
sum's maximum with NumPy, all linear in the body's length (about 1 ms for the largest body the front end reads).

**Lone surrogates.** JSON's ``\\ud800`` escape (and the raw bytes ``ED A0 80``, which ``json.loads`` decodes with
``surrogatepass``) gives a Python str holding a UTF-16 surrogate with no partner: not a Unicode scalar value, so
encoding it as UTF-8 raises UnicodeEncodeError wherever the text goes next (the tokenizer, gRPC, an answer that
echoes it). :func:`lone_surrogate` finds the first such string, key or value, and names where it is.
"""

from __future__ import annotations

import re

import numpy as np

#: A JSON string literal (escapes included); possessive, so a long or unterminated one costs linear time.
_STRING = re.compile(rb'"(?:[^"\\]++|\\.)*+"', re.DOTALL)
#: Every byte but the four brackets, deleted by ``bytes.translate``.
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
#: ``[`` / ``{`` → +1, ``]`` / ``}`` → -1 (0xFF as int8).
_STEPS = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")


def nesting_depth(raw: bytes) -> int:
    """The deepest nesting of arrays and objects in the JSON text ``raw`` (``{}`` → 1, ``{"a": [1]}`` → 2, a scalar
    → 0), counting brackets outside string literals. Linear in ``len(raw)``; for text that is not valid JSON (an
    unterminated string, say) the count is of the brackets it holds, and the parse that follows refuses it."""
    steps = _STRING.sub(b"", raw).translate(_STEPS, _NOT_BRACKETS)
    if not steps:
        return 0
    return int(np.cumsum(np.frombuffer(steps, dtype=np.int8), dtype=np.int64).max())


def _bad(s: str) -> int | None:
    """Index of the first lone surrogate in ``s``, or None when ``s`` is Unicode text."""
    if s.isascii():
        return None
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        return e.start
    return None


def _shown(key: str) -> str:
    """``key`` fit to print: a surrogate in it as its ``\\udXXX`` escape."""
    return key.encode("utf-8", "backslashreplace").decode("utf-8")


def lone_surrogate(value, path: str = "") -> tuple[str, int] | None:
    """Where the first lone surrogate in a parsed JSON ``value`` is, in document order: the field's path in the
    request (``prompt``, ``messages[0].content``, ``stop[1]``; a key holding one is named by its path with the
    surrogate escaped) and the character's index in that string; None when every string is Unicode text.
    Iterative, so any depth is safe."""
    stack = [(path, value)]
    while stack:
        where, v = stack.pop()
        if isinstance(v, str):
            i = _bad(v)
            if i is not None:
                return where, i
        elif isinstance(v, dict):
            items = []
            for k, item in v.items():
                child = f"{where}.{_shown(k)}" if where else _shown(k)
                i = _bad(k)
                if i is not None:
                    return child, i
                items.append((child, item))
            stack.extend(reversed(items))
        elif isinstance(v, list):
            stack.extend(reversed([(f"{where}[{n}]", item) for n, item in enumerate(v)]))
    return None
