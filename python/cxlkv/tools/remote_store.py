"""A real Redis (or Valkey) server for `cxlkv bench pods` and its test: started on a free port
in its own process group, killed and restarted on the same port mid-run, and read through its own
protocol (RESP): version, key count, keyspace hits. Nothing is persisted (no RDB, no AOF): a
restart comes back empty, as a remote that lost its memory would."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time

from cxlkv.errors import CommandError
from cxlkv.tools.serve_fleet import free_port, log_tail, own_group_dies_with_us, signal_group

__all__ = ["RedisServer", "find_server"]

START_TIMEOUT_S = 30


def find_server() -> str:
    """The path of `valkey-server` or `redis-server`; CommandError when neither is installed."""
    for name in ("valkey-server", "redis-server"):
        path = shutil.which(name)
        if path:
            return path
    raise CommandError(
        "no valkey-server or redis-server on PATH (Debian/Ubuntu: apt-get install -y redis-server)"
    )


class RedisServer:
    """One server process; `start`/`kill`/`stop` may be called in any order, `stop` any number of
    times (it is also the context manager's exit)."""

    def __init__(self, logdir: str, port: int | None = None) -> None:
        self.binary = find_server()
        self.port = port or free_port()
        self.log = os.path.join(logdir, f"redis-{self.port}.log")
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> RedisServer:
        argv = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--protected-mode", "no", "--daemonize", "no",
                "--dir", os.path.dirname(self.log)]  # fmt: skip
        with open(self.log, "a") as f:
            self.proc = subprocess.Popen(
                argv, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                preexec_fn=own_group_dies_with_us,
            )  # fmt: skip
        self.starts += 1
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                if self.command("PING") == "PONG":
                    return self
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise CommandError(f"{self.binary} did not start on port {self.port}:\n{log_tail(self.log)}")
            time.sleep(0.1)

    def kill(self) -> None:
        """SIGKILL: the server dies as a crashed remote would (no shutdown, no save)."""
        if self.proc is not None:
            signal_group(self.proc, signal.SIGKILL)
            self.proc.wait(10)
            self.proc = None

    def stop(self) -> None:
        if self.proc is not None:
            signal_group(self.proc, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                pass
            self.kill()

    # ------------------------------------------------------------------ what the remote says
    def command(self, *args: str) -> str | int:
        """One RESP command; a simple string, bulk string or integer reply."""
        payload = f"*{len(args)}\r\n" + "".join(f"${len(a.encode())}\r\n{a}\r\n" for a in args)
        with socket.create_connection(("127.0.0.1", self.port), timeout=5) as s:
            s.sendall(payload.encode())
            f = s.makefile("rb")
            head = f.readline().decode().rstrip("\r\n")
            kind, rest = head[:1], head[1:]
            if kind == "+":
                return rest
            if kind == ":":
                return int(rest)
            if kind == "$":
                n = int(rest)
                return "" if n < 0 else f.read(n + 2)[:n].decode(errors="replace")
            raise OSError(f"remote replied {head!r} to {args[0]}")

    def info(self, section: str = "default") -> dict[str, str]:
        out: dict[str, str] = {}
        for line in str(self.command("INFO", section)).splitlines():
            if ":" in line and not line.startswith("#"):
                k, v = line.split(":", 1)
                out[k] = v
        return out

    def calls(self, *commands: str) -> int:
        """How many times the server ran these commands (INFO commandstats). A client's reads
        of values are GETs; its lookups EXISTS, which count as keyspace hits too, so keyspace hits
        alone cannot tell a lookup from a load."""
        stats = self.info("commandstats")
        total = 0
        for c in commands:
            fields = dict(kv.split("=", 1) for kv in stats.get(f"cmdstat_{c}", "").split(",") if "=" in kv)
            total += int(fields.get("calls", 0))
        return total

    def snapshot(self) -> dict:
        """Key count, version, reads, writes and keyspace counters, read from the server itself."""
        info = self.info()
        return {
            "reads": self.calls("get", "mget", "getex", "getrange"),
            "writes": self.calls("set", "mset", "setex", "psetex"),
            "server": "valkey" if "valkey_version" in info else "redis",
            "version": info.get("valkey_version") or info.get("redis_version", "?"),
            "keys": int(self.command("DBSIZE")),
            "keyspace_hits": int(info.get("keyspace_hits", 0)),
            "keyspace_misses": int(info.get("keyspace_misses", 0)),
            "used_memory": int(info.get("used_memory", 0)),
        }
