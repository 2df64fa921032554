"""External check: NVIDIA's kvpress (``pip install -e '.[kvpress]'``, kvpress 0.5.2: the newest
release that installs next to sglang 0.5.23's transformers==5.19.0; 0.5.3+ pin transformers<5.3)
and our plain-torch references keep the same positions per layer and KV head on the default
model (SmolLM2-135M, HF transformers, fp32, CPU) and the same prompt.

kvpress's presses are run as black boxes: the positions they keep are read back by matching the
compressed cache's keys against the uncompressed ones (KVzip: its ``masked_key_indices``).

Definitional differences (the comparison feeds kvpress's numbers to our references so that the
selection itself is compared; each is asserted or printed below):

- budgets: kvpress keeps ``int(L * (1 - ratio))`` positions per head; ours take ``budget``
  (SnapKV / StreamingLLM: set equal). PyramidKV: kvpress keeps ``round(max - l * step)`` per layer
  from float arithmetic with the window *inside* that count (average ``L (1 - ratio)``); ours keep
  ``budget_l + w`` (integer steps, the window on top, average ``C``): the test gives our selection
  kvpress's per-layer counts and checks the two budget formulas differ only as stated.
- SnapKV: kvpress means over window queries and pools before averaging the GQA group; ours sum
  and average first (both linear: same ranking up to float rounding). kvpress ``torch.topk`` has
  no tie rule; ours keeps the lower position.
- KVzip: kvpress drops the chat-template prefix from scoring (score 0) and builds the probe as
  ``encode("\\n\\nRepeat the previous context exactly.") + encode(suffix) + context`` with the
  template's suffix; the model directory here has its chat template removed so that prefix is
  empty and the suffix is "\\n" (as kvpress does for template-less models). Its sinks get score
  1.0 (ours: always kept); its global count is ``total - int(total * ratio)`` (ours
  ``floor(keep_ratio * total)``).
- transformers 5.19 no longer passes ``cache_position`` to attention layers, which kvpress
  0.5.2's hooks read: a pre-hook here supplies it (``_cache_position_shim``); without it every
  press fails with ``KeyError: 'cache_position'``.
- H2O (kvpress ``ObservedAttentionPress``) is not compared: kvpress scores a key by the average
  attention it receives over the prompt's queries, once after prefill, with no recent window; our
  ``methods/h2o.py`` follows the H2O paper: it sums the attention (so early keys, seen by more
  queries, weigh more), keeps a recent window, and evicts online between prompt chunks and every
  ``--sparse-interval`` decode tokens. No setting of either makes the two rankings the same.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

kvpress = pytest.importorskip("kvpress")
transformers = pytest.importorskip("transformers")

from sgl_kernel_sparse import reference  # noqa: E402

from sglang_sparse.default_model import ensure_default_model  # noqa: E402

pytestmark = pytest.mark.slow

RATIO = 0.5  # kvpress compression_ratio; our keep ratio / budgets from it
WINDOW, KERNEL = 64, 5  # kvpress SnapKV / PyramidKV defaults
TEXT = " ".join(
    f"Item {i}: the {c} box on shelf {i % 7} holds {3 * i + 1} {w}, and the note beside it says "
    f"'{w} were counted on day {i % 5 + 1}'."
    for i, (c, w) in enumerate([("red", "apples"), ("blue", "bolts"), ("green", "cards"), ("grey", "dice"),
                                ("white", "eggs"), ("black", "files"), ("gold", "gears"), ("pink", "hats")] * 3))


def jaccard(a, b) -> float:
    a, b = set(a), set(b)
    return len(a & b) / max(len(a | b), 1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The default model without its chat template (KVzip's probe then has no template prefix)."""
    src = ensure_default_model(log=lambda *_: None)
    out = tmp_path_factory.mktemp("smollm2-notemplate")
    for f in src.iterdir():
        if f.name != "chat_template.jinja":
            shutil.copy(f, out / f.name)
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (out / "tokenizer_config.json").write_text(json.dumps(cfg))
    return out


def _cache_position_shim(module, args, kwargs):
    """kvpress 0.5.2's hooks read ``cache_position`` from the attention layer's kwargs, which
    transformers 5.19 no longer passes there: give it the positions this forward covers."""
    if "cache_position" not in kwargs:
        past = kwargs["past_key_values"].get_seq_length(module.layer_idx)
        q_len = kwargs["hidden_states"].shape[1]
        kwargs["cache_position"] = torch.arange(past, past + q_len)
    return args, kwargs


@pytest.fixture(scope="module")
def hf(model_dir):
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                              attn_implementation="sdpa").eval()
    for layer in model.model.layers:
        layer.self_attn.register_forward_pre_hook(_cache_position_shim, with_kwargs=True)
    return tok, model


def _qk(model, ids):
    """Post-RoPE queries ``[S, Hq, D]`` and keys ``[S, Hkv, D]`` of every layer (plain forward)."""
    qs = {}

    def hook(module, args, kwargs, out):
        h = kwargs["hidden_states"]
        q = module.q_proj(h).view(*h.shape[:2], -1, module.head_dim).transpose(1, 2)
        cos, sin = kwargs["position_embeddings"]
        q = q * cos.unsqueeze(1) + transformers.models.llama.modeling_llama.rotate_half(q) * sin.unsqueeze(1)
        qs[module.layer_idx] = q[0].transpose(0, 1)

    layers = model.model.layers
    handles = [layer.self_attn.register_forward_hook(hook, with_kwargs=True) for layer in layers]
    cache = transformers.DynamicCache()
    with torch.no_grad():
        model(ids, past_key_values=cache)
    for h in handles:
        h.remove()
    return [qs[i] for i in range(len(layers))], [cache.layers[i].keys[0].transpose(0, 1) for i in range(len(layers))]


