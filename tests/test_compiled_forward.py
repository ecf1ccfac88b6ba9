"""A batch's forward replayed from one compiled graph a shape (engine/compiled_forward.py) gives
the logits of the same forward built op by op, bit for bit in fp32 on the CPU: through random
runs of joins, leaves, widths 1..5, rollbacks by each row's own amount and caches crossing their
256-position steps. Graphs are reused per shape and bounded; a forward whose layer outputs a
capture keeps is never traced (the capture would keep placeholders)."""

import random

import mlx.core as mx
import pytest
from mlx_lm.models import llama
from mlx_lm.models.cache import make_prompt_cache

from mlxspec.engine import compiled_forward
from mlxspec.engine.batch_cache import RaggedCache
from mlxspec.engine.ragged_kv import RaggedKVCache
from mlxspec.models.layer_capture import LayerCapture

VOCAB = 50


@pytest.fixture(scope="module")
def model():
    args = llama.ModelArgs(model_type="llama", hidden_size=32, num_hidden_layers=3, intermediate_size=64,
                           num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=VOCAB)
    mx.random.seed(0)
    m = llama.Model(args)
    mx.eval(m.parameters())
    return m


def _row(model, n: int, seed: int) -> list:
    """One request's prefilled cache: KVCaches, and a hybrid's GatedDeltaNet ArraysCaches."""
    row = make_prompt_cache(model)
    model(mx.array([[(3 * t + seed) % VOCAB for t in range(n)]]), cache=row)
    return row


def _states_equal(a: RaggedCache, b: RaggedCache) -> bool:
    """Whether the two batches' recurrent (GatedDeltaNet) states are equal, array for array."""
    return all(mx.array_equal(x, y).item() for p, q in zip(a._recurrent, b._recurrent, strict=True)
               for x, y in zip(p.cache, q.cache, strict=True))


def _run(model, seed: int, steps: int = 30, hidden: bool = False) -> tuple[RaggedCache, int]:
    """A random run over a compiled and an op-by-op batch side by side: (the compiled batch,
    forwards compared); asserts each forward's logits (with HIDDEN: and its final-norm hidden
    rows, what an MTP row's head reads) and the rows' ends equal."""
    rng = random.Random(seed)
    both = [RaggedCache(model, compiled=True), RaggedCache(model, compiled=False)]
    compared = 0
    for step in range(steps):
        rows = both[0].rows
        if rows < 2 or (rows < 4 and rng.random() < 0.15):  # a row joins (prefilled alone)
            n = rng.randrange(200, 270)  # the capacity steps at 256
            for cache in both:
                cache.join(_row(model, n, step))
            continue
        if rng.random() < 0.1:  # a row leaves
            keep = sorted(rng.sample(range(rows), rows - 1))
            for cache in both:
                cache.keep(keep)
            continue
        width = rng.randint(1, 5)
        x = mx.array([[rng.randrange(VOCAB) for _ in range(width)] for _ in range(rows)])
        (a, ha, _), (b, hb, _) = (cache.forward(x, hidden) for cache in both)
        assert mx.array_equal(a, b).item(), (seed, step, mx.abs(a - b).max().item())
        assert (ha is None and hb is None) if not hidden else mx.array_equal(ha, hb).item(), (seed, step)
        compared += 1
        # a hybrid's one-token step is never rolled back (its states are not taped), as in the engine
        most = width if width > 1 or not both[0].recurrent else 0
        junk = [rng.randint(0, most) for _ in range(rows)]
        for cache in both:
            cache.rollback(junk)
        kv = [c for c in both[0].layers if isinstance(c, RaggedKVCache)]
        assert kv[0].ends == [c for c in both[1].layers if isinstance(c, RaggedKVCache)][0].ends
        assert _states_equal(*both), (seed, step)  # each row's state replayed by its own count
    return both[0], compared


@pytest.mark.parametrize("seed", range(2))  # the file: 22 s with MLX's CPU JIT cache cold, 4 s warm
def test_compiled_logits_equal_op_by_op_through_a_random_run(model, seed):
    cache, compared = _run(model, seed)
    assert compared >= 10 and cache.compiled.traced >= 1  # the compiled path ran


def test_compiled_hidden_rows_equal_op_by_op_through_a_random_run(model):
    """Rows whose drafter reads the target's hidden rows (an MTP head) take them from the
    compiled graph too, of shape (B, W, H)."""
    cache, compared = _run(model, 1, hidden=True)
    assert compared >= 10 and cache.compiled.traced >= 1


@pytest.fixture(scope="module")
def hybrid(tiny_qwen3_5):
    import mlx_lm

    return mlx_lm.load(str(tiny_qwen3_5))[0]


