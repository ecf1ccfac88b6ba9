"""Costs that grow with the context: the curve timed over padded long caches
(engine/context_cost.py), read by the gate at the request's own length, and stored.

Why: on one H200 (Qwen3-8B shape) a 2-token verify cost 1.5x a token at 1K of context and
2.0x at 32K, and a gate reading the curve timed over 128 tokens kept a scripted MTP head
drafting at 32K where it ran at 0.64x of plain decoding."""

import json

import mlx.core as mx
import mlx_lm
import pytest

import tiny
from mlxspec.engine import context_cost
from mlxspec.engine.cache import ModelState
from mlxspec.engine.gates import CostModel, SpeculationGate
from mlxspec.engine.speculate import SpeculativeDecoder
from mlxspec.tuning import storage

NOVEL_PROMPT = "The quick brown fox jumps over the lazy dog."


def _grown() -> CostModel:
    """A curve over 128 tokens, the same forwards timed over 4096, and a plain token there."""
    return CostModel(curve={1: 1.0, 2: 1.2, 3: 1.3}, slope=0.1, plain=0.8, context=128,
                     at={4096: {1: 1.1, 2: 1.5, 4: 1.8}}, plain_at={4096: 0.9}, context_known=True)


def test_costs_are_read_at_the_context():
    cost = _grown()
    assert cost.verify(2) == cost.verify(2, 128) == pytest.approx(1.2)  # the curve's own length
    assert cost.verify(2, 4096) == pytest.approx(1.5)  # as timed there
    assert cost.verify(2, 2112) == pytest.approx(1.35)  # halfway: linear in the length
    assert cost.verify(2, 8064) == pytest.approx(1.8)  # past the last: at its slope
    # width 3 was not timed at 4096: its growth lies between width 2's (0.3) and width 4's
    # (1.8 - 1.4, the curve read at 4 past its last width at slope 0.1)
    assert cost.verify(3, 4096) == pytest.approx(1.3 + 0.35)
    assert cost.plain_cost() == cost.plain_cost(128) == pytest.approx(0.8)
    assert cost.plain_cost(4096) == pytest.approx(0.9)
    # a plain token not timed there grows as a 1-token forward did
    cost.plain_at = {}
    assert cost.plain_cost(4096) == pytest.approx(0.9) and cost.plain_cost(8064) == pytest.approx(1.0)
    # no growth measured: the curve holds at every length
    flat = CostModel(curve={1: 1.0, 2: 1.2}, plain=0.8)
    assert flat.verify(2, 32768) == 1.2 and flat.plain_cost(32768) == 0.8


class _Lookup:
    name, cost_per_token, uses_model = "fake", 0.0, False


def _gate(cost: CostModel) -> SpeculationGate:
    gate = SpeculationGate(_Lookup(), max_depth=2, cost=cost)
    for _ in range(SpeculationGate.MIN_EVIDENCE + 4):
        gate.observe(2, 1)  # the first draft always kept, the second never: 2 tokens a verify
    return gate


def test_the_gate_switches_off_where_the_context_makes_a_verify_dear():
    """Two tokens a verify of 1.2 pay at 128 tokens (2 x 0.8 / 1.2 = 1.33x), not at 8K, where
    a 2-token verify costs 2.0 and a plain token 1.0 (1.0x; 10% is needed to switch on) and
    32K (0.7x). Planted bug, the gate never told the context: it drafts at 32K."""
    grown = CostModel(curve={1: 1.0, 2: 1.2, 3: 1.4}, plain=0.8, context=128,
                      at={8192: {1: 1.2, 2: 2.0, 3: 2.4}}, context_known=True)
    gate = _gate(grown)
    gate.at_context(100)
    assert gate.depth() == 1 and gate.on
    gate.at_context(32768 + 17)
    assert gate.context == 32768 and gate.depth() == 0 and not gate.on
    assert "stopped paying" in gate.events[-1][1]
    gate.at_context(300)  # a shorter context again (a new turn): pays again
    assert gate.depth() == 1 and gate.on

    blind = _gate(grown)
    blind.at_context(100)
    assert blind.depth() == 1
    assert blind.depth() == 1 and blind.on  # planted: at_context(32768) never called


def test_the_decisions_follow_the_token_count_in_steps():
    """The estimate is recomputed once a CONTEXT_STEP, so a run's decisions (and a seeded
    run's draws) follow its token count alone."""
    gate = _gate(_grown())
    gate.at_context(SpeculationGate.CONTEXT_STEP * 3 + 5)
    assert gate.context == SpeculationGate.CONTEXT_STEP * 3
    best = gate.best_depth()
    gate.at_context(SpeculationGate.CONTEXT_STEP * 3 + 100)
    assert gate.best_depth() is best  # same step: not recomputed


