"""What a client of ``tritonserver`` may reach, and what the server leaves readable or behind.

Triton's control APIs let any client that reaches a port change the server: the model repository API loads a
model from files uploaded with the request (a Python model's ``model.py`` then runs in the server, as its user)
and unloads the ensemble; the system and CUDA shared-memory APIs make the server read and write a region named
by the client (the Python backend's own regions hold request text); the logging and trace APIs change what is
written where (trace level ``TENSORS`` writes request tensors). :func:`restricted_api_args` puts these behind
Triton's restricted-API mechanism (``--http-restricted-api`` / ``--grpc-restricted-protocol``, tritonserver 2.51:
``<apis>:<header>=<value>``; a request without the header and value gets HTTP 403 or gRPC UNAVAILABLE,
"This API is restricted"). Health, metadata, model configuration, statistics and inference stay open.

Without an admin key the header is one no client can send (its name holds a ``:``, which ends a header name in
HTTP/1.1 and is refused in HTTP/2's), so the control APIs are off; its name is written to read as the answer's
reason (:data:`NO_KEY_HEADER`). With ``splitspec serve --admin-key KEY`` a
request carrying ``splitspec-admin-key: KEY`` (HTTP) or the metadata ``triton-grpc-protocol-splitspec-admin-key:
KEY`` (gRPC: Triton prefixes the name) is let through (:func:`admin_headers`). The key is on tritonserver's
command line, which other local users can read in the process list: it guards the ports against remote clients,
not against users of the same machine.

:data:`SERVER_UMASK` is the umask tritonserver and every process it starts run with: what they create is their
user's only. The Python backend's ``/dev/shm`` regions, which hold request and response tensors, escape a umask: the
backend (Boost.Interprocess) sets their mode to 0644 with ``fchmod`` after creating one for each model instance
and passing its name to the instance's stub (``triton_python_backend_stub <model.py> <region> ...``). tritonserver
therefore starts under the seccomp filter of :mod:`splitspec.serving.seccomp`, which turns that ``fchmod`` into a
no-op: the regions stay 0600 from creation. Where the filter cannot be installed, each of our models still calls
:func:`make_stub_region_private` as it initialises, before the model takes a request; a local user who opened a
region in the seconds before keeps the open descriptor. :func:`remove_shm_regions` removes a server's regions
(named from its ``shm-region-prefix-name``) once it is gone: a killed backend cannot remove them itself.
"""

from __future__ import annotations

import contextlib
import glob
import os
import re
import sys
from pathlib import Path

from splitspec.errors import ConfigError

#: Header (HTTP) / metadata key (gRPC, after :data:`GRPC_HEADER_PREFIX`) that carries the admin key.
ADMIN_HEADER = "splitspec-admin-key"
#: tritonserver 2.51 looks the restricted-protocol key up under this prefix in gRPC metadata.
GRPC_HEADER_PREFIX = "triton-grpc-protocol-"
#: The control APIs restricted (tritonserver's names, the same for HTTP and gRPC).
CONTROL_APIS = ("model-repository", "shared-memory", "logging", "trace")
#: Header name required when no admin key is set: the ``:`` makes it one that no HTTP or gRPC request can carry.
#: tritonserver's refusal quotes it (``This API is restricted, expecting header '...'``), so it says how to open the
#: API (no ``=`` or ``,``: tritonserver's option syntax).
NO_KEY_HEADER = f"{ADMIN_HEADER}: none; start splitspec serve with --admin-key KEY to open this API"
#: Admin keys: 16 or more characters that are valid in an HTTP header value and in gRPC metadata, and not
#: ``,``, ``:`` or ``=``, which tritonserver's option syntax uses.
ADMIN_KEY_PATTERN = re.compile(r"[A-Za-z0-9._~+/-]{16,}")
#: umask of tritonserver and its children: what they create is readable and writable by their user only.
SERVER_UMASK = 0o077
#: Where the Python backend creates its shared-memory regions (POSIX ``shm_open``).
SHM_DIR = Path("/dev/shm")
#: Mode of a region once :func:`make_stub_region_private` ran: read and write for the server's user only.
PRIVATE_MODE = 0o600


def check_admin_key(key: str) -> str:
    """Return ``key`` when it can serve as the admin key.

    Raises:
        ConfigError: it is shorter than 16 characters or holds a character outside ``A-Z a-z 0-9 . _ ~ + / -``.
    """
    if not ADMIN_KEY_PATTERN.fullmatch(key):
        raise ConfigError(f"--admin-key: expected 16 or more characters from A-Z a-z 0-9 . _ ~ + / - "
                          f"(got {len(key)} characters{'' if key.isascii() else ', not all ASCII'}); "
                          "e.g. python -c 'import secrets; print(secrets.token_urlsafe(24))'")
    return key


def restricted_api_args(admin_key: str | None = None) -> list[str]:
    """tritonserver arguments that restrict :data:`CONTROL_APIS` on HTTP and gRPC to requests carrying
    ``admin_key`` (None: to no request at all).

    Raises:
        ConfigError: see :func:`check_admin_key`.
    """
    header, value = (ADMIN_HEADER, check_admin_key(admin_key)) if admin_key is not None else (NO_KEY_HEADER, "off")
    rule = f"{','.join(CONTROL_APIS)}:{header}={value}"
    return [f"--http-restricted-api={rule}", f"--grpc-restricted-protocol={rule}"]


def admin_headers(admin_key: str, protocol: str = "http") -> dict[str, str]:
    """Headers (``protocol`` ``"http"``) or gRPC metadata (``"grpc"``: tritonclient's ``headers=``) that let a
    request through to the control APIs of a server started with ``admin_key``."""
    if protocol not in ("http", "grpc"):
        raise ValueError(f"protocol = {protocol!r}: expected 'http' or 'grpc'")
    return {(GRPC_HEADER_PREFIX if protocol == "grpc" else "") + ADMIN_HEADER: admin_key}


def remove_shm_regions(prefix: str, shm_dir: Path = SHM_DIR) -> int:
    """Remove the shared-memory regions ``<shm_dir>/<prefix>*`` (call only once no process of their server is
    left). Returns the bytes they held; a region that cannot be removed (another user's) is left, and so are all
    when ``shm_dir`` cannot be listed (``EMFILE``): a line on stderr says so, nothing is raised."""
    freed = 0
    try:
        for region in shm_dir.glob(glob.escape(prefix) + "*"):
            with contextlib.suppress(OSError):
                size = region.stat().st_size
                region.unlink()
                freed += size
    except OSError as e:
        print(f"splitspec serve: shared-memory regions {shm_dir}/{prefix}* left: cannot list {shm_dir} ({e.strerror or e})",
              file=sys.stderr, flush=True)
    return freed


def make_stub_region_private(cmdline: Path = Path("/proc/self/cmdline"), shm_dir: Path = SHM_DIR) -> list[Path]:
    """In a Python backend stub (a model's ``initialize``): give the shared-memory region(s) named on the stub's
    command line (``cmdline``, NUL-separated arguments) mode :data:`PRIVATE_MODE`. Elsewhere no argument names a
    region and nothing changes. Returns the regions changed."""
    try:
        args = cmdline.read_bytes().split(b"\0")
    except OSError:
        return []
    changed = []
    for arg in args:
        name = arg.decode(errors="replace")
        region = shm_dir / name
        if not name or "/" in name or not region.is_file():
            continue
        with contextlib.suppress(OSError):  # not ours: leave it
            os.chmod(region, PRIVATE_MODE)
            changed.append(region)
    return changed
