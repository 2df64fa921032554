"""Agent replay over several schedulers: Chain Cache continuations that reach the chain's holder
(chain-aware routing) vs round-robin, over replicas behind ``sglang-router`` and over one server
with ``--dp-size``.

Variants (``--variants``):
- ``replicas+chain``: ``--replicas`` servers (``--chain-replica a``, ``b``, ...) behind
  ``python -m sglang_router.launch_router --policy manual``; every request of an agent session
  carries the header ``X-SMG-Routing-Key: session-<s>``: the router pins the key to one replica
  (the first turn placed by the router) and the replica continues the key's chain
  (``key-session-<s>``; sglang-router 0.3.2 forwards that header but drops ``custom_params``,
  so behind it the key, not a chain id, names the chain).
- ``replicas+round-robin``: the same servers and headers behind ``--policy round_robin``: a
  continuation lands wherever the counter points and finds its chain only if that is where the
  previous turn ran.
- ``dp+chain``: one server with ``--dp-size <replicas>``; continuations pass the previous turn's
  ``chain_id`` (``chain-r<k>-<n>``) and sglang_sparse routes each to rank k (``routed_dp_rank``).
- ``dp+round-robin``: the same server; the client pins request i to rank ``i % replicas``
  (``routed_dp_rank``), which overrides the chain routing the way a chain-blind balancer would.

Each session: a system prompt + task (``--system`` tokens), then ``--turns`` turns of an answer
(``--answer`` tokens, greedy, ignore_eos) and a tool result (``--tool-output`` tokens); every
continuation resends the whole conversation (token ids). A continuation that does not report
``chain_status: resumed`` is a miss (it prefilled its whole conversation); one that names a chain
the rank does not hold gets 404 with a sentence and is resent without ``chain_id``. A request
that fails in transport or with 5xx (a replica gone) is retried after a second, counted.
``--kill-after N`` kills the last replica (SIGKILL) once N requests finished (replica variants).

Reported per variant: continuations, resumed, missed, retried, failed requests, end-to-end wall
time, tokens prefilled (prompt - cached over all requests, resends included).

    python benchmark/bench_replicas.py                 # CPU, default model, 8 sessions x 4 turns, 2 replicas
    python benchmark/bench_replicas.py --variants replicas+chain --kill-after 12
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_json  # noqa: E402

from sglang_sparse.server_process import ServerProcess, free_port

VARIANTS = ["replicas+chain", "replicas+round-robin", "dp+chain", "dp+round-robin"]
ROUTING_HEADER = "X-SMG-Routing-Key"  # sglang-router's routing key for --policy manual
REPLICA_NAMES = "abcdefgh"


class Router:
    """``python -m sglang_router.launch_router`` over ``urls`` (its own process group)."""

    def __init__(self, urls: list[str], policy: str, log_path: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [sys.executable, "-m", "sglang_router.launch_router", "--worker-urls", *urls, "--policy", policy,
                    "--host", "127.0.0.1", "--port", str(self.port), "--log-level", "warn"]
        self.n, self.log_path, self.proc = len(urls), log_path, None

    def __enter__(self) -> "Router":
        self.proc = subprocess.Popen(self.cmd, stdout=open(self.log_path, "w"), stderr=subprocess.STDOUT,
                                     start_new_session=True)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # up once every worker is registered and healthy
            try:
                workers = requests.get(self.url + "/workers", timeout=2).json().get("workers") or []
                if sum(bool(w.get("is_healthy")) for w in workers) >= self.n:
                    return self
            except (requests.RequestException, ValueError):
                pass
            if self.proc.poll() is not None:
                break
            time.sleep(0.5)
        self.__exit__()
        raise RuntimeError(f"sglang-router did not register {self.n} workers; see {self.log_path}")

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=30)


def post(url: str, body: dict, headers: dict, counts: dict, lock: threading.Lock, tries: int = 4):
    """POST /generate; transport errors and 5xx (a replica gone) are retried, counted."""
    for attempt in range(tries):
        try:
            resp = requests.post(url + "/generate", json=body, headers=headers, timeout=600)
            if resp.status_code < 500:
                return resp.status_code, resp.json()
            why = f"{resp.status_code}: {resp.text[:200]}"
        except requests.RequestException as err:
            why = f"{type(err).__name__}"
        with lock:
            counts["retried"] += 1
            counts["retry_reasons"].append(why)
        time.sleep(1.0)
    return None, {"error": why}


def session(url: str, s: int, args, mode: str, counts: dict, lock: threading.Lock, ticket) -> None:
    """One agent session; ``mode``: ``header`` (routing key), ``pin`` (round-robin routed_dp_rank)
    or ``plain``."""
    rng = random.Random(1000 + s)
    ids = [rng.randrange(1000, 30000) for _ in range(args.system)]
    headers = {ROUTING_HEADER: f"session-{s}"} if mode == "header" else {}
    chain_id = None
    for turn in range(args.turns):
        sp = {"temperature": 0, "max_new_tokens": args.answer, "ignore_eos": True}
        resent = False
        while True:
            body = {"input_ids": ids, "sampling_params": dict(sp)}
            if chain_id is not None and not resent and mode != "header":  # header: the key names the chain
                body["sampling_params"]["custom_params"] = {"chain_id": chain_id}
            if mode == "pin":
                body["routed_dp_rank"] = next(ticket) % args.replicas
            status, out = post(url, body, headers, counts, lock)
            meta = out.get("meta_info") or {}
            with lock:
                counts["requests"] += 1
                if status == 200:
                    counts["prefilled"] += meta["prompt_tokens"] - meta.get("cached_tokens", 0)
                    counts["reused"] += meta.get("reused_tokens", 0)
                if turn > 0 and not resent:
                    counts["continuations"] += 1
                    resumed = meta.get("chain_status") == "resumed"
                    counts["resumed"] += resumed
                    counts["missed"] += not resumed
                    if not resumed and len(counts["miss_messages"]) < 3:
                        counts["miss_messages"].append(f"{status}: {meta.get('chain_status')} {meta.get('chain_id')} "
                                                       f"{(out.get('error') or {}).get('message') or out.get('message') or ''}")
                counts["done"] += 1
                done = counts["done"]
            if args.kill_after and done == args.kill_after and args.on_kill is not None:
                args.on_kill()
            if status == 200:
                break
            if chain_id is not None and not resent and status in (404, 410):
                resent = True  # the chain is elsewhere (or gone): the whole conversation again
                continue
            with lock:
                counts["failed"] += 1
                counts["fail_reasons"].append(str(out)[:200])
            return
        chain_id = meta.get("chain_id")
        ids = ids + out["output_ids"] + [rng.randrange(1000, 30000) for _ in range(args.tool_output)]
        time.sleep(args.tool_wait)


def replay(url: str, args, mode: str) -> dict:
    counts = {"requests": 0, "done": 0, "continuations": 0, "resumed": 0, "missed": 0, "retried": 0, "failed": 0,
              "prefilled": 0, "reused": 0, "miss_messages": [], "retry_reasons": [], "fail_reasons": []}
    lock, ticket = threading.Lock(), _Ticket()
    t0 = time.monotonic()
    threads = [threading.Thread(target=session, args=(url, s, args, mode, counts, lock, ticket))
               for s in range(args.sessions)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    counts["wall_s"] = round(time.monotonic() - t0, 2)
    return counts


class _Ticket:
    def __init__(self) -> None:
        self.n, self.lock = -1, threading.Lock()

    def __next__(self) -> int:
        with self.lock:
            self.n += 1
            return self.n


def server_flags(args) -> list[str]:
    return ["--sparse-method", "snapkv", "--sparse-budget", str(args.budget), "--max-total-tokens", str(args.pool),
            "--chunked-prefill-size", "512", "--log-level", "warning", *args.extra]


def cpu_env(cores: str) -> dict:
    return {**os.environ, "SGLANG_CPU_OMP_THREADS_BIND": cores}


def run_replicas(args, policy: str, mode: str) -> dict:
    n = args.replicas
    servers = [ServerProcess(server_flags(args) + ["--chain-replica", REPLICA_NAMES[i]],
                             env=cpu_env(str(i % (os.cpu_count() or 1))), start_timeout=args.start_timeout)
               for i in range(n)]
    try:
        start_servers(servers)
        killed = []

        def kill_last() -> None:
            if not killed:
                killed.append(servers[-1].port)
                os.killpg(servers[-1].proc.pid, signal.SIGKILL)

        args.on_kill = kill_last if args.kill_after else None
        with Router([s.base_url for s in servers], policy, f"/tmp/bench_replicas_router_{policy}.log") as router:
            out = replay(router.url, args, mode)
        out["killed_replica"] = REPLICA_NAMES[n - 1] if killed else None
        return out
    finally:
        for srv in servers:
            srv.stop()


def start_servers(servers: list[ServerProcess], timeout: float | None = None) -> None:
    """Start every server at once; the first failure (with its server's log) is raised."""
    errors = []

    def start(srv: ServerProcess) -> None:
        try:
            srv.start(timeout)
        except Exception as err:  # noqa: BLE001 - raised below, with the server's log
            errors.append(err)

    threads = [threading.Thread(target=start, args=(srv,)) for srv in servers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def run_dp(args, mode: str) -> dict:
    n = args.replicas
    env = cpu_env("|".join(str(i % (os.cpu_count() or 1)) for i in range(n)))
    args.on_kill = None
    with ServerProcess(server_flags(args) + ["--dp-size", str(n)], env=env, start_timeout=args.start_timeout) as srv:
        return replay(srv.base_url, args, mode)


def run_variant(name: str, args) -> dict:
    if name == "replicas+chain":
        return run_replicas(args, "manual", "header")
    if name == "replicas+round-robin":
        return run_replicas(args, "round_robin", "header")
    if name == "dp+chain":
        return run_dp(args, "plain")
    if name == "dp+round-robin":
        return run_dp(args, "pin")
    raise ValueError(f"unknown variant {name!r}; choose from {', '.join(VARIANTS)}")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--variants", nargs="+", default=VARIANTS, choices=VARIANTS)
    p.add_argument("--replicas", type=int, default=2, help="servers behind the router, or --dp-size")
    p.add_argument("--sessions", type=int, default=8)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system", type=int, default=512)
    p.add_argument("--answer", type=int, default=16)
    p.add_argument("--tool-output", type=int, default=128)
    p.add_argument("--tool-wait", type=float, default=0.0)
    p.add_argument("--budget", type=int, default=256, help="SnapKV's budget per layer and KV head")
    p.add_argument("--pool", type=int, default=16384, help="KV pool tokens per replica (per rank under DP)")
    p.add_argument("--kill-after", type=int, default=0, help="kill the last replica after N requests (0: never)")
    p.add_argument("--start-timeout", type=float, default=600)
    p.add_argument("--out", default="replicas_cpu.json")
    p.add_argument("extra", nargs="*", help="SGLang flags for every server (after --)")
    return p.parse_args(argv)


def main() -> None:
    args = parse_args()
    results = {}
    for name in args.variants:
        r = run_variant(name, args)
        results[name] = r
        print(f"{name}: {json.dumps({k: v for k, v in r.items() if not isinstance(v, list)})}", flush=True)
    cols = ["continuations", "resumed", "missed", "retried", "failed", "prefilled", "reused", "wall_s"]
    print(f"\n{'variant':24}" + "".join(f"{c:>15}" for c in cols))
    for name, r in results.items():
        print(f"{name:24}" + "".join(f"{r[c]:>15}" for c in cols))
    settings = {k: v for k, v in vars(args).items() if k != "on_kill"}
    path = write_json(args.out, {"command": "python benchmark/bench_replicas.py " + " ".join(sys.argv[1:]),
                                 "machine": platform.platform(), "settings": settings, "results": results})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
