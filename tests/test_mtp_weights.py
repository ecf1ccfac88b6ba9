"""find_mtp_weights: every layout, key prefix and family of native MTP / NextN head tensors."""

import json
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import tiny
import tiny_mtp
from mlxspec.errors import InvalidCheckpointError
from mlxspec.models.mtp import MTPWeights, find_mtp_weights

VOCAB = 32
NORMS = ("mtp.norm.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight",
         "mtp.layers.0.input_layernorm.weight", "mtp.layers.0.post_attention_layernorm.weight",
         "mtp.layers.0.self_attn.q_norm.weight", "mtp.layers.0.self_attn.k_norm.weight")


def _config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


def _write_config(path: Path, config: dict) -> None:
    (path / "config.json").write_text(json.dumps(config))


def _find(path: Path) -> MTPWeights | None:
    return find_mtp_weights(path, _config(path))


def _head(path: Path, file: str = "model.safetensors") -> dict[str, np.ndarray]:
    """The stored mtp.* tensors of FILE, as float32 numpy."""
    weights = mx.load(str(path / file))
    return {k: np.array(v.astype(mx.float32)) for k, v in weights.items() if "mtp." in k}


def _rewrite(path: Path, edit) -> None:
    """Apply EDIT(dict) to model.safetensors' tensors in place."""
    weights = mx.load(str(path / "model.safetensors"))
    mx.eval(weights)
    edit(weights)
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "pt"})


def _copy(src: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(src, tmp_path / "ckpt"))


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    """A raw Hugging Face Qwen3.5 checkpoint (zero-centred norms, torch conv1d) with its head."""
    return tiny.write_checkpoint(tmp_path_factory.mktemp("dense"), "qwen3_5", vocab_size=VOCAB, seed=11)


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    """Qwen3.5-35B-A3B shrunk: MoE trunk and head, experts in HF fused layout."""
    return tiny.write_checkpoint(tmp_path_factory.mktemp("moe"), "qwen3_5_moe", vocab_size=VOCAB, seed=12)


@pytest.fixture(scope="module")
def dense_raw_head(dense):
    return _head(dense)


def _assert_dense_head(w: MTPWeights, raw: dict, shifted: bool) -> None:
    text = tiny._qwen3_5_config(VOCAB, [0], 0)["text_config"]
    expected = tiny.qwen3_5_mtp_shapes(text)
    assert w.family == "qwen3_5" and w.num_layers == 1
    assert {k: tuple(v.shape) for k, v in w.tensors.items()} == expected
    assert w.norms_shifted is shifted
    for name, value in w.tensors.items():
        want = raw[name] + 1.0 if shifted and name in NORMS else raw[name]
        np.testing.assert_allclose(np.array(value.astype(mx.float32)), want, rtol=0, atol=1e-6, err_msg=name)


# -- layouts and prefixes --------------------------------------------------------------------


@pytest.mark.parametrize("prefix", tiny_mtp.MTP_KEY_PREFIXES)
@pytest.mark.parametrize("layout", ["single", "sharded", *tiny_mtp.MTP_SIDECARS])
def test_layouts_and_prefixes(dense, dense_raw_head, tmp_path, layout, prefix):
    path = tiny_mtp.relayout_mtp(_copy(dense, tmp_path), layout, prefix)
    w = _find(path)
    expected_source = {"single": "model.safetensors",
                       "sharded": "model.safetensors.index.json (1 of 2 shards)"}.get(layout, layout)
    assert w.source == expected_source
    assert w.quantization is None
    # raw HF zero-centred norms get +1, whatever the file: in the main files because the trunk's
    # conv1d is unconverted, in a sidecar because the head's norm weights sit near 0
    _assert_dense_head(w, dense_raw_head, shifted=True)


def test_sharded_index_points_at_the_head_shard(dense, tmp_path):
    path = tiny_mtp.relayout_mtp(_copy(dense, tmp_path), "sharded")
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    assert {index[k] for k in index if k.startswith("mtp.")} == {"model-00002-of-00002.safetensors"}
    assert not (path / "model.safetensors").exists()


def test_sidecar_wins_over_main_files(dense, tmp_path):
    path = _copy(dense, tmp_path)
    head = {k: v for k, v in mx.load(str(path / "model.safetensors")).items() if k.startswith("mtp.")}
    mx.save_safetensors(str(path / "mtp.safetensors"), head)
    assert _find(path).source == "mtp.safetensors"


