"""Observing a pool where operators look (issue 17): `cxlkv exporter` scraped by a real Prometheus
server (Debian's `prometheus`; skipped, with the reason, only where the binary is missing) and
queried over its HTTP API; `cxlkv top --once` against a pool with live traffic, and `cxlkv top`
in a real terminal (a pty) that survives the pool being recreated and quits on `q`; the
operator-first `pool create` / `pool info`; the Grafana dashboard's every expression names a
series the exporter or the connector exports.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request

import pytest

import cxlkv
import cxlkv_testutil as tu
from conftest import KiB, MiB, small_layout

HERE = os.path.dirname(os.path.abspath(__file__))
DASHBOARD = os.path.join(HERE, "..", "..", "docs", "grafana", "cxlkv.json")
PROMETHEUS = shutil.which("prometheus")
WAIT_S = 60  # bound of every wait below (a loaded CI machine); none is a timing assertion


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cli(*args: str, **kw) -> subprocess.CompletedProcess:
    env = dict(os.environ, COLUMNS="200")
    return subprocess.run(
        [sys.executable, "-m", "cxlkv", *args], capture_output=True, text=True, timeout=60, env=env, **kw
    )


def http_get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


def wait_for(what: str, probe, procs=()):
    """probe() until it returns something truthy, at most WAIT_S; a dead helper fails at once."""
    deadline = time.monotonic() + WAIT_S
    last: object = None
    while time.monotonic() < deadline:
        for p in procs:
            if p.poll() is not None:
                out = p.stdout.read() if p.stdout else ""
                raise AssertionError(f"{what}: {p.args[:3]} exited {p.returncode}: {out[-2000:]}")
        try:
            last = probe()
            if last:
                return last
        except OSError as e:  # not listening yet
            last = e
        time.sleep(0.2)
    raise AssertionError(f"{what}: not within {WAIT_S} s (last: {last!r})")


def stop(*procs: subprocess.Popen) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=15)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def make_traffic(path: str, hits: int, misses: int) -> None:
    """A known mix on a fresh pool: `hits` blocks stored and read back, `misses` absent keys."""
    with cxlkv.Pool.create(path, 32 * MiB, chunk_size=MiB) as pool:
        ns = pool.namespace(small_layout())
        keys = [tu.make_key("obs", i) for i in range(hits)]
        for k in keys:
            assert ns.put(k, tu.key_payload(k, ns.block_bytes))
        assert all(ns.get_bytes(k) is not None for k in keys)
        assert all(ns.get_bytes(tu.make_key("absent", i)) is None for i in range(misses))


def exporter(path: str, port: int) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "cxlkv", "exporter", "--port", str(port), "--addr", "127.0.0.1", path],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def sample(text: str, name: str) -> float | None:
    """The value of an unlabelled series in Prometheus text format."""
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else None


# ---------------------------------------------------------------------------------------------
# exporter


def test_exporter_survives_absent_and_recreated_pool(pool_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}/metrics"
    ex = exporter(pool_path, port)
    try:
        text = wait_for("exporter up", lambda: http_get(url), [ex])
        assert sample(text, "cxlkv_up") == 0.0  # no pool yet: down, and says why
        assert "cxlkv_scrape_error_info" in text and "does not exist" in text
        make_traffic(pool_path, hits=3, misses=1)
        text = http_get(url)
        assert sample(text, "cxlkv_up") == 1.0
        assert (sample(text, "cxlkv_hits_total"), sample(text, "cxlkv_misses_total")) == (3.0, 1.0)
        first = re.search(r'cxlkv_pool_info\{.*uuid="([^"]+)"', text).group(1)
        cxlkv.Pool.destroy(pool_path)
        make_traffic(pool_path, hits=1, misses=0)  # recreated under the running exporter
        text = http_get(url)
        assert sample(text, "cxlkv_hits_total") == 1.0
        assert re.search(r'cxlkv_pool_info\{.*uuid="([^"]+)"', text).group(1) != first
        with open(pool_path, "r+b") as f:  # a pool file that is not a pool (yet): down, serving
            f.write(b"garbage!" * 8)
        assert sample(http_get(url), "cxlkv_up") == 0.0
        assert ex.poll() is None
    finally:
        stop(ex)


def test_exporter_use_per_namespace_and_device(pool_path):
    """Two namespaces with known contents: each one's blocks, bytes and chunks, and the device's."""
    from prometheus_client import generate_latest

    from cxlkv.services.exporter import make_registry

    with cxlkv.Pool.create(pool_path, 32 * MiB, chunk_size=MiB) as pool:
        a = pool.namespace(small_layout(model_id="a"))
        b = pool.namespace(small_layout(model_id="b", block_bytes=8192))
        for ns, n in ((a, 5), (b, 3)):
            for i in range(n):
                k = tu.make_key(ns.name, i)
                assert ns.put(k, tu.key_payload(k, ns.block_bytes))
        text = generate_latest(make_registry(pool_path)).decode()

    def per_ns(series: str) -> dict[str, float]:
        return {
            m[0]: float(m[1]) for m in re.findall(rf'^{series}{{namespace="([^"]+)"}} (\S+)$', text, re.M)
        }

    assert per_ns("cxlkv_namespace_used_blocks") == {"a": 5.0, "b": 3.0}
    assert per_ns("cxlkv_namespace_used_bytes") == {"a": 5 * 4096.0, "b": 3 * 8192.0}
    assert per_ns("cxlkv_namespace_chunks") == {"a": 1.0, "b": 1.0}
    cap = per_ns("cxlkv_namespace_capacity_bytes")
    assert 0 < cap["a"] <= MiB and 0 < cap["b"] <= MiB
    device_used = float(re.search(r"^cxlkv_device_used_bytes\{[^}]*\} (\S+)$", text, re.M).group(1))
    assert device_used == 5 * 4096 + 3 * 8192  # the blocks' strides (cache-line multiples here)


@pytest.mark.skipif(
    PROMETHEUS is None, reason="the prometheus binary is missing (Debian: apt-get install prometheus)"
)
def test_prometheus_scrapes_the_exporter_and_computes_the_hit_ratio(pool_path, tmp_path):
    make_traffic(pool_path, hits=6, misses=2)  # hit ratio 0.75
    ex_port, prom_port = free_port(), free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        "scrape_configs:\n  - job_name: cxlkv\n"
        f"    static_configs:\n      - targets: ['127.0.0.1:{ex_port}']\n"
    )
    ex = exporter(pool_path, ex_port)
    prom = subprocess.Popen(
        [
            PROMETHEUS,
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{prom_port}",
            "--log.level=warn",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    api = f"http://127.0.0.1:{prom_port}/api/v1/query?query="

    def query(expr: str):
        body = json.loads(http_get(api + urllib.parse.quote(expr)))
        assert body["status"] == "success", body
        return body["data"]["result"]

    try:
        ratio = wait_for(
            "a scrape with the hit ratio",
            lambda: query("sum(cxlkv_hits_total) / (sum(cxlkv_hits_total) + sum(cxlkv_misses_total))"),
            [ex, prom],
        )
        assert float(ratio[0]["value"][1]) == pytest.approx(0.75)
        [up] = query('up{job="cxlkv"}')
        assert up["value"][1] == "1"
        [ns] = query("cxlkv_namespace_info")
        assert ns["metric"]["namespace"] == small_layout().default_name()
        # Every expression of the Grafana board parses and evaluates in this Prometheus.
        with open(DASHBOARD) as f:
            board = json.load(f)
        for p in board["panels"]:
            for t in p.get("targets", []):
                query(t["expr"].replace("$__rate_interval", "1m"))
    finally:
        stop(prom, ex)


OLD_CLIENT = "0.24.1"  # LMCache's pin


def test_exporter_with_prometheus_client_0_24_1(pool_path, tmp_path):
    """The exporter on LMCache's pinned prometheus_client (a --target install beside the newest
    in the venv), where pip can fetch it; skipped with the reason where it cannot."""
    target = tmp_path / "old"
    r = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(target),
         f"prometheus_client=={OLD_CLIENT}"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    if r.returncode != 0:
        pytest.skip(f"pip could not install prometheus_client {OLD_CLIENT}: {r.stderr.strip()[-200:]}")
    make_traffic(pool_path, hits=2, misses=2)
    code = (
        "import prometheus_client, sys; from cxlkv.services.exporter import make_registry; "
        f"assert prometheus_client.__file__.startswith({str(target)!r}), prometheus_client.__file__; "
        f"sys.stdout.write(prometheus_client.generate_latest(make_registry({pool_path!r})).decode())"
    )
    # the old client first, then whatever cxlkv this run tests (a checkout's python/ or the venv's)
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(target), os.environ.get("PYTHONPATH")]))
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 0, r.stderr
    assert sample(r.stdout, "cxlkv_up") == 1.0 and sample(r.stdout, "cxlkv_hits_total") == 2.0


# ---------------------------------------------------------------------------------------------
# top

TRAFFIC = """
import sys, time, cxlkv
sys.path.insert(0, {here!r})
import cxlkv_testutil as tu
from conftest import small_layout
pool = cxlkv.Pool.open({path!r})
ns = pool.namespace(small_layout())
print("ready", flush=True)
i = 0
while True:  # until killed: a store, a hit and a miss per round
    k = tu.make_key("live", i)
    ns.put(k, tu.key_payload(k, ns.block_bytes))
    ns.get_bytes(k)
    ns.get_bytes(tu.make_key("nothing", i))
    i += 1
    time.sleep(0.001)
