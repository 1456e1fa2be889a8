"""The tokenizer as the server and the CLI use it: :class:`ChatTokenizer` over a tokenizer folder.

The folder holds the files Hugging Face's ``PreTrainedTokenizerFast`` reads: ``tokenizer.json`` and
``tokenizer_config.json`` (special tokens, chat template). :class:`ChatTokenizer` encodes, decodes, renders
the chat template (jinja2's immutable sandbox, configured the way transformers configures it) and gives
the stop ids. The constants below are the Kimi-K2-style special tokens and chat template the demo's
tokenizer is written with (:mod:`splitspec.demo.tokenizer_train`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from splitspec.errors import CheckpointError, ConfigError

BOS_TOKEN = "[BOS]"
EOS_TOKEN = "[EOS]"
IM_END_TOKEN = "<|im_end|>"
IM_USER_TOKEN = "<|im_user|>"
IM_ASSISTANT_TOKEN = "<|im_assistant|>"
IM_SYSTEM_TOKEN = "<|im_system|>"
IM_MIDDLE_TOKEN = "<|im_middle|>"
UNK_TOKEN = "[UNK]"
PAD_TOKEN = "[PAD]"

#: Special tokens in vocabulary order; they take the last ``len(SPECIAL_TOKENS)`` ids.
SPECIAL_TOKENS: tuple[str, ...] = (
    BOS_TOKEN,
    EOS_TOKEN,
    IM_END_TOKEN,
    IM_USER_TOKEN,
    IM_ASSISTANT_TOKEN,
    IM_SYSTEM_TOKEN,
    IM_MIDDLE_TOKEN,
    UNK_TOKEN,
    PAD_TOKEN,
)

DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant."
MODEL_MAX_LENGTH = 4096

#: Kimi-style chat template: ``<|im_{role}|>{role}<|im_middle|>{content}<|im_end|>`` per message,
#: a default system message when none leads, and the assistant header as generation prompt.
CHAT_TEMPLATE = (
    "{%- if messages|length == 0 or messages[0]['role'] != 'system' -%}"
    "<|im_system|>system<|im_middle|>" + DEFAULT_SYSTEM_PROMPT + "<|im_end|>"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] -%}"
    "{{ raise_exception('unsupported chat role: ' ~ message['role']) }}"
    "{%- endif -%}"
    "<|im_{{ message['role'] }}|>{{ message['role'] }}<|im_middle|>{{ message['content'] }}<|im_end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "<|im_assistant|>assistant<|im_middle|>"
    "{%- endif -%}"
)


def _raise_exception(message: str) -> None:
    raise ConfigError(f"chat template: {message}")


def _compile_chat_template(template: str):
    """Compile ``template`` in jinja2's immutable sandbox, configured like transformers does."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: Any = None, sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = _raise_exception
    try:
        return env.from_string(template)
    except jinja2.TemplateError as e:
        raise ConfigError(f"chat_template does not compile: {e}") from e


