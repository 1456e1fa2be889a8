"""Reading Hugging Face safetensors checkpoints tensor by tensor, and writing them tensor by tensor.

Formats: the safetensors file format (https://github.com/huggingface/safetensors, "Format"): an
8-byte little-endian header length N, N bytes of JSON ``{name: {"dtype", "shape", "data_offsets":
[begin, end]}, "__metadata__": {str: str}}`` (offsets relative to the data region, which follows the
header), then the tensors' bytes, row-major, little-endian, contiguous. The Hugging Face sharded
checkpoint index ``model.safetensors.index.json`` is ``{"metadata": {...}, "weight_map": {tensor name:
shard file}}``.

Why not ``safetensors.safe_open`` for reading: it memory-maps each shard, and every page a conversion
touches stays mapped (and counted in the process's resident memory) for as long as the handle is open,
so converting a checkpoint would grow to its whole size. :class:`SafetensorsFile` parses the header
(the same checks the library makes) and reads each tensor with one positioned read into a fresh buffer,
so resident memory is the tensors currently held, nothing more. Writing likewise streams
(:class:`StreamingSafetensorsWriter`): one tensor in memory at a time.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import struct
from pathlib import Path
from typing import Iterable

import torch

from splitspec.errors import CheckpointError
from splitspec.files import read_json

INDEX_NAME = "model.safetensors.index.json"
MAX_HEADER_BYTES = 100_000_000  # the library's own limit on the JSON header

# safetensors dtype codes (the format's "dtype" field) and their torch dtypes.
DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U64": torch.uint64, "U32": torch.uint32, "U16": torch.uint16, "U8": torch.uint8, "BOOL": torch.bool,
}
DTYPE_CODES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}


class TensorInfo:
    """What a safetensors header says about one tensor: dtype, shape, byte range in the data region."""

    __slots__ = ("dtype", "shape", "begin", "end")

    def __init__(self, dtype: torch.dtype, shape: tuple[int, ...], begin: int, end: int):
        self.dtype, self.shape, self.begin, self.end = dtype, shape, begin, end

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


class SafetensorsFile:
    """One safetensors file: its header parsed and checked at open, tensors read on demand.

    Checks (each failure a CheckpointError naming the file): a readable 8-byte header length within
    the file, a JSON object header, known dtype codes, integer shapes, byte ranges equal to
    numel × element size that tile the data region without gaps or overlaps, and a data region as long
    as the header says (a shorter file is reported as truncated).
    """

    def __init__(self, path: Path):
        self.path = Path(path)
        try:
            self._fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            raise CheckpointError(f"{self.path}: file not found") from None
        except OSError as e:
            raise CheckpointError(f"{self.path}: cannot open ({e.strerror})") from None
        try:
            self.size = os.fstat(self._fd).st_size
            self.tensors, self.metadata, self.data_start = self._parse()
        except BaseException:
            os.close(self._fd)
            raise

    def _fail(self, why: str) -> CheckpointError:
        return CheckpointError(f"{self.path}: not a readable safetensors file ({why})")

    def _parse(self) -> tuple[dict[str, TensorInfo], dict, int]:
        if self.size < 8:
            raise self._fail(f"{self.size} bytes, shorter than the 8-byte header length; the file is truncated")
        (n,) = struct.unpack("<Q", os.pread(self._fd, 8, 0))
        if n > MAX_HEADER_BYTES or 8 + n > self.size:
            raise self._fail(f"header length {n} does not fit in the file's {self.size} bytes; truncated or corrupt")
        raw = os.pread(self._fd, n, 8)
        try:
            header = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise self._fail(f"header is not valid JSON: {e}") from None
        if not isinstance(header, dict):
            raise self._fail("header is not a JSON object")
        metadata = header.pop("__metadata__", None) or {}
        tensors: dict[str, TensorInfo] = {}
        for name, e in header.items():
            if not isinstance(e, dict) or not {"dtype", "shape", "data_offsets"} <= set(e):
                raise self._fail(f"header entry '{name}' lacks dtype/shape/data_offsets")
            dtype = DTYPES.get(e["dtype"])
            if dtype is None:
                raise self._fail(f"tensor '{name}' has unknown dtype code {e['dtype']!r}")
            shape, offs = e["shape"], e["data_offsets"]
            if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
                raise self._fail(f"tensor '{name}' has shape {shape!r}")
            if not (isinstance(offs, list) and len(offs) == 2 and all(isinstance(o, int) for o in offs) and 0 <= offs[0] <= offs[1]):
                raise self._fail(f"tensor '{name}' has data_offsets {offs!r}")
            want = math.prod(shape) * dtype.itemsize
            if offs[1] - offs[0] != want:
                raise self._fail(f"tensor '{name}' spans {offs[1] - offs[0]} bytes, but {e['dtype']} {shape} needs {want}")
            tensors[name] = TensorInfo(dtype, tuple(shape), offs[0], offs[1])
        end = 0
        for name, info in sorted(tensors.items(), key=lambda kv: (kv[1].begin, kv[1].end)):
            if info.begin != end:
                raise self._fail(f"tensor '{name}' starts at byte {info.begin} of the data region, expected {end} (gap or overlap)")
            end = info.end
        data = self.size - 8 - n
        if end > data:
            raise self._fail(f"header describes {end} bytes of tensor data but the file holds {data}; the file is truncated")
        if end < data:
            raise self._fail(f"{data - end} bytes after the last tensor; corrupt")
        return tensors, metadata, 8 + n

    def read(self, name: str) -> torch.Tensor:
        """Read one tensor into a fresh CPU buffer (one positioned read; no memory map)."""
        info = self.tensors[name]
        buf = torch.empty(info.nbytes, dtype=torch.uint8)
        view, done = memoryview(buf.numpy()), 0
        while done < info.nbytes:
            got = os.preadv(self._fd, [view[done:]], self.data_start + info.begin + done)
            if got <= 0:
                raise CheckpointError(f"{self.path}: cannot read tensor '{name}': the file ended early; it may be truncated")
            done += got
        return buf.view(info.dtype).reshape(info.shape) if info.nbytes else torch.empty(info.shape, dtype=info.dtype)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


def check_shard_names(weight_map: dict, index: Path) -> None:
    """Raise CheckpointError, naming ``index``, when a shard ``weight_map`` names is not a plain file name (the
    checkpoint's folder is the only place a reader opens shards: no path, no ``..``)."""
    odd = next((f for f in weight_map.values() if not (isinstance(f, str) and f and Path(f).name == f
                                                        and f not in (".", ".."))), None)
    if odd is not None:
        raise CheckpointError(f"{index}: names shard {odd!r}, expected a file name in the checkpoint's folder")


class CheckpointReader:
    """Lazy, tensor-by-tensor access to a folder of safetensors files.

    The folder holds either ``model.safetensors.index.json`` plus the shards it names, or
    one or more ``*.safetensors`` files without an index. Headers are read at open; each tensor is
    read when asked for (memory: the tensors the caller holds, not shards; see :class:`SafetensorsFile`).
    ``used`` records every name read (or marked with :meth:`mark_used`), so that :meth:`unused`
    can report tensors a converter ignored.

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
            check_shard_names(weight_map, index)
            files = sorted(set(weight_map.values()))
            for f in files:
                if not (self.folder / f).exists():
                    raise CheckpointError(f"{index}: names shard '{f}', which is missing from {self.folder}")
        else:
            files = sorted(p.name for p in self.folder.glob("*.safetensors"))
            if not files:
                raise CheckpointError(f"{self.folder}: no *.safetensors files and no {INDEX_NAME}")
            weight_map = {}
        self._files: dict[str, SafetensorsFile] = {}
        self.location: dict[str, str] = {}
        for f in files:
            sf = SafetensorsFile(self.folder / f)
            self._files[f] = sf
            for k in sf.tensors:
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
        sf = SafetensorsFile(Path(path))
        self._files = {Path(path).name: sf}
        self.location = {k: Path(path).name for k in sf.tensors}
        self.used = set()
        return self

    def __contains__(self, name: str) -> bool:
        return name in self.location

    def names(self) -> list[str]:
        """All tensor names in the checkpoint, sorted."""
        return sorted(self.location)

    def info(self, name: str) -> TensorInfo:
        """Header facts (dtype, shape, bytes) of one tensor, without reading it.

        Raises:
            CheckpointError: the tensor is missing.
        """
        f = self.location.get(name)
        if f is None:
            raise CheckpointError(f"{self.folder}: tensor '{name}' is missing")
        return self._files[f].tensors[name]

    def file_of(self, name: str) -> Path:
        """Path of the shard holding ``name``."""
        return self.folder / self.location[name]

    @property
    def shard_sizes(self) -> dict[str, int]:
        """Bytes of each shard file."""
        return {f: sf.size for f, sf in self._files.items()}

    def check(self, name: str, shape: tuple[int, ...] | None = None, dtype: torch.dtype | tuple | None = None) -> TensorInfo:
        """Check one tensor's presence, shape and dtype from the header (shape/dtype None: any), without reading it.

        Raises:
            CheckpointError: naming the file and tensor.
        """
        info = self.info(name)
        path = self.file_of(name)
        if shape is not None and tuple(info.shape) != tuple(shape):
            raise CheckpointError(f"{path}: tensor '{name}' has shape {list(info.shape)}, expected {list(shape)}")
        if dtype is not None:
            ok = dtype if isinstance(dtype, tuple) else (dtype,)
            if info.dtype not in ok:
                raise CheckpointError(f"{path}: tensor '{name}' has dtype {info.dtype}, expected {' or '.join(map(str, ok))}")
        return info

    def get(self, name: str, shape: tuple[int, ...] | None = None, dtype: torch.dtype | tuple | None = None) -> torch.Tensor:
        """Read one tensor, checking its shape and dtype (from the header, before reading) when given (:meth:`check`).

        Args:
            name: tensor name as stored.
            shape: expected shape, or None to accept any.
            dtype: expected dtype (or tuple of accepted dtypes), or None to accept any.
        Raises:
            CheckpointError: naming the file and tensor.
        """
        self.check(name, shape, dtype)
        t = self._files[self.location[name]].read(name)
        self.used.add(name)
        return t

    def mark_used(self, names: Iterable[str]) -> None:
        """Count ``names`` as handled (e.g. deliberately skipped), so :meth:`unused` does not list them."""
        self.used.update(names)

    def unused(self) -> list[str]:
        """Names never read through :meth:`get` nor marked, sorted."""
        return sorted(set(self.location) - self.used)

    def close(self) -> None:
        for sf in self._files.values():
            sf.close()


class StreamingSafetensorsWriter:
    """Write a safetensors file one tensor at a time: peak memory is the tensor being written.

    Tensor bytes go to a sibling ``.data`` file as they arrive; :meth:`close` writes the header
    (8-byte length, JSON padded with spaces to a multiple of 8 bytes, as the format allows) and
    appends the data, then removes the ``.data`` file. Costs one extra sequential copy on disk.
    """

    def __init__(self, path: Path, metadata: dict[str, str] | None = None):
        self.path = Path(path)
        self.metadata = {"format": "pt", **(metadata or {})}
        self._data_path = self.path.with_name(self.path.name + ".data")
        self._data = open(self._data_path, "wb")
        self._header: dict[str, dict] = {}
        self._offset = 0

    def add(self, name: str, t: torch.Tensor) -> None:
        """Append tensor ``name`` (any device; copied to CPU, made contiguous)."""
        if name in self._header:
            raise ValueError(f"tensor '{name}' written twice to {self.path}")
        t = t.detach().to("cpu").contiguous()
        code = DTYPE_CODES.get(t.dtype)
        if code is None:
            raise ValueError(f"tensor '{name}': dtype {t.dtype} has no safetensors code")
        n = t.numel() * t.element_size()
        if n:
            self._data.write(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
        self._header[name] = {"dtype": code, "shape": list(t.shape), "data_offsets": [self._offset, self._offset + n]}
        self._offset += n

    @property
    def nbytes(self) -> int:
        """Tensor bytes written so far."""
        return self._offset

    def close(self) -> None:
        """Write the final file and remove the temporary data file."""
        self._data.close()
        header = json.dumps({"__metadata__": self.metadata, **self._header}, separators=(",", ":")).encode()
        header += b" " * (-len(header) % 8)
        with open(self.path, "wb") as out, open(self._data_path, "rb") as data:
            out.write(struct.pack("<Q", len(header)))
            out.write(header)
            shutil.copyfileobj(data, out, 16 << 20)
        os.unlink(self._data_path)

    def abort(self) -> None:
        """Drop everything written (used on errors)."""
        self._data.close()
        for p in (self._data_path, self.path):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(p)


def write_tensors(items: Iterable[tuple[str, torch.Tensor]], path: Path, metadata: dict[str, str] | None = None) -> int:
    """Stream ``(name, tensor)`` pairs into a safetensors file at ``path``; returns the tensor bytes written."""
    w = StreamingSafetensorsWriter(path, metadata)
    try:
        for name, t in items:
            w.add(name, t)
    except BaseException:
        w.abort()
        raise
    w.close()
    return w.nbytes


def save_tensors(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str] | None = None) -> None:
    """Save ``tensors`` to a safetensors file (``format: pt`` metadata), streaming them one by one."""
    write_tensors(tensors.items(), path, metadata)


