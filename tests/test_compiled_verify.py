"""A single request's verify replayed from one compiled graph (``CompiledForward.row``, what
``ModelState.forward`` runs for 2..MAX_ROW_WIDTH tokens over an attention-only target) gives the
logits and hidden rows of the same forward built op by op, bit for bit in fp32 on the CPU:
through random runs of widths 1..9, rollbacks by any amount and caches crossing their
256-position steps. It runs only where it applies, the speculative loop uses it and stays
exact, and a graph that writes one position late is caught."""

import random

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.models import llama

from mlxspec.bench.script import make_script
from mlxspec.bench.scripted import ScriptedLogits
from mlxspec.bench.synthetic import random_model
from mlxspec.engine import compiled_forward
from mlxspec.engine.cache import ModelState
from mlxspec.engine.compiled_forward import CompiledForward
from mlxspec.engine.drafters.pld import PromptLookupDrafter
from mlxspec.engine.sampling import SamplingParams
from mlxspec.engine.speculate import SpeculativeDecoder

VOCAB = 50


@pytest.fixture(scope="module")
def model():
    args = llama.ModelArgs(model_type="llama", hidden_size=32, num_hidden_layers=3, intermediate_size=64,
                           num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=VOCAB,
                           tie_word_embeddings=False)
    mx.random.seed(0)
    m = llama.Model(args)
    mx.eval(m.parameters())
    return m


def _forward(state: ModelState, tokens: mx.array, compiled: bool) -> tuple[mx.array, mx.array]:
    compiled_forward.row_verify = compiled
    try:
        logits = state.forward(tokens)
    finally:
        compiled_forward.row_verify = True
    return logits, state.hidden


def _run(model, seed: int, steps: int = 40, capture: tuple[int, ...] | None = None) -> int:
    """Two states of MODEL side by side, one compiling its steps; asserts every forward's
    logits and hidden rows (with CAPTURE: the captured layers' outputs) equal and returns how
    many forwards it compared that were compiled."""
    rng = random.Random(seed)
    step_was = compiled_forward.ROW_STEP
    compiled_forward.ROW_STEP = 256  # buffers grow (and graphs change capacity) within the run
    try:
        both = [ModelState(model, keep_hidden=capture is None, capture=capture) for _ in range(2)]
    finally:
        compiled_forward.ROW_STEP = step_was
    prompt = [(3 * t + seed) % VOCAB for t in range(rng.randrange(200, 250))]
    for state in both:
        state.prefill(prompt)
    kv = next(c for c in both[0].cache if hasattr(c, "keys"))
    first = kv.keys.shape[2]
    compiled = 0
    for step in range(steps):
        width = rng.randint(1, 9)
        x = mx.array([rng.randrange(VOCAB) for _ in range(width)], mx.uint32)
        (a, ha), (b, hb) = _forward(both[0], x, True), _forward(both[1], x, False)
        assert mx.array_equal(a, b).item(), (seed, step, width, mx.abs(a - b).max().item())
        assert mx.array_equal(ha, hb).item(), (seed, step, width)
        compiled += width > 1 or compiled_forward.plain_steps
        keep = rng.randint(0, width)
        for state in both:
            state.rollback_to(state.length - width + keep)
            state.commit()
        assert both[0].length == both[1].length
    assert kv.keys.shape[2] > first  # the buffers grew within the run
    return compiled


@pytest.fixture
def row_calls(monkeypatch) -> list[int]:
    """The widths ``CompiledForward.row`` ran, in order."""
    calls, real = [], CompiledForward.row

    def counted(self, tokens, layers, trunk=None, capture=None):
        calls.append(tokens.shape[0])
        return real(self, tokens, layers, trunk, capture)

    monkeypatch.setattr(CompiledForward, "row", counted)
    return calls


@pytest.mark.parametrize("seed", range(3))
def test_compiled_verify_equals_op_by_op_through_a_random_run(model, seed, row_calls):
    compared = _run(model, seed)
    assert compared > 10 and len(row_calls) == compared  # every verify of the compiling state, none of the other


@pytest.mark.parametrize("seed", range(2))
def test_a_hybrids_compiled_verify_equals_op_by_op_with_its_tapes(tiny_qwen3_5, seed, row_calls):
    """Qwen3.5's GatedDeltaNet layers: the graph also takes
    their states and gives back the states after the verify and the tapes a rollback replays,
    so the forwards after each partial rollback stay equal too."""
    hybrid = mlx_lm.load(str(tiny_qwen3_5))[0]
    assert ModelState(hybrid)._compiled is not None
    compared = _run(hybrid, seed, steps=25)
    assert compared > 5 and len(row_calls) == compared


