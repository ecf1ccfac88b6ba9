"""Constrained output and logprobs in the engine: every row of a verify is masked to the
language, drafts are cut where they leave it, and the result is exactly plain constrained
decoding (token for token at temperature 0, in distribution above); logprobs read from the
verify rows equal plain decoding's."""

import json
from collections import Counter

import jsonschema
import mlx.core as mx
import numpy as np
import pytest

from mlxspec.api import GenerationRequest, load
from mlxspec.engine.drafters.base import Draft, Drafter
from mlxspec.engine.sampling import SamplingParams
from mlxspec.engine.speculate import SpeculativeDecoder
from mlxspec.errors import UsageError
from mlxspec.options import ConstraintSpec
from stats_helpers import chi_square_p

PROMPT = "the quick brown fox jumps over the lazy dog, the quick brown fox jumps over the lazy dog"
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 6}, "age": {"type": "integer", "minimum": 0,
                                                                        "maximum": 99}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
# a prompt with the JSON in it: prompt lookup drafts the keys the schema forces
JSON_PROMPT = 'Reply as {"name": "Bob", "age": 42}. The quick brown fox. {"name": "'


@pytest.fixture(scope="module")
def spec(tiny_qwen3, tiny_qwen3_draft):
    return load(str(tiny_qwen3), draft_model=str(tiny_qwen3_draft))


DRAFTERS = [{"drafter": "pld", "depth": 3}, {"drafter": "draft", "depth": 3}]


def test_logprobs_match_plain_decoding(spec):
    plain = spec.generate(PROMPT, max_tokens=24, drafter="none", logprobs=5)
    assert len(plain.logprobs) == len(plain.tokens) == 24
    for kw in DRAFTERS:
        r = spec.generate(PROMPT, max_tokens=24, gates=False, logprobs=5, **kw)
        assert r.tokens == plain.tokens
        assert r.stats.drafted > 0
        for a, b in zip(r.logprobs, plain.logprobs):
            assert a.token == b.token
            assert abs(a.logprob - b.logprob) < 1e-4
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
            assert np.allclose([v for _, v in a.top], [v for _, v in b.top], atol=1e-4)


def test_logprobs_are_the_models_and_sorted(spec):
    r = spec.generate(PROMPT, max_tokens=4, drafter="none", logprobs=3)
    ids = spec.encode(PROMPT)
    logits = spec.target.model(mx.array(ids)[None])[0, -1].astype(mx.float32)
    lp = np.array(logits - mx.logsumexp(logits))
    first = r.logprobs[0]
    assert first.token == int(np.argmax(lp)) and abs(first.logprob - lp.max()) < 1e-4
    assert [t for t, _ in first.top] == list(np.argsort(-lp)[:3])
    assert spec.generate(PROMPT, max_tokens=4, drafter="none").logprobs is None
    assert all(not p.top for p in spec.generate(PROMPT, max_tokens=4, drafter="none", logprobs=0).logprobs)


def _generate_json(spec, temperature, seed, **kw):
    return spec.generate(JSON_PROMPT, max_tokens=48, temperature=temperature, seed=seed, gates=False,
                         constraint=ConstraintSpec("json_schema", SCHEMA), **kw)


@pytest.mark.parametrize("kw", [{"drafter": "none"}] + DRAFTERS)
def test_json_schema_output_validates(spec, kw):
    free = spec.generate(PROMPT, max_tokens=24, drafter="none")
    with pytest.raises(json.JSONDecodeError):  # this model does not write JSON by itself
        json.loads(free.text)
    for temperature in (0.0, 0.8):
        for seed in range(3):
            r = _generate_json(spec, temperature, seed, **kw)
            jsonschema.validate(json.loads(r.text), SCHEMA)
            assert r.finish_reason == "stop"


def test_constrained_speculation_is_plain_constrained_decoding_at_temperature_zero(spec):
    plain = _generate_json(spec, 0.0, 0, drafter="none", logprobs=2)
    for kw in DRAFTERS:
        r = _generate_json(spec, 0.0, 0, logprobs=2, **kw)
        assert r.tokens == plain.tokens and r.text == plain.text
        assert np.allclose([p.logprob for p in r.logprobs], [p.logprob for p in plain.logprobs], atol=1e-4)
    pld = _generate_json(spec, 0.0, 0, drafter="pld", depth=3)
    assert pld.stats.drafted > 0 and pld.stats.accepted > 0  # drafts survive inside the language


