"""SnapKV window scores: causal softmax of the last W prompt queries over all L keys, summed over
the window and averaged over each GQA group, per KV head -> fp32 ``[Hkv, L]``.

Two passes over the keys, both with grid ``(Hkv, cdiv(L, BLOCK_L))`` so long prompts fill the GPU:
  1. per key block, each (query head, window query) row's block max and sum of exp2 -> partial
     log-sum-exp ``[n_blocks, Hq, W]``; merged in torch (tiny) into the row's full lse;
  2. per key block, ``sum_{h in group, w} 2^(logit - lse) / GROUP`` for each key.
Window query w sits at position ``L-W+w`` and sees keys ``l <= L-W+w``. Key l is ``k[l]`` or,
with ``slots``, the pool row ``k[slots[l]]`` (so a prompt prefilled in chunks is scored once,
after its last chunk, straight from the KV pool).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_common import LOG2E, check_device, check_gqa, check_rows, kernel_keys, pow2


@triton.jit
def _load_keys_t(K, Q, SLOTS, s_ks, s_kh, g, l, d, L, D: tl.constexpr, HAS_SLOTS: tl.constexpr):
    """Key tile of KV head g for keys l and channels d, transposed, in Q's dtype (an fp8 pool's
    keys are converted here): [len(d), len(l)]."""
    lmask = l < L
    if HAS_SLOTS:
        row = tl.load(SLOTS + l, mask=lmask, other=0).to(tl.int64)  # pool slot of key l
    else:
        row = l.to(tl.int64)
    k = tl.load(K + row[None, :] * s_ks + g * s_kh + d[:, None],
                mask=lmask[None, :] & (d[:, None] < D), other=0.0)
    return k.to(Q.dtype.element_ty)


@triton.jit
def _head_logits(Q, K, SLOTS, k_t, s_qw, s_qh, s_ks, s_kh, h, g, w, l, W, L, qk_scale,
                 D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_W: tl.constexpr,
                 BLOCK_L: tl.constexpr, HAS_SLOTS: tl.constexpr, IEEE: tl.constexpr):
    """[BLOCK_W, BLOCK_L] base-2 logits of query head h's window queries vs keys l.
    fp16/bf16: one tensor-core dot against the preloaded tile k_t. fp32: exact (IEEE) FMA dots
    over 16-channel slices (a full-D FMA dot would hold whole rows in registers and spill)."""
    wmask = w[:, None] < W
    if IEEE:
        s = tl.zeros([BLOCK_W, BLOCK_L], dtype=tl.float32)
        for d0 in range(0, BLOCK_D, 16):  # a real loop: unrolling it spills
            d = d0 + tl.arange(0, 16)
            q = tl.load(Q + w[:, None] * s_qw + h * s_qh + d[None, :],
                        mask=wmask & (d[None, :] < D), other=0.0)
            kt = _load_keys_t(K, Q, SLOTS, s_ks, s_kh, g, l, d, L, D, HAS_SLOTS)
            s += tl.dot(q, kt, input_precision="ieee")
    else:
        d = tl.arange(0, BLOCK_D)
        q = tl.load(Q + w[:, None] * s_qw + h * s_qh + d[None, :],
                    mask=wmask & (d[None, :] < D), other=0.0)
        s = tl.dot(q, k_t)
    return s * qk_scale


@triton.jit
def _snapkv_lse_kernel(
    Q, K, SLOTS, LSE_PART, qk_scale, L, W,
    s_qw, s_qh, s_ks, s_kh,
    GROUP: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_W: tl.constexpr,
    BLOCK_L: tl.constexpr, HAS_SLOTS: tl.constexpr, IEEE: tl.constexpr,
):
    g = tl.program_id(0)
    lb = tl.program_id(1)
    hq = tl.num_programs(0) * GROUP
    l = lb * BLOCK_L + tl.arange(0, BLOCK_L)
    w = tl.arange(0, BLOCK_W)
    d = tl.arange(0, BLOCK_D)
    if IEEE:
        k_t = 0.0  # loaded slice by slice in _head_logits
    else:
        k_t = _load_keys_t(K, Q, SLOTS, s_ks, s_kh, g, l, d, L, D, HAS_SLOTS)
    seen = (l[None, :] <= (L - W + w)[:, None]) & (l[None, :] < L)  # causal, [BLOCK_W, BLOCK_L]
    for gi in tl.static_range(GROUP):
        h = g * GROUP + gi
        s = _head_logits(Q, K, SLOTS, k_t, s_qw, s_qh, s_ks, s_kh, h, g, w, l, W, L, qk_scale,
                         D, BLOCK_D, BLOCK_W, BLOCK_L, HAS_SLOTS, IEEE)
        s = tl.where(seen, s, -float("inf"))
        m = tl.max(s, axis=1)
        m_ref = tl.where(m == -float("inf"), 0.0, m)
        z = tl.sum(tl.exp2(s - m_ref[:, None]), axis=1)
        lse = tl.where(z > 0, m_ref + tl.log2(tl.where(z > 0, z, 1.0)), -float("inf"))
        tl.store(LSE_PART + (lb * hq + h) * W + w, lse, mask=w < W)  # [n_blocks, Hq, W]


@triton.jit
def _snapkv_score_kernel(
    Q, K, SLOTS, LSE, OUT, qk_scale, L, W,
    s_qw, s_qh, s_ks, s_kh, s_og,
    GROUP: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_W: tl.constexpr,
    BLOCK_L: tl.constexpr, HAS_SLOTS: tl.constexpr, IEEE: tl.constexpr,
):
    g = tl.program_id(0)
    lb = tl.program_id(1)
    l = lb * BLOCK_L + tl.arange(0, BLOCK_L)
    w = tl.arange(0, BLOCK_W)
    d = tl.arange(0, BLOCK_D)
    if IEEE:
        k_t = 0.0  # loaded slice by slice in _head_logits
    else:
        k_t = _load_keys_t(K, Q, SLOTS, s_ks, s_kh, g, l, d, L, D, HAS_SLOTS)
    seen = (l[None, :] <= (L - W + w)[:, None]) & (l[None, :] < L) & (w[:, None] < W)
    acc = tl.zeros([BLOCK_L], dtype=tl.float32)
    for gi in tl.static_range(GROUP):
        h = g * GROUP + gi
        s = _head_logits(Q, K, SLOTS, k_t, s_qw, s_qh, s_ks, s_kh, h, g, w, l, W, L, qk_scale,
                         D, BLOCK_D, BLOCK_W, BLOCK_L, HAS_SLOTS, IEEE)
        lse = tl.load(LSE + h * W + w, mask=w < W, other=0.0)
        prob = tl.where(seen, tl.exp2(s - lse[:, None]), 0.0)
        acc += tl.sum(prob, axis=0)
    tl.store(OUT + g * s_og + l, acc / GROUP, mask=l < L)


def snapkv_window_scores(q_win, k, scale=None, slots=None, block_l=None):
    """Triton version of ``reference.snapkv_window_scores``; fp32 ``[Hkv, L]``."""
    w, hq, d = q_win.shape
    hkv = k.shape[1]
    length = slots.shape[0] if slots is not None else k.shape[0]
    check_gqa(hq, hkv)
    if not 0 < w <= length:
        raise ValueError(f"need 0 < W <= L, got W={w}, L={length}")
    k, slots = kernel_keys(q_win, k, "q_win", "k", slots)
    check_rows(q_win, k)
    if slots is not None:
        check_device(slots)
        slots = slots.contiguous()
    block_d = pow2(d, 16)
    block_w = pow2(w, 16)  # tl.dot needs >= 16
    ieee = q_win.dtype == torch.float32  # exact fp32 products (no TF32)
    if block_l is None:
        block_l = 32 if ieee else (64 if block_w * block_d <= 32 * 128 else 32)
    n_blocks = triton.cdiv(length, block_l)
    qk_scale = ((1.0 / d**0.5) if scale is None else float(scale)) * LOG2E
    grid = (hkv, n_blocks)
    common = dict(GROUP=hq // hkv, D=d, BLOCK_D=block_d, BLOCK_W=block_w, BLOCK_L=block_l,
                  HAS_SLOTS=slots is not None, IEEE=ieee, num_warps=4)
    slots_arg = slots if slots is not None else q_win  # unused without slots
    lse_part = torch.empty(n_blocks, hq, w, dtype=torch.float32, device=q_win.device)
    _snapkv_lse_kernel[grid](
        q_win, k, slots_arg, lse_part, qk_scale, length, w,
        q_win.stride(0), q_win.stride(1), k.stride(0), k.stride(1), **common,
    )
    m = lse_part.amax(dim=0)  # finite: every window query sees key 0 (block 0)
    lse = (m + torch.log2(torch.exp2(lse_part - m).sum(dim=0))).contiguous()  # [Hq, W]
    out = torch.empty(hkv, length, dtype=torch.float32, device=q_win.device)
    _snapkv_score_kernel[grid](
        q_win, k, slots_arg, lse, out, qk_scale, length, w,
        q_win.stride(0), q_win.stride(1), k.stride(0), k.stride(1), out.stride(0), **common,
    )
    return out
