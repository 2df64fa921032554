"""H2O and R-KV on the toy engine (no SGLang): the kept positions equal the whole-sequence
simulations of ``sgl_kernel_sparse.eviction_scores`` (the formulas over logical positions, per KV
head) through chunked prefill, tensor-only decode steps, repeated evictions and a Chain Cache
continuation; every eviction frees exactly the rows over the budget; nothing leaks."""

from __future__ import annotations

import copy

import pytest
import torch
from sgl_kernel_sparse import eviction_scores as ref
from sgl_kernel_sparse.reference import attention_probs

from sglang_sparse.core.events import RequestSlice, StepMode
from sglang_sparse.registry import ConfigError, build_config
from toy_engine import HKV, HQ, LAYERS, ToyEngine, qkv

H2O = {"budget": 24, "recent": 8, "interval": 4}
RKV = {"budget": 24, "window": 4, "interval": 8, "alpha": 0.3, "kernel": 3}


def simulate(method, knobs, q, k, prompt_lens, chunk, decode_after):
    if method == "h2o":
        return ref.h2o_simulate(q, k, knobs["budget"], knobs["recent"], knobs["interval"], prompt_lens, chunk,
                                decode_after, evict_prefill=knobs.get("evict_prefill", "on") == "on")
    return ref.rkv_simulate(q, k, knobs["budget"], knobs["window"], knobs["interval"], knobs["alpha"],
                            knobs["kernel"], prompt_lens, chunk, decode_after)


class Run:
    """One request through the toy engine, turn after turn (a later turn resumes the earlier
    turn's rows and method state as a Chain Cache continuation does); q/k/v of every token kept
    for the reference."""

    def __init__(self, method, knobs, seed=1):
        self.eng, self.method, self.knobs, self.seed = ToyEngine(method, knobs), method, knobs, seed
        self.q = [torch.zeros(0, HQ, 8) for _ in range(LAYERS)]
        self.k = [torch.zeros(0, HKV, 8) for _ in range(LAYERS)]
        self.free0 = self.eng.store.free_count()
        self.prompt_lens, self.decode_after, self.rid = [], [], None

    def _take(self, n):
        self.seed += 1
        q, k, v = qkv(n, self.seed)
        self.q = [torch.cat([a, b]) for a, b in zip(self.q, q)]
        self.k = [torch.cat([a, b]) for a, b in zip(self.k, k)]
        return q, k, v

    def turn(self, new_prompt, chunk, decode, check_every_step=None):
        ctl, cache = self.eng.ctl, self.eng.ctl.cache
        start = self.q[0].shape[0]
        prompt_len = start + new_prompt
        rid = f"r{len(self.prompt_lens)}"
        if self.rid is None:
            ctl.request_started(rid, 0, prompt_len)
        elif not new_prompt:  # decode on in the same request
            rid = self.rid
        else:  # park the earlier request's rows + metadata, resume them (chains/scheduler.py)
            old = cache.requests[self.rid]
            retained, metadata = copy.deepcopy(old.retained), dict(old.metadata)
            ctl.request_finished(self.rid)
            ctl.request_resumed(rid, 0, prompt_len, retained, metadata)
        self.rid = rid
        q, k, v = self._take(new_prompt)
        for lo in range(0, new_prompt, chunk):
            hi = min(lo + chunk, new_prompt)
            rows0 = cache.retained(rid).n_rows
            s = RequestSlice(rid, 0, start + lo, start + hi, rows0, prompt_len)
            before = self.eng.store.free_count()
            freed = self.eng.run_step(StepMode.PREFILL, [s], *[[x[lo:hi] for x in t] for t in (q, k, v)])
            self.check_rows(before, freed, rows0 + hi - lo)
        self.prompt_lens.append(prompt_len)
        for _ in range(decode):
            dq, dk, dv = self._take(1)
            rows0 = cache.retained(rid).n_rows
            before = self.eng.store.free_count()
            freed = self.eng.decode(rid, 0, dq, dk, dv)
            self.check_rows(before, freed, rows0 + 1)
        self.decode_after.append(decode)

    def check_rows(self, free_before, freed, rows_written):
        """Slot accounting of one step: the allocator lost the step's rows and got back exactly
        what the eviction dropped (rows over the budget), and holds what the request keeps."""
        ret = self.eng.ctl.cache.retained(self.rid)
        budget = self.knobs["budget"]
        assert freed == (rows_written - budget if ret.n_rows < rows_written else 0)
        assert ret.n_rows == (budget if freed else rows_written)
        assert self.eng.store.free_count() == self.free0 - ret.n_rows
        assert ret.n_rows <= max(budget + self.knobs["interval"], self.prompt_peak())
        if self.method == "h2o" and self.knobs.get("evict_prefill", "on") == "on":
            # evicted at every safe point, prompt chunks included: never interval rows past the budget
            assert ret.n_rows < budget + self.knobs["interval"]

    def prompt_peak(self):
        return self.q[0].shape[0]

    def assert_matches_reference(self, chunk):
        ret = self.eng.ctl.cache.retained(self.rid)
        for layer in range(LAYERS):
            want = simulate(self.method, self.knobs, self.q[layer], self.k[layer], self.prompt_lens, chunk,
                            self.decode_after)
            got = ret.all_positions()[layer]
            assert torch.equal(got, want), (layer, got, want)
            keys = self.eng.ctl.cache.keys(self.rid, layer)  # the rows hold those tokens' keys
            for h in range(HKV):
                torch.testing.assert_close(keys[:, h], self.k[layer][want[h], h])

    def finish(self):
        self.eng.finish(self.rid, 0)
        assert self.eng.store.free_count() == self.free0


