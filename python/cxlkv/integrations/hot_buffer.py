"""A HiSparse-style hot buffer of token rows per request (SAC Appendix C; vLLM/SGLang HiSparse).

Sparse attention (DeepSeek-V3.2's DSA) reads the top-k tokens of each layer at each decode step,
and consecutive steps pick mostly the same tokens. A request keeps, per layer, ``capacity`` rows
near the compute (the GPU in HiSparse; host memory here, or a torch tensor on any device): slot 0
is reserved for the newest token (written by the step that produced it, never fetched), the others
are replaced least-recently-used first. :meth:`HotBuffer.step` resolves a step's top-k indices
against the buffer, fetches only the missing rows from the pool (``TokenStore.gather``, verified
rows) into LRU slots, and writes the k rows of every layer to ``out``. Hits, misses and bytes
moved are counted (:attr:`HotBuffer.counters`).

The token -> slot map is a dense ``[num_layers, max_tokens]`` int32 table per request (4 B per
token-layer: 32 MiB for 61 layers of 128K tokens), so a step's lookups are one vectorized read.
"""

from __future__ import annotations

from typing import Any

import numpy as np

NEWEST_SLOT = 0


class HotBuffer:
    """The hot rows of one request (``seq_key``) of ``store`` (a :class:`cxlkv.TokenStore`).

    ``capacity``: slots per layer, including the newest token's; must exceed the top-k of a step.
    ``device``: None keeps the buffer in numpy; a torch device name (``"cpu"``, ``"cuda"``) keeps
    it in a torch tensor, moved by the Triton row kernels (cxlkv.kernels.rows).
    """

    def __init__(self, store: Any, seq_key: Any, capacity: int, *, device: str | None = None) -> None:
        if capacity < 2:
            raise ValueError(f"capacity must be >= 2 (one slot is the newest token's), got {capacity}")
        self.store, self.seq_key, self.capacity = store, seq_key, capacity
        L, R = store.num_layers, store.row_bytes
        self.device = device
        if device is None:
            self.rows: Any = np.zeros((L, capacity, R), np.uint8)
        else:
            import torch

            self.rows = torch.zeros((L, capacity, R), dtype=torch.uint8, device=device)
        self.slot_token = np.full((L, capacity), -1, np.int64)
        self.last_used = np.full((L, capacity), -1, np.int64)
        self.token_slot = np.full((L, store.max_tokens), -1, np.int32)
        self.clock = 0
        self.counters = {
            "steps": 0,
            "hits": 0,
            "misses": 0,
            "rows_fetched": 0,
            "bytes_from_pool": 0,
            "bytes_out": 0,
        }

    # -- the newest token ---------------------------------------------------------------------
    def put_newest(self, position: int, rows: Any) -> None:
        """The step that produced token ``position`` hands its rows (``[num_layers, row_elems]``
        of the store's dtype, or ``[num_layers, row_bytes]`` uint8) to the reserved slot. The
        previous newest token moves to an LRU slot (it is still hot)."""
        L = self.store.num_layers
        raw = self._raw_rows(rows)
        if raw.shape != (L, self.store.row_bytes):
            raise ValueError(
                f"rows must be [num_layers, row] ({L} x {self.store.row_bytes} B), got {list(raw.shape)}"
            )
        if isinstance(position, bool) or not isinstance(position, (int, np.integer)):
            raise TypeError(f"position must be an int, not {type(position).__name__}")
        if not 0 <= position < self.store.max_tokens:
            raise IndexError(f"position {position} out of range 0..{self.store.max_tokens - 1}")
        layers = np.arange(L)
        old = self.slot_token[:, NEWEST_SLOT]
        if old[0] >= 0 and old[0] != position:
            victims = self._lru_victims(1)[:, 0]
            self._evict(layers, victims)
            self._copy_slots(layers, np.full(L, NEWEST_SLOT), victims)
            self._assign(layers, victims, old)
        self._evict(layers, np.full(L, NEWEST_SLOT))
        self._assign(layers, np.full(L, NEWEST_SLOT), np.full(L, position))
        self._write_slots(layers, np.full(L, NEWEST_SLOT), raw)

    # -- a decode step ------------------------------------------------------------------------
    def step(self, indices: Any, out: Any) -> Any:
        """Rows ``indices`` (``[num_layers, k]``, each layer's top-k) into ``out``
        (``[num_layers, k, row_bytes]`` uint8, numpy or torch like the buffer). Missing rows are
        fetched from the pool; errors of the pool fetch (SequenceMissError, IndexError) propagate
        and leave the buffer consistent (the rows not fetched are not mapped)."""
        L, R = self.store.num_layers, self.store.row_bytes
        raw_idx = np.asarray(indices.cpu() if hasattr(indices, "cpu") else indices)
        if raw_idx.dtype.kind not in "iu":  # a float index would be truncated to another token
            raise ValueError(f"indices must be integers, got dtype {raw_idx.dtype}")
        idx = np.ascontiguousarray(raw_idx, np.int64)
        if idx.ndim != 2 or idx.shape[0] != L:
            raise ValueError(f"indices must be [num_layers={L}, k], got {list(idx.shape)}")
        k = idx.shape[1]
        if k >= self.capacity:
            raise ValueError(f"top-k {k} needs a buffer of more than {k} slots (capacity {self.capacity})")
        if idx.size and (idx.min() < 0 or idx.max() >= self.store.max_tokens):
            raise IndexError(f"token index out of range 0..{self.store.max_tokens - 1}")
        self.clock += 1
        layers = np.arange(L)[:, None]
        slots = self.token_slot[layers, idx]
        hit = slots >= 0
        hit_layer, hit_pos = np.nonzero(hit)
        self.last_used[hit_layer, slots[hit_layer, hit_pos]] = self.clock  # not victims of this step
        hits = int(hit.sum())
        fetched = 0
        for layer in np.nonzero(~hit.all(axis=1))[0]:
            missing = np.unique(idx[layer][~hit[layer]])
            fetched += self._fetch(int(layer), missing)
        slots = self.token_slot[layers, idx]
        self.last_used[layers, slots] = self.clock
        self._gather_out(slots, out)
        c = self.counters
        c["steps"] += 1
        c["hits"] += hits
        c["misses"] += idx.size - hits
        c["rows_fetched"] += fetched
        c["bytes_from_pool"] += fetched * R
        c["bytes_out"] += idx.size * R
        return out

    def hit_rate(self) -> float:
        total = self.counters["hits"] + self.counters["misses"]
        return self.counters["hits"] / total if total else 0.0

    # -- internals ------------------------------------------------------------------------------
    def _fetch(self, layer: int, tokens: np.ndarray) -> int:
        victims = self._lru_victims(len(tokens), layer)
        rows = np.empty((len(tokens), self.store.row_bytes), np.uint8)
        self.store.gather_raw(self.seq_key, layer, tokens, rows)
        lay = np.full(len(tokens), layer)
        self._evict(lay, victims)
        self._write_slots(lay, victims, rows)
        self._assign(lay, victims, tokens)
        self.last_used[layer, victims] = self.clock
        return len(tokens)

    def _lru_victims(self, n: int, layer: int | None = None) -> np.ndarray:
        """The n least recently used slots (never the newest token's) of one layer, or of every
        layer ([L, n])."""
        lu = self.last_used[:, 1:] if layer is None else self.last_used[layer, 1:]
        part = (
            np.argpartition(lu, n - 1, axis=-1)[..., :n]
            if n < lu.shape[-1]
            else np.argsort(lu, axis=-1)[..., :n]
        )
        return part + 1

    def _evict(self, layers: np.ndarray, slots: np.ndarray) -> None:
        old = self.slot_token[layers, slots]
        live = old >= 0
        self.token_slot[layers[live], old[live]] = -1
        self.slot_token[layers, slots] = -1

    def _assign(self, layers: np.ndarray, slots: np.ndarray, tokens: np.ndarray) -> None:
        self.slot_token[layers, slots] = tokens
        self.token_slot[layers, tokens] = slots
        self.last_used[layers, slots] = self.clock

    def _flat(self, layers: np.ndarray, slots: np.ndarray) -> np.ndarray:
        return (np.asarray(layers, np.int64) * self.capacity + np.asarray(slots, np.int64)).ravel()

    def _write_slots(self, layers: np.ndarray, slots: np.ndarray, rows: np.ndarray) -> None:
        if self.device is None:
            self.rows[layers, slots] = rows
            return
        import torch

        from ..kernels.rows import scatter_rows

        flat = self.rows.view(-1, self.store.row_bytes)
        src = torch.from_numpy(np.ascontiguousarray(rows)).to(self.rows.device)
        scatter_rows(src, torch.from_numpy(self._flat(layers, slots)).to(self.rows.device), flat)

    def _copy_slots(self, layers: np.ndarray, src_slots: np.ndarray, dst_slots: np.ndarray) -> None:
        if self.device is None:
            self.rows[layers, dst_slots] = self.rows[layers, src_slots]
        else:
            self.rows[layers, dst_slots] = self.rows[layers, src_slots].clone()

    def _gather_out(self, slots: np.ndarray, out: Any) -> None:
        L, k = slots.shape
        if self.device is None:
            if out.shape != (L, k, self.store.row_bytes) or out.dtype != np.uint8:
                raise ValueError(f"out must be uint8 [{L}, {k}, {self.store.row_bytes}]")
            # reshape() of any other array is a copy: the rows would land there, not in out
            if not (out.flags.c_contiguous and out.flags.writeable):
                raise ValueError("out must be a writable C-contiguous array")
            # rows moved as the widest word dividing them: numpy's take copies item by item
            word = next(
                w
                for w in (np.uint64, np.uint32, np.uint16, np.uint8)
                if self.store.row_bytes % w().itemsize == 0
            )
            np.take(
                self.rows.reshape(-1, self.store.row_bytes).view(word),
                self._flat(np.arange(L)[:, None], slots),
                axis=0,
                out=out.reshape(-1, self.store.row_bytes).view(word),
            )
            return
        import torch

        from ..kernels.rows import gather_rows

        if tuple(out.shape) != (L, k, self.store.row_bytes) or out.dtype != torch.uint8:
            raise ValueError(f"out must be a uint8 tensor [{L}, {k}, {self.store.row_bytes}]")
        if not out.is_contiguous():  # view() refuses most, but not every, other stride
            raise ValueError("out must be a contiguous tensor")
        flat_idx = torch.from_numpy(self._flat(np.arange(L)[:, None], slots)).to(self.rows.device)
        gather_rows(self.rows.view(-1, self.store.row_bytes), flat_idx, out.view(-1, self.store.row_bytes))

    def _raw_rows(self, rows: Any) -> np.ndarray:
        if hasattr(rows, "detach"):
            import torch

            rows = rows.detach().to("cpu").contiguous().view(torch.uint8).numpy()
        a = np.ascontiguousarray(rows)
        return a.view(np.uint8).reshape(a.shape[0], -1)
