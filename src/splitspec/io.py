"""Reading Hugging Face safetensors checkpoints tensor by tensor, and writing folders atomically.

Formats: the safetensors file format (https://github.com/huggingface/safetensors) and the
Hugging Face sharded-checkpoint index ``model.safetensors.index.json``
(``{"metadata": {...}, "weight_map": {tensor name: shard file}}``).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from splitspec.errors import CheckpointError

INDEX_NAME = "model.safetensors.index.json"


def read_json(path: Path) -> dict:
    """Read a JSON object from ``path``.

    Raises:
        CheckpointError: the file is missing or is not a JSON object.
    """
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: file not found") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


class CheckpointReader:
    """Lazy, tensor-by-tensor access to a folder of safetensors files.

    The folder holds either ``model.safetensors.index.json`` plus the shards it names, or
    one or more ``*.safetensors`` files without an index. Tensors are read one at a time
    (memory: one tensor, not one shard). ``used`` records every name read, so that
    :meth:`unused` can report tensors a converter ignored.

    Raises:
        CheckpointError: no safetensors files, an index naming a missing shard, a
            truncated/corrupt shard, or a tensor that is absent or has the wrong shape/dtype.
    """

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        if not self.folder.is_dir():
            raise CheckpointError(f"{self.folder}: checkpoint folder not found")
        index = self.folder / INDEX_NAME
        if index.exists():
            weight_map = read_json(index).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise CheckpointError(f"{index}: missing or empty 'weight_map'")
            files = sorted(set(weight_map.values()))
            for f in files:
                if not (self.folder / f).exists():
                    raise CheckpointError(f"{index}: names shard '{f}', which is missing from {self.folder}")
        else:
            files = sorted(p.name for p in self.folder.glob("*.safetensors"))
            if not files:
                raise CheckpointError(f"{self.folder}: no *.safetensors files and no {INDEX_NAME}")
            weight_map = {}
        self._handles = {}
        self.location: dict[str, str] = {}
        for f in files:
            try:
                h = safe_open(str(self.folder / f), framework="pt")
                keys = list(h.keys())
            except Exception as e:  # safetensors raises its own error types for truncated headers
                raise CheckpointError(f"{self.folder / f}: not a readable safetensors file ({e})") from None
            self._handles[f] = h
            for k in keys:
                self.location[k] = f
        for name, f in weight_map.items():
            if self.location.get(name) != f:
                raise CheckpointError(f"{index}: tensor '{name}' is mapped to '{f}' but that shard does not hold it")
        self.used: set[str] = set()

    @classmethod
    def single(cls, path: Path) -> "CheckpointReader":
        """A reader over one safetensors file (ignores its siblings)."""
        self = cls.__new__(cls)
        self.folder = Path(path).parent
        try:
            h = safe_open(str(path), framework="pt")
            keys = list(h.keys())
        except FileNotFoundError:
            raise CheckpointError(f"{path}: file not found") from None
        except Exception as e:
            raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from None
        self._handles = {Path(path).name: h}
        self.location = {k: Path(path).name for k in keys}
        self.used = set()
        return self

    def __contains__(self, name: str) -> bool:
        return name in self.location

    def names(self) -> list[str]:
        """All tensor names in the checkpoint, sorted."""
        return sorted(self.location)

    def get(self, name: str, shape: tuple[int, ...] | None = None, dtype: torch.dtype | tuple | None = None) -> torch.Tensor:
        """Read one tensor, checking its shape and dtype when given.

        Args:
            name: tensor name as stored.
            shape: expected shape, or None to accept any.
            dtype: expected dtype (or tuple of accepted dtypes), or None to accept any.
        Raises:
            CheckpointError: naming the file and tensor.
        """
        f = self.location.get(name)
        if f is None:
            raise CheckpointError(f"{self.folder}: tensor '{name}' is missing")
        try:
            t = self._handles[f].get_tensor(name)
        except Exception as e:
            raise CheckpointError(f"{self.folder / f}: cannot read tensor '{name}' ({e}); the file may be truncated") from None
        if shape is not None and tuple(t.shape) != tuple(shape):
            raise CheckpointError(f"{self.folder / f}: tensor '{name}' has shape {list(t.shape)}, expected {list(shape)}")
        if dtype is not None:
            ok = dtype if isinstance(dtype, tuple) else (dtype,)
            if t.dtype not in ok:
                raise CheckpointError(f"{self.folder / f}: tensor '{name}' has dtype {t.dtype}, expected {' or '.join(map(str, ok))}")
        self.used.add(name)
        return t

    def unused(self) -> list[str]:
        """Names never read through :meth:`get`, sorted."""
        return sorted(set(self.location) - self.used)


@contextlib.contextmanager
def atomic_dir(final: Path) -> Iterator[Path]:
    """Yield a temporary folder beside ``final``; on success, move it into place.

    On any exception the temporary folder is removed and ``final`` is left as it was,
    so a failed run never leaves a half-written output.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = None
    if final.exists():
        old = final.parent / f".{final.name}.old-{os.getpid()}"
        os.rename(final, old)
    os.rename(tmp, final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def save_tensors(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str] | None = None) -> None:
    """Save contiguous copies of ``tensors`` to a safetensors file (``format: pt`` metadata)."""
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata={"format": "pt", **(metadata or {})})


def write_json(obj: dict, path: Path) -> None:
    """Write ``obj`` as indented JSON."""
    Path(path).write_text(json.dumps(obj, indent=2, sort_keys=False) + "\n")
