"""Tiny offline checkpoints with native MTP / NextN heads in the layouts real checkpoints use:
sharded or single files, sidecars, key prefixes, MLX-converted trunks, quantized heads, and
DeepSeek-V3 / GLM-4.5 NextN layers. Fixtures for mlxspec.models.mtp and the convert command."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np

from mlxspec.models.mtp.names import QWEN_PREFIXES
from tiny import (
    EOS_TOKEN,
    PAD_TOKEN,
    mlx_parameter_shapes,
    random_tensor,
    save_safetensors,
    tokenizer_info,
    write_config_files,
    write_minimal_tokenizer,
)

# MTP / NextN head layouts (fixtures for mlxspec.models.mtp.weights)

MTP_SIDECARS = ("mtp.safetensors", "mtp/weights.safetensors", "model-mtp.safetensors")
# HF key prefixes seen for the Qwen head; relayout_mtp writes any of them
# every key prefix the loader reads (mlxspec.models.mtp.names), not a copy of them
MTP_KEY_PREFIXES = QWEN_PREFIXES
_QWEN_HEAD_NORMS = ("norm.weight", "layernorm.weight", "q_norm.weight", "k_norm.weight",
                    "pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight")


def _save_mx(path: Path, arrays: dict, fmt: str = "pt") -> None:
    import mlx.core as mx

    path.parent.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(path), arrays, metadata={"format": fmt})


def _split_head(ckpt: Path) -> tuple[dict, dict]:
    """(trunk, head) tensors of CKPT's model.safetensors; the head keeps its "mtp." names."""
    import mlx.core as mx

    weights = mx.load(str(ckpt / "model.safetensors"))
    mx.eval(weights)  # mx.load is lazy: read everything before the file is rewritten
    head = {k: v for k, v in weights.items() if k.startswith("mtp.")}
    trunk = {k: v for k, v in weights.items() if not k.startswith("mtp.")}
    return trunk, head


def relayout_mtp(ckpt_dir, layout: str = "single", prefix: str = "mtp.") -> Path:
    """Move a written Qwen3.5 checkpoint's ``mtp.*`` tensors (all in model.safetensors).

    LAYOUT: "single" (they stay in model.safetensors), "sharded" (trunk in
    model-00001-of-00002.safetensors, head + lm_head in model-00002-of-00002.safetensors,
    with model.safetensors.index.json), or a sidecar name from MTP_SIDECARS (trunk stays in
    model.safetensors). PREFIX replaces the key prefix "mtp.". mlx-lm still loads the result.
    """
    ckpt = Path(ckpt_dir)
    trunk, head = _split_head(ckpt)
    head = {prefix + k[len("mtp."):]: v for k, v in head.items()}
    if layout == "single":
        _save_mx(ckpt / "model.safetensors", {**trunk, **head})
    elif layout == "sharded":
        shard2 = {**head, **{k: v for k, v in trunk.items() if k == "lm_head.weight"}}
        shard1 = {k: v for k, v in trunk.items() if k not in shard2}
        names = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
        weight_map = {}
        for name, arrays in zip(names, (shard1, shard2)):
            _save_mx(ckpt / name, arrays)
            weight_map.update({k: name for k in arrays})
        total = sum(v.nbytes for v in {**shard1, **shard2}.values())
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (ckpt / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        (ckpt / "model.safetensors").unlink()
    elif layout in MTP_SIDECARS:
        _save_mx(ckpt / "model.safetensors", trunk)
        _save_mx(ckpt / layout, head)
    else:
        raise ValueError(f"unknown layout {layout!r}")
    return ckpt


def convert_trunk_mlx(ckpt_dir, sidecar: str = "mtp.safetensors", shift_head_norms: bool = True) -> Path:
    """Rewrite a Qwen3.5 checkpoint as mlx-lm's converter leaves it, plus a head sidecar.

    The trunk goes through mlx-lm's own sanitize (norms +1, conv1d moved to (C, K, 1), mlx
    names) into model.safetensors; the head, which that sanitize drops, goes into SIDECAR with
    its norm weights +1 when SHIFT_HEAD_NORMS (an MLX-converted head), else zero-centred.
    """
    from mlx_lm.utils import _get_classes

    ckpt = Path(ckpt_dir)
    config = json.loads((ckpt / "config.json").read_text())
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(copy.deepcopy(config)))
    trunk, head = _split_head(ckpt)
    if shift_head_norms:
        head = {k: v + 1 if v.ndim == 1 and k.endswith(_QWEN_HEAD_NORMS) else v for k, v in head.items()}
    _save_mx(ckpt / "model.safetensors", model.sanitize(trunk), fmt="mlx")
    _save_mx(ckpt / sidecar, head, fmt="mlx")
    return ckpt