# -- zero-centred norms ----------------------------------------------------------------------


def test_mlx_converted_trunk_with_converted_sidecar_is_not_shifted(dense, dense_raw_head, tmp_path):
    path = tiny_mtp.convert_trunk_mlx(_copy(dense, tmp_path), shift_head_norms=True)
    trunk = mx.load(str(path / "model.safetensors"))
    assert not any("mtp." in k for k in trunk)
    assert all(v.shape[-1] == 1 for k, v in trunk.items() if k.endswith("conv1d.weight"))
    w = _find(path)
    assert w.source == "mtp.safetensors"
    # the sidecar already holds 1 + w: loaded as is, so the values equal raw + 1 exactly once
    assert w.norms_shifted is False
    for name in NORMS:
        np.testing.assert_allclose(np.array(w.tensors[name]), dense_raw_head[name] + 1.0, atol=1e-6)


def test_mlx_converted_trunk_with_raw_sidecar_is_shifted(dense, dense_raw_head, tmp_path):
    path = tiny_mtp.convert_trunk_mlx(_copy(dense, tmp_path), sidecar="model-mtp.safetensors",
                                  shift_head_norms=False)
    w = _find(path)
    assert w.source == "model-mtp.safetensors"
    _assert_dense_head(w, dense_raw_head, shifted=True)


def test_raw_trunk_decides_over_head_statistics(dense, tmp_path):
    """Head in the main files of an unconverted checkpoint: mlx-lm's conv1d rule shifts it,
    even when its norm weights happen to sit near 1."""
    path = _copy(dense, tmp_path)
    _rewrite(path, lambda w: w.update({k: mx.ones_like(w[k]) for k in NORMS}))
    w = _find(path)
    assert w.norms_shifted is True
    np.testing.assert_array_equal(np.array(w.tensors["mtp.norm.weight"]), 2.0)


def test_converted_head_in_main_files_of_converted_trunk_is_not_shifted(dense, tmp_path):
    """No unconverted conv1d: the head's own statistics decide (here: near 1, converted)."""
    path = tiny_mtp.convert_trunk_mlx(_copy(dense, tmp_path), shift_head_norms=True)
    trunk = dict(mx.load(str(path / "model.safetensors")))
    trunk.update(mx.load(str(path / "mtp.safetensors")))
    mx.eval(trunk)
    (path / "mtp.safetensors").unlink()
    mx.save_safetensors(str(path / "model.safetensors"), trunk)
    w = _find(path)
    assert w.source == "model.safetensors" and w.norms_shifted is False


def test_bfloat16_is_kept_and_shifted_in_place(tmp_path):
    path = tiny.write_checkpoint(tmp_path / "bf16", "qwen3_5", vocab_size=VOCAB, seed=3, dtype="bfloat16")
    stored = mx.load(str(path / "model.safetensors"))
    w = _find(path)
    assert all(v.dtype == mx.bfloat16 for v in w.tensors.values())
    assert w.norms_shifted
    assert mx.array_equal(w.tensors["mtp.norm.weight"], stored["mtp.norm.weight"] + 1).item()


# -- quantized heads --------------------------------------------------------------------------


def test_quantized_head(dense, dense_raw_head, tmp_path):
    path = tiny_mtp.quantize_mtp(_copy(dense, tmp_path), bits=4, group_size=32)
    w = _find(path)
    assert w.quantization == {"group_size": 32, "bits": 4, "mode": "affine"}
    for base in ("mtp.fc", "mtp.layers.0.self_attn.q_proj", "mtp.layers.0.mlp.down_proj"):
        assert w.tensors[base + ".weight"].dtype == mx.uint32
        assert base + ".scales" in w.tensors and base + ".biases" in w.tensors
    assert w.norms_shifted
    np.testing.assert_allclose(np.array(w.tensors["mtp.norm.weight"]), dense_raw_head["mtp.norm.weight"] + 1, atol=1e-6)


def test_quantization_inferred_without_config_block(dense, tmp_path):
    path = tiny_mtp.quantize_mtp(_copy(dense, tmp_path), bits=8, group_size=64)
    config = _config(path)
    del config["quantization"], config["quantization_config"]
    _write_config(path, config)
    assert _find(path).quantization == {"group_size": 64, "bits": 8, "mode": "affine"}


