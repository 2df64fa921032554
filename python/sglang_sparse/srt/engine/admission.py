"""The scheduler asks the method's MemoryOracle, not the logical length, what a request costs.

SGLang reserves ``prompt + max_new_tokens`` rows for a request at arrival and at admission. That
is right for dense attention and for Quest (which keeps every row), and too much for a method
that evicts: SnapKV holds the whole prompt only until its last chunk is scored, then ``budget``
rows. Running requests are already counted at their retained size, because compaction hands the
evicted rows back to SGLang's allocator and SGLang's decode check reads ``kv_committed_len``
(resident rows). What remains logical is the reservation for the decode still ahead:

- running requests (``PrefillAdder._get_running_request_total_token_offset``): SGLang reserves
  the tokens each may still decode; a request that also evicts while decoding (StreamingLLM)
  never grows past its row cap, so it reserves at most ``oracle.growth_left`` (its peak rows
  minus the rows it holds). Without this, long outputs keep admission shut although the pool
  has room;

- arrival: SGLang clips ``max_new_tokens`` so that ``prompt + max_new`` fits the pool (both via
  ``max_req_len``, the pool size, and ``max_new_tokens_for_memory``). An evicting method's request
  needs its prompt (prefill peak) and afterwards ``retained + max_new`` rows; its logical length
  is bounded by the model's context only;
- admission (``PrefillAdder``): ``total_tokens`` and the budget reserved for a newly admitted
  request count ``controller.decode_reserve(prompt, max_new)`` decode rows instead of
  ``max_new``. The prefill chunk itself is still charged in full (``current_offset``): its rows
  are really allocated before compaction frees them. A method that evicts between prompt chunks
  (H2O, ``oracle.prefill_cap``) is admitted on ``min(prompt, prefill_cap + chunk)`` prompt rows
  instead of the whole prompt: that is the most it holds at once, each later chunk is charged
  again when SGLang schedules it (``add_chunked_req``), and SGLang admits no other request until
  a chunked request's last chunk, so nothing else is promised the rows its later chunks take.

- a method store (``runtime.store_admits``, KIVI's blocks): a request waits while its units over
  its life do not fit next to what the running requests still need (unless nothing else runs).

Installed only when the method evicts; dense and Quest keep SGLang's own arithmetic.
"""

from __future__ import annotations

import functools

from sglang_sparse.srt.state import STATE, sparse

def _evicting_controller():
    ctl = STATE.scheduler.controller
    return ctl if ctl is not None and ctl.oracle.evicts else None


def around_max_new_tokens_for_memory(original, allocator, input_tokens, max_new_tokens, **kwargs):
    ctl = _evicting_controller()
    if ctl is None:
        return original(allocator, input_tokens, max_new_tokens, **kwargs)
    if original(allocator, input_tokens, 1, **kwargs) != 1:  # the prompt itself does not fit
        return original(allocator, input_tokens, max_new_tokens, **kwargs)
    # After compaction the request holds rows_after_prefill rows, then one more per new token
    # (or, when decoding also evicts, at most the oracle's row cap).
    after = ctl.oracle.rows_after_prefill(input_tokens)
    growth = ctl.oracle.decode_growth(input_tokens, max_new_tokens)
    if original(allocator, after, growth, **kwargs) == growth:
        return max_new_tokens
    return original(allocator, after, max_new_tokens, **kwargs)


def around_init_req_max_new_tokens(original, scheduler, req, *args, **kwargs):
    """The logical length of an evicting method's request is bounded by the model's context, not
    by the pool (which only has to hold its retained rows)."""
    if _evicting_controller() is None:
        return original(scheduler, req, *args, **kwargs)
    saved = scheduler.max_req_len
    scheduler.max_req_len = max(saved, scheduler.model_config.context_len - 1)
    try:
        return original(scheduler, req, *args, **kwargs)
    finally:
        scheduler.max_req_len = saved


def store_claims(reqs, but=None) -> list[tuple[str, int, int]]:
    """``(rid, prompt_len, max_new_tokens)`` of ``reqs`` (less ``but``), for ``store_admits``."""
    return [(r.rid, len(r.origin_input_ids), r.sampling_params.max_new_tokens or 0) for r in reqs if r is not but]


