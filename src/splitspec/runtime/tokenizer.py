"""The tokenizer as the server and the CLI use it: :class:`ChatTokenizer` over a tokenizer folder.

A model folder is data: the tokenizer is read from files, and no Python module shipped in the folder is run.
Two forms are read (docs/formats.md#tokenizer-folders):

- ``tokenizer.json`` (Hugging Face ``tokenizers``, what ``PreTrainedTokenizerFast`` reads): the demo's trained BPE;
- ``tiktoken.model`` (Kimi-K2 / K2.5): tiktoken BPE ranks with the special tokens of ``added_tokens_decoder``
  (:mod:`splitspec.runtime.tiktoken_folder`).

Either way ``tokenizer_config.json`` gives the special tokens and the chat template (a ``chat_template.jinja``
beside it takes precedence, as in transformers' ``from_pretrained``). A folder whose tokenizer exists only as
Python code (``auto_map.AutoTokenizer`` naming ``tokenization_*.py``) is refused unless the deployment opts in
with ``trust_remote_code``, which loads it through transformers' ``AutoTokenizer``. :class:`ChatTokenizer`
encodes, decodes, renders the chat template (jinja2's immutable sandbox, configured the way transformers
configures it) and gives the stop ids. The constants below are the Kimi-K2-style special tokens and chat
template the demo's tokenizer is written with (:mod:`splitspec.demo.tokenizer_train`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from splitspec.errors import CheckpointError, ConfigError
from splitspec.files import read_json
from splitspec.runtime.tiktoken_folder import TiktokenFolder

TOKENIZER_JSON = "tokenizer.json"
TIKTOKEN_MODEL = "tiktoken.model"
TOKENIZER_CONFIG = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
GENERATION_CONFIG = "generation_config.json"

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


class _TokenizerJson:
    """``tokenizer.json`` through the ``tokenizers`` library, with :class:`TiktokenFolder`'s interface."""

    def __init__(self, tok: Any) -> None:
        self.tok = tok

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self.tok.token_to_id(token)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self.tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)


class _RemoteCode:
    """A tokenizer loaded by transformers' ``AutoTokenizer`` with ``trust_remote_code`` (opt-in only)."""

    def __init__(self, tok: Any) -> None:
        self.tok = tok

    @property
    def vocab_size(self) -> int:
        return len(self.tok)

    def token_to_id(self, token: str) -> int | None:
        tid = self.tok.convert_tokens_to_ids(token)
        if tid is None or (tid == self.tok.unk_token_id and token != self.tok.unk_token):
            return None
        return int(tid)

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False))

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)


def tokenizer_file(folder: Path) -> str | None:
    """The tokenizer file a folder is read from: ``tokenizer.json``, else ``tiktoken.model``; None without one."""
    for name in (TOKENIZER_JSON, TIKTOKEN_MODEL):
        if (Path(folder) / name).is_file():
            return name
    return None


def has_tokenizer(folder: Path) -> bool:
    """Whether ``folder`` holds tokenizer files (``tokenizer.json``, ``tiktoken.model`` or ``tokenizer_config.json``);
    :meth:`ChatTokenizer.from_dir` then loads them or says what is wrong."""
    return tokenizer_file(folder) is not None or (Path(folder) / TOKENIZER_CONFIG).is_file()


def read_tokenizer_config(folder: Path) -> dict[str, Any]:
    """``folder/tokenizer_config.json`` as a dict. Raises CheckpointError naming the file when it is missing or
    not a JSON object."""
    return read_json(Path(folder) / TOKENIZER_CONFIG, "the tokenizer's special tokens and chat template")


def remote_tokenizer_class(config: dict[str, Any]) -> str | None:
    """``auto_map.AutoTokenizer``'s class (``"tokenization_kimi.TikTokenTokenizer"``), or None."""
    entry = (config.get("auto_map") or {}).get("AutoTokenizer") if isinstance(config.get("auto_map"), dict) else None
    if isinstance(entry, (list, tuple)):
        entry = next((e for e in entry if e), None)
    return entry if isinstance(entry, str) and entry else None


def _chat_template(folder: Path, config: dict[str, Any]) -> Any:
    """``chat_template.jinja`` when present (it wins, as in transformers), else the config's ``chat_template``
    (a string, or a list of ``{"name", "template"}`` whose ``default`` is taken)."""
    path = Path(folder) / CHAT_TEMPLATE_FILE
    if path.is_file():
        try:
            return path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{path}: cannot be read as UTF-8 text ({e})") from None
    template = config.get("chat_template")
    if isinstance(template, list):
        template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"), None)
    return template


def _generation_stop_ids(folder: Path) -> list[int]:
    """``eos_token_id`` (an id or a list) of ``generation_config.json``; [] without the file or field."""
    path = Path(folder) / GENERATION_CONFIG
    if not path.is_file():
        return []
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None
    ids = raw.get("eos_token_id") if isinstance(raw, dict) else None
    ids = [] if ids is None else ids if isinstance(ids, list) else [ids]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise CheckpointError(f"{path}: field 'eos_token_id' = {raw.get('eos_token_id')!r}, expected a token id or a list of them")
    return ids


def _token_text(token: Any) -> Any:
    """A special token as tokenizer_config.json gives it: a string or an AddedToken object's ``content``."""
    return token.get("content") if isinstance(token, dict) else token


