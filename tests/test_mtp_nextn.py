"""DeepSeek-V3 / GLM-4.5 NextN heads: load, compute the documented forward, draft exactly."""

import json
import shutil

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import mlx_lm
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import KVCache

import tiny_mtp
from mlxspec.engine.speculate import SpeculativeDecoder
from mlxspec.errors import InvalidCheckpointError
from mlxspec.models.mtp import MTPHead, load_mtp_head
from mlxspec.models.mtp.nextn import NextNHead
from mlxspec.models.trunk import split_trunk

VOCAB = 32
N = 32
PROMPT = [5, 9, 12, 5, 9, 14, 20, 7, 5, 9]


def _load(path):
    model, _, config = mlx_lm.load(str(path), return_config=True)
    return model, load_mtp_head(model, path, config)


def _rewrite(path, edit, file="model.safetensors"):
    """Apply EDIT (in place) to the tensors stored in PATH/FILE."""
    weights = mx.load(str(path / file))
    mx.eval(weights)
    edit(weights)
    mx.save_safetensors(str(path / file), weights, metadata={"format": "pt"})


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


@pytest.fixture(scope="module")
def glm_path(tmp_path_factory):
    return tiny_mtp.write_nextn_checkpoint(tmp_path_factory.mktemp("glm"), "glm4_moe", vocab_size=VOCAB, seed=1)


@pytest.fixture(scope="module")
def ds_path(tmp_path_factory):
    """DeepSeek-V3, 2 trunk layers, the NextN layer (model.layers.2.*) in an mtp.safetensors
    sidecar: mlx-lm reads only model*.safetensors, so the trunk loads as is."""
    path = tiny_mtp.write_nextn_checkpoint(tmp_path_factory.mktemp("ds"), "deepseek_v3", vocab_size=VOCAB,
                                       seed=2, hidden_size=32, intermediate_size=64,
                                       moe_intermediate_size=16, q_lora_rank=16)
    return tiny_mtp.nextn_to_sidecar(path)


@pytest.fixture(scope="module")
def ds61_path(tmp_path_factory):
    """DeepSeek-V3 in its own single-file layout: mlx-lm's deepseek_v3 sanitize drops the
    hard-coded "model.layers.61", so only 61 trunk layers load. Trunk layers are dense
    (first_k_dense_replace=61) to keep it fast; layer 61, the NextN block, is still MoE."""
    return tiny_mtp.write_nextn_checkpoint(tmp_path_factory.mktemp("ds61"), "deepseek_v3", vocab_size=VOCAB,
                                       seed=3, num_hidden_layers=61, first_k_dense_replace=61,
                                       hidden_size=32, intermediate_size=32, moe_intermediate_size=16,
                                       q_lora_rank=16)


@pytest.fixture(scope="module")
def glm(glm_path):
    return _load(glm_path)


@pytest.fixture(scope="module")
def ds(ds_path):
    return _load(ds_path)


@pytest.fixture(scope="module")
def ds61(ds61_path):
    return _load(ds61_path)


def greedy(model, prompt, n=N):
    return [t for (t, _), _ in zip(generate_step(mx.array(prompt), model, max_tokens=n), range(n))]


def drafted_output(model, head, depth, prompt=PROMPT, n=N):
    dec = SpeculativeDecoder(model, mtp_head=head, drafter="mtp", depth=depth, gates=False)
    out, stats = [], None
    for toks, stats in dec.generate(prompt, max_tokens=n):
        out.extend(toks)
    return out, stats


@pytest.mark.parametrize("which, moe_class",
                         [("glm", "MoE"), ("ds", "DeepseekV3MoE"), ("ds61", "DeepseekV3MoE")])
def test_nextn_head_loads(request, which, moe_class):
    model, head = request.getfixturevalue(which)
    assert isinstance(head, MTPHead) and isinstance(head.module, NextNHead)
    m = head.module
    # layer index num_hidden_layers >= first_k_dense_replace: the MoE MLP, as the real layer has
    assert type(m.block.mlp).__name__ == moe_class
    assert type(m.block).__module__ == f"mlx_lm.models.{model.model_type}"
    assert "embed_tokens" in m and "head" in m.shared_head  # the fixture ships both
    cache = head.make_cache()
    assert len(cache) == 1 and isinstance(cache[0], KVCache)
    assert head.nbytes > 0 and head.trunk.body is model.model
    assert head.source == ("mtp.safetensors" if which == "ds" else "model.safetensors")


