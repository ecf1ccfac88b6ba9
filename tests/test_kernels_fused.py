"""Sibling layers in one call (mlxspec/kernels/fused.py), on the CPU: which layers group, that a
forward makes one call a group and gives the logits of the unfused layers, and that a member
called on another array, or on decode's one row, is served by its own route. The kernel itself
(CUDA) is replaced by MLX's matmul per matrix; tests/test_kernels_gpu.py checks it bit for bit
against the single-matrix kernel."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models import qwen3
from mlx_lm.models.cache import make_prompt_cache

from mlxspec import kernels
from mlxspec.kernels import fused, qmm, qmm_tc


def _model():
    """A bf16 4-bit Qwen3 layout whose K (128) the tensor-core kernel takes."""
    args = qwen3.ModelArgs(model_type="qwen3", hidden_size=128, num_hidden_layers=2, intermediate_size=256,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6,
                           vocab_size=128, max_position_embeddings=512, rope_theta=1e6, tie_word_embeddings=False)
    mx.random.seed(0)
    model = qwen3.Model(args)
    model.set_dtype(mx.bfloat16)
    nn.quantize(model, group_size=64, bits=4)
    mx.eval(model.parameters())
    return model


def _mlx(x, w, scales, biases, group_size):
    return mx.quantized_matmul(x, w, scales, biases, transpose=True, group_size=group_size, bits=4)


@pytest.fixture
def routed(monkeypatch):
    """The kernels 'on' with MLX's matmul in their place; records each call's rows."""
    calls = {"fused": [], "single": []}
    monkeypatch.setattr(qmm, "active", lambda: True)
    monkeypatch.setattr(qmm, "MIN_WEIGHT_BYTES", 0)

    def fused_call(x, matrices, *, group_size, col_tiles=2):
        calls["fused"].append((x.size // x.shape[-1], len(matrices)))
        return [_mlx(x, *m, group_size) for m in matrices]

    def single(x, w, scales, biases, *, group_size, bits=4, **_):
        calls["single"].append(x.size // x.shape[-1])
        return _mlx(x, w, scales, biases, group_size)

    monkeypatch.setattr(qmm_tc, "fused_quantized_matmul", fused_call)
    monkeypatch.setattr(qmm_tc, "quantized_matmul", single)
    return calls


def _verify(model, width):
    cache = make_prompt_cache(model)
    model(mx.array([[3, 9, 27, 81, 5, 15, 45, 7]], mx.uint32), cache=cache)
    return model(mx.array([[11, 12, 13, 14][:width]], mx.uint32), cache=cache)


def test_groups_are_each_blocks_projections_of_one_input(routed):
    model = _model()
    want = _verify(model, 4)
    assert qmm.install(model) == 2 * 7 + 2  # each layer's 7 projections, the embedding, the output layer
    assert fused.install(model) == 2 * 2  # q/k/v and gate/up of each layer
    layer = model.model.layers[0]
    for names, size in ((("q_proj", "k_proj", "v_proj"), 3), (("gate_proj", "up_proj"), 2)):
        parent = layer.self_attn if size == 3 else layer.mlp
        calls = {id(getattr(parent, n).fused.call) for n in names}
        assert len(calls) == 1 and len(getattr(parent, names[0]).fused.call.members) == size
    assert layer.self_attn.o_proj.fused is None and layer.mlp.down_proj.fused is None
    routed["fused"].clear(), routed["single"].clear()
    got = _verify(model, 4)
    assert mx.array_equal(got, want).item()  # the same matmuls, whoever makes the call
    # the prefill (8 rows) and the verify (4 rows): a call a group each, o/down/output alone
    assert routed["fused"] == [(8, 3), (8, 2)] * 2 + [(4, 3), (4, 2)] * 2
    assert routed["single"] == [8, 8] * 2 + [8] + [4, 4] * 2 + [4]
    assert all(m.fused is None or m.fused.call.x is None for m in model.modules()
               if isinstance(m, qmm.SmallMQuantizedLinear))  # nothing held after a forward


def test_decode_and_kernels_off_take_each_layers_own_route(routed, monkeypatch):
    model = _model()
    qmm.install(model), fused.install(model)
    cache = make_prompt_cache(model)
    model(mx.array([[3, 9, 27, 81]], mx.uint32), cache=cache)
    routed["fused"].clear()
    model(mx.array([[5]], mx.uint32), cache=cache)  # decode: MLX's own layers
    monkeypatch.setattr(qmm, "active", lambda: False)
    model(mx.array([[5, 6]], mx.uint32), cache=cache)
    assert routed["fused"] == []


def test_a_member_on_another_array_makes_its_own_call(routed):
    """The group's outputs are kept for the array they were made of: a member called on a
    different array (or twice on one) gets its own product, never a sibling's stale one."""
    model = _model()
    qmm.install(model), fused.install(model)
    attn = model.model.layers[0].self_attn
    x1, x2 = (mx.random.normal((1, 3, 128)).astype(mx.bfloat16) for _ in range(2))
    q1 = attn.q_proj(x1)
    k2 = attn.k_proj(x2)
    assert mx.array_equal(k2, _mlx(x2, attn.k_proj["weight"], attn.k_proj["scales"], attn.k_proj["biases"], 64)).item()
    assert mx.array_equal(q1, _mlx(x1, attn.q_proj["weight"], attn.q_proj["scales"], attn.q_proj["biases"], 64)).item()
    k2b = attn.k_proj(x2)  # taken already: made again
    assert mx.array_equal(k2, k2b).item() and len(routed["fused"]) == 3


def test_only_matrices_of_one_k_split_share_a_call(routed, monkeypatch):
    """A fused output is its matrix's own call only where the K split is the same: Qwen3.6-27B's
    gated q (12288 columns) splits K = 5120 over 4 warps, its k and v (1024) over 8."""
    assert qmm_tc.fused_warps([4096, 1024, 1024], 4096) == 8  # Qwen3-8B: one call
    assert qmm_tc.fused_warps([12288, 1024, 1024], 5120) is None
    model = _model()
    qmm.install(model)
    real = qmm_tc.split_k
    monkeypatch.setattr(qmm_tc, "split_k", lambda n, k, t: 4 if n == 128 else real(n, k, t))  # q alone
    assert fused.install(model) == 2 * 2  # k+v, gate+up
    attn = model.model.layers[0].self_attn
    assert attn.q_proj.fused is None and attn.k_proj.fused.call is attn.v_proj.fused.call
    monkeypatch.setattr(qmm, "MIN_WEIGHT_BYTES", 10 << 20)
    for m in model.modules():
        if isinstance(m, qmm.SmallMQuantizedLinear):
            m.fused = None
    assert fused.install(model) == 0  # groups below the size limit stay on MLX's matmul


def test_uninstall_drops_the_groups(routed, mlx_lm_bindings_kept):
    model = _model()
    qmm.install(model), fused.install(model)
    kernels.uninstall(model)
    assert not any("fused" in vars(m) for m in model.modules())
