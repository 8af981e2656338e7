"""Mutations of a seed pool. A case is plain JSON, so a failing one can be saved and replayed:
  {"id", "variant", "kind", "patches": [[offset, hex bytes], ...], "reseal": bool, "size": int|None}
`gen_case(seed, case_id, seeds, maps)` is a pure function of (seed, case_id): a run is replayed by
its seed, one case by its file.
"""

from __future__ import annotations

import os
import random
import struct

import fuzz_layout as L

U64 = (1 << 64) - 1


def interesting(width: int, orig: int, rng: random.Random, extra=()) -> int:
    """0, -1, 2^k, orig±1, a flipped bit, random... for a field of `width` bits."""
    top = (1 << width) - 1
    c = [
        0,
        1,
        2,
        top,
        top - 1,
        1 << (width - 1),
        (1 << (width - 1)) - 1,
        (orig + 1) & top,
        (orig - 1) & top,
        orig ^ (1 << rng.randrange(width)),
        rng.getrandbits(width),
        (orig * 2) & top,
        orig // 2,
    ]
    if width == 64:
        c += [1 << 20, 1 << 32, (1 << 32) - 1, 1 << 36, 1 << 40, 1 << 58, 1 << 63]
    elif width == 32:
        c += [254, 255, 4096, 4097, 65535, 1 << 16]
    c += [v & top for v in extra]
    return rng.choice(c)


