"""How big a request tritonserver 2.51 takes, and the one limit of its front ends that this project sets.

Measured on the server ``nvidia-pytriton`` 0.7.0 installs (tritonserver 2.51, ``tritonserver --help``):

- HTTP: no option bounds a request body (``--http-max-input-size`` came in a later release); a 70 MB JSON body is
  read whole. Its HTTP library (libevhtp) parses a body sent as ``application/x-www-form-urlencoded`` — ``curl
  -d``'s default — as a query string before any handler runs, copying it twice onto the stack of the HTTP thread
  (``evhtp_parse_query_wflags``). With glibc's default thread stack (the 8 MiB RLIMIT_STACK) a single ~8 MB request
  of that type killed the server with SIGSEGV; a JSON-typed body of any size did not.
- gRPC: the receive limit is fixed at 2 GiB (``SetMaxMessageSize(INT32_MAX)`` in its gRPC server); no option.

So the stack size of tritonserver's threads is the limit that decides whether a body crashes the server:
:func:`server_stack_bytes` sizes it so that every request carrying a prompt the models accept
(``max_prompt_bytes``, :class:`~splitspec.settings.ServeConfig`) is parsed safely, and never below
:data:`SERVER_STACK_MIN_BYTES`. A larger body is refused by preprocessing before tokenising (``text_input``: N bytes,
at most M). A form-typed body larger than about half the stack still crashes tritonserver 2.51 on its own port, and
so does JSON nested a million deep (its parser recurses per level): its HTTP port is therefore private, behind the
HTTP guard (below). Reserving the stack costs address space, not memory: only the
pages a thread touches are backed.

The HTTP guard in front of tritonserver's HTTP port (:mod:`splitspec.serving.http_guard`) and the OpenAI-compatible
front end, both run by this project, bound their bodies by the same measure (:func:`repo_body_limit`,
:func:`request_body_limit`) before passing them on: no body of any type that reaches tritonserver's HTTP port through
them is larger than its stack is sized for.
"""

from __future__ import annotations

import contextlib
import resource
from pathlib import Path

from splitspec.serving.repo import repo_setting

#: Smallest stack of tritonserver's threads: form-typed bodies up to ~31 MiB are parsed safely.
SERVER_STACK_MIN_BYTES = 64 << 20
#: Bytes of JSON per prompt byte at worst (a control character escaped as ``\u0000``).
JSON_BYTES_PER_PROMPT_BYTE = 6
#: A request's JSON beside its prompt (other inputs, keys), at most.
JSON_OVERHEAD_BYTES = 64 << 10
#: Seconds a request's whole body may take to arrive, in the HTTP guard and the OpenAI front end alike: the largest
#: body (a few hundred KiB to some MiB) takes well under a second on any working link; a client that sent its headers
#: and stalls would otherwise hold its request open for good.
BODY_TIMEOUT_S = 30.0
#: Seconds a client connection may take to send a whole request head (request line and headers), from its opening
#: or from its previous answer (keep-alive), in the HTTP guard and the OpenAI front end alike; a request in flight is
#: never cut by it.
HEADER_TIMEOUT_S = 10.0
#: Client connections each of those front ends holds at once; one more is closed as soon as it is accepted.
MAX_CONNECTIONS = 1024


def request_body_limit(max_prompt_bytes: int) -> int:
    """The largest JSON body a request whose prompt has at most ``max_prompt_bytes`` UTF-8 bytes can take, in bytes:
    every prompt byte escaped (:data:`JSON_BYTES_PER_PROMPT_BYTE`) plus :data:`JSON_OVERHEAD_BYTES` for the rest. A
    longer body cannot carry a prompt the models accept; the OpenAI front end refuses it before reading it."""
    return JSON_BYTES_PER_PROMPT_BYTE * max_prompt_bytes + JSON_OVERHEAD_BYTES


def too_large_message(what: str, limit: int, max_prompt_bytes: int | None) -> str:
    """One line for a body over ``limit`` bytes; ``what``: e.g. ``request body of N bytes``."""
    why = (f"the largest JSON a prompt of max_prompt_bytes = {max_prompt_bytes} can take" if max_prompt_bytes
           else "the largest body tritonserver's thread stack is sized for")
    return f"{what} exceeds the limit of {limit} bytes ({why})"


def repo_max_prompt_bytes(repo: Path) -> int | None:
    """The repository's ``max_prompt_bytes`` (preprocessing's parameter); None when it names none."""
    prompt = (repo_setting(repo, "preprocessing", "max_prompt_bytes") or "").strip()
    return int(prompt) if prompt.isdigit() else None


def repo_body_limit(repo: Path) -> int:
    """The largest HTTP body passed to tritonserver serving ``repo``, in bytes: :func:`request_body_limit` of its
    ``max_prompt_bytes``; for a repository that names none, the largest body :data:`SERVER_STACK_MIN_BYTES` is sized
    for (:func:`server_stack_bytes`: twice the body plus 1 MiB)."""
    prompt = repo_max_prompt_bytes(repo)
    return request_body_limit(prompt) if prompt is not None else (SERVER_STACK_MIN_BYTES - (1 << 20)) // 2


def server_stack_bytes(repo: Path) -> int:
    """RLIMIT_STACK for tritonserver serving ``repo``: twice the largest body a request whose prompt has the
    repository's ``max_prompt_bytes`` (preprocessing's parameter) can take in JSON (:func:`request_body_limit`), plus
    1 MiB; at least :data:`SERVER_STACK_MIN_BYTES`."""
    prompt = repo_max_prompt_bytes(repo)
    body = request_body_limit(prompt) if prompt is not None else 0
    return max(SERVER_STACK_MIN_BYTES, 2 * body + (1 << 20))


@contextlib.contextmanager
def stack_limit(n_bytes: int):
    """Set this process's soft RLIMIT_STACK to ``n_bytes`` (at most the hard limit; an unlimited one too, for which
    glibc would pick its own thread stack size) while the processes it starts inherit it; restored after."""
    soft, hard = resource.getrlimit(resource.RLIMIT_STACK)
    want = n_bytes if hard == resource.RLIM_INFINITY else min(n_bytes, hard)
    if soft != resource.RLIM_INFINITY and soft >= want:
        yield
        return
    resource.setrlimit(resource.RLIMIT_STACK, (want, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_STACK, (soft, hard))
