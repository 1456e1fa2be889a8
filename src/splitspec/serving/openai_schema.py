"""OpenAI-compatible requests and responses, without a server: checking the JSON bodies of ``/v1/chat/completions``
and ``/v1/completions``, turning them into the ensemble's request inputs, and shaping answers, stream chunks and
errors as OpenAI's API reference describes them (platform.openai.com/docs/api-reference: chat, completions, models,
"Error codes"; stream chunks: the ``chat.completion.chunk`` object).

Fields:

* served: ``model``, ``messages`` (chat) / ``prompt`` (completions: a string, or a list of one string),
  ``max_tokens`` / ``max_completion_tokens`` (chat: both given, the same value; OpenAI's reference calls
  ``max_tokens`` deprecated in favour of ``max_completion_tokens`` and says nothing of both, so two different values
  are refused), ``temperature`` (0..2; 0 = greedy, also when absent: the
  ensemble's default, where OpenAI's is 1), ``top_p`` (0 < p ≤ 1), ``seed``
  (0..2^63−1, the engine's range), ``stop`` (a string or a list of up to :data:`~splitspec.serving.requests.MAX_STOP_STRINGS`),
  ``stream``, ``stream_options.include_usage``, ``user`` (accepted, unused); extensions as in vLLM's server:
  ``top_k`` and ``num_draft_tokens`` (draft tokens per cycle; 0 = no speculation).
* known but not served (:data:`NEUTRAL`): accepted only at their neutral value (``n`` = 1, ``logprobs`` false,
  penalties 0, no tools, ...); any other value is refused with a 400 naming the field.
* anything else is refused with a 400 naming the field, as OpenAI's own API does ("Unrecognized request argument
  supplied") and as the ensemble's HTTP generate endpoint does: a field silently ignored would change what the
  client thinks it asked for.

A body is parsed only when it nests at most :data:`MAX_JSON_DEPTH` deep, and every string in it, key or value, must
be Unicode text (no lone surrogate, :mod:`splitspec.serving.json_body`). Errors are
:class:`~splitspec.serving.openai_errors.APIError`: an HTTP status plus OpenAI's error object ``{"error": {"message",
"type", "param", "code"}}``. ``usage`` carries ``prompt_tokens`` and ``completion_tokens`` as the engine counted them (the ensemble's
``num_input_tokens`` / ``num_output_tokens``) and, as an extension, the request's ``acceptance_length`` (tokens per
target forward) and ``accepted_per_position``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import uuid

from splitspec.errors import ConfigError
from splitspec.serving.json_body import lone_surrogate, nesting_depth
from splitspec.serving.openai_errors import invalid
from splitspec.runtime.types import SEED_MAX
from splitspec.serving.requests import INT32_MAX, check_stop

#: Known OpenAI fields this server does not implement → the values that mean "not used" (accepted).
NEUTRAL = {
    "n": (None, 1), "best_of": (None, 1), "logprobs": (None, False, 0), "top_logprobs": (None, 0),
    "presence_penalty": (None, 0), "frequency_penalty": (None, 0), "repetition_penalty": (None, 1),
    "logit_bias": (None, {}), "echo": (None, False), "suffix": (None, ""), "tools": (None, []),
    "tool_choice": (None, "none"), "functions": (None, []), "function_call": (None, "none"),
    "parallel_tool_calls": (None, False, True), "response_format": (None, {"type": "text"}),
    "service_tier": (None, "auto", "default"), "store": (None, False), "metadata": (None, {}),
    "modalities": (None, ["text"]), "reasoning_effort": (None,), "prediction": (None,), "audio": (None,),
}
#: Fields each endpoint serves (besides the :data:`NEUTRAL` ones).
COMMON = ("model", "max_tokens", "temperature", "top_p", "seed", "stop", "stream", "stream_options", "user",
          "top_k", "num_draft_tokens")
CHAT_FIELDS = frozenset(COMMON + ("messages", "max_completion_tokens"))
COMPLETION_FIELDS = frozenset(COMMON + ("prompt",))
#: max_tokens of a completion request that names none (OpenAI's documented default).
COMPLETION_DEFAULT_MAX_TOKENS = 16
CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
SSE_DONE = "data: [DONE]\n\n"
#: Deepest nesting of arrays and objects a request body may have (a served body needs 5: a chat message's text part).
MAX_JSON_DEPTH = 64


@dataclasses.dataclass(frozen=True)
class GenerationRequest:
    """One checked request. ``messages`` (chat) or ``prompt`` (completions) is set; ``max_tokens`` None means
    "as many as fit" (chat only: completions default to :data:`COMPLETION_DEFAULT_MAX_TOKENS`)."""

    kind: str
    model: str
    messages: tuple[dict, ...] | None = None
    prompt: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    num_draft_tokens: int | None = None
    max_tokens_param: str = "max_tokens"  # the field max_tokens came in (chat: or max_completion_tokens)

    def ensemble_params(self) -> dict:
        """The ensemble's request inputs besides ``text_input`` and ``max_tokens`` (for
        :func:`splitspec.serving.client.grpc_inputs`; None values are left out there). The ensemble always streams
        (one response per engine cycle) and returns its statistics; the front end folds them for a non-streaming
        client."""
        return {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "seed": self.seed,
                "stop": list(self.stop) or None, "num_draft_tokens": self.num_draft_tokens, "stream": True,
                "return_stats": True}


# -------------------------------------------------------------------------------------------------
# Reading requests
# -------------------------------------------------------------------------------------------------


def parse_json(raw: bytes) -> dict:
    """The request body as a JSON object whose strings are all Unicode text.

    Raises:
        APIError: 400 for a body that is not JSON, nests arrays and objects deeper than :data:`MAX_JSON_DEPTH`
            (checked before parsing: :func:`~splitspec.serving.json_body.nesting_depth`), is not an object, or holds
            a lone surrogate (``"\\ud800"``), naming the field (:func:`~splitspec.serving.json_body.lone_surrogate`).
    """
    depth = nesting_depth(raw)
    if depth > MAX_JSON_DEPTH:
        raise invalid(None, f"request body nests arrays and objects {depth} levels deep, at most {MAX_JSON_DEPTH}")
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise invalid(None, f"request body is not valid JSON ({e})") from None
    if not isinstance(body, dict):
        raise invalid(None, f"request body must be a JSON object, got {type(body).__name__}")
    found = lone_surrogate(body)
    if found is not None:
        where, i = found
        raise invalid(where, f"{where}: a lone UTF-16 surrogate at character {i} (a \\ud800-\\udfff escape without "
                      "its pair): not Unicode text")
    return body


def _type_name(v) -> str:
    return "null" if v is None else {bool: "boolean", int: "integer", float: "number", str: "string", list: "array",
                                     dict: "object"}.get(type(v), type(v).__name__)


def _int(body: dict, name: str, lo: int, hi: int = INT32_MAX) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise invalid(name, f"{name}: expected an integer, got {_type_name(v)} {json.dumps(v)}")
    if v < lo or (hi is not None and v > hi):
        raise invalid(name, f"{name} = {v}: expected {lo}..{hi}")
    return v


def _number(body: dict, name: str, lo: float, hi: float, lo_open: bool = False) -> float | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise invalid(name, f"{name}: expected a number, got {_type_name(v)} {json.dumps(v)}")
    if v > hi or v < lo or (lo_open and v == lo):
        raise invalid(name, f"{name} = {v}: expected {'>' if lo_open else '≥'} {lo:g} and ≤ {hi:g}")
    return float(v)


def _stop(body: dict) -> tuple[str, ...]:
    v = body.get("stop")
    if v is None:
        return ()
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise invalid("stop", f"stop: expected a string or an array of strings, got {json.dumps(v)[:80]}")
    try:
        check_stop(stops)
    except ConfigError as e:
        raise invalid("stop", str(e)) from None
    return tuple(stops)


def _same(value, neutral) -> bool:
    """``value`` is ``neutral``: null only as null, booleans only as booleans, numbers by value (0 and 0.0)."""
    if value is None or neutral is None:
        return value is neutral
    if isinstance(value, bool) or isinstance(neutral, bool):
        return type(value) is type(neutral) and value == neutral
    return value == neutral


def _check_fields(body: dict, allowed: frozenset) -> None:
    for name, value in body.items():
        if name in allowed:
            continue
        if name not in NEUTRAL:
            raise invalid(name, f"unrecognized request argument {name!r} (served: {', '.join(sorted(allowed))})",
                          "unknown_parameter")
        if not any(_same(value, ok) for ok in NEUTRAL[name]):
            shown = ", ".join("null" if ok is None else json.dumps(ok) for ok in NEUTRAL[name])
            raise invalid(name, f"{name} = {json.dumps(value)[:80]}: not supported by this server (accepted: {shown})",
                          "unsupported_parameter")


def _common(body: dict, kind: str, allowed: frozenset) -> dict:
    _check_fields(body, allowed)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("model", f"model: expected the model's name (a string), got {_type_name(model)}")
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise invalid("stream", f"stream: expected a boolean, got {_type_name(stream)}")
    opts = body.get("stream_options")
    include_usage = False
    if opts is not None:
        if not stream:
            raise invalid("stream_options", "stream_options: only allowed when stream is true")
        if not isinstance(opts, dict) or set(opts) - {"include_usage", "continuous_usage_stats"}:
            raise invalid("stream_options", f"stream_options: expected {{\"include_usage\": bool}}, got {json.dumps(opts)[:80]}")
        include_usage = opts.get("include_usage", False)
        if not isinstance(include_usage, bool):
            raise invalid("stream_options", "stream_options.include_usage: expected a boolean")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise invalid("user", f"user: expected a string, got {_type_name(user)}")
    return dict(kind=kind, model=model, max_tokens=_int(body, "max_tokens", 1),
                temperature=_number(body, "temperature", 0.0, 2.0), top_p=_number(body, "top_p", 0.0, 1.0, lo_open=True),
                top_k=_int(body, "top_k", 0), seed=_int(body, "seed", 0, SEED_MAX), stop=_stop(body),
                stream=bool(stream), include_usage=include_usage, num_draft_tokens=_int(body, "num_draft_tokens", 0))


def _content(i: int, content) -> str:
    """A message's content: a string, or an array of text parts (joined)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) for p in content):
        texts = []
        for p in content:
            if p.get("type") != "text" or not isinstance(p.get("text"), str):
                raise invalid(f"messages[{i}].content", f"messages[{i}].content: only text parts are served, "
                              f"got a part of type {p.get('type')!r}")
            texts.append(p["text"])
        return "".join(texts)
    raise invalid(f"messages[{i}].content", f"messages[{i}].content: expected a string or an array of text parts, "
                  f"got {_type_name(content)}")


