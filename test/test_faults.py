"""Faults under load through real servers (CPU, the slot census after every step): concurrent
multi-turn chains in a small KV pool, with cancelled connections (client timeouts and streams
closed after their first chunk) and racing ``DELETE /chain`` and ``/prune``.

Asserted: no 5xx, no dropped connection but the cancelled ones, a retry after a cancel never
meets a busy chain, ``/sparse/stats`` census samples taken while requests run are all clean, a
clean census after every turn, and the whole pool free once the chains are deleted.

``SGLANG_SPARSE_FAULT_SESSIONS`` / ``_TURNS`` scale the default run (8 x 4); the ``slow``
variants run 16 sessions x 6 turns.
"""

from __future__ import annotations

import os
import random
import threading
import time

import pytest
import requests

from conftest import start_server

POOL = 2048
COMMON = ["--max-total-tokens", str(POOL), "--chunked-prefill-size", "256", "--log-level", "warning"]
SNAPKV = [*COMMON, "--sparse-method", "snapkv", "--sparse-budget", "64", "--sparse-window", "8"]
DENSE = [*COMMON, "--chain-cache", "on"]
ENV = {"SGLANG_SPARSE_CHECK_INTEGRITY": "1"}
TURN_OK = {200, 404, 410}
CANCEL = 0.35  # share of turns whose client gives up  # 404: a racer deleted the chain; 410: cancelled or reclaimed


def words(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 30000) for _ in range(n)]


