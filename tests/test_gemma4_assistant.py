"""Gemma 4 targets and the Gemma-4 assistant drafter, on tiny random checkpoints in the real
Hugging Face layout (tests/tiny_gemma4.py).

The assistant's logits are checked against transformers' own ``Gemma4AssistantForCausalLM``
(saved by scripts/make_gemma4_reference.py: no torch needed here); the engine must give plain
decoding's output at temperature 0 with every drafter and draft from the rolled-back target cache
after a partial accept. The assistant's sampling at temperature > 0 is scored at several
positions in tests/test_distribution_heads.py.
"""

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import tiny_gemma4
from mlxspec.engine.cache import ModelState
from mlxspec.engine.drafters.assistant import AssistantDrafter
from mlxspec.engine.drafters.registry import resolve_drafter
from mlxspec.engine.sampling import SamplingParams
from mlxspec.engine.speculate import SpeculativeDecoder
from mlxspec.errors import DrafterError, UsageError
from mlxspec.models.gemma4_assistant import load_assistant
from mlxspec.models.loader import load_model

GREEDY = SamplingParams()


@pytest.fixture(scope="module")
def reference_pair(tmp_path_factory, shared_tokenizer):
    return tiny_gemma4.build_reference(tmp_path_factory.mktemp("gemma4_ref"), shared_tokenizer)


@pytest.fixture(scope="module")
def reference():
    return np.load(tiny_gemma4.REFERENCE_FILE)


def _drafter(target, assistant_dir: Path):
    assistant, _ = load_assistant(Path(assistant_dir), "assistant")
    return AssistantDrafter(assistant, target)


def _prefilled(target, drafter, tokens):
    """Target state holding tokens[:-1], the drafter bound to it and fed its hidden rows."""
    state = ModelState(target, keep_hidden=True)
    drafter.bind_target(state)
    drafter.start(tokens)
    drafter.prefill(tokens, len(tokens) - 1, state.prefill(tokens[:-1]))
    return state


