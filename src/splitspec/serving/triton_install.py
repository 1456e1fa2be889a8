"""Finding the Triton Inference Server bundled in ``nvidia-pytriton`` and preparing to run it.

The ``nvidia-pytriton`` wheel ships ``tritonserver`` 2.51, the Python backend
(``libtriton_python.so`` + ``triton_python_backend_utils.py``) and one Python backend stub per
Python version. :func:`find_triton` locates them; :func:`prepare_backend_dir` assembles a backend folder
``<repo>/_backends/python/`` of symlinks to those files, with the stub that matches the Python
running this process. :func:`server_env` makes the stub use this same interpreter (its ``bin``
first on ``PATH``; the stub ignores ``PYTHONPATH``) and find the libraries bundled in
``site-packages/nvidia_pytriton.libs``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from splitspec.errors import SplitspecError

#: Folder (under the model repository) holding the assembled backend folder(s) and server logs.
BACKENDS_DIRNAME = "_backends"

@dataclass(frozen=True)
class TritonInstall:
    """Paths of the Triton files inside the installed ``pytriton`` package.

    Attributes:
        server_bin: the ``tritonserver`` executable.
        backend_lib: ``libtriton_python.so`` (the Python backend).
        backend_utils: ``triton_python_backend_utils.py``.
        stub: ``triton_python_backend_stub`` built for this process's Python version.
        libs_dir: ``site-packages/nvidia_pytriton.libs`` (bundled shared libraries).
    """

    server_bin: Path
    backend_lib: Path
    backend_utils: Path
    stub: Path
    libs_dir: Path


def find_triton() -> TritonInstall:
    """Locate ``tritonserver``, the Python backend and the matching stub in the ``pytriton`` package.

    Raises:
        SplitspecError: ``nvidia-pytriton`` is not installed, a file is missing, or there is no
            stub for this Python version (the message lists the versions available).
    """
    # located, not imported: importing pytriton needs its client's dependencies (sh, pyzmq, ...), which
    # a machine that only carries the server (scripts/gpu_setup.sh) does not have
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.origin:
        raise SplitspecError("the Python package 'pytriton' is missing: pip install nvidia-pytriton==0.7.0")
    root = Path(spec.origin).resolve().parent / "tritonserver"
    ver = f"{sys.version_info.major}.{sys.version_info.minor}"
    stubs = root / "python_backend_stubs"
    inst = TritonInstall(
        server_bin=root / "bin" / "tritonserver",
        backend_lib=root / "backends" / "python" / "libtriton_python.so",
        backend_utils=root / "backends" / "python" / "triton_python_backend_utils.py",
        stub=stubs / ver / "triton_python_backend_stub",
        libs_dir=root.parent.parent / "nvidia_pytriton.libs",
    )
    if not inst.stub.is_file():
        have = sorted(p.name for p in stubs.iterdir()) if stubs.is_dir() else []
        raise SplitspecError(f"{inst.stub}: no Python backend stub for Python {ver} in nvidia-pytriton "
                             f"(available: {', '.join(have) or 'none'})")
    for name in ("server_bin", "backend_lib", "backend_utils", "libs_dir"):
        p = getattr(inst, name)
        if not p.exists():
            raise SplitspecError(f"{p}: missing from the installed nvidia-pytriton package ({name})")
    return inst


def _symlink_atomic(target: Path, link: Path) -> None:
    """Make ``link`` a symlink to ``target``, replacing what is there in one rename."""
    if link.is_symlink() and os.readlink(link) == str(target):
        return
    tmp = link.with_name(f".{link.name}.{os.getpid()}.tmp")
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    os.symlink(target, tmp)
    os.replace(tmp, link)


def prepare_backend_dir(repo: Path, install: TritonInstall | None = None) -> Path:
    """Assemble ``<repo>/_backends/python/`` (symlinks to the Python backend and matching stub).

    Returns:
        the backend directory to pass as ``--backend-directory`` (``<repo>/_backends``).
    Raises:
        SplitspecError: see :func:`find_triton`.
    """
    install = install or find_triton()
    backends = Path(repo).resolve() / BACKENDS_DIRNAME
    py = backends / "python"
    py.mkdir(parents=True, exist_ok=True)
    _symlink_atomic(install.backend_lib, py / "libtriton_python.so")
    _symlink_atomic(install.backend_utils, py / "triton_python_backend_utils.py")
    _symlink_atomic(install.stub, py / "triton_python_backend_stub")
    return backends


def libpython_dir() -> str | None:
    """Folder holding this interpreter's ``libpythonX.Y.so.1.0``, when it has one (the stub links it)."""
    libdir = sysconfig.get_config_var("LIBDIR")
    ldlib = sysconfig.get_config_var("INSTSONAME") or sysconfig.get_config_var("LDLIBRARY")
    if libdir and ldlib and ldlib.endswith((".so", ".so.1.0")) and (Path(libdir) / ldlib).exists():
        return libdir
    return None


def server_env(install: TritonInstall | None = None, extra_lib_dirs: tuple[Path, ...] = (),
               base: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for ``tritonserver`` (and ``perf_analyzer``).

    ``PATH`` starts with the folder of ``sys.executable``, so the Python backend stub runs this
    interpreter with its site-packages (NumPy 1, torch, splitspec). ``LD_LIBRARY_PATH`` gets
    ``extra_lib_dirs``, ``nvidia_pytriton.libs`` and this interpreter's libpython folder.
    """
    install = install or find_triton()
    env = dict(os.environ if base is None else base)
    bindir = str(Path(sys.executable).parent)  # not resolved: a venv's bin, not the base interpreter's
    env["PATH"] = os.pathsep.join([bindir] + [p for p in env.get("PATH", "").split(os.pathsep) if p and p != bindir])
    ld = [str(p) for p in extra_lib_dirs] + [str(install.libs_dir)]
    if (libpy := libpython_dir()) is not None:
        ld.append(libpy)
    ld += [p for p in env.get("LD_LIBRARY_PATH", "").split(os.pathsep) if p and p not in ld]
    env["LD_LIBRARY_PATH"] = os.pathsep.join(ld)
    env.pop("PYTHONHOME", None)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env

