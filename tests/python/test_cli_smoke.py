"""Smoke tests of every ``cxlkv`` command: each one runs here at least once, as a real subprocess of
the installed ``cxlkv`` executable, with the tiniest parameters that still exercise its whole path
(workers spawned, pool created, bytes verified, output rendered). They check exit codes (0 ok,
1 inconsistency found by ``pool check``, 2 error) and that ``--json`` prints one object with the
keys its consumers read; never timings. The vLLM commands run only where vLLM is importable.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import struct
import subprocess
import sys
import uuid

import pytest

import cxlkv
import cxlkv_testutil as tu
from conftest import SHM_DIR, MiB, _remove

CXLKV = shutil.which("cxlkv", path=os.path.dirname(sys.executable))
HAVE_VLLM = importlib.util.find_spec("vllm") is not None
NO_VLLM = "vllm is not importable (install it with scripts/setup-vllm.sh)"
CLI_TIMEOUT_S = 120  # far above any command here: a hang fails the test instead of the run

pytestmark = pytest.mark.skipif(CXLKV is None, reason="the cxlkv executable is not installed")

# Keys that scripts and docs read from each --json output.
POOL_INFO_KEYS = {"pool_bytes", "chunk_bytes", "chunk_count", "index_slots", "max_nodes", "backend"}
CHECK_KEYS = {"ok", "errors"}
BENCH_COPY_KEYS = {
    "bench",
    "geometry",
    "store_gbps",
    "load_gbps",
    "memcpy_gbps",
    "memcpy_contig_gbps",
    "memcpy_mt_gbps",
    "store_vs_memcpy",
    "load_vs_memcpy",
    "copy_threads",
    "results",
    "machine",
    "notes",
}
BENCH_COPY_RESULT_KEYS = {
    "geometry",
    "blocks",
    "block_bytes",
    "batch_bytes",
    "iters",
    "verified",
    "store_gbps",
    "load_gbps",
    "memcpy_gbps",
}
BENCH_INDEX_KEYS = {
    "bench",
    "procs",
    "lookup_p50_ns",
    "lookup_p99_ns",
    "insert_p50_ns",
    "insert_p99_ns",
    "lookups_per_s",
    "lookups_per_s_1proc",
    "scaling",
    "batch_lookups_per_s",
    "keys",
    "block_bytes",
    "index_slots",
    "runs",
    "machine",
}
DEMO_KEYS = {
    "pool",
    "pool_size",
    "pool_existed",
    "procs",
    "seconds",
    "block_bytes",
    "hit_rate",
    "consumer_hit_rate",
    "requests",
    "blocks_requested",
    "blocks_hit",
    "blocks_stored",
    "blocks_loaded",
    "verify_errors",
    "processes",
    "pool_stats",
}


def cxlkv_cli(
    *args: str, timeout: int = CLI_TIMEOUT_S, pool_env: str | None = None
) -> subprocess.CompletedProcess:
    """Runs the installed ``cxlkv``; ``pool_env``: the value of $CXLKV_POOL (unset otherwise)."""
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", COLUMNS="120")
    env.pop("CXLKV_DEBUG", None)
    env.pop("CXLKV_POOL", None)
    if pool_env is not None:
        env["CXLKV_POOL"] = pool_env
    return subprocess.run(
        [CXLKV, *args], capture_output=True, text=True, timeout=timeout, env=env, check=False
    )


def ok(r: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert r.returncode == 0, f"exit {r.returncode}\nstdout:\n{r.stdout[-3000:]}\nstderr:\n{r.stderr[-3000:]}"
    assert "Traceback" not in r.stderr, r.stderr
    return r


def json_of(r: subprocess.CompletedProcess, keys: set[str]) -> dict:
    """stdout is exactly one JSON object holding ``keys``."""
    obj = json.loads(r.stdout)
    assert isinstance(obj, dict), r.stdout[:500]
    missing = keys - obj.keys()
    assert not missing, f"--json output lacks {sorted(missing)}; has {sorted(obj)}"
    return obj


@pytest.fixture
def scratch_pool_dir():
    """An empty directory under /dev/shm for the pools a benchmark creates and must remove."""
    d = os.path.join(SHM_DIR, f"cxlkv-test-{uuid.uuid4().hex}.d")
    os.mkdir(d)
    yield d
    _remove(d)


# ---------------------------------------------------------------------------------------------
# top level and pool


def test_version_and_help():
    assert ok(cxlkv_cli("--version")).stdout.startswith("cxlkv ")
    for argv in (
        [],
        ["pool"],
        ["bench"],
        ["demo"],
        ["pool", "create"],
        ["bench", "copy"],
        ["bench", "index"],
        ["bench", "vllm"],
        ["pool", "info"],
    ):
        r = ok(cxlkv_cli(*argv, "--help"))
        assert "usage: cxlkv" in r.stdout, argv
    r = cxlkv_cli()  # no command: usage error
    assert r.returncode == 2 and "error:" in r.stderr and "Traceback" not in r.stderr


def test_pool_lifecycle_text_and_json(pool_path):
    r = ok(
        cxlkv_cli(
            "pool",
            "create",
            pool_path,
            "--size",
            "16MiB",
            "--chunk-size",
            "1MiB",
            "--index-slots",
            "1024",
            "--max-nodes",
            "8",
            "--pin-slots",
            "16",
            "--json",
        )
    )
    info = json_of(r, POOL_INFO_KEYS)
    assert info["pool_bytes"] == 16 * MiB and info["chunk_bytes"] == MiB
    assert info["max_nodes"] == 8
    # a namespace with a block, so that info lists it and stats count something
    with cxlkv.Pool.open(pool_path) as pool:
        ns = pool.namespace(tu.shared_layout())
        k = tu.make_key("smoke")
        assert ns.put(k, tu.key_payload(k, ns.block_bytes))

    assert f"pool {pool_path}" in ok(cxlkv_cli("pool", "info", pool_path)).stdout
    info = json_of(ok(cxlkv_cli("pool", "info", pool_path, "--json")), POOL_INFO_KEYS | {"namespaces"})
    assert [n["model_id"] for n in info["namespaces"]] == [tu.SHARED_LAYOUT["model_id"]]

    assert f"stats {pool_path}" in ok(cxlkv_cli("pool", "stats", pool_path)).stdout
    stats = json.loads(ok(cxlkv_cli("pool", "stats", pool_path, "--json")).stdout)
    assert isinstance(stats, dict) and stats

    assert "pool is consistent" in ok(cxlkv_cli("pool", "check", pool_path)).stdout
    report = json_of(ok(cxlkv_cli("pool", "check", pool_path, "--json")), CHECK_KEYS)
    assert report["ok"] is True and report["errors"] == []

    # a namespace quota by the namespace's name, shown in text and JSON, then cleared
    name = info["namespaces"][0]["name"]
    set_ = json_of(
        ok(cxlkv_cli("pool", "quota", pool_path, "--namespace", name, "--max-fraction", "0.5", "--json")),
        {"quotas"},
    )
    (q,) = set_["quotas"]
    assert q["limit_bytes"] > 0 and q["usage_bytes"] >= 0, q
    assert "quotas" in ok(cxlkv_cli("pool", "quota", pool_path)).stdout
    cleared = json_of(
        ok(cxlkv_cli("pool", "quota", pool_path, "--namespace", name, "--clear", "--json")), {"quotas"}
    )
    assert cleared["quotas"][0]["limit_bytes"] == 0

    # create over an existing pool: an error without --force, a fresh pool with it
    r = cxlkv_cli("pool", "create", pool_path, "--size", "16MiB")
    assert r.returncode == 2 and r.stderr.startswith("cxlkv: error:"), r.stderr
    ok(
        cxlkv_cli(
            "pool",
            "create",
            pool_path,
            "--size",
            "8MiB",
            "--chunk-size",
            "1MiB",
            "--force",
            "--backend",
            "flush",
        )
    )
    info = json_of(ok(cxlkv_cli("pool", "info", pool_path, "--json")), POOL_INFO_KEYS)
    assert info["pool_bytes"] == 8 * MiB and info["namespaces"] == []

    assert "destroyed" in ok(cxlkv_cli("pool", "destroy", pool_path)).stdout
    assert not os.path.exists(pool_path)


def test_every_pool_command_and_the_demo_default_to_CXLKV_POOL(pool_path):
    """No PATH given: each command works on $CXLKV_POOL, the pool the library and the connector
    open (identified by its inode, so a default pool elsewhere on this machine cannot pass)."""
    info = json_of(
        ok(
            cxlkv_cli(
                "pool", "create", "--size", "16MiB", "--chunk-size", "1MiB", "--json", pool_env=pool_path
            )
        ),
        POOL_INFO_KEYS,
    )
    ino = os.stat(pool_path).st_ino
    assert info["path"] == pool_path and info["file_ino"] == ino
    assert (
        json_of(ok(cxlkv_cli("pool", "info", "--json", pool_env=pool_path)), POOL_INFO_KEYS)["file_ino"]
        == ino
    )
    stats = json.loads(ok(cxlkv_cli("pool", "stats", "--json", pool_env=pool_path)).stdout)
    assert stats["free_chunks"] == info["chunk_count"], (stats, info)  # this fresh pool's chunks
    assert json_of(ok(cxlkv_cli("pool", "check", "--json", pool_env=pool_path)), CHECK_KEYS)["ok"]
    assert pool_path in ok(cxlkv_cli("top", "--once", "--interval", "0.1", pool_env=pool_path)).stdout
    assert (
        json.loads(ok(cxlkv_cli("pool", "reap", "60", "--json", pool_env=pool_path)).stdout)["state"]
        == "free"
    )
    out = json_of(
        ok(cxlkv_cli("demo", "--procs", "1", "--seconds", "0.3", "--json", pool_env=pool_path)), DEMO_KEYS
    )
    assert out["pool"] == pool_path and out["pool_existed"] is True
    ok(cxlkv_cli("pool", "destroy", pool_env=pool_path))
    assert not os.path.exists(pool_path)


@pytest.mark.parametrize(
    "argv",
    [
        ["pool", "info", "{missing}"],
        ["pool", "stats", "{missing}", "--json"],
        ["pool", "check", "{missing}"],
        ["pool", "destroy", "{missing}"],
        ["pool", "create", "{missing}", "--size", "4XiB"],
        ["pool", "create", "{missing}", "--size", "1MiB", "--backend", "nonesuch"],
        ["bench", "index", "--procs", "0"],
        ["bench", "tp", "--heads", "3"],  # TP=2 cannot split 3 KV heads: refused before a pool exists
        ["demo", "--seconds", "-1"],
        ["exporter", "{missing}", "--port", "0"],
    ],
)
def test_errors_exit_2_with_one_line(argv, pool_path):
    r = cxlkv_cli(*[a.replace("{missing}", pool_path) for a in argv])
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr
    assert "error:" in r.stderr.strip().splitlines()[-1]
    assert not os.path.exists(pool_path)


def test_pool_check_exits_1_on_an_inconsistency(pool_path):
    with cxlkv.Pool.create(pool_path, 8 * MiB, chunk_size=1 * MiB) as pool:
        ns = pool.namespace(tu.shared_layout())
        k = tu.make_key("to-corrupt")
        assert ns.put(k, tu.key_payload(k, ns.block_bytes))
    h = tu.read_header(pool_path)
    with open(pool_path, "r+b") as f:  # point the entry's chunk past the arena
        for slot in range(h["index_slots"]):
            off = h["index_off"] + slot * tu.ENTRY_BYTES
            f.seek(off)
            if struct.unpack("<Q", f.read(8))[0] >> 56 == tu.ENTRY_READY:
                f.seek(off + tu.ENTRY_CHUNK_OFF)
                f.write(struct.pack("<I", h["chunk_count"] + 5))
                break
        else:
            pytest.fail("no READY index entry found")
    r = cxlkv_cli("pool", "check", pool_path)
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert "pool check failed" in r.stdout
    r = cxlkv_cli("pool", "check", pool_path, "--json")
    assert r.returncode == 1, (r.stdout, r.stderr)
    report = json_of(r, CHECK_KEYS)
    assert report["ok"] is False and report["errors"]


# ---------------------------------------------------------------------------------------------
# bench


def small_copy(pool_dir: str) -> list[str]:
    """``bench copy`` arguments for one small geometry: one iteration of 1 MiB batches."""
    return ["--geometry", "smollm2-135m", "--iters", "1", "--batch-size", "1MiB", "--pool-dir", pool_dir]


def test_bench_copy(scratch_pool_dir):
    # one geometry as JSON, both (the default "all") as tables; 1 MiB batches, one iteration
    r = ok(cxlkv_cli("bench", "copy", "--json", *small_copy(scratch_pool_dir), "--copy-threads", "1"))
    out = json_of(r, BENCH_COPY_KEYS)
    assert out["bench"] == "copy" and out["geometry"] == "smollm2-135m" and out["copy_threads"] == 1
    assert len(out["results"]) == 1
    res = out["results"][0]
    assert res.keys() >= BENCH_COPY_RESULT_KEYS, sorted(res)
    assert res["verified"] and res["blocks"] >= 1
    r = ok(cxlkv_cli("bench", "copy", "--iters", "1", "--batch-size", "1MiB", "--pool-dir", scratch_pool_dir))
    assert "llama3-8b" in r.stdout and "smollm2-135m" in r.stdout
    # --devices 2: the same geometry on a pool striped over two files, ratio to the single file
    r = ok(cxlkv_cli("bench", "copy", "--json", *small_copy(scratch_pool_dir), "--devices", "2"))
    striped = json_of(r, BENCH_COPY_KEYS)["results"][0]["striped"]
    assert striped["devices"] == 2 and striped["verified"] and striped["store_vs_single"] > 0
    assert os.listdir(scratch_pool_dir) == [], "bench copy left its pool behind"


def test_bench_index(scratch_pool_dir):
    # --ops 1000: one batch of the batched-lookup phase (fewer crash it, see below)
    small = [
        "--ops",
        "1000",
        "--keys",
        "200",
        "--samples",
        "50",
        "--inserts",
        "50",
        "--pool-dir",
        scratch_pool_dir,
    ]
    out = json_of(ok(cxlkv_cli("bench", "index", "--procs", "2", "--json", *small)), BENCH_INDEX_KEYS)
    assert out["bench"] == "index" and out["procs"] == 2 and out["keys"] == 200
    assert [run["procs"] for run in out["runs"]] == [1, 2]  # 1 always runs as the baseline
    r = ok(cxlkv_cli("bench", "index", "--procs", "1", *small))
    assert r.stdout.strip()
    assert os.listdir(scratch_pool_dir) == [], "bench index left its pool behind"


@pytest.mark.skipif(HAVE_VLLM, reason="vllm is importable: the commands run below instead")
@pytest.mark.parametrize(
    "argv",
    [
        ["bench", "vllm", "--model", "tiny", "--contexts", "1", "--turns", "1", "--json"],
        ["demo", "--vllm"],
        ["bench", "serve", "--model", "tiny", "--json"],
        ["bench", "pods", "--model", "tiny", "--prompts", "1", "--json"],
    ],
)
def test_vllm_commands_without_vllm_exit_2_with_the_reason(argv):
    """Not one engine start: the command says at once that it needs vLLM (exit 2, not 1)."""
    r = cxlkv_cli(*argv)
    assert r.returncode == 2, (r.returncode, r.stdout[-2000:], r.stderr[-2000:])
    assert r.stderr.startswith("cxlkv: error:") and "needs vLLM" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and r.stdout == "", (r.stdout, r.stderr)


@pytest.mark.parametrize(
    "bad, message",
    [
        (["--prompts", "0"], "--prompts"),
        (["--pool-size", "lots"], "--pool-size"),
        (["--words", "-3"], "--words"),
    ],
)
def test_bench_pods_arguments(bad, message):
    """`bench pods` starts four vLLM engines, an LMCache server per engine and a Redis server: a
    long benchmark, not run by the CLI smoke. CI runs its code in tests/vllm/test_pods.py (the same run on the tiny model);
    here only its arguments, which are refused before anything starts (exit 2, one line)."""
    r = cxlkv_cli("bench", "pods", *bad)
    assert r.returncode == 2, (r.returncode, r.stdout[-2000:], r.stderr[-2000:])
    assert message in r.stderr and r.stdout == "", r.stderr
    assert "--json" in ok(cxlkv_cli("bench", "pods", "--help")).stdout


def test_bench_index_fewer_ops_than_one_batch(scratch_pool_dir):
    r = cxlkv_cli(
        "bench",
        "index",
        "--procs",
        "1",
        "--json",
        "--ops",
        "200",
        "--keys",
        "200",
        "--samples",
        "50",
        "--inserts",
        "50",
        "--pool-dir",
        scratch_pool_dir,
    )
    assert "Traceback" not in r.stderr, r.stderr[-2000:]
    assert r.returncode in (0, 2), r.returncode


@pytest.mark.skipif(not HAVE_VLLM, reason=NO_VLLM)
@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_bench_vllm_tiny(tmp_path):
    """Six engine start-ups even with one one-turn conversation: minutes on 2 cores."""
    plot = str(tmp_path / "ttft.png") if importlib.util.find_spec("matplotlib") else None
    argv = [
        "bench",
        "vllm",
        "--model",
        "tiny",
        "--contexts",
        "1",
        "--turns",
        "1",
        "--turn-words",
        "20",
        "--json",
    ] + (["--plot", plot] if plot else [])
    out = json_of(
        ok(cxlkv_cli(*argv, timeout=1700)),
        {"model", "contexts", "turns", "ttft_s", "cxlkv2_cached_tokens", "per_request", "raw"},
    )
    assert set(out["ttft_s"]) == {"off", "local", "cxlkv-1", "cxlkv-2", "example-1", "example-2"}
    if plot:
        assert os.path.getsize(plot) > 0


@pytest.mark.skipif(not HAVE_VLLM, reason=NO_VLLM)
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_bench_serve_tiny():
    """`bench serve` (issue 16) on the tiny model: real vLLM OpenAI servers behind the router,
    vLLM's own benchmark client, `single` then `cxlkv` on two servers, one concurrency; three
    server start-ups. The --json contract (a list of rows), every request answered, the prefix
    reused, the cxlkv pair taking prefixes from the pool, and no server outliving the command."""

    def servers() -> set[int]:
        out = set()
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if b"vllm.entrypoints.openai.api_server" in f.read():
                        out.add(int(pid))
            except OSError:
                pass
        return out

    before = servers()
    r = ok(
        cxlkv_cli(
            "bench",
            "serve",
            "--model",
            "tiny",
            "--instances",
            "2",
            "--concurrency",
            "1",
            "--configs",
            "single,cxlkv",
            "--num-prompts",
            "8",
            "--num-prefixes",
            "2",
            "--prefix-len",
            "512",
            "--suffix-len",
            "32",
            "--output-len",
            "4",
            "--json",
            timeout=880,
        )
    )
    rows = json.loads(r.stdout)
    assert [(x["config"], x["concurrency"]) for x in rows] == [("single", 1), ("cxlkv", 1)]
    for x in rows:
        assert {"config", "concurrency", "hit_rate", "mean_ttft_ms", "p99_ttft_ms", "requests_per_s"} <= set(
            x
        )
        assert x["requests"] == 8 and x["failed"] == 0, x
        assert x["hit_rate"] > 0 and x["mean_ttft_ms"] > 0 and x["requests_per_s"] > 0
    single, cx = rows
    assert single["external_hit_rate"] == 0 and single["classes"]["tier"]["n"] == 0
    # two prefixes x four requests round robin over two servers: some first request of a prefix on
    # a server comes after the other server computed it
    assert cx["external_hit_tokens"] > 0 and cx["classes"]["tier"]["n"] > 0, cx
    assert servers() <= before, "a vLLM server outlived bench serve"


# ---------------------------------------------------------------------------------------------
# demo


def test_demo_json_then_text_on_the_same_pool(pool_path):
    r = ok(
        cxlkv_cli(
            "demo", "--procs", "2", "--seconds", "0.5", "--size", "32MiB", "--pool", pool_path, "--json"
        )
    )
    out = json_of(r, DEMO_KEYS)
    assert out["pool"] == pool_path and out["pool_existed"] is False and out["procs"] == 2
    assert out["pool_size"] == 32 * MiB
    assert [p["role"] for p in out["processes"]] == ["prefill", "consumer"]
    assert out["verify_errors"] == 0 and out["blocks_stored"] > 0
    # the pool stays in place; a second run reuses it and renders tables
    r = ok(cxlkv_cli("demo", "--procs", "1", "--seconds", "0.3", "--pool", pool_path))
    assert "existing pool" in r.stdout and "every loaded block matched" in r.stdout
    ok(cxlkv_cli("pool", "check", pool_path))


@pytest.mark.skipif(not HAVE_VLLM, reason=NO_VLLM)
@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_demo_vllm():
    """Three vLLM servers (SmolLM2) and a five-turn conversation; it has no smaller setting."""
    r = ok(cxlkv_cli("demo", "--vllm", timeout=1100))
    assert "server B's first turn" in r.stdout


def test_pool_ping_and_bench_rpc_smoke(pool_path, tmp_path):
    """The shared-memory RPC commands through the installed CLI: this test process is attached
    (its admin responder answers), and a tiny ``bench rpc`` prints every transport's keys."""
    with cxlkv.Pool.create(pool_path, 16 << 20) as pool:
        out = json_of(
            ok(cxlkv_cli("pool", "ping", str(pool.node_id), pool_path, "--count", "2", "--json")),
            {"node", "pid", "rtt_ns"},
        )
        assert out["node"] == pool.node_id and out["pid"] == os.getpid()
    small = ["--iterations", "20", "--warmup", "2", "--depth", "2", "--batches", "4", "--dir", str(tmp_path)]
    out = json_of(ok(cxlkv_cli("bench", "rpc", "--json", *small)), {"rpc_p50_ns", "tcp_p50_ns", "uds_p50_ns"})
    assert out["rpc_p50_ns"] > 0


