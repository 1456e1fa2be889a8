"""The demo's training corpus: the Python standard library's own ``.py`` sources, which every machine has.

- :func:`stdlib_source_files` and :func:`stdlib_corpus`: the sources in a fixed order and, capped in size,
  the tokenizer's training text (:mod:`splitspec.demo.tokenizer_train`).
"""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

from splitspec.errors import ConfigError

_SKIP_DIRS = frozenset({"test", "tests", "idlelib", "site-packages"})


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
