"""The HTTP guard's checks without a server: the depth bound on the attack's body (the scan itself:
test_json_body.py), the binary-tensor extension's JSON part, and the size limits derived from a repository."""

from __future__ import annotations

import json
import time

import re

import pytest

from splitspec.serving.http_bounds import (MAX_JSON_DEPTH, Refusal, check_body, check_depth, check_length, check_read,
                                           json_part)
from splitspec.serving.json_body import nesting_depth
from splitspec.serving.server_limits import (SERVER_STACK_MIN_BYTES, repo_body_limit, request_body_limit,
                                             server_stack_bytes)


def test_the_attack_body_is_measured_quickly_and_refused():
    """The body that killed tritonserver 2.51: a million levels, measured without recursion; a 6 MB prompt body and
    6 MB built to be slow for the scan take well under a second each (tens of ms on the 2-core machine)."""
    deep = b"[" * 1_000_000 + b"]" * 1_000_000
    with pytest.raises(Refusal) as e:
        check_depth(deep)
    assert e.value.status == 400 and f"nests 1000000 levels deep, at most {MAX_JSON_DEPTH}" in e.value.message
    prompt = json.dumps({"text_input": "def f(x): return [x, {x: '\"'}]\n" * 190_000, "max_tokens": 4}).encode()
    escapes = b"[" * 40 + b'"\\"' * 2_000_000
    strings = b"[" * 40 + b'"",' * 2_000_000  # 2 million strings: 0.3-0.6 s for a regular expression that cuts them
    for body in (deep, prompt, escapes, strings):
        t0 = time.perf_counter()
        nesting_depth(body)
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


@pytest.mark.parametrize("body,needle", [
    (b'{"text_input": "x", "stop_words": ["a"], "stop_words": [["a", 1]]}', "key 'stop_words' appears twice"),
    (b'{"text_input": "\xff"}', "not UTF-8 (byte 16"),
    (b'{"text_input": "x",}', "not valid JSON"),
    (b'["text_input"]', "expected a JSON object of inputs, got list"),
    (b'{"text_input": "x", "bad_words": [["a"]]}', "bad_words: expected a string or an array of strings"),
])
def test_generate_bodies_tritonserver_would_misread_are_refused(body, needle):
    for path in ("/v2/models/ensemble/generate", "/v2/models/ensemble/generate_stream?x=1",
                 "/v2/models/ensemble/generate#frag"):
        with pytest.raises(Refusal, match=re.escape(needle)) as e:
            check_body(body, None, MAX_JSON_DEPTH, path)
        assert e.value.status == 400
    check_body(body, None, MAX_JSON_DEPTH, "/v2/models/ensemble/infer")  # not a generate body: left to tritonserver


def test_generate_bodies_are_checked_whole_whatever_the_binary_header_says():
    deep = b"[" * 1000 + b"]" * 1000  # Triton's generate endpoints parse the whole body: the header does not apply
    for header in ("0", "1", str(len(deep))):
        with pytest.raises(Refusal, match="nests 1000 levels deep"):
            check_body(deep, header, MAX_JSON_DEPTH, "/v2/models/ensemble/generate")
    check_body(b'{"inputs": []}' + deep, "14", MAX_JSON_DEPTH, "/v2/models/ensemble/infer")  # binary tensors: not JSON
    for header in ("²", "١", "-1", "99"):  # digits beyond ASCII, negative, past the body
        with pytest.raises(Refusal, match="Inference-Header-Content-Length"):
            json_part(b"{}", header)