def test_bench_copy_and_index_compare_backends(scratch_pool_dir):
    """``--compare-backends``: coherent then multihost in one run, each result whole, and the
    multihost / coherent ratio of the headline fields."""
    copy = small_copy(scratch_pool_dir)
    out = json_of(
        ok(cxlkv_cli("bench", "copy", "--compare-backends", "--json", *copy)),
        {"compare_backends", "multihost_vs_coherent", "coherent", "multihost"},
    )
    assert out["coherent"]["backend"] == "coherent" and out["multihost"]["backend"] == "multihost"
    assert set(out["multihost_vs_coherent"]) == {"store_gbps", "load_gbps"}
    r = out["multihost_vs_coherent"]["store_gbps"]
    assert r == round(out["multihost"]["store_gbps"] / out["coherent"]["store_gbps"], 3)
    index = ["--procs", "2", "--ops", "1000", "--keys", "100", "--samples", "100", "--inserts", "100"]
    out = json_of(
        ok(
            cxlkv_cli(
                "bench", "index", "--compare-backends", "--json", *index, "--pool-dir", scratch_pool_dir
            )
        ),
        {"multihost_vs_coherent", "coherent", "multihost"},
    )
    assert out["multihost"]["procs"] == 2 and "lookup_p50_ns" in out["multihost_vs_coherent"]
    r = ok(cxlkv_cli("bench", "index", "--backend", "multihost", "--procs", "1", *index[2:]))
    assert "lookups/s" in r.stdout
    assert os.listdir(scratch_pool_dir) == [], "a benchmark left its pool behind"


