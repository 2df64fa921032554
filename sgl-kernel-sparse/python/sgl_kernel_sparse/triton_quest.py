"""Quest: page upper-bound scores from per-page key summaries (channel-wise min / max).

Page ``p`` of a request covers positions ``[p*PAGE, (p+1)*PAGE)``. Summaries are either one row
per request (``quest_page_scores``: ``kmin/kmax [S, P_max, Hkv, D]``, row ``summary_rows[b]``) or
per physical page of the KV pool (``quest_page_scores_paged``, what sglang_sparse's Quest keeps:
``[N_pages, Hkv, D]``, row-page p of request b is ``req_to_token[req_rows[b], p*PAGE] // PAGE``);
any float dtype. The summaries themselves are kept by ``sglang_sparse.kernels.quest_pages``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import tuning
from .triton_common import check_device, check_gqa, check_rows, check_table, pow2


@triton.jit
def _quest_scores_kernel(
    Q, KMIN, KMAX, SUM_ROWS, N_PAGES, OUT, P, TABLE,
    s_qb, s_qh, s_mr, s_mp, s_mh, s_xr, s_xp, s_xh, s_ob, s_oh, s_t,
    GROUP: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_P: tl.constexpr,
    PAGE: tl.constexpr, PAGED: tl.constexpr,
):
    """Program (b, g, pb): pages [pb*BLOCK_P, +BLOCK_P) of KV head g, for its GROUP query heads
    (the summary tile is loaded once and reused by every query head of the group).

    PAGED: summaries are per physical KV page ``[N_pages, Hkv, D]``; row-page p of request b
    lives in physical page ``TABLE[SUM_ROWS[b], p*PAGE] // PAGE``."""
    b = tl.program_id(0)
    g = tl.program_id(1)
    pb = tl.program_id(2)
    row = tl.load(SUM_ROWS + b).to(tl.int64)
    n_pages = tl.load(N_PAGES + b)
    p = pb * BLOCK_P + tl.arange(0, BLOCK_P)
    d = tl.arange(0, BLOCK_D)
    live = p < n_pages
    m2 = live[:, None] & (d[None, :] < D)
    if PAGED:
        phys = tl.load(TABLE + row * s_t + p * PAGE, mask=live, other=0).to(tl.int64) // PAGE
        off_mn = phys[:, None] * s_mp
        off_mx = phys[:, None] * s_xp
    else:
        off_mn = row * s_mr + p[:, None] * s_mp
        off_mx = row * s_xr + p[:, None] * s_xp
    mn = tl.load(KMIN + off_mn + g * s_mh + d[None, :], mask=m2, other=0.0)
    mx = tl.load(KMAX + off_mx + g * s_xh + d[None, :], mask=m2, other=0.0)
    mn = mn.to(tl.float32)
    mx = mx.to(tl.float32)
    for gi in tl.static_range(GROUP):
        h = g * GROUP + gi
        q = tl.load(Q + b * s_qb + h * s_qh + d, mask=d < D, other=0.0).to(tl.float32)
        s = tl.sum(tl.maximum(q[None, :] * mx, q[None, :] * mn), axis=1)
        s = tl.where(live, s, -float("inf"))
        tl.store(OUT + b * s_ob + h * s_oh + p, s, mask=p < P)


def _as_index(x, n, device):
    t = torch.as_tensor(x, device=device)
    return t.expand(n).contiguous() if t.dim() == 0 else t.contiguous()


