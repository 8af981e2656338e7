"""Token-addressable, layer-first rows in the pool (SAC §4.3.1): ``pool.token_store(layout, ...)``.

A sequence's rows (one per token per layer: an MLA latent, an ``fp8_ds_mla`` record, a dense K/V
row, or the indexer's 132-B row) are cut into chunks of ``layout.tokens_per_block`` tokens; chunk
``c`` is one block of a token namespace, its rows layer-first (src/core/transfer/token_rows.h has the byte
format). A decode step gathers the top-k rows of a layer straight out of the pool.

Contract (docs/API.md, "Token store"):

* Keys. Block ``c`` of a sequence is published under a key derived from (format version, stream,
  sequence key, ``c``, tokens it holds). A full chunk's key is fixed; a partial last chunk is
  re-published under a new key each time it grows and the older version deleted (blocks are
  immutable in the pool).
* Length. A reader on any process learns a sequence's length from the pool alone:
  ``match_prefix`` over the full-chunk keys, then a probe of the at most ``tokens_per_block - 1``
  partial versions of the next chunk (:meth:`TokenStore.length`).
* Integrity. Every row carries a hash seeded by (sequence, stream, layer, position); a gather
  verifies exactly the rows it delivers (one hash per row read, never the whole block). A reader
  pins a sequence's blocks once (a lease per refresh) and holds the pins across gathers, so they
  cannot be evicted under it; a row that was nonetheless overwritten or corrupted fails its hash:
  :class:`SequenceMissError`, never wrong rows.
* Placement (SAC §4.3.3). On a striped pool each sequence's blocks go to one device, sequences
  spread over the devices (fewest live sequences first); readers find them anywhere.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
from typing import Any

import numpy as np

from . import _core
from .errors import PinSlotsFullError, PoolFullError, SequenceConflictError, SequenceMissError

__all__ = [
    "PoolFullError",
    "SequenceConflictError",
    "SequenceMissError",
    "TokenStore",
    "indexer_blocks",
    "indexer_rows",
]

TOKEN_FORMAT_VERSION: int = _core.token_block_layout(1, 1, 1)["version"]
STREAM_ROWS = 0
STREAM_INDEXER = 1
# DeepSeek-V3.2's indexer cache per token: 128 B of fp8 values + one fp32 scale; vLLM stores a
# 64-token block as 64 x 128 B of values then 64 x 4 B of scales.
INDEXER_VALUE_BYTES = 128
INDEXER_SCALE_BYTES = 4
INDEXER_ROW_BYTES = INDEXER_VALUE_BYTES + INDEXER_SCALE_BYTES


def row_elems(layout: Any) -> int:
    """Elements of one token-layer row: MLA (and raw records such as ``fp8_ds_mla``: ``dtype
    uint8, head_size 656``) one latent of ``head_size``; dense K then V of every KV head."""
    if layout.kind == "dense":
        return 2 * layout.num_kv_heads * layout.head_size
    return layout.head_size


def _seq_bytes(seq_key: Any) -> bytes:
    if isinstance(seq_key, str):
        seq_key = seq_key.encode()
    if not isinstance(seq_key, (bytes, bytearray, memoryview)):
        raise TypeError(f"seq_key must be bytes or str, not {type(seq_key).__name__}")
    b = bytes(seq_key)
    if not 1 <= len(b) <= 1024:
        raise ValueError(f"seq_key must be 1..1024 bytes, got {len(b)}")
    return b


def _is_torch(x: Any) -> bool:
    return type(x).__module__.startswith("torch")


def _dtype_name(x: Any) -> str:
    return str(x.dtype)


class TokenStore:
    """Rows of sequences, addressed by (sequence, layer, token). See the module doc."""

    def __init__(
        self,
        pool: Any,
        layout: Any,
        *,
        max_tokens_per_seq: int,
        stream: int = STREAM_ROWS,
        placement: str | None = "request",
    ) -> None:
        if (
            isinstance(max_tokens_per_seq, bool)
            or not isinstance(max_tokens_per_seq, int)
            or max_tokens_per_seq < 1
        ):
            raise ValueError(f"max_tokens_per_seq must be a positive int, not {max_tokens_per_seq!r}")
        if placement not in ("request", None):
            raise ValueError(f"placement must be 'request' or None, not {placement!r}")
        self.layout = layout
        self.stream = stream
        self.max_tokens = max_tokens_per_seq
        self.num_layers = layout.num_layers
        self.tokens_per_block = layout.tokens_per_block
        self.row_elems = row_elems(layout)
        self.row_bytes = self.row_elems * layout.dtype_bytes
        geo = _core.token_block_layout(self.num_layers, self.tokens_per_block, self.row_bytes)
        self.block_bytes: int = geo["block_bytes"]
        self._payload = geo["payload_bytes"]
        self._row_stride = geo["row_stride"]  # a row's slot: its bytes, a zero pad, its check
        self._max_chunks = -(-max_tokens_per_seq // self.tokens_per_block)
        # The token format is part of the identity: block_bytes (row slots + header) and a
        # name of its own, so a block namespace of the same layout never shares these blocks.
        self.ns_layout = dataclasses.replace(layout, block_bytes=self.block_bytes)
        self.ns_name = f"{layout.default_name()}#tokens/v{TOKEN_FORMAT_VERSION}/s{stream}"
        self._pool = pool
        self._ns = pool.namespace(self.ns_layout, self.ns_name)
        self._devices = len(pool.info()["devices"]) if placement == "request" else 1
        self._device_of: dict[bytes, int | None] = {}
        self._writers: dict[bytes, _Tail] = {}
        self._views: dict[bytes, _View] = {}
        self.counters = {"rows_gathered": 0, "bytes_gathered": 0, "gathers": 0, "misses": 0, "blocks_put": 0}
        self.indexer: TokenStore | None = None

    # -- identity of a sequence's blocks ------------------------------------------------------
    def _seq_hash(self, seq: bytes) -> int:
        return int.from_bytes(hashlib.blake2b(b"cxlkv.seq\0" + seq, digest_size=8).digest(), "little")

    def block_key(self, seq_key: Any, chunk: int, valid_tokens: int) -> bytes:
        """The pool key of chunk ``chunk`` of a sequence holding ``valid_tokens`` tokens."""
        seq = _seq_bytes(seq_key)
        h = hashlib.blake2b(digest_size=32, person=b"cxlkv.tokens")
        h.update(bytes([TOKEN_FORMAT_VERSION, self.stream]))
        h.update(len(seq).to_bytes(4, "little") + seq)
        h.update(chunk.to_bytes(8, "little") + valid_tokens.to_bytes(4, "little"))
        return h.digest()

    # -- placement (SAC §4.3.3) ---------------------------------------------------------------
    def device_of(self, seq_key: Any) -> int | None:
        """The device this process stores the sequence's blocks on (None: anywhere)."""
        return self._place(_seq_bytes(seq_key))

    def _place(self, seq: bytes) -> int | None:
        if seq not in self._device_of:
            if self._devices <= 1:
                self._device_of[seq] = None
            else:
                live = [0] * self._devices
                for d in self._device_of.values():
                    if d is not None:
                        live[d] += 1
                self._device_of[seq] = live.index(min(live))
        return self._device_of[seq]

    def _ns_for(self, seq: bytes) -> Any:
        device = self._place(seq)
        if device is None:
            return self._ns
        return self._pool.namespace(self.ns_layout, self.ns_name, device=device)

    # -- writing ------------------------------------------------------------------------------
    def append(self, seq_key: Any, rows: Any) -> int:
        """Appends ``rows`` (``[num_layers, n_tokens, row_elems]``, the layout's dtype; numpy or
        torch) to the sequence. Returns its new length. Full chunks are published once; a partial
        last chunk is re-published as it grows. PoolFullError if a block cannot be stored;
        ValueError for no tokens (``n_tokens`` >= 1: an empty append is a caller's bug)."""
        seq = _seq_bytes(seq_key)
        data = self._rows_bytes(rows)
        n = data.shape[1]
        if n == 0:
            raise ValueError("rows must hold at least one token (got [num_layers, 0, row_elems])")
        tail = self._writers.get(seq) or self._recover_tail(seq)
        if tail.n_tokens + n > self.max_tokens:
            raise ValueError(
                f"append of {n} tokens would make the sequence {tail.n_tokens + n} tokens, past "
                f"max_tokens_per_seq={self.max_tokens}"
            )
        ns = self._ns_for(seq)
        T = self.tokens_per_block
        done = 0
        while done < n:
            c, t0 = divmod(tail.n_tokens, T)
            take = min(T - t0, n - done)
            block = tail.block if tail.block is not None else np.zeros(self.block_bytes, np.uint8)
            slots = block[: self._payload].reshape(self.num_layers, T, self._row_stride)
            slots[:, t0 : t0 + take, : self.row_bytes] = data[:, done : done + take]
            valid = t0 + take
            _core.token_seal(
                block, self.num_layers, T, self.row_bytes, self._seq_hash(seq), self.stream, c, valid
            )
            key = self._check_no_other_writer(ns, seq, c, t0, valid, block)
            if not ns.put(key, block):
                if ns.contains(key):  # another writer's put of this version won the race
                    raise self._conflict(seq, c, valid)
                raise PoolFullError(
                    f"could not store chunk {c} of a sequence ({self.block_bytes} B): the pool is full "
                    "and nothing can be evicted"
                )
            self.counters["blocks_put"] += 1
            if t0:  # the older version of this partial chunk is superseded
                ns.delete(self.block_key(seq, c, t0))
            done += take
            tail.n_tokens += take
            tail.block = None if valid == T else block
        self._writers[seq] = tail
        return tail.n_tokens

    def _check_no_other_writer(
        self, ns: Any, seq: bytes, c: int, t0: int, valid: int, block: np.ndarray
    ) -> bytes:
        """The key of chunk c at ``valid`` tokens, after checking that no other writer has taken
        this sequence past ``t0`` tokens of chunk c (a later version, or this one with other
        bytes): a second appender, or this handle's length gone stale. Not atomic (two puts of the
        same instant can still both land), but every interleaving of appends that do not overlap
        in time is caught. Cost: at most tokens_per_block - t0 index lookups."""
        key = self.block_key(seq, c, valid)
        for v in range(t0 + 1, self.tokens_per_block + 1):
            k = key if v == valid else self.block_key(seq, c, v)
            if not ns.contains(k):
                continue
            if v == valid:
                data = ns.get_bytes(k)
                if data is not None and np.array_equal(np.frombuffer(data, np.uint8), block):
                    continue  # the very bytes we would write: nothing diverges
            raise self._conflict(seq, c, v)
        return key

    def _conflict(self, seq: bytes, c: int, v: int) -> SequenceConflictError:
        self._writers.pop(seq, None)  # the next append resumes from the pool
        return SequenceConflictError(
            f"another writer appended to this sequence (chunk {c} holds a version of {v} tokens this "
            f"handle did not write): the append stopped before chunk {c}; the pool keeps the other's rows"
        )

    def _recover_tail(self, seq: bytes) -> _Tail:
        """Another process (or an earlier handle) may have written this sequence: continue it."""
        n = self.length(seq)
        tail = _Tail(n, None)
        if n % self.tokens_per_block:
            c, valid = divmod(n, self.tokens_per_block)
            data = self._ns.get_bytes(self.block_key(seq, c, valid))
            if data is None:
                raise SequenceMissError("the partial last chunk of the sequence vanished while resuming it")
            block = np.frombuffer(data, np.uint8).copy()
            # Resuming re-seals these rows: check the block is exactly what a writer of this
            # sequence sealed (header, row hashes, zeroed tail) before vouching for its bytes.
            check = block.copy()
            _core.token_seal(
                check, self.num_layers, self.tokens_per_block, self.row_bytes, self._seq_hash(seq),
                self.stream, c, valid,
            )  # fmt: skip
            if len(data) != self.block_bytes or not np.array_equal(check, block):
                self.counters["misses"] += 1
                raise SequenceMissError(
                    f"the partial chunk {c} of the sequence is not in the pool as written "
                    "(corrupt or foreign block): not resuming it"
                )
            tail.block = block
        return tail

    def _rows_bytes(self, rows: Any) -> np.ndarray:
        self._check_array("rows", rows, ndim=3)
        if tuple(rows.shape[::2]) != (self.num_layers, self.row_elems):
            raise ValueError(
                f"rows must be [num_layers={self.num_layers}, n_tokens, row_elems={self.row_elems}], "
                f"got {list(rows.shape)}"
            )
        if _is_torch(rows):
            import torch  # only reached with a torch tensor in hand

            t = rows.detach().to("cpu").contiguous()
            return t.view(torch.uint8).numpy().reshape(self.num_layers, -1, self.row_bytes)
        return np.ascontiguousarray(rows).view(np.uint8).reshape(self.num_layers, -1, self.row_bytes)

    def _check_array(self, what: str, a: Any, ndim: int) -> None:
        if not hasattr(a, "dtype") or not hasattr(a, "shape"):
            raise TypeError(f"{what} must be a numpy array or torch tensor, not {type(a).__name__}")
        try:
            name = _core.dtype_info(_dtype_name(a))["name"]
        except (ValueError, TypeError):
            name = _dtype_name(a)
        if name != self.layout.dtype:
            raise ValueError(f"{what} has dtype {_dtype_name(a)}; this store holds {self.layout.dtype} rows")
        if len(a.shape) != ndim:
            raise ValueError(f"{what} must have {ndim} dimensions, got shape {list(a.shape)}")

    # -- reading ------------------------------------------------------------------------------
    def length(self, seq_key: Any) -> int:
        """Tokens of the sequence in the pool now (0: absent), from the pool alone.

        Under a concurrent append it is a length the sequence had while this ran, never less than
        what it had when this began (see :meth:`_versions` for how)."""
        seq = _seq_bytes(seq_key)
        T = self.tokens_per_block
        keys = self._full_keys(seq)
        full = self._ns.match_prefix(keys)
        while True:
            if full * T >= self.max_tokens:
                return self.max_tokens
            for valid in self._versions(full, 1, both_ways=True):
                if self._ns.contains(self.block_key(seq, full, valid)):
                    return full * T + valid
            if full < len(keys) and self._ns.contains(keys[full]):  # completed meanwhile
                full += 1 + self._ns.match_prefix(keys[full + 1 :])
                continue
            return full * T

    def _versions(self, chunk: int, lo: int, both_ways: bool) -> Any:
        """The partial versions (valid token counts) of ``chunk`` to probe, from ``lo`` up: newest
        first (the one a reader wants), then, if ``both_ways``, once more oldest first; the caller
        probes the full chunk last.

        Why the second, ascending pass: a writer publishes a chunk's next version (more tokens,
        or the full chunk) before it deletes the one it supersedes, so the newest version is
        always present and only grows. A descending pass can pass the next version before it is
        put and reach the old one after it is deleted, finding none. An ascending pass cannot:
        missing version ``u`` means the newest is above ``u`` by then, so it finds that one
        further on, or the full chunk. (Not ascending alone: an older version pinned by a reader
        stays present, and would be found before the newest.)"""
        top = min(self.tokens_per_block - 1, self.max_tokens - chunk * self.tokens_per_block)
        down = range(top, lo - 1, -1)
        return itertools.chain(down, range(lo, top + 1)) if both_ways else down

    def _full_keys(self, seq: bytes) -> list:
        view = self._views.get(seq)
        if view is not None and view.full_keys:
            return view.full_keys
        T = self.tokens_per_block
        return [self.block_key(seq, c, T) for c in range(self.max_tokens // T)]

    def gather(self, seq_key: Any, layer: int, indices: Any, out: Any) -> Any:
        """Copies rows ``indices`` (any order, duplicates allowed) of layer ``layer`` into ``out``
        (``[len(indices), row_elems]``, the layout's dtype). Returns ``out``. IndexError for an
        index or layer out of range; SequenceMissError if a row is not in the pool as written."""
        if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)):
            raise TypeError(f"layer must be an int, not {type(layer).__name__}")
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer {layer} out of range 0..{self.num_layers - 1}")
        idx = self._indices(indices, ndim=1)
        self._check_out(out, (idx.shape[0], self.row_elems))
        return self._gather(seq_key, int(layer), 1, idx, False, out)

    def gather_raw(self, seq_key: Any, layer: int, indices: Any, out: np.ndarray) -> np.ndarray:
        """:meth:`gather` into a uint8 ``out`` of ``[len(indices), row_bytes]``: the rows' bytes,
        whatever the layout's dtype (for callers that move rows without interpreting them)."""
        if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)):
            raise TypeError(f"layer must be an int, not {type(layer).__name__}")
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer {layer} out of range 0..{self.num_layers - 1}")
        idx = self._indices(indices, ndim=1)
        if (
            not isinstance(out, np.ndarray)
            or out.dtype != np.uint8
            or out.shape != (idx.shape[0], self.row_bytes)
        ):
            raise ValueError(f"out must be a uint8 numpy array [{idx.shape[0]}, {self.row_bytes}]")
        if not (out.flags.c_contiguous and out.flags.writeable):
            raise ValueError("out must be a writable C-contiguous array")
        return self._gather(seq_key, int(layer), 1, idx, False, out)

    def gather_layers(self, seq_key: Any, indices: Any, out: Any) -> Any:
        """All layers in one call: ``indices`` ``[num_layers, k]`` (each layer its own top-k),
        ``out`` ``[num_layers, k, row_elems]``. Errors as :meth:`gather`."""
        idx = self._indices(indices, ndim=2)
        if idx.shape[0] != self.num_layers:
            raise ValueError(f"indices must be [num_layers={self.num_layers}, k], got {list(idx.shape)}")
        self._check_out(out, (self.num_layers, idx.shape[1], self.row_elems))
        return self._gather(seq_key, 0, self.num_layers, idx, True, out)

    def _gather(
        self, seq_key: Any, first: int, n_layers: int, idx: np.ndarray, per_layer: bool, out: Any
    ) -> Any:
        seq = _seq_bytes(seq_key)
        need = int(idx.max()) + 1 if idx.size else 0
        view = self._view(seq, need)
        target, finish = self._out_target(out)
        miss = _core.token_gather(
            self._ns,
            self.num_layers,
            self.tokens_per_block,
            self.row_bytes,
            self._seq_hash(seq),
            self.stream,
            view.n_tokens,
            view.offsets,
            first,
            n_layers,
            idx,
            per_layer,
            target,
        )
        if miss is not None:
            self.counters["misses"] += 1
            self.release(seq)  # the view no longer describes the pool
            raise SequenceMissError(
                f"row (layer {miss[0]}, token {miss[1]}) of the sequence is not in the pool as written "
                "(evicted, overwritten or corrupt)"
            )
        finish()
        rows = idx.size if per_layer else idx.size * n_layers
        self.counters["gathers"] += 1
        self.counters["rows_gathered"] += rows
        self.counters["bytes_gathered"] += rows * self.row_bytes
        return out

    def _out_target(self, out: Any):
        """Where the core writes: ``out`` itself (numpy, torch CPU), or for a CUDA tensor a host
        staging tensor copied to the device afterwards (a verified host gather, then one H2D copy;
        untested here: no GPU on our machines). A numpy ``out`` goes as its bytes: the core
        writes rows, whatever their dtype (so numpy extension dtypes such as ml_dtypes' bfloat16,
        which the extension's array type does not know, are gathered into like any other)."""
        if _is_torch(out):
            if out.device.type == "cpu":
                return out, lambda: None
            staging = out.detach().to("cpu")

            def finish() -> None:
                out.copy_(staging)

            return staging, finish
        return out.view(np.uint8), lambda: None

    def _indices(self, indices: Any, ndim: int) -> np.ndarray:
        if _is_torch(indices):
            indices = indices.detach().to("cpu").numpy()
        a = np.asarray(indices)
        if a.dtype.kind not in "iu":
            raise ValueError(f"indices must be integers, got dtype {a.dtype}")
        if a.ndim != ndim:
            raise ValueError(f"indices must have {ndim} dimension(s), got shape {list(a.shape)}")
        if a.dtype.kind == "u" and a.size and int(a.max()) > np.iinfo(np.int64).max:
            raise IndexError(f"token index {int(a.max())} out of range")
        return np.ascontiguousarray(a, dtype=np.int64)

    def _check_out(self, out: Any, shape: tuple) -> None:
        self._check_array("out", out, ndim=len(shape))
        if tuple(out.shape) != shape:
            raise ValueError(f"out must have shape {list(shape)}, got {list(out.shape)}")
        if _is_torch(out):
            if not out.is_contiguous():
                raise ValueError("out must be contiguous")
        elif not (out.flags.c_contiguous and out.flags.writeable):
            raise ValueError("out must be a writable C-contiguous array")

    # -- pins -----------------------------------------------------------------------------------
    def _view(self, seq: bytes, need: int) -> _View:
        view = self._views.get(seq)
        if view is None:
            view = self._views[seq] = _View(self._full_keys(seq))
        stale = need > view.n_tokens or (view.n_tokens == 0 and need == 0)
        if stale and view.bad is None:
            self._refresh(seq, view, need)
        if need > view.n_tokens:
            if view.bad is not None:  # the rows exist but a chunk before them does not verify
                raise self._miss(seq, view.bad)
            raise IndexError(f"token index {need - 1} out of range: the sequence has {view.n_tokens} tokens")
        return view

    def _refresh(self, seq: bytes, view: _View, need: int) -> None:
        """Pins the chunks published since the view was last refreshed (full ones once; the
        partial tail again, at its newest version, and one of at least ``need`` tokens whatever
        a concurrent append does, if the sequence had that many when this began: see
        :meth:`_versions`) and resolves where their rows lie."""
        if view.tail_lease is not None:
            view.tail_lease.release()
            view.tail_lease, view.tail = None, None
        seq_hash = self._seq_hash(seq)
        while True:
            if not self._pin_full_chunks(seq, view, seq_hash):
                return  # a malformed full chunk: _broken set the view
            if not self._pin_tail(seq, view, seq_hash, need):
                break  # else the chunk was completed while its tail was probed: pin it, go on
        offsets = list(view.full_offsets) + ([view.tail[0]] if view.tail else [])
        view.offsets = np.asarray(offsets, dtype=np.uint64)
        view.n_tokens = len(view.full_offsets) * self.tokens_per_block + (view.tail[1] if view.tail else 0)

    def _pin_full_chunks(self, seq: bytes, view: _View, seq_hash: int) -> bool:
        """Pins the full chunks published past the view's; False if one is malformed (the view
        is then :meth:`_broken`)."""
        T = self.tokens_per_block
        F = len(view.full_offsets)
        more = self._ns.match_prefix(view.full_keys[F:])
        if more:
            lease = self._ns.acquire(view.full_keys[F : F + more])
            got = self._resolve(view.full_keys[F : F + len(lease)], seq_hash, F)
            good = next((i for i, (_, valid) in enumerate(got) if valid != T), len(got))
            if good < len(lease):  # pinned, so present: its header is not as written
                lease.release()
                self._broken(seq, view, F + good, "a corrupt or foreign header")
                return False
            if len(got) < more and len(lease) == len(got) and self._ns.contains(view.full_keys[F + len(got)]):
                lease.release()
                raise PinSlotsFullError(
                    f"could pin only {len(got)} of {more} blocks of the sequence: this process's "
                    "pin slots are exhausted (create the pool with more pin_slots)"
                )
            view.leases.append(lease)
            view.full_offsets.extend(off for off, _ in got)
        return True

    def _pin_tail(self, seq: bytes, view: _View, seq_hash: int, need: int) -> bool:
        """Pins the newest version of the partial chunk past the full ones, one holding at least
        ``need`` tokens of the sequence if it had them (probed both ways while ``need`` reaches
        into this chunk). True if none is left but that chunk is full now (pin it, go on)."""
        T = self.tokens_per_block
        F = len(view.full_offsets)
        if self._max_chunks <= F:
            return False
        for valid in self._versions(F, max(1, need - F * T), both_ways=need > F * T):
            key = self.block_key(seq, F, valid)
            lease = self._ns.acquire([key])
            if len(lease):
                got = self._resolve([key], seq_hash, F)
                if got and got[0][1] == valid:
                    view.tail_lease, view.tail = lease, got[0]
                    return False
                if got or self._ns.contains(key):  # still published (not superseded): malformed
                    lease.release()
                    view.bad = f"the partial chunk {F} has a corrupt or foreign header"
                    return False
            lease.release()
        return len(view.full_keys) > F and self._ns.contains(view.full_keys[F])

    def _broken(self, seq: bytes, view: _View, chunk: int, what: str) -> None:
        """Chunk ``chunk`` is present but malformed: the view keeps (pins) only the chunks before
        it, and any gather past them is a miss (never an IndexError: the rows were written)."""
        F = len(view.full_offsets)
        view.bad = f"chunk {chunk} of the sequence has {what}"
        if chunk > F:
            lease = self._ns.acquire(view.full_keys[F:chunk])
            got = self._resolve(view.full_keys[F : F + len(lease)], self._seq_hash(seq), F)
            if len(lease) == len(got) == chunk - F:
                view.leases.append(lease)
                view.full_offsets.extend(off for off, _ in got)
            else:
                lease.release()
        view.offsets = np.asarray(view.full_offsets, dtype=np.uint64)
        view.n_tokens = len(view.full_offsets) * self.tokens_per_block

    def _miss(self, seq: bytes, why: str) -> SequenceMissError:
        """Counts a miss and drops the view (it no longer describes the pool)."""
        self.counters["misses"] += 1
        self.release(seq)
        return SequenceMissError(f"{why}: not in the pool as written")

    def _resolve(self, keys: list, seq_hash: int, first_chunk: int) -> list:
        return _core.token_resolve(
            self._ns,
            keys,
            self.num_layers,
            self.tokens_per_block,
            self.row_bytes,
            seq_hash,
            self.stream,
            first_chunk,
        )

    def release(self, seq_key: Any) -> None:
        """Drops this process's pins on the sequence (the next gather pins it again)."""
        view = self._views.pop(_seq_bytes(seq_key), None)
        if view is not None:
            view.close()

    def forget(self, seq_key: Any) -> None:
        """The request finished: drop pins, writer state and its placement."""
        seq = _seq_bytes(seq_key)
        self.release(seq)
        self._writers.pop(seq, None)
        self._device_of.pop(seq, None)

    def close(self) -> None:
        for view in self._views.values():
            view.close()
        self._views.clear()
        self._writers.clear()
        if self.indexer is not None:
            self.indexer.close()

    def __enter__(self) -> TokenStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclasses.dataclass
