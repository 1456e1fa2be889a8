"""Byte-level BPE tokenizer with Kimi-K2 style chat tokens, trained locally, and its thin runtime wrapper.

:func:`train_tokenizer` trains a byte-level BPE on a corpus every machine has: the Python
standard library's own ``.py`` sources. The special tokens sit at the end of the vocabulary,
as in Kimi-K2 (``[BOS]``, ``[EOS]``, ``<|im_end|>``, ``<|im_user|>``, ``<|im_assistant|>``,
``<|im_system|>``, ``<|im_middle|>``, plus ``[UNK]`` and ``[PAD]``). The files written are the
ones Hugging Face's ``PreTrainedTokenizerFast`` reads: ``tokenizer.json``,
``tokenizer_config.json`` (with the chat template) and ``special_tokens_map.json``.

:class:`ChatTokenizer` is what the server and CLI use: encode, decode, chat-template rendering
(jinja2's immutable sandbox, configured the way transformers configures it) and the stop ids.

:func:`count_token_frequencies` and :func:`select_draft_vocab` pick a drafter's reduced
vocabulary from token frequencies over a corpus.
"""

from __future__ import annotations

import json
import os
import sysconfig
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

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

_SKIP_DIRS = frozenset({"test", "tests", "idlelib", "site-packages"})
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


# --------------------------------------------------------------------------------------------
# Corpus
# --------------------------------------------------------------------------------------------


def stdlib_source_files() -> list[Path]:
    """List the Python standard library's ``.py`` sources in a fixed order.

    Returns:
        Absolute paths under ``sysconfig.get_paths()["stdlib"]``, sorted by their path relative
        to that folder (POSIX form), skipping any file below a folder named ``test``, ``tests``,
        ``idlelib`` or ``site-packages``.

    Raises:
        ConfigError: the standard library folder does not exist or holds no ``.py`` file.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise ConfigError(f"standard library folder {root} (sysconfig 'stdlib') does not exist")
    found: list[tuple[str, Path]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]
        for name in filenames:
            if name.endswith(".py"):
                path = Path(dirpath) / name
                found.append((path.relative_to(root).as_posix(), path))
    if not found:
        raise ConfigError(f"no .py files under the standard library folder {root}")
    found.sort(key=lambda item: item[0])
    return [path for _, path in found]


def stdlib_corpus(max_corpus_bytes: int = 6_000_000) -> list[str]:
    """Read the standard library sources as a training corpus.

    Args:
        max_corpus_bytes: upper bound on the corpus size in UTF-8 bytes; files are taken in
            :func:`stdlib_source_files` order and the last one is cut to fit.

    Returns:
        One string per file (read as UTF-8 with undecodable bytes dropped), in file order; the
        UTF-8 sizes sum to at most ``max_corpus_bytes``.

    Raises:
        ConfigError: ``max_corpus_bytes`` is not positive, or no source could be read.
    """
    if max_corpus_bytes <= 0:
        raise ConfigError(f"max_corpus_bytes must be positive, got {max_corpus_bytes}")
    texts: list[str] = []
    remaining = max_corpus_bytes
    for path in stdlib_source_files():
        try:
            data = path.read_bytes()
        except OSError:
            continue
        text = data.decode("utf-8", errors="ignore")
        raw = text.encode("utf-8")
        if len(raw) > remaining:
            text = raw[:remaining].decode("utf-8", errors="ignore")
            raw = text.encode("utf-8")
        if text:
            texts.append(text)
            remaining -= len(raw)
        if remaining <= 0:
            break
    if not texts:
        raise ConfigError("could not read any standard library source file for the tokenizer corpus")
    return texts


# --------------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------------


def _current_umask() -> int:
    """The process umask (read by setting and restoring it)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _write_json_atomic(path: Path, obj: Any) -> None:
    """Write ``obj`` as JSON to ``path`` through a temporary file in the same folder."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(obj, f, indent=2, ensure_ascii=False)
            f.write("\n")
        os.chmod(tmp, 0o666 & ~_current_umask())  # mkstemp creates 0600
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def tokenizer_config_dict(model_max_length: int = MODEL_MAX_LENGTH) -> dict[str, Any]:
    """Return the ``tokenizer_config.json`` content (special tokens, class, chat template)."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": UNK_TOKEN,
        "additional_special_tokens": [IM_END_TOKEN, IM_USER_TOKEN, IM_ASSISTANT_TOKEN, IM_SYSTEM_TOKEN,
                                      IM_MIDDLE_TOKEN],
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
        "add_bos_token": False,
        "add_eos_token": False,
        "chat_template": CHAT_TEMPLATE,
    }


def special_tokens_map_dict() -> dict[str, Any]:
    """Return the ``special_tokens_map.json`` content."""
    return {
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": UNK_TOKEN,
        "additional_special_tokens": [IM_END_TOKEN, IM_USER_TOKEN, IM_ASSISTANT_TOKEN, IM_SYSTEM_TOKEN,
                                      IM_MIDDLE_TOKEN],
    }