"""


def traffic(path: str) -> subprocess.Popen:
    p = subprocess.Popen(
        [sys.executable, "-c", TRAFFIC.format(here=HERE, path=path)], stdout=subprocess.PIPE, text=True
    )
    assert p.stdout.readline().strip() == "ready"
    return p


def test_top_once_against_a_live_pool(pool_path):
    with cxlkv.Pool.create(pool_path, 32 * MiB, chunk_size=MiB):
        pass
    t = traffic(pool_path)
    try:
        r = cli("top", "--once", "--interval", "0.5", pool_path)
    finally:
        stop(t)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert small_layout().default_name() in out  # namespaces
    assert re.search(rf"\b{t.pid}\b.*alive.*lock", out), out  # the traffic process's node and verdict
    # The traffic row: hit rate of the interval (one hit per miss: 50 %), then hits/s, misses/s,
    # puts/s all positive.
    row = re.search(r"^\s*(\d+\.\d)%\s+([\d,]+)\s+([\d,]+)\s+([\d,]+)\s", out, re.M)
    assert row, out
    assert 30.0 <= float(row.group(1)) <= 70.0, out
    assert all(int(row.group(i).replace(",", "")) > 0 for i in (2, 3, 4)), out


def test_top_once_on_a_missing_pool_says_why(pool_path):
    r = cli("top", "--once", "--interval", "0.1", pool_path)
    assert r.returncode == 2 and "pool not readable" in r.stdout and "does not exist" in r.stdout


def test_top_live_survives_recreate_and_quits_on_q(pool_path):
    import pty

    with cxlkv.Pool.create(pool_path, 32 * MiB, chunk_size=MiB):
        pass
    pid, fd = pty.fork()
    if pid == 0:  # the child: cxlkv top on a real terminal
        os.environ["COLUMNS"] = "160"
        os.execv(sys.executable, [sys.executable, "-m", "cxlkv", "top", "--interval", "0.2", pool_path])
    seen = bytearray()

    def read_until(needle: bytes) -> bool:
        import select

        while select.select([fd], [], [], 0.2)[0]:
            try:
                seen.extend(os.read(fd, 65536))
            except OSError:
                break
        return needle in seen

    try:
        wait_for("top's first frame", lambda: read_until(b"q quits"))
        cxlkv.Pool.destroy(pool_path)
        wait_for("top showing the pool gone", lambda: read_until(b"pool not readable"))
        make_traffic(pool_path, hits=1, misses=0)
        del seen[:]
        wait_for("top showing the new pool", lambda: read_until(small_layout().default_name().encode()))
        os.write(fd, b"q")
        _, status = wait_for(
            "top to exit on q", lambda: (lambda w: w if w[0] else None)(os.waitpid(pid, os.WNOHANG))
        )
        assert os.waitstatus_to_exitcode(status) == 0, seen[-2000:]
    finally:
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
        os.close(fd)


# ---------------------------------------------------------------------------------------------
# pool create / pool info: the operator's questions first, internals with --verbose

INTERNALS = ("node_table_off", "file_ino", "header_checksum_off", "arena_off")


def test_pool_create_and_info_lead_with_what_operators_ask(pool_path):
    r = cli("pool", "create", pool_path, "--size", "32MiB", "--chunk-size", "1MiB")
    assert r.returncode == 0, r.stderr
    assert "capacity" in r.stdout and "backend coherent" in r.stdout and "--kv-transfer-config" in r.stdout
    assert not any(k in r.stdout for k in INTERNALS), r.stdout
    assert all(
        k in cli("pool", "create", pool_path, "--size", "32MiB", "--force", "--verbose").stdout
        for k in INTERNALS
    )
    make_traffic_on = cxlkv.Pool.open(pool_path)
    try:
        ns = make_traffic_on.namespace(small_layout(source="weights sha256 of 2 files"))
        k = tu.make_key("info")
        ns.put(k, tu.key_payload(k, ns.block_bytes))
        ns.get_bytes(k)
        out = cli("pool", "info", pool_path).stdout
        lines = out.splitlines()
        first = {
            w: next(i for i, line in enumerate(lines) if line.lstrip().startswith(w))
            for w in ("capacity", "use", "namespaces", "nodes")
        }
        assert list(first) == sorted(first, key=first.get), out  # capacity, use, namespaces, nodes
        assert "hit rate 100.0%" in out and "weights sha256 of 2 files" in out
        assert re.search(r"alive\s+│\s+self|alive.*lock", out), out  # the node and its verdict
        assert not any(k in out for k in INTERNALS), out
        verbose = cli("pool", "info", "--verbose", pool_path).stdout
        assert all(k in verbose for k in INTERNALS), verbose
        info = json.loads(cli("pool", "info", "--json", pool_path).stdout)  # --json: every field, unchanged
        assert all(k in info for k in INTERNALS) and {"devices", "namespaces", "nodes"} <= set(info)
    finally:
        make_traffic_on.close()


# ---------------------------------------------------------------------------------------------
# the Grafana dashboard


def _exported_text(pool_path: str) -> str:
    """Every series name the exporter serves for a pool with traffic, and every one the
    connector registers through vLLM's hook (on a registry of its own)."""
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

    from cxlkv.services.exporter import make_registry

    make_traffic(pool_path, hits=1, misses=1)
    text = generate_latest(make_registry(pool_path)).decode()
    try:
        from vllm.config import VllmConfig

        from cxlkv.integrations.vllm_metrics import CxlKVPromMetrics
    except ImportError:  # no vLLM: the connector's series cannot be checked here
        pytest.skip("vLLM is not importable: the connector's series are checked where it is")
    registry = CollectorRegistry()

    def bound(cls):  # vLLM passes the metric classes; these register on `registry`
        return type(
            cls.__name__,
            (cls,),
            {"__init__": lambda self, *a, **k: cls.__init__(self, *a, registry=registry, **k)},
        )

    types = {Counter: bound(Counter), Gauge: bound(Gauge), Histogram: bound(Histogram)}
    CxlKVPromMetrics(VllmConfig(), types, ["model_name", "engine"], {0: ["m", "0"]})
    return text + generate_latest(registry).decode()