class _Tail:
    """The writer's copy of a sequence's partial last chunk (None: the last chunk is full)."""

    n_tokens: int
    block: np.ndarray | None


@dataclasses.dataclass
class _View:
    """A reader's pinned view of a sequence: leases held across gathers, and where rows lie."""

    full_keys: list
    leases: list = dataclasses.field(default_factory=list)
    full_offsets: list = dataclasses.field(default_factory=list)
    tail_lease: Any = None
    tail: tuple | None = None
    offsets: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.uint64))
    n_tokens: int = 0
    bad: str | None = None  # set when a chunk is present but malformed (gathers past it miss)

    def close(self) -> None:
        for lease in self.leases:
            lease.release()
        if self.tail_lease is not None:
            self.tail_lease.release()
        self.leases, self.tail_lease = [], None


# -- the indexer stream's block format (vLLM's DeepSeek-V3.2 indexer cache) ---------------------
def indexer_rows(blocks: np.ndarray, n_tokens: int, block_tokens: int = 64) -> np.ndarray:
    """vLLM indexer blocks (``[n_blocks, block_tokens * 132]`` uint8: values, then scales) as rows
    ``[n_tokens, 132]`` (a token's 128 B of values, then its 4-B scale): the store's row format."""
    b = np.ascontiguousarray(blocks, dtype=np.uint8).reshape(-1, block_tokens * INDEXER_ROW_BYTES)
    if n_tokens > b.shape[0] * block_tokens:
        raise ValueError(
            f"{b.shape[0]} blocks hold at most {b.shape[0] * block_tokens} tokens, not {n_tokens}"
        )
    split = block_tokens * INDEXER_VALUE_BYTES
    values = b[:, :split].reshape(-1, block_tokens, INDEXER_VALUE_BYTES)
    scales = b[:, split:].reshape(-1, block_tokens, INDEXER_SCALE_BYTES)
    return np.concatenate([values, scales], axis=2).reshape(-1, INDEXER_ROW_BYTES)[:n_tokens]


