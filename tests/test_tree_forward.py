"""One target forward over a draft tree (engine/tree_forward.py, models/tree_attention.py): every
row equals a plain chain forward along its path, and keeping a path leaves the state a chain
would (attention-only, sliding-window and GatedDeltaNet hybrid targets, fp32 on the CPU)."""

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
import numpy as np
import pytest
from mlx_lm.models import rope_utils
from mlx_lm.models.cache import QuantizedKVCache, make_prompt_cache

from mlxspec import compat
from mlxspec.engine.cache import ModelState
from mlxspec.engine.tree_forward import TreeUnsupported, keep_path, tree_forward
from mlxspec.models import tree_attention
from mlxspec.models.tree_attention import path_to

ATOL = 1e-4
# arch -> (longest prefix, most tree nodes): tiny_swa's window is 8 tokens and a tree must fit it
SIZES = {"llama": (20, 12), "qwen3": (20, 12), "qwen3_5": (20, 12), "qwen3_next": (12, 10), "swa": (2, 6)}


@pytest.fixture(scope="module")
def models(tiny_llama, tiny_qwen3, tiny_qwen3_5, tiny_swa, tiny_qwen3_next):
    out = {name: mlx_lm.load(str(path))[0] for name, path in [
        ("llama", tiny_llama), ("qwen3", tiny_qwen3), ("qwen3_5", tiny_qwen3_5), ("swa", tiny_swa)]}
    out["qwen3_next"] = tiny_qwen3_next
    for model in out.values():
        model.set_dtype(mx.float32)
    return out


def _embed(model):
    lm = getattr(model, "language_model", model)
    return lm.model.embed_tokens


def random_tree(rng, nodes: int, max_depth: int = 5) -> list[int]:
    """parents of a random branching tree of NODES nodes (root included), depth <= max_depth."""
    parents, depth = [-1], [0]
    while len(parents) < nodes:
        p = int(rng.integers(0, len(parents)))
        if depth[p] < max_depth:
            parents.append(p)
            depth.append(depth[p] + 1)
    return parents


def state(model, prefix, keep_hidden=False) -> ModelState:
    s = ModelState(model, keep_hidden=keep_hidden)
    s.prefill(prefix)
    return s


def toks(ids) -> mx.array:
    return mx.array(list(ids), mx.uint32)


def close(a, b) -> bool:
    return mx.abs(a - b).max().item() <= ATOL


def chain_rows(model, prefix, tokens, parents, keep_hidden=False):
    """Per node: (logits, hidden) of row -1 of a plain forward of its path after PREFIX."""
    ref = state(model, prefix, keep_hidden)
    out = []
    for i in range(len(parents)):
        logits = ref.forward(toks(tokens[j] for j in path_to(parents, i)))
        out.append((logits[-1], ref.hidden[-1] if keep_hidden else None))
        ref.rollback_to(len(prefix))
    return out


def random_case(rng, model, arch, empty_prefix=False):
    """(prefix, tokens, parents); an empty prefix puts the root at position 0 (fresh caches)."""
    longest, most = SIZES[arch]
    n_vocab = _embed(model).weight.shape[0]
    prefix = [] if empty_prefix else rng.integers(0, n_vocab, size=int(rng.integers(1, longest + 1))).tolist()
    parents = random_tree(rng, int(rng.integers(1, most + 1)))
    tokens = rng.integers(0, n_vocab, size=len(parents)).tolist()
    return prefix, tokens, parents


def tree_mismatches(model, prefix, tokens, parents) -> list[int]:
    s = state(model, prefix)
    logits = tree_forward(s, toks(tokens), parents)
    keep_path(s, len(prefix), [])
    return [i for i, (want, _) in enumerate(chain_rows(model, prefix, tokens, parents))
            if not close(logits[i], want)]


@pytest.mark.parametrize("arch", list(SIZES))
def test_tree_rows_equal_chain_rows(models, arch):
    model, rng = models[arch], np.random.default_rng(1)
    for trial in range(4):
        prefix, tokens, parents = random_case(rng, model, arch, empty_prefix=trial == 0)
        s = state(model, prefix, keep_hidden=True)
        logits = tree_forward(s, toks(tokens), parents)
        assert logits.shape[0] == len(parents) and s.hidden.shape[0] == len(parents)
        for i, (want, hidden) in enumerate(chain_rows(model, prefix, tokens, parents, True)):
            assert close(logits[i], want), f"{arch}: node {i} of {parents} after {len(prefix)}"
            assert close(s.hidden[i], hidden), f"{arch}: hidden row of node {i}"


