"""Regression tests for the red-team findings about untrusted pool bytes and the pool file
(/work/shared/redteam/report.md: F1, F5, F6, F11-F16, F18, F22, F23), each built from its
reproducer. A finding that used to kill the process (SIGSEGV, SIGFPE, SIGBUS) is exercised in a
child process, so that a regression fails the test instead of killing pytest."""

from __future__ import annotations

import os
import signal
import stat
import struct
import subprocess
import sys
import textwrap

import pytest

import cxlkv
import cxlkv_testutil as tu
from conftest import MiB, small_layout

NS_BYTES = 512  # NamespaceEntry
NS_BLOCK_BYTES_OFF = 16
NS_NAME_OFF = 160
NS_MODEL_ID_OFF = 64
NS_LOCK_OFF = 4096 + 64  # SharedWords.ns_lock
IS_ROOT = os.geteuid() == 0
NOBODY = 65534


def run_py(code: str, *, stdin: str | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "cxlkv", *args], capture_output=True, text=True, timeout=timeout
    )


def no_signal(r: subprocess.CompletedProcess) -> str:
    """'' if the child exited normally, else the signal's name (for assertion messages)."""
    return signal.Signals(-r.returncode).name if r.returncode < 0 else ""


def make(pool_path: str, **kw) -> None:
    with cxlkv.Pool.create(pool_path, "16MiB", chunk_size="1MiB", **kw) as p:
        ns = p.namespace(small_layout())
        ns.put(tu.make_key("a", 0), b"x" * 100)


# An attached process that waits for a line on stdin, then runs the given operations, reports each
# result or error class, and exits normally: a signal means the finding is back.
ATTACHED = """
import sys, cxlkv
sys.path.insert(0, {here!r})
from conftest import small_layout
import cxlkv_testutil as tu
p = cxlkv.Pool.open({path!r}); ns = p.namespace(small_layout())
print('READY', flush=True)
sys.stdin.readline()
for i in range({rounds}):
    for op in ('get', 'put', 'delete', 'stats'):
        try:
            if op == 'get': r = ns.get_bytes(tu.make_key('a', 0)); r = 'hit' if r == b'x' * 100 else ('miss' if r is None else 'WRONG')
            elif op == 'put': r = ns.put(tu.make_key('b', i), b'y' * 100)
            elif op == 'delete': r = ns.delete(tu.make_key('b', i))
            else: r = p.stats()['puts']
        except cxlkv.CxlkvError as e:
            r = type(e).__name__
        print(op, r, flush=True)
print('DONE', flush=True)
"""


def attached(path: str, rounds: int = 20) -> subprocess.Popen:
    code = ATTACHED.format(here=tu.here(), path=path, rounds=rounds)
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout.readline().strip() == "READY", proc.stderr.read()
    return proc


def finish(proc: subprocess.Popen) -> tuple[int, list[str], str]:
    out, err = proc.communicate("go\n", timeout=120)
    return proc.returncode, out.splitlines(), err


# ---------------------------------------------------------------------------------------------
# F1: the header was trusted in place after open.
@pytest.mark.parametrize(
    "field", ["arena_off", "chunk_map_off", "node_area_off", "node_table_off", "chunk_count"]
)
def test_f1_live_header_scribble(pool_path, field):
    make(pool_path)
    proc = attached(pool_path)
    tu.patch_header_field(pool_path, field, 1 << 62, fix_checksum=False)  # the co-tenant's store
    rc, lines, err = finish(proc)
    assert rc == 0, f"attached process died ({signal.Signals(-rc).name if rc < 0 else rc}): {err[-500:]}"
    assert lines[-1] == "DONE"
    assert "get WRONG" not in lines
    assert "get hit" in lines  # the private header copy keeps the pool fully usable


