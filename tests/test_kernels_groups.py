"""Stacked q/k/v and gate/up small-M matmuls (mlxspec/kernels/qmm_groups.py), on the CPU:
the stacking, the views, the one call per group and every fallback. The CUDA kernel itself
is checked against MLX in tests/test_kernels_gpu.py."""

from __future__ import annotations

import gc

import mlx.core as mx
import mlx.nn as nn
import pytest

from mlxspec.kernels import qmm, qmm_groups


def _quantized_qwen3():
    from mlx_lm.models import qwen3

    args = qwen3.ModelArgs(model_type="qwen3", hidden_size=128, num_hidden_layers=2, intermediate_size=256,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6,
                           vocab_size=128, max_position_embeddings=512, rope_theta=1e6, tie_word_embeddings=True)
    mx.random.seed(0)
    model = qwen3.Model(args)
    nn.quantize(model, group_size=32, bits=4)
    mx.eval(model.parameters())
    return model


def _logits(model, step):
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    model(mx.arange(20)[None] % 128, cache=cache)
    logits = model(mx.array([step]), cache=cache)
    mx.eval(logits)  # holds no graph (and so no weights) afterwards
    return logits


def _reference_stacked(calls):
    """The kernel's contract on the CPU: one output per stacked matrix, as MLX computes it."""
    def stacked(x, w, scales, biases, bounds, *, group_size, bits):
        calls.append((x.shape, bounds))
        edges = (0, *bounds, w.shape[0])
        return [mx.quantized_matmul(x, w[lo:hi], scales[lo:hi], biases[lo:hi], transpose=True,
                                    group_size=group_size, bits=bits) for lo, hi in zip(edges, edges[1:])]
    return stacked


def test_siblings_are_stacked_into_views_without_a_second_copy(monkeypatch):
    monkeypatch.setattr(qmm, "MIN_WEIGHT_BYTES", 0)
    model = _quantized_qwen3()
    one, four = _logits(model, [3]), _logits(model, [3, 1, 4, 1])
    gc.collect()
    before = mx.get_active_memory()
    assert qmm_groups.install(model) == 4  # q/k/v and gate/up in each of 2 layers
    gc.collect()
    grown = mx.get_active_memory() - before
    layer = model.model.layers[0]
    groups = {id(m._sibling_group): m._sibling_group for _, m in model.named_modules()
              if isinstance(m, qmm_groups.StackedQuantizedLinear)}
    stacked_bytes = sum(a.nbytes for g in groups.values() for a in g.stacked.values())
    assert grown < stacked_bytes / 4  # the layers hold views of the stacked arrays, not copies
    assert isinstance(layer.self_attn.k_proj, qmm_groups.StackedQuantizedLinear)
    assert isinstance(layer.mlp.up_proj, qmm_groups.StackedQuantizedLinear)
    assert not isinstance(layer.mlp.down_proj, qmm_groups.StackedQuantizedLinear)
    assert layer.self_attn.k_proj.weight.shape == (64, 128 * 4 // 32)
    # kernels off (here: no CUDA), every row count runs MLX on the views: the same logits
    assert mx.array_equal(_logits(model, [3]), one) and mx.array_equal(_logits(model, [3, 1, 4, 1]), four)
    assert qmm_groups.install(model) == 0  # again: nothing left to stack


def test_one_call_per_group_at_2_to_8_rows_and_the_same_logits(monkeypatch):
    monkeypatch.setattr(qmm, "MIN_WEIGHT_BYTES", 0)
    model = _quantized_qwen3()
    want = {n: _logits(model, list(range(1, n + 1))) for n in (1, 4, 9)}
    qmm_groups.install(model)
    calls = []
    monkeypatch.setattr(qmm_groups, "active", lambda: True)
    monkeypatch.setattr(qmm, "stacked_matmul", _reference_stacked(calls))
    for n, logits in want.items():
        calls.clear()
        got = _logits(model, list(range(1, n + 1)))
        assert mx.allclose(got, logits, atol=1e-5).item()
        # prefill (20 rows) and 1 or 9 rows: MLX's; 4 rows: one call per group, not per layer
        expected = [((1, 4, 128), (128, 192)), ((1, 4, 128), (256,))] * 2 if n == 4 else []
        assert calls == expected
        group = model.model.layers[0].self_attn.q_proj._sibling_group
        assert group.x is None and group.outputs == []  # nothing held between forwards


def test_a_sibling_falls_back_on_another_input_or_replaced_weights(monkeypatch):
    monkeypatch.setattr(qmm, "MIN_WEIGHT_BYTES", 0)
    model = _quantized_qwen3()
    qmm_groups.install(model)
    attn = model.model.layers[0].self_attn
    calls = []
    monkeypatch.setattr(qmm_groups, "active", lambda: True)
    monkeypatch.setattr(qmm, "stacked_matmul", _reference_stacked(calls))
    x, other = mx.random.normal((1, 3, 128)), mx.random.normal((1, 3, 128))
    q = attn.q_proj(x)
    k = attn.k_proj(other)  # another input: computed again, for it
    assert len(calls) == 2
    assert mx.allclose(k, mx.quantized_matmul(other, attn.k_proj.weight, attn.k_proj.scales, attn.k_proj.biases,
                                              transpose=True, group_size=32, bits=4), atol=1e-5).item()
    assert mx.allclose(q, mx.quantized_matmul(x, attn.q_proj.weight, attn.q_proj.scales, attn.q_proj.biases,
                                              transpose=True, group_size=32, bits=4), atol=1e-5).item()
    # weights replaced (a cast, a reload): the group no longer speaks for the layer
    attn.v_proj.update({"scales": attn.v_proj.scales * 2})
    calls.clear()
    y = attn.v_proj(x)
    assert calls == []
    assert mx.allclose(y, mx.quantized_matmul(x, attn.v_proj.weight, attn.v_proj.scales, attn.v_proj.biases,
                                              transpose=True, group_size=32, bits=4), atol=1e-5).item()


def test_only_matching_layouts_are_stacked(monkeypatch):
    monkeypatch.setattr(qmm, "MIN_WEIGHT_BYTES", 0)
    model = _quantized_qwen3()
    attn = model.model.layers[0].self_attn
    attn.v_proj = nn.QuantizedLinear(128, 64, bias=False, group_size=64, bits=8)  # another layout
    model.model.layers[1].mlp.up_proj = nn.Linear(128, 256, bias=False)  # not quantized
    assert qmm_groups.install(model) == 2  # layer 0's gate/up, layer 1's q/k/v
    assert not isinstance(attn.q_proj, qmm_groups.StackedQuantizedLinear)
    monkeypatch.setattr(qmm, "MIN_WEIGHT_BYTES", 1 << 30)
    assert qmm_groups.install(_quantized_qwen3()) == 0  # too small together: MLX's matmul


def test_stacked_matmul_checks_its_split_points():
    w = mx.zeros((8, 4), mx.uint32)
    s = mx.zeros((8, 1))
    for bounds in ((0,), (8,), (5, 3), (1, 2, 3)):
        with pytest.raises(ValueError):
            qmm.stacked_matmul(mx.zeros((2, 32)), w, s, s, bounds, group_size=32, bits=4)
