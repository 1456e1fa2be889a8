"""What a request body may be before the HTTP guard passes it to tritonserver (:mod:`splitspec.serving.http_guard`):
its size, and how deep its JSON nests. Pure functions, no I/O.

**Depth.** tritonserver 2.51 parses every HTTP body as JSON (its content type aside) with a parser that recurses once
per nesting level: a ~2 MB body of ``[`` × 1,000,000 then ``]`` × 1,000,000 killed it in 0.28 s (depth 500,000 was
answered with a 500). Its own requests nest 4 deep at most (``{"inputs": [{"data": [[...]]}]}``; nested ``data``
adds one level per tensor dimension). :func:`json_depth` measures the depth without recursion and without parsing,
in C loops (``bytes`` methods, numpy): escapes are cut first (``\\\\`` then ``\\"``, left to right as a JSON
lexer pairs them), so every quote left opens or closes a string; the brackets outside strings then sum to a running
count of the levels open, whose maximum is the depth. Up to a body's first syntax error that is the depth any JSON
parser reaches (the two read the same tokens there), and a parser stops at that error, so a body that passes cannot
drive a parser deeper. :func:`check_depth` skips the scan when the body holds no more opening brackets than the
bound. Measured on the 2-core CPU machine (loaded): 10–18 ms for a 6 MB prompt body full of brackets or line breaks,
at most 56 ms for 6 MB of escapes and quotes built to be slow, 13 ms for the million-deep body.

**Binary tensors.** With Triton's binary-tensor extension the header ``Inference-Header-Content-Length: N`` says
the first N bytes are the JSON; the rest is raw tensor data, not parsed (:func:`json_part`).
"""

from __future__ import annotations

import numpy as np

from splitspec.serving.server_limits import too_large_message

#: Deepest JSON nesting passed to tritonserver: its requests nest 4 deep, one more per dimension of a nested tensor.
MAX_JSON_DEPTH = 32
#: The binary-tensor extension's header: the body's first N bytes are the JSON.
JSON_LENGTH_HEADER = "Inference-Header-Content-Length"
#: Byte → class for the scan: 1 opens a level, 2 closes one, 3 a quote, 0 anything else.
_CLASSES = bytes(1 if c in b"[{" else 2 if c in b"]}" else 3 if c == ord('"') else 0 for c in range(256))
#: Bytes scanned per numpy block (its arrays take a few bytes per bracket or quote in it).
_BLOCK = 1 << 20


class Refusal(Exception):
    """A request the guard answers itself: HTTP ``status`` and a one-line ``message`` (Triton's ``{"error": ...}``)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


def json_depth(data: bytes) -> int:
    """Deepest nesting of arrays and objects in the JSON text ``data`` (0: a scalar or no brackets), brackets inside
    strings not counted. Malformed text is measured as far as it goes: never less than a parser reaches before its
    first error (module docstring). Linear in ``len(data)``; no recursion."""
    if b"[" not in data and b"{" not in data:
        return 0
    if b"\\" in data:  # an escaped backslash, then an escaped quote: neither is a quote that counts
        data = data.replace(b"\\\\", b"__").replace(b'\\"', b"__")
    classes = data.translate(_CLASSES)
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


def json_part(body: bytes, json_length: str | None) -> bytes:
    """The JSON of ``body``: all of it, or with the binary-tensor extension (``json_length``: the value of
    :data:`JSON_LENGTH_HEADER`) its first ``json_length`` bytes.

    Raises:
        Refusal: 400, ``json_length`` is not a byte count within the body.
    """
    if json_length is None:
        return body
    n = json_length.strip()
    if not n.isdigit() or int(n) > len(body):
        raise Refusal(400, f"{JSON_LENGTH_HEADER}: {json_length[:40]!r}: expected the byte count of the JSON that "
                           f"starts the body (0..{len(body)})")
    return body[:int(n)]


def check_depth(body: bytes, json_length: str | None = None, max_depth: int = MAX_JSON_DEPTH) -> None:
    """Refuse a body whose JSON (:func:`json_part`) nests deeper than ``max_depth``.

    Raises:
        Refusal: 400 naming the depth and the limit; or :func:`json_part`'s.
    """
    text = json_part(body, json_length)
    if text.count(b"[") + text.count(b"{") <= max_depth:
        return  # cannot nest deeper than it has brackets
    depth = json_depth(text)
    if depth > max_depth:
        raise Refusal(400, f"request JSON nests {depth} levels deep, at most {max_depth} (Triton's requests nest 4; "
                           "deeper nesting crashes tritonserver's JSON parser)")


def check_length(content_length: int | None, limit: int, max_prompt_bytes: int | None) -> None:
    """Refuse, before reading it, a body whose ``Content-Length`` exceeds ``limit`` bytes (None: no length given,
    chunked: :func:`check_read` bounds it while it is read). ``max_prompt_bytes``: what ``limit`` was derived from,
    named in the message.

    Raises:
        Refusal: 413 (:func:`~splitspec.serving.server_limits.too_large_message`).
    """
    if content_length is not None and content_length > limit:
        raise Refusal(413, too_large_message(f"request body of {content_length} bytes", limit, max_prompt_bytes))


def check_read(size: int, limit: int, max_prompt_bytes: int | None, what: str = "chunked request body") -> None:
    """Refuse a body read without a ``Content-Length`` to trust (``what``: chunked, or decompressed) once the
    ``size`` bytes read of it pass ``limit``.

    Raises:
        Refusal: 413 (:func:`~splitspec.serving.server_limits.too_large_message`).
    """
    if size > limit:
        raise Refusal(413, too_large_message(what, limit, max_prompt_bytes))
