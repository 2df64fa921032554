"""SkipKV on the toy engine (no SGLang): segments from token ids, whole segments dropped. The
kept positions equal ``sgl_kernel_sparse.eviction_scores.skipkv_simulate`` (the formula over
logical positions) through chunked prefill, tensor-only decode and a Chain Cache continuation;
every eviction frees exactly the rows it drops; the selection's edge cases (fewer rows than the
budget, one segment bigger than the budget, ties, GQA) and the boundary rule."""

from __future__ import annotations

import copy

import pytest
import torch
from sgl_kernel_sparse import eviction_scores as ref

from sglang_sparse.core.events import RequestSlice, StepMode
from sglang_sparse.methods.skipkv import Segments, ends_sentence
from sglang_sparse.registry import ConfigError, build_config
from toy_engine import HKV, HQ, LAYERS, ToyEngine, qkv

KNOBS = {"budget": 24, "sinks": 2, "recent": 6, "interval": 4, "max_segment": 6}
VOCAB = [f"w{i}" for i in range(40)]  # token texts; a few end sentences:
VOCAB[3], VOCAB[7], VOCAB[11], VOCAB[19] = ".", " why?", "\n", " done! "
BOUNDARY = torch.tensor([ends_sentence(t) for t in VOCAB])


class Run:
    """One request through the toy engine with token ids; a later turn resumes the earlier
    turn's rows and metadata as a Chain Cache continuation does."""

    def __init__(self, knobs=KNOBS, seed=1, vocab=VOCAB):
        self.eng, self.knobs, self.seed = ToyEngine("skipkv", knobs), knobs, seed
        if vocab is not None:
            self.eng.ctl.runtime.use_vocabulary(vocab)
        self.q = [torch.zeros(0, HQ, 8) for _ in range(LAYERS)]
        self.k = [torch.zeros(0, HKV, 8) for _ in range(LAYERS)]
        self.tokens = torch.zeros(0, dtype=torch.int64)
        self.free0 = self.eng.store.free_count()
        self.prompt_lens, self.decode_after, self.rid, self.parked = [], [], None, None

    def _take(self, n):
        self.seed += 1
        q, k, v = qkv(n, self.seed)
        self.q = [torch.cat([a, b]) for a, b in zip(self.q, q)]
        self.k = [torch.cat([a, b]) for a, b in zip(self.k, k)]
        g = torch.Generator().manual_seed(1000 + self.seed)
        self.tokens = torch.cat([self.tokens, torch.randint(0, len(VOCAB), (n,), generator=g)])
        return q, k, v

    def step(self, mode, s, q, k, v):
        cache = self.eng.ctl.cache
        rows0, before = cache.retained(s.rid).n_rows, self.eng.store.free_count()
        freed = self.eng.run_step(mode, [s], q, k, v)
        ret = cache.retained(s.rid)
        written = rows0 + s.num_tokens
        assert freed == written - ret.n_rows  # the eviction freed exactly the rows it dropped
        if freed:
            assert self.knobs["budget"] - self.knobs["max_segment"] < ret.n_rows <= self.knobs["budget"]
        assert self.eng.store.free_count() == before - s.num_tokens + freed == self.free0 - ret.n_rows

    def turn(self, new_prompt, chunk, decode):
        ctl, cache = self.eng.ctl, self.eng.ctl.cache
        start = self.q[0].shape[0]
        prompt_len = start + new_prompt
        rid = f"r{len(self.prompt_lens)}"
        if self.rid is None:
            ctl.request_started(rid, 0, prompt_len)
        elif not new_prompt:  # decode on in the same request
            rid, prompt_len = self.rid, cache.requests[self.rid].prompt_len
        else:  # park the earlier request's rows + metadata, resume them (chains/scheduler.py)
            old = cache.requests[self.rid]
            retained, metadata = copy.deepcopy(old.retained), dict(old.metadata)
            self.parked = (metadata["segments"], list(metadata["segments"].ids))
            ctl.request_finished(self.rid)
            ctl.request_resumed(rid, 0, prompt_len, retained, metadata)
        self.rid = rid
        q, k, v = self._take(new_prompt)
        for lo in range(0, new_prompt, chunk):
            hi = min(lo + chunk, new_prompt)
            s = RequestSlice(rid, 0, start + lo, start + hi, cache.retained(rid).n_rows, prompt_len,
                             tuple(self.tokens[start + lo: start + hi].tolist()))
            self.step(StepMode.PREFILL, s, *[[x[lo:hi] for x in t] for t in (q, k, v)])
        self.prompt_lens.append(prompt_len)
        for _ in range(decode):
            pos = self.q[0].shape[0]
            dq, dk, dv = self._take(1)
            s = RequestSlice(rid, 0, pos, pos + 1, cache.retained(rid).n_rows, prompt_len,
                             (int(self.tokens[pos]),))
            self.step(StepMode.DECODE, s, dq, dk, dv)
        self.decode_after.append(decode)

    def reference(self, chunk):
        c = self.knobs
        return ref.skipkv_simulate(self.q, self.k, BOUNDARY[self.tokens], c["budget"], c["sinks"], c["recent"],
                                   c["interval"], c["max_segment"], self.prompt_lens, chunk, self.decode_after,
                                   evict_prefill=c.get("evict_prefill", "on") == "on")

    def assert_matches_reference(self, chunk):
        want = self.reference(chunk)
        pos = self.eng.ctl.cache.retained(self.rid).all_positions()  # [layers, Hkv, rows]
        assert torch.equal(pos, want.expand_as(pos)), (pos[0, 0], want)  # the same tokens everywhere
        for layer in range(LAYERS):  # rows hold those tokens' keys
            torch.testing.assert_close(self.eng.ctl.cache.keys(self.rid, layer), self.k[layer][want])
        return want

    def finish(self):
        self.eng.finish(self.rid, 0)
        assert self.eng.store.free_count() == self.free0