def field_patch(buf: bytes, off: int, fmt: str, rng: random.Random, extra=()) -> list:
    size = struct.calcsize(fmt)
    if fmt.endswith("s"):
        new = rng.choice(
            [
                bytes(size),
                b"\xff" * size,
                rng.randbytes(size),
                bytes([0xC3, 0x28] * (size // 2)) + b"\x80" * (size % 2),
            ]
        )  # invalid UTF-8
        return [off, new.hex()]
    orig = struct.unpack_from(fmt, buf, off)[0]
    return [off, struct.pack(fmt, interesting(size * 8, orig, rng, extra)).hex()]


def u64_patch(off: int, v: int) -> list:
    return [off, struct.pack("<Q", v & U64).hex()]


def state_word_patch(buf: bytes, off: int, rng: random.Random, node_word: bool) -> list:
    """A state word with plausible structure: [state:8][node:8][rest:48], or a node slot's
    [state:8][pid:32][epoch:24]."""
    orig = struct.unpack_from("<Q", buf, off)[0]
    st = rng.choice([0, 1, 2, 3, 4, 5, 7, 255, orig >> 56])
    if node_word:
        pid = rng.choice([0, 1, os.getpid(), 0x7FFFFFFF, 0xFFFFFFFF, (orig >> 24) & 0xFFFFFFFF, 4194304])
        ep = rng.choice([0, 1, 0xFFFFFF, orig & 0xFFFFFF])
        return u64_patch(off, (st << 56) | (pid << 24) | ep)
    node = rng.choice([0, 1, 2, 3, 63, 64, 65, 200, 254, 255, (orig >> 48) & 0xFF])
    rest = rng.choice([orig & ((1 << 48) - 1), 0, (1 << 48) - 1, rng.getrandbits(48)])
    return u64_patch(off, (st << 56) | (node << 48) | rest)


def _header(buf, m, rng, sealed: bool):
    names = [n for n in L.HEADER_FIELDS if sealed is False or n != "checksum"]
    s, h = m["size"], m["header"]
    extra = [s, s + 1, s - 1, s - 4096, 2 * s, h["arena_off"], h["chunk_map_off"], h["index_off"]]
    off, fmt = L.HEADER_FIELDS[rng.choice(names)]
    patches = [field_patch(buf, off, fmt, rng, extra)]
    if sealed and rng.random() < 0.3:  # two fields at once keep some areas consistent
        off, fmt = L.HEADER_FIELDS[rng.choice([n for n in names if n != "magic"])]
        patches.append(field_patch(buf, off, fmt, rng, extra))
    return patches, sealed, None


def _header_bytes_sealed(buf, m, rng):
    patches = []
    for _ in range(rng.randint(1, 4)):
        off = rng.randrange(8, L.CHECKSUM_OFF)
        patches.append([off, rng.randbytes(min(rng.randint(1, 8), L.CHECKSUM_OFF - off)).hex()])
    return patches, True, None


def _shared_word(buf, m, rng):
    off = rng.choice([L.SHARED_INIT_OFF, L.SHARED_NSLOCK_OFF])
    return (
        [
            u64_patch(
                off, rng.choice([0, 1, 2, 63, 64, 65, 255, U64, 0x5953554254494E49, rng.getrandbits(64)])
            )
        ],
        False,
        None,
    )


def _node_slot(buf, m, rng):
    base = rng.choice(m["live_node_slots"] + m["node_slots"][:4] + [m["node_slots"][-1]])
    name = rng.choice(list(L.NODE_SLOT_FIELDS))
    off, fmt = L.NODE_SLOT_FIELDS[name]
    if name == "state":
        return [state_word_patch(buf, base + off, rng, node_word=True)], False, None
    return [field_patch(buf, base + off, fmt, rng)], False, None


def _node_area(buf, m, rng):
    h = m["header"]
    base = m["node_areas"][rng.choice([0, 1, 2, h["max_nodes"] - 1])]
    what = rng.random()
    if what < 0.4:
        return (
            [field_patch(buf, base + L.NODE_PIN_HW_OFF, "<Q", rng, [h["pin_slots"], h["pin_slots"] + 1])],
            False,
            None,
        )
    if what < 0.8:
        p = rng.randrange(min(h["pin_slots"], 16))
        v = rng.choice(
            [((rng.randrange(h["index_slots"]) + 1) << 24) | rng.randrange(4), U64, rng.getrandbits(64), 1]
        )
        return [u64_patch(base + L.NODE_PINS_OFF + 8 * p, v)], False, None
    c = rng.randrange(16)
    return (
        [u64_patch(base + L.NODE_COUNTERS_OFF + 8 * c, rng.choice([U64, rng.getrandbits(64)]))],
        False,
        None,
    )


def _quota(buf, m, rng):
    """A quota row (format/quota.h: a forged field, a forged row resealed with a bad checksum or
    a random one) or a node's usage counters (huge, wrapped, random)."""
    if rng.random() < 0.6:
        base = L.QUOTA_TABLE_OFF + 64 * rng.choice([0, 1, 2, rng.randrange(L.QUOTA_ROWS)])
        name = rng.choice(list(L.QUOTA_ROW_FIELDS))
        off, fmt = L.QUOTA_ROW_FIELDS[name]
        extra = {"kind": [0, 1, 2, 3], "ns_id": [0, 1, 2, 4096, 4097], "max_ppm": [1, 10**6, 10**6 + 1]}
        return [field_patch(buf, base + off, fmt, rng, extra.get(name, ()))], False, None
    h = m["header"]
    base = m["node_areas"][rng.choice([0, 1, h["max_nodes"] - 1])]
    side = rng.choice([L.NODE_QUOTA_CHARGED_OFF, L.NODE_QUOTA_RELEASED_OFF])
    v = rng.choice([U64, 1 << 63, h["pool_bytes"] + 1, rng.getrandbits(64)])
    return [u64_patch(base + side + 8 * rng.randrange(4), v)], False, None


def _ns_entry(buf, m, rng):
    nid = rng.choice(list(m["namespaces"]) + [len(m["namespaces"]) + 1])
    base = m["header"]["ns_table_off"] + (nid - 1) * L.NS_BYTES
    name = rng.choice(list(L.NS_FIELDS))
    off, fmt = L.NS_FIELDS[name]
    if name == "state":
        return [state_word_patch(buf, base + off, rng, node_word=False)], False, None
    extra = [8192, 8191, 8193, 2048, 4 << 20, (4 << 20) + 1, 1 << 32] if name == "block_bytes" else ()
    return [field_patch(buf, base + off, fmt, rng, extra)], False, None


def _index(buf, m, rng, random_slot: bool):
    h = m["header"]
    base = (
        h["index_off"] + L.ENTRY_BYTES * rng.randrange(h["index_slots"])
        if random_slot
        else rng.choice(m["entries"])
    )
    name = rng.choice(list(L.ENTRY_FIELDS) + ["state", "chunk", "block", "length"])  # weight the refs
    off, fmt = L.ENTRY_FIELDS[name]
    if name == "state":
        patches = [state_word_patch(buf, base + off, rng, node_word=False)]
    else:
        extra = {
            "chunk": [h["chunk_count"], h["chunk_count"] - 1, 2],
            "block": [511, 512, 2047, 2048, 4095, 4096],
            "length": [0, 2048, 2049, 8192, 8193],
            "ns_id": [1, 2, 3, 64, 65, 4096],
            "tenant_row": [0, 1, 2, 48, 49, 255],
            "ns_row": [0, 1, 2, 48, 49, 255],
        }.get(name, ())
        patches = [field_patch(buf, base + off, fmt, rng, extra)]
    if random_slot and rng.random() < 0.5:  # make the slot look READY
        patches.append(u64_patch(base, (L.ENTRY_READY << 56) | rng.getrandbits(48)))
    return patches, False, None


def _chunk_map(buf, m, rng):
    off = rng.choice(m["chunk_words"])
    orig = struct.unpack_from("<Q", buf, off)[0]
    st, node = rng.choice([0, 1, 2, 3, 4, 255]), rng.choice([0, 1, 2, 200, 255])
    ns = rng.choice([0, 1, 2, 3, 64, 65, 0xFFFF, (orig >> 32) & 0xFFFF])
    v = rng.choice(
        [(st << 56) | (node << 48) | (ns << 32), rng.getrandbits(64), orig ^ (1 << rng.randrange(64))]
    )
    return [u64_patch(off, v)], False, None


def _block_desc(buf, m, rng):
    h = m["header"]
    if m["descs"] and rng.random() < 0.8:
        off = rng.choice(m["descs"])
    else:
        off = (
            h["arena_off"]
            + rng.randrange(h["chunk_count"]) * m["chunk_stride"]
            + 8 * rng.randrange(m["desc_bytes"] // 8)
        )
    orig = struct.unpack_from("<Q", buf, off)[0]
    st, node = rng.choice([0, 1, 2, 3, 255]), rng.choice([0, 1, 2, 200, 255])
    low40 = (1 << 40) - 1
    slot = rng.choice(
        [orig & low40, 0, h["index_slots"], h["index_slots"] - 1, low40, rng.randrange(h["index_slots"])]
    )
    v = rng.choice([(st << 56) | (node << 48) | slot, (orig & ~low40) | slot, rng.getrandbits(64), 0])
    return [u64_patch(off, v)], False, None


def _payload(buf, m, rng):
    poff, length = rng.choice(m["payloads"])
    return [[poff + rng.randrange(max(1, length)), bytes([rng.getrandbits(8) | 1]).hex()]], False, None


def _bitflip_meta(buf, m, rng):
    patches = []
    for _ in range(rng.randint(1, 16)):
        o = rng.randrange(m["meta_end"])
        patches.append([o, bytes([buf[o] ^ (1 << rng.randrange(8))]).hex()])
    return patches, False, None


def _random_bytes(buf, m, rng):
    return (
        [
            [rng.randrange(m["size"] - 8), rng.randbytes(rng.randint(1, 8)).hex()]
            for _ in range(rng.randint(1, 32))
        ],
        False,
        None,
    )


def _resize(buf, m, rng):
    s = m["size"]
    return (
        [],
        False,
        rng.choice(
            [
                0,
                100,
                4096,
                8191,
                8192,
                12288,
                m["header"]["arena_off"],
                s - 1,
                s - 4096,
                rng.randrange(s),
                s + 4096,
            ]
        ),
    )


# kind: (generator, weight); "multi" combines 2-4 of the single-area kinds.
KINDS = {
    "hdr_field_raw": (lambda b, m, r: _header(b, m, r, sealed=False), 4),
    "hdr_field_sealed": (lambda b, m, r: _header(b, m, r, sealed=True), 14),
    "hdr_bytes_sealed": (_header_bytes_sealed, 4),
    "shared_word": (_shared_word, 3),
    "node_slot": (_node_slot, 6),
    "node_area": (_node_area, 6),
    "ns_entry": (_ns_entry, 10),
    "quota": (_quota, 4),
    "index_entry": (lambda b, m, r: _index(b, m, r, random_slot=False), 18),
    "index_random_slot": (lambda b, m, r: _index(b, m, r, random_slot=True), 3),
    "access": (lambda b, m, r: ([field_patch(b, r.choice(m["access"]), "<Q", r)], False, None), 2),
    "chunk_map": (_chunk_map, 8),
    "block_desc": (_block_desc, 8),
    "payload": (_payload, 3),
    "bitflip_meta": (_bitflip_meta, 5),
    "random_bytes_any": (_random_bytes, 3),
    "resize": (_resize, 2),
}
MULTI_WEIGHT = 10
_SINGLE = [k for k in KINDS if k not in ("random_bytes_any", "resize")]


def gen_case(seed: int, case_id: int, seeds: dict, maps: dict) -> dict:
    rng = random.Random(seed * 1_000_003 + case_id)
    variant = rng.choice(["clean", "clean", "deadnode"])
    buf, m = seeds[variant], maps[variant]
    names = list(KINDS) + ["multi"]
    kind = rng.choices(names, [KINDS[k][1] for k in KINDS] + [MULTI_WEIGHT])[0]
    if kind != "multi":
        patches, reseal, size = KINDS[kind][0](buf, m, rng)
    else:
        patches, reseal, size, parts = [], False, None, []
        for _ in range(rng.randint(2, 4)):
            k = rng.choices(_SINGLE, [KINDS[k][1] for k in _SINGLE])[0]
            p, r, _ = KINDS[k][0](buf, m, rng)
            patches += p
            reseal |= r
            parts.append(k)
        kind = "multi:" + "+".join(parts)
    return {
        "id": case_id,
        "variant": variant,
        "kind": kind,
        "patches": patches,
        "reseal": reseal,
        "size": size,
    }


def apply_case(seed_bytes: bytes, case: dict) -> bytes:
    b = bytearray(seed_bytes)
    for off, hx in case["patches"]:
        data = bytes.fromhex(hx)
        b[off : off + len(data)] = data
    if case["reseal"]:
        L.reseal_header(b)
    n = case.get("size")
    if n is not None:
        b = b[:n] if n <= len(b) else b + bytes(n - len(b))
    return bytes(b)


def where(off: int, m: dict) -> str:
    """Which area / field a file offset is in, for humans reading a case file."""
    h = m["header"]
    if off < L.HEADER_STRUCT_BYTES:
        return "header." + next(
            (n for n, (o, f) in L.HEADER_FIELDS.items() if o <= off < o + struct.calcsize(f)), "?"
        )
    if off < 8192:
        return "shared_words." + ("init" if off < L.SHARED_NSLOCK_OFF else "ns_lock")
    if off < h["node_area_off"]:
        return f"node_slot[{(off - h['node_table_off']) // L.NODE_SLOT_BYTES}]+{(off - h['node_table_off']) % L.NODE_SLOT_BYTES}"
    if off < h["ns_table_off"]:
        i, r = divmod(off - h["node_area_off"], h["node_area_bytes"])
        return f"node_area[{i}]+{r}"
    if off < h["index_off"]:
        i, r = divmod(off - h["ns_table_off"], L.NS_BYTES)
        return f"ns_entry[{i + 1}]+{r}"
    if off < h["access_off"]:
        i, r = divmod(off - h["index_off"], L.ENTRY_BYTES)
        return f"index_entry[{i}]+{r}"
    if off < h["chunk_map_off"]:
        return f"access[{(off - h['access_off']) // 8}]"
    if off < h["arena_off"]:
        return f"chunk_map[{(off - h['chunk_map_off']) // 8}]"
    c, r = divmod(off - h["arena_off"], m["chunk_stride"])
    return f"chunk{c}.desc[{r // 8}]" if r < m["desc_bytes"] else f"chunk{c}.payload+{r - m['desc_bytes']}"


def describe_case(case: dict, m: dict) -> list[str]:
    out = [f"{where(off, m)} = {hx}" for off, hx in case["patches"]]
    if case["reseal"]:
        out.append("header checksum re-sealed")
    if case.get("size") is not None:
        out.append(f"file resized to {case['size']}")
    return out
