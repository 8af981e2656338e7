"""Registering the pool mapping with CUDA, so that a GPU kernel reads and writes pool blocks
through UVA pointers (no staging copy).

- ``cudaHostRegister(mapped | portable)`` in ranges of at most 64 GiB cut between chunks
  (``Pool.transfer_ranges``: one call of >= 512 GiB fails on recent drivers, and no block is split
  between two ranges);
- every return code checked; after a failure CUDA's sticky error is cleared (``cudaGetLastError``)
  and every range registered so far is unregistered again;
- the device pointer of each range must equal its host address (UVA,
  ``cudaDevAttrCanUseHostPointerForRegisteredMem``): the kernels address the pool by host offsets;
- it runs in a background thread (~0.1 s per GB on current drivers); until it is done, or when it
  failed, the transfer uses its CPU staging path. It is never reported as registered when it
  failed: then one log line says why.

The CUDA runtime is reached through ctypes on the ``libcudart`` that torch already loaded: no build
dependency, imported only when a CUDA transfer is built. Tests pass their own ``CudaApi``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import threading
import time
from typing import Any, Protocol

HOST_REGISTER_PORTABLE = 0x01
HOST_REGISTER_MAPPED = 0x02
MAX_RANGE_BYTES = 64 << 30
DEV_ATTR_CAN_USE_HOST_POINTER = 91  # cudaDevAttrCanUseHostPointerForRegisteredMem

log = logging.getLogger("vllm.cxlkv")


class CudaApi(Protocol):
    """The CUDA runtime calls registration needs; each returns CUDA's error code (0: success)."""

    def host_register(self, addr: int, size: int, flags: int) -> int: ...
    def host_unregister(self, addr: int) -> int: ...
    def get_last_error(self) -> int: ...
    def device_pointer(self, addr: int) -> tuple[int, int]: ...  # (error, device pointer)
    def can_use_host_pointer(self) -> bool: ...
    def error_name(self, code: int) -> str: ...


class CtypesCudart:
    """CudaApi over libcudart (the one torch loaded, else the system's)."""

    def __init__(self, device: int = 0) -> None:
        self._lib = ctypes.CDLL(_find_cudart())
        self._device = device
        vp, sz, ui = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint
        self._lib.cudaHostRegister.argtypes = [vp, sz, ui]
        self._lib.cudaHostUnregister.argtypes = [vp]
        self._lib.cudaHostGetDevicePointer.argtypes = [ctypes.POINTER(vp), vp, ui]
        self._lib.cudaDeviceGetAttribute.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_int]
        self._lib.cudaGetErrorName.restype = ctypes.c_char_p

    def host_register(self, addr: int, size: int, flags: int) -> int:
        return int(self._lib.cudaHostRegister(ctypes.c_void_p(addr), size, flags))

    def host_unregister(self, addr: int) -> int:
        return int(self._lib.cudaHostUnregister(ctypes.c_void_p(addr)))

    def get_last_error(self) -> int:
        return int(self._lib.cudaGetLastError())

    def device_pointer(self, addr: int) -> tuple[int, int]:
        out = ctypes.c_void_p()
        err = int(self._lib.cudaHostGetDevicePointer(ctypes.byref(out), ctypes.c_void_p(addr), 0))
        return err, int(out.value or 0)

    def can_use_host_pointer(self) -> bool:
        v = ctypes.c_int(0)
        err = self._lib.cudaDeviceGetAttribute(ctypes.byref(v), DEV_ATTR_CAN_USE_HOST_POINTER, self._device)
        return err == 0 and v.value == 1

    def error_name(self, code: int) -> str:
        name = self._lib.cudaGetErrorName(code)
        return name.decode() if name else f"cudaError {code}"


def _find_cudart() -> str:
    try:  # the runtime torch loaded: the same one its kernels use
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.split()[-1]
                if "libcudart.so" in path:
                    return path
    except OSError:
        pass
    found = ctypes.util.find_library("cudart")
    if not found:
        raise OSError("libcudart not found (is torch built with CUDA?)")
    return found


