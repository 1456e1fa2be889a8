"""The trained pair's cache: one folder ``demo-<key>`` per content hash, so a machine trains once.

The key (:func:`cache_key`) hashes everything that determines the pair: the code of every module it
depends on (:data:`CODE_FILES`), the training configuration (seed included), the corpus files and
contents, and the library versions. The cache root is ``$SPLITSPEC_CACHE`` (default ``~/.cache/splitspec``).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

import splitspec
from splitspec.demo.corpus import CorpusSplit, corpus_fingerprint, corpus_split
from splitspec.demo.train_config import TrainConfig
from splitspec.files import atomic_dir, default_permissions

CACHE_ENV = "SPLITSPEC_CACHE"
TRAINING_INFO = "training.json"
_PACKAGE = Path(splitspec.__file__).resolve().parent
#: Files whose code defines the trained pair, relative to the splitspec package: a change to any of them
#: gives a new cache key. Every module of splitspec.demo (training, export, measurement, report) and the
#: tokenizer the pair is written for.
CODE_FILES = tuple(sorted(p.relative_to(_PACKAGE).as_posix() for p in (_PACKAGE / "demo").glob("*.py"))) + (
    "runtime/tokenizer.py",)


def library_versions() -> dict[str, str]:
    """Versions of Python and of the libraries the training results depend on (part of the cache key)."""
    import tokenizers
    import transformers

    return {"python": sys.version.split()[0], "torch": torch.__version__, "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__, "numpy": np.__version__}


def cache_root() -> Path:
    """``$SPLITSPEC_CACHE`` if set, else ``~/.cache/splitspec``."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "splitspec"


def cache_key(cfg: TrainConfig, split: CorpusSplit | None = None) -> str:
    """Content hash of everything that determines the trained pair: the training code
    (:data:`CODE_FILES`), ``cfg`` (seed included), the corpus files and contents, and the versions of
    Python, torch, transformers, tokenizers and numpy. 16 hex digits."""
    h = hashlib.sha256()
    for name in CODE_FILES:
        h.update(name.encode() + b"\0" + (_PACKAGE / name).read_bytes())
    h.update(json.dumps(cfg.to_dict(), sort_keys=True).encode())
    split = split or corpus_split(cfg.heldout_every, cfg.max_corpus_files)
    h.update(corpus_fingerprint(split).encode())
    h.update(json.dumps(library_versions(), sort_keys=True).encode())
    return h.hexdigest()[:16]


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """An exclusive advisory lock on ``path`` (so two processes do not train the same entry at once)."""
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def install_trained_pair(entry: Path, out_dir: Path) -> bool:
    """Copy a cached pair (``entry``) to ``out_dir`` (atomically). Returns False when ``out_dir``
    already holds the same pair (same cache key), True when it was copied."""
    entry, out_dir = Path(entry), Path(out_dir).absolute()
    want = json.loads((entry / TRAINING_INFO).read_text())["key"]
    try:
        have = json.loads((out_dir / TRAINING_INFO).read_text()).get("key")
    except (OSError, ValueError):
        have = None
    if have == want and (out_dir / "target" / "config.json").is_file() and (out_dir / "drafter" / "config.json").is_file():
        return False
    with atomic_dir(out_dir) as tmp:
        shutil.copytree(entry, tmp, dirs_exist_ok=True)
        default_permissions(tmp)
    return True