def parse_chat(body: dict) -> GenerationRequest:
    """Check a ``/v1/chat/completions`` body. Messages come back as ``{"role", "content": str}`` with the
    ``developer`` role read as ``system``.

    Raises:
        APIError: 400 naming the field that is missing, of the wrong type, out of range or not served.
    """
    fields = _common(body, "chat", CHAT_FIELDS)
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise invalid("messages", f"messages: expected a non-empty array of messages, got {_type_name(msgs)}")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise invalid(f"messages[{i}]", f"messages[{i}]: expected an object, got {_type_name(m)}")
        extra = set(m) - {"role", "content", "name"}
        if extra:
            raise invalid(f"messages[{i}]", f"messages[{i}]: field {sorted(extra)[0]!r} not served (tools are not)")
        role = CHAT_ROLES.get(m.get("role"))
        if role is None:
            raise invalid(f"messages[{i}].role", f"messages[{i}].role = {json.dumps(m.get('role'))}: expected one of "
                          f"{', '.join(CHAT_ROLES)}")
        out.append({"role": role, "content": _content(i, m.get("content"))})
    mct = _int(body, "max_completion_tokens", 1)
    if mct is not None:
        if fields["max_tokens"] not in (None, mct):  # OpenAI's reference defines no precedence: refuse, as for seed
            raise invalid("max_tokens", f"max_tokens = {fields['max_tokens']} and max_completion_tokens = "
                          f"{mct}: two different limits (max_tokens is the deprecated name of max_completion_tokens: "
                          "give one)")
        fields["max_tokens"], fields["max_tokens_param"] = mct, "max_completion_tokens"
    return GenerationRequest(messages=tuple(out), **fields)


