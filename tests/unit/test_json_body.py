"""The JSON nesting scan (serving/json_body.py) against a reference lexer: on valid JSON, on byte soup, across block
boundaries. The HTTP guard and the OpenAI front end both refuse a body by it before anything parses it."""

from __future__ import annotations

import json
import random

import pytest

import splitspec.serving.json_body as json_body
from splitspec.serving.json_body import nesting_depth


def lexer_depth(data: bytes) -> int:
    """The depth a JSON parser reaches: a byte-at-a-time lexer that stops where a parser must (a backslash outside a
    string; closers beyond the opened ones only lower the count, as a parser stops there too)."""
    depth = deepest = 0
    inside = escaped = False
    for c in data:
        if inside:
            if escaped:
                escaped = False
            elif c == ord("\\"):
                escaped = True
            elif c == ord('"'):
                inside = False
        elif c == ord('"'):
            inside = True
        elif c == ord("\\"):
            break
        elif c in b"[{":
            depth += 1
            deepest = max(deepest, depth)
        elif c in b"]}":
            depth -= 1
    return deepest


def random_json(rng: random.Random, level: int = 0):
    """Nested lists and objects whose strings hold brackets, quotes and backslashes."""
    r = rng.random()
    if level > 7 or r < 0.3:
        return rng.choice(['a[\\"{', 1, None, "\\\\", ']]}"', '\\"[', 2.5, True])
    if r < 0.65:
        return [random_json(rng, level + 1) for _ in range(rng.randint(0, 3))]
    return {rng.choice(["k[", 'q"', "\\", "{"]) + str(i): random_json(rng, level + 1) for i in range(rng.randint(0, 3))}


def nesting(obj) -> int:
    if isinstance(obj, list):
        return 1 + max(map(nesting, obj), default=0)
    if isinstance(obj, dict):
        return 1 + max(map(nesting, obj.values()), default=0)
    return 0


@pytest.mark.parametrize("text, depth", [
    (b"", 0), (b"42", 0), (b'"[[[{"', 0), (b"[]", 1), (b'{"a": [1, {"b": []}]}', 4),
    (b'["]"]', 1), (b'["\\"[", [[]]]', 3),  # an escaped quote does not end the string
    (b'["\\\\", [[]]]', 3),  # an escaped backslash, then the quote that ends the string
    (b'["\\\\\\"[[[", 1]', 1),  # three backslashes: the quote is escaped
    (b'[[["unterminated [[[[[[', 3), (b"]]]][[", 0), (b"[[[", 3),
])
def test_nesting_depth_of_known_texts(text, depth):
    assert nesting_depth(text) == depth


@pytest.mark.parametrize("block", [1 << 20, 1, 7])
def test_nesting_depth_matches_a_parser_on_json_and_byte_soup(monkeypatch, block):
    """Exact on valid JSON (its strings full of brackets, quotes and escapes); on any bytes never less than the lexer
    reaches before it stops, and exact where no backslash stands outside a string; the same in blocks of any size."""
    monkeypatch.setattr(json_body, "_BLOCK", block)
    rng = random.Random(block)
    for _ in range(400):
        obj = random_json(rng)
        assert nesting_depth(json.dumps(obj).encode()) == nesting(obj), obj
    soup = b'[]{}"\\ax'
    for _ in range(1500):
        text = bytes(rng.choice(soup) for _ in range(rng.randint(0, 40)))
        assert nesting_depth(text) >= lexer_depth(text), text
        if b"\\" not in text:
            assert nesting_depth(text) == lexer_depth(text), text