def train_tokenizer(out_dir: Path, vocab_size: int = 4096, max_corpus_bytes: int = 6_000_000) -> None:
    """Train a byte-level BPE tokenizer on the standard library sources and write it to ``out_dir``.

    The BPE part gets ``vocab_size - 9`` entries (256 byte symbols plus merges); the nine
    special tokens of :data:`SPECIAL_TOKENS` then take the last nine ids, so the vocabulary
    has exactly ``vocab_size`` entries. Byte-level pre-tokenizer and decoder: any UTF-8 text
    round-trips through encode/decode. The result depends only on the corpus, so the same
    Python installation gives a byte-identical ``tokenizer.json``.

    Args:
        out_dir: folder to write ``tokenizer.json``, ``tokenizer_config.json`` and
            ``special_tokens_map.json`` into (created if missing; each file is replaced atomically).
        vocab_size: total vocabulary size including the special tokens; a multiple of 8.
        max_corpus_bytes: corpus size bound in UTF-8 bytes (see :func:`stdlib_corpus`).

    Raises:
        ConfigError: ``vocab_size`` is not a multiple of 8 or leaves no room for merges, or the
            corpus is too small to reach ``vocab_size``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    n_special = len(SPECIAL_TOKENS)
    n_bytes = len(pre_tokenizers.ByteLevel.alphabet())
    if vocab_size % 8 != 0:
        raise ConfigError(f"tokenizer vocab_size must be a multiple of 8, got {vocab_size}")
    if vocab_size - n_special <= n_bytes:
        raise ConfigError(f"tokenizer vocab_size {vocab_size} leaves no room for merges "
                          f"({n_bytes} byte symbols + {n_special} special tokens)")
    bpe_size = vocab_size - n_special
    corpus = stdlib_corpus(max_corpus_bytes)

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=bpe_size,
        min_frequency=2,
        show_progress=False,
        special_tokens=[],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus, trainer=trainer, length=len(corpus))
    if tok.get_vocab_size(with_added_tokens=False) != bpe_size:
        raise ConfigError(
            f"tokenizer corpus of {max_corpus_bytes} bytes yields only "
            f"{tok.get_vocab_size(with_added_tokens=False)} BPE entries, need {bpe_size}; "
            "raise max_corpus_bytes or lower vocab_size")
    added = tok.add_special_tokens(list(SPECIAL_TOKENS))
    ids = [tok.token_to_id(t) for t in SPECIAL_TOKENS]
    if added != n_special or ids != list(range(bpe_size, vocab_size)) or tok.get_vocab_size() != vocab_size:
        raise ConfigError(f"special tokens did not land at the end of the vocabulary: ids {ids}, "
                          f"expected {bpe_size}..{vocab_size - 1}")

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tokenizer.json.", suffix=".tmp", dir=out_dir)
    os.close(fd)
    try:
        tok.save(tmp, pretty=True)
        os.chmod(tmp, 0o666 & ~_current_umask())
        os.replace(tmp, out_dir / "tokenizer.json")
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _write_json_atomic(out_dir / "tokenizer_config.json", tokenizer_config_dict())
    _write_json_atomic(out_dir / "special_tokens_map.json", special_tokens_map_dict())


# --------------------------------------------------------------------------------------------
# Draft vocabulary
# --------------------------------------------------------------------------------------------


def count_token_frequencies(tokenizer: "ChatTokenizer", texts: Iterable[str]) -> np.ndarray:
    """Count how often each token id occurs when ``tokenizer`` encodes ``texts``.

    Args:
        tokenizer: the target's tokenizer.
        texts: documents, each encoded on its own without special tokens.

    Returns:
        int64 array of shape [tokenizer.vocab_size]; entry i is the number of occurrences of id i.
    """
    counts = np.zeros(tokenizer.vocab_size, dtype=np.int64)
    batch: list[str] = []

    def flush() -> None:
        for enc in tokenizer._tok.encode_batch(batch, add_special_tokens=False):
            if enc.ids:
                counts[:] += np.bincount(np.asarray(enc.ids, dtype=np.int64), minlength=counts.shape[0])
        batch.clear()

    for text in texts:
        batch.append(text)
        if len(batch) >= 256:
            flush()
    if batch:
        flush()
    return counts


def select_draft_vocab(counts: np.ndarray, draft_vocab_size: int,
                       always_include: Sequence[int] = ()) -> np.ndarray:
    """Pick a drafter's reduced vocabulary: the most frequent target ids.

    Ids in ``always_include`` are taken first; the rest are filled by descending count, ties
    broken by the lower id.

    Args:
        counts: int array [vocab_size], occurrences per target id (see :func:`count_token_frequencies`).
        draft_vocab_size: number of ids to keep, ``len(always_include) <= draft_vocab_size <= vocab_size``.
        always_include: target ids that must be in the draft vocabulary (e.g. the stop tokens).

    Returns:
        int64 array [draft_vocab_size] of distinct target ids in ascending order; draft id i
        stands for target id ``result[i]``.

    Raises:
        ConfigError: sizes out of range or an id of ``always_include`` outside the vocabulary.
    """
    counts = np.asarray(counts)
    vocab_size = counts.shape[0]
    required = sorted(set(int(i) for i in always_include))
    if any(i < 0 or i >= vocab_size for i in required):
        raise ConfigError(f"always_include ids {required} must lie in [0, {vocab_size})")
    if not len(required) <= draft_vocab_size <= vocab_size:
        raise ConfigError(f"draft_vocab_size {draft_vocab_size} must lie in [{len(required)}, {vocab_size}]")
    # Stable sort on -count keeps ascending ids among equal counts.
    order = np.argsort(-counts.astype(np.int64), kind="stable")
    chosen = set(required)
    for i in order:
        if len(chosen) >= draft_vocab_size:
            break
        chosen.add(int(i))
    return np.array(sorted(chosen), dtype=np.int64)


# --------------------------------------------------------------------------------------------
# Runtime wrapper
# --------------------------------------------------------------------------------------------


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
