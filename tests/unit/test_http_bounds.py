"""The HTTP guard's checks without a server: the JSON depth scan (against a reference lexer, on valid JSON and on
byte soup, across block boundaries, on the attack's body), the binary-tensor extension's JSON part, and the size
limits derived from a repository."""

from __future__ import annotations

import json
import random
import time

import pytest

import splitspec.serving.http_bounds as bounds
from splitspec.serving.http_bounds import MAX_JSON_DEPTH, Refusal, check_depth, check_length, check_read, json_depth, json_part
from splitspec.serving.server_limits import (SERVER_STACK_MIN_BYTES, repo_body_limit, request_body_limit,
                                             server_stack_bytes)


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
def test_json_depth_of_known_texts(text, depth):
    assert json_depth(text) == depth


@pytest.mark.parametrize("block", [1 << 20, 1, 7])
def test_json_depth_matches_a_parser_on_json_and_byte_soup(monkeypatch, block):
    """Exact on valid JSON (its strings full of brackets, quotes and escapes); on any bytes never less than the lexer
    reaches before it stops, and exact where no backslash stands outside a string; the same in blocks of any size."""
    monkeypatch.setattr(bounds, "_BLOCK", block)
    rng = random.Random(block)
    for _ in range(400):
        obj = random_json(rng)
        assert json_depth(json.dumps(obj).encode()) == nesting(obj), obj
    soup = b'[]{}"\\ax'
    for _ in range(1500):
        text = bytes(rng.choice(soup) for _ in range(rng.randint(0, 40)))
        assert json_depth(text) >= lexer_depth(text), text
        if b"\\" not in text:
            assert json_depth(text) == lexer_depth(text), text


def test_the_attack_body_is_measured_quickly_and_refused():
    """The body that killed tritonserver 2.51: a million levels, measured without recursion; a 6 MB prompt body and
    6 MB built to be slow for the scan take well under a second each (tens of ms on the 2-core machine)."""
    deep = b"[" * 1_000_000 + b"]" * 1_000_000
    with pytest.raises(Refusal) as e:
        check_depth(deep)
    assert e.value.status == 400 and f"nests 1000000 levels deep, at most {MAX_JSON_DEPTH}" in e.value.message
    prompt = json.dumps({"text_input": "def f(x): return [x, {x: '\"'}]\n" * 190_000, "max_tokens": 4}).encode()
    slow = b"[" * 40 + b'"\\"' * 2_000_000
    for body in (deep, prompt, slow):
        t0 = time.perf_counter()
        json_depth(body)
        took = time.perf_counter() - t0
        assert took < 1.0, f"{len(body)} bytes took {took:.2f} s"
    check_depth(prompt)  # passes: 2 levels


def test_check_depth_bound_and_binary_tensor_part():
    check_depth(b"[" * MAX_JSON_DEPTH + b"]" * MAX_JSON_DEPTH)
    with pytest.raises(Refusal, match=f"nests {MAX_JSON_DEPTH + 1} levels deep"):
        check_depth(b"[" * (MAX_JSON_DEPTH + 1))
    body = b'{"inputs": [{"name": "x", "data": [[1]]}]}' + b"[" * 100  # binary tensor bytes after the JSON
    json_len = str(len(body) - 100)
    assert json_part(body, json_len) == body[:-100] and json_part(body, None) is body
    check_depth(body, json_len)
    with pytest.raises(Refusal, match="nests 100 levels"):
        check_depth(body)
    for bad in ("x", "-1", str(len(body) + 1)):
        with pytest.raises(Refusal, match="Inference-Header-Content-Length") as e:
            json_part(body, bad)
        assert e.value.status == 400


def test_size_limits_refuse_with_413_naming_the_limit():
    check_length(None, 100, 10)
    check_length(100, 100, 10)
    with pytest.raises(Refusal) as e:
        check_length(101, 100, 10)
    assert e.value.status == 413
    assert e.value.message == ("request body of 101 bytes exceeds the limit of 100 bytes (the largest JSON a prompt of "
                               "max_prompt_bytes = 10 can take)")
    check_read(100, 100, None)
    with pytest.raises(Refusal, match="^chunked request body exceeds the limit of 100 bytes .*thread stack"):
        check_read(101, 100, None)
    with pytest.raises(Refusal, match="^decompressed request body exceeds"):
        check_read(101, 100, 10, "decompressed request body")


def test_repository_body_limit_fits_the_server_stack(tmp_path):
    """The guard's limit is the repository's request_body_limit, and tritonserver's stack holds two copies of a body
    that long (what its form parser makes); without max_prompt_bytes, the largest body the minimum stack holds."""
    (tmp_path / "preprocessing").mkdir()
    cfg = tmp_path / "preprocessing" / "config.pbtxt"
    for prompt_bytes in (8192, 4_000_000):
        cfg.write_text(f'parameters {{ key: "max_prompt_bytes" value: {{ string_value: "{prompt_bytes}" }} }}')
        limit = repo_body_limit(tmp_path)
        assert limit == request_body_limit(prompt_bytes)
        assert 2 * limit < server_stack_bytes(tmp_path)
    cfg.write_text("")
    assert 2 * repo_body_limit(tmp_path) < SERVER_STACK_MIN_BYTES == server_stack_bytes(tmp_path)
