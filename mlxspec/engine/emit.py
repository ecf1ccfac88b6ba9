"""What a request has emitted so far: the stop-token and length rules, and the timings its
stats report (time to first token, decode time). One per request, batched or not."""

from __future__ import annotations

import time

import mlx.core as mx

from .stats import Stats


class Output:
    def __init__(self, stats: Stats, max_tokens: int, stop_tokens: set[int] | frozenset[int]):
        self.stats = stats
        self.max_tokens = max_tokens
        self.stop_tokens = stop_tokens
        self.t0 = self.t_first = time.perf_counter()
        self.emitted = 0

    @property
    def done(self) -> bool:
        return self.stats.finish_reason is not None

    @property
    def remaining(self) -> int:
        return self.max_tokens - self.emitted

    def take(self, new: list[int]) -> list[int]:
        """NEW committed tokens, cut after a stop token or at max_tokens: what is emitted."""
        out = []
        st = self.stats
        for t in new:
            out.append(t)
            self.emitted += 1
            if t in self.stop_tokens:
                st.finish_reason = "stop"
                break
            if self.emitted >= self.max_tokens:
                st.finish_reason = "length"
                break
        now = time.perf_counter()
        if st.generated_tokens == 0 and out:
            st.ttft_s = st.prompt_time_s = now - self.t0
            self.t_first = now
        st.generated_tokens += len(out)
        st.decode_time_s = now - self.t_first
        if st.generated_tokens // 256 != (st.generated_tokens - len(out)) // 256:
            mx.clear_cache()
        return out