@pytest.mark.parametrize("method,knobs", [("h2o", H2O), ("rkv", RKV)])
@pytest.mark.parametrize("chunk", [1000, 7])
def test_kept_positions_equal_the_reference_through_prefill_and_decode(method, knobs, chunk):
    run = Run(method, knobs)
    run.turn(60, chunk, 0)
    run.assert_matches_reference(chunk)  # the prompt's eviction
    run.turn(0, chunk, 21)  # several decode evictions (every `interval` rows over the budget)
    assert run.eng.ctl.runtime.counters["evictions"] >= 3
    run.assert_matches_reference(chunk)
    run.finish()


@pytest.mark.parametrize("method,knobs", [("h2o", H2O), ("rkv", RKV)])
def test_chain_continuation_goes_on_from_the_parked_scores(method, knobs):
    """Turn 2 resumes turn 1's rows and scores (per slot, kept with the parked rows) and
    prefills only its suffix; its evictions equal the reference over the whole two-turn sequence."""
    run = Run(method, knobs, seed=40)
    run.turn(50, 16, 7)  # R-KV: ends with 3 buffered decode queries (rows 29-31 of fire_at 32)
    run.turn(20, 16, 10)
    run.assert_matches_reference(16)
    run.finish()


def test_h2o_selection_does_not_depend_on_chunking():
    q, k, _ = qkv(82, seed=3)  # 70 prompt + 12 decoded
    a = ref.h2o_simulate(q[0], k[0], 24, 8, 4, [70], 70, [12])  # evict_prefill=False: the prompt held whole
    b = ref.h2o_simulate(q[0], k[0], 24, 8, 4, [70], 9, [12])
    assert torch.equal(a, b)


H2O_OFF = {**H2O, "evict_prefill": "off"}


@pytest.mark.parametrize("prompt,chunk", [(100, 7), (100, 3), (97, 16), (24, 5), (28, 5), (60, 28)])
def test_h2o_evicts_between_prompt_chunks_like_the_reference(prompt, chunk):
    """Prompts of several chunks (chunk 3 < interval 4: several chunks accumulate before an
    eviction; 24 = the budget exactly: nothing evicted; 28 = budget + interval): the kept
    positions after every chunk and after decoding equal the chunked reference, rows stay under
    budget + interval after every safe point, and the peak while prefilling is at most
    budget + interval - 1 + chunk."""
    run = Run("h2o", H2O, seed=7)
    run.turn(prompt, chunk, 0)
    run.assert_matches_reference(chunk)
    evictions = run.eng.ctl.runtime.counters.get("evictions", 0)
    if prompt <= H2O["budget"]:
        assert evictions == 0 and run.eng.ctl.cache.retained(run.rid).is_identity
    elif prompt >= H2O["budget"] + H2O["interval"] + chunk:  # at least one eviction before the last chunk
        assert evictions >= 2
    run.turn(0, chunk, 9)
    run.assert_matches_reference(chunk)
    run.finish()


def test_h2o_prefill_eviction_changes_the_kept_set_and_off_restores_the_whole_prompt_scoring():
    """The option matters: with evict_prefill=off the engine equals the unchunked reference (the
    prompt held whole, peak = prompt); on differs from it on this prompt (rows evicted early are
    never seen by later chunks) and equals the chunked reference (the test above)."""
    off = Run("h2o", H2O_OFF, seed=7)
    off.turn(100, 7, 0)
    off.assert_matches_reference(7)
    whole = [ref.h2o_simulate(off.q[layer], off.k[layer], 24, 8, 4, [100], 100, [0]) for layer in range(LAYERS)]
    assert all(torch.equal(off.eng.ctl.cache.retained(off.rid).all_positions()[layer], whole[layer])
               for layer in range(LAYERS))
    on = Run("h2o", H2O, seed=7)
    on.turn(100, 7, 0)
    assert any(not torch.equal(on.eng.ctl.cache.retained(on.rid).all_positions()[layer], whole[layer])
               for layer in range(LAYERS))
    assert on.eng.ctl.runtime.counters["evictions"] > off.eng.ctl.runtime.counters["evictions"] == 1
    off.finish()
    on.finish()


