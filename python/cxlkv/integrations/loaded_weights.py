"""Identity of the weights as loaded: a cryptographic digest of every byte of every parameter
tensor an engine holds (its TP rank's shard), in a fixed order.

The sampled file digest (identity.weights_digest) reads three 4 KiB windows per tensor, so an
edit elsewhere in a tensor (a ROME-style rank-one edit of a few rows, a sparse merged adapter)
goes unseen and two different checkpoints share KV. Once the engine has loaded its weights the
bytes are in memory anyway, and hashing all of them costs a fraction of loading them
(docs/IDENTITY.md, "The weights as loaded", has the measurement).

Recipe: parameters sorted by name (tied weights once, under their first name); for each, its
name, dtype, shape and byte count, then sha256 of each CHUNK_BYTES piece of its raw bytes (no
dtype conversion: bf16 is hashed as its 2-byte patterns). Chunks are hashed on a thread pool
(hashlib releases the GIL), so the digest does not depend on the thread count. sha256, not the
core's XXH3: the digest names a namespace other engines write to, and a 64-bit non-cryptographic
hash of weights someone else published can be collided on purpose.

Tensors on an accelerator are copied to the host one chunk at a time (no full host copy).
torch is optional: numpy arrays and buffers work too.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import struct
import sys
import time
import types
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

LOADED_VERSION = "cxlkv/loaded-weights/v1"  # bump when the recipe changes
CHUNK_BYTES = 64 << 20  # unit of parallelism; big enough that per-chunk overhead is nothing
MAX_THREADS = 16

__all__ = [
    "LOADED_VERSION",
    "LoadedDigest",
    "caller_model",
    "files_digest",
    "loaded_weights_digest",
    "module_digest",
]


@dataclasses.dataclass(frozen=True)
class LoadedDigest:
    digest: str  # sha256 hex
    tensors: int
    total_bytes: int
    seconds: float = dataclasses.field(default=0.0, compare=False)
    # Parameters left empty (0 elements): the engine moved their bytes out of reach (vLLM CPU
    # repacks linear weights into oneDNN handles and empties `weight`), so this digest does not
    # cover every weight.
    emptied: int = dataclasses.field(default=0, compare=False)
    kind: str = "loaded"  # "loaded": tensors in memory; "files": every byte of the weight files

    def describe(self) -> str:
        what = "tensors" if self.kind == "loaded" else "files"
        return f"sha256~{self.digest[:16]} (every byte of {self.tensors} {what}, {self.total_bytes / 1e9:.2f} GB)"


def _raw(t: Any) -> tuple[str, tuple, int, Callable[[int, int], Any]]:
    """(dtype, shape, nbytes, read(lo, hi) -> a buffer of bytes [lo, hi)) of a tensor or array."""
    if hasattr(t, "detach"):  # torch
        import torch

        t = t.detach()
        flat = t.contiguous().reshape(-1).view(torch.uint8)  # no copy unless non-contiguous
        if flat.device.type == "cpu":
            host = flat.numpy()
            return str(t.dtype), tuple(t.shape), host.nbytes, lambda lo, hi: host[lo:hi]
        # On an accelerator: one chunk at a time to the host (torch drops the GIL for the copy).
        return str(t.dtype), tuple(t.shape), flat.numel(), lambda lo, hi: flat[lo:hi].cpu().numpy()
    import numpy as np

    a = np.ascontiguousarray(t)
    host = a.reshape(-1).view(np.uint8)
    return str(a.dtype), tuple(a.shape), host.nbytes, lambda lo, hi: host[lo:hi]


def _chunk_digest(job: tuple[Callable[[int, int], Any], int, int]) -> bytes:
    read, lo, hi = job
    return hashlib.sha256(read(lo, hi)).digest()


def loaded_weights_digest(
    named_tensors: Iterable[tuple[str, Any]], threads: int | None = None
) -> LoadedDigest:
    """Digest of every byte of ``named_tensors`` ((name, tensor) pairs; names must be unique)."""
    t0 = time.perf_counter()
    tensors = sorted(named_tensors, key=lambda nt: nt[0])
    names = [n for n, _ in tensors]
    if len(set(names)) != len(names):
        raise ValueError("loaded_weights_digest: duplicate tensor names")
    metas: list[tuple[str, str, tuple, int, int, int]] = []
    jobs: list[tuple[Callable[[int, int], Any], int, int]] = []
    for name, t in tensors:
        dtype, shape, nbytes, read = _raw(t)
        first = len(jobs)
        jobs.extend((read, lo, min(lo + CHUNK_BYTES, nbytes)) for lo in range(0, nbytes, CHUNK_BYTES))
        metas.append((name, dtype, shape, nbytes, first, len(jobs)))
    if threads is None:
        threads = min(MAX_THREADS, len(os.sched_getaffinity(0)))
    with ThreadPoolExecutor(max(1, threads)) as pool:
        chunk_digests = list(pool.map(_chunk_digest, jobs))
    h = hashlib.sha256(LOADED_VERSION.encode())
    total = 0
    for name, dtype, shape, nbytes, first, end in metas:
        head = f"{name}|{dtype}|{','.join(map(str, shape))}".encode()
        h.update(struct.pack("<IQ", len(head), nbytes) + head)
        h.update(b"".join(chunk_digests[first:end]))
        total += nbytes
    return LoadedDigest(h.hexdigest(), len(tensors), total, time.perf_counter() - t0)


def module_digest(module: Any, threads: int | None = None) -> LoadedDigest:
    """Digest of a torch module's parameters (this process's shard of them). Buffers are left
    out: they are computed from the config by code (rotary tables) or are scratch space."""
    params = list(module.named_parameters())
    d = loaded_weights_digest(params, threads)
    return dataclasses.replace(d, emptied=sum(1 for _, p in params if p.numel() == 0))


def files_digest(files: Iterable[tuple[str, Any]], threads: int | None = None) -> LoadedDigest:
    """Every byte of the weight files ((name, path) pairs), by the same recipe (memory-mapped,
    chunks on the thread pool): where the engine's tensors are out of reach, the files it loaded
    them from determine them (with the config), and they were just read, so they are in the
    page cache."""
    import numpy as np

    def mapped(path: Any) -> Any:
        return np.memmap(path, dtype=np.uint8, mode="r") if os.path.getsize(path) else np.empty(0, np.uint8)

    d = loaded_weights_digest([(name, mapped(path)) for name, path in files], threads)
    return dataclasses.replace(d, kind="files")


def caller_model(max_frames: int = 32) -> Any:
    """The loaded model of the engine worker that is calling us, or None.

    vLLM hands a KV connector no reference to the model; but it builds the worker-side connector
    inside ``Worker.initialize_from_config`` (after ``load_model``), so the worker is on the call
    stack: the first ``self`` up the stack that is a model runner (``get_model()``) or a worker
    (``model_runner.get_model()``) holds this rank's weights. Scanning the garbage collector for
    the module that contains the attention layers was the other option: slower, and it finds
    wrappers (torch.compile's) whose parameter names differ between processes."""
    frame: types.FrameType | None = sys._getframe(1)
    for _ in range(max_frames):
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        for cand in (owner, getattr(owner, "model_runner", None)):
            get_model = getattr(cand, "get_model", None)
            if callable(get_model) and not isinstance(cand, type):
                try:
                    model = get_model()
                except Exception:  # noqa: BLE001 - not loaded (yet): keep looking, else None
                    continue
                if callable(getattr(model, "named_parameters", None)):
                    return model
        frame = frame.f_back
    return None