@pytest.mark.parametrize("which", ["qwen3_5", "qwen3_next"])
def test_a_hybrid_batchs_compiled_forward_equals_op_by_op(hybrid, tiny_qwen3_next, which):
    """A GatedDeltaNet hybrid's batch (Qwen3.5: linear, full, linear, full; Qwen3-Next: its MoE
    MLP and its own GatedDeltaNet class) replays its forwards from the graph too: logits and
    hidden rows bit for bit, and after each rollback (every row's state replayed by its own
    kept count from the graph's tapes) the same states."""
    cache, compared = _run(hybrid if which == "qwen3_5" else tiny_qwen3_next, 0, steps=25, hidden=True)
    assert compared >= 8 and cache.compiled.traced >= 1 and cache.recurrent


def test_planted_tapes_of_the_wrong_rows_are_caught(hybrid, monkeypatch):
    monkeypatch.delattr(hybrid, "_mlxspec_compiled_forward", raising=False)  # graphs traced with the plant
    real = compiled_forward._advance_recurrent

    def reversed_tapes(recurrent, states, tapes, W):
        real(recurrent, states, [t[::-1] for t in tapes], W)  # row b replays row B-1-b's tape

    monkeypatch.setattr(compiled_forward, "_advance_recurrent", reversed_tapes)
    with pytest.raises(AssertionError):
        _run(hybrid, 0, steps=25)


def test_a_rank_of_a_sharded_run_keeps_its_batch_op_by_op(model, monkeypatch):
    """One rank of several (mlx.launch) communicates inside its forward: its batch is not
    compiled, as its single requests are not."""
    cache = RaggedCache(model, compiled=True)
    cache.compiled = compiled_forward.CompiledForward(model)
    for n in (20, 30):
        cache.join(_row(model, n, n))
    monkeypatch.setenv("MLX_WORLD_SIZE", "2")
    cache.forward(mx.ones((2, 3), mx.int32))
    assert cache.compiled.traced == 0
    monkeypatch.delenv("MLX_WORLD_SIZE")
    cache.forward(mx.ones((2, 3), mx.int32))
    assert cache.compiled.traced == 1


def test_a_hybrid_batch_stays_op_by_op_when_kept_to_attention_only(hybrid, monkeypatch):
    """``MLXSPEC_COMPILED_VERIFY=kv`` (hybrid_verify off) keeps a hybrid's batch op by op too."""
    monkeypatch.setattr(compiled_forward, "hybrid_verify", False)
    cache = RaggedCache(hybrid, compiled=True)
    cache.compiled = compiled_forward.CompiledForward(hybrid)
    for n in (20, 30):
        cache.join(_row(hybrid, n, n))
    cache.forward(mx.ones((2, 3), mx.int32))
    assert cache.compiled.traced == 0


def test_planted_hidden_rows_of_the_wrong_row_are_caught(model, monkeypatch):
    real = compiled_forward.CompiledForward.__call__

    def swapped(self, inputs, layers, trunk=None):
        logits, h = real(self, inputs, layers, trunk)
        return logits, None if h is None else h[::-1]  # row b gets row B-1-b's

    monkeypatch.setattr(compiled_forward.CompiledForward, "__call__", swapped)
    with pytest.raises(AssertionError):
        _run(model, 1, hidden=True)


def test_a_planted_mask_that_ignores_the_rows_ends_is_caught(model, monkeypatch):
    """Each row sees every position of the buffer (past its end: junk and other rows' room)."""
    monkeypatch.delattr(model, "_mlxspec_compiled_forward", raising=False)  # graphs traced with the plant
    monkeypatch.setattr(compiled_forward.StaticKV, "make_mask",
                        lambda self, N, **_: mx.ones((1, 1, N, self.keys.shape[2]), mx.bool_))
    with pytest.raises(AssertionError):
        _run(model, 0)


def test_graphs_are_kept_per_shape_and_bounded(model):
    cache = RaggedCache(model, compiled=True)
    cache.compiled = compiled_forward.CompiledForward(model, kept=2)  # none traced yet
    for n in (20, 30):
        cache.join(_row(model, n, n))
    for width in (2, 2, 3, 2, 3, 4, 2):
        cache.forward(mx.ones((2, width), mx.int32))
        cache.rollback([width, width])
    # 2, 3 traced; 2 and 3 replayed; 4 traced and 2 dropped (the least recently used); 2 traced again
    assert cache.compiled.traced == 4


