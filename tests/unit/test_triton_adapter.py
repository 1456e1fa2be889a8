"""serving.triton against a hand-written stand-in for ``triton_python_backend_utils``: error responses carry the
code asked for, inputs come out as the plain mapping serving.requests reads, tensors have the right types."""

from __future__ import annotations

import json
import sys
import types

import numpy as np
import pytest

from splitspec.serving import triton
from splitspec.serving.requests import parse_request


class _TritonError:
    INVALID_ARG, UNAVAILABLE, INTERNAL = 3, 14, 13

    def __init__(self, message, code=None):
        self.message, self.code = message, code


class _Tensor:
    def __init__(self, name, array):
        self.name, self.array = name, array

    def as_numpy(self):
        return self.array


class _Response:
    def __init__(self, output_tensors, error=None):
        self.output_tensors, self.error = output_tensors, error


class _Request:
    def __init__(self, **arrays):
        self.tensors = {k: _Tensor(k, v) for k, v in arrays.items()}


@pytest.fixture
def pb(monkeypatch):
    """The stand-in module, installed as ``triton_python_backend_utils`` for the test."""
    mod = types.ModuleType("triton_python_backend_utils")
    mod.TritonError, mod.Tensor, mod.InferenceResponse = _TritonError, _Tensor, _Response
    mod.get_input_tensor_by_name = lambda request, name: request.tensors.get(name)
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", mod)
    return mod


@pytest.mark.parametrize("code", ["INVALID_ARG", "UNAVAILABLE", "INTERNAL"])
def test_error_response_carries_the_code(pb, code):
    r = triton.error_response("spec_decode: max_tokens: missing", code)
    assert r.output_tensors == [] and r.error.message == "spec_decode: max_tokens: missing"
    assert r.error.code == getattr(_TritonError, code)


def test_error_response_defaults_to_invalid_arg_and_drops_unknown_codes(pb):
    assert triton.error_response("bad").error.code == _TritonError.INVALID_ARG
    r = triton.error_response("odd", "NO_SUCH_CODE")
    assert r.error.message == "odd" and r.error.code is None


def test_read_inputs_leaves_absent_ones_out(pb):
    ids = np.array([1, 2, 3], dtype=np.int32)
    got = triton.read_inputs(_Request(input_ids=ids, stream=np.array([True])), ("input_ids", "max_tokens", "stream"))
    assert set(got) == {"input_ids", "stream"} and got["input_ids"] is ids


def test_read_inputs_feed_parse_request(pb):
    request = _Request(input_ids=np.array([4, 5], dtype=np.int32), max_tokens=np.array([3], dtype=np.int32),
                       stop=np.array([b"\n"], dtype=np.object_), extra=np.array([1]))
    req, opts = parse_request(triton.read_inputs(request, ("input_ids", "max_tokens", "stop", "stream")), 16)
    assert req.prompt_ids == [4, 5] and req.max_tokens == 3 and req.stop == ["\n"] and not opts.stream


def test_tensors(pb):
    t = triton.tensor("stream_id", [7], np.int64)
    assert t.name == "stream_id" and t.array.dtype == np.int64 and t.array.tolist() == [7]
    for value in ("héllo", "héllo".encode()):
        s = triton.bytes_tensor("output_text", value)
        assert s.array.dtype == np.object_ and s.array.tolist() == ["héllo".encode()]


def test_model_config():
    args = {"model_name": "spec_decode", "model_config": json.dumps(
        {"name": "ignored", "parameters": {"engines_dir": {"string_value": "/e"}, "k": {}}})}
    assert triton.model_config(args) == ("spec_decode", {"engines_dir": "/e", "k": ""})
    assert triton.model_config({"model_config": json.dumps({"name": "pre"})}) == ("pre", {})



def test_response_keeps_the_outputs_in_order(pb):
    arrays = [("output_text", triton.bytes_array("hi", batched=True)), ("stream_id", np.array([[3]], np.int64))]
    r = triton.response(arrays)
    assert [t.name for t in r.output_tensors] == ["output_text", "stream_id"] and r.error is None
    assert r.output_tensors[0].array.shape == (1, 1) and r.output_tensors[1].array is arrays[1][1]
