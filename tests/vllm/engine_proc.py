"""llm_driver.py as a process whose output a test reads while it runs: the engine tests that
steer an engine between rounds (start it, wait for a line, signal it, read its results)."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable

from conftest import HERE


class EngineProc:
    """One engine in its own session (its own process group: the frontend and vLLM's engine
    core), its output kept line by line in `lines`; every wait is bounded."""

    def __init__(self, spec: dict, env: dict) -> None:
        env = {**os.environ, **env}
        env.pop("PYTHONHASHSEED", None)  # keys must match across processes with default settings
        self.p = subprocess.Popen(
            [sys.executable, os.path.join(HERE, "llm_driver.py"), json.dumps(spec)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            start_new_session=True,
        )
        self.lines: list[str] = []
        self._q: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.p.stdout is not None
        for line in self.p.stdout:
            self.lines.append(line.rstrip("\n"))
            self._q.put(line.rstrip("\n"))
        self._q.put(None)  # end of output: the engine exited

    def tail(self, n: int = 60) -> str:
        return "\n".join(self.lines[-n:])

    def _next_line(self, match: Callable[[str], bool], what: str, timeout: float) -> str:
        """The next unread line that matches; AssertionError when the engine exits first or none
        comes within `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._q.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no {what} line in {timeout}s:\n{self.tail()}") from None
            if line is None:
                self._q.put(None)  # a later wait sees the end too, at once
                raise AssertionError(f"the engine exited (rc={self.p.wait()}) before {what}:\n{self.tail()}")
            if match(line):
                return line

    def wait_for(self, needle: str, bound_s: float = 300) -> str:
        """The next line that contains `needle`."""
        return self._next_line(lambda line: needle in line, repr(needle), bound_s)

    def expect(self, prefix: str, timeout: float = 300) -> str:
        """The next line that starts with `prefix`."""
        return self._next_line(lambda line: line.startswith(prefix), repr(prefix), timeout)

    def results(self, bound_s: float = 300) -> list[dict]:
        """Every RESULT record, once the engine has exited with 0."""
        try:
            self.p.wait(bound_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"engine still running after {bound_s} s:\n{self.tail()}") from None
        time.sleep(0.2)  # the reader thread drains the pipe
        out = [json.loads(line[7:]) for line in self.lines if line.startswith("RESULT ")]
        assert self.p.returncode == 0, self.tail()
        return out

    def kill(self) -> None:
        """kill -9 of the whole engine: the LLM frontend and its engine-core process (which holds
        the pool nodes and computes)."""
        try:
            os.killpg(self.p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.p.wait(60)