def check_like_chain(model, s, ref, rng, n_vocab):
    """S and REF (fed the same tokens, REF plainly) go on alike: forward, partial rollback,
    snapshot."""
    assert s.length == ref.length
    nxt = toks(rng.integers(0, n_vocab, size=4).tolist())
    assert close(s.forward(nxt), ref.forward(nxt))
    s.rollback_to(s.length - 2)
    ref.rollback_to(ref.length - 2)
    nxt = toks(rng.integers(0, n_vocab, size=2).tolist())
    assert close(s.forward(nxt, rollback=False), ref.forward(nxt, rollback=False))
    snap = s.snapshot()
    if snap is not None:
        fresh = ModelState(model)
        fresh.restore(snap, snap.length)
        nxt = toks(rng.integers(0, n_vocab, size=3).tolist())
        assert close(fresh.forward(nxt), ref.forward(nxt, rollback=False))


@pytest.mark.parametrize("arch", list(SIZES))
def test_keeping_a_path_leaves_the_state_of_its_chain(models, arch):
    model, rng = models[arch], np.random.default_rng(2)
    n_vocab = _embed(model).weight.shape[0]
    for trial in range(4):
        prefix, tokens, parents = random_case(rng, model, arch, empty_prefix=trial == 1)
        s, ref = state(model, prefix), state(model, prefix)
        start = s.length
        for _ in range(2):  # a second tree right after the first kept path
            tree_forward(s, toks(tokens), parents)
            assert s.length == start + len(parents)
            node = int(rng.integers(0, len(parents)))
            path = path_to(parents, node)[: int(rng.integers(0 if trial == 0 else 1, 99))]
            keep_path(s, start, path)
            assert s.length == start + len(path)
            ref.forward(toks(tokens[j] for j in path), rollback=False)
            start = s.length
            tokens = rng.integers(0, n_vocab, size=len(parents)).tolist()
            if arch == "swa":  # the window holds the second tree only after a short path
                break
        check_like_chain(model, s, ref, rng, n_vocab)


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5"])
def test_planted_bugs_are_caught(models, arch, monkeypatch):
    """The comparison with chains sees a mask that lets siblings see each other, chain
    positions, and (hybrid) a convolution over the input order instead of the path."""
    model = models[arch]
    prefix, tokens, parents = list(range(30, 39)), [5, 6, 7, 8, 9, 10, 11], [-1, 0, 0, 1, 1, 2, 3]
    assert tree_mismatches(model, prefix, tokens, parents) == []
    causal = lambda parents: np.tril(np.ones((len(parents),) * 2, dtype=bool))  # noqa: E731
    with monkeypatch.context() as m:
        m.setattr(tree_attention, "ancestor_matrix", causal)
        assert tree_mismatches(model, prefix, tokens, parents)
    plain_tree = tree_attention.make_tree

    def chain_positions(start, parents):
        tree = plain_tree(start, parents)
        tree.positions = mx.arange(start, start + len(parents), dtype=mx.int32)
        return tree

    with monkeypatch.context() as m:
        m.setattr("mlxspec.engine.tree_forward.make_tree", chain_positions)
        assert tree_mismatches(model, prefix, tokens, parents)
    if arch == "qwen3_5":
        with monkeypatch.context() as m:
            m.setattr(tree_attention.Tree, "windows", lambda self, k: np.stack(
                [np.arange(i, i + k) for i in range(self.size)]).astype(np.int32))
            assert tree_mismatches(model, prefix, tokens, parents)


def test_a_tree_that_would_fill_a_sliding_window_is_refused(models):
    model = models["swa"]
    s, ref = state(model, list(range(40, 46))), state(model, list(range(40, 46)))
    with pytest.raises(TreeUnsupported, match="sliding window"):
        tree_forward(s, toks([1, 2, 3, 4]), [-1, 0, 0, 1])
    assert s.length == 6
    assert close(s.forward(toks([1, 2])), ref.forward(toks([1, 2])))


