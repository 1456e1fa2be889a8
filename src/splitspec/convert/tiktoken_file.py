"""The data files of a tiktoken tokenizer folder (Kimi-K2 / K2.5): the ranks file ``tiktoken.model`` and the special
tokens of ``tokenizer_config.json``, parsed and checked, each problem a one-line error naming the file and line or
field. Read by ``splitspec convert`` (to check a checkpoint's tokenizer before anything is written) and by the
runtime's :class:`splitspec.runtime.tiktoken_folder.TiktokenFolder` (the format's sources are cited there).
"""

from __future__ import annotations

import base64
import binascii
from pathlib import Path
from typing import Any

from splitspec.errors import CheckpointError

#: Special ids above the BPE ranks that ``tokenization_kimi.py`` reserves (names from added_tokens_decoder or
#: :data:`RESERVED_TOKEN`).
NUM_RESERVED_SPECIAL_TOKENS = 256
RESERVED_TOKEN = "<|reserved_token_{}|>"

def read_ranks(path: Path) -> dict[bytes, int]:
    """Read a tiktoken ranks file: ``base64(token) rank`` per line, blank lines skipped.

    Returns: token bytes → rank, ranks exactly 0 … n−1.
    Raises:
        CheckpointError: the file is unreadable, or a line is malformed, repeats a token or a rank (the message
            names the line), or the ranks leave a gap.
    """
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise CheckpointError(f"{path}: cannot be read ({e.strerror or e})") from None
    ranks: dict[bytes, int] = {}
    seen: dict[int, int] = {}  # rank -> line number
    for no, line in enumerate(data.splitlines(), start=1):
        if not line.strip():
            continue
        parts = line.split()
        try:
            if len(parts) != 2:
                raise ValueError("expected 'base64-token rank'")
            token, rank = base64.b64decode(parts[0], validate=True), int(parts[1])
            if rank < 0:
                raise ValueError("negative rank")
        except (ValueError, binascii.Error) as e:
            raise CheckpointError(f"{path}: line {no}: {line[:60]!r} is not 'base64-token rank' ({e})") from None
        if token in ranks:
            raise CheckpointError(f"{path}: line {no}: token {token!r} listed twice (also rank {ranks[token]})")
        if rank in seen:
            raise CheckpointError(f"{path}: line {no}: rank {rank} listed twice (also on line {seen[rank]})")
        ranks[token], seen[rank] = rank, no
    if not ranks:
        raise CheckpointError(f"{path}: no tokens")
    if max(seen) != len(ranks) - 1:
        missing = next(r for r in range(len(ranks)) if r not in seen)
        raise CheckpointError(f"{path}: ranks must be 0 … {len(ranks) - 1} without gaps; rank {missing} is missing")
    return ranks


def special_tokens(config: dict[str, Any], n_base: int, where: str) -> tuple[dict[str, int], set[int]]:
    """Special tokens from ``added_tokens_decoder``, filled with reserved names up to ``n_base + 256`` ids.

    Args:
        config: ``tokenizer_config.json`` content; n_base: number of BPE ranks; where: that file, for messages.
    Returns:
        (token string → id, the ids dropped by ``skip_special_tokens``: ``"special": true`` entries and the
        reserved fillers).
    Raises:
        CheckpointError: ``added_tokens_decoder`` missing or malformed, an id below ``n_base`` (it collides with
            a BPE rank), or one content given two ids.
    """
    added = config.get("added_tokens_decoder")
    if not isinstance(added, dict) or not added:
        raise CheckpointError(f"{where}: field 'added_tokens_decoder' missing or not an object of id → token "
                              "(a tiktoken.model folder takes its special tokens from it)")
    tokens: dict[str, int] = {}
    skip: set[int] = set()
    for key, entry in added.items():
        field = f"added_tokens_decoder[{key!r}]"
        content = entry.get("content") if isinstance(entry, dict) else None
        if not isinstance(content, str) or not content:
            raise CheckpointError(f"{where}: {field}: expected an object with a non-empty string 'content'")
        try:
            tid = int(key)
        except ValueError:
            raise CheckpointError(f"{where}: {field}: the key must be a token id") from None
        if tid < n_base:
            raise CheckpointError(f"{where}: {field} = {content!r}: id {tid} collides with a BPE rank of "
                                  f"tiktoken.model (ranks 0 … {n_base - 1}); special ids start at {n_base}")
        if content in tokens:
            raise CheckpointError(f"{where}: {field}: {content!r} already has id {tokens[content]}")
        tokens[content] = tid
        if entry.get("special", True):
            skip.add(tid)
    taken = set(tokens.values())
    for tid in range(n_base, max(n_base + NUM_RESERVED_SPECIAL_TOKENS, max(taken) + 1)):
        if tid not in taken:
            name = RESERVED_TOKEN.format(tid)
            if name in tokens:
                raise CheckpointError(f"{where}: added_tokens_decoder: {name!r} names id {tokens[name]}, not {tid}")
            tokens[name] = tid
            skip.add(tid)
    return tokens, skip
