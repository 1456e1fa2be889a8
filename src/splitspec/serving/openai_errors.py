"""OpenAI's error object for the front end: :class:`APIError` (an HTTP status plus ``{"error": {"message", "type",
"param", "code"}}``, as OpenAI's API reference, "Error codes", shapes it) and the errors the front end answers
besides its own request checks (:mod:`splitspec.serving.openai_schema`): the ensemble's error responses mapped to
statuses, with ``param`` named where the message names an input (:func:`with_param`), an unreachable server, an
unknown model.
"""

from __future__ import annotations

import re
from typing import Protocol

from splitspec.errors import SplitspecError


class FieldNames(Protocol):
    """What :func:`with_param` reads of a request (:class:`splitspec.serving.openai_schema.GenerationRequest`):
    ``kind`` ("chat" or "completion") and ``max_tokens_param`` (the field its max_tokens came in)."""

    kind: str
    max_tokens_param: str


class APIError(SplitspecError):
    """An error answered to the client: HTTP ``status`` and OpenAI's error object; ``close``: end the connection after
    the answer (a refusal while reading the body, the rest of it unread)."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, close: bool = False):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.close = close

    def body(self) -> dict:
        """``{"error": {"message", "type", "param", "code"}}``."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid(param: str | None, message: str, code: str | None = None) -> APIError:
    """A 400 ``invalid_request_error`` about field ``param``."""
    return APIError(400, message, "invalid_request_error", param, code)


def ensemble_error(message: str) -> APIError:
    """The API error for an error response of the ensemble (a gRPC stream carries its text only, not its code): a
    failed or unloaded engine (``spec_decode: generation failed``, whatever the failure's own text says; a model not
    ready or unknown, a Python backend's stub process not healthy) or a full queue (``server busy``) → 503 ``service_unavailable``; the models' internal errors,
    among them a request that failed alone while the engine serves on (``spec_decode: internal error in this
    request``, e.g. NaN logits) → 500 ``server_error``; anything else is a bad request → 400
    (``context_length_exceeded`` when the prompt and max_tokens do not fit the engine's max_seq_len), its ``param``
    filled in by :func:`with_param` once the request is known."""
    low = message.lower()
    named = _NAMED.search(message)
    if named is not None and message.startswith("generation failed", named.start(1)):
        return APIError(503, message, "service_unavailable", None, "service_unavailable")
    if "internal error" in low:
        return APIError(500, message, "server_error", None, "internal_error")
    if any(s in low for s in ("generation failed", "not ready", "unknown model", "unavailable", "engine stopped",
                              "server busy", "is not healthy")):  # the last: Triton's word for a dead Python stub
        return APIError(503, message, "service_unavailable", None, "service_unavailable")
    return invalid(None, message, "context_length_exceeded" if "max_seq_len" in message else None)


#: Ensemble inputs the front end sets → the request field each comes from (the prompt's: ``prompt`` or ``messages``).
_FIELD_OF_INPUT = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "seed": "seed", "stop": "stop",
                   "num_draft_tokens": "num_draft_tokens", "max_tokens": None, "text_input": None, "prompt": None}
#: The first word of a model's message (``in ensemble 'ensemble', spec_decode: max_tokens = 0: ...``): the input it
#: names, as the models' messages begin (splitspec.serving.requests, the engine's request checks).
_NAMED = re.compile(r"\b(?:preprocessing|spec_decode|postprocessing): (\w+)")


def with_param(e: APIError, req: FieldNames) -> APIError:
    """``e``, an :func:`ensemble_error` answered to ``req``, with ``param`` set to the request field its message
    names, where the error is a 400 and the first word after the model's name is an input the front end sets:
    ``max_tokens`` → the field it came in (:attr:`GenerationRequest.max_tokens_param`), ``text_input`` and ``prompt``
    (the engine's context-length check) → ``messages`` (chat) or ``prompt``, as OpenAI names the field of its own
    ``context_length_exceeded``; the sampling fields, ``stop`` and ``num_draft_tokens`` → themselves."""
    m = _NAMED.search(e.message)
    if e.status != 400 or e.param is not None or m is None or m.group(1) not in _FIELD_OF_INPUT:
        return e
    name = m.group(1)
    e.param = (_FIELD_OF_INPUT[name] or (req.max_tokens_param if name == "max_tokens" else
                                         "messages" if req.kind == "chat" else "prompt"))
    return e


def unavailable(message: str) -> APIError:
    """503: the Triton server cannot be reached."""
    return APIError(503, f"the inference server is unavailable: {message}", "service_unavailable", None,
                    "service_unavailable")


def unknown_model(name: str, served: str) -> APIError:
    """404 for a model this server does not serve."""
    return APIError(404, f"the model {name!r} does not exist (served: {served!r})", "invalid_request_error", "model",
                    "model_not_found")
