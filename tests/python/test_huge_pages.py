"""The pool on huge pages (issue 16): the page size a pool's mapping actually got is reported
(``pool.info()["page_bytes"]``, ``pool info --json``, ``bench copy --dir``), checked against the
kernel's own account of the mapping (/proc/self/smaps, read here independently of the core): 4 KiB
on a default /dev/shm (huge=never), 2 MiB on a tmpfs mounted huge=always, which the test mounts
and unmounts itself (root only; skipped with the reason otherwise)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import pytest

import cxlkv
from conftest import SHM_DIR, MiB, small_layout

HUGE = 2 * MiB
PAGE = os.sysconf("SC_PAGE_SIZE")


def _mapping_of(ino: int) -> dict[str, int]:
    """Rss and PMD-mapped bytes of this process's mappings of inode `ino`, from smaps."""
    out = {"rss": 0, "pmd": 0}
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if head and "-" in head[0] and len(head) >= 5 and ":" not in head[0]:
                inside = head[4] == str(ino) and head[3] != "00:00"
                continue
            if inside and line.startswith("Rss:"):
                out["rss"] += int(head[1]) * 1024
            elif inside and line.startswith(("ShmemPmdMapped:", "FilePmdMapped:")):
                out["pmd"] += int(head[1]) * 1024
    return out


def _cli(*args: str) -> dict:
    r = subprocess.run(
        [sys.executable, "-m", "cxlkv", *args], capture_output=True, text=True, timeout=120, check=False
    )
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.fixture(scope="module")
def huge_tmpfs():
    """A tmpfs mounted huge=always for this module, unmounted and removed afterwards."""
    if os.geteuid() != 0:
        pytest.skip("mounting a huge=always tmpfs needs root")
    mode = open("/sys/kernel/mm/transparent_hugepage/shmem_enabled").read()
    if "[deny]" in mode:
        pytest.skip("shmem_enabled=deny: the kernel gives tmpfs no huge pages")
    d = tempfile.mkdtemp(prefix="cxlkv-huge-")
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=256m,huge=always", "cxlkv-test-huge", d],
        capture_output=True,
        text=True,
        check=False,
    )
    if r.returncode != 0:
        os.rmdir(d)
        pytest.skip(f"cannot mount a huge=always tmpfs: {r.stderr.strip()}")
    try:
        yield d
    finally:
        for name in os.listdir(d):
            os.unlink(os.path.join(d, name))
        subprocess.run(["umount", d], check=False)
        os.rmdir(d)


def test_default_shm_reports_the_pages_it_got(make_pool):
    pool = make_pool(size=16 * MiB)
    info = pool.info()
    got = _mapping_of(os.stat(pool.path).st_ino)
    assert got["rss"] > 0
    want = HUGE if 2 * got["pmd"] >= got["rss"] and got["pmd"] else PAGE
    assert info["page_bytes"] == want
    assert info["huge_page_resident_bytes"] == got["pmd"]
    if cxlkv._core.dir_huge_page_bytes(SHM_DIR) == 0:  # huge=never, as on this machine
        assert info["page_bytes"] == PAGE
        assert info["pool_bytes"] == 16 * MiB


def test_huge_tmpfs_pool_is_on_2mib_pages(huge_tmpfs):
    path = os.path.join(huge_tmpfs, "pool")
    assert cxlkv._core.dir_huge_page_bytes(huge_tmpfs) == HUGE
    # not whole huge pages: rounded down, as a devdax pool is cut to its alignment
    with cxlkv.Pool.create(path, 24 * MiB + 12345, chunk_size=1 * MiB) as pool:
        info = pool.info()
        assert info["pool_bytes"] == 24 * MiB
        ns = pool.namespace(small_layout(64 * 1024))
        key = bytes(range(32))
        assert ns.put(key, bytes(64 * 1024))
        got = _mapping_of(os.stat(path).st_ino)
        assert got["pmd"] > 0, "the kernel mapped no huge page of a huge=always tmpfs"
        assert info["page_bytes"] == HUGE
        assert info["huge_page_resident_bytes"] > 0
    # another process attaching, and the CLI's read-only view, get the same pages
    out = subprocess.run(
        [sys.executable, "-c", f"import cxlkv; print(cxlkv.Pool.open({path!r}).info()['page_bytes'])"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert int(out.stdout) == HUGE
    assert _cli("pool", "info", "--json", path)["page_bytes"] == HUGE
    cxlkv.Pool.destroy(path)


def test_bench_copy_dir_reports_both_page_sizes(huge_tmpfs):
    r = _cli(
        "bench", "copy", "--json", "--geometry", "smollm2-135m", "--iters", "1",
        "--batch-size", "4MiB", "--copy-threads", "1", "--dir", huge_tmpfs,
    )  # fmt: skip
    assert r["page_bytes"] == HUGE
    assert r["results"][0]["pool_dir"] == huge_tmpfs
    assert r["memcpy_page_bytes"] in (PAGE, HUGE)  # the baseline's pages, as the kernel gave them
    assert not os.listdir(huge_tmpfs)  # the bench pool is gone