def test_regex_and_grammar_constraints(spec):
    r = spec.generate(PROMPT, max_tokens=40, drafter="pld",
                      constraint=ConstraintSpec("regex", r"(fox|dog)( (fox|dog)){3}"))
    assert r.finish_reason == "stop"
    words = r.text.split(" ")
    assert len(words) == 4 and set(words) <= {"fox", "dog"}
    grammar = 'start: "yes" | "no" | "maybe"'
    r = spec.generate(PROMPT, max_tokens=10, temperature=1.0, seed=3, drafter="pld",
                      constraint=ConstraintSpec("grammar", grammar))
    assert r.text in ("yes", "no", "maybe")
    # any JSON object: this random model writes long keys, so some answers run out of tokens
    done = 0
    for seed in range(6):
        r = spec.generate(PROMPT, max_tokens=80, temperature=1.0, seed=seed, drafter="pld",
                          constraint=ConstraintSpec("json"))
        assert r.text.startswith('{"')
        if r.finish_reason == "stop":
            assert isinstance(json.loads(r.text), dict)
            done += 1
    assert done >= 1


@pytest.mark.parametrize("spec_arg, message", [
    (ConstraintSpec("regex", "[0-9"), "invalid regex"),
    (ConstraintSpec("json_schema", {"type": "nonsense"}), "invalid JSON schema"),
    (ConstraintSpec("grammar", "start: undefined_rule"), "invalid grammar"),
])
def test_bad_constraints_are_one_line_usage_errors(spec, spec_arg, message):
    with pytest.raises(UsageError, match=message) as err:
        spec.generate(PROMPT, max_tokens=4, constraint=spec_arg)
    assert "\n" not in str(err.value)


def test_request_checks_logprobs_and_constraint():
    with pytest.raises(UsageError, match="logprobs must be between 0 and 20"):
        GenerationRequest(logprobs=21)
    with pytest.raises(UsageError, match="regex constraint takes"):
        ConstraintSpec("regex", 5)
    with pytest.raises(UsageError, match="unknown constraint"):
        ConstraintSpec("xml")


# -- exact in distribution: a stochastic drafter whose drafts a constraint cuts -----------

# tiny_vocab8: 0-2 specials (2 = <|im_end|>, the end of text), 3..7 = "a".."e"
REGEX = "[a-c][b-e]"
ALLOWED = ({3, 4, 5}, {4, 5, 6, 7})
PARAMS = SamplingParams(temperature=1.0)
VOCAB8_PROMPT = [2, 3, 2, 3, 2, 3, 2]


class UniformDrafter(Drafter):
    """Draws k tokens uniformly from the whole vocabulary (q known): most leave the language."""

    name = "uniform"

    def propose(self, tokens, k, sampling):
        draft = mx.random.randint(0, 8, (k,)).astype(mx.uint32)
        return Draft(draft, mx.full((k, 8), -float(np.log(8))))


def _exact_constrained(model, prompt):
    """P(two tokens) under plain constrained sampling at temperature 1, enumerated."""
    probs = {}

    def row(seq, allowed):
        logits = np.array(model(mx.array(prompt + seq)[None])[0, -1].astype(mx.float32), dtype=np.float64)
        p = np.where([i in allowed for i in range(8)], np.exp(logits - logits.max()), 0.0)
        return p / p.sum()

    p0 = row([], ALLOWED[0])
    for a in ALLOWED[0]:
        p1 = row([a], ALLOWED[1])
        for b in ALLOWED[1]:
            probs[(a, b)] = p0[a] * p1[b]
    return probs


