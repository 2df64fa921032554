"""Start, wait for and stop an HTTP server process (used by tests and benchmarks).

The server's stdout+stderr go to a log file. If the server exits or does not become healthy in
time, ``ServerStartError`` carries the tail of that log, so the caller sees the server's own
traceback instead of a bare "connection refused". Engine-agnostic: only subprocess and HTTP.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests

LOG_TAIL_CHARS = 12000


class ServerStartError(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """``python -m <module> <args> --host 127.0.0.1 --port P`` in its own process group."""

    def __init__(
        self,
        args: list[str],
        module: str = "sglang_sparse.launch_server",
        env: dict[str, str] | None = None,
        log_path: str | Path | None = None,
        port: int | None = None,
        start_timeout: float = 300.0,
    ) -> None:
        self.start_timeout = start_timeout  # what ``with ServerProcess(...)`` waits for health
        self.port = port or free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.cmd = [sys.executable, "-m", module, *args, "--host", "127.0.0.1", "--port", str(self.port)]
        self.env = {**os.environ, **(env or {})}
        if log_path is None:
            fd, log_path = tempfile.mkstemp(prefix="sglang_sparse_server_", suffix=".log")
            os.close(fd)
        self.log_path = Path(log_path)
        self.proc: subprocess.Popen | None = None

    def log_tail(self, chars: int = LOG_TAIL_CHARS) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no server log)"
        return text[-chars:]

    def start(self, timeout: float | None = None) -> "ServerProcess":
        timeout = self.start_timeout if timeout is None else timeout
        log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            self.cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
        )
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerStartError(self._failure(f"server exited with code {self.proc.returncode}"))
            try:
                if requests.get(self.base_url + "/health_generate", timeout=30).status_code == 200:
                    return self
            except requests.RequestException:
                pass
            time.sleep(1.0)
        self.stop()
        raise ServerStartError(self._failure(f"server not healthy after {timeout:.0f}s"))

    def _failure(self, what: str) -> str:
        return (
            f"{what}\ncommand: {' '.join(self.cmd)}\nlog: {self.log_path}\n"
            f"----- server log (tail) -----\n{self.log_tail()}"
        )

    def stop(self, timeout: float = 30.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        # The launcher kills its scheduler and detokenizer on SIGTERM; the group kill is a backstop.
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(timeout=timeout)
                return
            except subprocess.TimeoutExpired:
                continue

    def __enter__(self) -> "ServerProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
