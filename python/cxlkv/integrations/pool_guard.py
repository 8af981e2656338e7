"""A pool that goes bad under a serving engine degrades the engine to "no cache", never kills it.

The pool file can be truncated, deleted or replaced while an engine has it mapped, and any call
into the pool can raise (a corrupt header, a full table, a bug). The connector asks
:meth:`PoolGuard.usable` at the entry of every hook and runs pool calls through
:meth:`PoolGuard.call`; the first problem is logged once (naming the pool and the cause) and from
then on the process serves without the cache: vLLM recomputes everything.

Truncation is the dangerous one: touching a page past the new end of the file raises SIGBUS.
:meth:`usable` compares the path's inode and size with what was mapped (a ``stat``, rate-limited
to ``check_interval_s``) before the hook touches the pool, so a truncation between two steps is
seen before any access. A truncation during a copy is the core's to convert into
``PoolTruncatedError`` (caught here like any error). Once the file is known to be truncated, the
pool is closed before any lease of it is released (:meth:`PoolGuard.retire`): the core's close
checks the file's size before it touches the node area, and a lease of a closed pool drops its
pins without touching the mapping (an access that still reaches a truncated page reads the zero
page the core's SIGBUS guard maps there). Nothing is kept alive past its owner: an earlier
version leaked such pools and leases on purpose, and nanobind reported them at every exit.

The verdict is process-wide (keyed by the mapped file's device, inode and pool uuid), so the scheduler-side
and worker-side connectors of one process stop together.

A fence (``FencedError``: this node may have been declared dead by a peer) is not a bad pool: it is
raised through :meth:`call` and :meth:`retire` for pool_session.py, which opens the pool again.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from cxlkv.errors import FencedError

T = TypeVar("T")

# (st_dev, st_ino, pool uuid) of a mapped pool -> why it may no longer be used (the uuid: inode
# numbers are reused once a file is gone)
_BROKEN: dict[tuple[int, int, str], tuple[str, bool]] = {}  # -> (cause, maybe truncated)
_LOCK = threading.Lock()


class PoolGuard:
    def __init__(self, pool: Any, path: str, logger: logging.Logger, check_interval_s: float = 0.001):
        self.pool = pool
        self.path = path
        self.log = logger
        self.check_interval_s = check_interval_s
        self._next_check = 0.0
        self.cause: str | None = None
        self.truncated = False
        if pool is None:  # see unusable()
            self._file, self._key = (0, 0), (0, 0, f"unopened:{path}")
            return
        info = pool.info()
        devices = info.get("devices") or []
        if len(devices) > 1:  # a striped pool: every device file, with the bytes it must keep
            self._files = [
                (d["path"], (d["file_dev"], d["file_ino"]), int(d["device_bytes"])) for d in devices
            ]
        else:
            st = os.stat(path)
            # The core's own view of the inode it mapped where it has one (no stat race at open).
            self._files = [(path, (st.st_dev, int(info.get("file_ino", st.st_ino))), int(pool.size))]
        self._file = self._files[0][1]
        self._key = (*self._file, str(info.get("uuid", "")))

    @classmethod
    def unusable(cls, path: str, logger: logging.Logger, cause: str, exc: BaseException) -> PoolGuard:
        """A guard for a pool that could not even be opened: logs why, once; never usable."""
        guard = cls(None, path, logger)
        guard.fail(cause, exc)
        return guard

    @property
    def identity(self) -> tuple[int, int, str]:
        """(st_dev, st_ino, uuid) of the mapped pool: which pool this is, across reopens."""
        return self._key

    # -------------------------------------------------------------------------------------------
    def _file_problem(self) -> str | None:
        for path, identity, size in self._files:
            what = "the pool file" if len(self._files) == 1 else f"the pool device {path}"
            try:
                st = os.stat(path)
            except FileNotFoundError:
                return f"{what} was deleted"
            except OSError as e:
                return f"{what} cannot be stat'ed ({e.strerror})"
            if (st.st_dev, st.st_ino) != identity:
                return f"{what} was replaced by another file"
            if stat.S_ISREG(st.st_mode) and st.st_size < size:  # a devdax device has no file size
                self.truncated = True
                return f"{what} was truncated to {st.st_size} bytes (mapped {size})"
        replaced = getattr(self.pool, "file_replaced", None)
        if replaced is not None and replaced():
            return "the pool file was replaced (core check)"
        return None

    def usable(self) -> bool:
        """False once the pool is known bad (here or in another connector of this process)."""
        if self.cause is not None:
            return False
        shared = _BROKEN.get(self._key)
        if shared is not None:
            self.cause, self.truncated = shared
            return False
        now = time.monotonic()
        if now >= self._next_check:
            self._next_check = now + self.check_interval_s
            problem = self._file_problem()
            if problem is not None:
                self.fail(problem)
                return False
        return True

    def fail(self, cause: str, exc: BaseException | None = None) -> None:
        """Marks the pool unusable for this process; logs once per process and pool."""
        if exc is not None:
            cause = f"{cause}: {type(exc).__name__}: {exc}"
            if type(exc).__name__ == "PoolTruncatedError":
                self.truncated = True
        with _LOCK:
            first = self._key not in _BROKEN
            _BROKEN.setdefault(self._key, (cause, self.truncated))
        self.cause, self.truncated = _BROKEN[self._key]
        if first:
            self.log.error(
                "cxlkv: pool %s is no longer usable (%s); this process serves without "
                "the KV cache from now on (vLLM recomputes)",
                self.path,
                cause,
            )

    def call(self, what: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T | None:
        """fn(*args) if the pool is usable and the call succeeds; None otherwise."""
        if not self.usable():
            return None
        try:
            return fn(*args, **kwargs)
        except FencedError:
            raise  # this node's, not the pool's: the caller opens the pool again
        except Exception as e:  # noqa: BLE001 - any pool failure degrades to "no cache"
            self.fail(f"{what} failed", e)
            return None

    def retire(self, obj: Any) -> None:
        """Drops obj (a lease, the pool) in a way that is safe for a bad pool: a truncated pool is
        closed first (its close and its leases' releases then leave the mapping untouched)."""
        if obj is None:
            return
        if not self.usable() and not self.truncated:
            self._file_problem()  # a file deleted first may have been truncated since
        if self.truncated and self.pool is not None and obj is not self.pool:
            self._drop(self.pool)
        self._drop(obj)

    def _drop(self, obj: Any) -> None:
        try:
            (getattr(obj, "release", None) or obj.close)()
        except FencedError:
            raise  # the core keeps the lease's pins and drops them untouched later
        except Exception as e:  # noqa: BLE001
            self.fail("release failed", e)

    def release_pool(self) -> None:
        """Closes the pool (as :meth:`retire` does) and forgets it: from then on the files are
        judged by ``stat`` alone (a closed pool answers nothing)."""
        self.retire(self.pool)
        self.pool = None
