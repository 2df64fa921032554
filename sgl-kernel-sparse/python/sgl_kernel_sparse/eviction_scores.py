"""Plain-torch references of the online eviction scores (H2O, R-KV, SkipKV): the formulas the
methods call, and whole-sequence simulations the fidelity tests compare the engine with.

Index conventions as in ``reference``; in addition a *row* is an index into one KV head's
retained sequence (ascending logical positions; after an eviction rows and positions differ).
Every score is fp32. GQA: a KV head's score sums (H2O) or, for R-KV's importance, averages its
group's query heads; both are per KV head so an eviction frees physical rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sgl_kernel_sparse.reference import _scale, stable_topk, token_logits


def attention_sums(q, keys, q_rows, scale=None, weights=None, block=None):
    """``[Hkv, N]``: ``sum_i w_i sum_{h in group} A^h_{i,j}``, the causal softmax attention of
    queries ``q [S, Hq, D]`` over ``keys [N, Hkv, D]`` (query i sees rows ``<= q_rows[i]``),
    summed over the queries (weighted by ``weights [S]``, default 1) and over the query heads of
    each GQA group. Queries go in blocks of ``block`` (default: about 2^26 fp32 logits, 256 MB,
    per block: memory ``block * Hq * N``)."""
    s, hq, d = q.shape
    n, hkv = keys.shape[0], keys.shape[1]
    block = block or max(1, (1 << 26) // max(1, hq * n))
    k = keys.float().repeat_interleave(hq // hkv, dim=1)  # [N, Hq, D]
    cols = torch.arange(n, device=keys.device).view(1, -1)
    out = torch.zeros(hkv, n, dtype=torch.float32, device=keys.device)
    for lo in range(0, s, block):
        qb = q[lo: lo + block].float()
        logits = torch.einsum("shd,nhd->hsn", qb, k) * _scale(scale, d)  # [Hq, s_b, N]
        visible = cols <= q_rows[lo: lo + block].to(keys.device).view(-1, 1)
        probs = torch.softmax(logits.masked_fill(~visible.unsqueeze(0), float("-inf")), dim=-1)
        if weights is not None:
            probs = probs * weights[lo: lo + block].to(probs).view(1, -1, 1)
        out += probs.sum(dim=1).view(hkv, hq // hkv, n).sum(dim=1)
    return out


def decode_attention_add(scores, q, k_cache, req_to_token, req_rows, n_rows, new_slots, weight=None, scale=None):
    """In place, one decode step of one layer: ``scores [S, Hkv]`` (fp32, one per pool slot and
    KV head) gets each decode query's softmax attention over its request's rows ``[0, n_rows[b])``
    (row j at slot ``req_to_token[req_rows[b], j]``; the width of ``req_to_token`` bounds the rows),
    summed over the query heads of each KV head's group and scaled by ``weight[b]`` (default 1).
    First every query's own slot ``new_slots[b]`` is zeroed (a new token's score starts at zero,
    then counts its own attention). Entries with ``new_slots[b] == 0`` (SGLang's dummy slot: the
    padding of a captured batch) add nothing. ``q [B, Hq, D]``, ``k_cache [S, Hkv, D]``."""
    b, hq, _ = q.shape
    hkv = scores.shape[1]
    scores.index_fill_(0, new_slots.long(), 0.0)
    logits = token_logits(q, k_cache, req_to_token, req_rows, n_rows, scale)  # [B, Hq, W], -inf past n_rows
    w = logits.shape[2]
    probs = logits.softmax(dim=-1).view(b, hkv, hq // hkv, w).sum(dim=2)  # [B, Hkv, W]
    live = (new_slots != 0).to(probs.dtype)
    if weight is not None:
        live = live * weight.to(probs.dtype)
    probs = torch.nan_to_num(probs * live.view(b, 1, 1))  # a query with no rows: 0, not NaN
    slots = req_to_token[req_rows.long()].long()  # [B, W]; entries past n_rows carry probability 0
    heads = torch.arange(hkv, device=scores.device).view(1, hkv, 1)
    flat = slots.unsqueeze(1) * hkv + heads  # [B, Hkv, W]: index into scores viewed as [S * Hkv]
    scores.view(-1).scatter_add_(0, flat.reshape(-1), probs.reshape(-1))


def h2o_select(scores, budget, recent):
    """H2O's kept rows from accumulated scores ``[..., n]``: the last ``recent`` rows always, plus
    the top ``budget - recent`` of rows ``[0, n - recent)`` by score (ties to the lower row, a
    stable sort). ``n <= budget``: all rows. Returns ``[..., min(n, budget)]`` ascending."""
    n = scores.shape[-1]
    if n <= budget:
        return torch.arange(n, device=scores.device).expand(*scores.shape[:-1], n).clone()
    heavy = stable_topk(scores[..., : n - recent], budget - recent)  # rows [0, n - recent)
    tail = torch.arange(n - recent, n, device=scores.device).expand(*scores.shape[:-1], recent)
    return torch.cat([heavy, tail], dim=-1)


def rkv_redundancy(keys):
    """R-KV's redundancy per row, ``keys [..., Hkv, n, D]`` -> ``[..., Hkv, n]``: the cosine similarity of
    each key to every other key of its head (self-similarity 0), averaged over the n rows, then a
    softmax over the rows (so it sums to 1 per head, on the scale of the importance).

    By linearity the row mean needs no ``[n, n]`` similarity matrix: with unit keys ``u_j``,
    ``mean_j u_i . u_j (j != i) = (u_i . sum_j u_j - u_i . u_i) / n``, O(n d) per head instead of
    O(n^2 d) (a 32K prompt's matrix is 4 GB per KV head in fp32; test_online_eviction checks it
    against the matrix form)."""
    n = keys.shape[-2]
    k = keys.float()
    norm = k.norm(dim=-1)  # [..., Hkv, n]
    inv = 1.0 / (norm + 1e-8)  # u_j = k_j * inv_j, never materialized (a batch of requests' keys is large)
    total = torch.einsum("...n,...nd->...d", inv, k)  # [..., Hkv, D]: the sum of every row's unit key
    dot = torch.einsum("...nd,...d->...n", k, total) * inv  # u_i . sum_j u_j
    mean = (dot - (norm * inv) ** 2) / n  # self-similarity u_i . u_i left out
    return mean.softmax(dim=-1)


def rkv_redundancy_rows(k_cache, slots):
    """``rkv_redundancy`` of the rows requests hold in one layer of the pool: ``k_cache [S, Hkv,
    D]``, ``slots [R, n]`` (request r's row i in ``slots[r, i]``) -> ``[R, Hkv, n]``."""
    return rkv_redundancy(k_cache[slots.long()].transpose(1, 2))


def rkv_redundancy_layers(flat_k, slots, num_layers):
    """``rkv_redundancy_rows`` of every layer of a flat pool: ``flat_k [layers * S, Hkv, D]`` (layer
    l's slot s is row ``l * S + s``), ``slots [R, n]`` -> ``[R, layers, Hkv, n]``; layer by layer
    (one layer's gathered keys at a time)."""
    per_layer = flat_k.view(num_layers, -1, *flat_k.shape[1:])
    return torch.stack([rkv_redundancy_rows(per_layer[layer], slots) for layer in range(num_layers)], dim=1)


def rkv_select(importance, keys, budget, window, alpha, kernel, redundancy=None):
    """R-KV's kept rows of one layer: importance ``[Hkv, n]`` (mean attention of the buffered
    queries), keys ``[Hkv, n, D]``; or of several layers / requests at once, ``[..., Hkv, n]``
    and ``[..., Hkv, n, D]`` (each row of the leading dims on its own). Rows ``[n - window, n)``
    (the buffer's own tokens) are kept; of rows ``[0, n - window)`` the top ``budget - window`` by
    ``alpha * maxpool(importance) - (1 - alpha) * redundancy`` (max-pool of odd ``kernel``,
    stride 1, padding ``kernel // 2``; redundancy over all n rows, ``rkv_redundancy``), ties to
    the lower row. ``n <= budget``: all. ``redundancy``: ``rkv_redundancy(keys)`` computed
    already (e.g. read from the pool by ``rkv_redundancy_rows``; ``keys`` is then unused).
    Returns ``[..., Hkv, min(n, budget)]`` ascending."""
    lead, n = importance.shape[:-1], importance.shape[-1]
    if n <= budget:
        return torch.arange(n, device=importance.device).expand(*lead, n).clone()
    cand = n - window
    imp = importance[..., :cand].float()
    if kernel > 1:  # max_pool1d takes [N, C, L]: every leading row as its own sequence
        imp = F.max_pool1d(imp.reshape(-1, 1, cand), kernel, stride=1, padding=kernel // 2).view(*lead, cand)
    redundancy = rkv_redundancy(keys) if redundancy is None else redundancy
    score = alpha * imp - (1.0 - alpha) * redundancy[..., :cand]
    picked = stable_topk(score, budget - window)
    tail = torch.arange(cand, n, device=importance.device).expand(*lead, window)
    return torch.cat([picked, tail], dim=-1)


def segment_ids(boundary, max_segment):
    """SkipKV's segments over logical positions ``[0, N)`` from ``boundary [N]`` (bool: the token
    at that position ends a sentence): position p starts a new segment when p is 0, when token
    p - 1 is a boundary, or when the current segment already holds ``max_segment`` tokens (a
    sentence longer than that is cut into pieces of ``max_segment``). Returns ``[N]`` int64,
    non-decreasing, 0-based."""
    flags = [bool(b) for b in boundary.tolist()]
    out, seg, run = [], -1, 0
    for p in range(len(flags)):
        if p == 0 or run >= max_segment or flags[p - 1]:
            seg, run = seg + 1, 0
        out.append(seg)
        run += 1
    return torch.tensor(out, dtype=torch.int64)


def skipkv_select(scores, seg, budget, sinks, recent):
    """SkipKV's kept rows, shared by every layer and KV head: ``scores [layers, Hkv, n]``
    accumulated attention per row, ``seg [n]`` the segment id of each row (non-decreasing).
    Rows ``[0, sinks)`` and ``[n - recent, n)`` are always kept. The candidate rows
    ``[sinks, n - recent)`` form *units*: maximal runs of one segment id (a segment cut by the
    sinks or the recent window keeps its protected part; the rest is a unit of its own). A unit's
    score is the mean over its rows and over all layers and KV heads of the row scores. Units are
    dropped whole, lowest score first (ties: the later unit first, so the lower row stays), until
    at most ``budget`` rows remain: between ``budget - largest unit + 1`` and ``budget`` rows are
    kept. ``n <= budget``: all rows. Needs ``budget > sinks + recent``. Returns ``[B]`` ascending."""
    n = scores.shape[-1]
    if n <= budget:
        return torch.arange(n, device=scores.device)
    lo, hi = sinks, n - recent  # candidate rows [lo, hi)
    _, unit, size = torch.unique_consecutive(seg[lo:hi].to(scores.device), return_inverse=True,
                                             return_counts=True)  # unit[r - lo]: unit of row r
    row_score = scores.float().mean(dim=(0, 1))[lo:hi]
    unit_score = torch.zeros(size.numel(), device=scores.device).index_add_(0, unit, row_score) / size
    keep_order = torch.sort(unit_score, descending=True, stable=True).indices  # ties: lower unit first
    drop_order = keep_order.flip(0)
    covered = size[drop_order].cumsum(0)  # rows dropped after each unit of drop_order
    n_drop = int((covered < n - budget).sum()) + 1  # the first prefix that drops >= n - budget rows
    kept = torch.ones(n, dtype=torch.bool, device=scores.device)
    kept[lo:hi] = ~torch.isin(unit, drop_order[:n_drop])
    return kept.nonzero().view(-1)


# ------------------------------------------------------------------ whole-sequence simulations


def _simulate(q, k, steps, weights_of, evict):
    """One layer, per KV head: the retained positions after running ``steps`` (``(start, end,
    rows_at_prompt_end)`` token ranges in order: prompt chunks, then one token per decode step;
    ``rows_at_prompt_end`` is None for decode steps). Each step's queries attend (causally) the
    head's retained positions plus the step's own; ``weights_of(rows, step)`` weighs them,
    ``evict(head, held, scores, step)`` returns rows to keep or None."""
    hq, hkv = q.shape[1], k.shape[1]
    g = hq // hkv
    kept = []
    for h in range(hkv):
        held = torch.zeros(0, dtype=torch.int64)
        scores = torch.zeros(0)
        for step in steps:
            start, end, _ = step
            held = torch.cat([held, torch.arange(start, end)])
            scores = torch.cat([scores, torch.zeros(end - start)])
            rows = torch.arange(len(held) - (end - start), len(held))
            w = weights_of(rows, step)
            scores += attention_sums(q[start:end, h * g:(h + 1) * g], k[held, h: h + 1], rows, weights=w)[0]
            keep = evict(h, held, scores, step)
            if keep is not None:
                held, scores = held[keep], scores[keep]
        kept.append(held)
    return torch.stack(kept)


def _steps(prompt_lens, chunk, decode_after):
    """Prompt chunks of each turn (``prompt_lens``: the logical length after each turn's prompt;
    a later turn continues the sequence, as a Chain Cache continuation does) with
    ``decode_after[t]`` decode steps after turn t."""
    steps, pos = [], 0
    for p, dec in zip(prompt_lens, decode_after):
        while pos < p:
            end = min(pos + chunk, p)
            steps.append((pos, end, p))
            pos = end
        for _ in range(dec):
            steps.append((pos, pos + 1, None))
            pos += 1
    return steps


def _evicts_now(step, over, interval, evict_prefill) -> bool:
    """The online trigger of H2O, R-KV and SkipKV after ``step = (start, end, prompt_end)``:
    after the prompt's last chunk when over the budget at all; after a decode step, or (with
    ``evict_prefill``) any other prompt chunk, once ``interval`` or more rows are over it."""
    last_chunk = step[2] is not None and step[1] == step[2]
    if step[2] is not None and not last_chunk and not evict_prefill:
        return False  # the prompt is held whole until its last chunk
    return over > 0 and (last_chunk or over >= interval)


def h2o_simulate(q, k, budget, recent, interval, prompt_lens, chunk, decode_after, evict_prefill=False):
    """H2O on one layer's ``q [N, Hq, D]`` / ``k [N, Hkv, D]``: every query adds its attention to
    the scores of the rows it sees; after the prompt's last chunk the rows are evicted to
    ``budget`` (when over it), and after any other step once ``interval`` or more rows are over
    it -- decode steps, and with ``evict_prefill`` prompt chunks too (the next chunk's queries
    then see only the kept rows); without it the prompt is held whole until its last chunk.
    Returns the kept positions ``[Hkv, rows]``."""
    def evict(h, held, scores, step):
        if _evicts_now(step, len(held) - budget, interval, evict_prefill):
            return h2o_select(scores, budget, recent)
        return None

    return _simulate(q, k, _steps(prompt_lens, chunk, decode_after), lambda rows, step: None, evict)


def rkv_simulate(q, k, budget, window, interval, alpha, kernel, prompt_lens, chunk, decode_after):
    """R-KV on one layer: the buffered queries are the last ``window`` before each eviction: a
    query at row r counts when ``r >= E - window``, E the rows at which the next eviction fires
    (the prompt's rows at its end when they exceed ``budget``, else ``budget + interval``);
    importance = their attention summed over the buffer and the GQA group / ``(window * group)``,
    reset after each eviction. Evicts at the end
    of a prompt over ``budget`` and whenever the rows reach ``budget + interval``. Returns the kept
    positions ``[Hkv, rows]``."""
    def weights_of(rows, step):
        start, end, prompt_end = step
        e = budget + interval
        if prompt_end is not None:
            rows_end = int(rows[0]) + prompt_end - start
            e = rows_end if rows_end > budget else e
        return (rows >= e - window).float()

    def evict(h, held, scores, step):
        if _evicts_now(step, len(held) - budget, interval, evict_prefill=False):
            keys = k[held, h: h + 1].transpose(0, 1)  # [1, n, D]
            importance = scores / (window * (q.shape[1] // k.shape[1]))  # mean over buffer and group
            keep = rkv_select(importance[None], keys, budget, window, alpha, kernel)[0]
            scores.zero_()  # the buffer starts over
            return keep
        return None

    return _simulate(q, k, _steps(prompt_lens, chunk, decode_after), weights_of, evict)


def skipkv_simulate(q, k, boundary, budget, sinks, recent, interval, max_segment, prompt_lens, chunk,
                    decode_after, evict_prefill=False):
    """SkipKV over all layers: ``q`` / ``k`` lists (one per layer) of ``[N, Hq, D]`` /
    ``[N, Hkv, D]``, ``boundary [N]`` the sentence-ending tokens. Every query adds its attention
    to its rows' scores (as H2O); after the prompt's last chunk the rows are evicted to ``budget``
    if over it, and once ``interval`` rows are over it after a decode step -- or, with
    ``evict_prefill``, after a prompt chunk (the next chunk's queries then see only the kept rows);
    without it the prompt is held whole until its last chunk. The kept positions are shared by
    every layer and head (``skipkv_select``). Returns them ``[B]``."""
    seg = segment_ids(boundary, max_segment)
    layers, hkv = len(q), k[0].shape[1]
    g = q[0].shape[1] // hkv
    held = torch.zeros(0, dtype=torch.int64)
    scores = torch.zeros(layers, hkv, 0)
    for start, end, prompt_end in _steps(prompt_lens, chunk, decode_after):
        held = torch.cat([held, torch.arange(start, end)])
        scores = torch.cat([scores, torch.zeros(layers, hkv, end - start)], dim=2)
        rows = torch.arange(len(held) - (end - start), len(held))
        for layer in range(layers):
            for h in range(hkv):
                scores[layer, h] += attention_sums(q[layer][start:end, h * g:(h + 1) * g],
                                                   k[layer][held, h: h + 1], rows)[0]
        if _evicts_now((start, end, prompt_end), len(held) - budget, interval, evict_prefill):
            keep = skipkv_select(scores, seg[held], budget, sinks, recent)
            held, scores = held[keep], scores[:, :, keep]
    return held