@pytest.mark.parametrize("which", ["dense", "hybrid"])
def test_a_capturing_states_compiled_steps_give_the_same_layer_outputs(model, tiny_qwen3_5, which, row_calls):
    """A DFlash drafter's target (``capture``): the graph gives the chosen layers' outputs back
    as outputs of its own, equal to the op-by-op forward's bit for bit, with the logits."""
    target, ids = (model, (0, 2)) if which == "dense" else (mlx_lm.load(str(tiny_qwen3_5))[0], (1, 3))
    compared = _run(target, 1, steps=25, capture=ids)
    assert compared > 5 and len(row_calls) == compared


def test_a_planted_wrong_capture_is_caught(model, monkeypatch):
    """Captured outputs that come back other than the layers gave them (here their features
    reversed, in the compiled graph only) fail the comparison."""
    real = CompiledForward._forward

    def reversed_capture(self, trunk, kinds, capture, *args):
        out = real(self, trunk, kinds, capture, *args)
        return (out[0], [h[..., ::-1] for h in out[1]], *out[2:]) if capture is not None else out

    monkeypatch.setattr(CompiledForward, "_forward", reversed_capture)
    CompiledForward.of(model).forget()
    try:
        with pytest.raises(AssertionError):
            _run(model, 1, steps=10, capture=(0, 2))
    finally:
        CompiledForward.of(model).forget()


def test_a_planted_wrong_tape_is_caught(tiny_qwen3_5, monkeypatch):
    """A tape whose keys are lost replays a wrong state after a partial accept."""
    from mlxspec.models.gdn_tape import Tape

    monkeypatch.setattr(compiled_forward, "Tape", lambda conv, q, k, v, a, b: Tape(conv, q, k * 0, v, a, b))
    hybrid = mlx_lm.load(str(tiny_qwen3_5))[0]
    with pytest.raises(AssertionError):
        _run(hybrid, 0, steps=25)


def test_an_moe_hybrids_compiled_verify_equals_op_by_op(tiny_qwen3_next, row_calls):
    """Qwen3-Next (the Qwen3.6 MoE's layout: GatedDeltaNet layers, routed experts): compiled by
    default, and equal to op by op through rollbacks and growth."""
    assert compiled_forward.hybrid_verify  # the default
    assert ModelState(tiny_qwen3_next)._compiled is not None
    compared = _run(tiny_qwen3_next, 0, steps=20)
    assert compared > 5 and len(row_calls) == compared


def test_a_hybrid_is_compiled_unless_kept_to_attention_only(tiny_qwen3_5, monkeypatch):
    """``MLXSPEC_COMPILED_VERIFY=kv`` leaves a hybrid's verifies op by op; ``0`` every verify."""
    assert [compiled_forward.verify_modes(v) for v in (None, "", "1", "hybrid", "kv", "KV", "0")] == [
        (True, True)] * 4 + [(True, False)] * 2 + [(False, False)]
    hybrid = mlx_lm.load(str(tiny_qwen3_5))[0]
    assert ModelState(hybrid)._compiled is not None
    monkeypatch.setattr(compiled_forward, "hybrid_verify", False)
    assert ModelState(hybrid)._compiled is None


def test_a_planted_write_one_position_late_is_caught(model, monkeypatch):
    real = compiled_forward.write_positions
    monkeypatch.setattr(compiled_forward, "write_positions", lambda offset, n: real(offset + 1, n))
    CompiledForward.of(model).forget()
    try:
        with pytest.raises(AssertionError):
            _run(model, 0, steps=10)
    finally:
        CompiledForward.of(model).forget()