class ChatTokenizer:
    """A tokenizer folder, as the server and the CLI use it.

    Wraps a tokenizer (``tokenizer.json``, ``tiktoken.model``, or opt-in remote code) plus the
    ``tokenizer_config.json`` fields (special tokens, chat template). Ids are Python ints in ``[0, vocab_size)``.
    """

    def __init__(self, tokenizer: Any, config: dict[str, Any], source: str = "<memory>",
                 chat_template: Any = None, extra_stop_ids: Sequence[int] = ()) -> None:
        """Wrap a loaded tokenizer (``vocab_size``, ``token_to_id``, ``encode``, ``encode_batch``, ``decode``; see
        :meth:`from_dir`) and its ``tokenizer_config.json`` dict. ``chat_template``: the template (default: the
        config's); ``extra_stop_ids``: more ids that end generation (generation_config.json's ``eos_token_id``).

        Raises:
            CheckpointError: no chat template, the BOS/EOS/``<|im_end|>`` tokens are not in the vocabulary, or a
                stop id is outside it.
        """
        self._tok = tokenizer
        self._config = config
        self._source = source
        template = config.get("chat_template") if chat_template is None else chat_template
        if not isinstance(template, str) or not template:
            raise CheckpointError(f"{source}/{TOKENIZER_CONFIG}: field 'chat_template' missing or not a string "
                                  f"(and no {CHAT_TEMPLATE_FILE})")
        self._template = _compile_chat_template(template)
        self._ids: dict[str, int] = {}
        self._names: dict[str, str] = {}
        for field, default in (("bos_token", BOS_TOKEN), ("eos_token", EOS_TOKEN)):
            token = _token_text(config.get(field, default))
            tid = tokenizer.token_to_id(token) if isinstance(token, str) else None
            if tid is None:
                raise CheckpointError(f"{source}/{TOKENIZER_CONFIG}: field '{field}' = {token!r} is not in the vocabulary")
            self._ids[field], self._names[field] = tid, token
        im_end = tokenizer.token_to_id(IM_END_TOKEN)
        if im_end is None:
            raise CheckpointError(f"{source}: token {IM_END_TOKEN!r} missing from the vocabulary")
        self._ids["im_end"] = im_end
        bad = [i for i in extra_stop_ids if i >= tokenizer.vocab_size]
        if bad:
            raise CheckpointError(f"{source}/{GENERATION_CONFIG}: field 'eos_token_id' {bad} outside the vocabulary "
                                  f"[0, {tokenizer.vocab_size})")
        self._stop = list(dict.fromkeys([self._ids["eos_token"], im_end, *extra_stop_ids]))

    @classmethod
    def from_dir(cls, path: Path, trust_remote_code: bool = False) -> "ChatTokenizer":
        """Load the tokenizer of folder ``path``: ``tokenizer.json``, else ``tiktoken.model``, plus
        ``tokenizer_config.json`` (and ``chat_template.jinja``, ``generation_config.json`` when present).

        ``trust_remote_code``: where ``tokenizer_config.json``'s ``auto_map`` names a Python tokenizer class, load
        it with transformers' ``AutoTokenizer`` (which imports and runs that module) instead. Off, such code is
        never run.

        Raises:
            CheckpointError: no tokenizer file, or a file missing or malformed (the message names it).
        """
        path = Path(path)
        kind = tokenizer_file(path)
        if kind is None and not (path / TOKENIZER_CONFIG).is_file():
            raise CheckpointError(f"{path}: no tokenizer: neither {TOKENIZER_JSON} nor {TIKTOKEN_MODEL} is there")
        config = read_tokenizer_config(path)
        remote = remote_tokenizer_class(config)
        if trust_remote_code and remote:
            tok: Any = _load_remote_code(path)
        elif kind == TOKENIZER_JSON:
            from tokenizers import Tokenizer

            try:
                tok = _TokenizerJson(Tokenizer.from_file(str(path / TOKENIZER_JSON)))
            except Exception as e:  # tokenizers raises a generic Exception on bad JSON
                raise CheckpointError(f"{path / TOKENIZER_JSON}: not a valid tokenizers file ({e})") from None
        elif kind == TIKTOKEN_MODEL:
            tok = TiktokenFolder(path, config)
        elif remote:
            raise CheckpointError(
                f"{path / TOKENIZER_CONFIG}: field 'auto_map.AutoTokenizer' = {remote!r} names Python code, and there is "
                f"no {TOKENIZER_JSON} or {TIKTOKEN_MODEL}; a model folder is read as data and its code is not run "
                "(pass --trust-remote-code to load it with transformers' AutoTokenizer)")
        else:
            raise CheckpointError(f"{path}: no tokenizer: neither {TOKENIZER_JSON} nor {TIKTOKEN_MODEL} is there")
        return cls(tok, config, source=str(path), chat_template=_chat_template(path, config),
                   extra_stop_ids=_generation_stop_ids(path))

    @property
    def vocab_size(self) -> int:
        """Total number of ids, special tokens included."""
        return self._tok.vocab_size

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
        """Ids that end generation: ``eos_token`` (``[EOS]``), ``<|im_end|>`` and generation_config.json's
        ``eos_token_id``."""
        return list(self._stop)

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
        return self._tok.encode(text)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """:meth:`encode` of each text (in parallel where the library can)."""
        return self._tok.encode_batch(texts)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Decode ids to text (special tokens dropped unless ``skip_special_tokens`` is False). An incomplete
        UTF-8 character at the end decodes to U+FFFD.

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
                                     bos_token=self._names["bos_token"], eos_token=self._names["eos_token"])


def _load_remote_code(path: Path) -> _RemoteCode:
    """transformers' ``AutoTokenizer`` over ``path`` with ``trust_remote_code=True``, local files only."""
    try:
        from transformers import AutoTokenizer

        return _RemoteCode(AutoTokenizer.from_pretrained(str(path), trust_remote_code=True, local_files_only=True))
    except Exception as e:  # whatever the folder's own code raises
        raise CheckpointError(f"{path}: transformers' AutoTokenizer (trust_remote_code) failed: "
                              f"{type(e).__name__}: {' '.join(str(e).split())}") from None