# F5: a corrupt block_bytes in any namespace entry was a SIGFPE for everyone.
@pytest.mark.parametrize("value", [(1 << 64) - 1, (1 << 64) - 63, 0, 1 << 32])
def test_f5_block_bytes_sigfpe(pool_path, value):
    with cxlkv.Pool.create(pool_path, "16MiB", chunk_size="1MiB") as pool:
        pool.namespace(small_layout()).put(tu.make_key("a", 0), b"x" * 100)
        pool.namespace(small_layout(model_id="other"))
        ns_off = pool.info()["ns_table_off"]
    tu.patch_file(pool_path, ns_off + NS_BYTES + NS_BLOCK_BYTES_OFF, struct.pack("<Q", value))
    for sub in ("info", "stats", "check"):
        r = run_cli("pool", sub, pool_path)
        assert r.returncode >= 0, f"pool {sub}: {no_signal(r)}"
        assert r.returncode == (1 if sub == "check" else 0), (sub, r.stdout[-400:], r.stderr)
    assert "impossible block size" in run_cli("pool", "check", pool_path).stdout
    r = run_py(f"""
        import sys, cxlkv; sys.path.insert(0, {tu.here()!r}); from conftest import small_layout
        import cxlkv_testutil as tu
        p = cxlkv.Pool.open({pool_path!r}); ns = p.namespace(small_layout())
        print(ns.get_bytes(tu.make_key('a', 0)) == b'x' * 100, len(p.namespaces()))
    """)
    assert r.returncode == 0, f"tenant of namespace 1: {no_signal(r)} {r.stderr[-400:]}"
    assert r.stdout.split() == ["True", "1"]  # the corrupt entry is skipped, the good one works


# F6: a forged header (checksum re-sealed) passed validation through a wrapping product.
@pytest.mark.parametrize("nab", [1 << 58, 1 << 63])
def test_f6_forged_node_area_bytes(pool_path, nab):
    make(pool_path)
    assert tu.read_header(pool_path)["max_nodes"] == 64
    tu.patch_header_field(pool_path, "node_area_bytes", nab)  # 64 * 2**58 == 2**64 == 0
    for sub in ("info", "stats", "check"):
        r = run_cli("pool", sub, pool_path)
        assert r.returncode == 2, f"pool {sub}: rc {r.returncode} {no_signal(r)} {r.stderr[-300:]}"
        assert "impossible geometry (node_area_bytes)" in r.stderr
    with pytest.raises(cxlkv.PoolFormatError, match="node_area_bytes"):
        cxlkv.Pool.open(pool_path)


# ---------------------------------------------------------------------------------------------
# F11: a pool owned or writable by another user, symlinks, the default path.
def test_f11_world_writable_pool_refused(pool_path):
    make(pool_path)
    os.chmod(pool_path, 0o666)
    with pytest.raises(PermissionError, match="writable by every user"):
        cxlkv.Pool.open(pool_path)
    with pytest.raises(PermissionError, match="writable by every user"):
        cxlkv.Pool.open_or_create(pool_path, "16MiB")
    r = run_cli("pool", "stats", pool_path)
    assert r.returncode == 2 and "--allow-foreign-owner" in r.stderr
    assert run_cli("pool", "stats", pool_path, "--allow-foreign-owner").returncode == 0
    with cxlkv.Pool.open(pool_path, allow_foreign_owner=True) as p:
        assert p.namespace(small_layout()).get_bytes(tu.make_key("a", 0)) == b"x" * 100


def test_f11_symlink_not_followed(pool_path):
    make(pool_path)
    link = pool_path + ".link"
    os.symlink(pool_path, link)
    try:
        with pytest.raises(OSError, match="symbolic link"):
            cxlkv.Pool.open(link)
    finally:
        os.unlink(link)


@pytest.mark.skipif(not IS_ROOT, reason="needs root to give the pool to another uid")
def test_f11_squatted_pool_refused(pool_path):
    """faults.py e: uid 65534 pre-creates the path (mode 0666); root's open_or_create attached."""
    make(pool_path)
    os.chown(pool_path, NOBODY, NOBODY)
    os.chmod(pool_path, 0o600)
    with pytest.raises(PermissionError, match=f"owned by uid {NOBODY}"):
        cxlkv.Pool.open_or_create(pool_path, "16MiB")
    with pytest.raises(PermissionError, match=f"owned by uid {NOBODY}"):
        cxlkv.Pool.open(pool_path)
    cxlkv.Pool.open(pool_path, allow_foreign_owner=True).close()


