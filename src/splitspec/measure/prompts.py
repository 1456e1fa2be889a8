"""Prompt files: the one reader for ``generate``, ``tune``, ``perf``, ``bench`` and the lab scripts, and the
input files the load-testing tools take.

A prompt file (``eval/prompts.jsonl`` is the held-out set) has one prompt per line:

* ``{"prompt": str}``: sent as is; ``"chat": true`` wraps it as one user message in the chat template;
* ``{"messages": [{"role": ..., "content": ...}, ...]}``: one user message is sent as a chat prompt; a
  longer conversation is rendered here with the tokenizer's chat template and sent as text;
* any other line (not starting with ``{``): the prompt's text, with backslash escapes (``\\n``, ``\\t``,
  ``\\uXXXX``) decoded.

``"id"`` names a JSON prompt (default ``line-<n>``). Blank lines are skipped.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from splitspec.errors import ConfigError
from splitspec.files import write_atomic

#: Prompts used when no prompt file is given (code completions and one chat question).
BUILTIN_PROMPTS: tuple[tuple[str, bool], ...] = (
    ("def fibonacci(n):", False),
    ("import os\n\ndef list_python_files(root):\n    \"\"\"Return every .py file under root.\"\"\"\n", False),
    ("class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n", False),
    ("def binary_search(items, target):\n    lo, hi = 0, len(items) - 1\n", False),
    ("How do I read a file line by line in Python?", True),
)


@dataclass(frozen=True)
class Prompt:
    """One prompt.

    Attributes:
        id: identifier from the prompt file (``code-01``) or ``line-<n>``.
        text: ``text_input`` as sent.
        chat: True: the server wraps ``text`` as one user message in the chat template
            (``apply_chat_template``).
    """

    id: str
    text: str
    chat: bool = False


def builtin_prompts() -> list[Prompt]:
    """:data:`BUILTIN_PROMPTS` as prompts (``builtin-1`` …)."""
    return [Prompt(f"builtin-{i + 1}", t, c) for i, (t, c) in enumerate(BUILTIN_PROMPTS)]


def read_prompts(path: Path | None, tokenizer_dir: Path | None = None) -> list[Prompt]:
    """Read a prompt file (the formats are in this module's docstring).

    Args:
        path: the file (None: the built-in prompts, :func:`builtin_prompts`).
        tokenizer_dir: tokenizer folder, ``tokenizer.json`` or ``tiktoken.model`` (only needed for multi-message prompts).
    Raises:
        ConfigError: the file is missing or unreadable, a line is not such an object, holds no prompt, has a
            bad escape, or the file holds no prompts (the message names the file and line).
    """
    if path is None:
        return builtin_prompts()
    path = Path(path)
    if path.exists() and not path.is_file():  # a folder; a FIFO would block the read forever
        raise ConfigError(f"{path}: not a regular file (expected a prompt file)")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise ConfigError(f"{path}: prompt file not found") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot read the prompt file ({e})") from None
    out: list[Prompt] = []
    tok = None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        if not line.lstrip().startswith("{"):
            try:  # backslash escapes (\n, \t, \uXXXX) decoded; other characters kept as they are
                text = line.encode("latin-1", "backslashreplace").decode("unicode_escape")
            except UnicodeDecodeError as e:
                raise ConfigError(f"{where}: bad backslash escape ({e.reason}); write a backslash as \\\\") from None
            out.append(Prompt(f"line-{n}", text))
            continue
        try:
            d = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{where}: not valid JSON ({e.msg})") from None
        pid = str(d.get("id", f"line-{n}"))
        msgs = _messages(d, where)
        if msgs is None:
            out.append(Prompt(pid, d["prompt"], bool(d.get("chat", False))))
        elif len(msgs) == 1 and msgs[0]["role"] == "user":
            out.append(Prompt(pid, msgs[0]["content"], True))
        else:
            tok = tok or _tokenizer(tokenizer_dir, where)
            out.append(Prompt(pid, tok.apply_chat_template(msgs, add_generation_prompt=True), False))
    if not out:
        raise ConfigError(f"{path}: no prompts")
    return out


def _messages(d: dict, where: str) -> list[dict] | None:
    """The checked ``messages`` of a JSON prompt, or None for a checked ``prompt``."""
    if "prompt" in d:
        if not isinstance(d["prompt"], str) or not d["prompt"]:
            raise ConfigError(f"{where}: 'prompt' must be a non-empty string, got {d['prompt']!r}")
        return None
    if "messages" not in d:
        raise ConfigError(f"{where}: expected a non-empty 'prompt' string or 'messages' "
                          "(a list of {\"role\": ..., \"content\": ...})")
    msgs = d["messages"]
    if not isinstance(msgs, list):
        raise ConfigError(f"{where}: 'messages' must be a list of chat messages, got {type(msgs).__name__}")
    if not msgs or not all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                           for m in msgs):
        raise ConfigError(f"{where}: 'messages' must be a non-empty list of {{\"role\": str, \"content\": str}}")
    return msgs


def _tokenizer(tokenizer_dir: Path | None, why: str):
    from splitspec.runtime.tokenizer import ChatTokenizer, has_tokenizer  # loaded only for a prompt that needs it

    if tokenizer_dir is None or not has_tokenizer(Path(tokenizer_dir)):
        raise ConfigError(f"{why}: a multi-message prompt needs the tokenizer (tokenizer_dir = {tokenizer_dir})")
    return ChatTokenizer.from_dir(Path(tokenizer_dir))


def prompt_text(tok, prompt: Prompt, chat: bool = False) -> str:
    """The text the model sees: a chat prompt (or any, with ``chat``) rendered with the chat template."""
    if prompt.chat or chat:
        return tok.apply_chat_template([{"role": "user", "content": prompt.text}], add_generation_prompt=True)
    return prompt.text


def encode_prompt(tok, prompt: Prompt, chat: bool = False) -> list[int]:
    """Token ids of ``prompt`` (see :func:`prompt_text`); special-token strings become their ids."""
    return tok.encode(prompt_text(tok, prompt, chat))


def rendered_text(prompts: Sequence[Prompt], tokenizer_dir: Path) -> list[str]:
    """The text the model sees for each prompt: chat prompts rendered with the tokenizer's chat
    template (special-token strings in it encode to the same ids as ``apply_chat_template``)."""
    tok = None
    out = []
    for p in prompts:
        if p.chat:
            tok = tok or _tokenizer(tokenizer_dir, f"prompt {p.id}")
        out.append(prompt_text(tok, p))
    return out


# --------------------------------------------------------------------------------------------
# Input files of the load-testing tools
# --------------------------------------------------------------------------------------------


def write_input_data(path: Path, prompts: Sequence[Prompt], max_tokens: int, protocol: str = "grpc") -> Path:
    """Write perf_analyzer's ``--input-data`` JSON: one entry per prompt, cycled through in order.

    Requests stream (``stream`` true: one response per engine cycle), as an interactive client would.

    Args:
        max_tokens: output tokens per request.
        protocol: ``grpc``: the ensemble's tensors (``{"text_input": [..], "max_tokens": [..], ...}``);
            ``http``: perf_analyzer's payload form, the JSON body posted to ``generate_stream``.
    """
    if protocol == "grpc":
        data = [{"text_input": [p.text], "max_tokens": [max_tokens], "apply_chat_template": [p.chat], "stream": [True]}
                for p in prompts]
    elif protocol == "http":
        data = [{"payload": [{"text_input": p.text, "max_tokens": max_tokens, "apply_chat_template": p.chat,
                              "stream": True}]} for p in prompts]
    else:
        raise ConfigError(f"protocol = {protocol!r}: expected one of grpc, http")
    write_atomic(Path(path), json.dumps({"data": data}, indent=2, ensure_ascii=False) + "\n")
    return Path(path)


def write_genai_perf_input(path: Path, prompts: Sequence[Prompt], tokenizer_dir: Path, chat_endpoint: bool = False) -> Path:
    """Write genai-perf's ``--input-file`` (JSON lines ``{"text": ...}``); chat prompts are rendered
    here (genai-perf has no per-prompt ``apply_chat_template``). ``chat_endpoint``: for an OpenAI chat endpoint,
    which sends each text as one user message through the chat template: every prompt's own text."""
    texts = [p.text for p in prompts] if chat_endpoint else rendered_text(prompts, tokenizer_dir)
    lines = [json.dumps({"text": t}, ensure_ascii=False) for t in texts]
    write_atomic(Path(path), "\n".join(lines) + "\n")
    return Path(path)
