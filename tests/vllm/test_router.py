"""The round-robin router of `cxlkv bench serve` (python/cxlkv/integrations/router.py): real
processes (the router, stand-in servers tests/vllm/fake_openai.py), real HTTP, real kill -9. No
engine: a few seconds.

Round robin spreads requests evenly; turn mode sends turn T of conversation U to (U + T) mod N;
a stream passes through chunk by chunk; a dead backend is an error to the client (a 502 naming
it, or a cut stream with an error event), never a truncated 200."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from test_pd import free_port, wait_ready

aiohttp = pytest.importorskip("aiohttp")
HERE = os.path.dirname(os.path.abspath(__file__))
pytestmark = pytest.mark.timeout(120)
N = 3


def spawn(args, log=subprocess.DEVNULL) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, *args], stdout=log, stderr=subprocess.STDOUT)


@pytest.fixture
def rig(tmp_path):
    """N stand-in servers (each streams 5 chunks 0.3 s apart, printing SENT i) behind the router
    in turn mode (requests without a route key are round robin)."""
    ports = [free_port() for _ in range(N)]
    rport = free_port()
    logs = [tmp_path / f"backend{i}.log" for i in range(N)]
    backends = [
        spawn([os.path.join(HERE, "fake_openai.py"), str(p), "5", "0.3"], open(logs[i], "w"))
        for i, p in enumerate(ports)
    ]
    argv = ["-m", "cxlkv.integrations.router", "--port", str(rport), "--mode", "turn"]
    for p in ports:
        argv += ["--backend", f"http://127.0.0.1:{p}"]
    router = spawn(argv, open(tmp_path / "router.log", "w"))
    deadline = time.time() + 60
    for p in [*ports, rport]:
        wait_ready(f"http://127.0.0.1:{p}/health", [*backends, router], deadline)
    yield {"url": f"http://127.0.0.1:{rport}", "backends": backends, "ports": ports, "logs": logs}
    for p in [*backends, router]:
        if p.poll() is None:
            p.kill()
        p.wait()


async def _get_json(url: str):
    async with aiohttp.ClientSession() as s, s.get(url) as r:
        return r.status, await r.json()


def seen(rig) -> list[int]:
    """Requests each backend got (its /stats)."""
    return [asyncio.run(_get_json(f"http://127.0.0.1:{p}/stats"))[1]["requests"] for p in rig["ports"]]


async def _post(url: str, body: dict, headers: dict | None = None):
    async with aiohttp.ClientSession() as s, s.post(url, json=body, headers=headers or {}) as r:
        return r.status, await r.read()


def test_round_robin_and_turn_routing(rig):
    url = rig["url"] + "/v1/completions"
    for _ in range(2 * N):
        status, body = asyncio.run(_post(url, {"prompt": "x", "max_tokens": 2}))
        assert status == 200, body
    assert seen(rig) == [2] * N
    # turn t of conversation u on (u + t) mod N: by header and by body field (removed before
    # forwarding: the stand-in would echo nothing, but vLLM rejects no field and logs it)
    asyncio.run(_post(url, {"prompt": "x", "max_tokens": 2}, {"X-Cxlkv-Route": "1:1"}))  # -> 2
    asyncio.run(_post(url, {"prompt": "x", "max_tokens": 2, "cxlkv_route": {"user": 2, "turn": 2}}))  # -> 1
    asyncio.run(_post(url, {"prompt": "x", "max_tokens": 2, "cxlkv_route": {"user": 3, "turn": 0}}))  # -> 0
    assert seen(rig) == [3, 3, 3]
    asyncio.run(_post(url, {"prompt": "x", "max_tokens": 2}, {"X-Cxlkv-Route": "5:0"}))  # -> 2
    assert seen(rig) == [3, 3, 4]
    status, body = asyncio.run(_post(url, {"prompt": "x", "cxlkv_route": {"user": "a"}}))
    assert status == 400 and b"bad route key" in body
    status, recs = asyncio.run(_get_json(rig["url"] + "/router/requests"))
    routed = [r for r in recs if r["route"]]
    assert [(r["route"], r["backend"]) for r in routed] == [("1:1", 2), ("2:2", 1), ("3:0", 0), ("5:0", 2)]
    assert all(r["status"] == 200 and r["prompt_tokens"] == 3 for r in recs)


async def _first_read_then_rest(url: str):
    async with aiohttp.ClientSession() as s, s.post(url, json={"prompt": "x", "stream": True}) as r:
        first = await r.content.readany()
        rest = await r.content.read()
        return r.status, first, rest


def test_stream_passes_through_chunk_by_chunk(rig):
    status, first, rest = asyncio.run(_first_read_then_rest(rig["url"] + "/v1/completions"))
    assert status == 200
    # the backend sends one event every 0.3 s: a router that buffered would hand over all of them
    # (and [DONE]) at once
    assert first.count(b"data: ") == 1, first
    body = first + rest
    assert body.count(b"data: {") == 5 and body.rstrip().endswith(b"data: [DONE]")


def test_dead_backend_is_a_502_naming_it(rig):
    rig["backends"][1].kill()
    rig["backends"][1].wait()
    url = rig["url"] + "/v1/completions"
    statuses = []
    for _ in range(N):
        status, body = asyncio.run(_post(url, {"prompt": "x", "max_tokens": 2, "stream": True}))
        statuses.append(status)
        if status != 200:
            err = json.loads(body)["error"]
            assert err["type"] == "upstream_error" and f":{rig['ports'][1]}" in err["side"], err
            assert "unreachable" in err["message"]
        else:
            assert body.rstrip().endswith(b"data: [DONE]")
    assert sorted(statuses) == [200, 200, 502]
    status, health = asyncio.run(_get_json(rig["url"] + "/health"))
    assert status == 503 and [b["ok"] for b in health["backends"]] == [True, False, True]


async def _stream_until_cut(url: str, on_first):
    async with aiohttp.ClientSession() as s, s.post(url, json={"prompt": "x", "stream": True}) as r:
        assert r.status == 200
        got = await r.content.readany()
        on_first()
        try:  # chunk by chunk: read() would drop what came before the error
            while chunk := await r.content.readany():
                got += chunk
        except aiohttp.ClientPayloadError as e:
            return got, e
        return got, None


def test_backend_killed_mid_stream_cuts_the_answer(rig):
    """The stand-in dies after its first event: the client gets an error event and a cut
    connection (aiohttp raises), never a clean end of a short answer."""

    def kill_backend0():
        os.kill(rig["backends"][0].pid, signal.SIGKILL)
        rig["backends"][0].wait()

    got, err = asyncio.run(_stream_until_cut(rig["url"] + "/v1/completions", kill_backend0))
    assert err is not None, f"the client saw a clean end: {got!r}"
    assert b"[DONE]" not in got
    assert b'"type": "upstream_error"' in got and b"stream broken" in got
    _, recs = asyncio.run(_get_json(rig["url"] + "/router/requests"))
    assert recs[-1]["status"] == 502 and recs[-1]["backend"] == 0
