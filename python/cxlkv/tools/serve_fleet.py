"""The processes `cxlkv bench serve` starts — vLLM OpenAI servers, the router, LMCache's server —
and the guarantee that every one of them ends, whatever way the benchmark ends (an error,
Ctrl-C, SIGTERM): each is started in its own session, and `Fleet.stop` signals the whole
process group (a vLLM server's engine core is a child of its API server; SIGINT to a server that
is still starting does not stop it), then kills what is left. Should the benchmark itself be
killed with SIGKILL, each child gets SIGTERM from the kernel (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field

from cxlkv.errors import CommandError

__all__ = ["Fleet", "Server", "cpu_sets", "free_port"]

START_TIMEOUT_S = 600


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_sets(instances: int) -> tuple[list[str], str]:
    """(cores of each of N servers, cores of the `single` server) as VLLM_CPU_OMP_THREADS_BIND
    lists. Each server gets its own share of this process's cores; the union of those shares is
    what N servers use together. More servers
    than cores: server i shares core i mod cores."""
    cpus = sorted(os.sched_getaffinity(0))
    if instances <= len(cpus):
        per = len(cpus) // instances
        shares = [cpus[i * per : (i + 1) * per] for i in range(instances)]
    else:
        shares = [[cpus[i % len(cpus)]] for i in range(instances)]
    union = sorted({c for s in shares for c in s})
    return [",".join(map(str, s)) for s in shares], ",".join(map(str, union))


@dataclass
class Server:
    name: str
    url: str
    proc: subprocess.Popen
    log: str
    cores: str = ""
    extra: dict = field(default_factory=dict)


class Fleet:
    """Every process of one configuration; a context manager that stops them all on exit."""

    def __init__(self, logdir: str):
        self.logdir = logdir
        self.procs: list[tuple[str, subprocess.Popen]] = []

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def spawn(self, name: str, argv: list[str], env: dict | None = None) -> tuple[subprocess.Popen, str]:
        log = os.path.join(self.logdir, f"{name}.log")
        with open(log, "w") as f:
            p = subprocess.Popen(
                argv,
                stdout=f,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                preexec_fn=own_group_dies_with_us,
            )
        self.procs.append((name, p))
        return p, log

    def stop(self, grace_s: float = 20.0) -> None:
        """SIGTERM to every group, then SIGKILL to the groups still alive after grace_s."""
        for _, p in self.procs:
            signal_group(p, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for _, p in self.procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for _, p in self.procs:
            signal_group(p, signal.SIGKILL)  # the group, even when its leader is gone
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        self.procs.clear()

    def vllm_server(
        self, name: str, model: str, served: str, max_model_len: int, cores: str, kv: dict | None
    ) -> Server:
        port = free_port()
        argv = [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            model,
            "--served-model-name",
            served,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--enforce-eager",
            "--max-model-len",
            str(max_model_len),
            "--enable-prompt-tokens-details",  # per-request cached_tokens: the router records them
            "--seed",
            "0",
            "--disable-uvicorn-access-log",
        ]
        if kv is not None:
            argv += ["--kv-transfer-config", json.dumps(kv)]
        env = dict(
            os.environ,
            VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
            VLLM_CPU_NUM_OF_RESERVED_CPU="0",
            VLLM_CPU_OMP_THREADS_BIND=cores,
        )
        env.pop("PYTHONHASHSEED", None)  # cxlkv keys must match across processes
        p, log = self.spawn(name, argv, env)
        return Server(name, f"http://127.0.0.1:{port}", p, log, cores)

    def router(self, backends: list[str], mode: str) -> Server:
        port = free_port()
        argv = [sys.executable, "-m", "cxlkv.integrations.router", "--port", str(port), "--mode", mode]
        for b in backends:
            argv += ["--backend", b]
        p, log = self.spawn("router", argv)
        return Server("router", f"http://127.0.0.1:{port}", p, log)

    def lmcache_server(self, l1_gib: int) -> Server:
        port, http_port, prom_port = free_port(), free_port(), free_port()
        argv = [
            sys.executable,
            "-m",
            "lmcache.cli.main",
            "server",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--l1-size-gb",
            str(l1_gib),
            "--eviction-policy",  # without it: "Legacy L1 configuration requires ..."
            "LRU",
            "--chunk-size",
            "256",
            "--supported-transfer-mode",  # without it vLLM CPU's engine_driven mode hangs start-up
            "auto",
            "--http-port",
            str(http_port),
            "--prometheus-port",
            str(prom_port),
        ]
        p, log = self.spawn("lmcache-server", argv)
        return Server("lmcache-server", f"http://127.0.0.1:{http_port}", p, log, extra={"port": port})


def own_group_dies_with_us() -> None:
    """In the child before exec: its own session (stop() signals the group, which reaches a
    server's engine process too), and SIGTERM when the benchmark dies without stopping it
    (SIGKILL: no finally block runs)."""
    os.setsid()
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def signal_group(p: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(p.pid, sig)  # setsid: the group id is the leader's pid
    except (ProcessLookupError, PermissionError):
        pass


def log_tail(path: str, lines: int = 15) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return ""


def wait_ready(servers: list[Server], health: str = "/health", timeout_s: float = START_TIMEOUT_S) -> None:
    """Until every server answers 200 on `health`; a server that exits or is not up in time is a
    CommandError naming its log (and quoting its last lines)."""
    deadline = time.monotonic() + timeout_s
    pending = list(servers)
    while pending:
        for s in list(pending):
            if s.proc.poll() is not None:
                raise CommandError(
                    f"bench serve: {s.name} exited with {s.proc.returncode} while starting "
                    f"(log {s.log}):\n{log_tail(s.log)}"
                )
            try:
                with urllib.request.urlopen(s.url + health, timeout=2) as r:
                    if r.status == 200:
                        pending.remove(s)
            except OSError:
                pass
        if pending and time.monotonic() > deadline:
            raise CommandError(
                f"bench serve: {pending[0].name} not ready in {timeout_s:.0f} s (log {pending[0].log})"
            )
        if pending:
            time.sleep(0.5)


def wait_port(s: Server, port: int, timeout_s: float = 120) -> None:
    """Until TCP `port` accepts (LMCache's server has no health route we rely on)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if s.proc.poll() is not None:
            raise CommandError(
                f"bench serve: {s.name} exited with {s.proc.returncode} (log {s.log}):\n{log_tail(s.log)}"
            )
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            time.sleep(0.5)
    raise CommandError(f"bench serve: {s.name} not listening on {port} after {timeout_s:.0f} s (log {s.log})")
