"""Where the default pool lives.

/dev/shm is world-writable: a pool at a fixed name there can be pre-created by any user, who then
reads (and can corrupt) the KV of every process that attaches to it. The default pool therefore
lives in a per-user directory, ``/dev/shm/cxlkv-<euid>/``, created with mode 0700; before using it
we check that it is a real directory (not a symlink), owned by us and closed to others, so another
user cannot pre-create it silently. ``$CXLKV_POOL`` overrides the whole path.

This module is the one place that resolves the default pool path: the library, every CLI command
and the vLLM connector call :func:`default_pool_path`, so they always name the same pool. Imports
nothing heavy: the CLI reads the default without loading the core.
"""

from __future__ import annotations

import os
import stat

DEFAULT_POOL_DIR = f"/dev/shm/cxlkv-{os.geteuid()}"


# A pool striped over several devices is named by their paths joined with this separator, device
# 0 first ("/dev/shm/a,/dev/shm/b"): the same string works wherever a pool path is taken
# (API, CLI, $CXLKV_POOL, the vLLM connector's pool_path). The core splits it (striping.h).
DEVICE_SEPARATOR = ","


def device_paths(pool_path: str) -> list[str]:
    """The device paths a pool path names: one for a single-device pool."""
    return pool_path.split(DEVICE_SEPARATOR)


def join_device_paths(paths) -> str:
    """A pool path from a path or a sequence of device paths (device 0 first)."""
    if isinstance(paths, (list, tuple)):
        return DEVICE_SEPARATOR.join(os.fspath(p) for p in paths)
    return os.fspath(paths)


def default_pool_path() -> str:
    """``$CXLKV_POOL`` if set (read now, not at import), else ``/dev/shm/cxlkv-<euid>/pool``."""
    return os.environ.get("CXLKV_POOL") or os.path.join(DEFAULT_POOL_DIR, "pool")


# The default as it was when cxlkv was imported (kept for callers that read a constant).
DEFAULT_POOL_PATH = default_pool_path()


def ensure_private_dir(path: str) -> None:
    """If ``path`` (or a device of it) lies in the default per-user directory, create that
    directory (0700) when missing, and refuse it (PermissionError) when it is not ours alone."""
    for device in device_paths(path):
        _ensure_private_dir_of(device)


def _ensure_private_dir_of(path: str) -> None:
    d = os.path.dirname(os.path.abspath(path))
    if d != DEFAULT_POOL_DIR:
        return
    try:
        os.mkdir(d, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(d)
    if not stat.S_ISDIR(st.st_mode):
        raise PermissionError(
            f"{d} is not a directory (a symlink or a file put there by someone else); "
            f"remove it or set CXLKV_POOL"
        )
    if st.st_uid != os.geteuid():
        raise PermissionError(
            f"{d} is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()}): "
            f"someone else created it; remove it or set CXLKV_POOL"
        )
    if stat.S_IMODE(st.st_mode) & 0o077:
        raise PermissionError(
            f"{d} is open to other users (mode {stat.S_IMODE(st.st_mode):04o}); "
            f"chmod 700 it or set CXLKV_POOL"
        )
