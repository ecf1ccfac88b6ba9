"""Native MTP drafting: the head loads from real layouts, drafts, and the output stays exact."""

import shutil

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.generate import generate_step

import mlxspec
import tiny
import tiny_mtp
from mlxspec.engine.sampling import SamplingParams
from mlxspec.engine.speculate import SpeculativeDecoder
from mlxspec.errors import DrafterError
from mlxspec.models.mtp import load_mtp_head

PROMPT = "def add(a, b):\n    return a + b\n\ndef"
N = 40


def _load_with_head(path):
    model, tok, config = mlx_lm.load(str(path), return_config=True)
    return model, tok, load_mtp_head(model, path, config)


@pytest.fixture(scope="module")
def dense(tiny_qwen3_5):
    return _load_with_head(tiny_qwen3_5)


@pytest.fixture(scope="module")
def moe(tmp_path_factory, shared_tokenizer):
    path = tiny.write_checkpoint(tmp_path_factory.mktemp("q35moe"), "qwen3_5_moe",
                                 tokenizer=shared_tokenizer, seed=7)
    return _load_with_head(path)


def greedy(model, prompt, n=N):
    return [t for (t, _), _ in zip(generate_step(mx.array(prompt), model, max_tokens=n), range(n))]


@pytest.mark.parametrize("which", ["dense", "moe"])
def test_mtp_drafting_is_exact(request, which):
    model, tok, head = request.getfixturevalue(which)
    assert head is not None
    prompt = tok.encode(PROMPT)
    ref = greedy(model, prompt)
    for depth in (1, 2, 3, 4):
        dec = SpeculativeDecoder(model, mtp_head=head, drafter="mtp", depth=depth, gates=False)
        out, stats = [], None
        for toks, stats in dec.generate(prompt, max_tokens=N):
            out.extend(toks)
        assert out == ref, f"{which} depth {depth}"
        assert stats.drafter == "mtp" and stats.drafted >= depth * 10


def test_head_is_the_same_in_every_layout(tiny_qwen3_5, dense, tmp_path):
    """Raw zero-centred norms (+1 on load) and an MLX-converted sidecar give the same head."""
    model, tok, head = dense
    converted = tmp_path / "converted"
    shutil.copytree(tiny_qwen3_5, converted)
    tiny_mtp.convert_trunk_mlx(converted, "mtp.safetensors", shift_head_norms=True)
    sharded = tmp_path / "sharded"
    shutil.copytree(tiny_qwen3_5, sharded)
    tiny_mtp.relayout_mtp(sharded, "sharded", prefix="model.language_model.mtp.")
    hidden = mx.random.normal((5, model.args.text_config["hidden_size"]), key=mx.random.key(0))
    tokens = mx.array([3, 4, 5, 6, 7], mx.uint32)
    want, _ = head.step(tokens, hidden, head.make_cache())
    for path in (converted, sharded):
        m2, _, cfg = mlx_lm.load(str(path), return_config=True)
        other = load_mtp_head(model, path, cfg)
        got, _ = other.step(tokens, hidden, other.make_cache())
        assert mx.allclose(got, want, atol=1e-5).item(), path.name
    # the zero-centred fix matters: norms left at their raw values change the head's output
    raw = {k: v for k, v in mx.load(str(tiny_qwen3_5 / "model.safetensors")).items() if k.startswith("mtp.")}
    head.module.load_weights([(k[4:], v) for k, v in raw.items() if k.endswith("norm.weight")], strict=False)
    try:
        wrong, _ = head.step(tokens, hidden, head.make_cache())
        assert not mx.allclose(wrong, want, atol=1e-2).item()
    finally:
        head.module.load_weights([(k[4:], v + 1.0) for k, v in raw.items() if k.endswith("norm.weight")],
                                 strict=False)