def parse_completion(body: dict) -> GenerationRequest:
    """Check a ``/v1/completions`` body (``prompt``: a non-empty string, or an array of exactly one).

    Raises:
        APIError: 400 naming the field that is missing, of the wrong type, out of range or not served.
    """
    fields = _common(body, "completion", COMPLETION_FIELDS)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        raise invalid("prompt", f"prompt: {len(prompt)} prompts in one request; this server takes one")
    if not isinstance(prompt, str):
        raise invalid("prompt", f"prompt: expected a string (token-id prompts are not served), got {_type_name(prompt)}")
    if not prompt:
        raise invalid("prompt", "prompt: empty")
    if fields["max_tokens"] is None:
        fields["max_tokens"] = COMPLETION_DEFAULT_MAX_TOKENS
    return GenerationRequest(prompt=prompt, **fields)


def default_max_tokens(prompt_tokens: int, max_seq_len: int, max_draft_len: int, limit: int) -> int:
    """max_tokens of a chat request that names none: what fits in the engine's sequence beside the prompt and one
    cycle's draft tokens (the engine's rule: prompt + max_tokens + k + 1 ≤ max_seq_len), at most ``limit``, at least 1
    (a prompt too long then gets the engine's own error)."""
    return max(1, min(limit, max_seq_len - prompt_tokens - max_draft_len - 1))