def units_whole(kept, seg, n, sinks, recent):
    """Every segment part among rows [sinks, n - recent) is kept whole or dropped whole."""
    mask = torch.zeros(n, dtype=torch.bool)
    mask[kept] = True
    mid = seg[sinks: n - recent]
    for s in mid.unique():
        part = mask[sinks: n - recent][mid == s]
        assert bool(part.all()) or not bool(part.any()), (int(s), part)
    assert bool(mask[:sinks].all()) and bool(mask[n - recent:].all())


@pytest.mark.parametrize("chunk,evict_prefill", [(1000, "on"), (7, "on"), (7, "off")])
def test_kept_positions_equal_the_reference_through_prefill_and_decode(chunk, evict_prefill):
    run = Run(dict(KNOBS, evict_prefill=evict_prefill))
    peak = []  # rows held after each prompt chunk
    step = run.step
    run.step = lambda mode, s, *t: (step(mode, s, *t), peak.append(run.eng.ctl.cache.retained(s.rid).n_rows))
    run.turn(60, chunk, 0)
    if chunk == 7:  # evicting between chunks bounds the rows a prompt holds; holding it whole does not
        c = KNOBS
        assert (max(peak) < c["budget"] + c["interval"] + chunk) == (evict_prefill == "on"), peak
    first = run.assert_matches_reference(chunk)  # the prompt's eviction
    assert first.numel() < 60
    evictions = run.eng.ctl.runtime.counters["evictions"]
    run.turn(0, chunk, 25)  # several decode evictions
    assert run.eng.ctl.runtime.counters["evictions"] >= evictions + 3
    kept = run.assert_matches_reference(chunk)
    seg = ref.segment_ids(BOUNDARY[run.tokens], KNOBS["max_segment"])
    assert torch.equal(torch.frombuffer(run.eng.ctl.cache.requests[run.rid].metadata["segments"].ids,
                                        dtype=torch.int64), seg)  # the runtime's segments, chunk by chunk
    assert seg[kept].unique().numel() < seg.unique().numel()  # whole segments went
    run.finish()