def test_quantized_head_drafts_exactly(tiny_qwen3_5, tmp_path):
    path = tmp_path / "q4"
    shutil.copytree(tiny_qwen3_5, path)
    tiny_mtp.quantize_mtp(path, bits=4, group_size=32)
    model, tok, head = _load_with_head(path)
    assert head is not None
    prompt = tok.encode(PROMPT)
    dec = SpeculativeDecoder(model, mtp_head=head, drafter="mtp", depth=2, gates=False)
    assert [t for toks, _ in dec.generate(prompt, max_tokens=N) for t in toks] == greedy(model, prompt)


def test_mtp_drafter_choice(tiny_qwen3_5, tiny_qwen3):
    with_head = mlxspec.load(str(tiny_qwen3_5))
    assert with_head.generate("hi", max_tokens=4).stats.drafter == "mtp"  # auto prefers the head
    without = mlxspec.load(str(tiny_qwen3))
    assert without.generate("hi", max_tokens=4).stats.drafter == "pld"  # auto falls back
    with pytest.raises(DrafterError, match="no MTP head"):
        without.generate("hi", max_tokens=4, drafter="mtp")


def test_qwen3_next_head_drafts_exactly(tiny_qwen3_next):
    """Qwen3-Next (MoE trunk, its own GatedDeltaNet class)."""
    from mlx.utils import tree_flatten

    from mlxspec.models.mtp.head import MTPHead, QwenMTPHead
    from mlxspec.models.trunk import split_trunk

    model = tiny_qwen3_next
    module = QwenMTPHead(model.args, 1)
    mx.eval(module.parameters())
    head = MTPHead(module, split_trunk(model), sum(v.nbytes for _, v in tree_flatten(module.parameters())), "test")
    prompt = list(range(10, 30))
    ref = greedy(model, prompt)
    for depth in (1, 2, 3):
        dec = SpeculativeDecoder(model, mtp_head=head, drafter="mtp", depth=depth, gates=False)
        out = [t for toks, _ in dec.generate(prompt, max_tokens=N) for t in toks]
        assert out == ref, f"depth {depth}"


def test_pending_pairs_are_fed_in_few_shapes(dense, monkeypatch):
    """After a long plain stretch the head catches up on any number of pairs: fed as pieces
    of at most 16 or a power of two (MLX's CUDA backend builds kernels per shape), with the
    same drafts as one forward over them all."""
    from mlxspec.engine.cache import ModelState
    from mlxspec.engine.drafters import mtp as mtp_drafter

    model, tok, head = dense
    prompt = tok.encode(PROMPT * 3)
    tokens = prompt + greedy(model, prompt, 45)  # 44 pairs pending after the prompt's

    def drafts(one_piece):
        monkeypatch.setattr(mtp_drafter, "ONE_PIECE", one_piece)
        sizes = []
        forward = head.forward
        monkeypatch.setattr(head, "forward", lambda t, *a, **kw: sizes.append(t.shape[0]) or forward(t, *a, **kw))
        state = ModelState(model, keep_hidden=True)
        drafter = mtp_drafter.MTPDrafter(head)
        drafter.start(prompt)
        drafter.prefill(prompt, len(prompt) - 1, state.prefill(prompt[:-1]))
        for t in tokens[len(prompt) - 1 : -1]:  # plain steps: one hidden row each, nothing fed
            state.forward(mx.array([t], mx.uint32), rollback=False)
            drafter.add_hidden(state.hidden)
        at_prompt = len(sizes)
        draft = drafter.propose(tokens, 3, SamplingParams())
        monkeypatch.undo()
        return draft.tokens.tolist(), sizes[:at_prompt], sizes[at_prompt:]

    pieces, at_prompt, sizes = drafts(16)
    assert at_prompt == [32, len(prompt) - 2 - 32]
    assert sizes[:2] == [32, 14] and all(n <= 16 or n & (n - 1) == 0 for n in sizes)
    whole, at_prompt, sizes = drafts(1 << 30)
    assert at_prompt == [len(prompt) - 2] and sizes[0] == 46 and whole == pieces
