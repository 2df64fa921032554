"""Client-side measurement helpers shared by the benchmark scripts (HTTP only)."""

from __future__ import annotations

import json
import statistics
import threading
import time
from pathlib import Path

import requests

RESULTS = Path(__file__).resolve().parent / "results"


def eviction_flags(method: str, budget: int) -> list[str]:
    """Server flags of an eviction method keeping ``budget`` rows per request (H2O: a quarter of
    them recent; StreamingLLM: 4 sinks + the rest recent; others at their defaults). KVzip keeps a
    ratio of each turn's new context, not a row count: ``budget / 8192`` (0.25 at 2,048, i.e. about
    a quarter of a 4K system prompt and of each 2K tool output; its chain grows by that per turn)."""
    return {
        "snapkv": ["--sparse-budget", str(budget)],
        "pyramidkv": ["--sparse-budget", str(budget)],  # the average over layers
        "h2o": ["--sparse-budget", str(budget), "--sparse-recent", str(budget // 4)],
        "rkv": ["--sparse-budget", str(budget)],
        "skipkv": ["--sparse-budget", str(budget)],
        "streamingllm": ["--sparse-sinks", "4", "--sparse-recent", str(budget - 4)],
        "kvzip": ["--sparse-keep-ratio", f"{min(1.0, budget / 8192):.6g}"],
    }[method]


def stream_generate(base_url: str, input_ids: list[int], max_new_tokens: int, on_tokens=None) -> dict:
    """One streamed /generate request (greedy, ignore_eos). Returns the arrival time of every
    generated token (``times``, monotonic seconds), ``ttft`` (s), ``end`` and ``tokens``.
    ``on_tokens(count)``, if given, is called at every chunk with the tokens generated so far."""
    body = {
        "input_ids": input_ids,
        "stream": True,
        "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": True},
    }
    start = time.monotonic()
    times: list[float] = []
    with requests.post(base_url + "/generate", json=body, stream=True, timeout=3600) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line.startswith(b"data:") or line.strip() == b"data: [DONE]":
                continue
            count = json.loads(line[5:])["meta_info"]["completion_tokens"]
            now = time.monotonic()
            times += [now] * (count - len(times))  # a chunk may carry several tokens
            if on_tokens is not None:
                on_tokens(count)
    return {"start": start, "first": times[0], "end": time.monotonic(), "ttft": times[0] - start,
            "tokens": len(times), "times": times}


def concurrent_decode(base_url: str, prompts: list[list[int]], max_new_tokens: int) -> dict:
    """Send all prompts at once. Decode throughput counts tokens after each request's first one,
    over the window from the last first-token to the last end (everyone is decoding in it)."""
    results: list[dict] = [None] * len(prompts)  # type: ignore[list-item]

    def run(i: int) -> None:
        results[i] = stream_generate(base_url, prompts[i], max_new_tokens)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    window = max(r["end"] for r in results) - max(r["first"] for r in results)
    decoded = sum(r["tokens"] - 1 for r in results)
    return {
        "decode_tok_s": decoded / window if window > 0 else float("nan"),
        "ttft_s": statistics.median(r["ttft"] for r in results),
        "tokens": decoded + len(results),
    }


def tree_cpu_seconds(pid: int) -> float:
    """User+system CPU seconds used so far by a process and all its descendants."""
    import psutil

    root = psutil.Process(pid)
    total = 0.0
    for proc in [root, *root.children(recursive=True)]:
        try:
            t = proc.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


def write_json(name: str, payload: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / name
    path.write_text(json.dumps(payload, indent=2))
    return path
