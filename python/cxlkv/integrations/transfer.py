"""How the connector's worker moves KV between vLLM's paged blocks and the pool.

One ``Transfer`` per worker, built in ``register_kv_caches`` from the KV arrays. Loads block: vLLM
runs the forward right after ``start_load_kv``. Saves do not: ``submit_save`` starts the copy and
returns a ``SaveHandle``; the step goes on, and the blocks stay owned by the request until the
handle is done (the connector holds them through vLLM's delayed free, see save_tracker.py).

The pool publishes a block only after its bytes and checksum are complete (write-once publish,
ARCHITECTURE.md §6): a save that is still copying is invisible to every reader, and one that fails
leaves nothing behind. ``CpuTransfer`` copies on a worker thread (``ns.store`` releases the GIL);
a CUDA implementation (transfer_cuda.py) keeps this protocol.
"""

from __future__ import annotations

import dataclasses
import os
import queue
import threading
import time
import weakref
from typing import Any, Protocol


@dataclasses.dataclass
class BlockOp:
    req_id: str
    keys: list  # 32-byte keys, one per block
    block_ids: list  # vLLM block ids, same length
    start_depth: int = 0  # position of keys[0] in its prefix chain
    group: int = 0  # vLLM's KV cache group (a hybrid model's; vllm_groups.py)


class SaveHandle(Protocol):
    def done(self) -> bool: ...  # non-blocking

    def result(self) -> int: ...  # waits; number of leading keys present in the pool after the save


class Transfer(Protocol):
    def load(self, op: BlockOp) -> int: ...  # blocking until the bytes are in vLLM's blocks

    def submit_save(self, op: BlockOp) -> SaveHandle: ...  # publishes each block once complete

    def close(self) -> None: ...


# Fault injection for tests (tests/vllm/test_async_saves.py): every save waits this long before it
# copies, which widens the window in which vLLM could reuse the blocks of a save in flight.
SAVE_DELAY_ENV = "CXLKV_TEST_SAVE_DELAY_S"


class CpuSaveHandle:
    """One save: ``result()`` is the number of leading keys present in the pool after it (0 when
    the pool refused the call: ``refused`` then says so); ``seconds`` the copy's duration."""

    def __init__(self, op: BlockOp) -> None:
        self.op = op
        self.refused = False
        self.seconds = 0.0
        self._n = 0
        self._done = threading.Event()

    def done(self) -> bool:
        return self._done.is_set()

    def result(self) -> int:
        self._done.wait()
        return self._n

    def _finish(self, n: int | None, seconds: float) -> None:
        self._n, self.refused, self.seconds = n or 0, n is None, seconds
        self._done.set()


class CpuTransfer:
    """Loads on the caller's thread; saves on ``workers`` threads, in submission order per thread.

    ``session`` is the worker's PoolSession: its ``call`` runs nothing on an unusable pool, opens the
    pool again after a fence and retries a store once on the new node (stores are idempotent), and
    never retries a load (its blocks were pinned by the fenced node's lease: it is reported failed
    and vLLM recomputes)."""

    def __init__(self, session: Any, kv_arrays: list, block_dim: int, *, workers: int = 1) -> None:
        self._session = session
        self._arrays = kv_arrays
        self._block_dim = block_dim
        self._queue: queue.SimpleQueue[CpuSaveHandle | None] = queue.SimpleQueue()
        self._closed = False
        # The threads hold the session and the arrays, not this object: a transfer dropped without
        # close() stops its threads (finalizer) instead of keeping the pool mapped until exit.
        delay = float(os.environ.get(SAVE_DELAY_ENV, "0") or 0)
        args = (self._queue, session, kv_arrays, block_dim, delay)
        self._threads = [
            threading.Thread(target=_save_loop, args=args, name=f"cxlkv-save-{i}", daemon=True)
            for i in range(max(1, workers))
        ]
        for t in self._threads:
            t.start()
        weakref.finalize(self, _stop, self._queue, len(self._threads))

    def load(self, op: BlockOp) -> int:
        n = self._session.call(
            "load",
            lambda ns: ns.load(op.keys, self._arrays, op.block_ids, block_dim=self._block_dim),
            retry=False,
        )
        return n or 0

    def submit_save(self, op: BlockOp) -> CpuSaveHandle:
        handle = CpuSaveHandle(op)
        if self._closed:
            handle._finish(None, 0.0)
        else:
            self._queue.put(handle)
        return handle

    def close(self, timeout_s: float = 30.0) -> None:
        """Lets the queued saves finish (bounded), then stops the threads."""
        if self._closed:
            return
        self._closed = True
        _stop(self._queue, len(self._threads))
        deadline = time.monotonic() + timeout_s
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))


def _stop(q: queue.SimpleQueue, threads: int) -> None:
    for _ in range(threads):
        q.put(None)


def _save_loop(q: queue.SimpleQueue, session: Any, arrays: list, block_dim: int, delay: float) -> None:
    while True:
        handle = q.get()
        if handle is None:
            return
        n: int | None = None
        t0 = time.perf_counter()
        try:
            if delay:
                time.sleep(delay)
            op = handle.op
            n = session.call(
                "store",
                lambda ns, op=op: ns.store(
                    op.keys, arrays, op.block_ids, block_dim=block_dim, start_depth=op.start_depth
                ),
            )
        finally:  # a handle is always finished: the request's blocks are held until it is
            handle._finish(n, time.perf_counter() - t0)