def test_bench_failover_smoke(scratch_pool_dir):
    """``bench failover``: two tiny leases, two kills each, through the installed CLI. The result
    names each lease beside its times (and their ratio), and the pools are removed after."""
    tiny = ["--lease-ms", "100,200", "--trials", "2", "--json", "--pool-dir", scratch_pool_dir]
    out = json_of(
        ok(cxlkv_cli("bench", "failover", *tiny)),
        {"bench", "leases", "seed", "percentile_method", "machine"},
    )
    assert [r["lease_ms"] for r in out["leases"]] == [100, 200]
    for r in out["leases"]:
        assert r["trials"] == 2 and len(r["samples_ms"]) == 2
        assert 0 < r["reclaimed_p50_ms"] <= r["reclaimed_max_ms"]
        # both are rounded from the same unrounded p50: they may differ in the last digit
        assert r["p50_over_lease"] == pytest.approx(r["reclaimed_p50_ms"] / r["lease_ms"], abs=0.0015)
    assert os.listdir(scratch_pool_dir) == [], "bench failover left its pools behind"


def test_sim_smoke():
    """``cxlkv sim``: a short clean run through the installed CLI (the proof itself, many seeds and
    every negative control, is tests/cpp/test_multihost.cpp and tests/python/test_sim.py)."""
    out = json_of(
        ok(cxlkv_cli("sim", "--hosts", "2", "--seconds", "2", "--lease-ms", "200", "--seed", "3", "--json")),
        {"ops", "verified_reads", "violations", "crashes", "pauses"},
    )
    assert out["violations"] == 0 and out["ops"] > 0