def test_dashboard_names_only_exported_series(pool_path):
    with open(DASHBOARD) as f:
        board = json.load(f)
    exprs = [t["expr"] for p in board["panels"] for t in p.get("targets", []) if "expr" in t]
    assert len(exprs) >= 8, "the board lost its panels"
    text = _exported_text(pool_path)
    names = set(re.findall(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{| )", text, re.M))
    names |= {"vllm:external_prefix_cache_hits_total", "vllm:external_prefix_cache_queries_total"}  # vLLM's
    labels = set(re.findall(r"[{,]([a-zA-Z_]\w*)=", text)) | {"instance", "job"}  # + Prometheus's
    functions = {"sum", "rate", "increase", "clamp_min", "histogram_quantile"}
    for expr in exprs:
        grouped = re.findall(r"\b(?:by|on|group_left) \(([^)]*)\)", expr)
        used_labels = {w.strip() for g in grouped for w in g.split(",")}
        assert used_labels <= labels, f"{expr!r} groups by labels nobody sets: {sorted(used_labels - labels)}"
        stripped = re.sub(r"\b(?:by|on|group_left) \([^)]*\)|\{[^}]*\}|\[[^\]]*\]|\"[^\"]*\"", "", expr)
        used = set(re.findall(r"(?<![\w.])[a-zA-Z_:][a-zA-Z0-9_:]*", stripped)) - functions
        assert used, expr
        assert used <= names, f"{expr!r} names series nobody exports: {sorted(used - names)}"
    rows = [p["title"] for p in board["panels"] if p.get("type") == "row"]
    assert len(rows) == 2 and all("cxlkv" in r for r in rows), rows


def test_quotas_are_shown_by_info_top_and_the_exporter(make_pool, pool_path):
    pytest.importorskip("prometheus_client")
    from rich.console import Console

    from cxlkv.services import exporter, top

    pool = make_pool()
    ns = pool.namespace(small_layout(), tenant="team-a")  # quotas: docs/ARCHITECTURE.md, test_quota.py
    pool.set_quota(tenant="team-a", max_bytes=MiB)
    assert ns.put(tu.make_key("shown"), b"s" * 4096)
    families = {f.name: f for f in exporter.PoolCollector(pool_path).collect()}
    (used,) = [x for x in families["cxlkv_quota_used_bytes"].samples if x.labels["subject"] == "team-a"]
    assert used.value == 4 * KiB and used.labels["kind"] == "tenant"
    assert families["cxlkv_quota_limit_bytes"].samples[0].value == MiB
    con = Console(record=True, width=160)
    top.once(pool_path, con, interval=0.05)
    text = con.export_text()
    assert "quotas" in text and "team-a" in text and "4.0 KiB / 1.0 MiB" in text
    info = subprocess.run(
        [sys.executable, "-m", "cxlkv", "pool", "info", pool_path, "--json"], capture_output=True, text=True
    )
    assert info.returncode == 0, info.stderr
    (q,) = json.loads(info.stdout)["quotas"]
    assert q["tenant"] == "team-a" and q["usage_bytes"] == 4 * KiB