class Registration:
    """The pool mapping's registration with CUDA: ``state`` is "pending", "registered" or "failed"
    (``reason`` says why); ``registered`` is True only once every range is registered and usable."""

    def __init__(self, view: Any, ranges: list, api: CudaApi, *, background: bool = True) -> None:
        self._view = view  # the pool bytes (numpy array): keeps the mapping alive while registered
        self._base = int(view.ctypes.data)
        self._ranges = [(int(o), int(n)) for o, n in ranges]
        self._api = api
        self._done: list[int] = []  # host addresses registered
        self._lock = threading.Lock()
        self.state = "pending"
        self.reason = ""
        self.seconds = 0.0
        self._thread: threading.Thread | None = None
        if background:
            self._thread = threading.Thread(target=self._run, name="cxlkv-cuda-register", daemon=True)
            self._thread.start()
        else:
            self._run()

    @property
    def registered(self) -> bool:
        return self.state == "registered"

    def wait(self, timeout: float | None = None) -> bool:
        if self._thread is not None:
            self._thread.join(timeout)
        return self.registered

    def _run(self) -> None:
        t0 = time.perf_counter()
        total = sum(n for _, n in self._ranges)
        try:
            if not self._api.can_use_host_pointer():
                raise _Failed("the GPU cannot use host pointers of registered memory (no UVA)")
            for off, n in self._ranges:
                addr = self._base + off
                err = self._api.host_register(addr, n, HOST_REGISTER_MAPPED | HOST_REGISTER_PORTABLE)
                if err:
                    raise _Failed(
                        f"cudaHostRegister of {n} bytes at pool offset {off}: {self._api.error_name(err)}"
                    )
                with self._lock:
                    self._done.append(addr)
                err, dev = self._api.device_pointer(addr)
                if err or dev != addr:
                    raise _Failed(
                        f"cudaHostGetDevicePointer at pool offset {off}: "
                        + (self._api.error_name(err) if err else f"device pointer {dev:#x} != host {addr:#x}")
                    )
        except _Failed as e:
            self._fail(str(e))
            return
        except Exception as e:  # noqa: BLE001 - any failure means: not registered, staging path
            self._fail(f"{type(e).__name__}: {e}")
            return
        self.seconds = time.perf_counter() - t0
        with self._lock:
            self.state = "registered"
        log.info(
            "cxlkv: pool mapping registered with CUDA: %.1f GiB in %d ranges, %.2f s",
            total / 2**30,
            len(self._ranges),
            self.seconds,
        )

    def _fail(self, why: str) -> None:
        self._api.get_last_error()  # clear the sticky error, so that the next CUDA call is not blamed
        self._unregister_all()
        with self._lock:
            self.state, self.reason = "failed", why
        log.warning("cxlkv: the pool is not registered with CUDA (%s); using the CPU staging path", why)

    def _unregister_all(self) -> None:
        with self._lock:
            done, self._done = self._done, []
        for addr in reversed(done):
            if self._api.host_unregister(addr):
                self._api.get_last_error()

    def close(self) -> None:
        """Unregisters (after waiting for a background registration to finish)."""
        if self._thread is not None:
            self._thread.join()
        self._unregister_all()
        with self._lock:
            if self.state == "registered":
                self.state, self.reason = "failed", "closed"
        self._view = None


class _Failed(Exception):
    pass


class SharedRegistration:
    """One user's hold on a mapping's Registration (register_pool): the same state, reason and
    seconds; close() lets go, and the last user's close unregisters. One mapping is registered
    once per process: a second cudaHostRegister of its ranges fails (already registered), which
    would leave every transfer but the first of a worker (one per KV cache group of a hybrid model,
    one per local head or state unit at TP > 1) on the staging path."""

    def __init__(self, key: tuple, reg: Registration) -> None:
        self._key, self._reg, self._closed = key, reg, False

    state = property(lambda self: self._reg.state)
    reason = property(lambda self: self._reg.reason)
    seconds = property(lambda self: self._reg.seconds)
    registered = property(lambda self: self._reg.registered)

    def wait(self, timeout: float | None = None) -> bool:
        return self._reg.wait(timeout)

    def close(self) -> None:
        with _shared_lock:
            if self._closed:
                return
            self._closed = True
            held = _shared[self._key]
            held[1] -= 1
            last = held[1] == 0
            if last:
                del _shared[self._key]
        if last:
            self._reg.close()


# (mapping base address, size, CudaApi given or 0) -> [Registration, users]. A mapping cannot be
# unmapped while its registration holds its view, so its address is not reused meanwhile.
_shared: dict[tuple, list] = {}
_shared_lock = threading.Lock()


def register_pool(
    pool: Any, api: CudaApi | None = None, *, background: bool = True, max_range_bytes: int = MAX_RANGE_BYTES
) -> SharedRegistration:
    """Registers ``pool``'s mapping (a cxlkv.Pool) with CUDA, or joins its registration when this
    process registered it already (SharedRegistration); see Registration."""
    view = pool.transfer_view()
    key = (int(view.ctypes.data), int(view.shape[0]), id(api) if api is not None else 0)
    with _shared_lock:
        held = _shared.get(key)
        if held is not None:
            held[1] += 1
            return SharedRegistration(key, held[0])
        ranges = pool.transfer_ranges(max_range_bytes)
        if api is None:
            try:
                api = CtypesCudart()
            except OSError as e:
                api = _Unavailable(str(e))
        reg = Registration(view, ranges, api, background=background)
        _shared[key] = [reg, 1]
        return SharedRegistration(key, reg)


class _Unavailable:
    """The CudaApi of a process without a CUDA runtime: registration fails with the reason."""

    def __init__(self, why: str) -> None:
        self._why = why

    def can_use_host_pointer(self) -> bool:
        raise _Failed(self._why)

    def host_register(self, addr: int, size: int, flags: int) -> int:
        return 1

    def host_unregister(self, addr: int) -> int:
        return 0

    def get_last_error(self) -> int:
        return 0

    def device_pointer(self, addr: int) -> tuple[int, int]:
        return 1, 0

    def error_name(self, code: int) -> str:
        return self._why
