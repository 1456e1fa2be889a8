"""What a request body may be before the HTTP guard passes it to tritonserver (:mod:`splitspec.serving.http_guard`):
its size, and how deep its JSON nests. Pure functions, no I/O. The size checks also bound the OpenAI front end's
bodies; both front ends read a body through :class:`~splitspec.serving.body_reader.BodyReader`.

**Depth.** tritonserver 2.51 parses every HTTP body as JSON (its content type aside) with a parser that recurses once
per nesting level: a ~2 MB body of ``[`` × 1,000,000 then ``]`` × 1,000,000 killed it in 0.28 s (depth 500,000 was
answered with a 500). Its own requests nest 4 deep at most (``{"inputs": [{"data": [[...]]}]}``; nested ``data``
adds one level per tensor dimension). :func:`check_depth` measures the depth with
:func:`~splitspec.serving.json_body.nesting_depth` (linear, no parsing, no recursion; tens of ms for 6 MB), after
skipping bodies that hold no more opening brackets than the bound.

**Generate inputs.** Triton 2.51's generate endpoints flatten a nested array into a string tensor (``"stop_words":
[["a"]]`` reaches the models as ``["a"]``) and answer a value they cannot convert to its input's type with a 500
(``"max_tokens": "ten"``), so the string-list inputs and every input's JSON type are checked here, where the JSON is
still seen (:func:`check_generate`).

**Binary tensors.** With Triton's binary-tensor extension the header ``Inference-Header-Content-Length: N`` says
the first N bytes are the JSON; the rest is raw tensor data, not parsed (:func:`json_part`).
"""

from __future__ import annotations

import json
import re

from splitspec.errors import ConfigError
from splitspec.serving.json_body import nesting_depth
from splitspec.serving.generate_json import check_generate_json
from splitspec.serving.server_limits import too_large_message

#: Deepest JSON nesting passed to tritonserver: its requests nest 4 deep, one more per dimension of a nested tensor.
MAX_JSON_DEPTH = 32
#: The binary-tensor extension's header: the body's first N bytes are the JSON.
JSON_LENGTH_HEADER = "Inference-Header-Content-Length"
#: The most characters of a header value the client chose quoted in a refusal (:func:`quoted`).
QUOTED_CHARS = 40
#: The largest ``Content-Length`` an HTTP parser takes (aiohttp's refuses more as an overflow; h11 takes 20 digits).
MAX_CONTENT_LENGTH = 2 ** 64 - 1


class Refusal(Exception):
    """A request answered before it is passed on: HTTP ``status`` and a one-line ``message``. Each front end answers
    it in its own protocol's shape: the guard as Triton's ``{"error": ...}``, the OpenAI front end as OpenAI's error
    object (:func:`splitspec.serving.openai_http.read_body`)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


def quoted(value: str) -> str:
    """A header ``value`` as a refusal quotes it: its ``repr``, cut to :data:`QUOTED_CHARS` characters (the cut
    marked ``...``)."""
    return repr(value[:QUOTED_CHARS]) + ("..." if len(value) > QUOTED_CHARS else "")


def json_part(body: bytes, json_length: str | None) -> bytes:
    """The JSON of ``body``: all of it, or with the binary-tensor extension (``json_length``: the value of
    :data:`JSON_LENGTH_HEADER`) its first ``json_length`` bytes.

    Raises:
        Refusal: 400, ``json_length`` is not a byte count within the body.
    """
    if json_length is None:
        return body
    n = json_length.strip()
    if not (n.isascii() and n.isdigit()) or int(n) > len(body):
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
    depth = nesting_depth(text)
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


#: Triton's generate extension: ``/v2/models/<model>[/versions/<v>]/generate`` and ``.../generate_stream``.
GENERATE_PATH = re.compile(r"^/v2/models/[^/?#]+(/versions/[^/?#]+)?/generate(_stream)?/?([?#].*)?$")


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    """``json.loads``' object hook: a key twice in one object is refused (Python keeps the last, Triton the first)."""
    doc = {}
    for key, value in pairs:
        if key in doc:
            raise Refusal(400, f"request JSON: key {key[:60]!r} appears twice in one object")
        doc[key] = value
    return doc


def check_generate(path: str, body: bytes) -> None:
    """Refuse a ``generate`` / ``generate_stream`` body that tritonserver would misread or fail on with a 500: one
    that is empty (tritonserver: ``document is empty``), not UTF-8 JSON, has a key twice in one object, whose
    string-list inputs Triton would flatten, or with an input's value of a JSON type Triton cannot convert
    (:func:`splitspec.serving.generate_json.check_generate_json`). Runs after :func:`check_depth` (so parsing cannot
    recurse deeply).

    Raises:
        Refusal: 400 naming what is wrong.
    """
    if not GENERATE_PATH.match(path):
        return
    if not body:
        raise Refusal(400, "request body: empty; expected a JSON object of inputs, e.g. {\"text_input\": \"...\"}")
    try:
        doc = json.loads(body.decode("utf-8"), object_pairs_hook=_unique_keys)
    except UnicodeDecodeError as e:
        raise Refusal(400, f"request body: not UTF-8 (byte {e.start}: {body[e.start:e.start + 1]!r})") from None
    except (ValueError, RecursionError) as e:
        raise Refusal(400, f"request body: not valid JSON ({str(e).splitlines()[0][:120]})") from None
    if not isinstance(doc, dict):
        raise Refusal(400, f"request body: expected a JSON object of inputs, got {type(doc).__name__}")
    try:
        check_generate_json(doc)
    except ConfigError as e:
        raise Refusal(400, str(e)) from None


def check_body(body: bytes, json_length: str | None, max_depth: int, path: str) -> None:
    """Every check of a read body: :func:`check_depth`, then :func:`check_generate`. The generate endpoints parse the
    whole body as JSON whatever ``Inference-Header-Content-Length`` says (it belongs to the inference protocol), so
    there the whole body is checked.

    Raises:
        Refusal: theirs.
    """
    generate = GENERATE_PATH.match(path) is not None
    check_depth(body, None if generate else json_length, max_depth)
    check_generate(path, body)
