"""OpenAI request checking and response shaping (serving/openai_schema.py, openai_errors.py, json_body.py), without a
server: every served field reaches the ensemble's inputs, every bad or unsupported field is refused with a 400 naming
it, and answers, chunks and errors have the shapes of OpenAI's API reference."""

from __future__ import annotations

import json

import pytest

from splitspec.serving import openai_errors as errors
from splitspec.serving import openai_schema as s
from splitspec.serving.client import INPUTS
from splitspec.serving.json_body import lone_surrogate, nesting_depth

CHAT = {"model": "demo", "messages": [{"role": "user", "content": "hi"}]}
COMP = {"model": "demo", "prompt": "def f(x):"}


def test_chat_fields_reach_the_ensemble_inputs():
    req = s.parse_chat({**CHAT, "max_completion_tokens": 7, "temperature": 0.5, "top_p": 0.9, "seed": 3,
                        "stop": "\n", "stream": True, "stream_options": {"include_usage": True}, "top_k": 5,
                        "num_draft_tokens": 0, "n": 1, "logprobs": False, "presence_penalty": 0.0, "user": "u"})
    assert (req.kind, req.max_tokens, req.stream, req.include_usage) == ("chat", 7, True, True)
    params = req.ensemble_params()
    assert params == {"temperature": 0.5, "top_p": 0.9, "top_k": 5, "seed": 3, "stop": ["\n"], "num_draft_tokens": 0,
                      "stream": True, "return_stats": True}
    assert set(params) <= set(INPUTS)  # names the ensemble has (client.grpc_inputs refuses others)