def test_h2o_memory_oracle_counts_the_chunk_not_the_prompt():
    on = build_config("h2o", H2O)
    from sglang_sparse.methods.h2o import H2ORuntime
    oracle = H2ORuntime(ToyEngine("h2o", H2O).ctl.cache, on).oracle
    assert oracle.chunked_prefill_rows(1500, 256) == 24 + 4 + 256
    assert oracle.chunked_prefill_rows(100, 256) == 100  # one chunk: the prompt
    assert oracle.chunked_prefill_rows(1500, None) == 1500  # chunked prefill off: the whole prompt
    off = H2ORuntime(ToyEngine("h2o", H2O_OFF).ctl.cache, build_config("h2o", H2O_OFF)).oracle
    assert off.chunked_prefill_rows(1500, 256) == 1500


@pytest.mark.parametrize("method,knobs", [("h2o", H2O), ("rkv", RKV)])
def test_short_requests_keep_everything(method, knobs):
    run = Run(method, knobs)
    run.turn(knobs["budget"] - 6, 5, 6)  # exactly the budget: nothing evicted
    ret = run.eng.ctl.cache.retained(run.rid)
    assert ret.is_identity and ret.n_rows == knobs["budget"]
    assert run.eng.ctl.cache.counters["compactions"] == 0
    run.finish()


def test_h2o_recent_window_is_always_kept_and_ties_go_to_the_older_row():
    scores = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0, 9.0, 9.0]])  # rows 5, 6: the recent window
    assert ref.h2o_select(scores, 4, 2).tolist() == [[1, 2, 5, 6]]  # ties 3.0: rows 1, 2 before 4
    assert ref.h2o_select(torch.zeros(2, 9), 5, 3).tolist() == [[0, 1, 6, 7, 8]] * 2
    assert ref.h2o_select(scores, 7, 2).tolist() == [list(range(7))]  # n <= budget
    run = Run("h2o", H2O)
    run.turn(50, 50, 13)
    pos, n = run.eng.ctl.cache.retained(run.rid).all_positions(), run.q[0].shape[0]
    for per_head in pos.reshape(-1, pos.shape[2]):
        assert set(range(n - H2O["recent"], n)) <= set(per_head.tolist())


def test_rkv_keeps_its_buffer_and_ties_go_to_the_older_row():
    imp = torch.zeros(1, 10)
    keys = torch.ones(1, 10, 4)  # identical keys: equal redundancy, equal scores
    assert ref.rkv_select(imp, keys, 6, 2, 0.1, 3).tolist() == [[0, 1, 2, 3, 8, 9]]
    keys = torch.eye(16)[:10].unsqueeze(0)  # orthogonal keys ...
    keys[0, 3] = keys[0, 1] * 2  # ... but rows 1 and 3 point the same way: both most redundant
    red = ref.rkv_redundancy(keys)[0]
    assert red[1] == red[3] > red[0]
    # alpha 0: redundancy alone; one of the tied copies goes, the later one (ties keep the older row)
    assert ref.rkv_select(imp, keys, 9, 2, 0.0, 1).tolist() == [[0, 1, 2, 4, 5, 6, 7, 8, 9]]
    imp[0, 3] = 1.0  # enough importance outweighs redundancy: now row 1 goes
    assert ref.rkv_select(imp, keys, 9, 2, 0.5, 1).tolist() == [[0, 2, 3, 4, 5, 6, 7, 8, 9]]


def test_rkv_redundancy_equals_the_similarity_matrix_form():
    """The linear form (sum of unit keys) against the definition: the ``[n, n]`` cosine matrix,
    diagonal zeroed, mean over each row, softmax over the rows; a zero key included."""
    keys = torch.randn(3, 200, 16, generator=torch.Generator().manual_seed(4))
    keys[1, 7] = 0.0
    u = keys / (keys.norm(dim=-1, keepdim=True) + 1e-8)
    sim = u @ u.transpose(-1, -2)
    sim.diagonal(dim1=-2, dim2=-1).zero_()
    torch.testing.assert_close(ref.rkv_redundancy(keys), sim.mean(dim=-1).softmax(dim=-1), rtol=1e-5, atol=1e-7)


def test_gqa_scores_sum_the_groups_query_heads():
    q, k, _ = qkv(12, seed=9)
    rows = torch.arange(12)
    got = ref.attention_sums(q[0], k[0], rows, block=5)
    probs = attention_probs(q[0], k[0], rows)  # [Hq, S, N]
    g = HQ // HKV
    want = torch.stack([probs[h * g:(h + 1) * g].sum(dim=(0, 1)) for h in range(HKV)])
    torch.testing.assert_close(got, want)
    run = Run("h2o", H2O)
    run.turn(60, 60, 0)
    pos = run.eng.ctl.cache.retained(run.rid).all_positions()
    assert not torch.equal(pos[:, 0], pos[:, 1])  # each KV head chooses its own rows


