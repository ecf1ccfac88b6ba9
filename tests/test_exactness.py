"""Temperature 0: every drafter, every depth gives exactly mlx-lm's greedy tokens."""

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import ArraysCache

import tiny
from mlxspec.engine.cache import ModelState
from mlxspec.engine.drafters.pld import PromptLookupDrafter
from mlxspec.engine.speculate import SpeculativeDecoder

N_TOKENS = 48
PROMPTS = [
    "def add(a, b):\n    return a + b\n\ndef",
    "The quick brown fox jumps over the lazy dog.",
    # repeats itself, so prompt lookup proposes a draft at nearly every step
    "x = 1\ny = 2\nx = 1\ny = 2\nx = 1\ny = 2\nx = 1\ny =",
]


@pytest.fixture(scope="module")
def models(tiny_llama, tiny_qwen3, tiny_qwen3_5, tiny_swa):
    return {name: mlx_lm.load(str(path)) for name, path in [
        ("llama", tiny_llama), ("qwen3", tiny_qwen3), ("qwen3_5", tiny_qwen3_5), ("swa", tiny_swa)]}


@pytest.fixture(scope="module")
def near_copy_hybrid(tmp_path_factory, shared_tokenizer):
    """The hybrid target's weights, slightly rescaled: drafts that are often but not always right."""
    path = tiny.write_checkpoint(tmp_path_factory.mktemp("near_copy"), "qwen3_5",
                                 tokenizer=shared_tokenizer, seed=4, weight_scale=0.23)
    return mlx_lm.load(str(path))[0]


@pytest.fixture(scope="module")
def draft(tiny_qwen3_draft):
    return mlx_lm.load(str(tiny_qwen3_draft))[0]


def greedy_reference(model, prompt, n=N_TOKENS):
    out = []
    for (tok, _), _ in zip(generate_step(mx.array(prompt), model, max_tokens=n), range(n)):
        out.append(tok)
    return out


@pytest.fixture(scope="module")
def reference(models):
    """(arch, prompt text) -> mlx-lm's greedy N_TOKENS on models[arch]: deterministic, so decoded
    once for every test of the module that compares with it."""
    made = {}

    def get(arch, text):
        if (arch, text) not in made:
            model, tok = models[arch]
            made[arch, text] = greedy_reference(model, tok.encode(text))
        return made[arch, text]
    return get


def speculate(model, prompt, n=N_TOKENS, **kw):
    dec = SpeculativeDecoder(model, gates=False, **kw)
    out, stats = [], None
    for toks, stats in dec.generate(prompt, max_tokens=n):
        out.extend(toks)
    return out, stats


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3_5", "swa"])
def test_prompt_lookup_is_exact(models, reference, arch):
    model, tok = models[arch]
    fired = 0
    for text in PROMPTS:
        prompt = tok.encode(text)
        ref = reference(arch, text)
        for depth in range(1, 9):
            if depth in (1, 8):  # the default lookup seldom fires on these random models: its ends
                got, _ = speculate(model, prompt, drafter="pld", depth=depth)
                assert got == ref, f"{arch} depth {depth} prompt {text[:20]!r}"
            # matching single tokens makes lookup fire at nearly every step: every depth
            eager = PromptLookupDrafter(max_ngram=2, min_ngram=1)
            got, stats = speculate(model, prompt, drafter=eager, depth=depth)
            assert got == ref, f"{arch} depth {depth} (eager lookup) prompt {text[:20]!r}"
            fired += stats.verify_steps
    assert fired >= 20  # drafts were really proposed, accepted or rejected


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3_5", "swa"])
def test_draft_model_is_exact(models, reference, draft, arch):
    model, tok = models[arch]
    for text in PROMPTS[:2]:
        prompt = tok.encode(text)
        ref = reference(arch, text)
        for depth in (1, 2, 3, 5, 8):
            got, stats = speculate(model, prompt, drafter="draft", draft_model=draft, depth=depth)
            assert got == ref, f"{arch} depth {depth}"
            assert stats.drafted > 0


def test_hybrid_partial_acceptance_is_exact(models, reference, near_copy_hybrid):
    """Rejections in the middle of a draft restore the GatedDeltaNet state and re-feed."""
    model, tok = models["qwen3_5"]
    partial = 0
    for text in PROMPTS:
        prompt = tok.encode(text)
        ref = reference("qwen3_5", text)
        for depth in (2, 4, 8):
            got, stats = speculate(model, prompt, drafter="draft", draft_model=near_copy_hybrid, depth=depth)
            assert got == ref, f"depth {depth}"
            partial += sum(1 for a in stats.position_accepted if 0 < a)
    assert partial > 0


def test_none_drafter_is_plain_decoding(models, reference):
    model, tok = models["qwen3_5"]
    prompt = tok.encode(PROMPTS[0])
    got, stats = speculate(model, prompt, drafter="none")
    assert got == reference("qwen3_5", PROMPTS[0])
    assert stats.verify_steps == 0 and stats.plain_steps == N_TOKENS