def test_only_verifies_that_apply_are_compiled(model, tiny_swa, tiny_qwen3_5, monkeypatch):
    made = CompiledForward.of(model)
    state = ModelState(model)
    state.prefill(list(range(20)))
    traced = made.traced
    mx.eval(state.forward(mx.array(list(range(compiled_forward.MAX_ROW_WIDTH + 1)), mx.uint32)))  # too wide
    assert made.traced == traced
    monkeypatch.setattr(compiled_forward, "plain_steps", False)  # MLXSPEC_COMPILED_PLAIN=0
    mx.eval(state.forward(mx.array([1], mx.uint32)))
    assert made.traced == traced
    monkeypatch.setattr(compiled_forward, "plain_steps", True)
    mx.eval(state.forward(mx.array([1], mx.uint32)))  # a plain step, compiled by default
    mx.eval(state.forward(mx.array([1, 2], mx.uint32)))
    assert made.traced == traced + 2
    capturing = ModelState(model, capture=(1,))  # a DFlash drafter's: captured as graph outputs
    assert capturing._compiled is not None
    capturing.close()
    assert ModelState(mlx_lm.load(str(tiny_swa))[0])._compiled is None  # a sliding window
    monkeypatch.setattr(compiled_forward, "hybrid_verify", False)  # GatedDeltaNet layers, =kv
    assert ModelState(mlx_lm.load(str(tiny_qwen3_5))[0])._compiled is None


def test_the_loop_compiles_its_verifies_and_keeps_the_greedy_tokens(tiny_llama, row_calls):
    target, tok = mlx_lm.load(str(tiny_llama))
    prompt = tok.encode("one two three four five six seven eight one two three four five six seven eight one two")
    plain = ModelState(target)
    logits = plain.forward(mx.array(prompt, mx.uint32), rollback=False)
    ref = []
    for _ in range(48):
        ref.append(mx.argmax(logits[-1]).item())
        logits = plain.forward(mx.array(ref[-1:], mx.uint32), rollback=False)
    dec = SpeculativeDecoder(target, drafter=PromptLookupDrafter(), depth=4, gates=False)
    out, stats = [], None
    for new, stats in dec.generate(prompt, sampling=SamplingParams(0.0), max_tokens=48):
        out.extend(new)
    assert out[:48] == ref
    assert len(row_calls) >= stats.verify_steps > 0


def test_a_dflash_loop_verifies_compiled_and_keeps_the_greedy_tokens(vocab8_dflash, row_calls):
    """The DFlash drafter reads the target's layer outputs (a capture): its chains' verifies and
    plain steps go through the graph, and the tokens stay plain decoding's."""
    from mlx_lm.generate import generate_step

    target, drafter_model = vocab8_dflash
    prompt = [1, 2, 3, 4, 5, 6, 7, 1, 2, 3]
    ref = [t for (t, _), _ in zip(generate_step(mx.array(prompt), target, max_tokens=40), range(40))]
    # chains (tree=0): a tree's verify stays op by op (its mask is the tree's)
    dec = SpeculativeDecoder(target, draft_model=drafter_model, drafter="dflash", depth=3, gates=False, tree=0)
    out, stats = [], None
    for new, stats in dec.generate(prompt, sampling=SamplingParams(0.0), max_tokens=40):
        out.extend(new)
    assert out == ref and stats.drafter == "dflash"
    assert len(row_calls) >= stats.verify_steps > 5


@pytest.mark.parametrize("shape", ["smoke", "smoke-hybrid"])
def test_an_echo_script_runs_its_verifies_compiled(shape, row_calls):
    model = random_model(shape, bits=0)
    script = make_script("echo", 1024, 96, 96)
    ScriptedLogits(model, script.target)
    dec = SpeculativeDecoder(model, drafter=PromptLookupDrafter(), depth=4, gates=False)
    out, stats = [], None
    for new, stats in dec.generate(script.prompt, sampling=SamplingParams(0.0), max_tokens=96):
        out.extend(new)
    assert out == script.continuation[:96]
    assert len(row_calls) >= stats.verify_steps > 10


def test_a_changed_script_needs_a_scope_of_its_own():
    """What a graph captured besides its inputs stays as traced: the bench's scripted logits
    table is one such, so the bench gives each script its own scope of graphs (and a script
    that comes back finds its graphs, traced once)."""
    m = random_model("smoke", bits=0)
    script = ScriptedLogits(m, [7] * 300)
    state = ModelState(m)
    state.prefill(list(range(1, 100)))
    x = mx.array([1, 2, 3], mx.uint32)
    made = CompiledForward.of(m)

    def argmax() -> list[int]:
        out = mx.argmax(state.forward(x), axis=-1).tolist()
        state.rollback_to(state.length - 3)
        return out

    made.scope = "sevens"
    assert argmax() == [7, 7, 7]
    script.table = mx.array([9] * 300, mx.int32)
    assert argmax() == [7, 7, 7]  # stale: the graph holds the old table
    made.scope = "nines"
    assert argmax() == [9, 9, 9]
    traced = made.traced
    script.table = mx.array([7] * 300, mx.int32)
    made.scope = "sevens"
    assert argmax() == [7, 7, 7] and made.traced == traced  # its graph again, not traced again
    made.forget()
    assert argmax() == [7, 7, 7] and made.traced == traced + 1


