"""Checks on a JSON request body that Python's ``json`` module does not make: how deeply it nests, and strings that
are not Unicode text.

**Nesting.** ``json.loads`` recurses once per level of ``[`` / ``{`` and raises RecursionError near the interpreter's
recursion limit (about 1,000 levels); a 50,000-deep body sent to the OpenAI front end came back as a 500, and
tritonserver 2.51's parser, which recurses the same way, crashed on a million levels. :func:`nesting_depth` measures
the depth without parsing and without recursion, in C loops (``bytes`` methods, numpy): escapes are cut first
(``\\\\`` then ``\\"``, left to right as a JSON lexer pairs them), so every quote left opens or closes a string; the
brackets outside strings then sum to a running count of the levels open, whose maximum is the depth. Up to a body's
first syntax error that is the depth any JSON parser reaches (the two read the same tokens there), and a parser
stops at that error, so a body that passes cannot drive a parser deeper. Linear in the body's length, with no
per-string cost (a regular expression that cut the strings out took 0.3–0.6 s for 6 MB of short strings): on the
2-core CPU machine (loaded) 10–18 ms for a 6 MB prompt body full of brackets or line breaks, at most 56 ms for 6 MB
of escapes and quotes built to be slow, 13 ms for a million levels.

**Lone surrogates.** JSON's ``\\ud800`` escape (and the raw bytes ``ED A0 80``, which ``json.loads`` decodes with
``surrogatepass``) gives a Python str holding a UTF-16 surrogate with no partner: not a Unicode scalar value, so
encoding it as UTF-8 raises UnicodeEncodeError wherever the text goes next (the tokenizer, gRPC, an answer that
echoes it). :func:`lone_surrogate` finds the first such string, key or value, and names where it is.
"""

from __future__ import annotations

import numpy as np

#: Byte → class for the scan: 1 opens a level, 2 closes one, 3 a quote, 0 anything else.
_CLASSES = bytes(1 if c in b"[{" else 2 if c in b"]}" else 3 if c == ord('"') else 0 for c in range(256))
#: Bytes scanned per numpy block (its arrays take a few bytes per bracket or quote in it).
_BLOCK = 1 << 20


def nesting_depth(raw: bytes) -> int:
    """The deepest nesting of arrays and objects in the JSON text ``raw`` (``{}`` → 1, ``{"a": [1]}`` → 2, a scalar
    → 0), counting brackets outside string literals. Malformed text is measured as far as it goes: never less than a
    parser reaches before its first error (module docstring). Linear in ``len(raw)``; no recursion."""
    if b"[" not in raw and b"{" not in raw:
        return 0
    if b"\\" in raw:  # an escaped backslash, then an escaped quote: neither is a quote that counts
        raw = raw.replace(b"\\\\", b"__").replace(b'\\"', b"__")
    classes = raw.translate(_CLASSES)
    deepest = level = inside = 0  # carried from block to block: levels open, whether inside a string
    for start in range(0, len(classes), _BLOCK):
        block = np.frombuffer(classes, np.uint8, min(_BLOCK, len(classes) - start), start)
        marks = block[block != 0]
        if not len(marks):
            continue
        steps = (marks == 1).view(np.int8) - (marks == 2).view(np.int8)
        quotes = (marks == 3).view(np.uint8)
        if inside or quotes.any():
            within = np.bitwise_xor.accumulate(quotes)  # 1 from an opening quote to its closing one
            if inside:
                within ^= 1
            inside = int(within[-1])
            within ^= 1
            steps *= within.view(np.int8)  # brackets inside strings count 0
        running = np.cumsum(steps, dtype=np.int32)
        deepest = max(deepest, level + int(running.max()))
        level += int(running[-1])
    return deepest


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