def quantize_mtp(ckpt_dir, bits: int = 4, group_size: int = 32) -> Path:
    """Quantize the head's 2-D linear weights in model.safetensors (mlx affine: .weight packed
    uint32, .scales, .biases) and add the ``quantization`` block mlx-lm writes to config.json.
    The trunk stays unquantized (mlx-lm quantizes only layers that have scales, so it loads)."""
    import mlx.core as mx

    ckpt = Path(ckpt_dir)
    trunk, head = _split_head(ckpt)
    out = {}
    for k, v in head.items():
        if k.endswith(".weight") and v.ndim == 2 and v.shape[-1] % group_size == 0:
            w, scales, biases = mx.quantize(v, group_size=group_size, bits=bits)
            base = k[: -len(".weight")]
            out.update({k: w, base + ".scales": scales.astype(v.dtype), base + ".biases": biases.astype(v.dtype)})
        else:
            out[k] = v
    _save_mx(ckpt / "model.safetensors", {**trunk, **out})
    config = json.loads((ckpt / "config.json").read_text())
    block = {"group_size": group_size, "bits": bits, "mode": "affine"}
    config["quantization"] = block
    config["quantization_config"] = dict(block)
    (ckpt / "config.json").write_text(json.dumps(config, indent=2))
    return ckpt


def nextn_config(model_type: str, vocab_size: int, **overrides) -> dict:
    """DeepSeek-V3 / GLM-4.7 configs shrunk, with one NextN layer (num_nextn_predict_layers)."""
    common = {
        "vocab_size": vocab_size, "hidden_size": 64, "intermediate_size": 128,
        "moe_intermediate_size": 32, "num_hidden_layers": 2, "first_k_dense_replace": 1,
        "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2,
        "n_group": 1, "topk_group": 1, "routed_scaling_factor": 2.5, "norm_topk_prob": True,
        "max_position_embeddings": 4096, "rope_scaling": None, "tie_word_embeddings": False,
        "num_nextn_predict_layers": 1, "torch_dtype": "float32", "use_cache": True,
    }
    if model_type == "deepseek_v3":
        config = {
            "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", **common,
            "num_attention_heads": 2, "num_key_value_heads": 2, "q_lora_rank": 32,
            "kv_lora_rank": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
            "moe_layer_freq": 1, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
            "rms_norm_eps": 1e-6, "rope_theta": 10000, "attention_bias": False,
        }
    elif model_type == "glm4_moe":
        config = {
            "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", **common,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
            "partial_rotary_factor": 0.5, "use_qk_norm": True, "attention_bias": True,
            "rms_norm_eps": 1e-5, "rope_theta": 1000000,
        }
    else:
        raise ValueError(f"unknown NextN model type {model_type!r}")
    config.update(overrides)
    return config


