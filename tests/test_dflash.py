"""DFlash block drafters: the published layout loads, the forward is z-lab's, the target's layer
outputs are what the drafter reads, and speculation with it is exact: token for token at
temperature 0 (dense and hybrid targets, partial accepts at every depth, prefix reuse, a bounded
context), in distribution at temperature > 0 (tests/test_dflash_distribution.py)."""

import json

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.generate import generate_step

import tiny_dflash
from mlxspec.engine.cache import ModelState
from mlxspec.engine.drafters.dflash import DFlashDrafter
from mlxspec.engine.drafters.registry import make_drafter
from mlxspec.engine.prefix_cache import PrefixCache
from mlxspec.engine.speculate import SpeculativeDecoder
from mlxspec.errors import DrafterError, InvalidCheckpointError, UsageError
from mlxspec.models import dflash
from mlxspec.models.loader import load_model

PROMPT_TEXT = "The quick brown fox jumps over the lazy dog. Write a function that adds two numbers."
N_TOKENS = 40


def _load_pair(tmp_path_factory, target_dir, name, **kw):
    target = load_model(str(target_dir))
    target.model.update(_fp32(target.model))
    drafter_dir = tiny_dflash.write_dflash_checkpoint(tmp_path_factory.mktemp(name), target_dir, seed=3, **kw)
    return target, load_model(str(drafter_dir)), drafter_dir


def _fp32(model):
    from mlx.utils import tree_map

    return tree_map(lambda p: p.astype(mx.float32) if mx.issubdtype(p.dtype, mx.floating) else p, model.parameters())


@pytest.fixture(scope="module")
def pairs(tmp_path_factory, tiny_qwen3, tiny_llama, tiny_qwen3_5):
    return {"qwen3": _load_pair(tmp_path_factory, tiny_qwen3, "qwen3-DFlash"),
            "llama": _load_pair(tmp_path_factory, tiny_llama, "llama-DFlash", block_size=16),
            "qwen3_5": _load_pair(tmp_path_factory, tiny_qwen3_5, "qwen3_5-DFlash")}


# -- loading --------------------------------------------------------------------------------

def test_published_layout_loads_and_is_checked(pairs, tmp_path):
    target, draft, path = pairs["qwen3"]
    assert isinstance(draft.model, dflash.DFlashDraftModel) and draft.tokenizer is None
    cfg = json.loads((path / "config.json").read_text())
    assert draft.model.args.target_layer_ids == tuple(cfg["dflash_config"]["target_layer_ids"])
    dflash.check_pair(target.model, draft.model)
    # broken configs and weights: one line each
    for change, words in [(lambda c: c.pop("dflash_config"), "dflash_config"),
                          (lambda c: c["dflash_config"].update(target_layer_ids=[99]), "outside"),
                          (lambda c: c["dflash_config"].update(mask_token_id="x"), "mask_token_id"),
                          (lambda c: c.update(block_size=0), "block_size")]:
        bad = dict(json.loads(json.dumps(cfg)))
        change(bad)
        folder = tmp_path / f"bad{len(list(tmp_path.iterdir()))}"
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(bad))
        (folder / "model.safetensors").write_bytes((path / "model.safetensors").read_bytes())
        with pytest.raises(InvalidCheckpointError, match=words):
            dflash.load_dflash(folder, "bad")
    weights = mx.load(str(path / "model.safetensors"))
    weights.pop("norm.weight")
    folder = tmp_path / "lacking"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(cfg))
    mx.save_safetensors(str(folder / "model.safetensors"), weights)
    with pytest.raises(InvalidCheckpointError, match="lacks 1 tensor"):
        dflash.load_dflash(folder, "lacking")


def test_a_drafter_for_another_target_is_refused(pairs):
    target, _, _ = pairs["qwen3"]
    _, other, _ = pairs["qwen3_5"]  # same width, 4 target layers against 2
    with pytest.raises(DrafterError, match="4-layer target"):
        dflash.check_pair(target.model, other.model)
    with pytest.raises(UsageError, match="DFlash drafter"):
        make_drafter("draft", target.model, other.model)
    with pytest.raises(UsageError, match="--drafter dflash needs"):
        make_drafter("dflash", target.model, None)


