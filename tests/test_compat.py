"""mlxspec/compat.py against the installed mlx-lm: every mlx-lm internal mlxspec relies on still
behaves as it assumes. An mlx-lm upgrade that renames or changes one fails here (pyproject.toml
bounds mlx-lm to the versions this file has passed with)."""

import importlib

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models import gated_delta, qwen3, qwen3_5
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

from mlxspec import compat
from mlxspec.kernels import qmm
from mlxspec.models.gdn_tape import TAPED

HYBRID = dict(model_type="qwen3_5_text", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
              num_attention_heads=2, num_key_value_heads=1, head_dim=32, linear_num_key_heads=1,
              linear_num_value_heads=2, linear_key_head_dim=32, linear_value_head_dim=32,
              linear_conv_kernel_dim=4, full_attention_interval=2, rms_norm_eps=1e-6,
              vocab_size=64, tie_word_embeddings=False,
              rope_parameters={"type": "default", "mrope_section": [2, 2, 2], "rope_theta": 10000,
                               "partial_rotary_factor": 0.5})


def _qwen3_5(**overrides) -> nn.Module:
    mx.random.seed(0)
    model = qwen3_5.Model(qwen3_5.ModelArgs(model_type="qwen3_5", text_config={**HYBRID, **overrides}))
    mx.eval(model.parameters())
    return model


def _qwen3() -> nn.Module:
    mx.random.seed(0)
    model = qwen3.Model(qwen3.ModelArgs(model_type="qwen3", hidden_size=64, num_hidden_layers=1,
                                        intermediate_size=128, num_attention_heads=2, num_key_value_heads=1,
                                        head_dim=32, rms_norm_eps=1e-6, vocab_size=64,
                                        max_position_embeddings=512, rope_theta=10000.0,
                                        tie_word_embeddings=False))
    mx.eval(model.parameters())
    return model


def test_model_classes_are_mlx_lms_for_a_config():
    assert compat.model_classes({"model_type": "qwen3"}) == (qwen3.Model, qwen3.ModelArgs)
    assert compat.model_classes({"model_type": "qwen3_5"}) == (qwen3_5.Model, qwen3_5.ModelArgs)
    with pytest.raises(ValueError):
        compat.model_classes({"model_type": "no_such_model_type"})


def test_ring_index_is_the_write_position_of_a_rotating_cache():
    c = RotatingKVCache(max_size=4)
    assert compat.ring_index(c) == 0
    kv = lambda n, v: mx.full((1, 1, n, 2), float(v))  # noqa: E731
    c.update_and_fetch(kv(4, 1), kv(4, 1))  # a multi-token write appends: the index is its end
    assert compat.ring_index(c) == 4 == c.keys.shape[2]
    c.update_and_fetch(kv(1, 2), kv(1, 2))  # a full ring: a 1-token write wraps to the start
    assert compat.ring_index(c) == 1 and c.keys[0, 0, 0, 0].item() == 2.0
    compat.set_ring_index(c, 3)  # the next 1-token write goes where the index says
    c.update_and_fetch(kv(1, 5), kv(1, 5))
    assert compat.ring_index(c) == 4 and c.keys[0, 0, 3, 0].item() == 5.0
    with pytest.raises(AttributeError):
        compat.set_ring_index(KVCache(), 0)


def _spy(calls, fn):
    def wrapped(*args, **kwargs):
        calls.append(fn.__name__)
        return fn(*args, **kwargs)
    return wrapped


def test_rebinding_a_model_modules_name_reroutes_its_layers():
    """mlx-lm's model modules look gated_delta_update and scaled_dot_product_attention up by
    name at call time (what kernels.gdn.install and kernels.attention.install rebind)."""
    for name in ("mlx_lm.models.qwen3_5", "mlx_lm.models.qwen3_next"):
        assert importlib.import_module(name).gated_delta_update is not None
    calls = []
    model = _qwen3_5()
    before = compat.rebind(qwen3_5, "gated_delta_update", _spy(calls, gated_delta.gated_delta_update))
    try:
        model(mx.array([[1, 2, 3]]))
    finally:
        compat.rebind(qwen3_5, "gated_delta_update", before)
    assert calls == ["gated_delta_update"]  # the one linear-attention layer

    model = _qwen3()
    sdpa = qwen3.scaled_dot_product_attention
    compat.rebind(qwen3, "scaled_dot_product_attention", _spy(calls, sdpa))
    try:
        model(mx.array([[1, 2, 3]]))
    finally:
        compat.rebind(qwen3, "scaled_dot_product_attention", sdpa)
    assert calls == ["gated_delta_update", "scaled_dot_product_attention"]