def indexer_blocks(rows: np.ndarray, block_tokens: int = 64) -> np.ndarray:
    """The inverse of :func:`indexer_rows`: rows ``[n_tokens, 132]`` into vLLM's block format
    (a partial last block zero-padded)."""
    r = np.ascontiguousarray(rows, dtype=np.uint8).reshape(-1, INDEXER_ROW_BYTES)
    n_blocks = -(-r.shape[0] // block_tokens)
    padded = np.zeros((n_blocks * block_tokens, INDEXER_ROW_BYTES), np.uint8)
    padded[: r.shape[0]] = r
    p = padded.reshape(n_blocks, block_tokens, INDEXER_ROW_BYTES)
    values = p[:, :, :INDEXER_VALUE_BYTES].reshape(n_blocks, -1)
    scales = p[:, :, INDEXER_VALUE_BYTES:].reshape(n_blocks, -1)
    return np.concatenate([values, scales], axis=1)


def open_token_store(
    pool: Any, layout: Any, max_tokens_per_seq: int, indexer: bool, placement: str | None
) -> TokenStore:
    """What ``Pool.token_store`` returns: the row store, and with ``indexer=True`` the indexer
    cache as a second stream of the same sequences (``ts.indexer``: 132-B raw rows, one per token
    per layer)."""
    ts = TokenStore(pool, layout, max_tokens_per_seq=max_tokens_per_seq, placement=placement)
    if indexer:
        idx_layout = dataclasses.replace(
            layout, kind="mla", dtype="uint8", num_kv_heads=1, head_size=INDEXER_ROW_BYTES, block_bytes=None
        )
        ts.indexer = TokenStore(
            pool,
            idx_layout,
            max_tokens_per_seq=max_tokens_per_seq,
            stream=STREAM_INDEXER,
            placement=placement,
        )
        ts.indexer._device_of = ts._device_of  # one request, one device, both streams
    return ts
