"""The connector's attachment to the pool (pool, namespace, guard) as one object that outlives its
node: a node that was fenced opens the pool again by itself.

A node is fenced when a peer may have declared it dead (ARCHITECTURE.md §3, §11): its process was
paused past the lease (GC, SIGSTOP, VM migration) or reaped by force. The pool is fine; only this
handle publishes nothing more, and every call on it raises ``FencedError``. So a fence, unlike the
failures of pool_guard.py, does not turn the process into "no cache". The session:

* closes the fenced handle. Leases taken through it become no-ops (the core drops the pins of a
  fenced or closed pool without touching the pool; they and the old node's slot are reclaimed as a
  dead node's), so no lease or namespace of the old node is ever used again;
* attaches again (a new node) and opens the namespace again under the same name;
* logs one WARNING per fence naming the pool and both nodes, and counts it (``pool_fenced``);
* retries the call that saw the fence once, on the new node: lookups, stores and deletes are
  idempotent. Not a load (``retry=False``): its blocks were pinned by the fenced node's lease, so it
  is reported failed like any failed load, and vLLM recomputes.

Thread-safe: the connector's worker loads on vLLM's thread while its saves run on a transfer
thread (transfer.py). A pool call runs outside the session's lock (a load never waits for a save's
copy); a fence is handled once, under the lock: a thread whose call failed on a handle that another
thread has replaced meanwhile (fenced and closed under it) retries on the new one instead of
judging the pool.

Bounded: a reopen that fails MAX_REOPENS times in a row (RETRY_DELAY_S, then twice that, apart;
no cache meanwhile) falls back to the guard's verdict, with one ERROR line: no cache for the rest
of the process. A pool file that is broken (truncated, deleted, replaced) is the guard's too: a
fence seen on such a file is not reopened.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from cxlkv.errors import ClosedError, CxlkvError, FencedError
from cxlkv.integrations.pool_guard import PoolGuard

T = TypeVar("T")

MAX_REOPENS = 3
RETRY_DELAY_S = 1.0


class _Superseded(FencedError):
    """A call failed on a handle that another thread replaced meanwhile (it was fenced)."""


class PoolSession:
    """``open_pool(create)`` attaches (create: the pool may not exist yet, first open only);
    ``open_namespace(pool)`` opens the connector's namespace in it; ``count(key)`` adds one to the
    connector's stats; ``who`` names the connector in log lines. ``fail_fast``: an error of the
    first open is raised instead of serving without the cache."""

    def __init__(
        self,
        path: str,
        logger: logging.Logger,
        open_pool: Callable[[bool], Any],
        open_namespace: Callable[[Any], Any],
        *,
        who: str = "",
        check_interval_s: float = 0.001,
        count: Callable[[str], None] = lambda key: None,
        fail_fast: bool = False,
    ):
        self.path, self.log, self.who = path, logger, who
        self._open_pool, self._open_namespace = open_pool, open_namespace
        self._check_interval_s = check_interval_s
        self._count = count
        self.pool: Any = None
        self.ns: Any = None
        self.node = 0  # read at attach: a fenced pool answers nothing, not even its node id
        self.fences = 0  # fences seen by this session (also counted as pool_fenced)
        self._fenced_node = 0  # != 0: fenced, not yet attached again
        self._fenced_in = ""
        self._failures = 0  # reopens failed in a row
        self._next_try = 0.0
        self._lock = threading.RLock()
        self._generation = 0  # +1 per attach: which handle a call ran on
        self._closed = False  # close() was called: calls raise ClosedError from then on
        try:
            self._attach(create=True)
        except (CxlkvError, OSError, ValueError) as e:
            if fail_fast:
                raise
            self.guard = PoolGuard.unusable(path, logger, "opening it failed", e)

    def _attach(self, create: bool) -> None:
        pool = self._open_pool(create)
        try:
            guard = PoolGuard(pool, self.path, self.log, self._check_interval_s)
            ns = self._open_namespace(pool)
            node = pool.node_id
        except BaseException:
            pool.close()
            raise
        self.pool, self.guard, self.ns, self.node = pool, guard, ns, node
        self._generation += 1

    # -------------------------------------------------------------------------------------------
    def usable(self) -> bool:
        """False while a fence is not recovered from, and once the pool is known bad."""
        with self._lock:
            if self._fenced_node and not self._reopen():
                return False
            return self.guard.usable()

    @property
    def disabled(self) -> bool:
        """True once the pool is known bad: no cache for the rest of the process (a fence being
        recovered from is not that)."""
        return self.guard.cause is not None

    def call(self, what: str, fn: Callable[..., T], *, retry: bool = True) -> T | None:
        """fn(namespace) if the pool is usable and the call succeeds; None otherwise. After a
        fence, once more on the new node when ``retry``."""
        with self._lock:
            if self._closed:
                raise ClosedError(f"cxlkv {self.who or 'session'}: {what} after close()")
            if not self.usable():
                return None
            guard, ns, generation = self.guard, self.ns, self._generation

        def run(ns: Any) -> T:
            try:
                return fn(ns)
            except Exception:
                if self._generation != generation:
                    raise _Superseded() from None
                raise

        try:
            return guard.call(what, run, ns)
        except FencedError as e:
            with self._lock:
                # Ours to handle unless another thread has opened the pool again meanwhile.
                mine = not isinstance(e, _Superseded) and self._generation == generation
                if (mine and not self._fenced(what)) or not retry:
                    return None
        return self.call(what, fn, retry=False)

    def retire(self, obj: Any) -> None:
        """Drops a lease (see PoolGuard.retire); a lease of a fenced node is dropped untouched."""
        with self._lock:
            try:
                self.guard.retire(obj)
            except FencedError:
                self._fenced("release")

    def close(self) -> None:
        """Releases the pool for good; idempotent. A later call() raises ClosedError."""
        with self._lock:
            self._closed = True
            self._release()

    def _release(self) -> None:
        self.guard.release_pool()
        self.pool = self.ns = None

    # -------------------------------------------------------------------------------------------
    def _fenced(self, what: str) -> bool:
        """This node was fenced: a new one if the pool itself is sound. True once reattached."""
        self.fences += 1
        self._count("pool_fenced")
        if not self.guard.usable():  # a broken file (or another connector's verdict) wins
            return False
        self._fenced_node, self._fenced_in = self.node or -1, what
        self._release()
        self._failures, self._next_try = 0, 0.0
        return self._reopen()

    def _reopen(self) -> bool:
        now = time.monotonic()
        if now < self._next_try:
            return False
        old, fenced_guard = self._fenced_node, self.guard
        try:
            self._attach(create=False)
        except (CxlkvError, OSError, ValueError) as e:
            self._failures += 1
            if self._failures >= MAX_REOPENS:
                self._fenced_node = 0  # the guard's verdict from now on
                self.guard.fail(
                    f"node {old} was fenced and opening the pool again failed {self._failures} times", e
                )
                return False
            self._next_try = now + RETRY_DELAY_S * 2 ** (self._failures - 1)
            self.log.warning(
                "cxlkv%s: pool %s: node %d was fenced; opening the pool again failed (%s: %s), "
                "try %d of %d; serving without the KV cache meanwhile",
                self.who,
                self.path,
                old,
                type(e).__name__,
                e,
                self._failures,
                MAX_REOPENS,
            )
            return False
        self._fenced_node = 0
        if self.guard.identity != fenced_guard.identity:  # another pool file at the path since
            self._release()
            self.guard = fenced_guard
            fenced_guard.fail(f"node {old} was fenced, and the file at the path is another pool now")
            return False
        self.log.warning(
            "cxlkv%s: pool %s: node %d was fenced (seen in %s): paused or reaped past its lease; "
            "opened the pool again as new node %d, serving with the KV cache again (fence %d of this "
            "connector, counted as pool_fenced)",
            self.who,
            self.path,
            old,
            self._fenced_in,
            self.node,
            self.fences,
        )
        return True