@pytest.fixture(scope="module")
def looping_llama(tmp_path_factory, shared_tokenizer):
    """Small weights: greedy output falls into loops, which prompt lookup drafts right."""
    path = tiny.write_checkpoint(tmp_path_factory.mktemp("looping"), "llama",
                                 tokenizer=shared_tokenizer, seed=0, weight_scale=0.05)
    return mlx_lm.load(str(path))


def _run(model, prompt, cost):
    dec = SpeculativeDecoder(model, drafter="pld", cost=cost)
    out, stats = [], None
    for toks, stats in dec.generate(prompt, max_tokens=120):
        out.extend(toks)
    return out, stats


def test_the_loop_tells_the_gate_its_context(looping_llama, monkeypatch):
    """Prompt lookup on looping output pays on the curve (on from about 65 tokens of context
    here); where verifies grow very dear from 96 tokens on, the loop's gate switches it off
    there and it stays off. The tokens are plain decoding's either way. Planted bug, the loop
    never telling the gate: it drafts on to the end."""
    model, tok = looping_llama
    monkeypatch.setattr(SpeculationGate, "CONTEXT_STEP", 16)
    prompt = tok.encode(NOVEL_PROMPT)
    plain = SpeculativeDecoder(model, drafter="none")
    expected = [t for toks, _ in plain.generate(prompt, max_tokens=120) for t in toks]

    def dear():
        return CostModel(slope=0.08, context=96, at={160: {1: 1.0, 2: 40.0, 9: 320.0}}, context_known=True)

    out, stats = _run(model, prompt, dear())
    assert out == expected
    events = [(e.enabled, len(prompt) + e.at_token, e.reason) for e in stats.gate_events]
    on = [at for enabled, at, _ in events if enabled]
    off = [at for enabled, at, why in events if not enabled and "stopped paying" in why]
    assert on and on[0] < 96 and off and 96 < off[0] <= 128 and max(on) < off[-1], events

    monkeypatch.setattr(SpeculationGate, "at_context", lambda self, tokens: None)
    out, blind = _run(model, prompt, dear())
    assert out == expected
    assert not [e for e in blind.gate_events if "stopped paying" in e.reason]
    assert blind.accepted > stats.accepted


# -- padded caches ----------------------------------------------------------------------------

@pytest.mark.parametrize("fixture", ["tiny_qwen3", "tiny_swa", "tiny_qwen3_5"])
def test_a_padded_cache_forwards_and_rolls_back_like_a_long_one(fixture, request):
    """Attention caches (a sliding window's included, up to its window) take N placeholder
    positions; recurrent state is left alone; forwards and rollbacks then work as after a
    long prefill."""
    model = mlx_lm.load(str(request.getfixturevalue(fixture)))[0]
    state = ModelState(model)
    assert state.pad(100) is False and state.length == 0  # no forward has shown the shapes
    state.prefill(list(range(1, 9)))
    per_token = state.kv_bytes_per_token()
    assert per_token > 0
    assert state.pad(300) is True and state.length == 308
    kv = [c for c in state.cache if hasattr(c, "offset") and not hasattr(c, "cache")]
    assert all(c.offset == 308 for c in kv)
    logits = state.forward(mx.array([5, 6, 7], mx.uint32))
    assert logits.shape[0] == 3 and not mx.isnan(logits).any().item()
    state.rollback_to(309)
    assert state.length == 309 and all(c.offset == 309 for c in kv)


def test_the_curve_is_timed_over_long_contexts(tiny_qwen3):
    """On the tiny model (CPU): every length within the memory limit gets widths with 1 among
    them and a plain token no dearer than a waited forward there; a length past the limit is
    left out; a model padded past nothing keeps a flat curve."""
    model = mlx_lm.load(str(tiny_qwen3))[0]
    cost = CostModel(curve={1: 1.0, 2: 1.1}, measured=True, context=32)
    context_cost.measure_context_cost(model, cost, 32, contexts=(512, 2048), widths=(1, 2, 4), reps=1)
    assert cost.context_known and set(cost.at) == {512, 2048}
    assert all(set(curve) == {1, 2, 4} and min(curve.values()) > 0 for curve in cost.at.values())
    assert all(0.25 <= cost.plain_at[L] <= cost.at[L][1] for L in cost.at)
    state = ModelState(model)
    state.prefill([1, 2, 3])
    limit = state.kv_bytes_per_token() * 1000
    cut = context_cost.measure_context_cost(model, CostModel(curve={1: 1.0}), 32, contexts=(512, 2048),
                                            widths=(1, 2), reps=1, limit_bytes=limit)
    assert set(cut.at) == {512} and cut.context_known
    spent = context_cost.measure_context_cost(model, CostModel(curve={1: 1.0}), 32, contexts=(512, 2048),
                                              widths=(1, 2), reps=1, budget_s=0.0)
    assert spent.at == {} and spent.context_known  # no time left: no length started