def nextn_layer_shapes(config: dict, index: int) -> dict[str, tuple]:
    """HF tensors of the NextN layer ``model.layers.{index}.`` (see mtp_tensors.md §5-6)."""
    h, v = config["hidden_size"], config["vocab_size"]
    n = config["num_attention_heads"]
    e, i, ns = config["n_routed_experts"], config["moe_intermediate_size"], config["n_shared_experts"]
    p = f"model.layers.{index}."
    shapes = {
        p + "embed_tokens.weight": (v, h), p + "enorm.weight": (h,), p + "hnorm.weight": (h,),
        p + "eh_proj.weight": (h, 2 * h), p + "shared_head.norm.weight": (h,),
        p + "shared_head.head.weight": (v, h),
        p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
        p + "mlp.gate.weight": (e, h), p + "mlp.gate.e_score_correction_bias": (e,),
        p + "mlp.shared_experts.gate_proj.weight": (i * ns, h),
        p + "mlp.shared_experts.up_proj.weight": (i * ns, h),
        p + "mlp.shared_experts.down_proj.weight": (h, i * ns),
    }
    for x in range(e):
        q = f"{p}mlp.experts.{x}."
        shapes.update({q + "gate_proj.weight": (i, h), q + "up_proj.weight": (i, h),
                       q + "down_proj.weight": (h, i)})
    a = p + "self_attn."
    if config["model_type"] == "deepseek_v3":
        nope, rope, vd = config["qk_nope_head_dim"], config["qk_rope_head_dim"], config["v_head_dim"]
        ql, kvl = config["q_lora_rank"], config["kv_lora_rank"]
        shapes.update({
            a + "q_a_proj.weight": (ql, h), a + "q_a_layernorm.weight": (ql,),
            a + "q_b_proj.weight": (n * (nope + rope), ql),
            a + "kv_a_proj_with_mqa.weight": (kvl + rope, h), a + "kv_a_layernorm.weight": (kvl,),
            a + "kv_b_proj.weight": (n * (nope + vd), kvl), a + "o_proj.weight": (h, n * vd),
        })
    else:
        d, nkv = config["head_dim"], config["num_key_value_heads"]
        for proj, out in (("q_proj", n * d), ("k_proj", nkv * d), ("v_proj", nkv * d)):
            shapes.update({a + proj + ".weight": (out, h), a + proj + ".bias": (out,)})
        shapes.update({a + "o_proj.weight": (h, n * d), a + "q_norm.weight": (d,), a + "k_norm.weight": (d,)})
    return shapes


def write_nextn_checkpoint(out_dir, model_type: str = "deepseek_v3", *, vocab_size: int = 32,
                           seed: int = 0, dtype: str = "float32", **overrides) -> Path:
    """A tiny DeepSeek-V3 / GLM-4.7 checkpoint with its NextN layer(s) at model.layers.{N}.

    The trunk is stored under mlx-lm's parameter names (its sanitize passes them through) and
    the NextN layer in the HF layout (per-expert tensors, kv_b_proj). glm4_moe loads with
    ``mlx_lm.load``; deepseek_v3 does not unless num_hidden_layers=61, because mlx-lm's
    deepseek_v3 sanitize drops the hard-coded prefix "model.layers.61" rather than layer N.
    A character tokenizer of VOCAB_SIZE tokens (<= 39) is written alongside.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_minimal_tokenizer(out_dir, vocab_size)
    _, special_ids = tokenizer_info(out_dir)
    eos_ids = [special_ids[EOS_TOKEN], special_ids[PAD_TOKEN]]
    config = nextn_config(model_type, vocab_size, eos_token_id=eos_ids,
                          pad_token_id=special_ids[PAD_TOKEN], torch_dtype=dtype, **overrides)
    shapes = mlx_parameter_shapes(config)
    n = config["num_hidden_layers"]
    for k in range(config["num_nextn_predict_layers"]):
        shapes.update(nextn_layer_shapes(config, n + k))
    rng = np.random.default_rng(seed)
    weights = {name: random_tensor(rng, name, shape, zero_centred_norms=False,
                                   weight_scale=0.1).astype(np.float32)
               for name, shape in sorted(shapes.items())}
    save_safetensors(out_dir / "model.safetensors", weights, dtype)
    write_config_files(out_dir, config, eos_ids, special_ids[PAD_TOKEN])
    return out_dir


def nextn_to_sidecar(path: Path) -> Path:
    """Move PATH's NextN layer (model.layers.{N}.*, N the trunk's layer count) from
    model.safetensors into an mtp.safetensors sidecar: mlx-lm reads only model*.safetensors, so
    a deepseek_v3 trunk of any depth then loads as is."""
    import mlx.core as mx

    path = Path(path)
    n = json.loads((path / "config.json").read_text())["num_hidden_layers"]
    weights = mx.load(str(path / "model.safetensors"))
    mx.eval(weights)
    head = {k: v for k, v in weights.items() if k.startswith(f"model.layers.{n}.")}
    mx.save_safetensors(str(path / "model.safetensors"), {k: v for k, v in weights.items() if k not in head},
                        metadata={"format": "pt"})
    mx.save_safetensors(str(path / "mtp.safetensors"), head, metadata={"format": "pt"})
    return path
