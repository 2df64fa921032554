"""Attention recall of Quest's page selection on the default model, per query head (the paper's
rule) and per KV head (``--sparse-select-per kv_head``) under several group rules.

For each context length x needle depth the needle-in-a-haystack prompt of ``bench_niah.py`` is
answered greedily with HF transformers (dense), and the prompt plus answer is run once more with
every attention layer's post-RoPE queries and keys captured. At each decode position ``t`` (the
answer's tokens: the queries Quest serves; prefill stays dense) and each layer from
``--dense-layers`` on, the keys ``[0, t]`` are cut into 16-token pages (the last one partial, as
Quest's running summaries), each query head's upper bounds are computed by
``sgl_kernel_sparse.reference.quest_page_scores`` and each rule picks ``budget / 16`` pages
(``reference.quest_select_pages``: ties to the lower page):

- ``head``: per query head by its own bound (Quest as published);
- ``kv_sum``: one set per KV head by the sum of its query heads' bounds (what ``kv_head`` serves);
- ``kv_softmax``: one set per KV head by the sum over its query heads of each head's softmax over
  pages of its bounds (times the attention scale): every head has the same say, whatever the
  scale of its logits;
- ``oracle_head`` / ``oracle_kv``: per query head / per KV head (group sum) by the true attention
  mass of each page: the best any page selection of that size could do.

Reported, averaged over prompts, decode positions, sparse layers and query heads: ``recall``, the
share of the dense attention mass that falls in the pages read; ``needle``, the share of the
needle's pages among them; ``pages``, distinct pages read per KV head (a KV-head set is read once
for its group; per-head sets are read as their union).

    python benchmark/bench_quest_recall.py                 # ~5 min on 2 CPU cores
    python benchmark/bench_quest_recall.py --lengths 2048 --depths 0.5 --budgets 256
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_niah import NEEDLE, build_prompt, essays_tokens  # noqa: E402
from common import write_json  # noqa: E402

from sgl_kernel_sparse import reference  # noqa: E402
from sglang_sparse.default_model import ensure_default_model  # noqa: E402
from sglang_sparse.kernels.quest_pages import group_scores  # noqa: E402

PAGE = 16
RULES = ("head", "kv_sum", "kv_softmax", "oracle_head", "oracle_kv")


def capture(model, ids: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Post-RoPE (q ``[Hq, T, D]``, k ``[Hkv, T, D]``) of every attention layer for ``ids``: a
    pre-hook on each attention module recomputes its projections and rotary embedding from the
    inputs the model gives it (the model's own functions; nothing is patched)."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    out = []

    def hook(module, args, kwargs):
        hs = kwargs.get("hidden_states", args[0] if args else None)
        cos, sin = kwargs["position_embeddings"]
        shape = (*hs.shape[:-1], -1, module.head_dim)
        q = module.q_proj(hs).view(shape).transpose(1, 2)
        k = module.k_proj(hs).view(shape).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        out.append((q[0].float(), k[0].float()))

    handles = [layer.self_attn.register_forward_pre_hook(hook, with_kwargs=True) for layer in model.model.layers]
    try:
        with torch.no_grad():
            model(torch.tensor([ids]))
    finally:
        for h in handles:
            h.remove()
    return out


def page_summaries(k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Channel-wise min / max per 16-token page of ``k [Hkv, L, D]`` (the last page over its valid
    tokens only) as ``[1, P, Hkv, D]``, the layout ``reference.quest_page_scores`` reads."""
    hkv, length, d = k.shape
    pages = -(-length // PAGE)
    pad = pages * PAGE - length
    lo = torch.nn.functional.pad(k, (0, 0, 0, pad), value=float("inf")).view(hkv, pages, PAGE, d).amin(2)
    hi = torch.nn.functional.pad(k, (0, 0, 0, pad), value=float("-inf")).view(hkv, pages, PAGE, d).amax(2)
    return lo.permute(1, 0, 2)[None], hi.permute(1, 0, 2)[None]


def rule_scores(rule: str, bounds: torch.Tensor, mass: torch.Tensor, group: int, scale: float) -> torch.Tensor:
    """``[1, H, P]`` scores a rule ranks pages by (H = Hq per query head, Hkv per KV head)."""
    if rule == "head":
        return bounds
    if rule == "kv_sum":
        return group_scores(bounds, group)
    if rule == "kv_softmax":
        return group_scores(torch.softmax(bounds * scale, dim=-1), group)
    if rule == "oracle_head":
        return mass
    return group_scores(mass, group)  # oracle_kv


def measure(layers, t: int, needle_pages: torch.Tensor, n_sel: int, dense_layers: int) -> dict:
    """Per rule: mean recall, needle coverage and distinct pages per KV head at decode position
    ``t`` (keys ``[0, t]``) over the sparse layers and query heads."""
    sums = {r: [0.0, 0.0, 0.0] for r in RULES}
    count = 0
    n_pages = -(-(t + 1) // PAGE)  # the same pages in every layer
    is_needle = torch.zeros(n_pages, dtype=torch.bool)
    is_needle[needle_pages[needle_pages < n_pages]] = True
    for q_all, k_all in layers[dense_layers:]:
        hq, _, d = q_all.shape
        group = hq // k_all.shape[0]
        q, k = q_all[:, t], k_all[:, : t + 1]  # [Hq, D], [Hkv, t+1, D]
        kmin, kmax = page_summaries(k)
        bounds = reference.quest_page_scores(q[None], kmin, kmax, torch.tensor([n_pages]))  # [1, Hq, P]
        scale = d ** -0.5
        probs = torch.softmax(torch.einsum("hd,hld->hl", q, k.repeat_interleave(group, 0)) * scale, dim=-1)
        pad = n_pages * PAGE - (t + 1)
        mass = torch.nn.functional.pad(probs, (0, pad)).view(hq, n_pages, PAGE).sum(-1)[None]  # [1, Hq, P]
        for rule in RULES:
            picked = reference.quest_select_pages(rule_scores(rule, bounds, mass, group, scale), n_sel)[0].long()
            if picked.shape[0] != hq:  # one set per KV head, read by each of its query heads
                picked = picked.repeat_interleave(group, 0)
            sel = torch.zeros(hq, n_pages, dtype=torch.bool)
            sel.scatter_(1, picked.clamp(min=0), picked >= 0)
            s = sums[rule]
            s[0] += float((mass[0] * sel).sum(-1).sum())
            s[1] += float((sel & is_needle).sum(-1).float().sum() / max(1, int(is_needle.sum())))
            s[2] += float(sel.view(-1, group, n_pages).any(1).sum(-1).float().sum()) * group  # union per KV head
        count += hq
    return {r: dict(recall=s[0] / count, needle=s[1] / count, pages=s[2] / count) for r, s in sums.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 7680])
    ap.add_argument("--depths", type=float, nargs="+", default=[0.25, 0.5, 0.75])
    ap.add_argument("--budgets", type=int, nargs="+", default=[256, 1024], help="Quest's token budget")
    ap.add_argument("--decode", type=int, default=16, help="answer tokens generated; their queries are measured")
    ap.add_argument("--dense-layers", type=int, default=2, help="Quest's dense first layers (not measured)")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    ap.add_argument("--out", default="quest_recall_cpu.json")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = ensure_default_model()
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    haystack = essays_tokens(tok)
    needle = tok.encode(NEEDLE, add_special_tokens=False)
    cells: dict[str, dict] = {}
    totals = {(b, r): [] for b in args.budgets for r in RULES}
    t0 = time.monotonic()
    for length in args.lengths:
        for depth in args.depths:
            prompt = build_prompt(tok, haystack, length, depth)
            with torch.no_grad():
                full = model.generate(torch.tensor([prompt]), max_new_tokens=args.decode, do_sample=False)[0].tolist()
            at = next(i for i in range(len(prompt)) if prompt[i: i + len(needle)] == needle)
            needle_pages = torch.unique(torch.arange(at, at + len(needle)) // PAGE)
            layers = capture(model, full[:-1])
            # decode step j feeds answer token j (position len(prompt) + j) and attends keys [0, that]
            positions = range(len(prompt), len(full) - 1)
            cell = {}
            for budget in args.budgets:
                per_t = [measure(layers, t, needle_pages, max(3, budget // PAGE), args.dense_layers)
                         for t in positions]
                cell[str(budget)] = {r: {m: sum(x[r][m] for x in per_t) / len(per_t) for m in ("recall", "needle",
                                                                                                "pages")}
                                     for r in RULES}
                for r in RULES:
                    totals[(budget, r)].append(cell[str(budget)][r])
            cells[f"{length}@{depth}"] = dict(length=length, depth=depth, answer=tok.decode(full[len(prompt):]),
                                              results=cell)
            print(f"{length} tokens, needle at {depth}: "
                  + "; ".join(f"{b}: " + " ".join(f"{r} {cell[str(b)][r]['recall']:.3f}" for r in RULES)
                              for b in args.budgets), flush=True)
    summary = {str(b): {r: {m: sum(x[m] for x in totals[(b, r)]) / len(totals[(b, r)])
                            for m in ("recall", "needle", "pages")} for r in RULES} for b in args.budgets}
    print(f"\nmean over {len(cells)} prompts x {args.decode - 1} decode positions x sparse layers x query heads "
          f"({time.monotonic() - t0:.0f} s)")
    print(f"{'budget':>6} {'rule':<12} {'recall':>7} {'needle':>7} {'pages/KV head':>14}")
    for b in args.budgets:
        for r in RULES:
            s = summary[str(b)][r]
            print(f"{b:>6} {r:<12} {s['recall']:>7.3f} {s['needle']:>7.3f} {s['pages']:>14.1f}")
    path = write_json(args.out, {"command": "python " + " ".join(sys.argv), "machine": platform.platform(),
                                 "model": str(model_dir), "page": PAGE, "settings": vars(args), "summary": summary,
                                 "cells": cells})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
