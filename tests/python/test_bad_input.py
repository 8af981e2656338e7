"""Bad input: every way a pool can be unusable gives a specific exception with a clear message,
and the CLI exits with code 2 without a traceback. Plus fuzzing (hypothesis) of the open path
and of index entries / metadata with corrupt offsets: errors, misses, never wrong bytes or a crash.
"""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import textwrap

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import cxlkv
import cxlkv_testutil as tu
from conftest import KiB, MiB, small_layout

BB = 4 * KiB
FUZZ_POOL_BYTES = 8 * MiB
FUZZ_PHASES = [Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink]


def run_cli(*args, as_user=None, timeout=60):
    """Runs ``python -m cxlkv ARGS``; with as_user, drops root privileges first (in-process, after
    the imports, so that the interpreter itself need not be readable by that user)."""
    if as_user is None:
        cmd = [sys.executable, "-m", "cxlkv", *args]
    else:
        # Warm-up run as root on a missing path so that every module the CLI imports lazily is
        # loaded before the interpreter's own files become unreadable.
        code = textwrap.dedent(f"""
            import contextlib, io, os, sys
            import cxlkv, cxlkv.cli
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                try:
                    cxlkv.cli.main({list(args[:-1])!r} + ["/nonexistent/cxlkv-warmup"])
                except SystemExit:
                    pass
            os.setgroups([]); os.setgid({as_user}); os.setuid({as_user})
            sys.argv = ["cxlkv"] + {list(args)!r}
            sys.exit(cxlkv.cli.main({list(args)!r}))
        """)
        cmd = [sys.executable, "-c", code]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def assert_cli_rejects(path, *, as_user=None):
    for sub in ("info", "check"):
        r = run_cli("pool", sub, path, as_user=as_user)
        assert r.returncode == 2, (sub, r.returncode, r.stdout, r.stderr)
        assert "Traceback" not in r.stderr, r.stderr
        assert "Traceback" not in r.stdout, r.stdout
        assert r.stderr.strip(), f"pool {sub}: no error message on stderr"
        assert path in r.stderr, f"pool {sub}: the message does not name the path: {r.stderr!r}"


def make_file_pool(path, size=32 * MiB):
    with cxlkv.Pool.create(path, size, chunk_size=1 * MiB) as pool:
        ns = pool.namespace(small_layout())
        for i in range(20):
            k = tu.make_key("bad", i)
            ns.put(k, tu.key_payload(k, BB))
    return path


# ------------------------------------------------------------------------------------------------
def test_header_layout_matches_format_h(pool_path):
    """The offsets these tests patch are those of src/core/format/format.h, and the checksum is XXH3-64
    over the header up to the checksum field."""
    make_file_pool(pool_path)
    h = tu.read_header(pool_path)
    assert h["magic"] == tu.MAGIC
    assert h["major"] == 3  # format 3: quotas (src/core/format/quota.h)
    assert h["header_bytes"] == tu.HEADER_STRUCT_BYTES
    assert h["pool_bytes"] == 32 * MiB
    with open(pool_path, "rb") as f:
        raw = f.read(tu.HEADER_STRUCT_BYTES)
    assert h["checksum"] == tu.header_checksum(raw)
    with cxlkv.Pool.open(pool_path) as pool:
        info = pool.info()
    for field in ("index_off", "index_slots", "chunk_count", "chunk_bytes", "arena_off"):
        if field in info:
            assert info[field] == h[field], field


def test_missing_file(pool_path):
    with pytest.raises(FileNotFoundError, match="cxlkv-test"):
        cxlkv.Pool.open(pool_path)
    assert_cli_rejects(pool_path)


def test_truncated_file(pool_path):
    make_file_pool(pool_path)
    os.truncate(pool_path, 16 * MiB)  # header says 32 MiB
    with pytest.raises(cxlkv.PoolTruncatedError, match="truncated") as ei:
        cxlkv.Pool.open(pool_path)
    assert pool_path in str(ei.value)
    assert_cli_rejects(pool_path)


@pytest.mark.parametrize("size", [0, 100, 4096, 8191])
def test_tiny_file(pool_path, size):
    with open(pool_path, "wb") as f:
        f.write(b"\0" * size)
    with pytest.raises(cxlkv.PoolTruncatedError, match="cxlkv-test"):
        cxlkv.Pool.open(pool_path)