def test_a_pipeline_stage_captures_its_layers_and_zeros_for_the_others():
    """On a stage of mlx-lm's pipeline (layers 2-3 of 4 here, numbered as in the whole model),
    the capture keeps the chosen layers this stage runs and zeros for the others, all-summed
    over the processes (a group of one here: the sum is itself); the logits come back equal.
    The two-process run is tests/test_distributed.py's pipeline job."""
    from types import SimpleNamespace

    import mlx.nn as nn

    from mlxspec.models.layer_capture import LayerCapture, layer_count

    H = 8
    mx.random.seed(0)
    stage = [nn.Linear(H, H), nn.Linear(H, H)]
    inner = SimpleNamespace(pipeline_size=2, start_idx=2, end_idx=4, layers=[None, None, *stage])
    model = SimpleNamespace(model=inner, args=SimpleNamespace(num_hidden_layers=4, hidden_size=H), layers=stage)
    assert layer_count(model) == 4
    with pytest.raises(DrafterError, match="target has 4"):
        LayerCapture(model, (1, 4))
    capture = LayerCapture(model, (1, 2))
    x = mx.random.normal((1, 3, H))
    out2 = stage[0](x)  # the stage's forward: layer 2, then 3
    stage[1](out2)
    logits = mx.random.normal((3, 5))
    rows, same = capture.take_after(logits)
    assert rows.shape == (3, 2 * H)
    assert mx.array_equal(rows[:, :H], mx.zeros((3, H))) and mx.allclose(rows[:, H:], out2[0])
    assert mx.array_equal(same, logits)


def test_a_quantized_drafter_loads_and_drafts(pairs, tmp_path):
    target, draft, path = pairs["qwen3"]
    model = draft.model
    nn.quantize(model, group_size=32, bits=4, class_predicate=lambda p, m: isinstance(m, nn.Linear))
    from mlx.utils import tree_flatten

    folder = tmp_path / "q4"
    folder.mkdir()
    mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(model.parameters())))
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization"] = {"group_size": 32, "bits": 4}
    (folder / "config.json").write_text(json.dumps(cfg))
    loaded, _ = dflash.load_dflash(folder, "q4")
    assert isinstance(loaded.layers[0].self_attn.q_proj, nn.QuantizedLinear)
    out, _ = _speculate(target.model, loaded, target.tokenizer.encode(PROMPT_TEXT), n=12, depth=3)
    assert out == _greedy(target.model, target.tokenizer.encode(PROMPT_TEXT), 12)
    pairs["qwen3"] = (target, load_model(str(path)), path)  # the module-wide drafter unquantized


# -- the forward ---------------------------------------------------------------------------

