"""What a verify and a plain token cost as the context grows, timed over padded caches.

The verify-cost curve (engine/costs.py) is timed over about 128 tokens of context. Attention
reads every cached key, and a verify's rows read them again, so the costs move with the
length: on one H200 (Qwen3-8B shape, 4-bit), from 128 to 32K tokens a waited 1-token forward
grew from 9.5 to 17.5 ms, a 2-token one from 9.3-10.1 to 21.7-25.0 ms and a pipelined plain
token from 5.6-6.1 to 14.2-14.9 ms (benchmarks/results/context-cost-h200-8b.json). Here the
same forwards are timed over caches of LONG_CONTEXTS tokens, padded with placeholder positions
(``ModelState.pad``, timed alike with prefilled ones to 8K) so that no long prefill runs, and
the gate reads them at the request's own length (``CostModel.verify(n, context)``).
"""

from __future__ import annotations

from typing import Callable

import mlx.core as mx
import mlx.nn as nn

from .cache import ModelState, model_nbytes
from .costs import PLAIN_RUNS, PLAIN_STEPS, Budget, plain_factor, verify_times
from .gates import CostModel

LONG_CONTEXTS = (4096, 16384)  # past the last, costs grow at the slope of the last two
LONG_WIDTHS = (1, 2, 3, 4, 6, 8, 12, 16)
LONG_REPS = 3
REAL_TOKENS = 16  # the padded caches start from this many prefilled tokens
UNIT_SHARE = 0.2  # of a budget, what timing the unit (a 1-token forward over the curve's context) may take
MEMORY_SHARE = 8  # padding may take this share of the device's memory: 1/8
UNKNOWN_MEMORY_BYTES = 2 << 30  # what padding may take where the device does not say its memory


def padding_limit_bytes() -> int:
    """Bytes the padded caches may take: an eighth of the device's memory where MLX reports
    it, else UNKNOWN_MEMORY_BYTES (on a Mac with 16 GB an 8B model's 147 KB a token is padded
    to 4K tokens, not 16K)."""
    try:
        info = mx.device_info()
    except (AttributeError, RuntimeError):
        info = {}
    memory = next((info[k] for k in ("memory_size", "total_memory") if isinstance(info.get(k), int)), None)
    return memory // MEMORY_SHARE if memory else UNKNOWN_MEMORY_BYTES


def measure_context_cost(
    model: nn.Module, cost: CostModel, context: int, *, vocab: int = 256,
    contexts=LONG_CONTEXTS, widths=LONG_WIDTHS, reps: int = LONG_REPS, budget_s: float | None = None,
    limit_bytes: int | None = None, on_progress: Callable[[int, int], None] | None = None,
) -> CostModel:
    """Fill COST (a curve timed over CONTEXT tokens) with the same forwards timed over each of
    CONTEXTS (``at``) and a pipelined plain token there (``plain_at``), in COST's units; a
    1-token forward over CONTEXT is timed again here as the unit. A length whose padded cache
    would pass LIMIT_BYTES (None: :func:`padding_limit_bytes`), or which the BUDGET_S left
    cannot time at two widths, is left out, and the longer ones with it. A model with no
    growing attention cache (recurrent only) gets none: its costs do not grow. Returns COST."""
    cost.context, cost.at, cost.plain_at, cost.context_known = context, {}, {}, True
    probe = ModelState(model)
    probe.prefill([(7 * i) % vocab for i in range(REAL_TOKENS)])
    per_token = probe.kv_bytes_per_token()
    del probe
    limit = padding_limit_bytes() if limit_bytes is None else limit_bytes
    lengths = [L for L in sorted(contexts) if L > context and per_token * L <= limit]
    if not per_token or not lengths:
        return cost
    budget = Budget(budget_s)
    on_gpu = mx.default_device().type == mx.DeviceType.gpu
    unit_budget = None if budget_s is None else budget_s * UNIT_SHARE
    one = min(verify_times(model, (1,), context=context, reps=reps, vocab=vocab, budget_s=unit_budget)[1])
    weights = max(1, model_nbytes(model))
    done, total = 0, len(lengths)
    for i, length in enumerate(lengths):
        # two forwards at least (a warm-up, one timed), each reading the weights and the cache
        if not budget.fits(2 * one * (1 + per_token * length / weights)):
            break
        left = budget.left()
        left = None if left is None else left / (len(lengths) - i)  # shared by the lengths to come
        times = verify_times(model, widths, context=REAL_TOKENS, reps=reps, vocab=vocab, warmup_each=on_gpu,
                             budget_s=left, pad_to=length)
        mx.clear_cache()
        if len(times) < 2:
            break
        cost.at[length] = {n: min(t) / one for n, t in times.items()}
        waited = cost.at[length][1] * one
        if budget.fits((PLAIN_STEPS + 2) * (PLAIN_RUNS + 1) * waited):
            cost.plain_at[length] = plain_factor(model, one, vocab, pad_to=length, cap=cost.at[length][1])
            mx.clear_cache()
        done += 1
        if on_progress:
            on_progress(done, total)
    if on_progress and done < total:
        on_progress(total, total)
    return cost