def test_target_matches_transformers(reference_pair, reference):
    target = load_model(str(reference_pair["target"])).model
    logits = target(mx.array(reference["prompt"].tolist())[None])[0]
    np.testing.assert_allclose(np.array(logits), reference["target_logits"], atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("head", ["dense", "sparse"])
def test_assistant_block_matches_transformers(reference_pair, reference, head):
    target = load_model(str(reference_pair["target"])).model
    drafter = _drafter(target, reference_pair[head])
    assert (drafter.assistant.masked_embedding is not None) == (head == "sparse")
    prompt = reference["prompt"].tolist()
    assert len(prompt) > 2 * drafter.assistant.sliding_window  # the window cuts the shared K/V
    _prefilled(target, drafter, prompt)
    expected = reference[f"{head}_tokens"].tolist()
    draft = drafter.propose(prompt, len(expected), GREEDY)
    assert draft.tokens.tolist() == expected
    # teacher-forced on the reference block: every step's logits
    step = drafter.stepper(len(prompt) - 1)
    rows = [step(i, mx.array([t], mx.uint32)) for i, t in enumerate([prompt[-1]] + expected[:-1])]
    ours = np.array(mx.concatenate(rows))
    np.testing.assert_allclose(ours, reference[f"{head}_logits"], atol=2e-4, rtol=1e-4)


# -- the engine on a Gemma-4 target -----------------------------------------------------------

@pytest.fixture(scope="module")
def gemma4(tmp_path_factory):
    """A 16-token Gemma-4 target (tiny random targets' greedy output changes often enough),
    a smaller Gemma-4 draft model, and copying assistants (dense and sparse head) that get
    partial accepts."""
    folder = tmp_path_factory.mktemp("gemma4")
    target_dir = tiny_gemma4.write_target(folder / "target", vocab_size=16, seed=21)
    draft_dir = tiny_gemma4.write_target(folder / "draft", vocab_size=16, seed=22, hidden_size=32,
                                         num_attention_heads=2, hidden_size_per_layer_input=0)
    sparse = {"sparse": True, "num_centroids": 4, "centroid_intermediate_top_k": 2}
    wrapped = tiny_gemma4.write_target(folder / "wrapped", vocab_size=16, seed=21, multimodal=True)
    return {
        "target": load_model(str(target_dir)).model,
        "wrapped": load_model(str(wrapped)).model,
        "draft": load_model(str(draft_dir)).model,
        "dense": load_assistant(
            tiny_gemma4.write_assistant(folder / "dense", target_dir, seed=23, copying=True), "a")[0],
        "sparse": load_assistant(
            tiny_gemma4.write_assistant(folder / "sparse", target_dir, seed=24, copying=True, **sparse), "a")[0],
    }


PROMPT = [5, 3, 6, 5, 3, 6, 5, 3, 4, 7, 5, 3]
WINDOW = 8  # the tiny targets' sliding window


def _tokens(dec, prompt, n, **kw):
    out, stats = [], None
    for toks, stats in dec.generate(prompt, max_tokens=n, **kw):
        out.extend(toks)
    return out, stats


@pytest.mark.parametrize("drafter", ["pld", "draft", "dense", "sparse", "wrapped"])
def test_greedy_output_is_plain_decoding(gemma4, drafter):
    """"wrapped": the same target in the multimodal gemma4 layout, drafted by the assistant."""
    target = gemma4["wrapped" if drafter == "wrapped" else "target"]
    drafter = "dense" if drafter == "wrapped" else drafter
    plain, _ = _tokens(SpeculativeDecoder(target, drafter="none"), PROMPT, 40)
    assert len(set(plain)) > 4  # not one token repeated
    if target is gemma4["wrapped"]:  # the same weights, laid out as the published checkpoints
        assert plain == _tokens(SpeculativeDecoder(gemma4["target"], drafter="none"), PROMPT, 40)[0]
    kw = {"drafter": "pld"} if drafter == "pld" else {
        "drafter": "draft" if drafter == "draft" else "assistant", "draft_model": gemma4[drafter]}
    for depth in (1, 3, 6):
        out, stats = _tokens(SpeculativeDecoder(target, depth=depth, gates=False, **kw), PROMPT, 40)
        assert out == plain, (drafter, depth)
        assert stats.drafter == kw["drafter"]
        assert 0 < stats.accepted < stats.drafted  # partial accepts: rollbacks were exercised
    assert len(PROMPT) + 40 > 3 * WINDOW  # the sliding-window rings wrapped


def test_auto_picks_the_assistant(gemma4):
    assert resolve_drafter("auto", gemma4["dense"], None) == "assistant"
    assert resolve_drafter("auto", gemma4["draft"], None) == "draft"
    dec = SpeculativeDecoder(gemma4["target"], draft_model=gemma4["dense"])
    assert dec.drafter.name == "assistant"
    with pytest.raises(UsageError, match="--drafter assistant"):
        SpeculativeDecoder(gemma4["target"], draft_model=gemma4["dense"], drafter="draft")
    with pytest.raises(UsageError, match="Gemma-4 assistant"):
        SpeculativeDecoder(gemma4["target"], draft_model=gemma4["draft"], drafter="assistant")


def test_assistant_refuses_another_target(gemma4, tiny_qwen3):
    other = load_model(str(tiny_qwen3)).model
    with pytest.raises(DrafterError, match="Gemma-4"):
        AssistantDrafter(gemma4["dense"], other)
    with pytest.raises(DrafterError, match="hidden size"):
        AssistantDrafter(gemma4["dense"], gemma4["draft"])


def test_partial_accept_reads_the_trimmed_cache(gemma4):
    """Verify 4 drafts, keep one, draft again: the drafter must see what a target that was
    only ever fed the kept tokens holds, not the rejected drafts' K/V left in the buffers."""
    target = gemma4["target"]
    tokens = list(PROMPT)
    drafter = AssistantDrafter(gemma4["dense"], target)
    state = _prefilled(target, drafter, tokens)
    start = state.length
    drafts = [7, 8, 9, 10]  # whatever the assistant says, the target holds these after verify
    state.forward(mx.array(tokens[-1:] + drafts, mx.uint32))
    kept = 1
    drafter.add_hidden(state.hidden[: kept + 1])
    state.rollback_to(start + 1 + kept)
    state.commit()
    tokens += drafts[:kept] + [11]
    after = drafter.stepper(len(tokens) - 1)(0, mx.array([tokens[-1]], mx.uint32))

    fresh_drafter = AssistantDrafter(gemma4["dense"], target)
    _prefilled(target, fresh_drafter, tokens)
    fresh = fresh_drafter.stepper(len(tokens) - 1)(0, mx.array([tokens[-1]], mx.uint32))
    np.testing.assert_allclose(np.array(after), np.array(fresh), atol=1e-4)
    # and the rejected drafts' K/V would have changed it: the check can tell
    stale = ModelState(target, keep_hidden=True)
    stale.prefill(tokens[:-1] + drafts[kept + 1:])
    stale_drafter = AssistantDrafter(gemma4["dense"], target)
    stale_drafter.bind_target(stale)
    stale_drafter.last_row, stale_drafter.fed = fresh_drafter.last_row, stale.length
    wrong = stale_drafter.stepper(len(tokens) - 1)(0, mx.array([tokens[-1]], mx.uint32))
    assert np.abs(np.array(wrong) - np.array(fresh)).max() > 1e-2


def test_trees_asked_of_a_gemma_target_fall_back_to_exact_chains(gemma4):
    """Gemma's attention is outside the tree forward's list: the assistant's tree request
    verifies chains, says why, and writes what plain decoding writes."""
    plain, _ = _tokens(SpeculativeDecoder(gemma4["target"], drafter="none"), PROMPT, 30)
    dec = SpeculativeDecoder(gemma4["target"], drafter="assistant", draft_model=gemma4["dense"], depth=3,
                             gates=False, tree=8)
    out, stats = _tokens(dec, PROMPT, 30)
    assert out == plain and stats.tree_steps == 0 and stats.accepted > 0
    assert stats.tree_note.startswith("this target cannot verify trees")