def reference_block_logits(model: dflash.DFlashDraftModel, embed, head, features, block):
    """z-lab's single-call forward, written out: context and block keys in one attention, no mask."""
    args = model.args
    ctx = model.hidden_norm(model.fc(features[None]))
    h = embed(block)[None]
    S, L = features.shape[0], block.shape[0]
    for layer in model.layers:
        attn = layer.self_attn
        x = layer.input_layernorm(h)
        q = attn.q_norm(attn.q_proj(x).reshape(1, L, args.num_attention_heads, -1)).transpose(0, 2, 1, 3)
        keys = mx.concatenate([attn.k_proj(ctx), attn.k_proj(x)], axis=1)
        values = mx.concatenate([attn.v_proj(ctx), attn.v_proj(x)], axis=1)
        k = attn.k_norm(keys.reshape(1, S + L, args.num_key_value_heads, -1)).transpose(0, 2, 1, 3)
        v = values.reshape(1, S + L, args.num_key_value_heads, -1).transpose(0, 2, 1, 3)
        q, k = model.rope(q, offset=S), model.rope(k, offset=0)
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=args.head_dim**-0.5)
        h = h + attn.o_proj(out.transpose(0, 2, 1, 3).reshape(1, L, -1))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return head(model.norm(h))[0]


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5"])
def test_features_are_the_layer_outputs_and_the_block_is_z_labs(pairs, arch):
    target, draft, _ = pairs[arch]
    ids = draft.model.args.target_layer_ids
    prompt = target.tokenizer.encode(PROMPT_TEXT)
    # the layer outputs, by running the layers one by one (no capture)
    lm = getattr(target.model, "language_model", target.model)
    state = ModelState(target.model, keep_hidden=True, capture=ids)
    feats = state.prefill(prompt[:-1], step=7)  # chunked: rows of every chunk, in order
    state.close()
    plain = ModelState(target.model)
    plain.prefill(prompt[:-1])
    logits_plain = plain.forward(mx.array(prompt[-1:], mx.uint32))
    assert feats.shape == (len(prompt) - 1, len(ids) * lm.args.hidden_size)
    drafter = DFlashDrafter(draft.model, target.model)
    drafter.start(prompt)
    drafter.prefill(prompt, len(prompt) - 1, feats[:5])
    drafter.add_hidden(feats[5:])
    k = drafter.block - 1
    got = drafter.block_logits(prompt, k)
    block = mx.array([prompt[-1]] + [draft.model.args.mask_token_id] * (drafter.block - 1), mx.uint32)
    want = reference_block_logits(draft.model, drafter.embed, drafter.head, feats, block)[1:]
    assert np.allclose(np.array(got), np.array(want), atol=1e-4)
    # capture changes nothing the target computes
    state2 = ModelState(target.model, keep_hidden=True, capture=ids)
    state2.prefill(prompt[:-1])
    logits_captured = state2.forward(mx.array(prompt[-1:], mx.uint32))
    state2.close()
    assert np.array_equal(np.array(logits_plain), np.array(logits_captured))


def test_features_match_a_layer_by_layer_forward(pairs):
    target, draft, _ = pairs["qwen3"]
    ids = draft.model.args.target_layer_ids
    prompt = target.tokenizer.encode(PROMPT_TEXT)
    state = ModelState(target.model, keep_hidden=True, capture=ids)
    feats = state.prefill(prompt)
    state.close()
    body = target.model.model
    h = body.embed_tokens(mx.array(prompt)[None])
    mask = "causal"
    wanted = []
    for i, layer in enumerate(body.layers):
        h = layer(h, mask, None)
        if i in ids:
            wanted.append(h[0])
    assert np.allclose(np.array(feats), np.array(mx.concatenate(wanted, axis=-1)), atol=1e-5)


# -- exactness at temperature 0 --------------------------------------------------------------

class SteeredDFlash(DFlashDrafter):
    """The real drafter whose block logits are pushed, per position, to the known greedy output
    with probability RATE and to a wrong token otherwise: partial accepts at every depth while
    the context, capture and block forward all run for real."""

    def __init__(self, *args, script, prompt_len, rate=0.75, seed=0, **kw):
        super().__init__(*args, **kw)
        self.script, self.prompt_len, self.rate = script, prompt_len, rate
        self.rng = np.random.default_rng(seed)

    def block_logits(self, tokens, k):
        logits = super().block_logits(tokens, k)
        if logits is None:
            return None
        done = len(tokens) - self.prompt_len  # output tokens so far; tokens[-1] is output done-1
        bias = np.zeros(logits.shape, np.float32)
        for i in range(k):
            idx = done + i
            right = self.script[idx] if idx < len(self.script) else 0
            bias[i, right if self.rng.random() < self.rate else (right + 1 + i) % logits.shape[-1]] = 60.0
        return logits + mx.array(bias)


def _greedy(model, prompt, n):
    return [t for (t, _), _ in zip(generate_step(mx.array(prompt), model, max_tokens=n), range(n))]


def _speculate(model, draft_model, prompt, n=N_TOKENS, depth=4, drafter=None, tree=0, **gen):
    """Chains unless TREE says otherwise (trees: tests/test_tree_engine.py)."""
    dec = SpeculativeDecoder(model, draft_model=draft_model, drafter=drafter or "auto", gates=False, depth=depth,
                             tree=tree)
    out, stats = [], None
    for toks, stats in dec.generate(prompt, max_tokens=n, **gen):
        out.extend(toks)
    return out, stats