def test_sliding_window_rollback_matches_sequential(models):
    """A wrapped RotatingKVCache rolled back after a multi-token write equals sequential decoding."""
    model, tok = models["swa"]
    prompt = tok.encode(PROMPTS[1])  # longer than the window of 8
    seq, spec = ModelState(model), ModelState(model)
    for st in (seq, spec):
        st.prefill(prompt)
    extra = [5, 6, 7, 8]
    spec.forward(mx.array(extra, mx.uint32))
    spec.rollback_to(len(prompt) + 1)
    seq.forward(mx.array(extra[:1], mx.uint32), rollback=False)
    probe = mx.array([9], mx.uint32)
    a = spec.forward(probe, rollback=False)
    b = seq.forward(probe, rollback=False)
    assert mx.argmax(a).item() == mx.argmax(b).item()
    assert mx.allclose(a, b, atol=1e-4).item()


def test_hybrid_rollback_restores_recurrent_state(models, monkeypatch):
    """A partial accept replays the taped GatedDeltaNet steps (no model re-forward) and leaves
    the conv and recurrent states bit for bit where a forward of the accepted tokens leaves them."""
    from mlxspec.models import gdn_tape

    model, tok = models["qwen3_5"]
    replays = []
    original = gdn_tape.TapedGatedDeltaNet.replay
    monkeypatch.setattr(gdn_tape.TapedGatedDeltaNet, "replay",
                        lambda self, *a: replays.append(a[-1]) or original(self, *a))
    prompt = tok.encode(PROMPTS[0])
    spec, seq, chunk = ModelState(model), ModelState(model), ModelState(model)
    for st in (spec, seq, chunk):
        st.prefill(prompt)
    forwards = []  # the verify, and any re-forward a rollback would make (compiled or not)
    spec_forward = spec.forward
    spec.forward = lambda *a, **k: forwards.append(1) or spec_forward(*a, **k)
    spec.forward(mx.array([11, 12, 13, 14], mx.uint32))
    spec.rollback_to(len(prompt) + 2)
    assert len(forwards) == 1 and replays == [2, 2]  # two linear layers replayed 2 steps each
    for t in (11, 12):
        seq.forward(mx.array([t], mx.uint32), rollback=False)
    chunk.forward(mx.array([11, 12], mx.uint32), rollback=False)
    assert spec.length == seq.length == chunk.length
    recurrent = [i for i, c in enumerate(spec.cache) if isinstance(c, ArraysCache)]
    assert recurrent
    for i in recurrent:
        for x, y, z in zip(spec.cache[i].cache, seq.cache[i].cache, chunk.cache[i].cache):
            assert mx.array_equal(x, z).item()  # same kernels: bit for bit
            assert mx.allclose(x, y, atol=1e-5).item()  # sequential decoding
    probe = mx.array([9], mx.uint32)
    spec.forward = spec_forward
    assert mx.allclose(spec.forward(probe, rollback=False), seq.forward(probe, rollback=False), atol=1e-4).item()

def test_sliding_window_draft_model_is_exact(models, reference):
    """A draft model whose window wraps during 1-token draft steps cannot rewind in place:
    it starts over from the committed tokens, and the output stays exact."""
    target, tok = models["llama"]
    swa_draft = models["swa"][0]
    prompt = tok.encode(PROMPTS[1])
    ref = reference("llama", PROMPTS[1])
    for depth in (2, 5):
        got, stats = speculate(target, prompt, drafter="draft", draft_model=swa_draft, depth=depth)
        assert got == ref
        assert stats.verify_steps > 5


def test_wrapped_ring_rolls_back_one_token_writes(models):
    """Draft models write their window one token at a time, overwriting in place: undoable."""
    model, tok = models["swa"]
    prompt = tok.encode(PROMPTS[1])  # longer than the window of 8: the ring is full
    seq, spec = ModelState(model), ModelState(model)
    for st in (seq, spec):
        st.prefill(prompt)
    for t in [5, 6, 7, 8, 9]:
        spec.forward(mx.array([t], mx.uint32))
    spec.rollback_to(len(prompt) + 2)
    spec.commit()
    seq.forward(mx.array([5, 6], mx.uint32), rollback=False)
    probe = mx.array([9], mx.uint32)
    a = spec.forward(probe, rollback=False)
    b = seq.forward(probe, rollback=False)
    assert spec.length == seq.length
    assert mx.allclose(a, b, atol=1e-4).item()


def test_qwen3_next_rollback_replays_the_tape(tiny_qwen3_next):
    from mlxspec.models.gdn_tape import TapedQwen3NextGatedDeltaNet

    model = tiny_qwen3_next
    prompt = list(range(20, 40))
    spec, chunk = ModelState(model), ModelState(model)
    assert isinstance(model.layers[0].linear_attn, TapedQwen3NextGatedDeltaNet)
    for st in (spec, chunk):
        st.prefill(prompt)
    spec.forward(mx.array([11, 12, 13, 14, 15], mx.uint32))
    spec.rollback_to(len(prompt) + 3)
    chunk.forward(mx.array([11, 12, 13], mx.uint32), rollback=False)
    for c1, c2 in zip(spec.cache, chunk.cache):
        if isinstance(c1, ArraysCache):
            for x, y in zip(c1.cache, c2.cache):
                assert mx.array_equal(x, y).item()
    probe = mx.array([9], mx.uint32)
    assert mx.allclose(spec.forward(probe, rollback=False), chunk.forward(probe, rollback=False), atol=1e-5).item()
