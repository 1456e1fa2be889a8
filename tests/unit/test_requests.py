"""spec_decode's request parsing, without a server: every bad input is refused with a message naming it, and a
good request becomes the runtime Request and stream options the model serves."""

from __future__ import annotations

import json

import numpy as np
import pytest

from splitspec.errors import ConfigError
from splitspec.runtime.sampling import SamplingParams
from splitspec.serving.requests import (ENSEMBLE_INPUTS, MAX_STOP_CHARS, MAX_STOP_STRINGS, StreamOptions,
                                        cancel_stream_id, check_parameters, parse_request, scalar, strings)

LIMIT = 4096


def _inputs(**overrides):
    """A good request's inputs (as Triton's ``as_numpy()`` gives them), with ``overrides`` (None: absent)."""
    base = {"input_ids": np.array([5, 6, 7], dtype=np.int32), "max_tokens": np.array([8], dtype=np.int32)}
    base.update(overrides)
    return {k: v for k, v in base.items() if v is not None}


def test_good_request_with_defaults():
    req, opts = parse_request(_inputs(), LIMIT)
    assert req.prompt_ids == [5, 6, 7] and all(type(i) is int for i in req.prompt_ids)
    assert req.max_tokens == 8 and req.num_draft_tokens is None and req.stop == []
    assert req.sampling == SamplingParams()
    assert opts == StreamOptions(stream=False, return_token_ids=False, return_stats=False)


def test_good_request_with_every_option():
    req, opts = parse_request(_inputs(
        temperature=np.array([0.7], dtype=np.float32), top_p=np.array([0.9], dtype=np.float32),
        top_k=np.array([20], dtype=np.int32), seed=np.array([12345], dtype=np.uint64),
        stop=np.array([b"\n\n", "done".encode()], dtype=np.object_), stream=np.array([True]),
        num_draft_tokens=np.array([2], dtype=np.int32), return_token_ids=np.array([True]),
        return_stats=np.array([True]), max_tokens=np.array([[LIMIT]], dtype=np.int32)), LIMIT)
    assert req.sampling == SamplingParams(temperature=0.7, top_p=0.9, top_k=20, seed=12345)  # 0.7, not 0.699999988
    assert req.max_tokens == LIMIT and req.num_draft_tokens == 2 and req.stop == ["\n\n", "done"]
    assert opts == StreamOptions(stream=True, return_token_ids=True, return_stats=True)


def test_num_draft_tokens_zero_is_kept():
    req, _ = parse_request(_inputs(num_draft_tokens=np.array([0], dtype=np.int32)), LIMIT)
    assert req.num_draft_tokens == 0


@pytest.mark.parametrize("inputs, message", [
    (_inputs(input_ids=None), "input_ids: missing"),
    (_inputs(input_ids=np.zeros(0, dtype=np.int32)), "input_ids: empty prompt"),
    (_inputs(max_tokens=None), "max_tokens: missing"),
    (_inputs(max_tokens=np.array([0], dtype=np.int32)), f"max_tokens = 0: expected 1..{LIMIT}"),
    (_inputs(max_tokens=np.array([LIMIT + 1], dtype=np.int32)), f"max_tokens = {LIMIT + 1}: expected 1..{LIMIT}"),
    (_inputs(max_tokens=np.array([-3], dtype=np.int32)), f"max_tokens = -3: expected 1..{LIMIT}"),
    (_inputs(max_tokens=np.array([4, 4], dtype=np.int32)), "max_tokens: expected one value, got shape [2]"),
    (_inputs(temperature=np.zeros((1, 2), dtype=np.float32)), "temperature: expected one value, got shape [1, 2]"),
    (_inputs(stream=np.zeros(0, dtype=bool)), "stream: expected one value, got shape [0]"),
    (_inputs(stop=np.array([b""], dtype=np.object_)), "stop: empty string"),
    (_inputs(stop=np.array([b"x" * (MAX_STOP_CHARS + 1)], dtype=np.object_)),
     f"stop: a string of {MAX_STOP_CHARS + 1} characters, at most {MAX_STOP_CHARS}"),
    (_inputs(stop=np.array([b"s%d" % i for i in range(MAX_STOP_STRINGS + 1)], dtype=np.object_)),
     f"stop: {MAX_STOP_STRINGS + 1} strings, at most {MAX_STOP_STRINGS}"),
    (_inputs(stop=np.array([b"\xff\xfe"], dtype=np.object_)), "stop: not valid UTF-8"),
])
def test_bad_request_is_refused_naming_the_input(inputs, message):
    with pytest.raises(ConfigError) as e:
        parse_request(inputs, LIMIT)
    assert str(e.value) == message


def test_stop_limits_are_inclusive():
    stop = np.array([b"x" * MAX_STOP_CHARS] * MAX_STOP_STRINGS, dtype=np.object_)
    req, _ = parse_request(_inputs(stop=stop), LIMIT)
    assert len(req.stop) == MAX_STOP_STRINGS


def test_unknown_parameters_are_refused_listing_the_inputs():
    with pytest.raises(ConfigError) as e:
        check_parameters(json.dumps({"max_token": 8}))
    assert str(e.value) == f"unknown parameter 'max_token': not an input of this model (inputs: {', '.join(ENSEMBLE_INPUTS)})"
    with pytest.raises(ConfigError, match=r"^unknown parameters 'a', 'b': not an input"):
        check_parameters(json.dumps({"b": 1, "a": 2, "priority": 0}))


@pytest.mark.parametrize("raw", [None, "", "{}", "not json", "[1, 2]",
                                 json.dumps({"sequence_id": 1, "timeout": 5, "triton_enable_empty_final_response": True,
                                             "binary_data_output": False, "headers": {}})])
def test_triton_parameters_and_no_parameters_pass(raw):
    check_parameters(raw)


def test_cancel_stream_id():
    assert cancel_stream_id({}) is None
    assert cancel_stream_id({"cancel_stream_id": np.array([2**62], dtype=np.int64)}) == 2**62
    with pytest.raises(ConfigError, match="cancel_stream_id: expected one value"):
        cancel_stream_id({"cancel_stream_id": np.array([1, 2], dtype=np.int64)})


def test_scalar_and_strings_of_absent_inputs():
    assert scalar({"x": None}, "x") is None and scalar({}, "x") is None
    assert strings({}, "stop") == [] and strings({"stop": None}, "stop") == []
    assert strings({"stop": np.array([["a", "é".encode()]], dtype=np.object_)}, "stop") == ["a", "é"]
