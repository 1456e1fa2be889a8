"""The demo's training corpus: the Python standard library's own ``.py`` sources, which every machine has.

- :func:`stdlib_source_files` and :func:`stdlib_corpus`: the sources in a fixed order and, capped in size,
  the tokenizer's training text (:mod:`splitspec.demo.tokenizer_train`);
- :func:`corpus_split`: the models' corpus, every ``heldout_every``-th file held out (for the held-out loss
  and the acceptance prompts);
- :func:`chat_samples`: chat conversations built from the training files' documented functions;
- :func:`build_token_stream` and :class:`WindowSampler`: one token stream of the training documents and
  seeded batches of windows cut from it; :func:`pad_batch` for sequences of different lengths;
  :func:`token_windows` for scoring held-out text.
"""

from __future__ import annotations

import ast
import hashlib
import os
import sysconfig
import textwrap
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from splitspec.errors import ConfigError

_SKIP_DIRS = frozenset({"test", "tests", "idlelib", "site-packages"})
EXCLUDED_CORPUS_DIRS = ("encodings",)  # codec tables: hundreds of KB of "'\x00' # 0x00 -> NULL" lines


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


@dataclass
class CorpusSplit:
    """Standard-library sources as (path relative to the stdlib folder, text), split by file."""

    train: list[tuple[str, str]]
    heldout: list[tuple[str, str]]


def corpus_split(heldout_every: int = 40, max_files: int | None = None) -> CorpusSplit:
    """Read the training corpus and split it into training and held-out files.

    Files come from :func:`stdlib_source_files` (sorted, tests excluded), minus
    those under :data:`EXCLUDED_CORPUS_DIRS`; file i (in that order) is held out when
    ``i % heldout_every == heldout_every // 2``.

    Args:
        heldout_every: one file in this many is held out.
        max_files: keep only the first ``max_files`` files (tests); None keeps all.

    Raises:
        ConfigError: no readable source file.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    files: list[tuple[str, str]] = []
    for path in stdlib_source_files():
        rel = path.relative_to(root).as_posix()
        if rel.split("/")[0] in EXCLUDED_CORPUS_DIRS:
            continue
        try:
            text = path.read_bytes().decode("utf-8", errors="ignore")
        except OSError:
            continue
        if text.strip():
            files.append((rel, text))
        if max_files is not None and len(files) >= max_files:
            break
    if not files:
        raise ConfigError(f"no readable .py file under the standard library folder {root}")
    split = CorpusSplit([], [])
    for i, item in enumerate(files):
        (split.heldout if i % heldout_every == heldout_every // 2 else split.train).append(item)
    if not split.train:
        raise ConfigError("the corpus split left no training file")
    return split


def corpus_fingerprint(split: CorpusSplit) -> str:
    """sha256 over every file's role, relative path and contents (part of the cache key)."""
    h = hashlib.sha256()
    for role, files in (("train", split.train), ("heldout", split.heldout)):
        for rel, text in files:
            h.update(f"{role}\0{rel}\0{len(text)}\0".encode())
            h.update(text.encode("utf-8"))
    return h.hexdigest()


_CODE_ASKS = (
    "Write a Python function `{sig}` that does the following: {doc}",
    "{doc}\n\nImplement this in Python as `{sig}`.",
    "How would I write `{name}` in Python? It should work like this: {doc}",
    "Can you show me a Python implementation of `{sig}`? {doc}",
)
_EXPLAIN_ASKS = (
    "What does `{qual}` in the `{module}` module do?",
    "Explain what the Python function `{qual}` from `{module}` is for.",
    "I found `{qual}` in `{module}`. What is it used for?",
)


def _first_paragraph(doc: str) -> str:
    return " ".join(doc.strip().split("\n\n")[0].split())


