"""KV events and prefix queries for routers (issue 17, item 3), on real pools filled through the
connector's real store path (the scheduler/worker pair of test_connector_unit, no engine):

* the connector's ``take_events()`` returns vLLM's own ``BlockStored`` / ``BlockRemoved``, only for
  blocks the pool's index holds, with the fields llm-d indexes (token ids, parent, block size,
  medium), encodable as vLLM's ``KVEventBatch``;
* ``cxlkv events`` (a real process) publishes the pool's stores and evictions to a real ZMQ
  subscriber decoding with vLLM's msgspec decoder, and a gap (subscribed late) is recovered
  through the replay socket;
* ``cxlkv query`` answers the longest stored prefix, on the command line and over HTTP
  (Mooncake conductor's ``POST /query`` shape).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

import cxlkv

kv_events = pytest.importorskip("vllm.distributed.kv_events")
msgspec = pytest.importorskip("msgspec")
zmq = pytest.importorskip("zmq")

from cxlkv.integrations import token_records as tr  # noqa: E402
from cxlkv.integrations.coalesce_clock import CLOCK_NAMESPACE, clock_layout  # noqa: E402
from cxlkv.integrations.keys import block_keys  # noqa: E402
from test_connector_unit import BS, Engine, tokens  # noqa: E402

DECODER = msgspec.msgpack.Decoder(kv_events.KVEventBatch)


def run_request(e: Engine, rid: str, toks: list) -> None:
    ext = e.add(rid, toks)  # tokens found in the pool are loaded, the rest computed
    e.step({rid: len(toks) - ext})


def ns_handle(pool: cxlkv.Pool, name: str):
    info = next(n for n in pool.namespaces() if n["name"] == name)
    return pool.namespace(cxlkv.KVLayout.from_info(info), name=name)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cli(*args: str, **kw) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "cxlkv", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kw,
    )


# -------------------------------------------------------------------------------------------------
# the connector's take_events
def test_connector_events_announce_only_what_the_pool_holds(pool_path, model_dir):
    e = Engine(pool_path, model_dir, kv_events=True)
    try:
        ns_name = e.sched._ns_name
        toks = tokens(7, 4 * BS + 1)
        keys = block_keys(toks, BS, ns_name)
        run_request(e, "a", toks)
        with cxlkv.Pool.open(pool_path) as other:  # another host evicts block 3 before the check
            assert ns_handle(other, ns_name).delete(keys[3])
        evs = list(e.sched.take_events())
        assert [type(x).__name__ for x in evs] == ["BlockStored"]
        st = evs[0]
        assert st.block_hashes == keys[:3]  # block 3 is not in the pool: not announced
        assert st.parent_block_hash is None and st.block_size == BS
        assert st.token_ids == toks[: 3 * BS]
        medium = f"cxlkv:{e.sched._session.pool.uuid}"
        assert st.medium == medium
        # vLLM's wire format round-trips (what its ZMQ publisher sends)
        batch = kv_events.KVEventBatch(ts=1.0, events=evs)
        assert DECODER.decode(msgspec.msgpack.encode(batch)).events[0] == st
        assert not list(e.sched.take_events())  # announced once

        # the token records prove themselves against the keys
        with cxlkv.Pool.open(pool_path) as p:
            rns = p.namespace(tr.layout(BS), name=tr.namespace_name(BS))
            rec = tr.decode(rns.get_bytes(tr.record_key(keys[1])), keys[1], BS)
            assert rec is not None and rec.token_ids == toks[BS : 2 * BS] and rec.prev == keys[0]
            assert tr.decode(rns.get_bytes(tr.record_key(keys[1])), keys[2], BS) is None

        # block 3 stored again (by another request with the same prefix): request a's chain
        # continues from its parent
        c = toks[: 4 * BS] + tokens(8, BS + 1)
        run_request(e, "c", c)
        held = [
            h for x in e.sched.take_events() if isinstance(x, kv_events.BlockStored) for h in x.block_hashes
        ]
        assert keys[3] not in held  # c loaded blocks 0-2: its saves wait for that load's step
        e.step({"c": 0})  # the next step sends them
        later = [x for x in e.sched.take_events() if isinstance(x, kv_events.BlockStored)]
        assert any(x.block_hashes == [keys[3]] and x.parent_block_hash == keys[2] for x in later)

        # a block lost from the pool is announced as removed
        with cxlkv.Pool.open(pool_path) as other:
            assert ns_handle(other, ns_name).delete(keys[0])
        gone = [x for x in e.sched.take_events() if isinstance(x, kv_events.BlockRemoved)]
        assert gone and gone[0].block_hashes == [keys[0]] and gone[0].medium == medium

        # a request that finished in the step is still announced (its last save was that step)
        t2 = tokens(9, 2 * BS + 1)
        run_request(e, "b", t2)
        e.finish("b")
        done = [x for x in e.sched.take_events() if isinstance(x, kv_events.BlockStored)]
        assert any(x.block_hashes == block_keys(t2, BS, ns_name)[:2] for x in done)
    finally:
        e.close()


def test_connector_announces_its_blocks_removed_when_the_pool_fails(pool_path, model_dir):
    e = Engine(pool_path, model_dir, kv_events=True)
    try:
        toks = tokens(5, 3 * BS + 1)
        run_request(e, "a", toks)
        (stored,) = e.sched.take_events()
        os.unlink(pool_path)  # the connector turns to "no cache" at its next use
        time.sleep(0.01)  # the guard's stat interval (1 ms)
        assert e.add("b", toks) == 0
        (gone,) = e.sched.take_events()
        assert isinstance(gone, kv_events.BlockRemoved)
        assert gone.block_hashes == stored.block_hashes and gone.medium == stored.medium
        assert not list(e.sched.take_events())  # said once
    finally:
        e.close()


def test_connector_events_off_by_default(pool_path, model_dir):
    e = Engine(pool_path, model_dir)
    try:
        run_request(e, "a", tokens(3, 2 * BS + 1))
        assert not list(e.sched.take_events())  # no --kv-events-config: nothing, no records
        with cxlkv.Pool.open(pool_path) as p:
            assert not any(tr.is_record_namespace(n) for n in p.namespaces())
    finally:
        e.close()


# -------------------------------------------------------------------------------------------------
# cxlkv events: a real publisher process, a real subscriber
def _recv(sub, timeout_s: float):
    if not sub.poll(int(timeout_s * 1000)):
        return None
    topic, seq, payload = sub.recv_multipart()
    return topic.decode(), int.from_bytes(seq, "big"), DECODER.decode(payload)


def test_pool_event_stream_with_replay(pool_path, model_dir):
    e = Engine(pool_path, model_dir, kv_events=True)
    pub_port, replay_port = free_port(), free_port()
    proc = None
    ctx = zmq.Context()
    try:
        ns_name = e.sched._ns_name
        first = tokens(11, 3 * BS + 1)
        run_request(e, "a", first)
        e.sched.take_events()  # the scheduler writes the token records
        proc = cli(
            "events",
            pool_path,
            "--endpoint",
            f"tcp://127.0.0.1:{pub_port}",
            "--replay-endpoint",
            f"tcp://127.0.0.1:{replay_port}",
            "--interval",
            "0.05",
            "--record-wait",
            "5",
            "--duration",
            "60",
            "--verbose",
        )
        # wait until the pool's current blocks went out as seq 0, before anyone subscribed
        line = proc.stdout.readline()
        while line and not line.startswith("0 "):
            line = proc.stdout.readline()
        assert line.startswith("0 kv@cxlkv-"), proc.stderr.read() if proc.poll() is not None else line

        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
        sub.connect(f"tcp://127.0.0.1:{pub_port}")
        # new stores until one reaches the subscriber (a SUB socket joins asynchronously)
        got, n = None, 0
        while got is None and n < 50:
            run_request(e, f"r{n}", tokens(100 + n, 2 * BS + 1))
            e.sched.take_events()
            got = _recv(sub, 0.5)
            n += 1
        assert got is not None, "no message reached the subscriber"
        topic, seq, _batch = got
        assert topic == f"kv@cxlkv-{e.sched._session.pool.uuid[:8]}@{ns_name}"
        assert seq > 0  # seq 0 was published before we subscribed: a gap

        # recover [0, seq) through the replay socket (vLLM's protocol: [b"", start] -> messages, end)
        replay = ctx.socket(zmq.DEALER)
        replay.connect(f"tcp://127.0.0.1:{replay_port}")
        replay.send_multipart([b"", (0).to_bytes(8, "big")])
        replayed = {}
        while True:
            assert replay.poll(10_000), "replay did not answer"
            _empty, _rtopic, rseq, payload = replay.recv_multipart()
            if int.from_bytes(rseq, "big", signed=True) == -1:
                break
            replayed[int.from_bytes(rseq, "big")] = DECODER.decode(payload)
        assert set(range(seq + 1)) <= set(replayed)
        stored = {}
        for s in range(seq):
            for ev in replayed[s].events:
                if isinstance(ev, kv_events.BlockStored):
                    for i, h in enumerate(ev.block_hashes):
                        stored[h] = (ev, i)
        keys = block_keys(first, BS, ns_name)
        for i, k in enumerate(keys[:3]):
            ev, _ = stored[k]
            assert ev.token_ids == first[i * BS : (i + 1) * BS]  # from the verified token record
            assert ev.parent_block_hash == (keys[i - 1] if i else None)
            assert ev.block_size == BS and ev.medium == f"cxlkv:{e.sched._session.pool.uuid}"

        # an eviction by anyone shows as BlockRemoved
        with cxlkv.Pool.open(pool_path) as other:
            assert ns_handle(other, ns_name).delete(keys[1])
        removed = []
        for _ in range(100):
            msg = _recv(sub, 0.2)
            if msg is not None:
                removed += [
                    h
                    for ev in msg[2].events
                    if isinstance(ev, kv_events.BlockRemoved)
                    for h in ev.block_hashes
                ]
            if keys[1] in removed:
                break
        assert keys[1] in removed
    finally:
        ctx.destroy(linger=0)
        if proc is not None:
            proc.terminate()
            proc.wait(10)
        e.close()


# -------------------------------------------------------------------------------------------------
# cxlkv query: CLI and HTTP
def test_query_cli_and_http(pool_path, model_dir):
    e = Engine(pool_path, model_dir)
    server = None
    try:
        ns_name = e.sched._ns_name
        toks = tokens(21, 5 * BS + 1)
        run_request(e, "a", toks)
        e.finish("a")
        # a coalescing writer's clock record: its namespace is not a second model
        clocks = e.sched._session.pool.namespace(clock_layout(), name=CLOCK_NAMESPACE)
        clocks.put(b"\x01" * 32, bytes(64))
        probe = toks[: 3 * BS] + [7] * (3 * BS)  # shares three blocks, then diverges
        out = subprocess.run(
            [sys.executable, "-m", "cxlkv", "query", "--pool", pool_path, "--json", *map(str, probe)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0, out.stderr
        r = json.loads(out.stdout)
        assert r["namespace"] == ns_name and r["matched_tokens"] == 3 * BS and r["block_size"] == BS
        bad = subprocess.run(
            [sys.executable, "-m", "cxlkv", "query", "--pool", pool_path, "--namespace", "served-alias", "1"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert bad.returncode != 0 and "no KV namespace 'served-alias'" in bad.stderr

        port = free_port()
        server = cli("query", "--pool", pool_path, "--serve", str(port))
        assert "POST http://" in server.stderr.readline()

        def post(body: dict):
            req = urllib.request.Request(
                f"http://127.0.0.1:{port}/query",
                data=json.dumps(body).encode(),
                method="POST",
                headers={"Content-Type": "application/json"},
            )
            with urllib.request.urlopen(req, timeout=30) as resp:
                return json.loads(resp.read())

        ans = post({"model": ns_name, "token_ids": toks})
        (inst,) = ans["data"].values()
        assert inst["matched_tokens"] == 5 * BS  # the whole stored prefix
        assert (
            post({"token_ids": probe})["data"][f"cxlkv:{e.sched._session.pool.uuid}"]["matched_tokens"]
            == 3 * BS
        )
        with pytest.raises(urllib.error.HTTPError) as err:
            post({"model": ns_name, "lora_name": "an-alias", "token_ids": toks})
        assert err.value.code == 400
    finally:
        if server is not None:
            server.terminate()
            server.wait(10)
        e.close()


# -------------------------------------------------------------------------------------------------
# the pool is untrusted input
def test_corrupt_index_entry_and_token_record_are_refused(pool_path, model_dir):
    """An entry naming a namespace that does not exist is no block (the core's scan drops it); a
    token record whose tokens do not hash to its key is not believed (the event has no tokens)."""
    from cxlkv.index_scan import scan_index
    from cxlkv.services.events import PoolEventSource

    e = Engine(pool_path, model_dir, kv_events=True)
    try:
        ns_name = e.sched._ns_name
        toks = tokens(31, 2 * BS + 1)
        keys = block_keys(toks, BS, ns_name)
        run_request(e, "a", toks)
        e.sched.take_events()  # writes the token records
        with cxlkv.Pool.open(pool_path) as pool:
            info = pool.info()
            entries = {k: (slot, ns_id) for slot, _g, ns_id, _d, k in scan_index(pool).entries()}
            # a record that lies: block 1's record with its first token changed
            rns = pool.namespace(tr.layout(BS), name=tr.namespace_name(BS))
            lie = bytearray(rns.get_bytes(tr.record_key(keys[1])))
            lie[tr.RECORD_HEADER] ^= 1
            assert rns.delete(tr.record_key(keys[1])) and rns.put(tr.record_key(keys[1]), bytes(lie))
        # block 0's index entry now names namespace 4000 (max_namespaces is 64)
        slot0 = entries[keys[0]][0]
        with open(pool_path, "r+b") as f:
            f.seek(info["index_off"] + slot0 * 64 + 40)  # IndexEntry.ns_id (format.h)
            f.write((4000).to_bytes(4, "little"))
        with cxlkv.Pool.open(pool_path) as pool:
            found = {k for *_, k in scan_index(pool).entries()}
            assert keys[0] not in found and keys[1] in found
            events = PoolEventSource(pool, record_wait_s=0).poll()
        stored = {
            ev["block_hashes"][0]: ev for evs in events.values() for ev in evs if ev["type"] == "BlockStored"
        }
        assert keys[0] not in stored
        assert stored[keys[1]]["token_ids"] == [] and stored[keys[1]]["parent_block_hash"] is None
    finally:
        e.close()


def test_event_stream_survives_the_pool_being_recreated(pool_path):
    """A pool destroyed and created again under `cxlkv events`: the old pool's topic gets
    AllBlocksCleared, and the new pool's blocks follow on the same sequence."""
    layout = cxlkv.KVLayout(
        model_id="recreate", num_layers=1, num_kv_heads=1, head_size=8, tokens_per_block=BS
    )
    keys = block_keys(list(range(2 * BS)), BS, "kv1-recreate")
    with cxlkv.Pool.create(pool_path, 16 << 20, chunk_size=1 << 20) as pool:
        pool.namespace(layout, name="kv1-recreate").put(keys[0], b"a" * 64)
        old_uuid = pool.uuid
    port = free_port()
    proc = cli(
        "events",
        pool_path,
        "--endpoint",
        f"tcp://127.0.0.1:{port}",
        "--replay-endpoint",
        "",
        "--interval",
        "0.05",
        "--record-wait",
        "0",
        "--duration",
        "60",
        "--verbose",
    )
    try:
        assert proc.stdout.readline().startswith(f"0 kv@cxlkv-{old_uuid[:8]}@kv1-recreate: BlockStored x1")
        cxlkv.Pool.destroy(pool_path, ignore_attached=True)
        with cxlkv.Pool.create(pool_path, 16 << 20, chunk_size=1 << 20) as pool:
            pool.namespace(layout, name="kv1-recreate").put(keys[1], b"b" * 64)
            new_uuid = pool.uuid
        assert proc.stdout.readline().startswith(f"1 kv@cxlkv-{old_uuid[:8]}@kv1-recreate: AllBlocksCleared")
        assert proc.stdout.readline().startswith(f"2 kv@cxlkv-{new_uuid[:8]}@kv1-recreate: BlockStored x1")
    finally:
        proc.terminate()
        proc.wait(10)