def test_f11_default_dir_private(monkeypatch, pool_path):
    from cxlkv import paths

    d = pool_path + ".d"
    monkeypatch.setattr(paths, "DEFAULT_POOL_DIR", d)
    try:
        p = os.path.join(d, "pool")
        with cxlkv.Pool.create(p, "16MiB", chunk_size="1MiB"):
            pass
        assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
        os.chmod(d, 0o777)  # someone opened it up (or pre-created it so)
        with pytest.raises(PermissionError, match="open to other users"):
            cxlkv.Pool.open(p)
        os.chmod(d, 0o700)
        if IS_ROOT:
            os.chown(d, NOBODY, NOBODY)  # pre-created by another user
            with pytest.raises(PermissionError, match=f"owned by uid {NOBODY}"):
                cxlkv.Pool.open_or_create(p, "16MiB")
            os.chown(d, 0, 0)
        cxlkv.Pool.open(p).close()
    finally:
        import shutil

        shutil.rmtree(d, ignore_errors=True)
    assert os.environ.get("CXLKV_POOL", f"/dev/shm/cxlkv-{os.geteuid()}/pool") == cxlkv.DEFAULT_POOL_PATH


# ---------------------------------------------------------------------------------------------
# F12: NUL and control characters in names.
def test_f12_nul_in_namespace_name(make_pool):
    pool = make_pool(size=16 * MiB)
    for _ in range(3):
        with pytest.raises(ValueError, match="NUL or control"):
            pool.namespace(small_layout(), name="tenant\x00x")
    with pytest.raises(ValueError, match="model_id"):
        small_layout(model_id="m\x1b]0;owned\x07")
    # the core refuses them too (other bindings, or a caller that skips the Python layer)
    with pytest.raises(ValueError, match="NUL or control"):
        pool._core.open_namespace("a\x00b", small_layout())
    assert pool.namespaces() == []


# F13: a stale ns_lock (holder out of range, or a FREE node slot) stalled every creation for ~19 s.
@pytest.mark.parametrize("holder", [64, 200, 2**40])
def test_f13_stale_ns_lock_broken(pool_path, holder):
    cxlkv.Pool.create(pool_path, "16MiB", chunk_size="1MiB").close()
    tu.patch_file(pool_path, NS_LOCK_OFF, struct.pack("<Q", holder))
    r = run_cli("pool", "check", pool_path)
    assert r.returncode == 1 and f"held by node {holder}" in r.stdout and "stale" in r.stdout, r.stdout[-500:]
    assert run_cli("pool", "check", pool_path).returncode == 0  # check broke it
    tu.patch_file(pool_path, NS_LOCK_OFF, struct.pack("<Q", holder))
    with cxlkv.Pool.open(pool_path) as p:
        p.namespace(small_layout())  # pre-fix: CxlkvError "held too long" after ~19 s
        assert len(p.namespaces()) == 1


# ---------------------------------------------------------------------------------------------
# F14: shrinking the pool file under a live process (faults.py a).
@pytest.mark.parametrize("size", [8192, 0, -1])
def test_f14_truncate_under_live_process(pool_path, size):
    make(pool_path)
    proc = attached(pool_path, rounds=3)
    if size < 0:  # truncate to 0, then extend back: a zero header under the live process
        os.truncate(pool_path, 0)
        os.truncate(pool_path, 16 * MiB)
    else:
        os.truncate(pool_path, size)
    rc, lines, err = finish(proc)
    assert rc == 0, f"attached process died ({signal.Signals(-rc).name if rc < 0 else rc}): {err[-500:]}"
    assert lines[-1] == "DONE" and "get WRONG" not in lines
    if size >= 0:
        assert "get PoolTruncatedError" in lines and "get hit" not in lines, lines


