"""An MTP head's commits and chain steps replayed from compiled graphs (``engine/compiled_head.py``,
``MLXSPEC_COMPILED_HEAD=1``) draft what the op-by-op head drafts, bit for bit in fp32 on the CPU:
two drafters side by side over the same random run (commits of 1..6 pairs, chains of depth
1..5, rollbacks, buffers growing past their step), at temperature 0 and 0.8 (each drafter with
its own random stream from the same seed), for the Qwen block (dense and MoE), GLM's NextN
layer and DeepSeek's (MLA attention). A graph that writes one position early is caught, and the
loop drafts through the graphs and stays exact."""

import random

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.generate import generate_step

import tiny
import tiny_mtp
from mlxspec.engine import compiled_head
from mlxspec.engine.compiled_head import CompiledHead
from mlxspec.engine.drafters.mtp import MTPDrafter
from mlxspec.engine.sampling import SamplingParams
from mlxspec.engine.speculate import SpeculativeDecoder
from mlxspec.models.mtp import load_mtp_head


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_5_moe", "glm4_moe", "deepseek_v3"])
def model_and_head(request, tmp_path_factory):
    """A random tiny model of each MTP family and its head, loaded as a user loads them."""
    out = tmp_path_factory.mktemp(request.param)
    if request.param.startswith("qwen3_5"):
        path = tiny.write_checkpoint(out, request.param, vocab_size=38, seed=4)
    elif request.param == "glm4_moe":
        path = tiny_mtp.write_nextn_checkpoint(out, "glm4_moe", vocab_size=32, seed=1)
    else:
        path = tiny_mtp.write_nextn_checkpoint(out, "deepseek_v3", vocab_size=32, seed=2, hidden_size=32,
                                               intermediate_size=64, moe_intermediate_size=16, q_lora_rank=16)
        tiny_mtp.nextn_to_sidecar(path)  # mlx-lm's deepseek_v3 loads only its trunk's layers
    model, _, config = mlx_lm.load(str(path), return_config=True)
    return model, load_mtp_head(model, path, config)


@pytest.fixture
def compiled_calls(monkeypatch) -> list[int]:
    """The head switched to compiled graphs; the pairs each compiled forward took, in order."""
    monkeypatch.setattr(compiled_head, "enabled", True)
    calls, real = [], CompiledHead.__call__

    def counted(self, tokens, hidden, cache, step=0):
        calls.append(tokens.shape[0])
        return real(self, tokens, hidden, cache, step)

    monkeypatch.setattr(CompiledHead, "__call__", counted)
    return calls


def _side_by_side(head, seed: int, temperature: float, steps: int = 30) -> None:
    """Two drafters of HEAD (compiled, op by op) through one random run: every draft's tokens
    and q rows equal."""
    rng = random.Random(seed)
    like = head.embed(mx.array([1], mx.uint32))  # (1, H) in the trunk's dtype

    def rows(n):  # stand-ins for the target's final-norm hidden rows
        return mx.random.normal((n, like.shape[-1]), key=mx.random.key(rng.randrange(1 << 30))).astype(like.dtype)

    prompt = [rng.randrange(1, 30) for _ in range(rng.randrange(12, 30))]
    drafters, samplings = [], []
    step_was = compiled_head.ROW_STEP
    compiled_head.ROW_STEP = 16  # the head's buffers grow within the run
    try:
        start = rows(len(prompt) - 1)
        for _ in range(2):
            d = MTPDrafter(head)
            d.start(prompt)
            d.prefill(prompt, len(prompt) - 1, start)
            drafters.append(d)
            samplings.append(SamplingParams(temperature=temperature).for_request(seed))
    finally:
        compiled_head.ROW_STEP = step_was
    first = drafters[0].cache[0].keys.shape[2]
    tokens = list(prompt)
    for step in range(steps):
        k = rng.randint(1, 5)
        drafts = []
        for d, s, compiled in zip(drafters, samplings, (True, False)):
            compiled_head.enabled = compiled
            try:
                drafts.append(d.propose(tokens, k, s))
            finally:
                compiled_head.enabled = True
        a, b = drafts
        assert a.host_tokens() == b.host_tokens(), (seed, step)
        assert a.logprobs is None or mx.array_equal(a.logprobs, b.logprobs).item(), (seed, step)
        kept = rng.randint(0, k)  # the verify kept KEPT drafts, then sampled one token
        new = a.host_tokens()[:kept] + [rng.randrange(1, 30)]
        more = rows(kept + 1)  # the target's hidden rows of the positions it committed
        for d in drafters:
            d.rollback(len(tokens) + kept)
            d.add_hidden(more)
        tokens += new
    grown = drafters[0].cache[0].keys.shape[2]
    assert grown >= first + 32, (first, grown)  # graphs of several capacities


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_compiled_head_drafts_what_the_op_by_op_head_drafts(model_and_head, temperature, compiled_calls):
    _, head = model_and_head
    _side_by_side(head, seed=3, temperature=temperature)
    assert len(compiled_calls) > 40 and max(compiled_calls) > 1  # chain steps and multi-pair commits


def test_a_planted_write_one_position_early_is_caught(model_and_head, compiled_calls, monkeypatch):
    """(Early, not late: a late write can land past the buffer's end, which MLX does not check.)"""
    _, head = model_and_head
    real = compiled_head.write_positions
    monkeypatch.setattr(compiled_head, "write_positions", lambda offset, n: real(offset - 1, n))
    CompiledHead.of(head).graphs.clear()
    try:
        with pytest.raises(AssertionError):
            _side_by_side(head, seed=3, temperature=0.0, steps=12)
    finally:
        CompiledHead.of(head).graphs.clear()


def test_the_loop_drafts_through_the_graphs_and_stays_exact(model_and_head, compiled_calls):
    model, head = model_and_head
    prompt = list(range(3, 30))
    ref = [t for (t, _), _ in zip(generate_step(mx.array(prompt), model, max_tokens=30), range(30))]
    dec = SpeculativeDecoder(model, mtp_head=head, drafter="mtp", depth=3, gates=False)
    out, stats = [], None
    for new, stats in dec.generate(prompt, max_tokens=30):
        out.extend(new)
    assert out == ref
    assert stats.drafted > 0 and len(compiled_calls) >= stats.verify_steps


def test_the_head_is_compiled_only_when_switched_on(model_and_head, monkeypatch):
    _, head = model_and_head
    cache = head.make_cache()
    assert not CompiledHead.wanted(cache)  # the default: MLXSPEC_COMPILED_HEAD unset
    monkeypatch.setattr(compiled_head, "enabled", True)
    assert CompiledHead.wanted(cache)
    assert not CompiledHead.applies(cache, 0, 1)  # no keys yet: a head's prompt goes op by op