class Load:
    """Sessions that run turn after turn together (a barrier between turns), racers alongside."""

    def __init__(self, server, sessions: int, turns: int, seed: int, prune: bool) -> None:
        self.server, self.url = server, server.base_url
        self.sessions, self.turns, self.prune = sessions, turns, prune
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        self.codes: dict[str, dict[int, int]] = {}
        self.errors: list[str] = []
        self.cancelled = self.sent = 0
        self.census_samples = 0
        self.stop = threading.Event()

    # -- bookkeeping ---------------------------------------------------------------------------
    def count(self, what: str, code: int) -> None:
        with self.lock:
            self.codes.setdefault(what, {})
            self.codes[what][code] = self.codes[what].get(code, 0) + 1
            if code >= 500:
                self.errors.append(f"{what} answered {code}")

    def fail(self, what: str) -> None:
        with self.lock:
            self.errors.append(what)

    # -- one request ---------------------------------------------------------------------------
    def generate(self, ids, chain_id, n, cancel: str | None):
        """Returns (status, body) or None when this call cancelled the request itself."""
        body = {"input_ids": ids, "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}}
        if chain_id is not None:
            body["chain_id"] = chain_id
        with self.lock:
            self.sent += 1
        try:
            if cancel == "stream":
                with requests.post(self.url + "/generate", json={**body, "stream": True}, stream=True,
                                   timeout=300) as resp:
                    if resp.status_code != 200:
                        return resp.status_code, resp.json()
                    next(resp.iter_lines())  # the first chunk, then the connection closes
                with self.lock:
                    self.cancelled += 1
                return None
            timeout = self.rng.uniform(0.3, 1.5) if cancel == "timeout" else 600
            resp = requests.post(self.url + "/generate", json=body, timeout=timeout)
            return resp.status_code, resp.json()
        except requests.exceptions.ReadTimeout:
            if cancel != "timeout":
                raise
            with self.lock:
                self.cancelled += 1
            return None

    # -- a session -----------------------------------------------------------------------------
    def session(self, s: int, barrier: threading.Barrier) -> None:
        rng = random.Random(1000 + s)
        context, chain_id = words(rng.randrange(120, 260), s), None
        try:
            for t in range(self.turns):
                cancel = rng.choice(["stream", "timeout"]) if rng.random() < CANCEL else None
                n = rng.randrange(8, 24)
                got = self.generate(context, chain_id, n, cancel)
                if got is None:  # cancelled: retry the turn on the same chain at once
                    got = self.generate(context, chain_id, n, None)
                    if got[0] == 409:
                        self.fail(f"session {s} turn {t}: a retry after a cancel met a busy chain: {got[1]}")
                code, body = got
                self.count("turn", code)
                if code in (404, 410):  # the chain is gone: start a new one over the whole context
                    code, body = self.generate(context, None, n, None)
                    self.count("turn-restart", code)
                if code != 200:
                    if code not in TURN_OK:
                        self.fail(f"session {s} turn {t}: {code} {body}")
                    chain_id = None
                else:
                    chain_id = body["meta_info"]["chain_id"]
                    context = context + body["output_ids"] + words(rng.randrange(30, 60), 100 * s + t)
                barrier.wait(timeout=900)
        except Exception as err:  # noqa: BLE001 - a dropped connection, a bad body
            self.fail(f"session {s}: {err!r}")
            barrier.abort()

    # -- racers --------------------------------------------------------------------------------
    def deleter(self) -> None:
        rng = random.Random(7)
        while not self.stop.wait(rng.uniform(0.3, 0.8)):
            try:
                chains = requests.get(self.url + "/chain", timeout=60).json()["chains"]
                idle = [c["chain_id"] for c in chains if c["status"] in ("idle", "active")]
                if idle:
                    r = requests.delete(f"{self.url}/chain/{rng.choice(idle)}", timeout=60)
                    self.count("delete", r.status_code)
            except Exception as err:  # noqa: BLE001
                self.fail(f"deleter: {err!r}")

    def pruner(self) -> None:
        rng = random.Random(8)
        while not self.stop.wait(rng.uniform(0.5, 1.0)):
            try:
                ids = words(rng.randrange(120, 260), rng.randrange(8))  # some session's first turn
                r = requests.post(self.url + "/prune", timeout=300, json={
                    "token_ids": ids, "ranges": [[16, 96]], "keep_ratio": 0.25, "wait": True})
                self.count("prune", r.status_code)
                if r.status_code == 200 and r.json()["status"] not in ("completed", "blocked", "failed"):
                    self.fail(f"prune record {r.json()}")
            except Exception as err:  # noqa: BLE001
                self.fail(f"pruner: {err!r}")

    def sampler(self) -> None:
        """The census while requests run: it must never report a lost or doubly owned slot."""
        while not self.stop.wait(0.25):
            try:
                integrity = requests.get(self.url + "/sparse/stats", timeout=60).json()["integrity"]
                with self.lock:
                    self.census_samples += 1
                if not integrity["ok"]:
                    self.fail(f"census under load: {integrity}")
            except Exception as err:  # noqa: BLE001
                self.fail(f"sampler: {err!r}")

    def run(self) -> None:
        turn_censuses = []
        barrier = threading.Barrier(self.sessions, action=lambda: turn_censuses.append(self.census()))
        racers = [threading.Thread(target=self.deleter), threading.Thread(target=self.sampler)]
        if self.prune:
            racers.append(threading.Thread(target=self.pruner))
        workers = [threading.Thread(target=self.session, args=(s, barrier)) for s in range(self.sessions)]
        for t in racers + workers:
            t.start()
        for t in workers:
            t.join()
        self.stop.set()
        for t in racers:
            t.join()
        self.turn_censuses = turn_censuses

    def census(self) -> dict:
        return requests.get(self.url + "/chain", timeout=60).json()["integrity"]


SESSIONS = int(os.environ.get("SGLANG_SPARSE_FAULT_SESSIONS", "8"))
TURNS = int(os.environ.get("SGLANG_SPARSE_FAULT_TURNS", "4"))


def run_faults(server, prune: bool, seed: int, sessions: int = SESSIONS, turns: int = TURNS):
    load = Load(server, sessions, turns, seed, prune)
    load.run()
    print(f"faults: {load.sent} requests, {load.cancelled} cancelled, codes {load.codes}, "
          f"{load.census_samples} census samples under load")
    assert not load.errors, load.errors[:10]
    assert len(load.turn_censuses) == turns and all(c["ok"] for c in load.turn_censuses), load.turn_censuses
    assert load.cancelled >= 0.2 * sessions * turns, (load.cancelled, sessions * turns)
    assert load.census_samples > 0
    # the end: delete every chain (and flush the radix cache): the whole pool is free again
    for c in requests.get(server.base_url + "/chain", timeout=60).json()["chains"]:
        requests.delete(f"{server.base_url}/chain/{c['chain_id']}", timeout=60)
    assert requests.post(server.base_url + "/flush_cache", timeout=60).status_code == 200
    s = requests.get(server.base_url + "/sparse/stats", timeout=60).json()
    assert s["kv_free_slots"] == s["kv_total_slots"] == POOL, s
    assert s["integrity"]["ok"] and s["counters"]["integrity_violations"] == 0, s
    return load


@pytest.fixture(scope="module")
def snapkv_server(request, default_model_dir):
    return start_server(SNAPKV, request, env=ENV)


@pytest.fixture(scope="module")
def dense_server(request, default_model_dir):
    return start_server(DENSE, request, env=ENV)


def test_snapkv_chains_under_cancels_and_deletes(snapkv_server):
    load = run_faults(snapkv_server, prune=False, seed=1)
    assert load.codes["delete"].get(200, 0) > 0  # the racer really deleted chains under the sessions


def test_dense_pinned_chains_under_cancels_deletes_and_prunes(dense_server):
    load = run_faults(dense_server, prune=True, seed=2)
    assert sum(load.codes.get("prune", {}).values()) > 0


@pytest.mark.slow
def test_snapkv_chains_under_faults_long(snapkv_server):
    run_faults(snapkv_server, prune=False, seed=3, sessions=16, turns=6)


@pytest.mark.slow
def test_dense_chains_under_faults_long(dense_server):
    run_faults(dense_server, prune=True, seed=4, sessions=16, turns=6)