def test_chain_continuation_goes_on_from_the_parked_scores_and_segments():
    run = Run(seed=40)
    run.turn(50, 16, 7)
    run.turn(20, 16, 10)  # prefills only its 20-token suffix on the parked rows
    run.assert_matches_reference(16)
    segs, ids = run.parked
    assert list(segs.ids) == ids  # the parked record's segments are not changed by the continuation
    assert run.eng.ctl.runtime.counters["segment_boundaries"] == int(BOUNDARY[run.tokens].sum())
    run.finish()


def test_short_requests_keep_everything():
    run = Run()
    run.turn(KNOBS["budget"] - 5, 5, 5)  # exactly the budget: nothing evicted
    ret = run.eng.ctl.cache.retained(run.rid)
    assert ret.is_identity and ret.n_rows == KNOBS["budget"]
    assert run.eng.ctl.cache.counters["compactions"] == 0
    run.finish()


def test_segments_follow_the_boundary_rule_and_cap():
    flags = torch.tensor([0, 0, 1, 0, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0], dtype=torch.bool)
    assert ref.segment_ids(flags, 4).tolist() == [0, 0, 0, 1, 1, 2, 3, 3, 3, 3, 4, 4, 4, 4]
    assert ref.segment_ids(torch.zeros(7, dtype=torch.bool), 3).tolist() == [0, 0, 0, 1, 1, 1, 2]
    segs = Segments()
    for lo in range(0, 14, 3):  # incremental, in chunks, equals the whole-sequence rule
        segs.extend(flags[lo: lo + 3].tolist(), 4)
    assert list(segs.ids) == ref.segment_ids(flags, 4).tolist()
    assert [ends_sentence(t) for t in (".", " end.", "?\"", " ok! ", "\n\n", "a\nb", "3.5", "Mr", "", ")")] == \
        [True, True, False, True, True, True, False, False, False, False]


def test_fewer_rows_than_the_budget_is_the_identity():
    scores = torch.rand(2, 2, 9)
    assert ref.skipkv_select(scores, torch.arange(9), 9, 2, 3).tolist() == list(range(9))
    assert ref.skipkv_select(scores[..., :5], torch.zeros(5, dtype=torch.int64), 9, 2, 3).tolist() == list(range(5))


def test_lowest_segments_go_first_whole_and_ties_keep_the_lower_row():
    # rows: sinks [0, 1) | candidates [1, 9) in segments 1,1,2,2,2,3,4,4 | recent [9, 11)
    seg = torch.tensor([0, 1, 1, 2, 2, 2, 3, 4, 4, 5, 5])
    row = torch.tensor([9.0, 5, 5, 1, 1, 1, 7, 3, 3, 0, 0])
    scores = row.expand(2, 2, 11).clone()
    # 11 rows, budget 8: drop >= 3 rows -> segment 2 (mean 1) is enough
    assert ref.skipkv_select(scores, seg, 8, 1, 2).tolist() == [0, 1, 2, 6, 7, 8, 9, 10]
    # budget 7: drop >= 4 -> segment 2, then segment 4 (mean 3): 5 rows go, 6 kept (< budget)
    assert ref.skipkv_select(scores, seg, 7, 1, 2).tolist() == [0, 1, 2, 6, 9, 10]
    tie = torch.ones(2, 2, 11)  # all equal: the later segments go first
    assert ref.skipkv_select(tie, seg, 8, 1, 2).tolist() == [0, 1, 2, 3, 4, 5, 9, 10]