def test_quantized_head_missing_biases(dense, tmp_path):
    path = tiny_mtp.quantize_mtp(_copy(dense, tmp_path))
    _rewrite(path, lambda w: w.pop("mtp.layers.0.self_attn.o_proj.biases"))
    with pytest.raises(InvalidCheckpointError, match=r"mtp\.layers\.0\.self_attn\.o_proj\.biases"):
        _find(path)


# -- MoE heads ----------------------------------------------------------------------------------


def test_moe_head_fused_layout(moe, tmp_path):
    w = _find(moe)
    text = _config(moe)["text_config"]
    assert {k: tuple(v.shape) for k, v in w.tensors.items()} == tiny.qwen3_5_mtp_shapes(text)
    assert w.tensors["mtp.layers.0.mlp.experts.gate_up_proj"].shape == (4, 64, 64)
    assert len(w.tensors) == 19 and w.norms_shifted


def _split_experts(weights: dict, layout: str) -> None:
    p = "mtp.layers.0.mlp."
    gate_up = weights.pop(p + "experts.gate_up_proj")
    down = weights.pop(p + "experts.down_proj")
    mid = gate_up.shape[-2] // 2
    gate, up = gate_up[:, :mid, :], gate_up[:, mid:, :]
    if layout == "switch_mlp":
        weights.update({p + "switch_mlp.gate_proj.weight": gate, p + "switch_mlp.up_proj.weight": up,
                        p + "switch_mlp.down_proj.weight": down})
    else:
        for e in range(gate.shape[0]):
            weights.update({f"{p}experts.{e}.gate_proj.weight": gate[e],
                            f"{p}experts.{e}.up_proj.weight": up[e],
                            f"{p}experts.{e}.down_proj.weight": down[e]})


@pytest.mark.parametrize("layout", ["per_expert", "switch_mlp"])
def test_moe_head_other_expert_layouts(moe, tmp_path, layout):
    path = _copy(moe, tmp_path)
    _rewrite(path, lambda w: _split_experts(w, layout))
    w = _find(path)
    key = "mtp.layers.0.mlp.experts.3.down_proj.weight" if layout == "per_expert" \
        else "mtp.layers.0.mlp.switch_mlp.down_proj.weight"
    assert key in w.tensors and w.num_layers == 1


def test_moe_head_missing_expert(moe, tmp_path):
    path = _copy(moe, tmp_path)

    def edit(w):
        _split_experts(w, "per_expert")
        del w["mtp.layers.0.mlp.experts.2.up_proj.weight"]

    _rewrite(path, edit)
    with pytest.raises(InvalidCheckpointError, match=r"experts\.2\.up_proj\.weight is missing"):
        _find(path)


def test_qwen3_next_counts_layers_from_tensor_names(moe, tmp_path):
    """Qwen3-Next: flat config, no mtp_num_hidden_layers, no attn_output_gate (gated anyway)."""
    path = _copy(moe, tmp_path)
    config = {**_config(path)["text_config"], "model_type": "qwen3_next"}
    for key in ("mtp_num_hidden_layers", "attn_output_gate"):
        config.pop(key)
    _write_config(path, config)
    w = _find(path)
    assert w.family == "qwen3_5" and w.num_layers == 1 and len(w.tensors) == 19


# -- errors and absent heads ----------------------------------------------------------------------


def test_missing_tensor_is_one_line_error(dense, tmp_path):
    path = _copy(dense, tmp_path)
    _rewrite(path, lambda w: w.pop("mtp.layers.0.self_attn.k_norm.weight"))
    with pytest.raises(InvalidCheckpointError) as err:
        _find(path)
    msg = str(err.value)
    assert "\n" not in msg
    assert "mtp.layers.0.self_attn.k_norm.weight is missing" in msg and "(32,)" in msg


def test_wrong_shape_is_one_line_error(dense, tmp_path):
    path = _copy(dense, tmp_path)
    # a q_proj without the attention output gate half: (n_heads * head_dim, hidden)
    _rewrite(path, lambda w: w.update({"mtp.layers.0.self_attn.q_proj.weight": mx.zeros((64, 64))}))
    with pytest.raises(InvalidCheckpointError) as err:
        _find(path)
    msg = str(err.value)
    assert "\n" not in msg
    assert "mtp.layers.0.self_attn.q_proj.weight has shape (64, 64), expected (128, 64)" in msg


