"""ServerProcess: ports outside the ephemeral range, a new port when the chosen one is taken
before the server binds it (CI once lost a TP=2 server's port to its own gloo workers), and a
stop that leaves no process of the server's group behind."""

import socket
import time
from pathlib import Path

import pytest

from sglang_sparse import server_process as sp

HERE = Path(__file__).parent
ENV = {"PYTHONPATH": str(HERE)}


def test_free_port_is_outside_the_ephemeral_range():
    lo, hi = sp._ephemeral_range()
    for _ in range(20):
        port = sp.free_port()
        assert not lo <= port <= hi, (port, lo, hi)


def _taken_port():
    # Bound, not listening: connecting is refused at once, as before the holder listens.
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    return s


def test_a_port_taken_before_the_server_binds_it_is_replaced(monkeypatch):
    taken = _taken_port()
    picks = iter([taken.getsockname()[1]])
    real_free_port = sp.free_port
    monkeypatch.setattr(sp, "free_port", lambda: next(picks, None) or real_free_port())
    server = sp.ServerProcess([], module="stand_in_server", env=ENV)
    assert server.port == taken.getsockname()[1]
    try:
        # A first attempt that waited for health instead of reading the bind error from the log
        # would raise "not healthy" here.
        server.start(timeout=30)
        assert server.port != taken.getsockname()[1]
        assert str(server.port) in server.cmd
    finally:
        server.stop()
        taken.close()


def test_a_port_the_caller_chose_is_not_changed():
    taken = _taken_port()
    port = taken.getsockname()[1]
    server = sp.ServerProcess([], module="stand_in_server", env=ENV, port=port)
    try:
        with pytest.raises(sp.ServerStartError, match=f"port {port} already in use"):
            server.start(timeout=30)
    finally:
        server.stop()
        taken.close()


def test_stop_leaves_no_process_of_the_group():
    """A child that ignores SIGTERM (a scheduler in a long step) is gone when stop returns,
    without waiting out a grace period."""
    server = sp.ServerProcess(["--child"], module="stand_in_server", env=ENV).start(timeout=30)
    pgid = server.proc.pid
    for _ in range(100):  # the child is up
        if len(sp._group_members(pgid)) == 2:
            break
        time.sleep(0.05)
    assert len(sp._group_members(pgid)) == 2
    server.stop(timeout=20)
    assert sp._group_members(pgid) == []


def test_stop_after_the_launcher_crashed_kills_what_it_left():
    """A launcher that exited at start leaves its child; the finalizer's stop must still kill it
    (it used to return at once because the launcher itself was gone)."""
    server = sp.ServerProcess(["--crash"], module="stand_in_server", env=ENV)
    with pytest.raises(sp.ServerStartError, match="exited with code 3"):
        server.start(timeout=30)
    pgid = server.proc.pid
    assert sp._group_members(pgid), "the crashed launcher's child should still run"
    server.stop(timeout=20)
    assert sp._group_members(pgid) == []
