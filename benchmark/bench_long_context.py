"""Long-context decode on one GPU through the real server: capacity and matched-batch throughput.

Two experiments (issue 4; the paper's protocol, appendix C.6: a discarded workload, warm-up
decode steps, then a fixed full-batch decode window timed only at its edges):

- ``capacity``: ``--prompt-len`` L inputs with ``--output-len`` N outputs in a KV pool of
  ``--pool`` P tokens. For each method the largest batch whose KV stays resident for the whole
  output is computed from the pool (dense: every request holds L + N rows, so P // (L + N);
  an evicting method with budget B: the request being prefilled holds L rows, every admitted one
  at most B + N, so (P - L) // (B + N) + 1), that batch is submitted at once, and the run checks
  that all of it is resident together (``/sparse/stats``) and measures its aggregate decode
  throughput. The output is stopped after the window (the full N tokens would cost device time
  and change nothing about residency, which the arithmetic bounds).
- ``matched``: the same batch sizes for every variant (``plain`` = stock ``sglang.launch_server``,
  ``dense`` and ``quest`` through sglang_sparse) at one prompt length. Prompts are shared
  across batch sizes, so the radix cache prefills each only once per server.

Throughput = tokens decoded inside the window by all requests / window seconds, with the window
opening when every request has produced ``--warmup`` tokens and closing when the first one
reaches ``--warmup + --window``.

    . benchmark/gpu/env.sh
    M=.gpumodel/qwen3-8b-shape
    python3 benchmark/bench_long_context.py capacity --model-path $M --prompt-len 32768 \\
        --output-len 2048 --pool 196608 --methods dense snapkv
    python3 benchmark/bench_long_context.py matched --model-path $M --prompt-len 32768 \\
        --batches 1 2 4 8 --methods plain dense quest
Flags after ``--`` go to every server.

Tuning (issue 15's rule: every ratio is over the alternative at its best): each variant named in
``--tune`` (default ``plain dense``, the baselines) is run once per value of ``--kv-splits``
(SGLang's ``--triton-attention-num-kv-splits``, default 8, which leaves most SMs idle at long
context and small batch); its reported figure per batch is the best of the sweep, and the JSON
keeps the whole sweep under ``tuning``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import threading
import time
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, write_json  # noqa: E402

from sglang_sparse.server_process import ServerProcess

GPU_FLAGS = ["--load-format", "dummy", "--attention-backend", "triton", "--sampling-backend", "pytorch",
             "--mem-fraction-static", "0.80", "--cuda-graph-backend-prefill", "disabled", "--log-level", "warning"]
# (prefill CUDA graphs: off for every variant, as the launcher does for methods with prefill
# hooks; with them, the 8B shape runs out of memory while capturing at 0.80)


ONLINE_INTERVAL = {"h2o": 32, "rkv": 128, "skipkv": 32}  # rows past the budget before the next eviction


# RetroInfer's tiers (--retro-*): the pinned host tier (40 GB: 8 x 32K prompts of the 8B shape,
# 4.8 GB each), the device page cache (4M rows of one KV head: 2 GiB at bf16, d 128) and the
# device memory for indexes; the cache and the index budget come out of its pool (pool_tokens)
RETRO = {"host_mb": 40_000, "cache_rows": 4 * 2 ** 20, "index_mb": 8192}


# an evicting method under SGLang's overlap scheduler (--sparse-overlap on): the method's variant + that flag
OVERLAP_OF = {"rkv-overlap": "rkv", "h2o-overlap": "h2o"}


def variant(name: str, budget: int, prompt_len: int = 32768) -> tuple[str, list[str]]:
    """(module, extra flags) of a variant; sparse methods get ``budget`` tokens (KVzip: the keep
    ratio ``budget / prompt_len``, the same number of context entries on average per head)."""
    if name in OVERLAP_OF:
        module, flags = variant(OVERLAP_OF[name], budget, prompt_len)
        return module, flags + ["--sparse-overlap", "on"]
    flags = {
        # Quest allocates KV in 16-token pages (the launcher sets it); the dense variants use the
        # same page size so all three share the allocator and kernels. SnapKV needs page size 1.
        "plain": ["--page-size", "16"], "dense": ["--page-size", "16"],
        # FlashPrefill's block-sparse prefill (bench_prefill.py), dense decode, the same pages
        "flashprefill": ["--sparse-prefill", "flashprefill", "--page-size", "16"],
        "quest": ["--sparse-method", "quest", "--sparse-token-budget", str(budget)],
        # one page set per KV head (group-summed bounds), read once per group by the GQA kernel
        "quest-kv": ["--sparse-method", "quest", "--sparse-token-budget", str(budget), "--sparse-select-per",
                     "kv_head"],
        # filter layers 2, 8, 18 (the paper's choice for 32-layer models; the 8B shape has 36)
        "omnikv": ["--sparse-method", "omnikv", "--sparse-token-budget", str(budget), "--page-size", "16"],
        # no Chain Cache: requests here are independent (a parked chain would hold pool rows)
        "snapkv": ["--sparse-method", "snapkv", "--sparse-budget", str(budget), "--chain-cache", "off"],
        "pyramidkv": ["--sparse-method", "pyramidkv", "--sparse-budget", str(budget), "--chain-cache", "off"],
        # sinks + recent = the budget; 16 more rows at most between evictions
        "streamingllm": ["--sparse-method", "streamingllm", "--sparse-sinks", "4", "--sparse-recent",
                         str(budget - 4), "--sparse-evict-every", "16", "--chain-cache", "off"],
        # online eviction back to the budget every ONLINE_INTERVAL rows (prefill and decode)
        "h2o": ["--sparse-method", "h2o", "--sparse-budget", str(budget), "--sparse-recent", str(budget // 4),
                "--sparse-interval", str(ONLINE_INTERVAL["h2o"]), "--chain-cache", "off"],
        "rkv": ["--sparse-method", "rkv", "--sparse-budget", str(budget), "--sparse-interval",
                str(ONLINE_INTERVAL["rkv"]), "--chain-cache", "off"],
        # whole sentences dropped; recent window and max segment at SkipKV's defaults (128, 64)
        "skipkv": ["--sparse-method", "skipkv", "--sparse-budget", str(budget), "--sparse-interval",
                   str(ONLINE_INTERVAL["skipkv"]), "--chain-cache", "off"],
        "kvzip": ["--sparse-method", "kvzip", "--sparse-keep-ratio", f"{budget / prompt_len:.6g}",
                  "--chain-cache", "off"],
        # KVzip compresses each prompt once (prompt + probe, one output token, parked as a chain),
        # then every request resumes its compacted chain together (park_chains): the probes admit
        # one 32K request at a time, so without this the first requests finish before the last starts
        "kvzip-chain": ["--sparse-method", "kvzip", "--sparse-keep-ratio", f"{budget / prompt_len:.6g}",
                        "--chain-cache", "on"],
        "fp8": ["--sparse-method", "fp8", "--page-size", "16"],
        # 2-bit, G = 32, R = 128; a quarter of the pool's bytes stays full-precision slots
        "kivi": ["--sparse-method", "kivi", "--sparse-bits", "2", "--chain-cache", "off"],
        # 3-bit codes + an fp16 norm per token and head, G = 32, R = 32, same byte split as KIVI
        "turboquant": ["--sparse-method", "turboquant", "--sparse-bits", "3", "--chain-cache", "off"],
        # rank 64 of 128 per KV head (ratio 0.5), G = 32, R = 32, same byte split as KIVI; plain
        # SVD of the weights (--load-format dummy has no checkpoint to calibrate on)
        "palu": ["--sparse-method", "palu", "--sparse-ratio", "0.5", "--sparse-whiten", "off", "--chain-cache", "off"],
        "palu-0.75": ["--sparse-method", "palu", "--sparse-ratio", "0.75", "--sparse-whiten", "off", "--chain-cache",
                      "off"],
        # budget / 16 clusters of 16 tokens per query head; the cold rows of up to 8 32K prompts in
        # the pinned host tier, a 2 GiB device page cache, 8 GiB for indexes; decode is eager
        # (Python per layer and request, one host sync per layer), so no decode CUDA graphs
        "retroinfer": ["--sparse-method", "retroinfer", "--sparse-retrieve", str(max(1, budget // 16)),
                       "--sparse-tokens-per-cluster", "16", "--sparse-host-mb", str(RETRO["host_mb"]),
                       "--sparse-cache-rows", str(RETRO["cache_rows"]), "--sparse-index-mb", str(RETRO["index_mb"]),
                       "--disable-cuda-graph"],
    }[name]
    return ("sglang.launch_server" if name == "plain" else "sglang_sparse.launch_server"), flags


class Stream(threading.Thread):
    """One streamed greedy request; records when each token arrived; stops reading (SGLang then
    aborts the request) once ``stop`` is set."""

    def __init__(self, base_url: str, ids: list[int], max_new: int, stop: threading.Event,
                 timeout: float = 3600, params: dict | None = None) -> None:
        super().__init__(daemon=True)
        self.url, self.ids, self.max_new, self.stop = base_url + "/generate", ids, max_new, stop
        self.timeout, self.params = timeout, params or {}
        self.times: list[float] = []
        self.meta: dict = {}  # the last chunk's meta_info
        self.chain: dict = {}  # chain_status / reused_tokens (on the first chunk only)
        self.error: str | None = None

    def run(self) -> None:
        body = {"input_ids": self.ids, "stream": True,
                "sampling_params": {"temperature": 0, "max_new_tokens": self.max_new, "ignore_eos": True,
                                    **self.params}}
        try:
            with requests.post(self.url, json=body, stream=True, timeout=self.timeout) as resp:
                resp.raise_for_status()
                for line in resp.iter_lines():
                    if self.stop.is_set():
                        return
                    if not line.startswith(b"data:") or line.strip() == b"data: [DONE]":
                        continue
                    self.meta = json.loads(line[5:])["meta_info"]
                    if "chain_status" in self.meta:
                        self.chain = {k: self.meta.get(k) for k in ("chain_id", "chain_status", "reused_tokens")}
                    count = self.meta["completion_tokens"]
                    now = time.monotonic()
                    self.times += [now] * (count - len(self.times))
        except Exception as err:  # reported with the result, never silently dropped
            self.error = repr(err)


def running(base_url: str) -> int:
    """Requests running now from ``/sparse/stats``; -1 for plain SGLang (no such route)."""
    resp = requests.get(base_url + "/sparse/stats", timeout=60)
    return resp.json()["running_requests"] if resp.status_code == 200 else -1


def decode_window(base_url: str, prompts: list[list[int]], max_new: int, warmup: int, window: int,
                  timeout: float, params: list[dict] | None = None) -> dict:
    """``params``: extra sampling params per prompt (a chain to resume)."""
    stop = threading.Event()
    streams = [Stream(base_url, p, max_new, stop, params=params[i] if params else None)
               for i, p in enumerate(prompts)]
    for s in streams:
        s.start()
    need, peak, t_start = warmup + window, 0, time.monotonic()
    while time.monotonic() - t_start < timeout:
        peak = max(peak, running(base_url))
        if all(len(s.times) >= need or not s.is_alive() for s in streams):
            break
        time.sleep(0.5)
    stop.set()
    for _ in range(240):  # closed streams are aborted by the server; let it drain
        left = running(base_url)
        if left <= 0:
            time.sleep(3 if left < 0 else 0)  # plain SGLang: no count, give aborts a moment
            break
        time.sleep(0.5)
    errors = [s.error for s in streams if s.error]
    done = [s for s in streams if len(s.times) >= need]
    res = {"batch": len(prompts), "peak_running": peak, "completed_window": len(done), "errors": errors[:3]}
    if params:  # resumed chains: how many were found, and the fewest rows any of them reused
        res["chains_resumed"] = sum(s.chain.get("chain_status") == "resumed" for s in streams)
        res["reused_tokens_min"] = min((s.chain.get("reused_tokens") or 0 for s in streams), default=0)
    if len(done) < len(streams):
        res["decode_tok_s"] = float("nan")
        return res
    t0 = max(s.times[warmup - 1] for s in streams)  # everyone is past warm-up
    t1 = min(s.times[need - 1] for s in streams)  # the first one leaves the window
    tokens = sum(sum(1 for x in s.times if t0 < x <= t1) for s in streams)
    res.update(decode_tok_s=tokens / (t1 - t0) if t1 > t0 else float("nan"), window_tokens=tokens,
               window_s=t1 - t0, ttft_last_s=max(s.times[0] for s in streams) - t_start)
    if t1 <= t0:  # e.g. KVzip at 32K: its probes admit one request at a time
        res["window_note"] = ("no common decode window: the first request left its window before the "
                              "last one was past its warm-up (admission too slow for this output length)")
    return res


def make_prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1000, 30000) for _ in range(length)] for _ in range(n)]


def server(name: str, args, extra: list[str]) -> ServerProcess:  # noqa: D401
    module, flags = variant(name, args.budget, args.prompt_len)
    # KVzip prefills its reconstruction probe (a little over the prompt again) after the prompt
    ctx = (kvzip_prefill(args.prompt_len) if name.startswith("kvzip") else args.prompt_len) + args.output_len + 64
    base = GPU_FLAGS if not args.cpu else ["--device", "cpu", "--log-level", "warning"]
    flags = ["--model-path", args.model_path, *base, *flags, "--max-total-tokens", str(pool_tokens(name, args)),
             "--context-length", str(ctx), *extra]
    return ServerProcess(flags, module=module, start_timeout=args.start_timeout)


def pool_tokens(name: str, args) -> int:
    """KV pool in tokens for the same bytes as ``--pool`` tokens at the model's precision (fp8
    stores a token in half the bytes, so twice the tokens; RetroInfer's device page cache and
    index budget are paid for with pool tokens, so its device memory is dense's)."""
    if name == "retroinfer":
        return args.pool - -(-(retro_cache_bytes(args) + RETRO["index_mb"] * 2 ** 20) // token_bytes(args))
    return 2 * args.pool if name == "fp8" else args.pool


def model_shape(args) -> tuple[int, int, int]:
    """(layers, KV heads, head dim) of the model."""
    cfg = json.loads((Path(args.model_path) / "config.json").read_text())
    d = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return cfg["num_hidden_layers"], cfg["num_key_value_heads"], d


def token_bytes(args) -> int:
    layers, heads, d = model_shape(args)
    return 2 * 2 * layers * heads * d  # bf16 K and V of one token


def retro_cache_bytes(args) -> int:
    return RETRO["cache_rows"] * 2 * 2 * model_shape(args)[2]  # K and V rows of one KV head, bf16


def retro_batch(args) -> int:
    """RetroInfer's resident requests: each needs its cold rows in the host tier and its index in
    the index budget; its pool holds the prompt being prefilled plus sinks + local + output rows
    of every other one (``methods/retroinfer.py``: 4 + 64)."""
    from sglang_sparse.methods.retroinfer import RetroInferConfig, index_nbytes

    c = RetroInferConfig(tokens_per_cluster=16)
    layers, heads, d = model_shape(args)
    cold = args.prompt_len - c.sinks - c.local
    index = index_nbytes(c, cold, layers, heads, d, d, 2)  # bf16
    host = cold * token_bytes(args)
    by_pool = (pool_tokens("retroinfer", args) - args.prompt_len) // (c.sinks + c.local + args.output_len) + 1
    return min(RETRO["index_mb"] * 2 ** 20 // index, RETRO["host_mb"] * 2 ** 20 // host, by_pool)


def capacity_batch(name: str, args) -> int:
    """Largest batch resident for the whole output: the request being prefilled holds its whole
    prompt, every admitted one its retained rows + the output (capped for StreamingLLM)."""
    name = OVERLAP_OF.get(name, name)
    pool, L, N = pool_tokens(name, args), args.prompt_len, args.output_len
    if name == "snapkv":
        return (pool - L) // (args.budget + N) + 1
    if name.startswith("kvzip"):  # the request being probed holds prompt + probe; every kept one ~ budget + N
        # (a layer keeps its widest head's count for every head: /sparse/stats' kvzip_padded_entries
        # says how far over the budget that went; peak_running says what was resident)
        return (pool - kvzip_prefill(L)) // (args.budget + N) + 1
    if name == "pyramidkv":
        from sglang_sparse.methods.pyramidkv import PyramidKVConfig, layer_budgets

        layers = model_shape(args)[0]
        rows = -(-sum(layer_budgets(PyramidKVConfig(budget=args.budget, window=32), L, layers)) // layers)
        return (pool - L) // (rows + N) + 1
    if name == "streamingllm":
        return (pool - L) // (args.budget + 16) + 1
    if name in ONLINE_INTERVAL:  # never more than budget + interval rows once the prompt is in
        cap = args.budget + ONLINE_INTERVAL[name]
        chunk = prefill_chunk(args)
        # H2O and SkipKV also evict between prompt chunks (--sparse-evict-prefill, on by default):
        # the request being prefilled then holds at most cap + one chunk, not its whole prompt
        held = min(L, cap + chunk) if name in ("h2o", "skipkv") and chunk else L
        return (pool - held) // cap + 1
    if name == "retroinfer":
        return retro_batch(args)
    if name in ("kivi", "turboquant", "palu", "palu-0.75"):  # every history in blocks (3/4 of the pool's bytes)
        c, block_bytes = payload_block(name, *model_shape(args))
        blocks = int(pool * token_bytes(args) * (1 - c.fp_fraction)) // block_bytes
        return blocks // -(-(L + N) // c.group)
    return pool // (L + N)


def payload_block(name: str, layers: int, heads: int, d: int):
    """(method config, bytes of one block of G tokens in bf16) of a payload variant."""
    if name.startswith("palu"):
        from sglang_sparse.core.latent_store import PaluLatentStore
        from sglang_sparse.core.lowrank import ranks_for_ratio
        from sglang_sparse.methods.palu import PaluConfig

        c = PaluConfig(ratio=0.75 if name == "palu-0.75" else 0.5)
        rank, groups = ranks_for_ratio(c.ratio, heads, d, c.head_group)
        return c, PaluLatentStore.latent_block_bytes(layers, groups, rank, c.group, 2)
    store, cfg_cls, bits = payload_store(name)
    c = cfg_cls()
    return c, store.block_bytes(layers, heads, d, bits, c.group)


def payload_store(name: str):
    """(store class, config class, bits) of a payload variant, as ``server_flags`` sets it."""
    if name == "kivi":
        from sglang_sparse.core.quant_store import QuantizedBlockStore
        from sglang_sparse.methods.kivi import KIVIConfig

        return QuantizedBlockStore, KIVIConfig, 2
    from sglang_sparse.core.turboquant_store import TurboQuantBlockStore
    from sglang_sparse.methods.turboquant import TurboQuantConfig

    return TurboQuantBlockStore, TurboQuantConfig, 3


def kvzip_prefill(prompt_len: int) -> int:
    """Tokens a KVzip request holds while its probe runs: the context (the prompt but its last
    token) + the chunked reconstruction probe of it (``methods.kvzip.probe_tokens``), + 1."""
    from sglang_sparse.methods.kvzip import KVzipConfig

    c, context = KVzipConfig(), prompt_len - 1
    chunks = -(-context // c.chunk)
    # repeat texts are at most 32 tokens each (the probe's fixed words, core/pruning.py)
    return prompt_len + context + chunks * (32 + c.tail)


def free_slots(base_url: str) -> int:
    return requests.get(base_url + "/sparse/stats", timeout=60).json()["kv_free_slots"]


def park_chains(base_url: str, prompts: list[list[int]], probe_rows: int, grow: int,
                timeout: float) -> tuple[list[list[int]], list[dict], dict]:
    """Phase one of ``kvzip-chain``: the prompts one after another (the pool admits one 32K probe
    at a time anyway), each with one output token; the server compresses it and parks it as a
    chain. It stops before a probe (``probe_rows`` free rows) would make the server reclaim a
    parked chain, and drops the last chain if the parked ones could not each grow by ``grow``
    output rows: KVzip's kept rows per request depend on the scores (a layer keeps its widest
    head's count for every head), so the resident batch is found here, not by arithmetic.
    Returns the continuations (prompt + its output token: the chain extended by its last token
    only, so no second probe), their sampling params (the chain to resume) and what it cost."""
    t0, conts, params, seconds, errors = time.monotonic(), [], [], [], []
    for p in prompts:
        if free_slots(base_url) < probe_rows:
            break
        t = time.monotonic()
        resp = requests.post(base_url + "/generate", timeout=timeout, json={
            "input_ids": p, "sampling_params": {"temperature": 0, "max_new_tokens": 1}})
        body = resp.json()
        chain = body.get("meta_info", {}).get("chain_id") if resp.status_code == 200 else None
        if chain is None:
            errors.append(body.get("message") or resp.status_code)
            break
        seconds.append(time.monotonic() - t)
        conts.append(p + body["output_ids"])
        params.append({"custom_params": {"chain_id": chain}})
        if free_slots(base_url) < len(conts) * grow:  # no room for every output: one fewer
            requests.delete(base_url + f"/chain/{chain}", timeout=60)
            conts.pop(), params.pop()
            break
    info = {"seconds": time.monotonic() - t0, "parked": len(conts), "errors": errors[:3],
            "seconds_per_prompt": seconds, "free_slots_after": free_slots(base_url)}
    return conts, params, info


def prefill_chunk(args) -> int | None:
    """``--chunked-prefill-size`` given to the servers after ``--`` (None: SGLang picks it)."""
    extra = args.extra
    if "--chunked-prefill-size" in extra:
        return int(extra[extra.index("--chunked-prefill-size") + 1])
    return None


def run_variant(name: str, args, extra: list[str], batches: list[int], prompts, save, splits=None) -> dict:
    """One server of ``name``: a discarded warm-up request, the KV representation, then every batch."""
    res: dict = {}
    try:
        t0 = time.monotonic()
        with server(name, args, extra) as srv:
            # progress lines: a run cut by the call's limit still says how far it got
            print(name, f"server up in {time.monotonic() - t0:.0f} s", flush=True)
            decode_window(srv.base_url, make_prompts(1, 256, seed=99), 16, 2, 4, timeout=120)  # discarded
            print(name, f"warm-up done at {time.monotonic() - t0:.0f} s", flush=True)
            st = requests.get(srv.base_url + "/sparse/stats", timeout=60)
            if st.status_code == 200:  # the KV representation and pool, as the server counts them
                res["kv"] = {k: st.json().get(k) for k in ("kv_bytes_per_token", "kv_total_slots", "kv_bytes_total")}
            for b in batches:
                max_new = args.output_len if args.experiment == "capacity" else args.warmup + args.window + 2
                todo, params = prompts[:b], None
                if name == "kvzip-chain":
                    todo, params, parked = park_chains(srv.base_url, todo, kvzip_prefill(args.prompt_len),
                                                       args.output_len, args.timeout)
                    print(name, b, "parked", json.dumps(parked), flush=True)
                res[str(b)] = decode_window(srv.base_url, todo, max_new, args.warmup, args.window,
                                            args.timeout, params)
                if params is not None:
                    res[str(b)]["park"] = parked
                st = requests.get(srv.base_url + "/sparse/stats", timeout=60)
                if st.status_code == 200:  # e.g. timings_us.compaction over steps: what eviction cost a step
                    # (totals since the server started: its warm-up and earlier batches included; a
                    # capacity server runs one batch)
                    body = st.json()
                    res[str(b)]["sparse_stats"] = {k: body.get(k) for k in ("steps", "counters", "timings_us")}
                print(name, b, f"kv-splits={splits}" if splits else "", json.dumps(res[str(b)]), flush=True)
                save()
    except Exception as err:  # keep what was measured; say what failed
        res["error"] = repr(err)
        print(name, "failed:", repr(err), flush=True)
    return res


def pick_best(runs: dict) -> dict:
    """Per batch, the run with the highest decode tok/s; the sweep itself under ``tuning``."""
    def tok_s(r):
        v = r.get("decode_tok_s", float("nan")) if isinstance(r, dict) else float("nan")
        return v if v == v else -1.0  # NaN (window not completed) ranks last

    sweep = {}
    for s, res in runs.items():  # tok/s per batch of each split count (and why a server failed)
        sweep[str(s)] = {b: r["decode_tok_s"] for b, r in res.items() if isinstance(r, dict) and "decode_tok_s" in r}
        if "error" in res:
            sweep[str(s)]["error"] = res["error"]
    out: dict = {"tuning": {"flag": "--triton-attention-num-kv-splits", "sweep": sweep, "best": {}}}
    batches = {b for res in runs.values() for b, r in res.items() if isinstance(r, dict) and "batch" in r}
    for b in sorted(batches, key=int):
        s_best = max(runs, key=lambda s: tok_s(runs[s].get(b, {})))
        out[b] = dict(runs[s_best][b], kv_splits=s_best)
        out["tuning"]["best"][b] = s_best
    for res in runs.values():
        if "kv" in res:
            out["kv"] = res["kv"]
            break
    return out


def server_extra(args, splits: int | None, batches: list[int]) -> list[str]:
    """SGLang flags of one server: those after ``--``, the split count of a sweep, and with
    ``--graphs-own-batch`` (capacity) decode graphs for its own batch only (the last occurrence of
    a flag wins, so this replaces a list given after ``--``)."""
    extra = args.extra + ([] if splits is None else ["--triton-attention-num-kv-splits", str(splits)])
    if args.graphs_own_batch and args.experiment == "capacity":
        extra += ["--cuda-graph-bs-decode", str(batches[0])]
    return extra


def check_splits_for(args, methods: list[str]) -> None:
    """``--kv-splits-for`` names only variants that run: a typo or a method left out of
    ``--methods`` would otherwise be ignored and its variant run at another split count."""
    for item in args.kv_splits_for:
        method = item.partition("=")[0]
        if method not in methods:
            raise SystemExit(f"--kv-splits-for {item!r}: {method!r} is not among the variants run "
                             f"(--methods {' '.join(methods)})")


def split_sweep(name: str, args) -> list:
    """The --triton-attention-num-kv-splits values ``name`` runs at: its own ``--kv-splits-for``
    list, else ``--kv-splits`` if it is tuned, else ``[None]`` (SGLang's default, no flag)."""
    own = {}
    for item in args.kv_splits_for:
        method, _, values = item.partition("=")
        try:
            own[method] = [int(v) for v in values.split(",")]
        except ValueError:
            raise SystemExit(f"--kv-splits-for {item!r}: expected METHOD=N[,N...], e.g. rkv=4 or rkv=4,8") from None
    if name in own:
        return own[name]
    return args.kv_splits if name in args.tune and args.kv_splits else [None]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("experiment", choices=["capacity", "matched"])
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--methods", nargs="+", default=None)
    ap.add_argument("--prompt-len", type=int, default=32768)
    ap.add_argument("--output-len", type=int, default=2048)
    ap.add_argument("--budget", type=int, default=2048, help="SnapKV budget / Quest token budget")
    ap.add_argument("--pool", type=int, default=196608, help="KV pool tokens (--max-total-tokens)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--window", type=int, default=32)
    ap.add_argument("--timeout", type=float, default=420, help="seconds per batch before giving up")
    ap.add_argument("--out", default=None)
    ap.add_argument("--start-timeout", type=float, default=300,
                    help="seconds a server may take to start (torch.compile at 128K: more)")
    ap.add_argument("--cpu", action="store_true", help="smoke run on a CPU with real weights (no GPU flags)")
    ap.add_argument("--graphs-own-batch", action="store_true",
                    help="capacity: each server captures decode CUDA graphs for its own resident batch only "
                         "(--cuda-graph-bs-decode B, after the flags given after --): smaller batches pad up to it, "
                         "and a server starts without capturing sizes it never runs")
    ap.add_argument("--tune", nargs="*", default=["plain", "dense"],
                    help="variants swept over --kv-splits (best kept per batch)")
    ap.add_argument("--kv-splits", type=int, nargs="*", default=[],
                    help="values of --triton-attention-num-kv-splits for the --tune variants (none: SGLang's default)")
    ap.add_argument("--kv-splits-for", nargs="*", default=[], metavar="METHOD=N[,N...]",
                    help="a variant's own split values (a sweep if several), instead of --kv-splits: e.g. rkv=4 "
                         "runs R-KV at the count a cheaper run found best while dense sweeps --kv-splits")
    for key, val in RETRO.items():
        ap.add_argument(f"--retro-{key.replace('_', '-')}", type=int, default=val, help=f"RetroInfer's --sparse-{key}")
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    args = ap.parse_args(argv[:cut])
    RETRO.update({key: getattr(args, f"retro_{key}") for key in RETRO})
    args.extra = argv[cut + 1 :]  # extra SGLang flags for every server
    methods = args.methods or (["dense", "snapkv"] if args.experiment == "capacity" else ["plain", "dense", "quest"])
    check_splits_for(args, methods)
    out = args.out or f"long_{args.experiment}_{args.prompt_len}.json"
    results: dict[str, dict] = {}

    def save() -> None:
        # the sparse kernels' launch table the servers inherit (sgl_kernel_sparse.tuning), if one is named
        write_json(out, {"command": "python " + " ".join(sys.argv), "machine": platform.platform(),
                         "kernel_tuning_table": os.environ.get("SGL_KERNEL_SPARSE_TUNING"),
                         "settings": vars(args), "results": results})

    for name in methods:
        batches = [capacity_batch(name, args)] if args.experiment == "capacity" else args.batches
        prompts = make_prompts(max(batches), args.prompt_len)
        sweep = split_sweep(name, args)
        runs = {}
        for splits in sweep:  # results after every server: a run stopped early keeps them
            extra = server_extra(args, splits, batches)
            runs[splits] = run_variant(name, args, extra, batches, prompts, save, splits)
            results[name] = runs[None] if splits is None else pick_best(runs)
            save()
    print(f"\n{args.experiment}: prompt {args.prompt_len} tokens, pool {args.pool}, budget {args.budget}; "
          f"decode tok/s in a {args.window}-token window after {args.warmup} warm-up tokens")
    for name, res in results.items():
        cells = [f"b={b}: {r['decode_tok_s']:.1f} tok/s (peak running {r['peak_running']})"
                 for b, r in res.items() if isinstance(r, dict) and "decode_tok_s" in r]
        if "kv" in res:
            cells.append(f"{res['kv']['kv_bytes_per_token']} B/token")
        print(f"{name:<8}", "; ".join(cells) or res.get("error"))
    print(f"wrote {RESULTS / out}")  # the last save()'s file (an absolute --out stays as is)


if __name__ == "__main__":
    main()