@pytest.mark.slow
def test_constrained_speculative_sampling_is_exact_in_distribution(tiny_vocab8):
    spec = load(str(tiny_vocab8))
    probs = _exact_constrained(spec.target.model, VOCAB8_PROMPT)
    assert sum(p > 0.03 for p in probs.values()) >= 6  # broad, not one-hot
    n = 1200
    for drafter in (UniformDrafter(), "pld"):
        dec = SpeculativeDecoder(spec.target.model, drafter=drafter, depth=2, gates=False)
        counts, drafted, accepted = Counter(), 0, 0
        for i in range(n):
            out = []
            for toks, stats in dec.generate(VOCAB8_PROMPT, sampling=PARAMS, max_tokens=2, seed=i,
                                            constraint=spec.constraint(ConstraintSpec("regex", REGEX))):
                out.extend(toks)
            counts[tuple(out)] += 1
            drafted, accepted = drafted + stats.drafted, accepted + stats.accepted
        assert drafted >= n and accepted > 0
        assert chi_square_p(counts, probs, n) > 1e-3, drafter


@pytest.mark.slow
def test_the_distribution_test_catches_a_cut_drawn_from_p(tiny_vocab8, monkeypatch):
    """Drawing the token after a cut draft from p (not the residual of the cut token's q) is
    biased for a stochastic drafter: the test above can tell."""
    from mlxspec.engine import speculate as speculate_mod

    real = speculate_mod.accept
    monkeypatch.setattr(speculate_mod, "accept", lambda *args: real(*args[:4]))
    spec = load(str(tiny_vocab8))
    probs = _exact_constrained(spec.target.model, VOCAB8_PROMPT)
    n = 1200
    dec = SpeculativeDecoder(spec.target.model, drafter=UniformDrafter(), depth=2, gates=False)
    counts = Counter()
    for i in range(n):
        out = []
        for toks, _ in dec.generate(VOCAB8_PROMPT, sampling=PARAMS, max_tokens=2, seed=i,
                                    constraint=spec.constraint(ConstraintSpec("regex", REGEX))):
            out.extend(toks)
        counts[tuple(out)] += 1
    assert chi_square_p(counts, probs, n) < 1e-3


def test_mtp_head_drafts_inside_constraints_exactly(tiny_qwen3_5):
    spec = load(str(tiny_qwen3_5))
    kw = dict(max_tokens=40, logprobs=1, constraint=ConstraintSpec("json_schema", SCHEMA), gates=False)
    plain = spec.generate(JSON_PROMPT, drafter="none", **kw)
    mtp = spec.generate(JSON_PROMPT, drafter="mtp", depth=2, **kw)
    assert mtp.stats.drafter == "mtp" and mtp.stats.drafted > 0
    assert mtp.tokens == plain.tokens
    assert np.allclose([p.logprob for p in mtp.logprobs], [p.logprob for p in plain.logprobs], atol=1e-4)
    for seed in range(2):
        r = spec.generate(JSON_PROMPT, drafter="mtp", depth=2, temperature=0.8, seed=seed, **kw)
        if r.finish_reason == "stop":
            jsonschema.validate(json.loads(r.text), SCHEMA)


def test_model_drafters_draft_inside_the_language(tiny_qwen3):
    """A draft model that is the target itself, masked like it, proposes exactly the target's
    constrained tokens: every draft is accepted (unmasked, its JSON-less guesses would be cut)."""
    same = load(str(tiny_qwen3), draft_model=str(tiny_qwen3))
    kw = dict(max_tokens=40, constraint=ConstraintSpec("json_schema", SCHEMA), gates=False)
    plain = same.generate(JSON_PROMPT, drafter="none", **kw)
    r = same.generate(JSON_PROMPT, drafter="draft", depth=4, **kw)
    assert r.tokens == plain.tokens
    assert r.stats.drafted > 10 and r.stats.accepted == r.stats.drafted


def test_a_draft_through_the_end_of_text_leaves_the_matcher_as_it_was(spec):
    c = spec.constraint(ConstraintSpec("regex", "fox"))
    c.advance(spec.tokenizer.encode("fox", add_special_tokens=False))
    before = np.array(c.mask_after([]))
    eos = spec.tokenizer.eos_token_id
    assert before[0, eos] and before.sum() == 1  # only the end may follow
    cut, masks = c.masks([eos, 5, 6])
    assert cut == 1 and masks.shape[0] == 2  # nothing is verified past the end
    assert c.mask_after([eos]) is None
    assert (np.array(c.mask_after([])) == before).all()
    c.advance([eos])
    assert not c.matcher.is_error()