class ChatTokenizer:
    """A trained tokenizer folder, as the server and the CLI use it.

    Wraps a :class:`tokenizers.Tokenizer` plus the ``tokenizer_config.json`` fields (special
    tokens, chat template). Ids are Python ints in ``[0, vocab_size)``.
    """

    def __init__(self, tokenizer: Any, config: dict[str, Any], source: str = "<memory>") -> None:
        """Wrap a loaded ``tokenizers.Tokenizer`` and its ``tokenizer_config.json`` dict (see :meth:`from_dir`).

        Raises:
            CheckpointError: no chat template, or the BOS/EOS/``<|im_end|>`` tokens are not in the vocabulary.
        """
        self._tok = tokenizer
        self._config = config
        self._source = source
        template = config.get("chat_template")
        if not isinstance(template, str) or not template:
            raise CheckpointError(f"{source}/tokenizer_config.json: field 'chat_template' missing or not a string")
        self._template = _compile_chat_template(template)
        self._ids: dict[str, int] = {}
        for field, default in (("bos_token", BOS_TOKEN), ("eos_token", EOS_TOKEN)):
            token = config.get(field, default)
            if isinstance(token, dict):  # AddedToken serialised form
                token = token.get("content")
            tid = tokenizer.token_to_id(token) if isinstance(token, str) else None
            if tid is None:
                raise CheckpointError(f"{source}/tokenizer_config.json: {field} {token!r} is not in tokenizer.json")
            self._ids[field] = tid
        im_end = tokenizer.token_to_id(IM_END_TOKEN)
        if im_end is None:
            raise CheckpointError(f"{source}/tokenizer.json: token {IM_END_TOKEN!r} missing")
        self._ids["im_end"] = im_end

    @classmethod
    def from_dir(cls, path: Path) -> "ChatTokenizer":
        """Load ``tokenizer.json`` and ``tokenizer_config.json`` from ``path``.

        Raises:
            CheckpointError: a file is missing or malformed (the message names it).
        """
        from tokenizers import Tokenizer

        path = Path(path)
        tok_file = path / "tokenizer.json"
        cfg_file = path / "tokenizer_config.json"
        for f in (tok_file, cfg_file):
            if not f.is_file():
                raise CheckpointError(f"{f}: file missing")
        try:
            tok = Tokenizer.from_file(str(tok_file))
        except Exception as e:  # tokenizers raises a generic Exception on bad JSON
            raise CheckpointError(f"{tok_file}: not a valid tokenizers file ({e})") from e
        try:
            config = json.loads(cfg_file.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{cfg_file}: not valid JSON ({e})") from e
        if not isinstance(config, dict):
            raise CheckpointError(f"{cfg_file}: expected a JSON object")
        return cls(tok, config, source=str(path))

    @property
    def vocab_size(self) -> int:
        """Total number of ids, special tokens included."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token_id(self) -> int:
        """Id of the ``bos_token`` of tokenizer_config.json (``[BOS]``)."""
        return self._ids["bos_token"]

    @property
    def eos_token_id(self) -> int:
        """Id of the ``eos_token`` of tokenizer_config.json (``[EOS]``)."""
        return self._ids["eos_token"]

    @property
    def im_end_id(self) -> int:
        """Id of ``<|im_end|>``, which ends every chat turn."""
        return self._ids["im_end"]

    @property
    def stop_token_ids(self) -> list[int]:
        """Ids that end generation: ``[EOS]`` and ``<|im_end|>``."""
        return [self.eos_token_id, self.im_end_id]

    def token_to_id(self, token: str) -> int | None:
        """Id of ``token``, or None when it is not in the vocabulary."""
        return self._tok.token_to_id(token)

    def encode(self, text: str) -> list[int]:
        """Encode ``text`` to ids; special-token strings in it become their ids, none are added.

        Raises:
            ConfigError: ``text`` is not a str.
        """
        if not isinstance(text, str):
            raise ConfigError(f"text to encode must be a str, got {type(text).__name__}")
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Decode ids to text (special tokens dropped unless ``skip_special_tokens`` is False).

        Raises:
            ConfigError: an id is outside ``[0, vocab_size)``.
        """
        ids = [int(i) for i in ids]
        n = self.vocab_size
        bad = [i for i in ids if i < 0 or i >= n]
        if bad:
            raise ConfigError(f"token ids {bad[:5]} outside the vocabulary [0, {n})")
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """Render ``messages`` (``{"role": system|user|assistant, "content": str}``) as a prompt string.

        Raises:
            ConfigError: a message is not a dict with a known role and str content.
        """
        if not isinstance(messages, list):
            raise ConfigError(f"messages must be a list of dicts, got {type(messages).__name__}")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant"):
                raise ConfigError(f"messages[{i}]: needs 'role' system, user or assistant")
            if not isinstance(m.get("content"), str):
                raise ConfigError(f"messages[{i}]: 'content' must be a str")
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     bos_token=BOS_TOKEN, eos_token=EOS_TOKEN)
