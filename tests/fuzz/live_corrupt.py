"""The live co-tenant corruption probe.

A reader process has the pool open and loops over get (into a guarded buffer), get_bytes, contains,
match_prefix, put and delete, verifying every byte it reads, while this process, a buggy or hostile
co-tenant with write access to the pool file, scribbles on one area of the pool through its own
mapping. A scenario passes when the reader neither dies by a signal, nor hangs, nor reads wrong
bytes, nor has its guard bytes touched, nor sees an exception other than a cxlkv/OS/ValueError,
and a fresh `cxlkv pool check` afterwards does not crash.

  python tests/fuzz/live_corrupt.py [--seconds S] [--only SCN,...]     (prints one JSON line each)
  python tests/fuzz/live_corrupt.py --reader POOL SECONDS SEED           (internal: the reader)
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import random
import struct
import subprocess
import sys
import tempfile
import time
import zlib
from collections.abc import Callable

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import fuzz_layout as L  # noqa: E402
import fuzz_seedpool as S  # noqa: E402

N_KEYS = 300
HOT = 8  # most reads go to a few keys, so a scribble and a read meet often
SHM = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
CXLKV_CLI = os.path.join(os.path.dirname(sys.executable), "cxlkv")
HUGE = 1 << 62


def item(i: int) -> tuple[bytes, bytes]:
    k = S.key("live", i)
    return k, S.payload(k, S.A_BLOCK)


def reader(path: str, seconds: float, seed: int) -> None:
    """The victim: runs for `seconds` (its operations drawn from `seed`), then prints its counts
    as one JSON line."""
    import cxlkv

    st = {"ops": 0, "hits": 0, "misses": 0, "wrong": 0, "guard": 0, "clean_errors": {}, "other_errors": {}}
    ns = cxlkv.Pool.open(path).namespace(S.layout_a())
    items = [item(i) for i in range(N_KEYS)]
    prefix = [k for k, _ in items[:32]]
    rng = random.Random(seed)
    whole = np.full(S.A_BLOCK + 128, 0xA5, dtype=np.uint8)
    inner = whole[64 : 64 + S.A_BLOCK]
    os.write(1, b"READY\n")
    t_end = time.monotonic() + seconds
    while time.monotonic() < t_end:
        i = rng.randrange(HOT) if rng.random() < 0.7 else rng.randrange(N_KEYS)
        k, p = items[i]
        op = rng.random()
        st["ops"] += 1
        try:
            if op < 0.45:
                got = ns.get_bytes(k)
                if got is None:
                    st["misses"] += 1
                    ns.put(k, p)
                elif got != p:
                    st["wrong"] += 1
                    st.setdefault("first_wrong", {"key": i, "len": len(got)})
                else:
                    st["hits"] += 1
            elif op < 0.75:
                whole[:] = 0xA5
                hit = ns.get(k, inner)
                if not ((whole[:64] == 0xA5).all() and (whole[-64:] == 0xA5).all()):
                    st["guard"] += 1
                if hit and bytes(inner) != p:
                    st["wrong"] += 1
                    st.setdefault("first_wrong", {"key": i, "op": "get"})
                st["hits" if hit else "misses"] += 1
            elif op < 0.85:
                ns.contains(k)
            elif op < 0.93:
                ns.match_prefix(prefix)
            elif op < 0.97:
                ns.put(k, p)
            else:
                kk, pp = items[rng.randrange(HOT, N_KEYS)]
                ns.delete(kk)
                ns.put(kk, pp)
        except (cxlkv.CxlkvError, OSError, ValueError) as e:
            bucket = (
                "clean_errors"
                if isinstance(e, (cxlkv.CxlkvError, OSError)) or type(e) is ValueError
                else "other_errors"
            )
            st[bucket][type(e).__name__] = st[bucket].get(type(e).__name__, 0) + 1
        except Exception as e:  # noqa: BLE001 - anything else is a finding
            st["other_errors"][type(e).__name__] = st["other_errors"].get(type(e).__name__, 0) + 1
            st.setdefault("first_other_error", repr(e)[:300])
    os.write(1, (json.dumps(st) + "\n").encode())
    os._exit(0)  # do not run close() on a pool the co-tenant may have wrecked: not what we measure


def make_pool(path: str) -> None:
    import cxlkv

    with cxlkv.Pool.create(path, "16MiB") as pool:
        ns = pool.namespace(S.layout_a())
        for i in range(N_KEYS):
            assert ns.put(*item(i))


class CoTenant:
    """This process's own writable mapping of the pool file."""

    def __init__(self, path: str):
        self.f = open(path, "r+b")
        self.m = mmap.mmap(self.f.fileno(), 0)
        self.h = L.read_header(self.m)
        self.desc_bytes = L.chunk_desc_bytes(self.h["chunk_bytes"])
        self.stride = self.desc_bytes + self.h["chunk_bytes"]
        idx = np.frombuffer(
            self.m, dtype=np.uint64, count=self.h["index_slots"] * 8, offset=self.h["index_off"]
        ).reshape(-1, 8)
        states = (idx[:, 0] >> np.uint64(56)).copy()
        del idx
        self.entries = [self.h["index_off"] + 64 * int(s) for s in np.nonzero(states)[0]]
        self.ready = [self.h["index_off"] + 64 * int(s) for s in np.nonzero(states == L.ENTRY_READY)[0]]
        self.chunks = [
            c
            for c in range(self.h["chunk_count"])
            if struct.unpack_from("<Q", self.m, self.h["chunk_map_off"] + 8 * c)[0] >> 56 == L.CHUNK_ACTIVE
        ]

    def u64(self, off: int, v: int) -> None:
        struct.pack_into("<Q", self.m, off, v & ((1 << 64) - 1))

    def close(self) -> None:
        self.m.close()
        self.f.close()


