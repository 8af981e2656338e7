"""The identity of the weights as loaded (loaded_weights.py) on real torch modules: every byte
counts, so the ROME-like edit that the sampled file digest misses (issue 14 item 5: 20 of 2048
rows of a 4 MiB projection) changes it; and it depends on nothing but the bytes."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from cxlkv.integrations import identity as ident
from cxlkv.integrations import loaded_weights as lw

torch = pytest.importorskip("torch")

ROWS, COLS = 2048, 1024  # fp16: a 4 MiB projection


def model(seed: int = 0) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)
    m = torch.nn.Sequential(
        torch.nn.Embedding(64, COLS),
        torch.nn.Linear(COLS, ROWS, bias=False),
        torch.nn.LayerNorm(ROWS),
    ).to(torch.float16)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32).to(p.dtype))
    return m


def save(m: torch.nn.Module, d: Path) -> Path:
    """The module as a safetensors checkpoint (raw little-endian bytes, as the format stores them)."""
    d.mkdir(parents=True, exist_ok=True)
    header, blobs, off = {}, [], 0
    for name, p in sorted(m.state_dict().items()):
        raw = p.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        header[name] = {"dtype": "F16", "shape": list(p.shape), "data_offsets": [off, off + len(raw)]}
        blobs.append(raw)
        off += len(raw)
    h = json.dumps(header).encode()
    (d / "model.safetensors").write_bytes(struct.pack("<Q", len(h)) + h + b"".join(blobs))
    return d


def rome_edit(m: torch.nn.Module, rows=range(1000, 1020)) -> None:
    """A rank-one update confined to 20 rows of the projection (what ROME-style editing does)."""
    w = m[1].weight
    g = torch.Generator().manual_seed(7)
    u = torch.zeros(ROWS, dtype=torch.float32)
    u[list(rows)] = torch.randn(len(rows), generator=g)
    v = torch.randn(COLS, generator=g)
    with torch.no_grad():
        w.add_((0.05 * torch.outer(u, v)).to(w.dtype))


def test_rome_edit_missed_by_sampling_is_caught_as_loaded(tmp_path):
    m = model()
    assert m[1].weight.numel() * m[1].weight.element_size() == 4 << 20
    sampled, loaded = ident.weights_digest(save(m, tmp_path / "a")).digest, lw.module_digest(m).digest
    rome_edit(m)
    # The documented hole of the sampled digest: the edit lies outside its three windows.
    assert ident.weights_digest(save(m, tmp_path / "b")).digest == sampled
    assert lw.module_digest(m).digest != loaded


def test_depends_on_the_bytes_only(monkeypatch):
    a, b = model(1), model(1)
    ref = lw.module_digest(a)
    assert ref == lw.module_digest(b)  # another instance, same bytes
    assert ref.tensors == 4 and ref.total_bytes == sum(p.numel() * 2 for p in a.parameters())
    # Many chunks per tensor: the thread count does not change the digest.
    monkeypatch.setattr(lw, "CHUNK_BYTES", 1 << 20)
    small = lw.module_digest(a, threads=1)
    assert lw.module_digest(a, threads=3) == small
    assert small != ref  # the chunk size is part of the recipe (versioned with it)
    # Order of iteration is not identity: names are sorted.
    assert lw.loaded_weights_digest(reversed(list(a.named_parameters()))) == small


def test_every_bit_and_the_dtype_count():
    m = model(2)
    ref = lw.module_digest(m).digest
    with torch.no_grad():
        flat = m[2].bias.view(torch.int16)
        flat[-1] ^= 1  # the last bit of the last element of a norm
    assert lw.module_digest(m).digest != ref
    x = torch.arange(8, dtype=torch.float32)
    assert (
        lw.loaded_weights_digest([("w", x.to(torch.bfloat16))]).digest
        != lw.loaded_weights_digest([("w", x.to(torch.float16))]).digest
    )
    assert lw.loaded_weights_digest([("w", x)]) != lw.loaded_weights_digest([("v", x)])


def test_non_contiguous_and_numpy_tensors():
    x = torch.randn(64, 32).to(torch.bfloat16)
    assert lw.loaded_weights_digest([("w", x.t())]) == lw.loaded_weights_digest([("w", x.t().contiguous())])
    y = torch.randn(16, 16)
    # numpy arrays work as well (without torch in the process); the dtype is named as numpy does.
    assert lw.loaded_weights_digest([("w", y.numpy())]) == lw.loaded_weights_digest([("w", y.numpy().copy())])
    with pytest.raises(ValueError, match="duplicate"):
        lw.loaded_weights_digest([("w", y), ("w", y)])


def test_emptied_parameters_are_counted():
    """vLLM CPU repacks linear weights into oneDNN handles and leaves `weight` empty: such a
    digest does not cover every weight, and says so."""
    m = model()
    assert lw.module_digest(m).emptied == 0
    m[1].weight = torch.nn.Parameter(torch.empty(0, dtype=torch.float16), requires_grad=False)
    assert lw.module_digest(m).emptied == 1


def test_files_digest_every_byte_of_the_files(tmp_path):
    m = model()
    a = save(m, tmp_path / "a")
    b = save(m, tmp_path / "b")  # same bytes elsewhere
    ref = lw.files_digest(ident.weight_files(a))
    assert ref.kind == "files" and ref.total_bytes == (a / "model.safetensors").stat().st_size
    assert lw.files_digest(ident.weight_files(b)) == ref
    rome_edit(m)
    save(m, b)
    assert ident.weights_digest(b).digest == ident.weights_digest(a).digest  # sampling misses it
    assert lw.files_digest(ident.weight_files(b)) != ref