def chat_samples(files: list[tuple[str, str]]) -> list[list[dict[str, str]]]:
    """Chat conversations built from the documented public functions of ``files``.

    For a function with a docstring: one of "write a function `sig` that <first docstring
    paragraph>" → "```python\\n<the function's source>\\n```", or "what does `module.qualname` do?"
    → the docstring (chosen by a CRC of the name, so the result is deterministic).

    Returns:
        Lists of ``{"role": "user"|"assistant", "content": str}`` messages, in file order.
    """
    out: list[list[dict[str, str]]] = []
    for rel, text in files:
        try:
            tree = ast.parse(text)
        except (SyntaxError, ValueError):
            continue
        module = rel[:-3].replace("/", ".").removesuffix(".__init__")
        lines = text.splitlines(keepends=True)  # (ast.get_source_segment re-splits the file on every call)
        stack: list[tuple[ast.AST, str]] = [(tree, "")]
        while stack:
            node, prefix = stack.pop(0)
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.ClassDef) and not prefix:
                    stack.append((child, child.name + "."))
                if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) or child.name.startswith("_"):
                    continue
                doc = ast.get_docstring(child, clean=True)
                if not doc:
                    continue
                para = _first_paragraph(doc)
                if not 20 <= len(para) <= 400:
                    continue
                qual = prefix + child.name
                crc = zlib.crc32(f"{module}.{qual}".encode())
                try:
                    sig = f"{child.name}({ast.unparse(child.args)})"
                except Exception:  # pragma: no cover - unparse failure on odd syntax
                    continue
                if crc % 3 == 0:
                    answer = doc.strip()
                    if len(answer) > 800:
                        answer = answer[:800].rsplit("\n\n", 1)[0].strip()
                    ask = _EXPLAIN_ASKS[(crc // 3) % len(_EXPLAIN_ASKS)].format(qual=qual, module=module)
                else:
                    src = "".join(lines[child.lineno - 1:child.end_lineno or child.lineno])
                    if len(src) > 1500 or src.count("\n") < 3:
                        continue
                    code = textwrap.dedent(src).rstrip("\n")
                    answer = f"```python\n{code}\n```"
                    ask = _CODE_ASKS[(crc // 3) % len(_CODE_ASKS)].format(sig=sig, name=child.name, doc=para)
                out.append([{"role": "user", "content": ask}, {"role": "assistant", "content": answer}])
    return out


def build_token_stream(tok: Any, split: CorpusSplit, seed: int, chat_fraction: float
                       ) -> tuple[np.ndarray, list[list[int]]]:
    """Encode the training corpus into one token stream.

    Documents (whole source files, and chat samples rendered with the chat template, up to
    ``chat_fraction`` of the tokens) are shuffled with ``seed`` and concatenated, each
    followed by ``[EOS]``.

    Returns:
        (stream: int64 [N], chat prompts: token ids of each chat sample's conversation up to and
        including the assistant header, in shuffled order; used for self-distillation).
    """
    rng = np.random.default_rng([seed, 1])
    code_ids = tok.encode_batch([t for _, t in split.train])
    n_code = sum(len(x) for x in code_ids)
    chats = chat_samples(split.train)
    order = rng.permutation(len(chats))
    chats = [chats[i] for i in order]
    rendered = [tok.apply_chat_template(c, add_generation_prompt=False) for c in chats]
    chat_ids = tok.encode_batch(rendered) if rendered else []
    budget = chat_fraction / (1.0 - chat_fraction) * n_code
    used, n_chat = 0, 0
    while used < len(chat_ids) and n_chat < budget:
        n_chat += len(chat_ids[used]) + 1
        used += 1
    prompts = [tok.encode(tok.apply_chat_template(c[:1], add_generation_prompt=True)) for c in chats[used:]]
    prompts += [tok.encode(tok.apply_chat_template(c[:1], add_generation_prompt=True)) for c in chats[:used]]
    docs = code_ids + chat_ids[:used]
    eos = tok.eos_token_id
    parts = [np.asarray(docs[i] + [eos], dtype=np.int64) for i in rng.permutation(len(docs))]
    return np.concatenate(parts), prompts


class WindowSampler:
    """Batches of windows [B, seq_len + 1] cut from a token stream, in a seeded order.

    Epoch e cuts the stream at a random offset into non-overlapping windows and visits them in a
    random permutation (numpy ``default_rng([seed, e])``); batch i is a pure function of (seed, i).
    """

    def __init__(self, stream: np.ndarray, seq_len: int, batch_size: int, seed: int):
        self.stream, self.L, self.B, self.seed = stream, seq_len + 1, batch_size, seed
        if len(stream) < self.L * (batch_size + 1):
            raise ConfigError(f"token stream of {len(stream)} tokens is too short for batches of "
                              f"{batch_size} × {seq_len + 1}")
        self._epoch, self._starts = -1, np.empty(0, dtype=np.int64)

    def _epoch_starts(self, epoch: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, 2, epoch])
        offset = int(rng.integers(self.L))
        n = (len(self.stream) - offset) // self.L
        starts = offset + self.L * np.arange(n, dtype=np.int64)
        return starts[rng.permutation(n)][: (n // self.B) * self.B]

    def batch(self, i: int) -> torch.Tensor:
        """Batch ``i``: int64 [B, seq_len + 1]."""
        per_epoch = len(self._epoch_starts(0)) // self.B
        epoch, j = divmod(i, per_epoch)
        if epoch != self._epoch:
            self._epoch, self._starts = epoch, self._epoch_starts(epoch)
        starts = self._starts[j * self.B:(j + 1) * self.B]
        return torch.from_numpy(np.stack([self.stream[s:s + self.L] for s in starts]))


def pad_batch(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad ``seqs`` → (tokens int64 [B, max len], lengths int64 [B])."""
    width = max(len(s) for s in seqs)
    x = torch.full((len(seqs), width), pad_id, dtype=torch.int64)
    for r, s in enumerate(seqs):
        x[r, :len(s)] = torch.tensor(s, dtype=torch.int64)
    return x, torch.tensor([len(s) for s in seqs], dtype=torch.int64)


def token_windows(tok: Any, texts: list[str], seq_len: int, max_windows: int) -> list[list[int]]:
    """Non-overlapping windows of ``seq_len + 1`` token ids of ``texts``, for scoring next-token loss.

    Each text is encoded on its own and cut from its start; a last partial window counts if it has at
    least 2 tokens. At most ``max_windows`` windows, taken in order.
    """
    windows: list[list[int]] = []
    for ids in tok.encode_batch(texts):
        windows += [ids[s:s + seq_len + 1] for s in range(0, len(ids) - 1, seq_len + 1) if len(ids[s:s + seq_len + 1]) >= 2]
    return windows[:max_windows]
