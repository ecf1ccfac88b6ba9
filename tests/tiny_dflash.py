"""Tiny DFlash drafter checkpoints in the published z-lab layout (config.json with block_size,
dflash_config.{target_layer_ids, mask_token_id}, num_target_layers; tensors fc, hidden_norm,
layers.*, norm; no embedding or LM head), shrunk sizes, random weights, built offline.

The config keys are those of SpecForge's ``qwen3-32b-dflash.json`` (shared/reference/models/
drafters.md); the sizes follow the target they are made for.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

import tiny


def target_text_config(target_dir) -> dict:
    cfg = json.loads((Path(target_dir) / "config.json").read_text())
    return cfg.get("text_config", cfg)


def dflash_config(target: dict, *, layers: int = 2, block_size: int = 8, mask_token_id: int | None = None,
                  target_layer_ids: list[int] | None = None) -> dict:
    """A config.json for a drafter of TARGET (its text config), as published drafters write it."""
    n = target["num_hidden_layers"]
    heads = target["num_attention_heads"]
    hidden = target["hidden_size"]
    ids = target_layer_ids
    if ids is None:
        ids = sorted({min(n - 1, 1 + i) for i in range(min(layers, n))})
    return {
        "architectures": ["DFlashDraftModel"],
        "block_size": block_size,
        "dflash_config": {"mask_token_id": mask_token_id if mask_token_id is not None else target["vocab_size"] - 1,
                          "target_layer_ids": ids},
        "head_dim": target.get("head_dim", hidden // heads),
        "hidden_size": hidden,
        "intermediate_size": target["intermediate_size"],
        "layer_types": ["full_attention"] * layers,
        "max_position_embeddings": 4096,
        "model_type": "qwen3",
        "num_attention_heads": heads,
        "num_key_value_heads": target["num_key_value_heads"],
        "num_hidden_layers": layers,
        "num_target_layers": n,
        "rms_norm_eps": 1e-06,
        "rope_theta": target.get("rope_theta", 10000.0),
        "tie_word_embeddings": False,
        "vocab_size": target["vocab_size"],
        "torch_dtype": "float32",
    }


def dflash_shapes(cfg: dict) -> dict[str, tuple]:
    H, hd, inter = cfg["hidden_size"], cfg["head_dim"], cfg["intermediate_size"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    shapes = {"fc.weight": (H, len(cfg["dflash_config"]["target_layer_ids"]) * H),
              "hidden_norm.weight": (H,), "norm.weight": (H,)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
            p + "self_attn.q_proj.weight": (nh * hd, H), p + "self_attn.k_proj.weight": (nkv * hd, H),
            p + "self_attn.v_proj.weight": (nkv * hd, H), p + "self_attn.o_proj.weight": (H, nh * hd),
            p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
            p + "mlp.gate_proj.weight": (inter, H), p + "mlp.up_proj.weight": (inter, H),
            p + "mlp.down_proj.weight": (H, inter),
        })
    return shapes


def write_dflash_checkpoint(out_dir, target_dir, *, seed: int = 0, dtype: str = "float32",
                            weight_scale: float = 0.25, **config_overrides) -> Path:
    """A random DFlash drafter for the checkpoint in TARGET_DIR, in OUT_DIR."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg = dflash_config(target_text_config(target_dir), **config_overrides)
    cfg["torch_dtype"] = dtype
    rng = np.random.default_rng(seed)
    weights = {}
    for name, shape in dflash_shapes(cfg).items():
        if len(shape) == 1:
            weights[name] = np.ones(shape, np.float32)
        else:
            weights[name] = (rng.standard_normal(shape) * weight_scale / np.sqrt(shape[1])).astype(np.float32) * 4
    tiny.save_safetensors(out_dir / "model.safetensors", weights, dtype)
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2))
    return out_dir
