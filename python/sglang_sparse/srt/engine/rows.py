"""Rows vs logical positions inside SGLang: the one place that keeps them apart.

SGLang assumes a request's ``req_to_token`` row holds one slot per logical token: ``seq_lens``,
``prefix_lens`` and ``kv_allocated_len`` count both, and decode positions are ``seq_lens - 1``.
A request of sglang_sparse may hold fewer rows than it has logical tokens:

```
 logical   0 ................... N-1 | N ........ N+s-1      N: tokens before this extend
 rows      0 ...... P-1 | P ...... P+s-1                      P <= N rows hold KV for them
           (kept)         (the extend's own rows)
 offset = N - P           RoPE position of row r (r >= P) = r + offset = its logical position
```

P < N after SnapKV compacted a request (it keeps budget rows), after H2O compacted a request
between two of its prompt chunks (``evict_prefill``), for a request resuming a chain's
compacted rows, and for a request matching a pruned radix path (the tree holds P slots for N
tokens). Here:

- ``set_row_lengths``: the one patch of a batch's lengths to rows (``seq_lens``, its CPU copy,
  ``orig_seq_lens``, ``seq_lens_sum``, the requests' ``kv_allocated_len`` / ``kv_committed_len``);
- ``after_prepare_for_extend``: SGLang wrote the extend's slots at ``row[N:N+s]`` and counted N
  prefix rows; they move to ``row[P:P+s]`` and the lengths become rows;
- ``follow_compaction``: at the safe point, a compacted request's lengths become its rows;
  ``follow_chunk_compaction`` the same for a request compacted between two prompt chunks;
- ``before_model_forward``: RoPE positions get the per-row offset (``STATE.scheduler.pos_offset``,
  indexed by ``req_to_token`` row), eager and CUDA-graph replay alike (SGLang's graph runner
  copies ``forward_batch.positions`` into its buffers after this point). While no row holds an
  offset (``STATE.scheduler.offset_rows`` is empty: dense, Quest, any request before eviction)
  the step launches nothing here.
"""

from __future__ import annotations

from sglang_sparse.srt.state import STATE, sparse


def set_row_lengths(batch, rows: dict[int, int]) -> None:
    """Batch entry i now has ``rows[i]`` resident rows. New tensors, never in place: queued
    copies of the batch (overlap scheduler) may share the old ones."""
    if not rows:
        return
    seq_lens, seq_cpu, orig = batch.seq_lens.clone(), batch.seq_lens_cpu.clone(), batch.orig_seq_lens.clone()
    for i, n in rows.items():
        seq_lens[i] = seq_cpu[i] = orig[i] = n
        kv = batch.reqs[i].kv
        kv.kv_allocated_len = kv.kv_committed_len = n
    batch.seq_lens, batch.seq_lens_cpu, batch.orig_seq_lens = seq_lens, seq_cpu, orig
    batch.seq_lens_sum = int(seq_cpu.sum())


def set_offset(row: int, off: int) -> None:
    """Row ``row``'s RoPE offset, on the device and in the host-side set of rows that hold one
    (the set lets ``before_model_forward`` skip its gather and add without reading the device)."""
    st = STATE.scheduler
    if off:
        st.offset_rows.add(row)
    elif row in st.offset_rows:
        st.offset_rows.discard(row)
    else:
        return  # already 0 on the device
    st.pos_offset[row] = off


def request_offset(req) -> int:
    """Logical tokens without KV before the request's rows (set at its first extend; a
    compaction between prompt chunks raises it, ``follow_chunk_compaction``)."""
    st = sparse(req)
    if st.offset is None:
        st.offset = st.start_offset
    return st.offset


def after_prepare_for_extend(result, batch, *args, **kwargs):
    offsets = [request_offset(req) for req in batch.reqs]
    if not any(offsets):
        return None
    table = batch.req_to_token_pool.req_to_token
    prefix, lengths = list(batch.prefix_lens), {}
    for i, (req, off) in enumerate(zip(batch.reqs, offsets)):
        if not off:
            continue
        row, logical, s = req.kv.req_pool_idx, prefix[i], batch.extend_lens[i]
        resident = logical - off  # P: the request's rows before this extend
        table[row, resident: resident + s] = table[row, logical: logical + s].clone()
        prefix[i] = resident
        lengths[i] = resident + s
        set_offset(row, off)
    batch.prefix_lens = prefix
    set_row_lengths(batch, lengths)
    return None


def follow_compaction(batch) -> None:
    """After the safe point compacted requests of ``batch``: their lengths follow their rows."""
    ctl = STATE.scheduler.controller
    lengths = {}
    for i, req in enumerate(batch.reqs):
        known = ctl.cache.requests.get(req.rid)
        if known is None or known.retained.n_rows == req.kv.kv_allocated_len:
            continue
        lengths[i] = known.retained.n_rows  # compacted: the request now owns rows [0, n_rows)
        set_offset(req.kv.req_pool_idx, known.retained.offset)
    set_row_lengths(batch, lengths)


def follow_chunk_compaction(req) -> None:
    """A request compacted between two prompt chunks (not in any batch):

    ```
     logical  0 ............................ N-1 | N ... N+s-1   N = req.prefix_len (SGLang's
     rows     0 .. P-1 | (stale P .. N-1)          next chunk)   index into its fill ids, kept)
              kept      freed slots, no longer the request's
    ```

    SGLang keeps ``req.prefix_len`` = N (its next chunk is fill ids ``[N, N+s)``); the request owns
    rows ``[0, P)`` (``kv_allocated_len`` / ``kv_committed_len`` = P, the freed slots are back in
    SGLang's allocator); the offset N - P becomes the request's RoPE offset, so the next
    extend's slots move from ``row[N:N+s]`` to ``row[P:P+s]`` and get logical positions
    (``after_prepare_for_extend``), as a resumed chain's suffix does."""
    known = STATE.scheduler.controller.cache.requests[req.rid]
    ret = known.retained
    assert ret.logical_len == req.prefix_len, (req.rid, ret.logical_len, req.prefix_len)
    req.kv.kv_allocated_len = req.kv.kv_committed_len = ret.n_rows
    sparse(req).offset = ret.offset
    set_offset(req.kv.req_pool_idx, ret.offset)


def before_model_forward(runner, forward_batch=None, *args, **kwargs):
    """Logical RoPE positions for rows with logical tokens without KV before them."""
    pos_offset = STATE.scheduler.pos_offset
    if pos_offset is None or forward_batch is None or not STATE.scheduler.offset_rows:
        return None
    mode = forward_batch.forward_mode
    if mode.is_decode():
        offset = pos_offset[forward_batch.req_pool_indices]
    elif mode.is_extend() and forward_batch.extend_seq_lens is not None:
        offset = pos_offset[forward_batch.req_pool_indices].repeat_interleave(
            forward_batch.extend_seq_lens.to(pos_offset.device))
    else:
        return None
    forward_batch.positions = forward_batch.positions + offset.to(forward_batch.positions.dtype)
    return None


def on_release(req) -> None:
    """The request leaves: a retracted request that comes back prefills from scratch."""
    st = sparse(req)
    st.offset, st.start_offset, st.gap = None, 0, 0
    if STATE.scheduler.pos_offset is not None and req.kv.req_pool_idx is not None:
        set_offset(req.kv.req_pool_idx, 0)