def test_a_batch_row_alone_steps_compiled_as_a_single_request(model, row_calls):
    from mlx_lm.models.cache import KVCache

    from mlxspec.engine.batch_cache import RaggedCache

    both = []
    for _ in range(2):
        row = [KVCache() for _ in model.layers]
        model(mx.array([[t % VOCAB for t in range(230)]]), cache=row)
        cache = RaggedCache(model)
        cache.join(row)
        both.append(cache)
    for width in (1, 2, 5, 9):  # a plain step, then verifies
        x = mx.array([[(7 * j + width) % VOCAB for j in range(width)]])
        compiled_forward.row_verify = True
        a, ha, _ = both[0].forward(x, hidden=True)
        compiled_forward.row_verify = False
        b, hb, _ = both[1].forward(x, hidden=True)
        compiled_forward.row_verify = True
        assert mx.array_equal(a, b).item() and mx.array_equal(ha, hb).item(), width
        for cache in both:
            cache.rollback([width - 1])
    assert row_calls == [1, 2, 5, 9]


@pytest.mark.parametrize("held_elsewhere", [False, True])
def test_a_compiled_verify_writes_into_the_cache_not_a_copy(model, held_elsewhere):
    """At long context a copy of every layer's buffers a verify would cost more than the verify:
    the graph's writes reuse the buffers they replace (MLX donates a buffer no one else holds).
    Holding the old buffers elsewhere (the planted case) forces the copy, and the check sees it."""
    state = ModelState(model)
    state.prefill(list(range(1, 50)))
    assert state.pad(8000)
    x = mx.array([1, 2, 3, 4], mx.uint32)
    mx.eval(state.forward(x))  # traced and warm
    state.rollback_to(state.length - 4)
    layer = state.cache[0].keys.nbytes
    held = [c.keys for c in state.cache] if held_elsewhere else None
    mx.eval([c.state for c in state.cache])
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    mx.eval(state.forward(x))
    extra = mx.get_peak_memory() - base
    # one layer's keys and values copied would be 2 x LAYER; the attention's scores over 8K keys
    # (the CPU's op materialises them) are about one LAYER
    if held_elsewhere:
        assert extra > 2 * layer, (extra, layer)
    else:
        assert extra < 2 * layer, (extra, layer)
    del held


def test_a_long_run_traces_few_graphs():
    """A graph is traced per (width, capacity): the request's buffers grow in ROW_STEP positions,
    so a 1,200-token run traces each width about once a ROW_STEP (with mlx-lm's 256: 33 graphs
    before plain steps were compiled too, 39 with them)."""
    model = random_model("smoke", bits=0)
    script = make_script("echo", 1024, 200, 1200)
    ScriptedLogits(model, script.target)
    made = CompiledForward.of(model)
    dec = SpeculativeDecoder(model, drafter=PromptLookupDrafter(), gates=True)
    out, stats = [], None
    for new, stats in dec.generate(script.prompt, sampling=SamplingParams(0.0), max_tokens=1200):
        out.extend(new)
    assert out == script.continuation[:1200] and stats.verify_steps > 100
    assert made.traced <= 18, made.traced


def test_the_switches_read_off_on_and_their_defaults(monkeypatch):
    """``MLXSPEC_COMPILED_PLAIN`` / ``_BATCH`` / ``_HEAD``: ``0`` off, anything else on, the
    default when unset or empty."""
    for value, default, want in [(None, True, True), ("", False, False), ("0", True, False), (" 0 ", True, False),
                                 ("1", False, True), ("yes", False, True)]:
        if value is None:
            monkeypatch.delenv("MLXSPEC_TEST_SWITCH", raising=False)
        else:
            monkeypatch.setenv("MLXSPEC_TEST_SWITCH", value)
        assert compiled_forward.env_switch("MLXSPEC_TEST_SWITCH", default) is want, (value, default)
