"""Start, wait for and stop an HTTP server process (used by tests and benchmarks).

The server's stdout+stderr go to a log file. If the server exits or does not become healthy in
time, ``ServerStartError`` carries the tail of that log, so the caller sees the server's own
traceback instead of a bare "connection refused". Engine-agnostic: only subprocess and HTTP.
"""

from __future__ import annotations

import os
import random
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


# Ports a server listens on are drawn below the kernel's ephemeral range (32768+ by default) and
# below 22000-29999, where SGLang draws its own NCCL/TCPStore port. A port the kernel hands out
# for ``bind(0)`` is one that gloo (CPU tensor parallelism) and client sockets also get handed out
# while the server starts, so a server told to listen there can find the port taken by one of its
# own TP workers before uvicorn binds it (seen in CI: Errno 98 once the workers were up).
LISTEN_PORTS = (12000, 22000)
START_ATTEMPTS = 3


def _ephemeral_range() -> tuple[int, int]:
    try:
        lo, hi = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(lo), int(hi)
    except (OSError, ValueError):
        return 32768, 60999


def _available(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A free port outside the ephemeral range (falls back to one the kernel picks)."""
    lo_eph, hi_eph = _ephemeral_range()
    for _ in range(200):
        port = random.randrange(*LISTEN_PORTS)
        if not lo_eph <= port <= hi_eph and _available(port):
            return port
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
        self.fixed_port = port is not None  # a port the caller chose is never changed on retry
        self.module, self.args = module, list(args)
        self._use_port(port or free_port())
        self.env = {**os.environ, **(env or {})}
        if log_path is None:
            fd, log_path = tempfile.mkstemp(prefix="sglang_sparse_server_", suffix=".log")
            os.close(fd)
        self.log_path = Path(log_path)
        self.proc: subprocess.Popen | None = None
        self._stopped = False

    def _use_port(self, port: int) -> None:
        self.port = port
        self.base_url = f"http://127.0.0.1:{port}"
        self.cmd = [sys.executable, "-m", self.module, *self.args, "--host", "127.0.0.1", "--port", str(port)]

    def log_tail(self, chars: int = LOG_TAIL_CHARS) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no server log)"
        return text[-chars:]

    def start(self, timeout: float | None = None) -> "ServerProcess":
        """Start and wait for ``/health_generate``. If the port was taken between choosing it and
        the server binding it, start again on another port (unless the caller fixed the port)."""
        for attempt in range(START_ATTEMPTS):
            if attempt:
                self._use_port(free_port())
            if self._start_once(timeout):
                return self
            if self.fixed_port:
                break
        raise ServerStartError(self._failure(f"port {self.port} already in use"))

    def _bind_failed(self) -> bool:
        # uvicorn: "error while attempting to bind on address ('127.0.0.1', P): address already in use"
        return f"{self.port}): address already in use" in self.log_tail().lower()

    def _start_once(self, timeout: float | None) -> bool:
        """True when healthy, False when the port could not be bound; raises on other failures."""
        timeout = self.start_timeout if timeout is None else timeout
        log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            self.cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
        )
        log.close()
        self._stopped = False
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._bind_failed():
                # uvicorn logs the bind error and the scheduler lives on: stop it rather than wait
                # out the timeout (or ask whoever holds the port for our health).
                self.stop()
                return False
            if self.proc.poll() is not None:
                raise ServerStartError(self._failure(f"server exited with code {self.proc.returncode}"))
            try:
                if requests.get(self.base_url + "/health_generate", timeout=30).status_code == 200:
                    return True
            except requests.RequestException:
                pass
            time.sleep(0.25)
        self.stop()
        raise ServerStartError(self._failure(f"server not healthy after {timeout:.0f}s"))

    def _failure(self, what: str) -> str:
        return (
            f"{what}\ncommand: {' '.join(self.cmd)}\nlog: {self.log_path}\n"
            f"----- server log (tail) -----\n{self.log_tail()}"
        )

    def stop(self, timeout: float = 30.0, graceful: bool = False) -> None:
        """Kill the server's process group and wait until every process in it has exited (so its
        memory, GPU memory included, is free for the next server). ``graceful`` sends SIGTERM
        first, which lets SGLang drain: ~5 s on the CPU, so tests and benchmarks skip it."""
        if self.proc is None or self._stopped:
            return
        self._stopped = True  # once: the group id may be reused after its processes are gone
        pgid = self.proc.pid
        # A launcher that already exited may have left its scheduler behind: the group goes too.
        signals = (signal.SIGTERM, signal.SIGKILL) if graceful and self.proc.poll() is None else (signal.SIGKILL,)
        for sig in signals:
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(timeout=timeout)
                break
            except subprocess.TimeoutExpired:
                continue
        _wait_group_exit(pgid, timeout)

    def __enter__(self) -> "ServerProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes of process group ``pgid``, from /proc (empty elsewhere)."""
    live = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            # "pid (comm) state ppid pgrp ...": comm may hold spaces, so split after its ")"
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[2] == str(pgid) and fields[0] != "Z":
            live.append(int(stat.parent.name))
    return live


def _wait_group_exit(pgid: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while _group_members(pgid) and time.monotonic() < deadline:
        try:
            os.killpg(pgid, signal.SIGKILL)  # children the launcher started after the first kill
        except ProcessLookupError:
            return
        time.sleep(0.05)