def test_swap_class_keeps_a_layers_weights_and_outputs():
    model = _qwen3_5()
    gdn = model.language_model.model.layers[0].linear_attn
    x = mx.random.normal((1, 5, 64))
    want = gdn(x, cache=make_prompt_cache(model)[0])
    params, taped = dict(gdn.parameters()), TAPED[type(gdn)]
    compat.swap_class(gdn, taped)
    assert type(gdn) is taped
    assert dict(gdn.parameters()).keys() == params.keys()
    assert mx.array_equal(gdn(x, cache=make_prompt_cache(model)[0]), want)

    layer = nn.QuantizedLinear(64, 64, group_size=32, bits=4)
    y = layer(x)
    compat.swap_class(layer, qmm.SmallMQuantizedLinear)
    assert mx.array_equal(layer(x), y)
    with pytest.raises(TypeError):
        compat.swap_class(nn.Linear(2, 2), qmm.SmallMQuantizedLinear)


def test_drop_ssm_mask_lets_an_attention_only_qwen3_5_decode_with_a_cache():
    """With no GatedDeltaNet layer, mlx-lm's text model still reads its mask from cache[ssm_idx]
    (a KVCache there): decoding with a cache fails until the index is dropped."""
    model = _qwen3_5(full_attention_interval=1)
    text_model = model.language_model.model
    assert text_model.ssm_idx == 0
    with pytest.raises(TypeError):  # create_ssm_mask on a KVCache (if this passes, mlx-lm fixed it)
        mx.eval(model(mx.array([[1, 2, 3]]), cache=make_prompt_cache(model)))
    compat.drop_ssm_mask(text_model)
    assert text_model.ssm_idx is None
    mx.eval(model(mx.array([[1, 2, 3]]), cache=make_prompt_cache(model)))
    with pytest.raises(AttributeError):
        compat.drop_ssm_mask(nn.Linear(2, 2))


def test_hf_tokenizer_is_the_one_inside_mlx_lms_wrapper(shared_tokenizer):
    from mlx_lm.tokenizer_utils import load as load_tokenizer
    from transformers import PreTrainedTokenizerFast

    wrapper = load_tokenizer(shared_tokenizer)
    inner = compat.hf_tokenizer(wrapper)
    assert isinstance(inner, PreTrainedTokenizerFast) and inner is not wrapper
    assert inner.encode("hello world") == wrapper.encode("hello world")
    assert compat.hf_tokenizer(inner) is inner


def test_shard_leaves_its_group_on_the_layers_that_reduce_and_gather_makes_logits_whole():
    """mlx-lm's qwen3_5 shard() marks the GatedDeltaNet layers (they all_sum their output) and a
    vocabulary-split lm_head (its logits are gathered): the tape and the trunk read both marks.
    A group of one (this process) shards to the whole model."""
    model = _qwen3_5()
    lm = model.language_model
    gdn = lm.model.layers[0].linear_attn
    assert compat.sharding_group(gdn) is None and compat.sharding_group(lm) is None
    tokens = mx.array([[1, 2, 3]])
    whole = model(tokens)
    group = mx.distributed.init()
    model.shard(group)
    assert compat.sharding_group(gdn) is group and compat.sharding_group(lm) is group
    logits = compat.gather_last_axis(lm.lm_head(mx.ones((1, 3, 64))), group)
    assert logits.shape == (1, 3, 64)
    assert mx.allclose(model(tokens), whole, atol=1e-5)


def test_shard_qwen3_5_layers_splits_an_mtp_heads_layer_as_the_trunks():
    """The MTP head's decoder layer goes through qwen3_5.Model.shard on a stand-in: its
    projections become mlx-lm's sharded linears (a group of one: the same outputs)."""
    from mlx.nn.layers.distributed import AllToShardedLinear, ShardedToAllLinear

    from mlxspec.models.mtp.head import QwenMTPHead

    mx.random.seed(1)
    head = QwenMTPHead(qwen3_5.TextModelArgs.from_dict(HYBRID), 1)
    mx.eval(head.parameters())
    x, h = mx.random.normal((1, 3, 64)), mx.random.normal((1, 3, 64))
    whole = head(x, h, head.make_cache())
    compat.shard_qwen3_5_layers(head.layers, mx.distributed.init())
    attn, mlp = head.layers[0].self_attn, head.layers[0].mlp
    assert isinstance(attn.q_proj, AllToShardedLinear) and isinstance(attn.o_proj, ShardedToAllLinear)
    assert isinstance(mlp.down_proj, ShardedToAllLinear)
    assert mx.allclose(head(x, h, head.make_cache()), whole, atol=1e-5)


def test_pipeline_size_is_what_pipeline_left_on_the_inner_model():
    """1 for a whole model; mlx-lm's PipelineMixin keeps the split's size on the inner model
    (a group of one here: still 1; set by hand to what a split over 2 processes leaves)."""
    for model in (_qwen3_5(), _qwen3()):
        assert compat.pipeline_size(model) == 1
    model = _qwen3_5()
    model.language_model.model.pipeline(mx.distributed.init())
    assert compat.pipeline_size(model) == 1
    model.language_model.model.pipeline_size = 2
    assert compat.pipeline_size(model) == 2