def _reference_step(stored, n, tokens, hidden, block, embed_w, head_w, eps):
    """The NextN forward written out from the stored HF tensors (block run as loaded)."""
    p = f"model.layers.{n}."
    e = mx.fast.rms_norm(embed_w[tokens], stored[p + "enorm.weight"], eps)
    h = mx.fast.rms_norm(hidden, stored[p + "hnorm.weight"], eps)
    x = mx.concatenate([e, h], axis=-1) @ stored[p + "eh_proj.weight"].T  # embedding first
    cache = KVCache()
    mask = nn.MultiHeadAttention.create_additive_causal_mask(x.shape[0]) == 0
    x = block(x[None], mask=mask, cache=cache)[0]
    out = mx.fast.rms_norm(x, stored[p + "shared_head.norm.weight"], eps)
    return out @ head_w.T, out


@pytest.mark.parametrize("which", ["glm", "ds", "ds61"])
def test_nextn_forward_matches_the_formula(request, which):
    model, head = request.getfixturevalue(which)
    path = request.getfixturevalue(which + "_path")
    stored = mx.load(str(path / ("mtp.safetensors" if which == "ds" else "model.safetensors")))
    n = model.args.num_hidden_layers
    tokens = mx.array([3, 4, 5, 6, 7], mx.uint32)
    hidden = mx.random.normal((5, model.args.hidden_size), key=mx.random.key(1))
    logits, out = head.step(tokens, hidden, head.make_cache())
    want_logits, want_out = _reference_step(
        stored, n, tokens, hidden, head.module.block, stored[f"model.layers.{n}.embed_tokens.weight"],
        stored[f"model.layers.{n}.shared_head.head.weight"], model.args.rms_norm_eps)
    assert mx.allclose(out, want_out, atol=1e-4).item()  # recycled hidden: post shared_head.norm
    assert mx.allclose(logits, want_logits, atol=1e-4).item()


def test_trunk_embedding_and_head_when_not_shipped(glm_path, tmp_path):
    path = _copy(glm_path, tmp_path / "glm")
    _rewrite(path, lambda t: [t.pop(f"model.layers.2.{k}.weight") for k in ("embed_tokens", "shared_head.head")])
    model, head = _load(path)
    assert "embed_tokens" not in head.module and "head" not in head.module.shared_head
    stored = mx.load(str(path / "model.safetensors"))
    tokens = mx.array([3, 4, 5], mx.uint32)
    hidden = mx.random.normal((3, model.args.hidden_size), key=mx.random.key(2))
    logits, out = head.step(tokens, hidden, head.make_cache())
    want_logits, want_out = _reference_step(stored, 2, tokens, hidden, head.module.block,
                                            stored["model.embed_tokens.weight"], stored["lm_head.weight"],
                                            model.args.rms_norm_eps)
    assert mx.allclose(out, want_out, atol=1e-4).item()
    assert mx.allclose(logits, want_logits, atol=1e-4).item()
    assert greedy(model, PROMPT, 12) == drafted_output(model, head, 3, n=12)[0]


@pytest.mark.parametrize("which, n", [("glm", N), ("ds", N), ("ds61", 8)])
def test_nextn_drafting_is_exact(request, which, n):
    model, head = request.getfixturevalue(which)
    ref = greedy(model, PROMPT, n)
    for depth in (1, 2, 3, 4):
        out, stats = drafted_output(model, head, depth, n=n)
        assert out == ref, f"{which} depth {depth}"
        assert stats.drafter == "mtp" and stats.drafted >= depth * (n // 4)


def test_trained_nextn_head_is_accepted(glm, glm_path):
    """Fit the head (block frozen) to the target's own greedy continuations: its drafts are then
    accepted, which shows the pairs, the chain, the cache and the head's logits line up."""
    model, head = glm
    trained = load_mtp_head(model, glm_path, json.loads((glm_path / "config.json").read_text()))
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(3, VOCAB, 6)] for _ in range(12)]
    seqs = mx.array([p + greedy(model, p, 24) for p in prompts])
    trunk = split_trunk(model)
    hidden = mx.stop_gradient(trunk.body(seqs))
    m = trained.module
    emb = mx.stop_gradient(m.embed_tokens(seqs[:, 1:-1]))
    targets = seqs[:, 2:]
    m.block.freeze()

    def loss_fn(module):
        out = module(emb, hidden[:, :-2], [None])
        return nn.losses.cross_entropy(module.shared_head.head(out), targets, reduction="mean")

    opt = optim.Adam(learning_rate=1e-2)
    step = nn.value_and_grad(m, loss_fn)
    for _ in range(50):
        loss, grads = step(m)
        opt.update(m, grads)
        mx.eval(m.parameters(), opt.state)
    drafted = accepted = 0
    for p in prompts[:4]:
        out, stats = drafted_output(model, trained, 1, prompt=p, n=24)
        assert out == greedy(model, p, 24)
        drafted, accepted = drafted + stats.drafted, accepted + stats.accepted
    _, untrained = drafted_output(model, head, 1, prompt=prompts[0], n=24)
    print(f"acceptance untrained {untrained.accepted / untrained.drafted:.2f}, "
          f"trained {accepted / drafted:.2f} (loss {loss.item():.3f})")
    assert untrained.accepted / untrained.drafted < 0.5
    assert accepted / drafted > 0.8