def test_chat_messages_roles_and_text_parts():
    req = s.parse_chat({"model": "m", "messages": [
        {"role": "developer", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "a"},
                                                                                   {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": "c", "name": "bot"}]})
    assert req.messages == ({"role": "system", "content": "be brief"}, {"role": "user", "content": "ab"},
                            {"role": "assistant", "content": "c"})
    assert req.max_tokens is None  # chat: as many as fit (decided by the front end with the tokenizer)


def test_completion_defaults_and_single_prompt_list():
    req = s.parse_completion({**COMP, "prompt": ["x"]})
    assert (req.prompt, req.max_tokens, req.stream, req.stop) == ("x", s.COMPLETION_DEFAULT_MAX_TOKENS, False, ())
    assert s.parse_completion({**COMP, "stop": ["a", "b"], "max_tokens": 3}).ensemble_params()["stop"] == ["a", "b"]


BAD_CHAT = [
    ({"messages": [{"role": "user", "content": "x"}]}, "model"),
    ({**CHAT, "messages": []}, "messages"),
    ({**CHAT, "messages": "hi"}, "messages"),
    ({**CHAT, "messages": [{"role": "tool", "content": "x"}]}, "messages[0].role"),
    ({**CHAT, "messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "messages[0].content"),
    ({**CHAT, "messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages[0]"),
    ({**CHAT, "max_tokens": "ten"}, "max_tokens"),
    ({**CHAT, "max_tokens": 0}, "max_tokens"),
    ({**CHAT, "max_tokens": True}, "max_tokens"),
    ({**CHAT, "max_completion_tokens": -2}, "max_completion_tokens"),
    ({**CHAT, "temperature": "hot"}, "temperature"),
    ({**CHAT, "temperature": 2.5}, "temperature"),
    ({**CHAT, "top_p": 0}, "top_p"),
    ({**CHAT, "seed": -1}, "seed"),
    ({**CHAT, "seed": 2**63}, "seed"),  # past the engine's seeds (it refused them after the schema let them through)
    ({**CHAT, "max_tokens": 10**23}, "max_tokens"),  # past the ensemble's INT32: refused, not a 500
    ({**CHAT, "max_completion_tokens": 2**31}, "max_completion_tokens"),
    ({**CHAT, "max_tokens": 5, "max_completion_tokens": 6}, "max_tokens"),  # which one? OpenAI does not say
    ({**CHAT, "top_k": 2**40}, "top_k"),
    ({**CHAT, "seed": 1.5}, "seed"),
    ({**CHAT, "stop": 5}, "stop"),
    ({**CHAT, "stop": [""]}, "stop"),
    ({**CHAT, "stop": ["x"] * 17}, "stop"),
    ({**CHAT, "stream": "yes"}, "stream"),
    ({**CHAT, "stream_options": {"include_usage": True}}, "stream_options"),  # without stream
    ({**CHAT, "stream": True, "stream_options": {"include_usage": 1}}, "stream_options"),
    ({**CHAT, "n": 2}, "n"),
    ({**CHAT, "logprobs": True}, "logprobs"),
    ({**CHAT, "top_logprobs": 3}, "top_logprobs"),
    ({**CHAT, "presence_penalty": 0.5}, "presence_penalty"),
    ({**CHAT, "frequency_penalty": 1}, "frequency_penalty"),
    ({**CHAT, "logit_bias": {"5": 1}}, "logit_bias"),
    ({**CHAT, "tools": [{"type": "function"}]}, "tools"),
    ({**CHAT, "max_new_tokens": 5}, "max_new_tokens"),
    ({**CHAT, "prompt": "x"}, "prompt"),  # a completions field
]


@pytest.mark.parametrize("body,param", BAD_CHAT)
def test_bad_chat_fields_are_refused_naming_the_field(body, param):
    with pytest.raises(errors.APIError) as e:
        s.parse_chat(body)
    err = e.value.body()["error"]
    assert e.value.status == 400 and err["type"] == "invalid_request_error" and err["param"] == param
    assert param.split("[")[0] in err["message"] and set(err) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("seed", [2**63, 2**64 - 1, -1])
def test_seed_beyond_the_engines_range_is_one_400_naming_it(seed):
    """The engine seeds a request's generator with 0 ≤ seed < 2^63 (SamplingParams.check): the schema takes that range
    and refuses the rest in one line naming the field and the range."""
    with pytest.raises(errors.APIError) as e:
        s.parse_completion({**COMP, "seed": seed})
    err = e.value.body()["error"]
    assert (e.value.status, err["param"]) == (400, "seed")
    assert err["message"] == f"seed = {seed}: expected 0..{2**63 - 1}" and "\n" not in err["message"]
    assert s.parse_completion({**COMP, "seed": 2**63 - 1}).seed == 2**63 - 1


@pytest.mark.parametrize("body,param", [({**COMP, "prompt": ""}, "prompt"), ({**COMP, "prompt": [1, 2, 3]}, "prompt"),
                                        ({**COMP, "prompt": ["a", "b"]}, "prompt"), ({"model": "m"}, "prompt"),
                                        ({**COMP, "echo": True}, "echo"), ({**COMP, "best_of": 2}, "best_of"),
                                        ({**COMP, "logprobs": 2}, "logprobs"), ({**COMP, "suffix": "x"}, "suffix"),
                                        ({**COMP, "messages": []}, "messages")])
def test_bad_completion_fields_are_refused(body, param):
    with pytest.raises(errors.APIError) as e:
        s.parse_completion(body)
    assert (e.value.status, e.value.param) == (400, param)


def test_max_tokens_and_max_completion_tokens_agree_or_are_refused():
    req = s.parse_chat({**CHAT, "max_tokens": 6, "max_completion_tokens": 6})
    assert (req.max_tokens, req.max_tokens_param) == (6, "max_completion_tokens")
    with pytest.raises(errors.APIError) as e:
        s.parse_chat({**CHAT, "max_tokens": 5, "max_completion_tokens": 6})
    assert e.value.message.startswith("max_tokens = 5 and max_completion_tokens = 6: two different limits")


@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2]", b"\xff\xfe", b"null"])
def test_body_must_be_a_json_object(raw):
    with pytest.raises(errors.APIError) as e:
        s.parse_json(raw)
    assert e.value.status == 400 and "JSON" in e.value.message


@pytest.mark.parametrize("raw,depth", [(b"1", 0), (b"{}", 1), (b'{"a": [1, {"b": []}]}', 4), (b'["]]]", "[[[\\\\"]', 1),
                                       (b'{"a": "\\"[{"}', 1), (b"[" * 50_000 + b"]" * 50_000, 50_000)])
def test_nesting_depth_skips_strings(raw, depth):
    assert nesting_depth(raw) == depth


def test_deep_nesting_is_refused_before_parsing():
    """50,000 levels made json.loads raise RecursionError (a 500); the limit is checked on the bytes first."""
    chat = json.dumps(CHAT).encode()
    assert s.parse_json(chat) == CHAT
    deep = b'{"model": "m", "messages": ' + b"[" * 50_000 + b"]" * 50_000 + b"}"
    at_limit = b"[" * (s.MAX_JSON_DEPTH - 1) + b"{}" + b"]" * (s.MAX_JSON_DEPTH - 1)
    with pytest.raises(errors.APIError) as e:
        s.parse_json(deep)
    assert e.value.status == 400 and e.value.message == ("request body nests arrays and objects 50001 levels deep, at "
                                                         f"most {s.MAX_JSON_DEPTH}")
    with pytest.raises(errors.APIError, match="must be a JSON object, got list"):  # parsed: within the limit
        s.parse_json(at_limit)
    with pytest.raises(errors.APIError, match="65 levels deep"):
        s.parse_json(b"[" + at_limit + b"]")


@pytest.mark.parametrize("raw,param,at", [
    (rb'{"model": "m", "prompt": "ab\ud800"}', "prompt", 2),
    (rb'{"model": "m", "messages": [{"role": "user", "content": "\udfff"}]}', "messages[0].content", 0),
    (rb'{"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "x\udc00"}]}]}',
     "messages[0].content[0].text", 1),
    (rb'{"model": "m", "stop": ["ok", "\ud800"]}', "stop[1]", 0),
    (b'{"model": "m", "prompt": "\xed\xa0\x80"}', "prompt", 0),  # the surrogate's UTF-8-style bytes, not an escape
    (rb'{"model": "m", "x\ud800": 1}', r"x\ud800", 1),  # a key: named with the surrogate escaped
])
def test_lone_surrogates_are_refused_naming_the_field(raw, param, at):
    with pytest.raises(errors.APIError) as e:
        s.parse_json(raw)
    err = e.value.body()["error"]
    assert (e.value.status, err["param"], err["type"]) == (400, param, "invalid_request_error")
    assert err["message"].startswith(f"{param}: a lone UTF-16 surrogate at character {at} ")
    json.dumps(err, ensure_ascii=False).encode("utf-8")  # the answer itself encodes: the 500 came from such encodes
    # a surrogate pair is one character (U+1F600), and stays accepted
    assert s.parse_json(rb'{"prompt": "\ud83d\ude00"}') == {"prompt": "\U0001F600"}
    assert lone_surrogate({"a": ["\U0001F600", {"b": "é"}]}) is None


@pytest.mark.parametrize("message,status,code", [
    ("spec_decode: prompt (300 tokens) + max_tokens ... exceeds the engine's max_seq_len = 256", 400, "context_length_exceeded"),
    ("preprocessing: text_input: empty prompt", 400, None),
    ("spec_decode: max_tokens = 100000: expected 1..4096", 400, None),
    ("spec_decode: generation failed: worker 1 died", 503, "service_unavailable"),
    ("Request for unknown model: 'ensemble' is not found", 503, "service_unavailable"),
    ("in ensemble 'ensemble', spec_decode: server busy: 128 requests open, at most 64 decoding and 64 waiting", 503,
     "service_unavailable"),
    ("postprocessing: internal error: KeyError: 3", 500, "internal_error"),
    ("Stub process 'spec_decode_0_0' is not healthy.", 503, "service_unavailable"),  # Triton's, the stub died
    # a request that failed alone (NaN logits) while the engine serves on: the server's fault, not unavailable
    ("in ensemble 'ensemble', spec_decode: internal error in this request (the engine serves on): sampling: draw: "
     "weights sum to 0, NaN or inf, expected a finite sum > 0 (NaN or inf in the logits?)", 500, "internal_error"),
    # the engine stopped serving: 503, whatever the failure's own text says
    ("in ensemble 'ensemble', spec_decode: generation failed: RuntimeError: CUDA error: an internal error", 503,
     "service_unavailable"),
])
def test_ensemble_errors_map_to_statuses(message, status, code):
    e = errors.ensemble_error(message)
    assert (e.status, e.code, e.message) == (status, code, message)


@pytest.mark.parametrize("body,message,param", [
    (CHAT, "in ensemble 'ensemble', spec_decode: max_tokens = 100000: expected 1..4096", "max_tokens"),
    ({**CHAT, "max_completion_tokens": 9}, "spec_decode: max_tokens = 9: expected 1..4", "max_completion_tokens"),
    (CHAT, "spec_decode: temperature = 0.001, expected 0 (greedy) or 0.01..100", "temperature"),
    (CHAT, "spec_decode: seed = 18446744073709551615, expected an integer in [0, 2^63)", "seed"),
    (CHAT, "spec_decode: num_draft_tokens = 9, expected 0..4 (engine max_draft_len)", "num_draft_tokens"),
    (CHAT, "spec_decode: stop and stop_words: 17 strings, at most 16", "stop"),
    (CHAT, "spec_decode: prompt (300 tokens) + max_tokens (8) + draft length (4) + 1 = 313 exceeds the engine's "
           "max_seq_len = 256", "messages"),
    (COMP, "preprocessing: text_input: the prompt encodes to no tokens", "prompt"),
    (COMP, "spec_decode: request needs 900 KV tokens but the whole KV budget is 512 tokens: it can never fit", None),
    (COMP, "spec_decode: generation failed: worker 1 died (max_tokens = 3)", None),  # a 503: no field to blame
])
def test_pipeline_errors_name_the_request_field(body, message, param):
    """A refusal passed through from the pipeline names the OpenAI field its message is about (it named none)."""
    req = s.parse_chat(body) if "messages" in body else s.parse_completion(body)
    e = errors.with_param(errors.ensemble_error(message), req)
    assert e.param == param and e.message == message


def test_default_max_tokens_fits_the_engine_rule():
    # the engine refuses prompt + max_tokens + k + 1 > max_seq_len (runtime/scheduler.py)
    assert s.default_max_tokens(10, 256, 8, 4096) == 256 - 10 - 8 - 1
    assert s.default_max_tokens(10, 256, 8, 100) == 100
    assert s.default_max_tokens(300, 256, 8, 4096) == 1


def test_answer_chunks_and_usage_shapes():
    req = s.parse_chat({**CHAT, "stream": True, "stream_options": {"include_usage": True}})
    ans = {"num_input_tokens": 5, "num_output_tokens": 3, "acceptance_length": 2.5, "accepted_per_position": [3, 2]}
    use = s.usage(ans)
    assert use == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8, "acceptance_length": 2.5,
                   "accepted_per_position": [3, 2]}
    first, mid, last = (s.chunk(req, "chatcmpl-1", 7, role=True), s.chunk(req, "chatcmpl-1", 7, "ab"),
                        s.chunk(req, "chatcmpl-1", 7, "c", "length"))
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""} and first["usage"] is None
    assert mid["object"] == "chat.completion.chunk" and mid["choices"][0] == {
        "index": 0, "delta": {"content": "ab"}, "logprobs": None, "finish_reason": None}
    assert last["choices"][0]["finish_reason"] == "length"
    tail = s.usage_chunk(req, "chatcmpl-1", 7, use)
    assert tail["choices"] == [] and tail["usage"] == use
    event = s.sse(mid)
    assert event.startswith("data: ") and event.endswith("\n\n") and json.loads(event[6:]) == mid
    whole = s.answer(s.parse_completion(COMP), "cmpl-1", 7, "text", "stop", use)
    assert whole["object"] == "text_completion" and whole["choices"][0]["text"] == "text"
    assert whole["choices"][0]["finish_reason"] == "stop" and whole["usage"]["total_tokens"] == 8
    chat = s.answer(req, "chatcmpl-1", 7, "hi", "stop", use)
    assert chat["object"] == "chat.completion" and chat["choices"][0]["message"] == {"role": "assistant", "content": "hi"}
    assert s.response_id("chat").startswith("chatcmpl-") and s.response_id("completion").startswith("cmpl-")
    assert s.response_id("chat") != s.response_id("chat")


def test_unknown_model_is_404_in_error_shape():
    e = errors.unknown_model("gpt-4", "demo")
    assert e.status == 404 and e.body()["error"]["code"] == "model_not_found" and "gpt-4" in e.message
