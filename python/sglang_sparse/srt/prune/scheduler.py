"""Prefix-cache pruning inside the scheduler (``POST /prune``; the HTTP side is ``prune/http.py``).

One pruning job, all on the scheduler's thread:

1. **plan** (control op ``prune_plan``): validate the intervals against the logical radix tree
   (cached, page aligned, idle), remember the retained positions and slots of ``[L, R)``;
2. **probe**: the HTTP side sends a normal generation request tagged
   ``custom_params.sglang_sparse_probe = <prune_id>`` (1 output token, never inserted into the
   tree). It is scheduled, batched and chunked like any request. In every layer of its prefill
   ``capture`` (called by the attention backend) scores the interval's slots from the probe's
   attention (``core.pruning``): snapkv recomputes the observation window (the match is capped
   before it), kvzip teacher-forces "repeat the context" + the interval tokens;
3. **apply** (``prune_apply``): one keep mask, applied to the tree nodes only if no request reads
   them (else ``blocked``, nothing changed); the dropped slots go back to SGLang's allocator and
   the nodes carry a pruning record.

Rows vs logical: a later request matching the pruned path holds its P retained slots in rows
``[0, P)`` for N logical tokens (``cache/radix.py``); nothing here changes running requests.
"""

from __future__ import annotations

import torch
from sgl_kernel_sparse.reference import SNAPKV_WINDOW, attention_probs

from sglang_sparse.core import pruning
from sglang_sparse.core.logical_tree import PruneBlocked
from sglang_sparse.srt.admin.ops import PrefixDelete, PrefixInspect, PrefixPriority, PruneApply, PruneForget, PrunePlan
from sglang_sparse.srt.parallel import dp_rank  # answers to an admin operation arrive in any rank order
from sglang_sparse.srt.prune.job import PROBE_KEY, Job
from sglang_sparse.srt.state import STATE, sparse

class PruneError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


# -- plan ------------------------------------------------------------------------------------------
def _cache(scheduler):
    cache = scheduler.tree_cache
    if getattr(cache, "tree", None) is None:
        raise PruneError(409, "pruning needs sglang_sparse's radix cache (--radix-cache-backend sglang_sparse)")
    if getattr(cache, "units_on", False):
        raise PruneError(409, f"the radix cache holds {STATE.scheduler.controller.runtime.name}'s stored payload "
                              "(quantized blocks), not KV slots: /prune drops slots of a model-precision prefix "
                              "and cannot prune it")
    if not cache.tree_on:
        method = (STATE.scheduler.controller.runtime.name if STATE.scheduler.controller is not None else "this method")
        raise PruneError(409, f"the radix cache is off ({method} evicts KV itself, or --disable-radix-cache "
                              "was given): there is no cached prefix to prune")
    return cache


def _ranges(raw, n_tokens: int, page: int) -> list[tuple[int, int]]:
    if not isinstance(raw, list) or not raw:
        raise PruneError(400, "ranges must be a non-empty list of [L, R] intervals")
    out = []
    for item in raw:
        if (not isinstance(item, (list, tuple)) or len(item) != 2
                or not all(isinstance(x, int) and not isinstance(x, bool) for x in item)):
            raise PruneError(400, f"interval {item!r} is not a pair of integers [L, R]")
        left, right = item
        if not 0 <= left < right:
            raise PruneError(400, f"interval [{left}, {right}) is empty or reversed: need 0 <= L < R")
        if right > n_tokens:
            raise PruneError(400, f"interval [{left}, {right}) ends past the sequence ({n_tokens} tokens)")
        if left % page or right % page:
            raise PruneError(400, f"interval [{left}, {right}) is not aligned to the KV page size {page}: "
                                  "L and R must be multiples of it")
        out.append((left, right))
    out.sort()
    for (a, b), (c, d) in zip(out, out[1:]):
        if c < b:
            raise PruneError(400, f"intervals [{a}, {b}) and [{c}, {d}) overlap")
    return out