def quest_page_scores(q, kmin, kmax, n_pages, summary_rows=None, block_p=None):
    """Triton version of ``reference.quest_page_scores``: fp32 ``[B, Hq, P]``."""
    b, hq, d = q.shape
    p_max, hkv = kmin.shape[1], kmin.shape[2]
    check_gqa(hq, hkv)
    if summary_rows is None:
        summary_rows = torch.arange(b, device=q.device)
    check_rows(q, kmin, kmax)
    check_device(n_pages, summary_rows)
    out = torch.empty(b, hq, p_max, dtype=torch.float32, device=q.device)
    if b == 0 or p_max == 0:
        return out
    block_d = pow2(d, 16)
    if block_p is None:
        block_p = max(8, min(64, 4096 // block_d))  # ~4K fp32 per summary tile
    _quest_scores_kernel[(b, hkv, triton.cdiv(p_max, block_p))](
        q, kmin, kmax, summary_rows, n_pages, out, p_max, summary_rows,
        q.stride(0), q.stride(1), kmin.stride(0), kmin.stride(1), kmin.stride(2),
        kmax.stride(0), kmax.stride(1), kmax.stride(2), out.stride(0), out.stride(1), 0,
        GROUP=hq // hkv, D=d, BLOCK_D=block_d, BLOCK_P=block_p, PAGE=1, PAGED=False, num_warps=4,
    )
    return out


def quest_page_scores_paged(q, kmin, kmax, req_to_token, req_rows, n_pages, page, block_p=None, num_warps=None):
    """Triton version of ``reference.quest_page_scores_paged``: fp32 ``[B, Hq, P]``,
    ``P = ceil(req_to_token.shape[1] / page)``. No host sync (CUDA-graph safe). ``block_p`` /
    ``num_warps`` left ``None`` come from the device's tuning table (``tuning.py``), else
    ~4K summary elements per tile and 4 warps."""
    b, hq, d = q.shape
    hkv = kmin.shape[1]
    check_gqa(hq, hkv)
    check_table(req_to_token)
    check_device(req_to_token, req_rows, n_pages)
    p_max = -(-req_to_token.shape[1] // page)
    out = torch.empty(b, hq, p_max, dtype=torch.float32, device=q.device)
    if b == 0 or p_max == 0:
        return out
    block_d = pow2(d, 16)
    cfg = tuning.fill("quest_page_scores_paged", b, q.device, block_p=block_p, num_warps=num_warps)
    block_p = pow2(cfg["block_p"]) if cfg["block_p"] else max(8, min(64, 4096 // block_d))
    _quest_scores_kernel[(b, hkv, triton.cdiv(p_max, block_p))](
        q, kmin, kmax, req_rows, n_pages, out, p_max, req_to_token,
        q.stride(0), q.stride(1), 0, kmin.stride(0), kmin.stride(1),
        0, kmax.stride(0), kmax.stride(1), out.stride(0), out.stride(1), req_to_token.stride(0),
        GROUP=hq // hkv, D=d, BLOCK_D=block_d, BLOCK_P=block_p, PAGE=int(page), PAGED=True,
        num_warps=int(cfg["num_warps"] or 4),
    )
    return out


@triton.jit
def _fold_decode_keys_kernel(K, SLOTS, KMIN, KMAX, s_kt, s_kh, s_mp, s_mh, H, D: tl.constexpr,
                             BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr):
    """Program t: token t's key ``[H, D]`` into the summary of its physical page ``slot // PAGE``;
    the page's first slot starts a fresh summary (the page was just allocated)."""
    t = tl.program_id(0)
    slot = tl.load(SLOTS + t).to(tl.int64)
    page = slot // PAGE
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    m = (h[:, None] < H) & (d[None, :] < D)
    k = tl.load(K + t * s_kt + h[:, None] * s_kh + d[None, :], mask=m).to(KMIN.dtype.element_ty)
    off = page * s_mp + h[:, None] * s_mh + d[None, :]
    fresh = (slot % PAGE) == 0
    mn = tl.load(KMIN + off, mask=m)
    mx = tl.load(KMAX + off, mask=m)
    tl.store(KMIN + off, tl.where(fresh, k, tl.minimum(mn, k)), mask=m)
    tl.store(KMAX + off, tl.where(fresh, k, tl.maximum(mx, k)), mask=m)


def quest_fold_decode_keys(kmin, kmax, k, slots, page):
    """Triton version of ``reference.quest_fold_keys`` for decode: one launch, every token of
    ``k [T, Hkv, D]`` in a *different* page (one new token per request; padded entries may all
    write slot 0, whose page nobody reads). Prefill chunks, with many tokens per page, take the
    reference (scatter) path."""
    check_rows(kmin, kmax, k)
    check_device(slots)
    t, hkv, d = k.shape
    if t == 0:
        return
    _fold_decode_keys_kernel[(t,)](
        k, slots, kmin, kmax, k.stride(0), k.stride(1), kmin.stride(0), kmin.stride(1), hkv, D=d,
        BLOCK_H=pow2(hkv), BLOCK_D=pow2(d, 16), PAGE=int(page), num_warps=4,
    )