def test_wrong_magic(pool_path):
    make_file_pool(pool_path)
    tu.patch_file(pool_path, 0, b"NOTAPOOL")
    with pytest.raises(cxlkv.PoolFormatError, match="magic"):
        cxlkv.Pool.open(pool_path)
    assert_cli_rejects(pool_path)


def test_future_major_version(pool_path):
    make_file_pool(pool_path)
    future = tu.read_header(pool_path)["major"] + 1
    tu.patch_header_field(pool_path, "major", future)
    with pytest.raises(cxlkv.PoolVersionError, match=str(future)) as ei:
        cxlkv.Pool.open(pool_path)
    assert "newer" in str(ei.value) or "version" in str(ei.value).lower() or "format" in str(ei.value)
    assert_cli_rejects(pool_path)


def test_future_minor_version_is_fine(pool_path):
    make_file_pool(pool_path)
    tu.patch_header_field(pool_path, "minor", 99)
    tu.patch_header_field(pool_path, "compat", 1 << 40)  # unknown compat features are ignored
    with cxlkv.Pool.open(pool_path) as pool:
        ns = pool.namespace(small_layout())
        k = tu.make_key("bad", 3)
        assert ns.get_bytes(k) == tu.key_payload(k, BB)


def test_unknown_incompat_feature(pool_path):
    make_file_pool(pool_path)
    tu.patch_header_field(pool_path, "incompat", 1 << 17)
    with pytest.raises(cxlkv.PoolVersionError, match=r"incompat|feature"):
        cxlkv.Pool.open(pool_path)
    assert_cli_rejects(pool_path)


def test_unknown_ro_compat_feature_opens_read_only_only(pool_path):
    # ro_compat: an older reader may read but must not write (format.h PoolHeader).
    make_file_pool(pool_path)
    tu.patch_header_field(pool_path, "ro_compat", 1 << 5)
    with pytest.raises(cxlkv.PoolVersionError, match="ro_compat"):
        cxlkv.Pool.open(pool_path)
    with cxlkv.Pool.open(pool_path, read_only=True) as pool:
        assert pool.info()["ro_compat"] == 1 << 5
    r = run_cli("pool", "info", pool_path)
    assert r.returncode == 0, (r.stdout, r.stderr)


def test_lock_hosts_must_be_zero_outside_multihost(pool_path):
    # The field that was reserved1 (must be zero) is lock_hosts now: zero unless multihost.
    make_file_pool(pool_path)
    tu.patch_header_field(pool_path, "lock_hosts", 7)
    with pytest.raises(cxlkv.PoolFormatError, match="lock_hosts"):
        cxlkv.Pool.open(pool_path)
    assert_cli_rejects(pool_path)


def test_other_build_stamp(pool_path):
    make_file_pool(pool_path)
    tu.patch_header_field(pool_path, "stamp_index_entry", 128)
    with pytest.raises(cxlkv.PoolVersionError):
        cxlkv.Pool.open(pool_path)
    assert_cli_rejects(pool_path)


@pytest.mark.parametrize("offset", [13, 45, 70, 130, 170, 200])
def test_header_checksum_mismatch(pool_path, offset):
    make_file_pool(pool_path)
    with open(pool_path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x10]))
    with pytest.raises(cxlkv.PoolFormatError) as ei:
        cxlkv.Pool.open(pool_path)
    assert pool_path in str(ei.value)
    if offset != 13:  # offset 13 is inside header_bytes, which may be checked first
        assert "checksum" in str(ei.value)
    assert_cli_rejects(pool_path)


def test_random_bytes(pool_path):
    with open(pool_path, "wb") as f:
        f.write(os.urandom(4 * MiB))
    with pytest.raises(cxlkv.PoolFormatError, match="not a cxlkv pool"):
        cxlkv.Pool.open(pool_path)
    assert_cli_rejects(pool_path)
    with pytest.raises(cxlkv.PoolFormatError):
        cxlkv.Pool.destroy(pool_path)  # refuses to delete what is not a pool
    assert os.path.exists(pool_path)


def test_directory(pool_path):
    os.mkdir(pool_path)
    with pytest.raises(IsADirectoryError, match="cxlkv-test"):
        cxlkv.Pool.open(pool_path)
    with pytest.raises((IsADirectoryError, FileExistsError)):
        cxlkv.Pool.create(pool_path, 32 * MiB)
    assert_cli_rejects(pool_path)