# -- stored, and measured once where a request needs it ----------------------------------------

def test_the_growth_is_stored_and_read_back(tmp_path, monkeypatch, tiny_qwen3):
    from mlxspec.api import load

    monkeypatch.setenv(storage.DATA_ENV, str(tmp_path / "tune"))
    spec = load(str(tiny_qwen3))
    storage.save_cost(spec.target, _grown())
    again = storage.stored_cost(spec.target)
    assert again.context_known and again.context == 128 and again.at == {4096: {1: 1.1, 2: 1.5, 4: 1.8}}
    assert again.plain_at == {4096: 0.9} and again.verify(2, 4096) == pytest.approx(1.5)
    path = storage.result_path(spec.target)
    record = json.loads(path.read_text())
    for bad in ({"context": 128, "at": {"4096": {"1": -1, "2": 1.5}}}, {"context": "x"}, {"at": [1]},
                {"context": 5000, "at": {"4096": {"1": 1.1, "2": 1.5}}}):
        path.write_text(json.dumps({**record, storage.CONTEXT_KEY: bad}))
        read = storage.stored_cost(spec.target)
        assert read.at == {} and read.verify(2, 32768) == pytest.approx(1.2), bad
    del record[storage.CONTEXT_KEY]  # an older record: not known, measured when a request needs it
    path.write_text(json.dumps(record))
    assert not storage.stored_cost(spec.target).context_known


@pytest.fixture
def measured_once(tmp_path, monkeypatch, tiny_qwen3):
    """tiny_qwen3 loaded with a stored curve and no growth in its record; measuring the growth
    records the curve's context in the returned list and gives a fixed growth."""
    from mlxspec.api import load

    monkeypatch.setenv(storage.DATA_ENV, str(tmp_path / "tune"))
    spec = load(str(tiny_qwen3))
    storage.save_cost(spec.target, CostModel(curve={1: 1.0, 2: 1.2}, measured=True))
    calls = []

    def measure(model, cost, context, **kw):
        calls.append(context)
        cost.context, cost.at, cost.context_known = context, {4096: {1: 1.5, 2: 3.0}}, True
        return cost

    monkeypatch.setattr(context_cost, "measure_context_cost", measure)
    return spec, calls


def test_a_long_request_measures_the_growth_once(measured_once):
    """A request whose prompt and answer may reach CONTEXT_COST_FROM tokens measures the
    growth (announced) where the stored record lacks it, and stores it; a short one and the
    next long one do not."""
    from mlxspec.options import CONTEXT_COST_FROM

    spec, calls = measured_once
    labels = []
    spec.generate("hi", drafter="pld", max_tokens=4, on_status=labels.append)
    assert calls == []
    long = "hi " * (CONTEXT_COST_FROM // 2)  # a prompt past it: its context is long from the start
    spec.generate(long, drafter="pld", max_tokens=4, on_status=labels.append)
    assert calls == [128] and any("grows with the context" in label for label in labels)
    assert storage.stored_cost(spec.target).at == {4096: {1: 1.5, 2: 3.0}}
    spec._cost = None  # a later run: read from the record
    spec.generate(long, drafter="pld", max_tokens=4)
    assert calls == [128] and spec._cost.at == {4096: {1: 1.5, 2: 3.0}}


def test_a_tree_budget_reads_the_costs_at_the_context():
    """Wide verifies nearly free over 128 tokens, a row more each over 16K (the attention reads
    the keys once a row): trees of 32 nodes at the start, one extra node at 16K. Planted bug,
    the context left out: 32 at 16K too."""
    from mlxspec.engine.tree_step import TreePolicy

    flat = {n: 1.0 + 0.01 * (n - 1) for n in range(1, 34)}
    cost = CostModel(curve=flat, measured=True, context=128, at={16384: {n: float(n) for n in range(1, 34)}},
                     context_known=True)
    assert TreePolicy(None, cost).budget(4, 3.0) == 32
    assert TreePolicy(None, cost).budget(4, 3.0, context=16384) == 5


def test_a_batch_row_that_may_run_long_measures_the_growth(measured_once):
    """A row joining a batch: its prompt is not known when its plan is made, so its
    max_tokens alone decides (a server's requests are served this way)."""
    from mlxspec.options import CONTEXT_COST_FROM
    from mlxspec.request import GenerationRequest

    spec, calls = measured_once
    spec.batch_plan(GenerationRequest(drafter="pld", max_tokens=16))
    assert calls == []
    spec.batch_plan(GenerationRequest(drafter="pld", max_tokens=CONTEXT_COST_FROM))
    assert calls == [128]