def test_bench_sparse_smoke(scratch_pool_dir):
    """`bench sparse` at a tiny geometry: the JSON fields the issue names, ratios measured in the
    same run, the pools it made removed; the table prints too."""
    tiny = ["--contexts", "1K,2K", "--topk", "64", "--layers", "2", "--steps", "2", "--hit-rates", "0.5,0.9"]
    tiny += ["--pool-dir", str(scratch_pool_dir)]
    out = json_of(
        ok(cxlkv_cli("bench", "sparse", "--json", *tiny)), {"results", "layers_measured", "model_layers"}
    )
    assert out["layers_measured"] == 2 and out["model_layers"] == 61
    assert len(out["results"]) == 4  # two formats x two contexts
    for x in out["results"]:
        assert {"context_tokens", "topk", "bytes_ratio", "latency_ratio", "gather_vs_memcpy"} <= set(x)
        assert x["gather_vs_private"] > 0 and x["gather_private_gbps"] > 0 and x["gather_call_s"] > 0
        assert x["bytes_ratio"] == x["context_tokens"] / 64
        assert len(x["hot_buffer"]) == 2 and all(0 <= h["hit_rate"] <= 1 for h in x["hot_buffer"])
    assert not os.listdir(scratch_pool_dir)
    assert "bytes ratio" in ok(cxlkv_cli("bench", "sparse", *tiny, "--formats", "bf16")).stdout


