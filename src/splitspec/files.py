"""Files written safely: atomic writes of files and folders, JSON in and out, PNG plots.

Every output of the pipeline (checkpoints, engines, repositories, results) goes through these, so a
failed or interrupted run leaves either the old output or the new one, never a half-written one.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator

from splitspec.errors import CheckpointError, ConfigError


def read_json(path: Path, what: str | None = None, error: type[Exception] = CheckpointError) -> dict:
    """Read a JSON object from ``path``; ``what`` (e.g. "the engine description") is named when it is missing.

    Raises:
        ``error`` (CheckpointError by default): the file is missing, not a regular file (a folder, a FIFO whose read
            would block, a dangling link), unreadable or not a JSON object.
    """
    path = Path(path)
    if (path.exists() or path.is_symlink()) and not path.is_file():
        raise error(f"{path}: cannot be read (not a regular file)")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise error(f"{path}: file not found" + (f" ({what})" if what else "")) from None
    except (ValueError, RecursionError) as e:  # malformed, not UTF-8, an integer too long to convert, nested too deep
        raise error(f"{path}: not valid JSON ({type(e).__name__}: {str(e)[:200]})") from None
    except OSError as e:  # a folder, no permission, ...
        raise error(f"{path}: cannot be read ({e.strerror or e})") from None
    if not isinstance(data, dict):
        raise error(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


@contextlib.contextmanager
def atomic_dir(final: Path, keep: tuple = ()) -> Iterator[Path]:
    """Yield a temporary folder beside ``final``; on success, move it into place.

    On any exception the temporary folder is removed and ``final`` is left as it was,
    so a failed run never leaves a half-written output. ``keep`` lists folders that must survive
    (the inputs): an output that is, or contains, one of them is refused, and so is an existing folder inside one.

    Raises:
        ConfigError: ``final`` is an existing file, the current folder or one above it, or would
            replace one of ``keep``.
    """
    final = Path(final).absolute()
    here = Path.cwd().resolve()
    if final.exists() and not final.is_dir():
        raise ConfigError(f"{final}: output path is an existing file; expected a folder to create or replace")
    if final.resolve() == here or final.resolve() in here.parents:
        raise ConfigError(f"{final}: output folder is the current folder or above it; name a new folder")
    for k in keep:
        k = Path(k).resolve()
        if final.resolve() == k or final.resolve() in k.parents:
            raise ConfigError(f"{final}: output folder would replace the input {k}; choose another --out")
        if k in final.resolve().parents and final.exists():
            raise ConfigError(f"{final}: output folder would replace part of the input {k}; choose another --out")
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it private; outputs get ordinary permissions
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    replace_dir(tmp, final)


def replace_dir(tmp: Path, final: Path) -> None:
    """Rename the finished folder ``tmp`` to ``final``, replacing an existing ``final`` only then
    (restored if the rename fails)."""
    old: Path | None = None
    if final.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{final.name}.old-", dir=final.parent))
        os.rmdir(old)
        os.replace(final, old)
    try:
        os.replace(tmp, final)
    except BaseException:
        if old is not None:
            os.replace(old, final)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def write_atomic(path: Path, data: str | bytes, mode: int | None = 0o644) -> None:
    """Write ``data`` (str: UTF-8) to ``path`` through a temporary file in the same folder, then move it into
    place: readers see the old file or the new one, never a half-written one. ``mode``: the file's mode
    (None: the umask's default, like a plain ``open``). Raises OSError as the file system does, naming ``path``
    (not the temporary file, which is removed then); an existing folder, device, FIFO or socket at ``path`` is
    refused."""
    path = Path(path)
    if path.is_dir():  # os.replace would name the temporary file
        raise IsADirectoryError(errno.EISDIR, "a folder, expected a file path", str(path))
    if path.exists() and not path.is_file():  # a device, FIFO or socket: replacing it would remove it
        raise OSError(errno.EINVAL, "not a regular file, refused as an output", str(path))
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
        if mode is None:
            umask = os.umask(0)
            os.umask(umask)
            mode = 0o666 & ~umask
        os.chmod(tmp, mode)  # mkstemp makes it private
        os.replace(tmp, path)
    except BaseException as e:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        if isinstance(e, FileExistsError):  # from mkdir: a parent is a file
            raise NotADirectoryError(errno.ENOTDIR, "a parent of it is a file, not a folder", str(path)) from None
        if isinstance(e, OSError) and e.filename != str(path):
            raise type(e)(e.errno, e.strerror, str(path)) from None
        raise


def write_png(fig, path: Path, dpi: int = 110) -> Path:
    """Save a matplotlib figure as PNG at ``path``, atomically (:func:`write_atomic`), and close it. Returns path."""
    import io

    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    plt.close(fig)
    write_atomic(Path(path), buf.getvalue())
    return Path(path)


def write_json(obj: Any, path: Path, ensure_ascii: bool = True) -> None:
    """Write ``obj`` as indented JSON (UTF-8), atomically (:func:`write_atomic`: never a half-written file).
    ``ensure_ascii=False`` writes non-ASCII characters as they are instead of ``\\u`` escapes (tokenizer
    files, which Hugging Face writes that way)."""
    write_atomic(Path(path), json.dumps(obj, indent=2, sort_keys=False, ensure_ascii=ensure_ascii) + "\n", mode=None)


def default_permissions(root: Path) -> None:
    """Give ``root`` and everything below it the umask's default modes (mkdtemp/mkstemp make them private)."""
    mask = os.umask(0o022)
    os.umask(mask)
    os.chmod(root, 0o777 & ~mask)
    for dirpath, dirnames, filenames in os.walk(root):
        for d in dirnames:
            os.chmod(os.path.join(dirpath, d), 0o777 & ~mask)
        for f in filenames:
            os.chmod(os.path.join(dirpath, f), 0o666 & ~mask)


def make_dir(path: Path, what: str) -> Path:
    """Create the output folder ``path`` (and its parents) if needed; returns it.

    Raises:
        ConfigError: ``path`` is an existing file, or cannot be created (``what`` names the option, e.g. "--out").
    """
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{what} {path}: an existing file; expected a folder to create or write into")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"{what} {path}: cannot be created ({e.strerror or e})") from None
    return path
