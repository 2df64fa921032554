"""MemoryOracle: what a request costs in KV rows, as the scheduler must ask it (engine-agnostic).

The attention budget does not decide memory: Quest reads a few pages but keeps everything;
SnapKV holds the whole prompt until its last chunk is scored, then only its budget.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MemoryOracle:
    """Rows (slots) held by one request. ``retained_budget=None``: nothing is evicted.
    ``row_cap``: a method that also evicts while decoding (StreamingLLM) never holds more rows
    than this once its prompt is compacted. ``prefill_cap``: a method that also evicts between
    prompt chunks (H2O) holds at most this many rows before each chunk, so at most
    ``prefill_cap + chunk`` while one chunk is prefilled."""

    retained_budget: int | None = None
    row_cap: int | None = None
    prefill_cap: int | None = None

    @classmethod
    def online(cls, budget: int, interval: int, evict_prefill: bool = False) -> "MemoryOracle":
        """An online evictor (H2O, R-KV, SkipKV): back to ``budget`` rows once ``interval`` are
        over it, so never more than ``budget + interval`` while decoding; with ``evict_prefill``
        also between prompt chunks, so the same cap before each chunk."""
        cap = budget + interval
        return cls(retained_budget=budget, row_cap=cap, prefill_cap=cap if evict_prefill else None)

    def prefill_peak_rows(self, prompt_len: int) -> int:
        """Rows held while the prompt is prefilled in one piece (until compaction)."""
        return prompt_len

    def chunked_prefill_rows(self, extend_len: int, chunk: int | None) -> int:
        """Rows an extend of ``extend_len`` new tokens, prefilled in chunks of at most ``chunk``
        tokens, holds at its peak beside the rows the request holds already: all of them,
        unless the method evicts between chunks (``prefill_cap``), then the rows it keeps
        before a chunk plus that chunk."""
        if self.prefill_cap is None or not chunk or chunk <= 0:
            return extend_len
        return min(extend_len, self.prefill_cap + chunk)

    def rows_after_prefill(self, prompt_len: int) -> int:
        if self.retained_budget is None:
            return prompt_len
        return min(prompt_len, self.retained_budget)

    def rows_at(self, prompt_len: int, generated: int) -> int:
        """Rows held after ``generated`` decode tokens."""
        rows = self.rows_after_prefill(prompt_len) + generated
        return rows if self.row_cap is None else min(rows, max(self.row_cap, self.rows_after_prefill(prompt_len)))

    def decode_growth(self, prompt_len: int, max_new_tokens: int) -> int:
        """Rows a request gains from its compacted prompt to its last token (at most
        ``max_new_tokens``; less when decoding also evicts)."""
        return self.rows_at(prompt_len, max_new_tokens) - self.rows_after_prefill(prompt_len)

    def growth_left(self, prompt_len: int, max_new_tokens: int, rows_now: int) -> int:
        """Rows a running request holding ``rows_now`` rows may still gain before it finishes: up
        to its peak after compaction (``rows_at`` its last token), never negative. SnapKV: the
        tokens left to decode; StreamingLLM: at most up to its row cap, however long it runs."""
        return max(0, self.rows_at(prompt_len, max_new_tokens) - rows_now)

    @property
    def evicts(self) -> bool:
        return self.retained_budget is not None

    def admission_rows(self, prompt_len: int, max_new_tokens: int) -> int:
        """Rows to reserve to admit a request and run it to completion."""
        return max(self.prefill_peak_rows(prompt_len), self.rows_at(prompt_len, max_new_tokens))

    def decode_reserve(self, prompt_len: int, max_new_tokens: int) -> int:
        """Rows to reserve on top of the prompt's own rows for ``max_new_tokens`` of decoding.

        An engine that counts ``prompt + max_new`` asks this instead of using ``max_new``:
        ``prompt + decode_reserve == admission_rows``. For SnapKV with budget B, a prompt of
        L > B rows and N new tokens: ``max(0, B + N - L)``, since compaction frees ``L - B`` rows
        before the first decode token is written."""
        return self.admission_rows(prompt_len, max_new_tokens) - self.prefill_peak_rows(prompt_len)

