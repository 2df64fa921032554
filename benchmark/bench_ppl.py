"""Perplexity of held-out essay text read over a method's KV, through the real server.

A method changes what later tokens see of the history: quantized blocks (KIVI, TurboQuant),
evicted rows (SnapKV, ...), block-sparse prefill (FlashPrefill). So the text is scored in two
requests, as an agent's next turn would be:

1. the *context* ``seg[:M]``, one output token: the method does to it what it does to any prompt
   (quantizes it into blocks, evicts down to its budget, prefills it block-sparse) and the
   request's KV stays cached: in its chain (methods with Chain Cache; ``meta_info.chain_id``) or
   in the radix tree (dense, FlashPrefill);
2. the whole ``seg[:N]`` (with the chain id when there is one), ``return_logprob`` from ``M``:
   only ``seg[M:N]`` is prefilled, over the cached context, and SGLang returns the log-probability
   of each of its tokens (the first, predicted from the context's last row, has none: SGLang does
   not recompute that row). Perplexity = exp(-mean log p) over those tokens of every segment.

Dense runs the same two requests, so the figures differ only by what the method did to the
context. ``reused`` in the output (``cached_tokens`` / ``reused_tokens`` of request 2) says the
context was really reused, not re-prefilled in full precision.

Held-out text: the *last* tokens of the Paul Graham essays in file-name order (the needle
benchmark cuts its haystacks from the start), ``--segments`` segments of ``--length`` tokens.

    python benchmark/bench_ppl.py --configs dense turboquant-2bit turboquant-4bit --out ppl_cpu.json
    python benchmark/bench_ppl.py --configs dense palu@0.5 palu@0.75 --out ppl_palu_cpu.json
    python benchmark/bench_ppl.py --configs dense deltakv@16 deltakv@32 --out ppl_deltakv_cpu.json

Palu changes the K/V of *every* token (its projection is low-rank), not only the stored context:
its figures include the scored tokens' own low-rank K/V. DeltaKV only approximates the stored
context (its compressor is fitted here by PCA, not the paper's trained one).
"""

from __future__ import annotations

import argparse
import math
import platform
import sys
import time
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_niah import CONFIGS, essays_tokens, pool_scale  # noqa: E402
from common import write_json  # noqa: E402

from sglang_sparse.default_model import ensure_default_model  # noqa: E402
from sglang_sparse.server_process import ServerProcess  # noqa: E402


def generate(base_url: str, ids: list[int], chain_id: str | None, logprob_from: int | None) -> dict:
    body = {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": 1}}
    if chain_id is not None:
        body["chain_id"] = chain_id
    if logprob_from is not None:
        body.update(return_logprob=True, logprob_start_len=logprob_from)
    resp = requests.post(base_url + "/generate", json=body, timeout=3600)
    if resp.status_code != 200:
        raise RuntimeError(f"{resp.status_code}: {resp.text[:300]}")
    return resp.json()["meta_info"]


def score_segment(base_url: str, seg: list[int], context: int) -> dict:
    """Log-probabilities of ``seg[context:]`` read over the cached, method-processed context."""
    first = generate(base_url, seg[:context], None, None)
    meta = generate(base_url, seg, first.get("chain_id"), context)
    # entries (logprob, token id, text); the first scored token's is None (see the docstring)
    logprobs = [e[0] for e in meta["input_token_logprobs"] if e[0] is not None]
    return {"logprobs": logprobs, "cached_tokens": meta.get("cached_tokens", 0),
            "reused_tokens": meta.get("reused_tokens", 0), "chain_status": meta.get("chain_status")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", nargs="+", default=["dense", "turboquant-2bit", "turboquant-4bit"],
                    choices=list(CONFIGS), help="bench_niah.py's configurations")
    ap.add_argument("--length", type=int, default=2048, help="tokens per segment (context + scored)")
    ap.add_argument("--context", type=int, default=1536, help="tokens of each segment's cached context")
    ap.add_argument("--segments", type=int, default=4)
    ap.add_argument("--out", default="ppl_cpu.json")
    args = ap.parse_args()
    if not 0 < args.context < args.length - 1:
        ap.error("--context must lie in (0, --length - 1)")

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ensure_default_model())
    text = essays_tokens(tok)[-args.segments * args.length:]
    segments = [text[i * args.length:(i + 1) * args.length] for i in range(args.segments)]
    pool = 2 * args.length + 4096
    results: dict[str, dict] = {}
    for name in args.configs:
        t0 = time.monotonic()
        # payload methods (KIVI's pool split): 4x the pool, so their full-precision slots (a quarter)
        # hold what dense's pool holds; as bench_niah
        scale = pool_scale(CONFIGS[name])
        flags = CONFIGS[name] + ["--max-total-tokens", str(scale * pool), "--log-level", "warning"]
        with ServerProcess(flags) as srv:
            scored = [score_segment(srv.base_url, seg, args.context) for seg in segments]
        lps = [lp for s in scored for lp in s["logprobs"]]
        results[name] = {
            "ppl": math.exp(-sum(lps) / len(lps)), "tokens": len(lps),
            "per_segment": [math.exp(-sum(s["logprobs"]) / len(s["logprobs"])) for s in scored],
            "reuse": [{k: s[k] for k in ("cached_tokens", "reused_tokens", "chain_status")} for s in scored],
            "seconds": round(time.monotonic() - t0, 1),
        }
        print(f"{name}: ppl {results[name]['ppl']:.3f} over {len(lps)} tokens ({results[name]['seconds']} s) "
              f"reuse {results[name]['reuse'][0]}", flush=True)
        write_json(args.out, {"command": "python " + " ".join(sys.argv), "machine": platform.platform(),
                              "settings": vars(args), "configs": {c: CONFIGS[c] for c in args.configs},
                              "results": results})
    base = results.get("dense", {}).get("ppl")
    print(f"\nheld-out essay text, {args.segments} x {args.length} tokens, scored over each segment's last "
          f"{args.length - args.context} (context {args.context} cached by the method)")
    print(f"{'config':<18}{'ppl':>9}{'vs dense':>10}{'tokens':>8}  reused (segment 1)")
    for name, r in results.items():
        ratio = f"{r['ppl'] / base:.3f}x" if base else "-"
        reuse = r["reuse"][0]
        print(f"{name:<18}{r['ppl']:>9.3f}{ratio:>10}{r['tokens']:>8}  "
              f"cached {reuse['cached_tokens']}, chain {reuse['reused_tokens']} ({reuse['chain_status']})")


if __name__ == "__main__":
    main()