def _quantize_layer(path, n, file="model.safetensors", bits=4, group_size=32):
    """Quantize NextN layer N's linear / embedding weights (mlx affine) as an MLX export would;
    the MoE router (no to_quantized in mlx-lm), norms and too narrow weights stay as they are."""

    def edit(t):
        for k in [k for k in t if k.startswith(f"model.layers.{n}.")]:
            v = t[k]
            if (k.endswith(".weight") and v.ndim == 2 and not k.endswith("mlp.gate.weight")
                    and v.shape[-1] % group_size == 0):
                w, s, b = mx.quantize(v, group_size=group_size, bits=bits)
                base = k[: -len(".weight")]
                t.update({k: w, base + ".scales": s, base + ".biases": b})

    _rewrite(path, edit, file)
    config = json.loads((path / "config.json").read_text())
    config["quantization"] = {"group_size": group_size, "bits": bits, "mode": "affine"}
    (path / "config.json").write_text(json.dumps(config))


def test_quantized_nextn_head(glm_path, tmp_path):
    path = _copy(glm_path, tmp_path / "q4")
    _quantize_layer(path, 2)
    model, head = _load(path)
    m = head.module
    assert isinstance(m.eh_proj, nn.QuantizedLinear) and m.eh_proj.bits == 4
    assert isinstance(m.embed_tokens, nn.QuantizedEmbedding)
    assert type(m.block.mlp.switch_mlp.gate_proj).__name__ == "QuantizedSwitchLinear"
    assert isinstance(m.block.mlp.gate.weight, mx.array) and m.block.mlp.gate.weight.dtype == mx.float32
    out, stats = drafted_output(model, head, 2)
    assert out == greedy(model, PROMPT) and stats.drafted > 0


def test_quantized_deepseek_nextn_head(tmp_path):
    """A quantized MLA kv_b_proj goes through mlx-lm's own dequantize / split / requantize."""
    path = tiny_mtp.write_nextn_checkpoint(tmp_path / "dsq", "deepseek_v3", vocab_size=VOCAB, seed=4,
                                       hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
                                       q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=32,
                                       v_head_dim=32)
    weights = mx.load(str(path / "model.safetensors"))
    mx.eval(weights)
    head = {k: v for k, v in weights.items() if k.startswith("model.layers.2.")}
    mx.save_safetensors(str(path / "model.safetensors"), {k: v for k, v in weights.items() if k not in head})
    mx.save_safetensors(str(path / "mtp.safetensors"), head)
    _quantize_layer(path, 2, file="mtp.safetensors")
    model, head = _load(path)
    attn = head.module.block.self_attn
    assert type(attn.embed_q).__name__ == "QuantizedMultiLinear" and attn.embed_q.bits == 4
    assert isinstance(attn.q_a_proj, nn.QuantizedLinear)
    out, stats = drafted_output(model, head, 3, n=16)
    assert out == greedy(model, PROMPT, 16) and stats.drafted > 0


def _one_line_error(path):
    model, _, config = mlx_lm.load(str(path), return_config=True)
    with pytest.raises(InvalidCheckpointError) as err:
        load_mtp_head(model, path, config)
    msg = str(err.value)
    assert "\n" not in msg
    return msg


@pytest.mark.parametrize("name", ["eh_proj.weight", "mlp.experts.3.up_proj.weight", "self_attn.kv_a_layernorm.weight"])
def test_missing_tensor_is_named(glm_path, ds61_path, tmp_path, name):
    src, n = (ds61_path, 61) if "kv_a" in name else (glm_path, 2)
    path = _copy(src, tmp_path / "broken")
    _rewrite(path, lambda t: t.pop(f"model.layers.{n}.{name}"))
    msg = _one_line_error(path)
    assert f"nextn.layers.0.{name} is missing" in msg


def test_fp8_nextn_is_refused(glm_path, tmp_path):
    path = _copy(glm_path, tmp_path / "fp8")
    _rewrite(path, lambda t: t.update({"model.layers.2.eh_proj.weight_scale_inv": mx.ones((1, 1))}))
    msg = _one_line_error(path)
    assert msg.startswith("fp8 NextN weights are not supported; convert to bf16 or MLX first")
