"""The checks of an HTTP generate request's JSON made before tritonserver reads it, without a server."""

from __future__ import annotations

import pytest

from splitspec.errors import ConfigError
from splitspec.serving.generate_json import check_generate_json

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
