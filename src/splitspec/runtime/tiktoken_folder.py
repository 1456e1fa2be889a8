"""A Kimi-K2 / K2.5 tokenizer folder read as data: ``tiktoken.model`` + ``tokenizer_config.json``, no code run.

Kimi checkpoints ship no ``tokenizer.json``. Their tokenizer is tiktoken byte-level BPE, described by
(moonshotai/Kimi-K2-Instruct on Hugging Face: ``tokenization_kimi.py``, ``tokenizer_config.json``):

- ``tiktoken.model``: one line per mergeable token, ``base64(token bytes) rank``, ranks 0 … n−1
  (Kimi: n = 163,584). The rank is the token id and the merge priority (tiktoken's ``load_tiktoken_bpe`` format).
- ``tokenizer_config.json`` → ``added_tokens_decoder``: ``{"163584": {"content": "[BOS]", "special": true, …}, …}``.
  ``tokenization_kimi.py`` makes every id from n upward a special token, named by this map or else
  ``<|reserved_token_{id}|>`` (``num_reserved_special_tokens = 256``), so Kimi's ids 163584 … 163839 are all
  special; entries with ``"special": false`` (the tool-call markers) are still single tokens, only kept by
  ``decode(skip_special_tokens=True)``.
- the pre-tokenisation pattern :data:`KIMI_PAT_STR`, which lives in ``tokenization_kimi.py``'s ``pat_str``, not
  in any data file (Han runs, letter words with English contractions, numbers of 1–3 digits, punctuation, spaces).

``tokenization_kimi.py`` encodes with ``allowed_special="all"`` (special-token strings in text become their ids)
and cuts text into pieces with at most 25,000 consecutive whitespace or non-whitespace characters before
encoding (tiktoken issue 195: very long runs overflow the regex engine's stack); this class does the same, so
its ids agree token for token. Decoding joins the tokens' bytes and decodes UTF-8 with ``errors="replace"``:
an incomplete trailing character comes out as U+FFFD, which the incremental detokeniser holds back.

The ranks file is parsed here rather than by ``tiktoken.load.load_tiktoken_bpe``: that function caches even a
local file in a temporary folder keyed by its path alone and, without an expected hash, returns the cached copy
ever after, so a file replaced at the same path would be read stale; parsing here also names the bad line.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from splitspec.convert.tiktoken_file import read_ranks, special_tokens

#: ``pat_str`` of moonshotai/Kimi-K2-Instruct's ``tokenization_kimi.py`` (the same in Kimi-K2.5 and K2-Thinking).
KIMI_PAT_STR = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"""
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"""
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])
#: Longest run of whitespace or of non-whitespace characters handed to tiktoken in one piece.
MAX_RUN_CHARS = 25_000


def split_long_runs(text: str, limit: int = MAX_RUN_CHARS) -> Iterator[str]:
    """Cut ``text`` so that no piece holds more than ``limit`` consecutive whitespace or non-whitespace
    characters (as ``tokenization_kimi.py`` does before encoding)."""
    start, run, space = 0, 0, text[:1].isspace()
    for i, ch in enumerate(text):
        if ch.isspace() != space:
            space, run = not space, 1
            continue
        run += 1
        if run > limit:
            yield text[start:i]
            start, run = i, 1
    yield text[start:]


class TiktokenFolder:
    """A tiktoken encoding built from a folder's ``tiktoken.model`` and ``tokenizer_config.json`` (already read).

    The interface :class:`splitspec.runtime.tokenizer.ChatTokenizer` uses: ``vocab_size``, ``token_to_id``,
    ``encode``, ``encode_batch``, ``decode``. Ids are Python ints in ``[0, vocab_size)``.
    """

    def __init__(self, folder: Path, config: dict[str, Any], pat_str: str = KIMI_PAT_STR) -> None:
        """Raises CheckpointError naming the file and line or field that is wrong (see :func:`read_ranks`,
        :func:`special_tokens`)."""
        import tiktoken

        folder = Path(folder)
        ranks = read_ranks(folder / "tiktoken.model")
        self.specials, self._skip = special_tokens(config, len(ranks), str(folder / "tokenizer_config.json"))
        self._ranks = ranks
        self._enc = tiktoken.Encoding(name=str(folder / "tiktoken.model"), pat_str=pat_str,
                                      mergeable_ranks=ranks, special_tokens=self.specials)

    @property
    def vocab_size(self) -> int:
        """BPE ranks plus special tokens (Kimi: 163,840)."""
        return self._enc.n_vocab

    def token_to_id(self, token: str) -> int | None:
        """Id of a special token, or of a BPE token given as its UTF-8 text; None when neither."""
        tid = self.specials.get(token)
        return tid if tid is not None else self._ranks.get(token.encode("utf-8"))

    def encode(self, text: str) -> list[int]:
        """Ids of ``text``; special-token strings in it become their ids."""
        if len(text) <= MAX_RUN_CHARS:
            return self._enc.encode(text, allowed_special="all")
        return [i for piece in split_long_runs(text) for i in self._enc.encode(piece, allowed_special="all")]

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """:meth:`encode` of each text."""
        return [self.encode(t) for t in texts]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids`` (in range); an incomplete UTF-8 sequence decodes to U+FFFD."""
        if skip_special_tokens:
            ids = [i for i in ids if i not in self._skip]
        return self._enc.decode(list(ids))

