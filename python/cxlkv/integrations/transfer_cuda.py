"""The CUDA data path of the vLLM connector: ``CudaTransfer`` moves whole KV blocks between
vLLM's paged KV cache on a GPU and the pool with one fused Triton kernel per batch
(kernels/paged.py), on a side stream, through the registered pool mapping (cuda_registration.py).

Protocol (integrations/transfer.py): ``load(op)`` blocks until the bytes are in vLLM's blocks and
returns the leading count loaded; ``submit_save(op)`` returns at once with a handle whose
``done()`` turns true only after the copy's event and the commit. Integrity (docs/ARCHITECTURE.md,
"The CUDA data path"): a save reserves blocks (Namespace.reserve), the kernel writes them, the
commit checksums the pool bytes on the CPU and publishes; a load pins and verifies its blocks
(Namespace.pin_verified), the kernel reads them, ``recheck`` verifies them again, and only the
leading intact count is reported: a corrupt block is a miss, never wrong KV.

Ordering: the side stream waits for the compute stream before each copy (a save reads KV the
forward pass wrote; a load overwrites blocks an earlier kernel may still read); a load is synced
before it returns (the forward that reads it is launched afterwards); a save is committed by a
worker thread once its event completed, so the step never waits for it. Until the pool is
registered with CUDA (background, ~0.1 s per GB), or if that failed, each copy is staged through
pinned host memory with the same kernel.

Without CUDA (tests, ``TRITON_INTERPRET=1``), the KV arrays are CPU tensors and the kernels
address the pool bytes directly: the same code paths, synchronously.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from typing import Any

import torch

from cxlkv.errors import CxlkvError
from cxlkv.kernels import paged

log = logging.getLogger("vllm.cxlkv")


class _PoolWords:
    """A pool pointer the Triton launcher accepts: a data_ptr and a dtype (the registered
    mapping is host memory; its device pointer is its host address under UVA)."""

    def __init__(self, addr: int, dtype: torch.dtype, device: torch.device) -> None:
        self._addr, self.dtype, self.device = addr, dtype, device

    def data_ptr(self) -> int:
        return self._addr


class _Attached:
    """What one pool object (the session may open the pool again after a fence) lends us."""

    def __init__(self, pool: Any, device: torch.device, api: Any, background: bool) -> None:
        self.pool = pool
        self.view: Any = pool.transfer_view()  # numpy uint8 over the pool; keeps the mapping alive
        self.size = int(self.view.shape[0])
        self.cpu_bytes: Any = torch.from_numpy(self.view)
        self.registration = None
        if device.type == "cuda":
            from cxlkv.integrations.cuda_registration import register_pool

            self.registration = register_pool(pool, api, background=background)

    def direct(self) -> bool:
        return self.registration is None or self.registration.registered

    def words(self, word_bytes: int, device: torch.device) -> Any:
        w = paged.pool_words(self.cpu_bytes, word_bytes)
        if device.type == "cpu":
            return w
        return _PoolWords(int(self.view.ctypes.data), w.dtype, device)

    def close(self) -> None:
        if self.registration is not None:
            self.registration.close()  # before the view (and maybe the mapping) goes
        self.view = self.cpu_bytes = None


class _Device:
    """Streams and events on a GPU; on the CPU every copy is complete when launched."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.side = torch.cuda.Stream(device=device) if self.cuda else None

    def begin(self):
        """Orders the side stream after the compute stream's work so far; a context to launch in."""
        if not self.cuda:
            return _Null()
        side = self.side
        assert side is not None
        side.wait_stream(torch.cuda.current_stream(side.device))
        return torch.cuda.stream(side)

    def record(self):
        if not self.cuda:
            return None
        ev = torch.cuda.Event()
        ev.record(self.side)
        return ev


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class SaveHandle:
    """done(): non-blocking; result(): waits, leading keys present in the pool after the save."""

    def __init__(self, future: concurrent.futures.Future | None, value: int = 0) -> None:
        self._future, self._value = future, value

    def done(self) -> bool:
        return self._future is None or self._future.done()

    def result(self) -> int:
        return self._value if self._future is None else self._future.result()


