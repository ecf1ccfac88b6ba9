"""Queued verifies (pipelining): a verify guessed before the one before it is read changes no
token, whether the guess holds (used as queued) or not (undone), on every cache kind."""

import mlx_lm
import pytest

from mlxspec.bench.script import ScriptedLogits, SteeredLookup, make_script
from mlxspec.bench.synthetic import random_model
from mlxspec.engine.drafters.pld import PromptLookupDrafter
from mlxspec.engine.gates import AheadGate
from mlxspec.engine.sampling import SamplingParams
from mlxspec.engine.speculate import SpeculativeDecoder
from test_exactness import PROMPTS, greedy_reference


def _generate(model, prompt, drafter, n, temperature=0.0, seed=None, depth=4):
    dec = SpeculativeDecoder(model, drafter=drafter, depth=depth, gates=False)
    out, stats = [], None
    for new, stats in dec.generate(prompt, sampling=SamplingParams(temperature), max_tokens=n, seed=seed):
        out.extend(new)
    return out, stats


@pytest.fixture
def always_queue(monkeypatch):
    """Queue every guess, so the queued path runs (and mostly misses) on real tiny models."""
    monkeypatch.setattr(AheadGate, "ON_AT", 0.0)


@pytest.mark.parametrize("arch", ["llama", "qwen3_5", "swa"])
def test_queued_verifies_keep_greedy_tokens(always_queue, tiny_llama, tiny_qwen3_5, tiny_swa, arch):
    path = {"llama": tiny_llama, "qwen3_5": tiny_qwen3_5, "swa": tiny_swa}[arch]
    model, tok = mlx_lm.load(str(path))
    queued = 0
    for text in PROMPTS:
        prompt = tok.encode(text)
        ref = greedy_reference(model, prompt)
        for depth in (1, 3):
            got, stats = _generate(model, prompt, PromptLookupDrafter(max_ngram=2, min_ngram=1), len(ref),
                                   depth=depth)
            assert got == ref, f"{arch} depth {depth} {text[:20]!r}"
            queued += stats.queued_used + stats.queued_dropped
    assert queued > 0


@pytest.mark.parametrize("shape", ["smoke", "smoke-hybrid"])
def test_scripted_echo_uses_queued_verifies_and_stays_exact(shape):
    """On an echo script the guesses mostly hold: queued verifies are used, and the ones
    undone after an edit leave the output equal to the script."""
    model = random_model(shape, bits=0)
    script = make_script("echo", 1024, 96, 96)
    ScriptedLogits(model, script.target)
    out, stats = _generate(model, script.prompt, PromptLookupDrafter(), 96)
    assert out == script.continuation[:96]
    assert stats.queued_used > 5
    assert stats.queued_dropped > 0


def test_queued_verifies_change_no_sampled_token(monkeypatch):
    """Temperature > 0, seeded: with and without queueing the same tokens (same draws)."""
    model = random_model("smoke", bits=0)
    script = make_script("scripted-a0.8", 1024, 64, 64)
    ScriptedLogits(model, script.target)
    runs = []
    for on_at in (0.0, 2.0):  # always queue / never queue
        monkeypatch.setattr(AheadGate, "ON_AT", on_at)
        runs.append(_generate(model, script.prompt, SteeredLookup(script), 64, temperature=0.7, seed=3))
    (queued, s1), (plain, s2) = runs
    assert queued == plain
    assert s1.queued_used + s1.queued_dropped > 0 and s2.queued_used + s2.queued_dropped == 0


def test_ahead_gate_follows_the_hit_rate():
    gate = AheadGate()
    assert not gate.on
    for _ in range(8):
        gate.observe(True)
    assert gate.on
    for _ in range(3):
        gate.observe(False)
    assert not gate.on