def test_sharded_index_naming_a_missing_shard(dense, tmp_path):
    path = tiny_mtp.relayout_mtp(_copy(dense, tmp_path), "sharded")
    (path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(InvalidCheckpointError, match="model-00002-of-00002.safetensors"):
        _find(path)


def test_sidecar_without_head_tensors(dense, tmp_path):
    path = _copy(dense, tmp_path)
    mx.save_safetensors(str(path / "mtp.safetensors"), {"something.else": mx.zeros((2,))})
    with pytest.raises(InvalidCheckpointError, match="mtp.safetensors holds no MTP head tensors"):
        _find(path)


def test_no_head_returns_none(dense, tmp_path):
    # an mlx-lm conversion: sanitize dropped mtp.*, the config still says mtp_num_hidden_layers 1
    path = tiny_mtp.convert_trunk_mlx(_copy(dense, tmp_path))
    (path / "mtp.safetensors").unlink()
    assert _config(path)["text_config"]["mtp_num_hidden_layers"] == 1
    assert _find(path) is None


def test_zero_layers_in_config_returns_none(dense, tmp_path):
    path = _copy(dense, tmp_path)
    config = _config(path)
    config["text_config"]["mtp_num_hidden_layers"] = 0
    _write_config(path, config)
    assert _find(path) is None


def test_unsupported_model_type_returns_none(tmp_path):
    path = tiny.write_checkpoint(tmp_path / "llama", "llama", vocab_size=VOCAB, hidden_size=32,
                                 intermediate_size=64, num_hidden_layers=1)
    assert _find(path) is None


# -- NextN (DeepSeek-V3, GLM-4.x) -----------------------------------------------------------------


@pytest.mark.parametrize("model_type", ["deepseek_v3", "glm4_moe"])
def test_nextn_layer(tmp_path, model_type):
    path = tiny_mtp.write_nextn_checkpoint(tmp_path / model_type, model_type, vocab_size=VOCAB)
    config = _config(path)
    n = config["num_hidden_layers"]
    stored = mx.load(str(path / "model.safetensors"))
    w = _find(path)
    assert w.family == "nextn" and w.num_layers == 1 and w.source == "model.safetensors"
    expected = {k.replace(f"model.layers.{n}.", "nextn.layers.0."): s
                for k, s in tiny_mtp.nextn_layer_shapes(config, n).items()}
    assert {k: tuple(v.shape) for k, v in w.tensors.items()} == expected
    assert {"nextn.layers.0.eh_proj.weight", "nextn.layers.0.enorm.weight", "nextn.layers.0.hnorm.weight",
            "nextn.layers.0.shared_head.norm.weight", "nextn.layers.0.shared_head.head.weight",
            "nextn.layers.0.embed_tokens.weight"} <= set(w.tensors)
    # standard RMSNorm weights: never shifted
    assert w.norms_shifted is False
    assert mx.array_equal(w.tensors["nextn.layers.0.enorm.weight"], stored[f"model.layers.{n}.enorm.weight"]).item()
    assert w.quantization is None


def test_nextn_two_layers_and_missing_tensor(tmp_path):
    path = tiny_mtp.write_nextn_checkpoint(tmp_path / "ds", "deepseek_v3", vocab_size=VOCAB,
                                       num_nextn_predict_layers=2)
    w = _find(path)
    assert w.num_layers == 2
    assert "nextn.layers.1.eh_proj.weight" in w.tensors
    _rewrite(path, lambda t: t.pop("model.layers.3.eh_proj.weight"))
    with pytest.raises(InvalidCheckpointError, match=r"nextn\.layers\.1\.eh_proj\.weight is missing"):
        _find(path)


def test_nextn_sidecar(tmp_path):
    path = tiny_mtp.write_nextn_checkpoint(tmp_path / "glm", "glm4_moe", vocab_size=VOCAB)
    weights = mx.load(str(path / "model.safetensors"))
    mx.eval(weights)
    head = {k: v for k, v in weights.items() if k.startswith("model.layers.2.")}
    mx.save_safetensors(str(path / "model.safetensors"), {k: v for k, v in weights.items() if k not in head})
    mx.save_safetensors(str(path / "mtp.safetensors"), head)
    w = _find(path)
    assert w.source == "mtp.safetensors" and w.family == "nextn" and not w.norms_shifted