@pytest.mark.parametrize("arch", ["qwen3", "llama", "qwen3_5"])
@pytest.mark.parametrize("depth", [1, 3, 7])
def test_temperature_zero_is_plain_decoding(pairs, arch, depth):
    target, draft, _ = pairs[arch]
    prompt = target.tokenizer.encode(PROMPT_TEXT)
    ref = _greedy(target.model, prompt, N_TOKENS)
    steered = SteeredDFlash(draft.model, target.model, script=ref, prompt_len=len(prompt), seed=depth)
    out, stats = _speculate(target.model, None, prompt, depth=depth, drafter=steered)
    assert out == ref
    assert stats.drafter == "dflash" and stats.accepted > 0
    # partial accepts at every depth: each position accepted sometimes, rejected sometimes
    for pos in range(depth):
        assert 0 < stats.position_accepted[pos] < stats.position_drafted[pos], (pos, stats)
    # the unsteered random drafter too (mostly rejected)
    out, stats = _speculate(target.model, draft.model, prompt, depth=depth)
    assert out == ref and stats.drafter == "dflash" and stats.drafted > 0 and stats.tree_steps == 0
    out, stats = _speculate(target.model, draft.model, prompt, depth=depth, tree=None)  # the default: auto
    assert out == ref and stats.drafter == "dflash"


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5"])
def test_prefix_reuse_restores_the_drafters_context(pairs, arch):
    target, draft, _ = pairs[arch]
    prompt = target.tokenizer.encode(PROMPT_TEXT)
    ref = _greedy(target.model, prompt, N_TOKENS)
    cache = PrefixCache(1 << 26)

    def run():
        steered = SteeredDFlash(draft.model, target.model, script=ref, prompt_len=len(prompt), seed=5)
        dec = SpeculativeDecoder(target.model, drafter=steered, gates=False, depth=4, tree=0)
        out, stats = [], None
        for toks, stats in dec.generate(prompt, max_tokens=N_TOKENS, prefix_cache=cache):
            out.extend(toks)
        return out, stats, steered

    first, s1, _ = run()
    second, s2, drafter = run()
    assert first == second == ref
    assert s2.cached_tokens == len(prompt) - 1 and drafter.dropped == 0
    assert s1.position_accepted == s2.position_accepted  # the same context: the same drafts


def test_a_bounded_context_stays_exact_and_bounded(pairs):
    target, draft, _ = pairs["qwen3_5"]
    prompt = target.tokenizer.encode(PROMPT_TEXT * 3)
    ref = _greedy(target.model, prompt, N_TOKENS)
    steered = SteeredDFlash(draft.model, target.model, script=ref, prompt_len=len(prompt), sink=4, window=16)
    out, stats = _speculate(target.model, None, prompt, drafter=steered)
    assert out == ref and stats.accepted > 0
    assert steered.dropped > 0 and steered.cache[0].offset <= 4 + 16 + 16 // 4
    assert steered.position == len(prompt) + N_TOKENS - 1 - (N_TOKENS - len(out)) or steered.position > len(prompt)


def test_depth_never_exceeds_the_block(pairs):
    target, draft, _ = pairs["qwen3"]  # block 8
    dec = SpeculativeDecoder(target.model, draft_model=draft.model, drafter="dflash")
    assert dec.max_depth == 7
    dec = SpeculativeDecoder(target.model, draft_model=draft.model, drafter="dflash", depth=12, gates=False)
    assert dec.depth == 7
    out, stats = _speculate(target.model, draft.model, target.tokenizer.encode(PROMPT_TEXT), n=20, depth=12)
    assert max(stats.depth_histogram) <= 7


def test_a_drafter_that_never_pays_is_switched_off(pairs):
    target, draft, _ = pairs["qwen3"]  # the random drafter: its drafts are rejected
    prompt = target.tokenizer.encode(PROMPT_TEXT)
    dec = SpeculativeDecoder(target.model, draft_model=draft.model, drafter="dflash")
    out, stats = [], None
    for toks, stats in dec.generate(prompt, max_tokens=60):
        out.extend(toks)
    assert out == _greedy(target.model, prompt, 60)
    assert stats.gate_events and not stats.gate_events[0].enabled  # switched off
    assert stats.plain_steps > 40 and stats.verify_steps < 15  # probes only, backing off