def scribbler(scn: str, t: CoTenant, rng: random.Random) -> Callable[[], None]:
    """One round of scribbling for scenario `scn`."""
    h = t.h
    e_chunk, e_block, e_len = (L.ENTRY_FIELDS[n][0] for n in ("chunk", "block", "length"))
    if scn.startswith("header:"):
        name, val = scn.split(":", 1)[1].split("=")
        off, fmt = L.HEADER_FIELDS[name]
        return lambda: struct.pack_into(fmt, t.m, off, int(val, 0))
    if scn == "index_random_bytes":

        def f():
            o = rng.choice(t.entries) + rng.randrange(8, 64)
            t.m[o : o + 4] = rng.randbytes(4)

        return f
    if scn == "index_state_words":

        def f():
            o = rng.choice(t.entries)
            old = struct.unpack_from("<Q", t.m, o)[0]
            t.u64(
                o,
                (rng.choice([1, 2, 3, 4, 5, 255]) << 56)
                | (rng.choice([0, 1, 2, 200]) << 48)
                | (old & ((1 << 48) - 1)),
            )

        return f
    if scn == "index_ref_fields_oob":

        def f():
            o = rng.choice(t.ready)
            which = rng.randrange(3)
            if which == 0:
                struct.pack_into("<I", t.m, o + e_chunk, rng.choice([h["chunk_count"], 0xFFFFFFFF, 1 << 20]))
            elif which == 1:
                struct.pack_into("<H", t.m, o + e_block, rng.choice([512, 4095, 65535]))
            else:
                struct.pack_into("<I", t.m, o + e_len, rng.choice([S.A_BLOCK + 1, 0xFFFFFFFF, 1 << 24]))

        return f
    if scn == "index_swap_refs":  # entries point at other keys' (valid) blocks: wrong data if trusted

        def f():
            a, b = rng.sample(t.ready, 2)
            ra = bytes(t.m[a + e_chunk : a + e_chunk + 6])
            t.m[a + e_chunk : a + e_chunk + 6] = t.m[b + e_chunk : b + e_chunk + 6]
            t.m[b + e_chunk : b + e_chunk + 6] = ra

        return f
    if scn == "block_descs":
        return lambda: t.u64(
            h["arena_off"] + rng.choice(t.chunks) * t.stride + 8 * rng.randrange(t.desc_bytes // 8),
            rng.choice([0, rng.getrandbits(64), (1 << 56) | rng.randrange(h["index_slots"]), 2 << 56]),
        )
    if scn == "chunk_map":
        return lambda: t.u64(
            h["chunk_map_off"] + 8 * rng.randrange(h["chunk_count"]),
            rng.choice(
                [
                    0,
                    (1 << 56) | (200 << 48) | (1 << 32),
                    (2 << 56) | (2 << 32),
                    (3 << 56) | (1 << 32),
                    rng.getrandbits(64),
                    (2 << 56) | (1 << 32),
                ]
            ),
        )
    if scn == "ns_table":
        return lambda: t.u64(
            h["ns_table_off"] + rng.choice([0, 8, 16, 24, 44, 160]),
            rng.choice([0, rng.getrandbits(64), 1, 1 << 40, (1 << 64) - 1]),
        )
    if scn == "node_table":

        def f():
            i = rng.randrange(4)
            t.u64(
                h["node_table_off"] + L.NODE_SLOT_BYTES * i + rng.choice([0, 8, 16, 24]),
                rng.choice([0, rng.getrandbits(64), (3 << 56) | (1 << 24), 2 << 56]),
            )
            t.u64(
                h["node_area_off"] + h["node_area_bytes"] * i + L.NODE_PIN_HW_OFF,
                rng.choice([0, 1 << 40, (1 << 64) - 1, 5]),
            )

        return f
    if scn == "pins":
        return lambda: t.u64(
            h["node_area_off"]
            + h["node_area_bytes"] * rng.randrange(4)
            + L.NODE_PINS_OFF
            + 8 * rng.randrange(8),
            ((rng.choice(t.ready) - h["index_off"]) // 64 + 1) << 24 | rng.randrange(3),
        )
    if scn == "payload_toggle":  # one byte of every block flips back and forth (F2)
        arr = np.frombuffer(t.m, dtype=np.uint8)
        views = [
            arr[h["arena_off"] + c * t.stride + t.desc_bytes :][: 512 * S.A_BLOCK].reshape(512, S.A_BLOCK)
            for c in t.chunks
        ]

        def f():
            for v in views:
                v[:, 100] ^= 0x5A

        f.views = views  # type: ignore[attr-defined]  - released before the mapping is closed
        return f
    if scn == "ns_lock_foreign":
        return lambda: t.u64(L.SHARED_NSLOCK_OFF, 200)
    raise ValueError(f"unknown scenario {scn!r}")


SCENARIOS = [
    "index_random_bytes",
    "index_state_words",
    "index_ref_fields_oob",
    "index_swap_refs",
    "block_descs",
    "chunk_map",
    "ns_table",
    "node_table",
    "pins",
    "payload_toggle",
    f"header:arena_off={HUGE:#x}",
    "header:chunk_count=0x100000",
    f"header:chunk_map_off={HUGE:#x}",
    "header:node_area_bytes=0x100000000",
    f"header:node_area_off={HUGE:#x}",
    "header:max_nodes=254",
    "header:pin_slots=0xffffffff",
    f"header:node_table_off={HUGE:#x}",
    "header:chunk_bytes=0x10000000000",
    f"header:ns_table_off={HUGE:#x}",
    "header:max_namespaces=4096",
    "header:index_slots=0x1000000000",
    "header:pool_bytes=0",
]


def run_scenario(scn: str, seconds: float, seed: int = 0) -> dict:
    """Runs one scenario; `failures` lists what went wrong (empty: passed). `seed` draws the
    reader's operations (the scribbler's are drawn from the scenario's name); it is in the result."""
    fd, path = tempfile.mkstemp(prefix="cxlkv-live-", dir=SHM)
    os.close(fd)
    os.unlink(path)
    try:
        make_pool(path)
        p1 = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--reader", path, str(seconds), str(seed)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        first = p1.stdout.readline()
        assert first.strip() == b"READY", (first, p1.stderr.read()[-2000:] if p1.poll() is not None else b"")
        t = CoTenant(path)
        f = scribbler(scn, t, random.Random(zlib.crc32(scn.encode())))
        rounds = 0
        t_end = time.monotonic() + seconds
        while time.monotonic() < t_end and p1.poll() is None:
            f()
            rounds += 1
            if scn != "payload_toggle" and rounds % 16 == 0:
                time.sleep(0.0005)  # let the reader see a mix of old and new values
        try:
            out, err = p1.communicate(timeout=seconds + 30)
            hang = False
        except subprocess.TimeoutExpired:
            p1.kill()
            out, err = p1.communicate()
            hang = True
        del f
        t.close()
        res: dict = {"scenario": scn, "seed": seed, "rounds": rounds, "rc": p1.returncode, "hang": hang}
        lines = [ln for ln in out.decode(errors="replace").splitlines() if ln.startswith("{")]
        if lines:
            res.update(json.loads(lines[-1]))
        if p1.returncode != 0:
            res["stderr"] = err.decode(errors="replace")[-800:]
        after = subprocess.run([CXLKV_CLI, "pool", "check", path], capture_output=True, timeout=60)
        res["after_check_rc"] = after.returncode
    finally:
        if os.path.exists(path):
            os.unlink(path)
    fails = []
    if hang:
        fails.append("reader hung")
    elif res["rc"] is not None and res["rc"] < 0:
        fails.append(f"reader died by signal {-res['rc']}")
    elif res["rc"] != 0 or not lines:
        fails.append(f"reader exited {res['rc']} without a result")
    if res.get("wrong"):
        fails.append(f"{res['wrong']} wrong reads")
    if res.get("guard"):
        fails.append(f"{res['guard']} guard-byte hits")
    if res.get("other_errors"):
        fails.append(f"non-cxlkv exceptions {res['other_errors']}")
    if res["after_check_rc"] < 0:
        fails.append(f"pool check afterwards died by signal {-res['after_check_rc']}")
    res["failures"] = fails
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reader", nargs=3, metavar=("POOL", "SECONDS", "SEED"))
    ap.add_argument("--seed", type=int, default=0, help="seed of the reader's operations (default 0)")
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--only", help="comma-separated scenarios (default: all)")
    args = ap.parse_args(argv)
    if args.reader:
        reader(args.reader[0], float(args.reader[1]), int(args.reader[2]))
        return 0
    bad = 0
    for scn in args.only.split(",") if args.only else SCENARIOS:
        r = run_scenario(scn, args.seconds, args.seed)
        bad += bool(r["failures"])
        print(
            json.dumps(
                {
                    k: r.get(k)
                    for k in (
                        "scenario",
                        "seed",
                        "failures",
                        "ops",
                        "hits",
                        "misses",
                        "wrong",
                        "guard",
                        "clean_errors",
                        "rounds",
                        "after_check_rc",
                    )
                }
            ),
            flush=True,
        )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