def test_batches_over_one_model_share_its_graphs(model):
    """A batch that ends and the next one over the same model (a bench's repetitions, a
    server's idle spells) trace a shape once."""
    traced = []
    for _ in range(2):
        cache = RaggedCache(model, compiled=True)
        for n in (20, 30):
            cache.join(_row(model, n, n))
        cache.forward(mx.ones((2, 3), mx.int32))
        traced.append(cache.compiled.traced)
    assert cache.compiled is compiled_forward.CompiledForward.of(model) and traced[1] == traced[0]


def test_the_graphs_go_with_their_model():
    import gc
    import weakref

    args = llama.ModelArgs(model_type="llama", hidden_size=16, num_hidden_layers=1, intermediate_size=32,
                           num_attention_heads=2, num_key_value_heads=1, rms_norm_eps=1e-5, vocab_size=VOCAB)
    m = llama.Model(args)
    graphs = weakref.ref(compiled_forward.CompiledForward.of(m))
    del m
    gc.collect()
    assert graphs() is None


def test_a_forward_with_a_capture_attached_is_not_traced(model):
    cache = RaggedCache(model, compiled=True)
    cache.compiled = compiled_forward.CompiledForward(model)
    for n in (20, 30):
        cache.join(_row(model, n, n))
    capture = LayerCapture(model, (1,))  # attached as it is made, as a joining DFlash row's
    cache.forward(mx.ones((2, 3), mx.int32))
    assert cache.compiled.traced == 0
    got = capture.take(batched=True)
    assert got.shape == (2, 3, 32)
    mx.eval(got)  # real outputs, not a trace's placeholders


def test_the_batch_compiles_unless_switched_off(model, monkeypatch):
    """``MLXSPEC_COMPILED_BATCH`` (read at import: ``compiled_forward.batch_forward``) is what a
    batch made without ``compiled`` follows: on unless ``=0``."""
    assert compiled_forward.env_switch("MLXSPEC_UNSET_SWITCH", True)
    monkeypatch.setenv("MLXSPEC_COMPILED_BATCH", "0")
    assert not compiled_forward.env_switch(compiled_forward.BATCH_ENV, True)
    monkeypatch.setattr(compiled_forward, "batch_forward", True)
    assert RaggedCache(model).compiled is not None
    monkeypatch.setattr(compiled_forward, "batch_forward", False)
    assert RaggedCache(model).compiled is None
    assert RaggedCache(model, compiled=True).compiled is not None


@pytest.mark.parametrize("which", ["qwen3_5", "qwen3_next"])
def test_a_batchs_rows_replay_their_own_counts_in_one_call(hybrid, tiny_qwen3_next, which, monkeypatch):
    """``replay_rows`` (the batch's rollback: one gather and one masked recurrence for every row)
    gives each row the conv and recurrent states its own ``replay`` of its count gives, bit for
    bit, with counts of 0 and the whole width among them; planted: a mask one step too long."""
    from mlx_lm.models.cache import ArraysCache, make_prompt_cache

    from mlxspec.models import gdn_tape

    model = hybrid if which == "qwen3_5" else tiny_qwen3_next
    gdn = gdn_tape.tape_layers(model, make_prompt_cache(model))[0]
    B, W = 4, 5
    mx.random.seed(3)
    cache = ArraysCache(2)
    gdn(mx.random.normal((B, 7, gdn.hidden_size)), cache=cache)  # a state to start from
    before = [cache[0], cache[1]]
    cache.record_tape = True
    gdn(mx.random.normal((B, W, gdn.hidden_size)), cache=cache)
    tape = cache.tape

    def alone(kept):
        out = []
        for i, m in enumerate(kept):
            row = gdn_tape.Tape(*(x[i:i + 1] for x in (tape.conv_input, tape.q, tape.k, tape.v, tape.a, tape.b)))
            out.append(gdn.replay(row, before[1][i:i + 1], m))
        return mx.concatenate([c for c, _ in out]), mx.concatenate([s for _, s in out])

    for kept in ([0, W, 2, 3], [W] * B, [0] * B, [1, 1, 4, 2]):
        conv, state = gdn.replay_rows(tape, before[1], gdn_tape.RowCounts(kept))
        want_conv, want_state = alone(kept)
        assert mx.array_equal(conv, want_conv).item() and mx.array_equal(state, want_state).item(), kept
    real = gdn_tape.gated_delta_update
    monkeypatch.setattr(gdn_tape, "gated_delta_update", lambda *a, **k: real(
        *a[:8], None if a[8] is None else mx.pad(a[8][:, :-1], [(0, 0), (1, 0)], constant_values=True), **k))
    conv, state = gdn.replay_rows(tape, before[1], gdn_tape.RowCounts([0, W, 2, 3]))
    assert not mx.array_equal(state, alone([0, W, 2, 3])[1]).item()
