"""The hashes of the core (vendored xxHash, third_party/xxhash) and the pool's own streaming block
checksum against the ``xxhash`` PyPI package, an independent build of the same specification: every
length 0..4096 on random bytes, and large inputs. The on-pool checksums and index keys depend on
these values, so a mismatch would make existing pools fail to verify."""

from __future__ import annotations

import random

import pytest

import cxlkv

xxhash = pytest.importorskip("xxhash")
_core = cxlkv._core


def _data(rng: random.Random, n: int) -> bytes:
    return rng.randbytes(n)


def test_all_lengths_to_4096_match_pypi_xxhash() -> None:
    rng = random.Random(0x5EED)
    blob = _data(rng, 4096 + 64)
    for n in range(4097):
        off = n % 61  # vary the alignment of the input too
        b = blob[off : off + n]
        want = xxhash.xxh3_64_intdigest(b)
        assert _core.xxh3_64(b) == want, n
        assert _core.block_checksum(b, 0, True) == want, n
        if n % 7 == 0:  # seeded (index keys use the namespace id, liveness small seeds)
            seed = rng.getrandbits(64)
            assert _core.xxh3_64_seeded(b, seed) == xxhash.xxh3_64_intdigest(b, seed=seed), n


@pytest.mark.parametrize("n", [65536, 1 << 20, (4 << 20) + 7, (9 << 20) - 1])
def test_large_inputs_match_pypi_xxhash(n: int) -> None:
    b = _data(random.Random(n), n)
    want = xxhash.xxh3_64_intdigest(b)
    assert _core.xxh3_64(b) == want
    assert _core.xxh3_64_seeded(b, 0x9E3779B97F4A7C15) == xxhash.xxh3_64_intdigest(b, seed=0x9E3779B97F4A7C15)
    for piece, copy in ((0, True), (0, False), (4096, True), (1000, True), (64, False), (333, False)):
        assert _core.block_checksum(b, piece, copy) == want, (piece, copy)
