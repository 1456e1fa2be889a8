"""A seccomp filter that keeps tritonserver's files private: ``fchmod`` may not open a data file to other users.

tritonserver and every process it starts run with umask 077 (:data:`~splitspec.serving.access.SERVER_UMASK`), so
what they create is their user's only, with one exception found by listing ``/dev/shm`` while the server starts:
the Python backend creates each shared-memory region (Boost.Interprocess ``shared_memory_object``: ``shm_open`` with
mode 0644, which the umask trims to 0600) and then sets the mode to 0644 on purpose with ``fchmod``, whatever the
umask. Each region (request and response tensors) stayed world-readable for 0.7–4 s, until its model's
``initialize`` made it 0600 (measured on the 2-core CPU machine, three models, 2026-12).

:func:`private_fchmod` is run in tritonserver's process between ``fork`` and ``exec`` (``Popen``'s ``preexec_fn``)
and installs a seccomp-BPF filter (Linux ``seccomp(2)``, ``SECCOMP_MODE_FILTER``; inherited by every process the
server starts) under which an ``fchmod`` that would give group or other users any permission on a file without an
execute bit returns success without changing anything. The region keeps its mode from creation, 0600. Every other
system call, ``chmod``/``fchmodat`` by path and ``fchmod`` to a mode that is private or executable, runs as
before. The filter also sets ``no_new_privs`` (set-user-id programs started below the server do not gain
privileges), which an unprivileged process needs to install one.

Only x86-64 and AArch64 are known (their system-call numbers and little-endian argument layout); elsewhere, or where
seccomp is refused (an old kernel, a container policy), nothing is installed and the models' ``initialize`` still
makes their regions 0600 (:func:`~splitspec.serving.access.make_stub_region_private`): :func:`filter_installed`
tells which happened.
"""

from __future__ import annotations

import ctypes
import platform
import struct
from pathlib import Path
from typing import Callable

# Linux UAPI constants: linux/prctl.h, linux/seccomp.h, linux/filter.h, linux/audit.h
PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 38, 22, 2
SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO = 0x7FFF0000, 0x00050000
_LD_W_ABS, _JEQ_K, _JSET_K, _RET_K = 0x20, 0x15, 0x45, 0x06
#: machine (``platform.machine()``) → (AUDIT_ARCH value, fchmod's system-call number)
ARCHES = {"x86_64": (0xC000003E, 91), "aarch64": (0xC00000B7, 52), "arm64": (0xC00000B7, 52)}
#: Offsets in ``struct seccomp_data``: nr, arch, the low 32 bits of args[1] (little-endian): fchmod's mode.
_NR, _ARCH, _ARG1 = 0, 4, 24
#: Mode bits an ignored fchmod would grant: any for group or other, on a file without an execute bit.
OTHERS, EXECUTE = 0o077, 0o111


def fchmod_filter(arch: int, nr_fchmod: int) -> bytes:
    """The BPF program (``struct sock_filter[]``, 8 bytes each): ``fchmod(fd, mode)`` with ``mode & 0o077`` and no
    ``mode & 0o111`` returns 0 without running; everything else is allowed."""
    prog = [(_LD_W_ABS, 0, 0, _ARCH),
            (_JEQ_K, 0, 6, arch),          # another ABI: allow
            (_LD_W_ABS, 0, 0, _NR),
            (_JEQ_K, 0, 4, nr_fchmod),     # not fchmod: allow
            (_LD_W_ABS, 0, 0, _ARG1),
            (_JSET_K, 2, 0, EXECUTE),      # an executable's mode: allow
            (_JSET_K, 0, 1, OTHERS),       # private already: allow
            (_RET_K, 0, 0, SECCOMP_RET_ERRNO | 0),  # "succeeds", changes nothing
            (_RET_K, 0, 0, SECCOMP_RET_ALLOW)]
    return b"".join(struct.pack("=HBBI", *ins) for ins in prog)


class _Fprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def private_fchmod(machine: str | None = None) -> Callable[[], None] | None:
    """A ``preexec_fn`` that installs the filter in the child before it runs tritonserver, or None where this machine's
    architecture is not known. Everything is prepared here, in the parent; the child only makes two ``prctl`` calls,
    and a refusal there is left silent (the server then starts without the filter: :func:`filter_installed`)."""
    known = ARCHES.get(machine or platform.machine())
    if known is None:
        return None
    program = ctypes.create_string_buffer(fchmod_filter(*known))
    fprog = _Fprog(len(program.raw) // 8, ctypes.addressof(program))
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong]
    fprog_ptr = ctypes.addressof(fprog)

    def install() -> None:
        if prctl(PR_SET_NO_NEW_PRIVS, 1, None, 0, 0) == 0:
            prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, fprog_ptr, 0, 0)

    install.keep = (program, fprog)  # the memory fprog_ptr points to lives as long as the callable
    return install


def filter_installed(pid: int) -> bool:
    """True when process ``pid`` runs under a seccomp filter (``Seccomp: 2`` in ``/proc/<pid>/status``)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return any(line.split() == ["Seccomp:", "2"] for line in status.splitlines())