def test_no_permission(pool_path):
    make_file_pool(pool_path)
    os.chmod(pool_path, 0o000)
    if os.geteuid() != 0:
        with pytest.raises(PermissionError, match="cxlkv-test"):
            cxlkv.Pool.open(pool_path)
        assert_cli_rejects(pool_path)
        return
    # root bypasses file permissions: open as an unprivileged user in a child process
    code = textwrap.dedent(f"""
        import os, cxlkv
        os.setgroups([]); os.setgid(65534); os.setuid(65534)
        try:
            cxlkv.Pool.open({pool_path!r})
        except PermissionError as e:
            assert {pool_path!r} in str(e), str(e)
            print("PermissionError")
        except BaseException as e:
            print("wrong exception", type(e).__name__, e)
        else:
            print("opened")
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "PermissionError", r.stdout + r.stderr
    assert_cli_rejects(pool_path, as_user=65534)


def test_read_only_file_no_write_permission(pool_path):
    make_file_pool(pool_path)
    os.chmod(pool_path, 0o444)
    if os.geteuid() == 0:
        code = textwrap.dedent(f"""
            import os, cxlkv
            os.setgroups([]); os.setgid(65534); os.setuid(65534)
            try:
                cxlkv.Pool.open({pool_path!r})
            except PermissionError:
                print("PermissionError")
            else:
                print("opened")
        """)
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
        assert r.stdout.strip() == "PermissionError", r.stdout + r.stderr
    else:
        with pytest.raises(PermissionError):
            cxlkv.Pool.open(pool_path)


def test_devdax_missing():
    path = "/dev/dax97.3"
    assert not os.path.exists(path)
    with pytest.raises(FileNotFoundError, match=r"dax97\.3"):
        cxlkv.Pool.open(path)
    with pytest.raises(FileNotFoundError, match=r"dax97\.3"):
        cxlkv.Pool.create(path, 64 * MiB)
    assert_cli_rejects(path)


def test_not_ready_pool(pool_path):
    """A pool whose commit word never said READY (creator died mid-initialization)."""
    make_file_pool(pool_path)
    for word in (0, tu.INIT_BUSY):
        tu.patch_file(pool_path, tu.SHARED_WORDS_OFF, struct.pack("<Q", word))
        with pytest.raises(cxlkv.PoolNotReadyError, match="initialized"):
            cxlkv.Pool.open(pool_path)
        assert_cli_rejects(pool_path)


def test_half_initialized_header(pool_path):
    """The creator died before even writing the header: zero magic, init word BUSY."""
    with open(pool_path, "wb") as f:
        f.truncate(32 * MiB)
    tu.patch_file(pool_path, tu.SHARED_WORDS_OFF, struct.pack("<Q", tu.INIT_BUSY))
    with pytest.raises((cxlkv.PoolNotReadyError, cxlkv.PoolFormatError)):
        cxlkv.Pool.open(pool_path)
    assert_cli_rejects(pool_path)


def test_impossible_geometry(pool_path):
    make_file_pool(pool_path)
    pristine = open(pool_path, "rb").read(tu.HEADER_STRUCT_BYTES)
    cases = [
        ("index_off", 31 * MiB),
        ("index_slots", 1000),
        ("chunk_count", 1 << 30),
        ("arena_off", 64),
        ("max_nodes", 0),
        ("node_area_bytes", 8),
        ("chunk_bytes", 4096),
        ("pool_bytes", 1 << 62),
        ("backend", 77),
    ]
    for field, value in cases:
        tu.patch_file(pool_path, 0, pristine)
        tu.patch_header_field(pool_path, field, value)
        with pytest.raises(cxlkv.CxlkvError) as ei:
            cxlkv.Pool.open(pool_path)
        assert isinstance(ei.value, (cxlkv.PoolFormatError, cxlkv.PoolTruncatedError)), (field, ei.value)
    assert_cli_rejects(pool_path)


def test_layout_mismatch_message(make_pool):
    pool = make_pool()
    pool.namespace(small_layout(model_id="org/model-x"), name="x")
    with pytest.raises(cxlkv.LayoutMismatchError) as ei:
        pool.namespace(small_layout(model_id="org/model-x", num_kv_heads=8), name="x")
    assert "x" in str(ei.value)
    assert isinstance(ei.value, cxlkv.CxlkvError)


def test_cli_ok_on_good_pool(pool_path):
    make_file_pool(pool_path)
    r = run_cli("pool", "info", pool_path)
    assert r.returncode == 0, r.stderr
    r = run_cli("pool", "check", pool_path)
    assert r.returncode == 0, r.stdout + r.stderr


# ------------------------------------------------------------------------------------------------
# Fuzzing the open path.
@pytest.fixture(scope="module")
def pristine_pool():
    """Bytes of a small pool holding some blocks, with one dead node (killed with SIGKILL while
    holding a lease) so that opening it runs the reclaim path too. Made once per module; each
    fuzz example writes a fresh copy."""
    path = f"/dev/shm/cxlkv-test-pristine-{os.getpid()}"
    try:
        with cxlkv.Pool.create(
            path, FUZZ_POOL_BYTES, chunk_size=256 * KiB, index_slots=1024, max_nodes=8, pin_slots=64
        ) as pool:
            ns = pool.namespace(small_layout())
            keys = [tu.make_key("fuzz", i) for i in range(300)]
            for k in keys:
                ns.put(k, tu.key_payload(k, BB))
        code = textwrap.dedent(f"""
            import sys, time
            sys.path.insert(0, {tu.here()!r})
            import cxlkv, cxlkv_testutil as tu
            from conftest import small_layout
            pool = cxlkv.Pool.open({path!r})
            ns = pool.namespace(small_layout())
            lease = ns.acquire([tu.make_key("fuzz", i) for i in range(40)])
            assert len(lease) == 40
            print("ready", flush=True)
            time.sleep(60)
        """)
        p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        assert p.stdout.readline().strip() == "ready"
        p.kill()
        p.wait()
        with open(path, "rb") as f:
            data = f.read()
    finally:
        if os.path.exists(path):
            os.unlink(path)
    return Pristine(data, keys, {n: tu.read_header_field(data, n) for n in tu.HEADER_FIELDS})


class Pristine(tuple):
    """(bytes, keys, header) with a short repr, so hypothesis reports stay readable."""

    def __new__(cls, data, keys, header):
        return super().__new__(cls, (data, keys, header))

    def __repr__(self):
        return f"<pristine pool image, {len(self[0])} bytes>"


def exercise(path, keys):
    """Open the pool and use it; returns normally or raises the allowed exceptions. Any bytes a
    get returns must be the right ones."""
    with cxlkv.Pool.open(path) as pool:
        pool.info()
        pool.stats()
        pool.check()
        ns = pool.namespace(small_layout())
        out = bytearray(BB)
        for k in keys[::7]:
            data = ns.get_bytes(k)
            assert data is None or data == tu.key_payload(k, BB), "wrong bytes from a corrupt pool"
            out[:] = bytes(BB)
            if ns.get(k, out):
                assert bytes(out) == tu.padded_payload(k, BB), "wrong bytes from a corrupt pool"
        ns.match_prefix(keys[:10])
        for i in range(40):  # enough to need eviction in the small pool
            k = tu.make_key("fuzz-new", i)
            ns.put(k, tu.key_payload(k, BB))
        with ns.acquire(keys[:4]):
            pass
        ns.delete(keys[1])
        pool.check()


# A corrupt pool may only produce cxlkv errors (or OS errors); a ValueError would mean that a
# value read from the pool was mistaken for a bad argument.
ALLOWED = (cxlkv.CxlkvError, OSError)


def write_copy(path, data):
    with open(path, "wb") as f:
        f.write(data)


@settings(
    max_examples=200,
    deadline=None,
    phases=FUZZ_PHASES,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    st.data(),
    st.booleans(),
    st.sampled_from(["none", "shrink", "grow"]),
)
def test_fuzz_header_open(pristine_pool, pool_path, data, fix_checksum, resize):
    pristine, keys, _ = pristine_pool
    buf = bytearray(pristine)
    for _ in range(data.draw(st.integers(1, 3), label="patches")):
        off = data.draw(st.integers(0, tu.HEADER_STRUCT_BYTES - 1), label="offset")
        blob = data.draw(st.binary(min_size=1, max_size=24), label="bytes")
        blob = blob[: tu.HEADER_STRUCT_BYTES - off]
        buf[off : off + len(blob)] = blob
    if fix_checksum:  # get past the checksum so that field validation is what gets fuzzed
        struct.pack_into("<Q", buf, tu.CHECKSUM_OFF, tu.header_checksum(buf))
    if resize == "shrink":
        buf = buf[: data.draw(st.integers(0, len(buf) - 1), label="size")]
    elif resize == "grow":
        buf += bytes(data.draw(st.integers(1, 1 * MiB), label="grow"))
    write_copy(pool_path, bytes(buf))
    try:
        exercise(pool_path, keys)
    except ALLOWED:
        pass


@settings(
    max_examples=150,
    deadline=None,
    phases=FUZZ_PHASES,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    st.integers(0, (1 << 64) - 1),
    st.sampled_from([n for n, (_, f) in tu.HEADER_FIELDS.items() if f in ("<Q", "<I", "<H")]),
)
def test_fuzz_header_field_values(pristine_pool, pool_path, value, field):
    """One field set to an arbitrary value, checksum re-sealed: open fails cleanly or works."""
    pristine, keys, _ = pristine_pool
    write_copy(pool_path, pristine)
    off, fmt = tu.HEADER_FIELDS[field]
    bits = struct.calcsize(fmt) * 8
    if field == "checksum":
        tu.patch_file(pool_path, off, struct.pack(fmt, value % (1 << bits)))
    else:
        tu.patch_header_field(pool_path, field, value % (1 << bits))
    try:
        exercise(pool_path, keys)
    except ALLOWED:
        pass


# ------------------------------------------------------------------------------------------------
# Entries and metadata with corrupt offsets.
def ready_entries(buf, h):
    """(slot, key) of every READY index entry in pool bytes ``buf``."""
    out = []
    base = h["index_off"]
    for slot in range(h["index_slots"]):
        off = base + slot * tu.ENTRY_BYTES
        word = struct.unpack_from("<Q", buf, off)[0]
        if word >> 56 == tu.ENTRY_READY:
            out.append((slot, bytes(buf[off + tu.ENTRY_KEY_OFF : off + tu.ENTRY_KEY_OFF + 32])))
    return out


def test_corrupt_entry_offsets(pool_path):
    make_file_pool(pool_path)
    with cxlkv.Pool.open(pool_path) as pool:
        info = pool.info()
    h = tu.read_header(pool_path)
    index_off = info.get("index_off", h["index_off"])
    assert index_off == h["index_off"]
    with open(pool_path, "rb") as f:
        buf = f.read()
    entries = ready_entries(buf, h)
    assert len(entries) == 20
    keys = {tu.make_key("bad", i) for i in range(20)}
    assert {k for _, k in entries} == keys
    garbage = [
        ("chunk", tu.ENTRY_CHUNK_OFF, struct.pack("<I", 0xFFFFFFF0)),
        ("chunk", tu.ENTRY_CHUNK_OFF, struct.pack("<I", h["chunk_count"])),
        ("block", tu.ENTRY_BLOCK_OFF, struct.pack("<H", 0xFFFF)),
        ("block", tu.ENTRY_BLOCK_OFF, struct.pack("<H", 300)),
        ("length", tu.ENTRY_LENGTH_OFF, struct.pack("<I", 0xFFFFFFFF)),
        ("length", tu.ENTRY_LENGTH_OFF, struct.pack("<I", BB + 1)),
        ("ns", tu.ENTRY_NS_OFF, struct.pack("<I", 0xFFFF)),
        ("checksum", tu.ENTRY_CHECKSUM_OFF, struct.pack("<Q", 12345)),
        ("block-swap", tu.ENTRY_BLOCK_OFF, None),  # points at another key's block
        ("chunk-block", tu.ENTRY_CHUNK_OFF, struct.pack("<IH", 0, 0)),
    ]
    corrupted = {}
    with open(pool_path, "r+b") as f:
        for i, (slot, k) in enumerate(entries[: len(garbage)]):
            name, field_off, blob = garbage[i]
            off = index_off + slot * tu.ENTRY_BYTES
            if blob is None:
                other = entries[-1][0]
                blob = buf[
                    index_off + other * tu.ENTRY_BYTES + tu.ENTRY_CHUNK_OFF : index_off
                    + other * tu.ENTRY_BYTES
                    + tu.ENTRY_BLOCK_OFF
                    + 2
                ]
                field_off = tu.ENTRY_CHUNK_OFF
            f.seek(off + field_off)
            f.write(blob)
            corrupted[k] = name
    with cxlkv.Pool.open(pool_path) as pool:
        ns = pool.namespace(small_layout())
        out = bytearray(BB)
        for k in keys:
            for attempt in ("get", "get_bytes", "load"):
                try:
                    if attempt == "get":
                        out[:] = bytes(BB)
                        ok = ns.get(k, out)
                        data = bytes(out) if ok else None
                        expect = tu.padded_payload(k, BB)
                    else:
                        data = ns.get_bytes(k)
                        expect = tu.key_payload(k, BB)
                except cxlkv.PoolCorruptError:
                    assert k in corrupted
                    continue
                if k in corrupted:
                    # a corrupt entry yields a miss or an error, never other bytes
                    assert data is None or data == expect, corrupted[k]
                else:
                    assert data == expect, "an intact entry must still be readable"
        report = pool.check()
        assert not report["ok"]
        assert report["errors"], report
        # more puts (eviction walks the corrupt entries too): bool or PoolCorruptError only
        for i in range(10000):  # more than the pool holds
            k = tu.make_key("after-corruption", i)
            try:
                assert ns.put(k, tu.key_payload(k, BB)) in (True, False)
            except cxlkv.PoolCorruptError:
                pass
        for k in keys - set(corrupted):
            try:
                d = ns.get_bytes(k)
            except cxlkv.PoolCorruptError:
                continue
            assert d is None or d == tu.key_payload(k, BB)
    r = run_cli("pool", "check", pool_path)
    assert r.returncode == 1, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr


@settings(
    max_examples=150,
    deadline=None,
    phases=FUZZ_PHASES,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(st.data())
def test_fuzz_entry_fields(pristine_pool, pool_path, data):
    """Random garbage in random fields of random READY entries: get() is a hit with the right
    bytes, a miss, or PoolCorruptError; nothing else."""
    pristine, keys, h = pristine_pool
    buf = bytearray(pristine)
    entries = ready_entries(buf, h)
    assert entries
    n = data.draw(st.integers(1, 8), label="entries")
    for _ in range(n):
        slot, _k = data.draw(st.sampled_from(entries), label="entry")
        field = data.draw(st.sampled_from([0, 40, 44, 48, 50, 52, 56]), label="field")
        width = {0: 8, 40: 4, 44: 4, 48: 2, 50: 2, 52: 4, 56: 8}[field]
        blob = data.draw(st.binary(min_size=width, max_size=width), label="value")
        off = h["index_off"] + slot * tu.ENTRY_BYTES + field
        buf[off : off + width] = blob
    write_copy(pool_path, bytes(buf))
    try:
        exercise(pool_path, keys)
    except ALLOWED:
        pass


METADATA_AREAS = ["node_table", "node_areas", "ns_table", "index", "access", "chunk_map", "arena"]


@settings(
    max_examples=150,
    deadline=None,
    phases=FUZZ_PHASES,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(st.data(), st.sampled_from(METADATA_AREAS))
def test_fuzz_metadata_areas(pristine_pool, pool_path, data, area):
    """Random bytes over any metadata area (node table, pins, namespaces, index, chunk map,
    block descriptors and payloads): open and use the pool; errors or misses only."""
    pristine, keys, h = pristine_pool
    bounds = {
        "node_table": (h["node_table_off"], h["max_nodes"] * 64),
        "node_areas": (h["node_area_off"], h["max_nodes"] * h["node_area_bytes"]),
        "ns_table": (h["ns_table_off"], h["max_namespaces"] * h["stamp_namespace"]),
        "index": (h["index_off"], h["index_slots"] * 64),
        "access": (h["access_off"], h["index_slots"] * 8),
        "chunk_map": (h["chunk_map_off"], h["chunk_count"] * 8),
        "arena": (h["arena_off"], len(pristine) - h["arena_off"]),
    }[area]
    start, length = bounds
    length = min(length, 1 << 20)
    buf = bytearray(pristine)
    for _ in range(data.draw(st.integers(1, 4), label="patches")):
        off = start + data.draw(st.integers(0, length - 1), label="offset")
        blob = data.draw(st.binary(min_size=1, max_size=64), label="bytes")
        blob = blob[: start + length - off]
        buf[off : off + len(blob)] = blob
    write_copy(pool_path, bytes(buf))
    try:
        exercise(pool_path, keys)
    except ALLOWED:
        pass


def test_corrupt_namespace_name(pool_path):
    """Non-UTF-8 bytes in a namespace's model id / name inside the pool: listing namespaces and
    stats must still work (or raise a cxlkv error), not leak a UnicodeDecodeError."""
    make_file_pool(pool_path)
    h = tu.read_header(pool_path)
    tu.patch_file(pool_path, h["ns_table_off"] + 64, b"\x80\xff")  # model_id
    tu.patch_file(pool_path, h["ns_table_off"] + 160, b"\xc3\x28")  # name
    with cxlkv.Pool.open(pool_path) as pool:
        for call in (pool.namespaces, pool.stats, pool.check, pool.info):
            try:
                call()
            except cxlkv.CxlkvError:
                pass
    r = run_cli("pool", "info", pool_path)
    assert "Traceback" not in r.stderr, r.stderr
    assert r.returncode in (0, 1, 2)


def test_payload_corruption_is_a_miss(pool_path):
    """A flipped byte in a stored payload: get() misses and counts a checksum failure; it never
    returns the corrupt bytes."""
    make_file_pool(pool_path)
    k = tu.make_key("bad", 7)
    expect = tu.key_payload(k, BB)
    with open(pool_path, "rb") as f:
        buf = f.read()
    pos = buf.find(expect)
    assert pos > 0 and buf.find(expect, pos + 1) == -1
    tu.patch_file(pool_path, pos + len(expect) // 2, bytes([buf[pos + len(expect) // 2] ^ 1]))
    with cxlkv.Pool.open(pool_path) as pool:
        ns = pool.namespace(small_layout())
        before = pool.stats()
        assert ns.get_bytes(k) is None
        out = bytearray(BB)
        assert ns.get(k, out) is False
        assert ns.load([k], [memoryview(bytearray(BB)).cast("B", (1, BB))], [0]) == 0
        after = pool.stats()
        # counted at least once (the core may drop the corrupt block after the first failure)
        assert after["checksum_failures"] - before["checksum_failures"] >= 1
        other = tu.make_key("bad", 8)
        assert ns.get_bytes(other) == tu.key_payload(other, BB)


def test_an_entry_shorter_than_the_block_is_a_miss_for_load(make_pool):
    """A put of fewer bytes than the namespace's blocks (any writer of the namespace may make one)
    is a valid entry for get_bytes, but ns.load used to copy it into the front of the block, leave
    the rest as it was and count the block as loaded: wrong KV (or SSM state) with a hit. Now it
    stops the load there, as a miss does."""
    pool = make_pool()
    ns = pool.namespace(small_layout())
    full, short = tu.make_key("short", 1), tu.make_key("short", 2)
    assert ns.put(full, tu.padded_payload(full, BB)) and ns.put(short, b"\x01" * 10)
    assert ns.get_bytes(short) == b"\x01" * 10  # the generic API keeps its length
    dst = bytearray(2 * BB)
    arrays = [memoryview(dst).cast("B", (2, BB))]
    assert ns.load([full, short], arrays, [0, 1]) == 1
    assert ns.load([short, full], arrays, [1, 0]) == 0
    assert bytes(dst[:BB]) == tu.padded_payload(full, BB)


def test_get_whole_refuses_an_entry_shorter_than_the_buffer(make_pool):
    """ns.get(key, out) fills out's front with a shorter entry (the generic API: out >= stored
    length). The LMCache and SGLang tensor paths hand it one whole block: with whole=True a short
    entry is a miss there, never a block whose tail is stale memory."""
    pool = make_pool()
    ns = pool.namespace(small_layout())
    short, full = tu.make_key("short", 3), tu.make_key("short", 4)
    assert ns.put(short, b"\x01" * 10) and ns.put(full, tu.padded_payload(full, BB))
    out = bytearray(BB)
    assert ns.get(short, out) is True  # the generic API, unchanged
    assert ns.get(short, out, whole=True) is False
    assert ns.get(full, out, whole=True) is True and bytes(out) == tu.padded_payload(full, BB)
