"""Constrained output and logprobs in the engine: every row of a verify is masked to the
language, drafts are cut where they leave it, and the result is exactly plain constrained
decoding (token for token at temperature 0 here; in distribution above it, with chains cut after
1 and 2 tokens and drafted under the mask, in tests/test_distribution.py); logprobs read from
the verify rows equal plain decoding's."""

import json

import jsonschema
import mlx.core as mx
import numpy as np
import pytest

from mlxspec.api import GenerationRequest, load
from mlxspec.errors import UsageError
from mlxspec.options import ConstraintSpec

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
    for seed in range(16):  # about 1 in 8 ends within 40 tokens
        r = spec.generate(PROMPT, max_tokens=40, temperature=1.0, seed=seed, drafter="pld",
                          constraint=ConstraintSpec("json"))
        assert r.text.startswith("{")
        if r.finish_reason == "stop":
            assert isinstance(json.loads(r.text), dict)
            done += 1
    assert done >= 1


@pytest.mark.parametrize("spec_arg, message", [
    (ConstraintSpec("regex", "[0-9"), "invalid regex.*: unclosed character class$"),  # the reason, lines later
    (ConstraintSpec("regex", "(a"), "invalid regex.*: unclosed group$"),
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


def test_the_token_after_a_cut_comes_from_the_cut_tokens_residual():
    """A draft cut before the verify (its token outside the language) still counts as drafted:
    after the kept drafts are all accepted, the next token is drawn from the cut position's
    residual norm(max(p - q_cut, 0)), not from p. Here that residual is one-hot on token 1 while
    p gives tokens 0 and 1 half each: drawing from p (the bug) shows token 0 in about half of
    the 64 draws (missed with probability 2**-64)."""
    from mlxspec.engine.sampling import SamplingParams, accept

    params = SamplingParams(temperature=1.0).for_request(0)
    rows = mx.log(mx.array([[0.0, 0.0, 1.0, 0.0], [0.5, 0.5, 0.0, 0.0]]))  # p_1 certain of the draft
    draft, q = mx.array([2], mx.uint32), mx.log(mx.array([[0.0, 0.0, 1.0, 0.0]]))
    cut_q = mx.log(mx.array([[0.5, 0.0, 0.0, 0.5]]))  # the cut token's q: p - q > 0 only at token 1
    after = []
    for _ in range(64):
        n, out = accept(params, rows, draft, q, cut_q)
        assert n.item() == 1
        after.append(out[1].item())
    assert set(after) == {1}