def plan(scheduler, op: PrunePlan) -> dict:
    cache = _cache(scheduler)
    tree = cache.tree
    tokens = [int(t) for t in op.token_ids]
    policy = op.policy
    try:
        pruning.check_policy(policy)
        ranges = _ranges(op.ranges, len(tokens), tree.page)
        ns = (op.extra_key, op.cache_salt)
        matched = tree.match(tokens, ns).length
        if matched < ranges[-1][1]:
            raise PruneError(404, f"the sequence is not cached that far: {matched} of its first "
                                  f"{ranges[-1][1]} tokens are in the prefix cache")
        pieces = [tree.retained_in(tree.interval_nodes(tokens, a, b, ns)) for a, b in ranges]
        positions = torch.cat([p for p, _ in pieces])
        slots = torch.cat([s for _, s in pieces])
        keep = pruning.keep_count(int(positions.numel()), op.keep_ratio, op.keep_tokens, tree.page)
    except pruning.PruneRequestError as err:
        raise PruneError(400, str(err)) from None
    except PruneBlocked as err:
        return {"status": "blocked", "reason": str(err)}
    cap = None
    if policy == "snapkv":
        window = min(SNAPKV_WINDOW, len(tokens) - ranges[-1][1])
        if window < 1:
            raise PruneError(400, "the snapkv policy observes the interval from the tokens after it; "
                                  "the sequence ends where the last interval does (use kvzip)")
        cap = len(tokens) - window
    prune_id = op.prune_id
    STATE.scheduler.prune_jobs[prune_id] = Job(prune_id, tokens, ns, ranges, policy, keep, positions, slots, cap)
    return {"status": "queued", "prune_id": prune_id, "original_tokens": sum(b - a for a, b in ranges),
            "retained_tokens": int(positions.numel()), "keep_tokens": keep, "dp_rank": dp_rank()}


# -- probe -----------------------------------------------------------------------------------------
def after_create_req(req, scheduler, recv_req, *args, **kwargs):
    """Tag a probe request (it must not start a chain or enter the tree)."""
    params = getattr(getattr(req, "sampling_params", None), "custom_params", None) if req is not None else None
    if not isinstance(params, dict) or PROBE_KEY not in params:
        return None
    job = STATE.scheduler.prune_jobs.get(str(params[PROBE_KEY]))
    if job is None:
        req.set_finish_with_abort(f"unknown pruning job {params[PROBE_KEY]!r}", status_code=404)
        return None
    st = sparse(req)
    st.probe, st.probe_cap = job, job.probe_cap
    req.skip_radix_cache_insert = True
    return None


def after_prepare_for_extend(result, batch, *args, **kwargs):
    """After allocation: which req_to_token rows belong to probes (``capture`` sees rows only)."""
    for req in batch.reqs:
        job = sparse(req).probe
        if job is not None:
            STATE.scheduler.probe_rows[req.kv.req_pool_idx] = job
    return None


def on_release(req) -> None:
    if sparse(req).probe is not None and req.kv.req_pool_idx is not None:
        STATE.scheduler.probe_rows.pop(req.kv.req_pool_idx, None)


QUERY_BLOCK = 128


def capture(backend, q, layer, forward_batch) -> None:
    """Score the interval slots of every probe in this extend batch for this layer."""
    rows = forward_batch.req_pool_indices.tolist()
    hits = [(i, STATE.scheduler.probe_rows[r]) for i, r in enumerate(rows) if r in STATE.scheduler.probe_rows]
    if not hits:
        return
    ext, prefix = forward_batch.extend_seq_lens_cpu, forward_batch.extend_prefix_lens_cpu
    q3 = q.reshape(-1, layer.tp_q_head_num, layer.qk_head_dim)
    k_buf = backend.token_to_kv_pool.get_key_buffer(layer.layer_id)
    table = backend.req_to_token_pool.req_to_token
    for i, job in hits:
        start, s, p = sum(ext[:i]), ext[i], prefix[i]
        row_slots = table[rows[i], : p + s].to(torch.int64)
        idx = job.index_of(row_slots.cpu())
        cols = (idx >= 0).nonzero().flatten()
        if cols.numel() == 0:
            continue
        keys = k_buf[row_slots]
        per_head = None
        for b in range(0, s, QUERY_BLOCK):  # bounded memory: [Hq, block, rows]
            e = min(s, b + QUERY_BLOCK)
            probs = attention_probs(q3[start + b: start + e].cpu(), keys.cpu(),
                                            torch.arange(p + b, p + e), layer.scaling)
            part = pruning.reduce_queries(job.policy, probs[:, :, cols])
            per_head = part if per_head is None else pruning.combine(job.policy, per_head, part)
        score = pruning.finish_layer(job.policy, per_head)
        at = idx[cols]
        job.scores[at] = torch.maximum(job.scores[at], score)
        job.layers_seen.add(layer.layer_id)