# -------------------------------------------------------------------------------------------------
# Shaping answers
# -------------------------------------------------------------------------------------------------


def response_id(kind: str) -> str:
    """``chatcmpl-…`` (chat) or ``cmpl-…`` (completions), unique per request."""
    return f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"


def usage(answer: dict) -> dict:
    """OpenAI's ``usage`` from the ensemble's folded outputs (``num_input_tokens``, ``num_output_tokens``, and the
    speculation figures as extension fields)."""
    p, c = int(answer.get("num_input_tokens") or 0), int(answer.get("num_output_tokens") or 0)
    out = {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}
    if answer.get("acceptance_length") is not None:
        out["acceptance_length"] = round(float(answer["acceptance_length"]), 4)
    if answer.get("accepted_per_position") is not None:
        out["accepted_per_position"] = [int(v) for v in answer["accepted_per_position"]]
    return out


def finish_reason(reason: str | None) -> str | None:
    """The ensemble's finish reason in OpenAI's terms (``stop`` and ``length`` are the same words)."""
    return {"stop": "stop", "length": "length"}.get(reason or "", reason)


def _head(kind: str, rid: str, created: int, model: str, chunk: bool = False) -> dict:
    obj = {"chat": "chat.completion.chunk" if chunk else "chat.completion", "completion": "text_completion"}[kind]
    return {"id": rid, "object": obj, "created": created, "model": model}


def answer(req: GenerationRequest, rid: str, created: int, text: str, reason: str | None, use: dict) -> dict:
    """The whole answer of a non-streaming request."""
    if req.kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": finish_reason(reason)}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason(reason)}
    return {**_head(req.kind, rid, created, req.model), "choices": [choice], "usage": use}


def chunk(req: GenerationRequest, rid: str, created: int, text: str | None = None, reason: str | None = None,
          role: bool = False) -> dict:
    """One stream chunk: a chat ``delta`` (``role`` on the first, then ``content``) or a completion ``text``, with
    ``finish_reason`` on the last. With ``include_usage``, every chunk carries ``"usage": null`` (OpenAI's rule)."""
    if req.kind == "chat":
        delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason(reason)}
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason(reason)}
    out = {**_head(req.kind, rid, created, req.model, chunk=True), "choices": [choice]}
    if req.include_usage:
        out["usage"] = None
    return out


def usage_chunk(req: GenerationRequest, rid: str, created: int, use: dict) -> dict:
    """The last chunk of a stream with ``include_usage``: no choices, the request's usage."""
    return {**_head(req.kind, rid, created, req.model, chunk=True), "choices": [], "usage": use}


def sse(obj: dict) -> str:
    """One server-sent event carrying ``obj`` as JSON (UTF-8 text kept as is)."""
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


def models_list(name: str, created: int) -> dict:
    """``GET /v1/models``: the one served model."""
    return {"object": "list", "data": [{"id": name, "object": "model", "created": created, "owned_by": "splitspec"}]}