@pytest.mark.parametrize("method,knobs", [("h2o", H2O), ("rkv", RKV)])
def test_padding_entries_of_a_captured_batch_add_nothing(method, knobs):
    """A CUDA-graph batch is padded with entries that write slot 0 and read row 0 of the slot
    table: those must not change any real row's score."""
    run = Run(method, dict(knobs, interval=16))
    run.turn(20, 20, 0)
    scores = run.eng.ctl.runtime.scores
    before = scores.t.clone()
    dq, dk, _ = qkv(1, seed=77)
    batch = run.eng.decode_batch(0, [RequestSlice("pad", 0, 0, 1, 0, 1)], dq, dk)
    batch = type(batch)(**{**batch.__dict__, "slots": torch.zeros(1, dtype=torch.int64)})
    run.eng.ctl.decode_view_tensors(batch)
    assert torch.equal(scores.t[:, 1:], before[:, 1:])


@pytest.mark.parametrize("method,knobs,message", [
    ("h2o", {"recent": 0}, "recent=0 is out of range: must be >= 1"),
    ("h2o", {"budget": 8, "recent": 8}, "budget=8 is out of range: must be > recent=8"),
    ("h2o", {"budget": 256}, "budget=256 is out of range: must be > recent=512 .* lower --sparse-recent"),
    ("h2o", {"interval": 0}, "interval=0 is out of range: must be >= 1"),
    ("h2o", {"evict_prefill": "yes"}, "evict_prefill='yes' is not allowed: must be on .* or off"),
    ("rkv", {"interval": 4, "window": 8}, "interval=4 is out of range: must be >= 8"),
    ("rkv", {"alpha": 1.5}, r"alpha=1.5 is out of range: must be in \[0, 1\]"),
    ("rkv", {"kernel": 4}, "kernel=4 must be odd"),
    ("rkv", {"budget": 8, "window": 8}, "budget=8 is out of range: must be >= 9"),
])
def test_bad_options_are_refused_with_a_sentence(method, knobs, message):
    with pytest.raises(ConfigError, match=message):
        build_config(method, knobs)


@pytest.mark.parametrize("method,knobs", [("h2o", H2O), ("rkv", RKV)])
def test_a_wave_of_decode_evictions_is_planned_together(method, knobs):
    """Requests that decode in step reach their interval at the same step: their evictions are
    planned together (``plan_many``, ``compact_rows_many``) and each keeps what it would alone
    (the reference over its own tokens), with no slot lost."""
    eng = ToyEngine(method, knobs)
    runtime = eng.ctl.runtime
    free0 = eng.store.free_count()
    calls = []
    plan_many = runtime.plan_many
    runtime.plan_many = lambda rids: calls.append(list(rids)) or plan_many(rids)
    prompt, rids = 40, ["a", "b", "c"]
    q, k = {}, {}
    for row, rid in enumerate(rids):
        pq, pk, pv = qkv(prompt, seed=60 + row)
        eng.prefill(rid, row, pq, pk, pv, chunk=prompt)
        q[rid], k[rid] = pq, pk
    for step in range(2 * knobs["interval"] + 1):
        tq, tk, tv = zip(*(qkv(1, seed=1000 * (row + 1) + step) for row in range(len(rids))))
        slices = [RequestSlice(rid, row, prompt + step, prompt + step + 1, eng.ctl.cache.retained(rid).n_rows, prompt)
                  for row, rid in enumerate(rids)]
        eng.run_step(StepMode.DECODE, slices, *[[torch.cat([t[layer] for t in x]) for layer in range(LAYERS)]
                                                for x in (tq, tk, tv)])
        for row, rid in enumerate(rids):
            q[rid] = [torch.cat([a, b]) for a, b in zip(q[rid], tq[row])]
            k[rid] = [torch.cat([a, b]) for a, b in zip(k[rid], tk[row])]
    assert rids in calls  # at least one wave of all three in one plan_many call
    held = 0
    for rid in rids:
        ret = eng.ctl.cache.retained(rid)
        held += ret.n_rows
        for layer in range(LAYERS):
            want = simulate(method, knobs, q[rid][layer], k[rid][layer], [prompt], prompt, [2 * knobs["interval"] + 1])
            assert torch.equal(ret.all_positions()[layer], want), (rid, layer)
    assert eng.store.free_count() == free0 - held
    for row, rid in enumerate(rids):
        eng.finish(rid, row)
    assert eng.store.free_count() == free0