# -- apply -----------------------------------------------------------------------------------------
def apply(scheduler, op: PruneApply) -> dict:
    result = _apply(scheduler, op)
    if "status" in result and not isinstance(result["status"], int):
        result["dp_rank"] = dp_rank()
    return result


def _apply(scheduler, op: PruneApply) -> dict:
    job = STATE.scheduler.prune_jobs.pop(op.prune_id, None)
    if job is None:
        raise PruneError(404, f"unknown pruning job {op.prune_id!r}")
    cache = _cache(scheduler)
    tree = cache.tree
    if not job.layers_seen:
        return {"status": "failed", "reason": "the probe request did not run (aborted?)"}
    try:
        per_range = [tree.interval_nodes(job.tokens, a, b, job.namespace) for a, b in job.ranges]
    except PruneBlocked as err:
        return {"status": "blocked", "reason": str(err)}
    except KeyError as err:
        return {"status": "failed", "reason": f"the prefix left the cache while it was scored: {err}"}
    now = [tree.retained_in(nodes) for nodes in per_range]
    if not torch.equal(torch.cat([s for _, s in now]), job.slots):
        return {"status": "failed", "reason": "the cached prefix changed while it was scored"}
    # a token's score is the maximum over layers and heads: under tensor parallelism each rank
    # scored its own heads, so the maximum over ranks gives every rank the same mask
    STATE.scheduler.controller.cache.heads.max_(job.scores)
    always = job.positions < pruning.KVZIP_SINKS if job.policy == "kvzip" else None
    mask = pruning.keep_mask(job.scores, job.positions, job.keep, tree.page, always)
    record = {"prune_id": job.prune_id, "policy": job.policy,
              "ranges": [list(r) for r in job.ranges], "kept_tokens": int(mask.sum())}
    freed, at = 0, 0
    for nodes, (pos, _) in zip(per_range, now):
        dropped = tree.apply_keep(nodes, mask[at: at + pos.numel()], record)
        at += pos.numel()
        cache.free_tree_slots(dropped)
        freed += int(dropped.numel())
    return {"status": "completed", "retained_tokens": int(mask.sum()), "freed_slots": freed}


def forget(op: PruneForget) -> dict:
    STATE.scheduler.prune_jobs.pop(op.prune_id, None)
    return {"status": "forgotten"}


# -- inspection and admin (appendix B.2) -----------------------------------------------------------
def inspect(scheduler, op: PrefixInspect) -> dict:
    cache = _cache(scheduler)
    tree = cache.tree
    tokens = [int(t) for t in op.token_ids]
    ns = (op.extra_key, op.cache_salt)
    m = tree.match(tokens, ns)
    blocks, start = [], 0
    for node in tree.path(m.node):
        blocks.append({"start": start, "end": start + len(node.key), **tree.describe(node)})
        start += len(node.key)
    return {"status": 200, "cached_tokens": m.length, "retained_tokens": int(m.slots.numel()), "blocks": blocks}


def set_priority(scheduler, op: PrefixPriority) -> dict:
    cache = _cache(scheduler)
    tokens = [int(t) for t in op.token_ids]
    priority = op.priority
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise PruneError(400, "priority must be an integer (higher is evicted later)")
    m = cache.tree.match(tokens, (op.extra_key, op.cache_salt))
    if m.length == 0:
        raise PruneError(404, "the sequence is not in the prefix cache")
    for node in cache.tree.path(m.node):
        node.priority = priority
    return {"status": 200, "cached_tokens": m.length, "priority": priority}


def delete_prefix(scheduler, op: PrefixDelete) -> dict:
    cache = _cache(scheduler)
    tokens = [int(t) for t in op.token_ids]
    m = cache.tree.match(tokens, (op.extra_key, op.cache_salt))
    if m.length < len(tokens) - len(tokens) % cache.tree.page or m.length == 0:
        raise PruneError(404, f"the sequence is not cached (only {m.length} tokens match)")
    try:
        freed = cache.tree.delete_subtree(m.node)
    except PruneBlocked as err:
        raise PruneError(409, f"cannot delete: {err}") from None
    cache.free_tree_slots(freed)
    return {"status": 200, "freed_slots": int(freed.numel())}
