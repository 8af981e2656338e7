"""Identity follows the bytes: the name of a KV namespace is derived from what determines the KV
bytes, never from a display name (served alias, model path, LoRA name).

Recipe (docs/IDENTITY.md explains the why and the limits):

* the weights, by content: :func:`weights_digest` hashes every weight file's size, its tensor
  table (safetensors header / GGUF tensor infos: names, dtypes, shapes, offsets) and fixed-size
  samples of every tensor's bytes at deterministic offsets (start, middle, end);
* the KV layout (kind, layers, the model's total KV heads, head size, KV heads per pool entry),
  the KV cache dtype through the core's canonical dtype table, the KV scales, the quantization
  method, the block size and the device's byte layout: :class:`KVIdentity`. Not the
  tensor-parallel size or rank: the vLLM connector stores one entry per block and KV head, which
  every TP size reads (heads.py), so engines of any TP size share a namespace.

Per-file digests are cached beside the model (``.cxlkv-identity.json``) or, where that directory
is read-only, under ``~/.cache/cxlkv/identity/`` (keyed by the resolved path): a 100 GB checkpoint
costs a few thousand small reads once, then a stat per file. The cache is a hint, never an
authority: an entry counts only when every stat field of the file (device, inode, size, mtime,
ctime) matches, a cache file counts only when its owner is trusted and nobody else can write it,
and anything malformed is recomputed (:mod:`cxlkv.integrations.identity_cache`).

Usable without vLLM (the connector in :mod:`cxlkv.integrations.vllm` is one user).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import stat
import struct
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from cxlkv.errors import WeightPathError
from cxlkv.integrations.identity_cache import CACHE_FILE, IdentityCache

__all__ = [
    "CACHE_FILE",
    "IDENTITY_VERSION",
    "SAMPLE_BYTES",
    "SHARED_DTYPES",
    "SHARED_ENTRY_LAYOUT",
    "SHARED_ENTRY_LAYOUTS",
    "SHARED_MLA_ENTRY_LAYOUT",
    "KVIdentity",
    "WeightsDigest",
    "adapter_digest",
    "canonical_dtype",
    "config_digest",
    "file_digest",
    "shared_identity",
    "short_name",
    "tensor_digest",
    "weight_files",
    "weights_digest",
    "weights_identity",
]

IDENTITY_VERSION = "cxlkv/identity/v1"  # bump when the recipe changes: old namespaces stay apart
SAMPLE_BYTES = 4096  # one sample window
SAMPLES_PER_TENSOR = 3  # start, middle, end of every tensor
WHOLE_TENSOR_BYTES = 3 * SAMPLE_BYTES  # smaller tensors (norms, biases) are hashed whole
BLOB_WINDOW_STRIDE = 64 << 20  # unparsed weight files: one window per 64 MiB, at least 64
BLOB_MIN_WINDOWS = 64
WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".bin", ".pt", ".pth", ".ckpt", ".npz", ".msgpack", ".h5")
# Files beside the weights that change the model's computation (config, quantization, generation
# is not one of them): hashed whole, they are small.
CONFIG_FILES = (
    "config.json",
    "quantize_config.json",
    "quant_config.json",
    "quantization_config.json",
    "hf_quant_config.json",
    "adapter_config.json",
    "params.json",
)
MAX_NAME = 95  # the core's kNameBytes - 1

PathLike = str | os.PathLike


# -------------------------------------------------------------------------------------------------
# dtypes: the core's table is the only one
def canonical_dtype(dtype: Any) -> str:
    """Canonical name of a KV cache dtype ('bf16', 'fp8_e4m3', ...) from any alias, a torch or
    numpy dtype included (the core's table, cxlkv.resolve_dtype). Unknown: ValueError."""
    import cxlkv

    return cxlkv.resolve_dtype(str(dtype))


# -------------------------------------------------------------------------------------------------
# names
def short_name(name: str, limit: int = MAX_NAME) -> str:
    """``name`` if it fits ``limit`` bytes of printable ASCII; else a readable head plus a hash of
    the whole name, so two long names never collide by truncation."""
    if len(name.encode()) <= limit and name.isprintable() and name.isascii():
        return name
    digest = hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()[:32]
    head = "".join(c if c.isascii() and c.isprintable() else "_" for c in name)
    return f"{head[: limit - len(digest) - 1]}~{digest}"


# -------------------------------------------------------------------------------------------------
# content sampling
def _windows(start: int, length: int, count: int) -> list[tuple[int, int]]:
    """``count`` windows of SAMPLE_BYTES evenly spread over [start, start + length)."""
    if length <= max(WHOLE_TENSOR_BYTES, count * SAMPLE_BYTES):
        return [(start, length)]
    span = length - SAMPLE_BYTES
    return [(start + span * i // (count - 1), SAMPLE_BYTES) for i in range(count)]


def _hash_windows(h: hashlib._Hash, f, windows: Iterable[tuple[int, int]]) -> None:
    for off, n in windows:
        f.seek(off)
        data = f.read(n)
        h.update(struct.pack("<QQ", off, len(data)))
        h.update(data)


def _safetensors_digest(h, f, size: int) -> bool:
    """Header (tensor table) + samples of every tensor. False when it is not a safetensors file."""
    head = f.read(8)
    if len(head) < 8:
        return False
    n = struct.unpack("<Q", head)[0]
    if not 2 <= n <= min(size - 8, 1 << 30):
        return False
    try:
        table = json.loads(f.read(n))
    except (ValueError, UnicodeDecodeError):
        return False
    if not isinstance(table, dict):
        return False
    h.update(b"safetensors")
    h.update(json.dumps(table, sort_keys=True).encode())
    base = 8 + n
    for name in sorted(k for k in table if k != "__metadata__"):
        t = table[name]
        try:
            begin, end = (int(x) for x in t["data_offsets"])
        except (KeyError, TypeError, ValueError):
            return False
        if not 0 <= begin <= end or base + end > size:
            return False
        _hash_windows(h, f, _windows(base + begin, end - begin, SAMPLES_PER_TENSOR))
    return True


_GGUF_SCALARS = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}


def _gguf_tensor_ranges(f, size: int) -> tuple[bytes, list[tuple[int, int]]] | None:
    """(tensor table bytes, [(offset, length)] of every tensor's data) of a GGUF file, or None."""

    def read(fmt: str):
        n = struct.calcsize(fmt)
        b = f.read(n)
        if len(b) != n:
            raise ValueError("short read")
        return struct.unpack(fmt, b)[0]

    def string() -> bytes:
        n = read("<Q")
        if n > 1 << 24:
            raise ValueError("string too long")
        return f.read(n)

    def skip_value(t: int, depth: int = 0) -> None:
        if t in _GGUF_SCALARS:
            read(_GGUF_SCALARS[t])
        elif t == 8:
            string()
        elif t == 9 and depth < 4:
            et, count = read("<I"), read("<Q")
            if count > 1 << 28:
                raise ValueError("array too long")
            for _ in range(count):
                skip_value(et, depth + 1)
        else:
            raise ValueError(f"bad GGUF value type {t}")

    try:
        if f.read(4) != b"GGUF":
            return None
        version = read("<I")
        if version < 2:
            return None
        n_tensors, n_kv = read("<Q"), read("<Q")
        if n_tensors > 1 << 20 or n_kv > 1 << 20:
            return None
        alignment = 32
        for _ in range(n_kv):
            key, t = string(), read("<I")
            if key == b"general.alignment" and t == 4:
                alignment = read("<I") or 32
            else:
                skip_value(t)
        table_start = f.tell()
        infos = []
        for _ in range(n_tensors):
            string()
            dims = read("<I")
            if dims > 8:
                return None
            for _ in range(dims):
                read("<Q")
            read("<I")
            infos.append(read("<Q"))
        table = (table_start, f.tell())
    except (ValueError, struct.error):
        return None
    data = (table[1] + alignment - 1) // alignment * alignment
    offsets = sorted(set(infos))
    ranges = []
    for i, off in enumerate(offsets):
        end = offsets[i + 1] if i + 1 < len(offsets) else size - data
        if data + end > size or end < off:
            return None
        ranges.append((data + off, end - off))
    f.seek(table[0])
    return f.read(table[1] - table[0]), ranges


def file_digest(path: PathLike, suffix: str | None = None) -> str:
    """Sampled content digest of one weight file (see the module docstring); sha256 hex.
    ``suffix``: the format's file suffix when ``path`` has none (a hub blob a snapshot links to)."""
    path = Path(path)
    suffix = path.suffix if suffix is None else suffix
    size = path.stat().st_size
    h = hashlib.sha256(IDENTITY_VERSION.encode())
    h.update(struct.pack("<Q", size))
    with open(path, "rb") as f:
        if suffix == ".safetensors" and _safetensors_digest(h, f, size):
            return h.hexdigest()
        f.seek(0)
        gguf = _gguf_tensor_ranges(f, size) if suffix == ".gguf" else None
        if gguf is not None:
            h.update(b"gguf")
            h.update(gguf[0])
            for off, n in gguf[1]:
                _hash_windows(h, f, _windows(off, n, SAMPLES_PER_TENSOR))
            return h.hexdigest()
        # Unparsed format (pickled .bin, ...): windows spread over the whole file, the start
        # (headers, tensor tables) included.
        h.update(b"blob")
        count = max(BLOB_MIN_WINDOWS, size // BLOB_WINDOW_STRIDE)
        _hash_windows(h, f, _windows(0, size, count))
    return h.hexdigest()


def tensor_digest(data: Any) -> str:
    """sha256 of a tensor's (or buffer's) raw bytes: the key material of prompt embeddings."""
    if hasattr(data, "detach"):  # torch: a byte view of the CPU copy, no dtype conversion
        t = data.detach().cpu().contiguous()
        h = hashlib.sha256(f"{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(-1).view(__import__("torch").uint8).numpy().tobytes())
        return h.hexdigest()
    return hashlib.sha256(memoryview(data).cast("B")).hexdigest()


@dataclasses.dataclass(frozen=True)
class WeightsDigest:
    digest: str  # sha256 hex over every weight/config file's digest
    files: int
    total_bytes: int
    commit: str = ""  # a Hugging Face snapshot's commit, shown in `source` only
    path: str = ""

    def describe(self) -> str:
        gb = self.total_bytes / 1e9
        commit = f" hf-commit {self.commit[:12]}" if self.commit else ""
        return f"sha256~{self.digest[:16]} ({self.files} files, {gb:.2f} GB){commit} at {self.path}"


def _allowed_trees(root: Path) -> tuple[Path, ...]:
    """Where the files of the model at ``root`` (resolved) may live: its own tree; for a Hugging
    Face hub snapshot (``<repo>/snapshots/<commit>``, whose files are symlinks into the repo's
    blobs), also ``<repo>/blobs``."""
    repo = root.parent.parent
    if root.parent.name == "snapshots" and repo.name.startswith(("models--", "datasets--", "spaces--")):
        return (root, repo / "blobs")
    return (root,)


def _checked_target(path: Path, trees: tuple[Path, ...]) -> Path:
    """The regular file ``path`` resolves to, inside ``trees``; else WeightPathError."""
    real = Path(os.path.realpath(path))
    if not any(real.is_relative_to(t) for t in trees):
        where = " or ".join(str(t) for t in trees)
        raise WeightPathError(
            f"{path} resolves to {real}, outside {where}: cxlkv hashes only files inside the model "
            "(copy the file in, or point the link inside)"
        )
    st = os.stat(real)
    if not stat.S_ISREG(st.st_mode):
        raise WeightPathError(f"{path} resolves to {real}, which is not a regular file")
    return real


def _weight_files(root: Path) -> list[tuple[Path, Path]]:
    """(path as found under root, the regular file it resolves to) of every weight and config
    file; symlinks are followed only inside :func:`_allowed_trees` (WeightPathError otherwise),
    and a directory reached twice (a link to an ancestor) is walked once."""
    root = Path(os.path.realpath(root))
    trees = _allowed_trees(root)
    if root.is_file():
        return [(root, _checked_target(root, trees))]
    out: list[tuple[Path, Path]] = []
    seen = {root}
    for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
        keep = []
        for d in sorted(d for d in dirnames if not d.startswith(".")):
            real = Path(os.path.realpath(Path(dirpath) / d))
            if not real.is_relative_to(root):
                raise WeightPathError(f"{Path(dirpath) / d} resolves to {real}, outside the model {root}")
            if real not in seen:
                seen.add(real)
                keep.append(d)
        dirnames[:] = keep
        for fn in filenames:
            if fn.endswith(WEIGHT_SUFFIXES) or fn in CONFIG_FILES:
                found = Path(dirpath) / fn
                out.append((found, _checked_target(found, trees)))
    return sorted(out)


def weight_files(path: PathLike) -> list[tuple[str, Path]]:
    """(name relative to the model directory, the file to read) of every weight file of a model
    directory or lone weight file (whose name is not content: "")."""
    root = Path(path).expanduser().resolve()
    return [
        ("" if root.is_file() else f.relative_to(root).as_posix(), real)
        for f, real in _weight_files(root)
        if f.suffix in WEIGHT_SUFFIXES
    ]


def _hf_commit(root: Path) -> str:
    parts = root.resolve().parts
    if len(parts) >= 3 and parts[-2] == "snapshots" and re.fullmatch(r"[0-9a-f]{40}", parts[-1]):
        return parts[-1]
    return ""


def weights_digest(path: PathLike) -> WeightsDigest:
    """Content identity of a model directory (or a single weight file such as a .gguf).

    The same bytes at another path give the same digest (file names relative to the directory
    are hashed, absolute paths are not); any change to a sampled window, a tensor table, a file
    size or a config file gives another."""
    # Resolved: a symlink such as /models/current re-pointed to another version is another model.
    root = Path(path).expanduser().resolve()
    files = _weight_files(root)
    if not any(f.suffix in WEIGHT_SUFFIXES for f, _ in files):
        raise FileNotFoundError(f"no weight files ({', '.join(WEIGHT_SUFFIXES)}) under {root}")
    # Names inside a directory (shards) are content; the name of a lone file (a .gguf) is not.
    # What is read is the checked target, so a link re-pointed after the check is not followed.
    stats = [
        ("" if root.is_file() else f.relative_to(root).as_posix(), f, real, real.stat()) for f, real in files
    ]
    cache = IdentityCache(root, {st.st_uid for *_, st in stats}, IDENTITY_VERSION)
    h = hashlib.sha256(IDENTITY_VERSION.encode())
    total = 0
    for rel, f, real, st in stats:
        digest = cache.get(rel, st)
        if digest is None:  # the name (a hub blob's is its hash) says the format; the target is read
            config = f.name in CONFIG_FILES
            digest = hashlib.sha256(real.read_bytes()).hexdigest() if config else file_digest(real, f.suffix)
        cache.put(rel, st, digest)
        total += st.st_size
        name = rel.encode()
        h.update(struct.pack("<I", len(name)) + name + bytes.fromhex(digest))
    cache.save()
    return WeightsDigest(h.hexdigest(), len(files), total, _hf_commit(root), str(root))


# Keys of a loaded config that name where it came from, not what it computes.
CONFIG_PROVENANCE_KEYS = frozenset({"_name_or_path", "name_or_path", "_commit_hash", "transformers_version"})


def _strip_provenance(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _strip_provenance(v) for k, v in value.items() if k not in CONFIG_PROVENANCE_KEYS}
    if isinstance(value, list | tuple):
        return [_strip_provenance(v) for v in value]
    return value


def config_digest(paths: Iterable[PathLike] = (), loaded: dict | None = None) -> str:
    """Digest of the configuration an engine computes with, beyond the model directory's own
    config files (those are in :func:`weights_digest`): the config files of every other path the
    engine read a config from (vLLM's ``hf_config_path``: a directory's CONFIG_FILES, or a file),
    by content, and ``loaded``, the config as the engine parsed it (overrides and values derived
    from a GGUF included), minus the keys that only say where it came from."""
    h = hashlib.sha256(IDENTITY_VERSION.encode() + b"|config")
    for p in sorted({Path(p).expanduser().resolve() for p in paths}):
        found = [p / n for n in CONFIG_FILES if (p / n).is_file()] if p.is_dir() else [p]
        for f in found:
            name = f.name.encode()  # not the path: another directory with equal bytes is equal
            h.update(struct.pack("<I", len(name)) + name + hashlib.sha256(f.read_bytes()).digest())
    if loaded is not None:
        h.update(b"loaded" + json.dumps(_strip_provenance(loaded), sort_keys=True, default=str).encode())
    return h.hexdigest()


def weights_identity(files: WeightsDigest, config: str, loaded: Any = None) -> tuple[str, str]:
    """(KVIdentity.weights, its source text) from the sampled file digest, the config digest and,
    when the engine could hash them, every byte of the weights (a loaded_weights.LoadedDigest:
    as loaded, or of the files). The kinds never share a name: "loaded:" / "files:" /
    "sampled:" lead the weights field, and the source, which ``cxlkv pool info`` shows, says
    which one a namespace used."""
    parts = [files.digest, config] + ([loaded.digest] if loaded is not None else [])
    kind = loaded.kind if loaded is not None else "sampled"  # "loaded" | "files" | "sampled"
    digest = hashlib.sha256("|".join([kind, *parts]).encode()).hexdigest()
    where = f" at {files.path}" if files.path else ""
    if loaded is None:
        source = f"weights sampled {files.describe()}"
    elif kind == "loaded":
        source = f"weights as loaded {loaded.describe()} + files sha256~{files.digest[:12]}{where}"
    else:
        source = f"weights file bytes {loaded.describe()}{where}"
    return f"{kind}:{digest}", source


def adapter_digest(path: PathLike) -> str:
    """Content identity of a LoRA adapter directory (same recipe as the weights)."""
    return weights_digest(path).digest


# -------------------------------------------------------------------------------------------------
# the namespace
@dataclasses.dataclass(frozen=True)
class KVIdentity:
    """Everything that determines the bytes of one KV block; two identities that differ in any
    field never share a namespace. ``weights`` is a :func:`weights_digest` or an operator's
    ``model_id`` override (then ``weights_source`` says so)."""

    weights: str
    dtype: str  # canonical KV cache dtype (canonical_dtype)
    kind: str  # 'dense' | 'mla' | 'opaque'
    num_layers: int
    num_kv_heads: int
    head_size: int
    block_size: int  # tokens per block
    heads_per_entry: int = 0  # dense: KV heads per pool entry (0: whole blocks; heads.py)
    kv_scales: str = "none"  # how K/V are scaled into dtype (fp8: the scales or their method)
    quantization: str = "none"  # weight quantization method (changes the computed KV)
    compute_dtype: str = ""  # the model's activation dtype (K/V are computed in it)
    overrides: str = ""  # runtime changes to the model's config (vLLM hf_overrides)
    device_layout: str = "cpu"  # device type + attention backend + block byte layout
    block_bytes: int = 0
    weights_source: str = dataclasses.field(default="", compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", canonical_dtype(self.dtype))

    def fields(self) -> dict:
        d = dataclasses.asdict(self)
        d.pop("weights_source")
        return d

    def digest(self) -> str:
        blob = json.dumps({"v": IDENTITY_VERSION, **self.fields()}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()

    def namespace_name(self) -> str:
        """What the namespace is called in the pool: the identity's digest (no display name: the
        same bytes under two aliases must share it), 192 bits."""
        return f"kv2-{self.digest()[:48]}"  # kv2: per-head entries, no TP rank/size (format 2.5)

    def model_id(self) -> str:
        """The layout's model_id field (96 bytes): the weights identity, hashed if too long."""
        return short_name(self.weights)

    def source(self, limit: int = 255) -> str:
        """Human-readable provenance for ``cxlkv pool info`` (display only, never identity)."""
        s = (
            f"{self.weights_source or self.weights}; kv {self.dtype} scales={self.kv_scales} "
            f"quant={self.quantization} bs{self.block_size} h{self.num_kv_heads}/e{self.heads_per_entry} "
            f"{self.device_layout}"
        )
        s = "".join(c if c.isprintable() and c.isascii() else "?" for c in s)
        return s if len(s) <= limit else s[: limit - 3] + "..."


# -------------------------------------------------------------------------------------------------
# the namespace engines share (docs/IDENTITY.md, "Across engines")
SHARED_ENTRY_LAYOUT = "entry:layer,kv,token,dim"  # one KV head's entry: per layer K rows then V rows
SHARED_MLA_ENTRY_LAYOUT = "entry:layer,token,latent"  # one block's entry: per layer its latent rows
SHARED_ENTRY_LAYOUTS = {"dense": SHARED_ENTRY_LAYOUT, "mla": SHARED_MLA_ENTRY_LAYOUT}
SHARED_DTYPES = ("bf16", "fp16", "fp32")  # no scales: equal values are equal bytes


def shared_identity(
    weights: str,
    weights_source: str,
    dtype: Any,
    num_layers: int,
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    kind: str = "dense",
) -> KVIdentity:
    """The identity of a KV cache that any engine can read and write: what determines the bytes
    of one entry and nothing about the engine. ``weights``: the ``files:`` kind over the model
    directory alone (``config_digest()`` with no engine-parsed config: an engine's parsed config
    is its own), or an operator's ``model_id``. ``kind`` "dense": the entry of KV head g of a
    block is, for each layer in order, that head's K of the block's tokens (token-major,
    ``head_size`` elements each), then its V. ``kind`` "mla": one entry per block (the latent is
    the same on every rank; ``num_kv_heads`` must be 1), for each layer in order the block's
    latent rows (token-major, ``head_size`` = kv_lora_rank + rope elements each). ``block_bytes``
    is one such entry. K/V computed in ``dtype`` (the compute dtype is the KV dtype), no weight
    quantization, no config overrides: an engine configured otherwise keeps its own namespace."""
    dt = canonical_dtype(dtype)
    if dt not in SHARED_DTYPES:
        raise ValueError(f"KV dtype {dt} has no engine-neutral namespace (scaled or quantized KV)")
    if kind not in SHARED_ENTRY_LAYOUTS:
        raise ValueError(f"KV kind {kind!r} has no engine-neutral namespace")
    if kind == "mla" and num_kv_heads != 1:
        raise ValueError(f"an MLA latent is one entry per block, not {num_kv_heads} heads")
    itemsize = 4 if dt == "fp32" else 2
    rows = 2 if kind == "dense" else 1  # K and V rows, or one latent row, per token and layer
    return KVIdentity(
        weights=weights,
        weights_source=weights_source,
        dtype=dt,
        kind=kind,
        num_layers=num_layers,
        num_kv_heads=num_kv_heads,
        head_size=head_size,
        block_size=block_size,
        heads_per_entry=1 if kind == "dense" else 0,
        compute_dtype=dt,
        device_layout=f"{SHARED_ENTRY_LAYOUTS[kind]}|{sys.byteorder}",
        block_bytes=num_layers * rows * block_size * head_size * itemsize,
    )