def test_one_segment_bigger_than_the_budget():
    """The selection drops a unit whole, so a single candidate segment leaves only the sinks and
    the recent window; the runtime never builds one: ``max_segment`` cuts a sentence with no
    boundary into pieces, of which only as many go as needed."""
    scores = torch.rand(1, 2, 30)
    assert ref.skipkv_select(scores, torch.zeros(30, dtype=torch.int64), 20, 2, 4).tolist() == \
        [0, 1, 26, 27, 28, 29]
    seg = ref.segment_ids(torch.zeros(30, dtype=torch.bool), 5)  # pieces of 5: rows [2, 26) form 6 units
    kept = ref.skipkv_select(scores, seg, 20, 2, 4)
    assert 20 - 5 < kept.numel() <= 20
    units_whole(kept, seg, 30, 2, 4)
    run = Run(vocab=None)  # no vocabulary: no token ends a sentence, segments are max_segment pieces
    run.turn(60, 60, 0)
    n = run.eng.ctl.cache.retained(run.rid).n_rows
    assert KNOBS["budget"] - KNOBS["max_segment"] < n <= KNOBS["budget"]
    run.finish()


def test_gqa_the_segment_score_averages_layers_and_kv_heads():
    seg = torch.tensor([0, 1, 1, 2, 2, 3])
    scores = torch.zeros(2, 2, 6)
    scores[0, 0, 1:3] = 10.0  # one head of one layer likes segment 1 a lot
    scores[:, :, 3:5] = 2.0  # every head likes segment 2 a little: mean 2 < 10 / 4
    assert ref.skipkv_select(scores, seg, 4, 1, 1).tolist() == [0, 1, 2, 5]
    scores[0, 0, 1:3] = 7.0  # 7 / 4 < 2: now segment 1 goes
    assert ref.skipkv_select(scores, seg, 4, 1, 1).tolist() == [0, 3, 4, 5]


def test_random_selections_drop_whole_units_within_the_budget():
    g = torch.Generator().manual_seed(5)
    for _ in range(30):
        n = int(torch.randint(20, 80, (1,), generator=g))
        seg = ref.segment_ids(torch.rand(n, generator=g) < 0.2, 6)
        kept = ref.skipkv_select(torch.rand(3, 2, n, generator=g), seg, 18, 3, 5)
        assert 18 - 6 < kept.numel() <= 18 and bool((kept.diff() > 0).all())
        units_whole(kept, seg, n, 3, 5)


@pytest.mark.parametrize("knobs,message", [
    ({"recent": 0}, "recent=0 is out of range: must be >= 1"),
    ({"sinks": -1}, "sinks=-1 is out of range: must be >= 0"),
    ({"interval": 0}, "interval=0 is out of range: must be >= 1"),
    ({"max_segment": 0}, "max_segment=0 is out of range: must be >= 1"),
    ({"evict_prefill": "yes"}, "evict_prefill='yes' is not allowed: must be on .* or off"),
    ({"budget": 100, "recent": 64, "max_segment": 64},
     "budget=100 is out of range: must be >= sinks \\+ recent \\+ max_segment = 132 .*--sparse-max-segment"),
])
def test_bad_options_are_refused_with_a_sentence(knobs, message):
    with pytest.raises(ConfigError, match=message):
        build_config("skipkv", knobs)


def test_positions_without_token_ids_count_as_inside_a_sentence():
    """A slice that starts past the known positions (a prefix the method never saw) or carries no
    token ids: the unknown positions come first and end no sentence."""
    eng = ToyEngine("skipkv", dict(KNOBS, max_segment=4))
    rt = eng.ctl.runtime
    rt.use_vocabulary(VOCAB)
    eng.ctl.request_started("a", 0, 12)
    rt.track(RequestSlice("a", 0, 3, 6, 0, 12, (3, 0, 0)))  # positions 0-2 unknown, then "." at 3
    rt.track(RequestSlice("a", 0, 4, 9, 0, 12, (0, 0, 3, 0, 0)))  # 4-5 known already, 6-8 new
    rt.track(RequestSlice("a", 0, 9, 11, 0, 12))  # no ids
    ids = list(eng.ctl.cache.requests["a"].metadata["segments"].ids)
    want = ref.segment_ids(torch.tensor([0, 0, 0, 1, 0, 0, 1, 0, 0, 0, 0], dtype=torch.bool), 4).tolist()
    assert ids == want == [0, 0, 0, 0, 1, 1, 1, 2, 2, 2, 2]
