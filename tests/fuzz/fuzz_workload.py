"""The Python workload the format fuzzer runs on every mutated pool (in its own process).

`exercise(path)` opens the pool and both seed namespaces and runs every API call, each step in its
own try, comparing every successful read with the bytes the seed stored. It returns
  ops:        [op, "ok" | "E:<ExceptionType>", message] per step
  wrong:      reads that succeeded with bytes that differ from what was stored   (a failure)
  guard:      writes outside the caller's buffer (guard bytes changed)          (a failure)
  unexpected: exceptions other than cxlkv errors, OSError and plain ValueError   (a failure)
Each step announces itself on stderr ("@op", unbuffered) so the op a signal hit is known.
Run directly: python fuzz_workload.py POOL_PATH  (prints the result as one JSON line).
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from collections.abc import Callable

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fuzz_seedpool as S

GUARD = 64
CANARY = 0xA5


def guarded(n: int) -> tuple[np.ndarray, np.ndarray]:
    """(whole, inner): n bytes with GUARD canary bytes on both sides."""
    whole = np.full(n + 2 * GUARD, CANARY, dtype=np.uint8)
    return whole, whole[GUARD : GUARD + n]


def guards_intact(whole: np.ndarray) -> bool:
    return bool((whole[:GUARD] == CANARY).all() and (whole[-GUARD:] == CANARY).all())


def exercise(path: str) -> dict:
    import cxlkv

    res: dict = {"ops": [], "wrong": [], "guard": [], "unexpected": []}

    def step(op: str, fn: Callable):
        os.write(2, f"@{op}\n".encode())
        try:
            v = fn()
        except BaseException as e:  # noqa: BLE001 - every exception is classified below
            res["ops"].append([op, "E:" + type(e).__name__, str(e)[:160]])
            clean = isinstance(e, (cxlkv.CxlkvError, OSError)) or type(e) is ValueError
            if not clean:
                res["unexpected"].append([op, type(e).__name__, str(e)[:300], traceback.format_exc()[-800:]])
            return False, None
        res["ops"].append([op, "ok"])
        return True, v

    ok, pool = step("open", lambda: cxlkv.Pool.open(path))
    if not ok:
        return res
    step("info", pool.info)
    step("namespaces", pool.namespaces)
    ok_a, a = step("ns_a", lambda: pool.namespace(S.layout_a()))
    ok_b, b = step("ns_b", lambda: pool.namespace(S.layout_b()))
    if ok_a:
        _exercise_a(a, step, res)
    if ok_b:
        _exercise_b(b, step, res)
    step("stats", pool.stats)
    ok, rep = step("check", pool.check)
    if ok:
        res["check_ok"] = bool(rep.get("ok"))
    step("close", pool.close)
    return res


def _exercise_a(a, step: Callable, res: dict) -> None:
    idx = list(S.A_PUT) + list(S.A_STORE)
    keys = [S.key("a", i) for i in idx]

    def get_bytes():
        for i, k in zip(idx, keys, strict=True):
            a.contains(k)
            got = a.get_bytes(k)
            if got is not None and got != S.expected_a(i):
                res["wrong"].append(["get_bytes", "a", i, len(got)])

    step("get_bytes_a", get_bytes)

    def get_guarded():
        for i in idx[:40]:
            whole, inner = guarded(S.A_BLOCK)
            hit = a.get(S.key("a", i), inner)
            if not guards_intact(whole):
                res["guard"].append(["get", "a", i])
            exp = S.expected_a(i)
            if hit and bytes(inner[: len(exp)]) != exp:
                res["wrong"].append(["get", "a", i])

    step("get_guarded_a", get_guarded)
    step("match_prefix_a", lambda: a.match_prefix(keys))

    def load():
        ids = list(S.A_STORE)[:8]
        half = S.A_BLOCK // 2
        whole, flat = guarded(2 * 48 * half)
        dst = flat.reshape(2, 48, half)
        bids = [(7 * j) % 48 for j in range(len(ids))]
        n = a.load([S.key("a", i) for i in ids], [dst], bids, block_dim=1)
        if not guards_intact(whole):
            res["guard"].append(["load", "a"])
        for j in range(n):
            if bytes(dst[0, bids[j]]) + bytes(dst[1, bids[j]]) != S.expected_a(ids[j]):
                res["wrong"].append(["load", "a", ids[j]])

    step("load_a", load)

    def put():
        for i in range(1000, 1012):
            k = S.key("a", i)
            p = S.payload(k, S.A_BLOCK - i % 3)
            if a.put(k, p):
                got = a.get_bytes(k)
                if got is not None and got != p:
                    res["wrong"].append(["put_get", "a", i])

    step("put_a", put)

    def store():
        half = S.A_BLOCK // 2
        src = np.zeros((2, 8, half), dtype=np.uint8)
        skeys = [S.key("a", 2000 + j) for j in range(4)]
        for j, k in enumerate(skeys):
            p = np.frombuffer(S.payload(k, S.A_BLOCK), dtype=np.uint8)
            src[0, j], src[1, j] = p[:half], p[half:]
        n = a.store(skeys, [src], list(range(4)), block_dim=1)
        for j in range(n):
            got = a.get_bytes(skeys[j])
            if got is not None and got != S.payload(skeys[j], S.A_BLOCK):
                res["wrong"].append(["store_get", "a", 2000 + j])

    step("store_a", store)
    step("delete_a", lambda: [a.delete(S.key("a", i)) for i in (1, 2, 3, 301, 1000)])

    def acquire():
        with a.acquire(keys[:16]) as lease:
            len(lease)

    step("acquire_a", acquire)


def _exercise_b(b, step: Callable, res: dict) -> None:
    def read_write():
        for i in S.B_PUT:
            got = b.get_bytes(S.key("b", i))
            if got is not None and got != S.expected_b(i):
                res["wrong"].append(["get_bytes", "b", i, len(got)])
        b.put(S.key("b", 999), b"z" * S.B_BLOCK)

    step("rw_b", read_write)


if __name__ == "__main__":
    sys.stdout.write(json.dumps(exercise(sys.argv[1])) + "\n")
    sys.stdout.flush()
