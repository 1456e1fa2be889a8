"""spec_decode's request parsing, without a server: every bad input is refused with a message naming it, and a
good request becomes the runtime Request and stream options the model serves."""

from __future__ import annotations

import json

import numpy as np
import pytest

from splitspec.errors import ConfigError, ServerBusy
from splitspec.runtime.sampling import SamplingParams
from splitspec.serving.requests import (ENSEMBLE_INPUTS, INT32_HINT, MAX_STOP_CHARS, MAX_STOP_STRINGS, SPEC_DECODE_INPUTS,
                                        UNSUPPORTED, StreamOptions, cancel_stream_id, check_capacity, check_parameters,
                                        parse_request, prompt_text, scalar, strings)

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
    assert opts == StreamOptions(stream=True, return_token_ids=True, return_stats=True, return_num_input_tokens=True,
                                 return_num_output_tokens=True)


def test_num_draft_tokens_zero_is_kept():
    req, _ = parse_request(_inputs(num_draft_tokens=np.array([0], dtype=np.int32)), LIMIT)
    assert req.num_draft_tokens == 0


@pytest.mark.parametrize("inputs, message", [
    (_inputs(input_ids=None), "input_ids: missing"),
    (_inputs(input_ids=np.zeros(0, dtype=np.int32)), "input_ids: empty prompt"),
    (_inputs(max_tokens=None), f"max_tokens: missing (a required input: tokens to generate at most, 1..{LIMIT})"),
    (_inputs(max_tokens=np.array([0], dtype=np.int32)), f"max_tokens = 0: expected 1..{LIMIT}{INT32_HINT}"),
    (_inputs(max_tokens=np.array([LIMIT + 1], dtype=np.int32)), f"max_tokens = {LIMIT + 1}: expected 1..{LIMIT}"),
    (_inputs(max_tokens=np.array([-3], dtype=np.int32)), f"max_tokens = -3: expected 1..{LIMIT}{INT32_HINT}"),
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


# ---------------------------------------------------------------------------------------------
# The TensorRT-LLM backend's convention
# ---------------------------------------------------------------------------------------------


def _batched(**values):
    """Inputs as the batched models receive them: every value [1, 1], every list [1, n] (the end-to-end gRPC
    client of the TensorRT-LLM backend builds them so: ``np.array([[value]])``, ``np.array([words])``)."""
    out = {"input_ids": np.array([[5, 6, 7]], dtype=np.int32), "max_tokens": np.array([[8]], dtype=np.int32)}
    for name, v in values.items():
        out[name] = np.array([v], dtype=np.object_) if isinstance(v, list) else np.array([[v]])
    return out


def test_a_request_of_the_end_to_end_client_parses():
    """What end_to_end_grpc_client.py sends by default (stream, beam_width 1, temperature, exclude_input_in_output
    false, stop_words), with greedy decoding."""
    inputs = _batched(stream=np.bool_(False), beam_width=np.int32(1), temperature=np.float32(0.0),
                      exclude_input_in_output=np.bool_(False), stop_words=[b"\n\n", b"done"],
                      text_input=b"def f():", bad_words=[], num_return_sequences=np.int32(1))
    req, opts = parse_request(inputs, LIMIT)
    assert req.prompt_ids == [5, 6, 7] and req.max_tokens == 8 and req.stop == ["\n\n", "done"]
    assert req.sampling == SamplingParams() and req.stop_token_ids is None
    assert opts == StreamOptions(echo="def f():")  # non-streamed, the prompt first
    _, opts = parse_request({**inputs, "stream": np.array([[True]])}, LIMIT)
    assert opts.stream and opts.echo is None  # a stream never repeats the prompt
    _, opts = parse_request({k: v for k, v in inputs.items() if k != "exclude_input_in_output"}, LIMIT)
    assert opts.echo is None  # absent: only the generated text, as before


def test_a_request_of_the_openai_front_end_parses():
    """What Triton's OpenAI front end sends a TensorRT-LLM ensemble: seed (older versions: random_seed) as UINT64,
    top_p, the penalties at OpenAI's defaults, token counts asked for."""
    inputs = _batched(stream=np.bool_(True), top_p=np.float32(0.95), temperature=np.float32(0.7),
                      seed=np.uint64(2**40 + 3), frequency_penalty=np.float32(0.0), presence_penalty=np.float32(0.0),
                      return_num_input_tokens=np.bool_(True), return_num_output_tokens=np.bool_(True),
                      stop_words=[b"\n"])
    req, opts = parse_request(inputs, LIMIT)
    assert req.sampling == SamplingParams(temperature=0.7, top_p=0.95, seed=2**40 + 3) and req.stop == ["\n"]
    assert opts == StreamOptions(stream=True, return_num_input_tokens=True, return_num_output_tokens=True)
    old = {k: v for k, v in inputs.items() if k != "seed"} | {"random_seed": np.array([[9]], dtype=np.uint64)}
    assert parse_request(old, LIMIT)[0].sampling.seed == 9
    assert parse_request(old | {"seed": np.array([[9]], dtype=np.uint64)}, LIMIT)[0].sampling.seed == 9
    with pytest.raises(ConfigError, match=r"^seed = 9 and random_seed = 8: two different seeds"):
        parse_request(old | {"seed": np.array([[9]], dtype=np.uint64), "random_seed": np.array([[8]], dtype=np.uint64)},
                      LIMIT)


@pytest.mark.parametrize("name, value, shown", [
    ("beam_width", np.int32(2), "2"), ("beam_width", np.int32(0), "0"), ("num_return_sequences", np.int32(2), "2"),
    ("min_tokens", np.int32(5), "5"), ("repetition_penalty", np.float32(1.3), "1.3"),
    ("presence_penalty", np.float32(0.5), "0.5"), ("frequency_penalty", np.float32(-0.2), "-0.2"),
    ("return_log_probs", np.bool_(True), "true"), ("return_context_logits", np.bool_(True), "true"),
    ("return_generation_logits", np.bool_(True), "true"),
])
def test_controls_not_implemented_are_refused_naming_them(name, value, shown):
    with pytest.raises(ConfigError) as e:
        parse_request(_batched(**{name: value}), LIMIT)
    assert str(e.value).startswith(f"{name} = {shown}: not supported by this server; accepted: "), str(e.value)


def test_controls_not_implemented_pass_at_their_neutral_value():
    neutral = dict(beam_width=np.int32(1), num_return_sequences=np.int32(1), min_tokens=np.int32(1),
                   repetition_penalty=np.float32(1.0), presence_penalty=np.float32(0.0),
                   frequency_penalty=np.float32(0.0), return_log_probs=np.bool_(False),
                   return_context_logits=np.bool_(False), return_generation_logits=np.bool_(False),
                   length_penalty=np.float32(0.5), pad_id=np.int32(2), bad_words=[b"", b""])
    assert set(UNSUPPORTED) < set(neutral)
    req, opts = parse_request(_batched(**neutral), LIMIT)
    assert req.sampling == SamplingParams() and opts == StreamOptions()


def test_bad_words_are_refused_and_empty_stop_words_ignored():
    with pytest.raises(ConfigError, match=r"^bad_words = \['no'\]: not supported by this server"):
        parse_request(_batched(bad_words=[b"", b"no"]), LIMIT)
    req, _ = parse_request(_batched(stop_words=[b""], stop=[b"x"]), LIMIT)  # TensorRT-LLM's examples send ""
    assert req.stop == ["x"]
    many = [b"w%d" % i for i in range(MAX_STOP_STRINGS)]
    with pytest.raises(ConfigError, match=rf"^stop and stop_words: {MAX_STOP_STRINGS + 1} strings, at most"):
        parse_request(_batched(stop_words=many, stop=[b"x"]), LIMIT)


def test_end_id_and_statistics_switches():
    req, opts = parse_request(_batched(end_id=np.int32(3), return_perf_metrics=np.bool_(True)), LIMIT)
    assert req.stop_token_ids == {3}
    assert opts == StreamOptions(return_stats=True)  # perf metrics: the statistics, not the token counts
    with pytest.raises(ConfigError, match=r"^end_id = -1: expected a token id"):
        parse_request(_batched(end_id=np.int32(-1)), LIMIT)


@pytest.mark.parametrize("name", ["end_id", "pad_id"])
def test_token_ids_beyond_the_vocabulary_are_refused_naming_the_input_and_the_size(name):
    """A token-id input must be a token of the served vocabulary: the last one passes, the next is refused."""
    req, _ = parse_request(_batched(**{name: np.int32(511)}), LIMIT, vocab_size=512)
    assert req.stop_token_ids == ({511} if name == "end_id" else None)
    for bad in (512, 10**6):
        with pytest.raises(ConfigError, match=rf"^{name} = {bad}: outside the vocabulary .*0\.\.511, vocab_size 512\)$"):
            parse_request(_batched(**{name: np.int32(bad)}), LIMIT, vocab_size=512)
    assert parse_request(_batched(**{name: np.int32(10**6)}), LIMIT)[0]  # no vocabulary given: not checked


def test_inputs_agree_with_the_client_and_the_model():
    """The client's input table, spec_decode's inputs and the ensemble's config name the same inputs."""
    import re
    from pathlib import Path

    from splitspec.serving.client import INPUTS

    assert tuple(INPUTS) == ENSEMBLE_INPUTS
    root = Path(__file__).resolve().parents[2] / "triton_repo"
    names = lambda model: re.findall(r'name: "(\w+)"', (root / model / "config.pbtxt.in").read_text()  # noqa: E731
                                     .split("\ninput [")[1].split("\noutput [")[0])
    assert tuple(names("ensemble")) == ENSEMBLE_INPUTS
    assert tuple(names("spec_decode")) == (*SPEC_DECODE_INPUTS, "cancel_stream_id")


# ---------------------------------------------------------------- admission: prompt size, capacity


@pytest.mark.parametrize("raw, message", [
    (None, "text_input: missing (a required input"),
    (np.array([[b"abcdefghi"]], dtype=np.object_), "text_input: 9 bytes, at most 8"),
    (np.array(["ééééé"], dtype=np.object_), "text_input: 10 bytes, at most 8"),  # counted in UTF-8 bytes
    (np.array([b"\xff\xfe"], dtype=np.object_), "text_input: not valid UTF-8"),
    (np.array([b""], dtype=np.object_), "text_input: empty prompt"),
    (np.array([b"a", b"b"], dtype=np.object_), "text_input: expected one value"),
])
def test_prompt_text_refusals(raw, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        prompt_text({} if raw is None else {"text_input": raw}, 8)


def test_prompt_text_at_the_limit_is_accepted_and_the_limit_is_checked_before_decoding():
    assert prompt_text({"text_input": np.array([["défi".encode()]], dtype=np.object_)}, 5) == "défi"  # 5 bytes
    with pytest.raises(ConfigError, match="at most 3"):  # refused by size although it is not UTF-8 either
        prompt_text({"text_input": np.array([b"\xff\xfe\xfd\xfc"], dtype=np.object_)}, 3)


@pytest.mark.parametrize("open_requests, refused", [(0, False), (5, False), (6, True), (9, True)])
def test_check_capacity(open_requests, refused):
    if refused:
        with pytest.raises(ServerBusy, match=rf"server busy: {open_requests} requests open, at most 4 decoding and 2 "):
            check_capacity(open_requests, 4, 2)
    else:
        check_capacity(open_requests, 4, 2)


@pytest.mark.parametrize("name", ["seed", "random_seed"])
@pytest.mark.parametrize("value", [2**63, 2**64 - 1])
def test_a_seed_beyond_the_engines_is_refused_as_sent(name, value):
    """seed (and random_seed) are UINT64, the engine's seeds 0..2^63 - 1: a larger one is refused here, in one line
    naming the input, its value as sent (not wrapped negative) and the range, before it reaches the engine."""
    with pytest.raises(ConfigError) as e:
        parse_request(_inputs(**{name: np.array([[value]], dtype=np.uint64)}), LIMIT)
    assert str(e.value) == f"{name} = {value}: expected 0..{2**63 - 1} (0 ≤ seed < 2^63)"
    top = parse_request(_inputs(**{name: np.array([[2**63 - 1]], dtype=np.uint64)}), LIMIT)[0]
    assert top.sampling.seed == 2**63 - 1
    top.check()  # and the engine takes it


def test_top_k_beyond_int32_names_the_value_as_sent():
    """``"top_k": 3000000000`` over HTTP generate reaches the model wrapped to INT32 (Triton's front end, modulo 2^32):
    the message names the range and 3000000000, the value the client sent (before: the engine's ``top_k =
    -1294967296, expected an integer ≥ 0``, the wrapped value only)."""
    wrapped = np.array([[3_000_000_000]], dtype=np.int64).astype(np.int32)  # what Triton hands the model
    assert int(wrapped[0, 0]) == 3_000_000_000 - 2**32
    with pytest.raises(ConfigError) as e:
        parse_request(_inputs(top_k=wrapped), LIMIT)
    assert str(e.value) == (f"top_k = -1294967296: expected 0..{2**31 - 1} (0 = no limit){INT32_HINT[:-1]}: "
                            "3000000000 sent as JSON arrives as -1294967296)")
    with pytest.raises(ConfigError, match=r"^top_k = 3000000000: expected 0\.\.2147483647 \(0 = no limit\)$"):
        parse_request(_inputs(top_k=np.array([[3_000_000_000]], dtype=np.int64)), LIMIT)  # not an INT32: no hint
    assert parse_request(_inputs(top_k=np.array([[2**31 - 1]], dtype=np.int32)), LIMIT)[0].sampling.top_k == 2**31 - 1


@pytest.mark.parametrize("name, value, dtype, bounds", [
    ("top_k", 3_000_000_000, "INT32", f"{-2**31}..{2**31 - 1}"), ("max_tokens", -2**31 - 1, "INT32", f"{-2**31}..{2**31 - 1}"),
    ("seed", 2**64, "UINT64", f"0..{2**64 - 1}"), ("seed", -1, "UINT64", f"0..{2**64 - 1}")])
def test_the_grpc_client_refuses_an_integer_its_tensor_cannot_hold(name, value, dtype, bounds):
    """splitspec's gRPC client names such a value as given instead of letting NumPy wrap it into the tensor."""
    from splitspec.serving.client import grpc_inputs

    kw = {"max_tokens": value} if name == "max_tokens" else {"max_tokens": 4, name: value}
    with pytest.raises(ConfigError) as e:
        grpc_inputs("x", **kw)
    assert str(e.value) == f"{name} = {value}: beyond {dtype}, the input's type ({bounds})"


@pytest.mark.parametrize("name, value", [("top_k", 3e9), ("top_k", "3000000000"), ("seed", -1.0), ("seed", 1.5),
                                         ("num_draft_tokens", True)])
def test_the_grpc_client_refuses_a_non_integer_for_an_integer_input(name, value):
    """A float, string or bool for an integer input is named as given, not cast (3e9 would wrap, 1.5 truncate)."""
    from splitspec.serving.client import grpc_inputs

    with pytest.raises(ConfigError, match=rf"^{name} = {value!r}: expected an integer"):
        grpc_inputs("x", 4, **{name: value})


def test_max_tokens_wrapped_by_triton_http_gets_a_hint():
    with pytest.raises(ConfigError, match=r"max_tokens = -2147483643: expected 1\.\.4096 \(an INT32 input.*modulo 2\^32"):
        parse_request(_inputs(max_tokens=np.array([2**31 + 5 - 2**32], dtype=np.int32)), LIMIT)
    with pytest.raises(ConfigError, match=r"max_tokens = 4097: expected 1\.\.4096$"):  # too large: no hint
        parse_request(_inputs(max_tokens=np.array([LIMIT + 1], dtype=np.int32)), LIMIT)
