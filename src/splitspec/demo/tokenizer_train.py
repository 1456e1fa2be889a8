"""Train the demo's byte-level BPE tokenizer, and choose a drafter's reduced vocabulary.

:func:`train_tokenizer` trains a byte-level BPE on a corpus every machine has: the Python standard
library's own ``.py`` sources (:func:`splitspec.demo.corpus.stdlib_corpus`). The special tokens sit at the
end of the vocabulary, as in Kimi-K2 (``[BOS]``, ``[EOS]``, ``<|im_end|>``, ``<|im_user|>``,
``<|im_assistant|>``, ``<|im_system|>``, ``<|im_middle|>``, plus ``[UNK]`` and ``[PAD]``). The files written
are the ones Hugging Face's ``PreTrainedTokenizerFast`` reads, and :class:`splitspec.runtime.tokenizer.ChatTokenizer`
too: ``tokenizer.json``, ``tokenizer_config.json`` (with the chat template) and ``special_tokens_map.json``.

:func:`count_token_frequencies` and :func:`select_draft_vocab` pick a drafter's reduced vocabulary from
token frequencies over a corpus.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from splitspec.demo.corpus import stdlib_corpus
from splitspec.errors import ConfigError
from splitspec.files import write_atomic, write_json
from splitspec.runtime.tokenizer import (
    BOS_TOKEN,
    CHAT_TEMPLATE,
    EOS_TOKEN,
    IM_ASSISTANT_TOKEN,
    IM_END_TOKEN,
    IM_MIDDLE_TOKEN,
    IM_SYSTEM_TOKEN,
    IM_USER_TOKEN,
    MODEL_MAX_LENGTH,
    PAD_TOKEN,
    SPECIAL_TOKENS,
    UNK_TOKEN,
    ChatTokenizer,
)


def special_tokens_map_dict() -> dict[str, Any]:
    """Return the ``special_tokens_map.json`` content (also the special tokens of ``tokenizer_config.json``)."""
    return {
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": UNK_TOKEN,
        "additional_special_tokens": [IM_END_TOKEN, IM_USER_TOKEN, IM_ASSISTANT_TOKEN, IM_SYSTEM_TOKEN,
                                      IM_MIDDLE_TOKEN],
    }


def tokenizer_config_dict(model_max_length: int = MODEL_MAX_LENGTH) -> dict[str, Any]:
    """Return the ``tokenizer_config.json`` content (special tokens, class, chat template)."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special_tokens_map_dict(),
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
        "add_bos_token": False,
        "add_eos_token": False,
        "chat_template": CHAT_TEMPLATE,
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
    write_atomic(out_dir / "tokenizer.json", tok.to_str(pretty=True), mode=None)
    write_json(tokenizer_config_dict(), out_dir / "tokenizer_config.json", ensure_ascii=False)
    write_json(special_tokens_map_dict(), out_dir / "special_tokens_map.json", ensure_ascii=False)


def count_token_frequencies(tokenizer: ChatTokenizer, texts: Iterable[str]) -> np.ndarray:
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
        for ids in tokenizer.encode_batch(batch):
            if ids:
                counts[:] += np.bincount(np.asarray(ids, dtype=np.int64), minlength=counts.shape[0])
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
