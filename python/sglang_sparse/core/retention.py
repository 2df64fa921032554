"""The retention map: which logical positions keep KV, per layer and KV head (engine-agnostic).

``GET /chain/{id}/retention`` and ``GET /sparse/requests/{rid}/retention`` answer it
(``docs/chain_cache.md``). Index ranges, as in ``core/retained``:

```
 logical positions  0 .................................... L-1      L = logical_len
 kept (layer l, head h): an ascending subset of [0, L), written as half-open runs
                    [[s0, e0), [s1, e1), ...]  with  s0 < e0 < s1 < e1 ...
 rows (resident)    what the engine holds; a method with a store of its own (KIVI's quantized
                    blocks, RetroInfer's host tier) keeps positions that have no row
```

A method reports its map through ``SparseMethodRuntime.kept_positions`` (default: the rows of the
request's ``RetainedMap``, ``resident_positions``); this module builds and describes it.
"""

from __future__ import annotations

import torch

from sglang_sparse.core.retained import RetainedMap


def resident_positions(ret: RetainedMap) -> list[torch.Tensor]:
    """Per layer, ``[kv_heads, n_l]``: the logical position each resident row holds (ascending).

    An identity map (no compaction yet) with ``offset = logical_len - n_rows > 0`` (a request
    whose rows start after logical tokens held elsewhere: KIVI's cached blocks) has rows
    ``r -> r + offset``, the engine's RoPE rule (``srt/engine/rows.py``)."""
    if ret.is_identity and not ret.per_layer:
        rows = torch.arange(ret.offset, ret.logical_len, dtype=torch.int64)
        return [rows.expand(ret.kv_heads, -1) for _ in range(ret.num_layers)]
    return [ret.layer_positions(layer) for layer in range(ret.num_layers)]


def all_positions(ret: RetainedMap) -> list[torch.Tensor]:
    """Every logical position ``[0, logical_len)`` in every layer and head (a method that keeps
    all of them, in rows or in a store of its own)."""
    every = torch.arange(ret.logical_len, dtype=torch.int64)
    return [every.expand(ret.kv_heads, -1) for _ in range(ret.num_layers)]


def with_prefix(positions: list[torch.Tensor], prefix: int) -> list[torch.Tensor]:
    """``positions`` plus logical ``[0, prefix)`` in every layer and head (held outside the rows,
    before them: KIVI's quantized blocks). The rows must hold positions ``>= prefix`` only."""
    if prefix <= 0:
        return positions
    head = torch.arange(prefix, dtype=torch.int64)
    return [torch.cat([head.expand(p.shape[0], -1), p], dim=1) for p in positions]


def runs(positions: torch.Tensor) -> list[list[int]]:
    """Ascending logical positions ``[n]`` as half-open runs ``[[start, end), ...]``."""
    if positions.numel() == 0:
        return []
    p = positions.to(torch.int64)
    breaks = torch.nonzero(p[1:] != p[:-1] + 1).flatten() + 1  # first index of each later run
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), breaks])
    ends = torch.cat([breaks, torch.tensor([p.numel()])])
    return [[int(p[s]), int(p[e - 1]) + 1] for s, e in zip(starts.tolist(), ends.tolist())]


def check_layers(layers, num_layers: int) -> list[int]:
    """The layers a caller asked for (None: all), or ValueError with a sentence."""
    if layers is None:
        return list(range(num_layers))
    bad = [x for x in layers if not isinstance(x, int) or isinstance(x, bool) or not 0 <= x < num_layers]
    if bad:
        raise ValueError(f"layer {bad[0]!r} is out of range; the model has {num_layers} layers (0 to {num_layers - 1})")
    return sorted(set(layers))


def describe(positions: list[torch.Tensor], logical_len: int, layers: list[int], explicit: bool = False) -> dict:
    """The JSON body: ``logical_len``, the kept count and fraction over the chosen layers, and per
    layer and KV head the kept positions as runs (``explicit``: as a plain list as well)."""
    heads = int(positions[0].shape[0]) if positions else 0
    out_layers, total = [], 0
    for layer in layers:
        per_head = []
        for h in range(heads):
            p = positions[layer][h]
            entry = {"head": h, "kept": int(p.numel()), "ranges": runs(p)}
            if explicit:
                entry["positions"] = p.tolist()
            per_head.append(entry)
        kept = sum(e["kept"] for e in per_head)
        total += kept
        out_layers.append({"layer": layer, "kept": kept, "heads": per_head})
    full = logical_len * heads * len(layers)
    return {"logical_len": logical_len, "num_layers": len(positions), "kv_heads": heads, "kept": total,
            "kept_fraction": round(total / full, 6) if full else None, "layers": out_layers}