def test_bench_tp_smoke(scratch_pool_dir):
    """`bench tp` at a tiny geometry (a second at most): every load checked inside the run, the
    ratios against the same-run whole-block baseline in the JSON and the table, its pool removed.
    tests/python/test_heads.py covers what it measures."""
    tiny = ["--layers", "2", "--heads", "4", "--head-size", "8", "--blocks", "8", "--iters", "1"]
    tiny += ["--pool-dir", str(scratch_pool_dir)]
    out = json_of(
        ok(cxlkv_cli("bench", "tp", "--json", *tiny)),
        {"bench", "ratio_tp2_from_tp1_vs_same_tp", "ratio_tp1_heads_vs_whole", "load"},
    )
    assert out["bench"] == "tp" and out["blocks"] == 8 and out["geometry"]["kv_heads"] == 4
    assert out["ratio_tp2_from_tp1_vs_same_tp"] > 0 and out["tp2_rank_from_tp1_heads"]["GBps"] > 0
    assert not os.listdir(scratch_pool_dir)
    text = ok(cxlkv_cli("bench", "tp", *tiny)).stdout
    assert "TP=2 rank from TP=1" in text and "ratio" in text


def test_bench_tp_state_smoke(scratch_pool_dir):
    """`bench tp --state` (SSM states: per-key-head unit entries vs one whole-state entry) at a tiny
    geometry: both loads checked byte for byte inside the run, its pool removed."""
    tiny = ["--state", "--layers", "1", "--heads", "2", "--blocks", "2", "--iters", "1"]
    tiny += ["--pool-dir", str(scratch_pool_dir)]
    out = json_of(
        ok(cxlkv_cli("bench", "tp", "--json", *tiny)),
        {"bench", "ratio_tp2_from_tp1_vs_same_tp", "ratio_tp1_units_vs_whole", "load"},
    )
    assert out["bench"] == "tp-state" and out["geometry"]["key_heads"] == 2
    assert out["tp2_rank_from_tp1_units"]["bytes"] * 2 == out["tp1_from_units"]["bytes"]
    assert not os.listdir(scratch_pool_dir)
    assert "TP=2 rank from TP=1 unit entries" in ok(cxlkv_cli("bench", "tp", *tiny)).stdout