def test_f14_truncated_error_names_pool(pool_path):
    make(pool_path)
    r = run_py(f"""
        import os, sys, cxlkv; sys.path.insert(0, {tu.here()!r}); from conftest import small_layout
        import cxlkv_testutil as tu
        p = cxlkv.Pool.open({pool_path!r}); ns = p.namespace(small_layout())
        os.truncate({pool_path!r}, 8192)
        print('first', ns.get_bytes(tu.make_key('a', 0)))  # runs on zero pages: a miss
        try:
            ns.get_bytes(tu.make_key('a', 0))
        except cxlkv.PoolTruncatedError as e:
            print('error', e)
        print('replaced', p.file_replaced())
    """)
    assert r.returncode == 0, f"{no_signal(r)} {r.stderr[-500:]}"
    assert "first None" in r.stdout
    assert f"error pool {pool_path} was truncated while mapped (now 8192 bytes" in r.stdout
    assert "replaced False" in r.stdout


@pytest.mark.parametrize("faulthandler_at", ["none", "before_open", "after_open"])
def test_f14_sigbus_outside_pools_still_kills(pool_path, faulthandler_at):
    """The SIGBUS handler only answers faults inside pool mappings: any other SIGBUS still ends
    the process (through the handler installed before ours, e.g. faulthandler), never a hang."""
    make(pool_path)
    other = pool_path + ".other"
    r = run_py(
        f"""
        import faulthandler, mmap, os, sys, cxlkv
        sys.path.insert(0, {tu.here()!r}); from conftest import small_layout
        import cxlkv_testutil as tu
        if {faulthandler_at!r} == 'before_open': faulthandler.enable()
        p = cxlkv.Pool.open({pool_path!r}); ns = p.namespace(small_layout())
        if {faulthandler_at!r} == 'after_open': faulthandler.enable()
        os.truncate({pool_path!r}, 8192)
        ns.get_bytes(tu.make_key('a', 0))
        try:
            ns.get_bytes(tu.make_key('a', 0)); print('no error')
        except cxlkv.PoolTruncatedError:
            print('truncated', flush=True)
        with open({other!r}, 'w+b') as f:
            f.truncate(1 << 20); m = mmap.mmap(f.fileno(), 1 << 20); f.truncate(0)
            print('unreachable', m[4096], flush=True)
    """,
        timeout=60,
    )
    if os.path.exists(other):
        os.unlink(other)
    assert r.returncode == -signal.SIGBUS, (r.returncode, r.stdout, r.stderr[-500:])
    assert "unreachable" not in r.stdout
    if faulthandler_at != "after_open":
        assert "truncated" in r.stdout, (r.stdout, r.stderr[-500:])


