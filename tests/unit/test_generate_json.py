"""The checks of an HTTP generate request's JSON made before tritonserver reads it, without a server."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from splitspec.errors import ConfigError
from splitspec.serving.generate_json import INPUT_TYPES, check_generate_json
from splitspec.serving.requests import ENSEMBLE_INPUTS

FLAT = 'expected a string or an array of strings (e.g. ["\\n\\n", "done"])'


@pytest.mark.parametrize("body,message", [
    ({"stop_words": [["a"]]}, f"stop_words: {FLAT}, got an array whose element 0 is an array"),
    ({"stop_words": ["a", ["b"]]}, f"stop_words: {FLAT}, got an array whose element 1 is an array"),
    ({"bad_words": [[["x"]]]}, f"bad_words: {FLAT}, got an array whose element 0 is an array"),
    ({"stop": {"x": 1}}, f"stop: {FLAT}, got an object"),
    ({"stop_words": [1]}, f"stop_words: {FLAT}, got an array whose element 0 is a number"),
    ({"stop_words": None}, f"stop_words: {FLAT}, got null"),
])
def test_generate_json_string_lists_must_be_flat(body, message):
    """Triton's HTTP generate flattens nested arrays ([["a"]] reaches spec_decode as the tensor of ["a"], measured) and
    answers a number or object with a 500: the JSON is checked where it is read, naming the input and the form."""
    with pytest.raises(ConfigError) as e:
        check_generate_json({"text_input": "x", "max_tokens": 4, **body})
    assert str(e.value) == message


def test_generate_json_flat_string_lists_pass():
    for body in ({"stop_words": ["\n\n", "done"], "bad_words": [], "stop": "x"}, {"stop_words": ""}, {"text_input": [["x"]]}):
        check_generate_json(body)  # text_input and scalars: Triton's own checks and the models' (one value) hold


@pytest.mark.parametrize("body,message", [
    ({"max_tokens": "ten"}, "max_tokens: expected an integer (INT32), got a string"),
    ({"max_tokens": 2.0}, "max_tokens: expected an integer (INT32), got a number with a fraction or exponent"),
    ({"max_tokens": True}, "max_tokens: expected an integer (INT32), got a boolean"),
    ({"max_tokens": None}, "max_tokens: expected an integer (INT32), got null"),
    ({"max_tokens": {"a": 1}}, "max_tokens: expected an integer (INT32), got an object"),
    ({"max_tokens": ["2"]}, "max_tokens: expected an integer (INT32), got an array holding a string"),
    ({"max_tokens": 2 ** 63}, "max_tokens: expected an integer (INT32), got 9223372036854775808, beyond the signed "
                              "64-bit integers Triton reads"),
    ({"max_tokens": -2 ** 63 - 1}, "max_tokens: expected an integer (INT32), got -9223372036854775809, beyond the "
                                   "signed 64-bit integers Triton reads"),
    ({"max_tokens": 10 ** 40}, "max_tokens: expected an integer (INT32), got an integer of 41 digits, beyond the "
                               "signed 64-bit integers Triton reads"),
    ({"timeout_ms": 1.5}, "timeout_ms: expected an integer (INT64), got a number with a fraction or exponent"),
    ({"temperature": "hot"}, "temperature: expected a number (FP32), got a string"),
    ({"top_p": False}, "top_p: expected a number (FP32), got a boolean"),
    ({"stream": 1}, "stream: expected true or false (BOOL), got a number"),
    ({"return_stats": "false"}, "return_stats: expected true or false (BOOL), got a string"),
    ({"seed": -1}, "seed: expected a non-negative integer (UINT64), got -1"),
    ({"seed": 1.0}, "seed: expected a non-negative integer (UINT64), got a number with a fraction or exponent"),
    ({"seed": 2 ** 64}, "seed: expected a non-negative integer (UINT64), got 18446744073709551616, beyond the "
                        "unsigned 64-bit integers Triton reads"),
    ({"text_input": 5}, "text_input: expected a string (STRING), got a number"),
    ({"text_input": None}, "text_input: expected a string (STRING), got null"),
])
def test_generate_json_values_of_the_wrong_type_are_refused(body, message):
    """Triton 2.51's HTTP generate answered these with a 500 (``Unable to parse 'data': attempt to access JSON
    non-signed-integer as signed-integer``, measured), before any model saw them: refused here, naming the input
    and the type it takes."""
    with pytest.raises(ConfigError) as e:
        check_generate_json({"text_input": "x", "max_tokens": 4, **body})
    assert str(e.value) == message


def test_generate_json_values_triton_reads_pass():
    """What Triton reads (measured): an integer within 64 bits for INT32 (it wraps; the models check the range), any
    number for FP32 (1e300 becomes inf, which the models refuse), a value or nested arrays of them (Triton flattens),
    an empty array (Triton's own 400), and keys that are not inputs (the models' 400)."""
    for body in ({"max_tokens": [2]}, {"max_tokens": [[2]]}, {"max_tokens": -2 ** 63}, {"max_tokens": 2 ** 63 - 1},
                 {"max_tokens": []}, {"temperature": 0}, {"temperature": 1e300}, {"top_p": 0.5}, {"stream": False},
                 {"seed": 2 ** 64 - 1}, {"seed": 0}, {"text_input": ["x"]}, {"timeout_ms": 5},
                 {"max_new_tokens": "ten"}, {"parameters": {"max_tokens": "x"}}):
        check_generate_json({"text_input": "x", "max_tokens": 4, **body})


def test_generate_json_types_are_the_ensembles():
    """INPUT_TYPES is the ensemble's inputs and their types (triton_repo/ensemble/config.pbtxt.in)."""
    config = (Path(__file__).parents[2] / "triton_repo" / "ensemble" / "config.pbtxt.in").read_text()
    inputs = config[config.index("input ["):config.index("output [")]
    declared = dict(re.findall(r'name: "(\w+)"\s+data_type: TYPE_(\w+)', inputs))
    assert declared == INPUT_TYPES and len(declared) == len(ENSEMBLE_INPUTS)
