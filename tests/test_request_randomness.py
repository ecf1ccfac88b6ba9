"""Each request draws from its own random stream (sampling.RandomKeys): a seeded request
repeats, leaves MLX's global generator alone (so the unseeded requests after it do not
repeat), and two requests generated at once do not disturb each other."""

import mlx.core as mx
import mlx_lm
import pytest

from mlxspec.engine.sampling import SamplingParams
from mlxspec.engine.speculate import SpeculativeDecoder

PARAMS = SamplingParams(temperature=1.0)
PROMPT = [2, 3, 4, 5, 2, 3]
N = 24  # 8 ** 24 sequences at temperature 1: two unseeded runs agree by chance with p ~ 0


@pytest.fixture(scope="module")
def model(tiny_vocab8):
    return mlx_lm.load(str(tiny_vocab8))[0]


def decoders(model):
    """Plain decoding, and the model drafting for itself (sampled drafts, acceptance draws)."""
    return {"none": SpeculativeDecoder(model, drafter="none"),
            "draft": SpeculativeDecoder(model, drafter="draft", draft_model=model, gates=False, depth=3)}


def run(dec, seed=None):
    return [t for toks, _ in dec.generate(PROMPT, sampling=PARAMS, max_tokens=N, seed=seed) for t in toks]


@pytest.mark.parametrize("drafter", ["none", "draft"])
def test_seeded_repeats_and_unseeded_after_it_does_not(model, drafter):
    dec = decoders(model)[drafter]
    first = [run(dec, seed=11), run(dec)]
    second = [run(dec, seed=11), run(dec)]
    assert first[0] == second[0]  # the seeded request repeats
    assert first[1] != second[1]  # the unseeded one after it does not (a global reseed made it)


def test_a_seeded_request_leaves_the_global_generator_alone(model):
    dec = decoders(model)["draft"]
    mx.random.seed(123)
    expected = mx.random.uniform(shape=(4,)).tolist()
    mx.random.seed(123)
    run(dec, seed=5)
    assert mx.random.uniform(shape=(4,)).tolist() == expected


@pytest.mark.parametrize("drafter", ["none", "draft"])
def test_interleaved_requests_do_not_disturb_each_other(model, drafter):
    alone = {seed: run(decoders(model)[drafter], seed=seed) for seed in (1, 2)}
    streams = {seed: decoders(model)[drafter].generate(PROMPT, sampling=PARAMS, max_tokens=N, seed=seed)
               for seed in (1, 2)}
    together = {1: [], 2: []}
    live = set(streams)
    while live:  # one step of each in turn, as a server batching them would
        for seed in sorted(live):
            try:
                together[seed].extend(next(streams[seed])[0])
            except StopIteration:
                live.discard(seed)
    assert together == alone


@pytest.mark.parametrize("seed", [-1, 2**63])
def test_a_seed_mx_random_key_cannot_take_is_a_usage_error(seed):
    """The Python API's request refuses it by name where mx.random.key raised a TypeError."""
    from mlxspec.errors import UsageError
    from mlxspec.request import GenerationRequest

    with pytest.raises(UsageError, match="seed must be between 0 and"):
        GenerationRequest(seed=seed, temperature=0.7)