def _kept_by_press(model, ids, press, full_keys):
    """Positions ``[layer][head] -> list`` kept by a kvpress press, from its compressed cache."""
    cache = transformers.DynamicCache()
    with torch.no_grad(), press(model):
        model(ids, past_key_values=cache)
    kept = []
    for layer, k_full in enumerate(full_keys):
        k = cache.layers[layer].keys[0]  # [Hkv, n, D]
        per_head = []
        for h in range(k.shape[0]):
            d = torch.cdist(k[h], k_full[:, h])  # [n, L]
            per_head.append(sorted(d.argmin(dim=1).tolist()))
        kept.append(per_head)
    return kept


@pytest.fixture(scope="module")
def prompt(hf):
    tok, model = hf
    ids = tok(TEXT, return_tensors="pt").input_ids
    q, k = _qk(model, ids)
    return ids, q, k


def test_snapkv_and_streamingllm_agree(hf, prompt):
    _, model = hf
    ids, q, k = prompt
    length = ids.shape[1]
    n_kept = int(length * (1 - RATIO))
    snap = _kept_by_press(model, ids, kvpress.SnapKVPress(RATIO, window_size=WINDOW, kernel_size=KERNEL), k)
    stream = _kept_by_press(model, ids, kvpress.StreamingLLMPress(RATIO, n_sink=4), k)
    worst = 1.0
    for layer in range(len(k)):
        ours = reference.snapkv_keep_indices(q[layer][-WINDOW:], k[layer], n_kept, WINDOW, KERNEL)
        for h in range(ours.shape[0]):
            worst = min(worst, jaccard(ours[h].tolist(), snap[layer][h]))
            want = list(range(4)) + list(range(length - (n_kept - 4), length))
            assert stream[layer][h] == want
    print(f"snapkv: L={length}, keep {n_kept}, worst Jaccard over layers x heads {worst:.4f}")
    assert worst >= 0.95


def test_pyramidkv_agrees_given_kvpress_layer_budgets(hf, prompt):
    _, model = hf
    ids, q, k = prompt
    length, layers = ids.shape[1], len(k)
    press = kvpress.PyramidKVPress(RATIO, window_size=WINDOW, kernel_size=KERNEL)
    kept = _kept_by_press(model, ids, press, k)
    theirs = [len(kept[layer][0]) for layer in range(layers)]
    worst = 1.0
    for layer in range(layers):
        ours = reference.snapkv_keep_indices(q[layer][-WINDOW:], k[layer], theirs[layer], WINDOW, KERNEL)
        for h in range(ours.shape[0]):
            worst = min(worst, jaccard(ours[h].tolist(), kept[layer][h]))
    # the budget formulas: ours keep budget_l + w (integer step), kvpress round(max - l*step), w inside
    avg = WINDOW + int(length * (1 - RATIO))
    mine = [b + WINDOW for b in reference.pyramid_budgets(length, avg, WINDOW, layers)]
    print(f"pyramidkv: kvpress budgets {theirs}\n  ours (C={avg}) {mine}\n  worst Jaccard {worst:.4f}")
    assert theirs[0] == mine[0] - WINDOW and all(m - t >= 0 for m, t in zip(mine, theirs))
    assert worst >= 0.95


def test_kvzip_agrees(hf, prompt):
    tok, model = hf
    ids, _, _ = prompt
    ctx = ids.shape[1]
    press = kvpress.KVzipPress(RATIO, n_sink=4)
    with torch.no_grad(), press(model):
        model(ids, past_key_values=transformers.DynamicCache())
    layers = model.model.layers
    hkv = model.config.num_key_value_heads
    pruned = torch.zeros(len(layers), hkv, ctx, dtype=torch.bool)
    for i, layer in enumerate(layers):
        _, heads, seq = layer.self_attn.masked_key_indices
        pruned[i, heads, seq] = True
    # our reference on the same probe (one chunk: the context is < 2048 tokens)
    probe = torch.cat([tok.encode("\n\nRepeat the previous context exactly.", add_special_tokens=False,
                                  return_tensors="pt"),
                       tok.encode("\n", add_special_tokens=False, return_tensors="pt"), ids], dim=1)
    q, k = _qk(model, torch.cat([ids, probe], dim=1))
    pos = torch.arange(ctx, ctx + probe.shape[1])
    scores = torch.stack([reference.kvzip_probe_scores(q[layer][ctx:], k[layer], pos, ctx)
                          for layer in range(len(layers))])
    mask = reference.kvzip_keep_mask(scores, 1 - RATIO, sinks=4)
    worst = min(jaccard(mask[i, h].nonzero().flatten().tolist(), (~pruned[i, h]).nonzero().flatten().tolist())
                for i in range(len(layers)) for h in range(hkv))
    overall = jaccard(mask.flatten().nonzero().flatten().tolist(), (~pruned).flatten().nonzero().flatten().tolist())
    print(f"kvzip: kept {int(mask.sum())} vs {int((~pruned).sum())}, overall Jaccard {overall:.4f}, "
          f"worst per (layer, head) {worst:.4f}")
    assert overall >= 0.95 and worst >= 0.9
