"""The P/D proxy when a side dies (F4 of the connector red-team report): real processes (the
proxy and stand-in upstream servers, tests/vllm/fake_openai.py), real kill -9. No engine: fast.

A dead decode server gives the client an error (an SSE error event, or a 5xx naming the side),
never a truncated success; no prefill is sent while the decode side is down; /health says so."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from test_pd import free_port, pd_proxy_args, wait_ready

pytest.importorskip("aiohttp")
HERE = os.path.dirname(os.path.abspath(__file__))
pytestmark = pytest.mark.timeout(120)


def spawn(args, log=subprocess.DEVNULL) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, *args], stdout=log, stderr=subprocess.STDOUT)


def fake(port: int, chunks: int = 3, delay: float = 0.0, log=subprocess.DEVNULL) -> subprocess.Popen:
    return spawn([os.path.join(HERE, "fake_openai.py"), str(port), str(chunks), str(delay)], log)


def request(url: str, body: dict | None = None, timeout: float = 60):
    """(status, body bytes) without raising on HTTP errors."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


@pytest.fixture
def rig(tmp_path):
    """prefill + decode stand-ins (decode streams 40 chunks, 0.1 s apart) behind the proxy."""
    pp, dp, xp = free_port(), free_port(), free_port()
    decode_log = open(tmp_path / "decode.log", "w")
    procs = {
        "prefill": fake(pp),
        "decode": fake(dp, chunks=40, delay=0.1, log=decode_log),
        "proxy": spawn(
            pd_proxy_args(pp, dp, xp, "--health-ttl", "0"),
            open(tmp_path / "proxy.log", "w"),
        ),
    }
    deadline = time.time() + 60
    for port in (pp, dp, xp):
        wait_ready(f"http://127.0.0.1:{port}/health", list(procs.values()), deadline)
    yield {
        "procs": procs,
        "proxy": f"http://127.0.0.1:{xp}",
        "prefill": f"http://127.0.0.1:{pp}",
        "decode": f"http://127.0.0.1:{dp}",
        "decode_log": tmp_path / "decode.log",
    }
    for p in procs.values():
        if p.poll() is None:
            p.kill()
        p.wait()


def kill9(p: subprocess.Popen) -> None:
    os.kill(p.pid, signal.SIGKILL)
    p.wait()


def test_healthy_stream_passes_through(rig):
    status, body = request(
        rig["proxy"] + "/v1/completions", {"prompt": "hi", "max_tokens": 4, "stream": True}
    )
    assert status == 200 and body.rstrip().endswith(b"data: [DONE]") and b"error" not in body
    status, body = request(rig["proxy"] + "/health")
    assert status == 200 and json.loads(body)["ok"] is True


def test_decode_killed_mid_stream_gives_error_event(rig):
    """The client must see an error, not a short answer that looks complete."""
    req = urllib.request.Request(
        rig["proxy"] + "/v1/completions",
        json.dumps({"prompt": "hi", "max_tokens": 40, "stream": True}).encode(),
        {"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        assert r.status == 200
        first = r.readline()  # the stream has started
        assert first.startswith(b"data: ")
        while b"SENT 2" not in rig["decode_log"].read_bytes():
            time.sleep(0.05)
        kill9(rig["procs"]["decode"])
        rest = r.read()
    events = [ln for ln in (first + rest).split(b"\n") if ln.startswith(b"data: ")]
    assert b"[DONE]" not in rest
    err = json.loads(events[-1][6:])
    assert err["error"]["side"] == "decode" and "stream broken" in err["error"]["message"]


def test_decode_down_no_prefill_and_503_naming_decode(rig):
    kill9(rig["procs"]["decode"])
    status, body = request(rig["proxy"] + "/v1/completions", {"prompt": "hi", "max_tokens": 4})
    assert status == 503
    err = json.loads(body)["error"]
    assert err["side"] == "decode" and "decode server" in err["message"]
    _, stats = request(rig["prefill"] + "/stats")
    assert json.loads(stats)["requests"] == 0, "a prefill was sent while the decode side was down"
    status, body = request(rig["proxy"] + "/health")
    h = json.loads(body)
    assert status == 503 and h["decode"]["ok"] is False and h["prefill"]["ok"] is True


def test_prefill_down_gives_502_naming_prefill(rig):
    kill9(rig["procs"]["prefill"])
    status, body = request(
        rig["proxy"] + "/v1/completions", {"prompt": "hi", "max_tokens": 4, "stream": True}
    )
    assert status == 502
    err = json.loads(body)["error"]
    assert err["side"] == "prefill"
    status, _ = request(rig["proxy"] + "/health")
    assert status == 503