class CudaTransfer:
    """One per worker: built in register_kv_caches from vLLM's KV arrays (CUDA tensors, or CPU
    tensors under Triton's interpreter). ``session``: the connector's PoolSession (``call``,
    ``pool``); ``api``: a cuda_registration.CudaApi (tests pass a fake of the CUDA calls)."""

    def __init__(
        self,
        session: Any,
        kv_arrays: list,
        block_dim: int,
        block_bytes: int,
        *,
        api: Any = None,
        background_register: bool = True,
        staging: bool = False,
    ) -> None:
        self._session = session
        self._plan = paged.plan_fragments(kv_arrays, block_dim, block_bytes)
        self._device = self._plan.device
        self._dev = _Device(self._device)
        self._api, self._background = api, background_register
        self._force_staging = staging  # tests: the staging path on the CPU too
        self._attached: _Attached | None = None
        self._lock = threading.Lock()
        self._saver = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="cxlkv-cuda-save")
        self.block_bytes = block_bytes

    # ------------------------------------------------------------------------------------------
    def _attach(self) -> _Attached | None:
        pool = self._session.pool
        with self._lock:
            if self._attached is not None and self._attached.pool is not pool:
                self._attached.close()  # the session opened the pool again: register the new one
                self._attached = None
            if self._attached is None and pool is not None:
                self._attached = _Attached(pool, self._device, self._api, self._background)
            return self._attached

    @property
    def registration(self) -> Any:
        a = self._attached
        return a.registration if a is not None else None

    def _direct(self, a: _Attached) -> bool:
        return a.direct() and not self._force_staging

    # ------------------------------------------------------------------------------------------
    def load(self, op: Any) -> int:
        a = self._attach()
        if a is None or not op.keys:
            return 0
        lease = self._session.call("pin_verified", lambda ns: ns.pin_verified(op.keys), retry=False)
        if lease is None:
            return 0
        try:
            n = len(lease)
            if n == 0:
                return 0
            ids, offs = list(op.block_ids[:n]), list(lease.offsets)
            if self._direct(a):
                with self._dev.begin():
                    paged.scatter(self._plan, a.words(self._plan.word_bytes, self._device), a.size, ids, offs)
            else:
                with self._dev.begin():  # staged buffers are allocated on the side stream
                    staged = self._stage_in(a, offs)
                    paged.scatter(
                        self._plan, staged, staged.numel() * self._plan.word_bytes, ids, self._packed(n)
                    )
            ev = self._dev.record()
            if ev is not None:
                ev.synchronize()  # the bytes are in vLLM's blocks before the forward pass
            return int(lease.recheck())  # intact before and after the device read them
        except CxlkvError as e:
            log.warning("cxlkv: CUDA load of %s failed (%s); vLLM recomputes it", op.req_id, e)
            return 0
        finally:
            lease.release()

    def submit_save(self, op: Any) -> SaveHandle:
        a = self._attach()
        if a is None or not op.keys:
            return SaveHandle(None, 0)
        res = self._session.call("reserve", lambda ns: ns.reserve(op.keys, start_depth=op.start_depth))
        if res is None:
            return SaveHandle(None, 0)
        mine = [i for i, s in enumerate(res.states) if s == "reserved"]
        ids = [op.block_ids[i] for i in mine]
        offs = [res.offsets[i] for i in mine]
        try:
            if self._direct(a):
                with self._dev.begin():
                    paged.gather(self._plan, a.words(self._plan.word_bytes, self._device), a.size, ids, offs)
                staged = None
            else:
                staged = self._stage_out(ids)
            ev = self._dev.record()
        except BaseException:
            res.abort()
            raise
        return SaveHandle(self._saver.submit(self._finish_save, a, res, ev, staged, offs))

    def _finish_save(self, a: _Attached, res: Any, ev: Any, staged: Any, offs: list) -> int:
        """Worker thread: once the copy is complete, the CPU checksums and publishes (commit)."""
        try:
            if ev is not None:
                ev.synchronize()
            if staged is not None:
                host = staged.numpy() if staged.device.type == "cpu" else staged.cpu().numpy()
                bb = self.block_bytes
                for i, o in enumerate(offs):
                    a.view[o : o + bb] = host[i * bb : (i + 1) * bb]
            return int(res.commit())
        except CxlkvError as e:  # fenced or failed pool: nothing is published
            log.warning("cxlkv: CUDA save not committed (%s)", e)
            res.abort()
            return 0

    # ------------------------------------------------------------------------------------------
    # CPU staging: until (or unless) the pool is registered, copies go through host memory, in
    # the pool block layout, and the same kernels pack/unpack them on the device.
    def _packed(self, n: int) -> list:
        return [i * self.block_bytes for i in range(n)]

    def _stage_in(self, a: _Attached, offs: list) -> torch.Tensor:
        bb = self.block_bytes
        host = torch.empty(len(offs) * bb, dtype=torch.uint8, pin_memory=self._dev.cuda)
        hv = host.numpy()
        for i, o in enumerate(offs):
            hv[i * bb : (i + 1) * bb] = a.view[o : o + bb]
        dev = host.to(self._device, non_blocking=True) if self._dev.cuda else host
        return paged.pool_words(dev, self._plan.word_bytes)

    def _stage_out(self, ids: list) -> torch.Tensor:
        bb = self.block_bytes
        with self._dev.begin():  # allocated on the side stream, which uses it
            dev = torch.empty(len(ids) * bb, dtype=torch.uint8, device=self._device)
            paged.gather(
                self._plan,
                paged.pool_words(dev, self._plan.word_bytes),
                dev.numel(),
                ids,
                self._packed(len(ids)),
            )
            if not self._dev.cuda:
                return dev
            host = torch.empty(dev.numel(), dtype=torch.uint8, pin_memory=True)
            host.copy_(dev, non_blocking=True)
        return host

    def close(self) -> None:
        self._saver.shutdown(wait=True)  # every save committed or aborted
        with self._lock:
            if self._attached is not None:
                self._attached.close()
                self._attached = None