@functools.cache
def _oracle_adder(base: type) -> type:
    """A PrefillAdder subclass whose reservations come from the controller's MemoryOracle (one
    per SGLang adder class)."""

    class OracleAdmissionAdder(base):
        _oracle_prompt_len: int | None = None

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            # this round's chunked prefill size (None: off), before any chunk is taken from it
            self._oracle_chunk = self.rem_chunk_tokens

        def add_one_req(self, req, *args, **kwargs):
            ctl = STATE.scheduler.controller
            # a method store (KIVI's blocks) must hold the request too; alone (or finishing with
            # an error at once), it always runs
            others = store_claims([*self.running_batch.reqs, *self.can_run_list], req) if ctl.store_admission else []
            cached = len(sparse(req).units or ())  # blocks of its prompt the radix cache holds
            if others and req.to_finish is None and not ctl.runtime.store_admits(
                    len(req.origin_input_ids), req.sampling_params.max_new_tokens or 0, others, cached):
                from sglang.srt.managers.schedule_policy import AddReqResult

                ctl.runtime.bump("store_admission_waits")
                return AddReqResult.NO_TOKEN
            # SGLang's ignore-eos path simulates finishing requests handing back their *logical*
            # length, which overstates what an evicting method frees; use the budget path.
            sp = req.sampling_params
            ignore_eos, sp.ignore_eos = sp.ignore_eos, False
            try:
                return super().add_one_req(req, *args, **kwargs)
            finally:
                sp.ignore_eos = ignore_eos

        def _get_running_request_total_token_offset(self, req) -> int:
            reserved = super()._get_running_request_total_token_offset(req)
            ctl = STATE.scheduler.controller
            state = ctl.cache.requests.get(req.rid)
            if state is None:  # not (yet) known to the controller: SGLang's estimate
                return reserved
            left = ctl.oracle.growth_left(len(req.origin_input_ids), req.sampling_params.max_new_tokens,
                                          state.retained.n_rows)
            return min(reserved, left)

        def _check_prefill_budget(self, req, *, total_tokens, extend_input_len, **kwargs):
            max_new = self._swa_new_tokens(req)  # = the max_new that add_one_req put in total_tokens
            oracle = STATE.scheduler.controller.oracle
            reserve = oracle.decode_reserve(len(req.origin_input_ids), max_new)
            # a method that evicts between prompt chunks (H2O) holds at most its prefill cap + one
            # chunk of the extend at a time, not the whole extend (MemoryOracle.chunked_prefill_rows)
            prompt = oracle.chunked_prefill_rows(extend_input_len, self._oracle_chunk)
            total = total_tokens - max_new + reserve - extend_input_len + prompt
            return super()._check_prefill_budget(req, total_tokens=total, extend_input_len=extend_input_len, **kwargs)

        def _commit_prefill_admission(self, req, *args, **kwargs):
            self._oracle_prompt_len = len(req.origin_input_ids)
            try:
                return super()._commit_prefill_admission(req, *args, **kwargs)
            finally:
                self._oracle_prompt_len = None

        def add_chunked_req(self, req):
            self._oracle_prompt_len = len(req.origin_input_ids)
            try:
                return super().add_chunked_req(req)
            finally:
                self._oracle_prompt_len = None

        def _update_prefill_budget(self, prefix_len, extend_input_len, max_new_tokens, *args, **kwargs):
            # max_new_tokens is non-zero only with a request's last prompt chunk.
            if max_new_tokens and self._oracle_prompt_len is not None:
                max_new_tokens = STATE.scheduler.controller.decode_reserve(self._oracle_prompt_len, max_new_tokens)
            return super()._update_prefill_budget(prefix_len, extend_input_len, max_new_tokens, *args, **kwargs)

    OracleAdmissionAdder.__name__ = f"OracleAdmission{base.__name__}"
    return OracleAdmissionAdder


def after_get_prefill_adder_class(result, *args, **kwargs):
    return _oracle_adder(result) if _evicting_controller() is not None else result