@pytest.mark.skipif(not IS_ROOT, reason="needs root to mount a small tmpfs")
def test_f14_sparse_pool_on_full_tmpfs(pool_path, tmp_path):
    """faults.py c: a sparse copy of a pool on a full tmpfs died with SIGBUS at first touch."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mnt)]).returncode != 0:
        pytest.skip("cannot mount a tmpfs")
    try:
        cxlkv.Pool.create(pool_path, "32MiB", chunk_size="1MiB").close()
        dst = str(mnt / "pool")
        subprocess.run(["cp", "--sparse=always", pool_path, dst], check=True)
        subprocess.run(["sh", "-c", f"dd if=/dev/zero of={mnt}/filler bs=1M count=64 2>/dev/null"])
        r = run_py(f"""
            import sys, cxlkv; sys.path.insert(0, {tu.here()!r}); from conftest import small_layout
            try:
                p = cxlkv.Pool.open({dst!r}); ns = p.namespace(small_layout())
                print('puts', sum(ns.put(bytes([i % 256, i // 256]) * 16, b's' * 4096) for i in range(2000)))
            except OSError as e:
                print('error', e)
        """)
        assert r.returncode == 0, f"{no_signal(r)} {r.stderr[-500:]}"
        assert "is a sparse file" in r.stdout or "puts" in r.stdout, r.stdout
    finally:
        subprocess.run(["umount", "-l", str(mnt)])


# ---------------------------------------------------------------------------------------------
# F15: destroy and create --force while processes are attached (faults.py b).
def test_f15_destroy_refuses_while_attached(pool_path):
    make(pool_path)
    proc = attached(pool_path, rounds=1)
    try:
        r = run_cli("pool", "destroy", pool_path)
        assert r.returncode == 2 and f"(pid {proc.pid})" in r.stderr, r.stderr
        r = run_cli("pool", "create", pool_path, "--size", "16MiB", "--force")
        assert r.returncode == 2 and f"(pid {proc.pid})" in r.stderr, r.stderr
        assert os.path.exists(pool_path)
        with pytest.raises(cxlkv.PoolInUseError):
            cxlkv.Pool.destroy(pool_path)
        r = run_cli("pool", "destroy", pool_path, "--ignore-attached")
        assert r.returncode == 0 and not os.path.exists(pool_path), r.stderr
    finally:
        finish(proc)


def test_f15_destroy_after_detach(pool_path):
    make(pool_path)
    rc, _, _ = finish(attached(pool_path, rounds=1))
    assert rc == 0
    cxlkv.Pool.destroy(pool_path)
    assert not os.path.exists(pool_path)


# F16: destroy of a /dev/dax* path wiped any file without a magic check.
@pytest.mark.skipif(not IS_ROOT, reason="needs root to write under /dev")
def test_f16_devdax_destroy_checks_chr_and_magic():
    path = f"/dev/daxcxlkv-test-{os.getpid()}"
    data = b"precious data " * 1000
    with open(path, "wb") as f:
        f.write(data)
    try:
        r = run_cli("pool", "destroy", path)
        assert r.returncode == 2, r.stderr
        r = run_cli("pool", "destroy", path, "--force")
        assert r.returncode == 2 and "not a devdax character device" in r.stderr, r.stderr
        with open(path, "rb") as f:
            assert f.read() == data
    finally:
        os.unlink(path)


# F22: mmap failing after fallocate left the temporary file behind.
def test_f22_no_temp_file_when_mmap_fails(pool_path):
    d = pool_path + ".d"
    os.mkdir(d)
    try:
        r = run_py(f"""
            import resource, cxlkv
            vm = int([l for l in open('/proc/self/status') if l.startswith('VmSize')][0].split()[1]) * 1024
            resource.setrlimit(resource.RLIMIT_AS, (vm + (8 << 20), resource.RLIM_INFINITY))
            try:
                cxlkv.Pool.create({d + "/pool"!r}, '32MiB'); print('created')
            except OSError as e:
                print('error', e)
        """)
        assert r.returncode == 0 and "error" in r.stdout, (r.stdout, r.stderr[-300:])
        assert os.listdir(d) == []
    finally:
        import shutil

        shutil.rmtree(d, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# F23: the CLI could not remove a bad or half-made pool file; info needed write access.
@pytest.mark.parametrize("kind", ["empty", "bad_magic", "half_made"])
def test_f23_cli_removes_bad_pool_file(pool_path, kind):
    if kind == "empty":
        open(pool_path, "wb").close()
    elif kind == "bad_magic":
        with open(pool_path, "wb") as f:
            f.write(b"NOTAPOOL" + bytes(16 * MiB - 8))
    else:
        make(pool_path)
        tu.patch_file(pool_path, 0, bytes(8))  # magic zeroed, init word BUSY: a creator died mid-way
        tu.patch_file(pool_path, tu.SHARED_WORDS_OFF, struct.pack("<Q", tu.INIT_BUSY))
    r = run_cli("pool", "destroy", pool_path)
    assert r.returncode == 2 and os.path.exists(pool_path), r.stderr
    r = run_cli("pool", "destroy", pool_path, "--force")
    assert r.returncode == 0 and not os.path.exists(pool_path), r.stderr
    open(pool_path, "wb").close()
    r = run_cli("pool", "create", pool_path, "--size", "16MiB", "--force")
    assert r.returncode == 0, r.stderr
    cxlkv.Pool.open(pool_path).close()


def test_f23_read_only_info_takes_no_slot(pool_path):
    make(pool_path, max_nodes=1)
    with cxlkv.Pool.open(pool_path):  # the only node slot is taken
        r = run_cli("pool", "info", pool_path, "--json")
        assert r.returncode == 0, r.stderr
    with cxlkv.Pool.open(pool_path, read_only=True) as p:
        assert p.info()["read_only"] and p.node_id == 0
        with pytest.raises(cxlkv.ReadOnlyError):
            p._core.open_namespace("x", small_layout())


@pytest.mark.skipif(not IS_ROOT, reason="needs root to drop to another uid")
def test_f23_info_for_reader_without_write_access(pool_path):
    make(pool_path)
    os.chmod(pool_path, 0o644)
    # Warm up as root (imports the renderer's modules), then drop to nobody and run it again.
    r = run_py(f"""
        import contextlib, io, os, sys
        from cxlkv import cli
        with contextlib.redirect_stdout(io.StringIO()):
            cli.main(['pool', 'info', {pool_path!r}])
        os.setgroups([]); os.setgid({NOBODY}); os.setuid({NOBODY})
        sys.exit(cli.main(['pool', 'info', {pool_path!r}]))
    """)
    assert r.returncode == 0, r.stderr[-500:]
    assert "namespaces" in r.stdout


# F18: `pool info` printed raw terminal escapes from names in the pool.
def test_f18_info_escapes_control_characters(pool_path):
    with cxlkv.Pool.create(pool_path, "16MiB", chunk_size="1MiB") as pool:
        pool.namespace(small_layout(model_id="mmmmmmmm"), name="xxxxxxxxxxxxxxxxxxxx")
        ns_off = pool.info()["ns_table_off"]
    # Written straight into the pool, as a co-tenant with an older build (or a stray write) could.
    tu.patch_file(pool_path, ns_off + NS_NAME_OFF, b"x\x1b[2J\x1b[Hpool ok\r")
    tu.patch_file(pool_path, ns_off + NS_MODEL_ID_OFF, b"m\x1b]0;own\x07\x9b")
    r = run_cli("pool", "info", pool_path)
    assert r.returncode == 0, r.stderr
    assert "\x1b" not in r.stdout and "\x07" not in r.stdout and "\r" not in r.stdout
    assert "\\x1b" in r.stdout


# ---------------------------------------------------------------------------------------------
# For the vLLM connector: which file is mapped, and does the path still name it?
def test_file_identity_and_file_replaced(pool_path):
    make(pool_path)
    with cxlkv.Pool.open(pool_path) as p:
        st = os.stat(pool_path)
        info = p.info()
        assert (info["file_dev"], info["file_ino"]) == (st.st_dev, st.st_ino)
        assert p.file_replaced() is False
        os.rename(pool_path, pool_path + ".old")
        assert p.file_replaced() is True  # deleted (moved away)
        make(pool_path)
        assert p.file_replaced() is True  # replaced by another pool
        os.unlink(pool_path)
        os.rename(pool_path + ".old", pool_path)
        assert p.file_replaced() is False


# F14, second half: with no SIGBUS handler of ours installed (as at interpreter exit, after
# pytest's faulthandler.disable() restored the default), the heartbeat thread, lease release and
# close must not store into the lost pages of a shrunk pool file (they were a Bus error).
def test_f14_shrunk_pool_heartbeat_release_close_touch_nothing(pool_path):
    code = f"""
import cxlkv, os, signal, time
pool = cxlkv.Pool.create({pool_path!r}, "16MiB", chunk_size="1MiB", lease_ms=200)
ns = pool.namespace(cxlkv.KVLayout(model_id="m", block_bytes=4096))
ns.put(bytes(32), b"x" * 4096)
lease = ns.acquire([bytes(32)])
os.truncate({pool_path!r}, 4096)
signal.signal(signal.SIGBUS, signal.SIG_DFL)
time.sleep(1.0)  # several heartbeats (lease 200 ms: one beat every 50 ms)
lease.release()
pool.close()
print("survived")
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "survived" in r.stdout, no_signal(r) if r.returncode < 0 else r.stderr[-500:]