def test_roi_smoke():
    """The cost model through the installed CLI: the paper's example, one JSON object."""
    r = ok(
        cxlkv_cli(
            "roi", "--gpu-tflops", "100", "--prefill-tflop", "25", "--new-prompt-ratio", "0.1",
            "--slo-s", "0.4", "--load-s", "0.1", "--multi-round-ratio", "1", "--rps", "120", "--json",
        )
    )  # fmt: skip
    out = json.loads(r.stdout)
    assert (out["gpus_baseline"], out["gpus_pool"]) == (75, 10)


def test_events_and_query_smoke(pool_path):
    """Both router commands on a pool with one empty KV namespace (tests/python/test_events.py
    covers them on populated pools, with a real subscriber and HTTP client)."""
    with cxlkv.Pool.create(pool_path, 16 * MiB, chunk_size=1 * MiB) as pool:
        pool.namespace(
            cxlkv.KVLayout(model_id="smoke", num_layers=1, num_kv_heads=1, head_size=8), name="kv1-smoke"
        )
    argv = [
        "events",
        pool_path,
        "--endpoint",
        "tcp://127.0.0.1:0",
        "--replay-endpoint",
        "",
        "--duration",
        "0.3",
    ]
    assert json_of(ok(cxlkv_cli(*argv)), {"messages", "events"})["events"] == 0
    out = json_of(ok(cxlkv_cli("query", "--pool", pool_path, "--json", "1", "2", "3")), {"matched_tokens"})
    assert out["matched_tokens"] == 0 and out["namespace"] == "kv1-smoke"