def test_an_error_inside_the_forward_leaves_the_state_as_it_was(models, monkeypatch):
    model = models["qwen3_5"]
    s, ref = state(model, list(range(50, 60))), state(model, list(range(50, 60)))

    calls, plain_update = [], tree_attention.gated_delta_update

    def broken(*args, **kwargs):  # fails in the second linear layer, after an attention layer
        calls.append(1)
        if len(calls) > 3:  # the tree has two levels: two calls a layer
            raise RuntimeError("planted")
        return plain_update(*args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(tree_attention, "gated_delta_update", broken)
        with pytest.raises(RuntimeError, match="planted"):
            tree_forward(s, toks([1, 2, 3]), [-1, 0, 0])
    assert tree_attention.current() is None and s.length == 10
    assert all(getattr(c, "offset", 10) == 10 for c in s.cache)  # the attention rows cut again
    assert close(s.forward(toks([4, 5, 6])), ref.forward(toks([4, 5, 6])))
    logits = tree_forward(s, toks([7, 8]), [-1, 0])  # and a tree works again
    keep_path(s, 13, [0, 1])
    assert close(logits[1], ref.forward(toks([7, 8]), rollback=False)[1])


def test_misuse_is_refused(models):
    model = models["qwen3"]
    s = state(model, [1, 2, 3])
    with pytest.raises(RuntimeError, match="without a tree_forward"):
        keep_path(s, 3, [0])
    with pytest.raises(ValueError):
        tree_forward(s, toks([1, 2]), [-1, 1])  # a node its own parent
    with pytest.raises(ValueError):
        tree_forward(s, toks([1, 2, 3]), [-1, 0])  # tokens and parents differ
    tree_forward(s, toks([4, 5, 6]), [-1, 0, 0])
    with pytest.raises(RuntimeError, match="keep_path"):
        tree_forward(s, toks([4]), [-1])
    with pytest.raises(ValueError):
        keep_path(s, 3, [0, 1, 2])  # 2 is 1's sibling
    with pytest.raises(ValueError):
        keep_path(s, 4, [0])
    keep_path(s, 3, [0, 2])
    assert s.length == 5


def test_an_unsupported_layer_or_cache_is_refused_before_anything_changes(tiny_llama):
    model = mlx_lm.load(str(tiny_llama))[0]
    attn = model.layers[1].self_attn
    attn.rope = rope_utils.DynamicNTKScalingRoPE(16, 4096, False, 10000.0, 2.0)
    s = state(model, [1, 2, 3])
    with pytest.raises(TreeUnsupported, match="DynamicNTKScalingRoPE"):
        tree_forward(s, toks([4, 5]), [-1, 0])
    assert s.length == 3 and type(model.layers[0].self_attn) is type(attn)  # nothing swapped

    model = mlx_lm.load(str(tiny_llama))[0]
    s = ModelState(model)
    s.cache[0] = QuantizedKVCache(group_size=32, bits=8)
    with pytest.raises(TreeUnsupported, match="QuantizedKVCache"):
        tree_forward(s, toks([4, 5]), [-1, 0])


def test_compat_tree_classes_are_the_tiny_models_and_ropes_take_array_offsets(models):
    """compat.tree_attention_classes / array_offset_ropes against the installed mlx-lm."""
    for arch in ("llama", "qwen3", "qwen3_5", "qwen3_next"):
        model = models[arch]
        tree_attention.install(model, make_prompt_cache(model))
        attn = next(lr.self_attn for lr in model.layers if hasattr(lr, "self_attn"))
        assert isinstance(attn, compat.tree_attention_classes())
        # tree-aware, and still of its mlx-lm module (kernels.attention.install reads it)
        assert type(attn).__name__.startswith("Tree") and type(attn).__module__.startswith("mlx_lm.models.")
    x = mx.random.normal((1, 2, 5, 32), key=mx.random.key(0))
    positions = mx.array([7, 9, 8, 12, 7])
    ropes = [nn.RoPE(32), rope_utils.Llama3RoPE(32, 2048, False, 10000, {"factor": 8.0}),
             rope_utils.YarnRoPE(32, scaling_factor=4.0), rope_utils.SuScaledRoPE(32),
             rope_utils.ProportionalRoPE(32, 16)]
    assert {type(r) for r in ropes} == set(compat.array_offset_ropes())
    for rope in ropes:
        got = rope(x.transpose(2, 1, 0, 3), offset=positions).transpose(2, 1, 0, 3)
        for i in range(5):
            want = rope(x[:, :, i : i + 1], offset=int(positions[i].item()))
            assert mx.array_equal(got[:, :, i : i + 1], want), type(rope).__name__
