"""Shared fixtures. Server tests share one server per module (see ``start_server``)."""

from __future__ import annotations

import os
import threading
import time

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _has_gpu() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


def worker_core() -> int | None:
    """Under ``pytest -n N`` (pytest-xdist, what ``make test`` runs): the core this worker's
    OpenMP threads and those of every server it starts are bound to (``gw<i>`` gets the i-th
    core this process may use); None outside a parallel run."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if not worker.startswith("gw"):
        return None
    cores = sorted(os.sched_getaffinity(0))
    return cores[int(worker[2:]) % len(cores)]


def pytest_configure(config):
    """A worker of a parallel run gives its own torch one thread and binds the OpenMP threads
    of every server it starts to its own core (``SGLANG_CPU_OMP_THREADS_BIND``, inherited by the
    servers' environment); the processes themselves may run on any core, so imports at start-up
    still spread. Unbound, two servers each spin OpenMP threads on every core against each other:
    eight server modules took 2.3x their serial time under ``-n 2``; bound, 0.74x. Modules that
    bind cores themselves (several ranks or replicas) are marked ``whole_machine`` and run after
    the parallel part, alone."""
    core = worker_core()
    if core is None:
        return
    os.environ["SGLANG_CPU_OMP_THREADS_BIND"] = str(core)
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        import torch

        torch.set_num_threads(1)
    except ImportError:
        pass


def pytest_collection_modifyitems(config, items):
    if _has_gpu():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def default_model_dir():
    from sglang_sparse.default_model import ensure_default_model

    return ensure_default_model()


@pytest.fixture(scope="session")
def tok(default_model_dir):
    """The default model's tokenizer."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(default_model_dir))


def start_server(args, request, module="sglang_sparse.launch_server", env=None, timeout=400):
    """Start a server for one test module; on failure the error shows the server's log."""
    from sglang_sparse.server_process import ServerProcess

    server = ServerProcess(args, module=module, env=env)
    request.addfinalizer(server.stop)
    server.start(timeout=timeout)
    return server


def assert_every_slot_owned_once(server) -> None:
    """Idle server on the logical radix cache: the slot census is clean and free + cached
    (evictable) + locked or pinned (protected) slots make up the whole pool."""
    import requests

    s = requests.get(server.base_url + "/sparse/stats", timeout=60).json()
    assert s["integrity"]["ok"], s["integrity"]
    radix = s["radix"]
    assert s["kv_free_slots"] + radix["evictable_slots"] + radix["protected_slots"] == s["kv_total_slots"]


def sparse_stats(server) -> dict:
    import requests

    return requests.get(server.base_url + "/sparse/stats", timeout=60).json()


def distinct_burst(server, k: int, length: int, n: int) -> list:
    """``k`` requests of ``length`` distinct token ids each (no shared prefix) sent at once, each
    generating exactly ``n`` greedy tokens; asserts every one got them, returns the responses."""
    from concurrent.futures import ThreadPoolExecutor

    import requests

    def one(i):
        ids = [1000 + (37 * i + 11 * j) % 20000 for j in range(length)]
        return requests.post(server.base_url + "/generate", timeout=1800, json={
            "input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": n, "ignore_eos": True}})

    with ThreadPoolExecutor(k) as pool:
        outs = list(pool.map(one, range(k)))
    assert all(r.status_code == 200 and len(r.json()["output_ids"]) == n for r in outs), outs[0].text
    return outs


def hf_argmax(model, ids, n):
    """Greedy decoding by argmax (end-of-text tokens included, as ``ignore_eos`` serves them;
    ``generate`` with ``min_new_tokens`` would suppress them)."""
    import torch

    out = []
    with torch.no_grad():
        step = model(torch.tensor([ids]), use_cache=True)
        for _ in range(n):
            out.append(int(step.logits[0, -1].argmax()))
            step = model(torch.tensor([out[-1:]]), past_key_values=step.past_key_values, use_cache=True)
    return out


def greedy(server, ids, n) -> dict:
    """``/generate`` of ``ids``, greedy, exactly ``n`` new tokens (ignore_eos); asserts a 200."""
    import requests

    body = {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": n, "ignore_eos": True}}
    resp = requests.post(server.base_url + "/generate", json=body, timeout=300)
    assert resp.status_code == 200, resp.text
    return resp.json()


def free_and_used(s) -> tuple[int, int]:
    """(free slots, bytes used) of a ``/sparse/stats`` answer with idle chains' rows and the radix
    cache's method units (KIVI's blocks) counted as free: what a request leaves behind once its
    chain and the tree's copy of its blocks are set aside (SGLang's warm-up request parks a chain
    too, which a test may reclaim)."""
    rows, units = s["chain_idle_rows"], s["radix"]["evictable_units"] + s["radix"]["protected_units"]
    return s["kv_free_slots"] + rows, s["kv_bytes_used"] - rows * s["kv_bytes_per_slot"] - units * s["radix"]["unit_bytes"]


def run_together(server, calls) -> tuple[list, int]:
    """Run the zero-argument ``calls`` at once, one thread each. Returns their results in order
    and the most requests running together (polled from ``/sparse/stats``); a call's exception is
    raised here (a thread's would otherwise vanish)."""
    import requests

    results, errors = [None] * len(calls), []

    def run(i):
        try:
            results[i] = calls[i]()
        except BaseException as err:
            errors.append(err)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    peak = 0
    while any(t.is_alive() for t in threads):
        running = requests.get(server.base_url + "/sparse/stats", timeout=60).json()["running_requests"]
        peak = max(peak, running)
        time.sleep(0.2)
    for t in threads:
        t.join()
    assert not errors, errors
    return results, peak


def expand_ranges(ranges) -> list[int]:
    """The logical positions of a retention map's half-open runs ``[[start, end), ...]``."""
    return [p for start, end in ranges for p in range(start, end)]


def watch(server, body, poll=0.2) -> tuple[dict, list]:
    """POST /generate of ``body`` in a thread and take /sparse/stats snapshots (between scheduler
    steps) every ``poll`` seconds while it runs; returns (the 200 response's JSON, the snapshots
    taken while exactly one request was running)."""
    import requests

    out, seen = {}, []
    worker = threading.Thread(target=lambda: out.update(resp=requests.post(
        server.base_url + "/generate", json=body, timeout=600)))
    worker.start()
    while worker.is_alive():
        s = requests.get(server.base_url + "/sparse/stats", timeout=60).json()
        if s["running_requests"] == 1:
            seen.append(s)
        time.sleep(poll)
    worker.join()
    assert out["resp"].status_code == 200, out["resp"].text
    return out["resp"].json(), seen


def stream_and_get(server, body, path) -> tuple:
    """Stream ``/generate`` of ``body`` (greedy; its ``rid`` names it); once the first token has
    arrived (the request is decoding) GET ``path``; then read the stream to its end. Returns
    (the GET's response, the first streamed chunk, the last one)."""
    import json

    import requests

    with requests.post(server.base_url + "/generate", json={**body, "stream": True}, stream=True, timeout=600) as resp:
        assert resp.status_code == 200, resp.text
        lines = resp.iter_lines()
        first = next(x for x in lines if x.startswith(b"data: {"))
        mid = requests.get(server.base_url + path, timeout=60)
        chunks = [first] + [x for x in lines if x.startswith(b"data: {")]
    return mid, json.loads(first[6:]), json.loads(chunks[-1][6:])
