"""Tiny random Gemma-4 text targets and their "assistant" drafters, in the Hugging Face layout
and config schema (``gemma4_text`` / ``gemma4_assistant``), built deterministically from a seed
with numpy alone: the same seed gives the same tensors, so the reference logits saved by
``scripts/make_gemma4_reference.py`` (transformers + torch) hold for checkpoints rebuilt here.

The target has kv-shared layers (as E2B/E4B) and per-layer inputs, and its last eligible
sliding and full layers are not its last layers overall, so reading the wrong layer's K/V
shows; the sliding window (8) is shorter than the prompts the tests use.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np

from tiny import (
    EOS_TOKEN,
    PAD_TOKEN,
    TOKENIZER_FILES,
    builtin_corpus,
    save_safetensors,
    tokenizer_info,
    train_tokenizer,
    write_config_files,
    write_minimal_tokenizer,
)

ROPE = {
    "full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1000000.0, "rope_type": "proportional"},
    "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"},
}
# layers 0-2 keep K/V (last sliding: 1, last full: 2); 3 and 4 reuse them
TARGET_LAYERS = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention", "full_attention"]
ASSISTANT_LAYERS = ["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"]


def target_config(vocab_size: int, eos_ids: list[int], pad_id: int, **overrides) -> dict:
    config = {
        "architectures": ["Gemma4ForCausalLM"],
        "model_type": "gemma4_text",
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": len(TARGET_LAYERS),
        "layer_types": list(TARGET_LAYERS),
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "global_head_dim": 32,
        "num_kv_shared_layers": 2,
        "hidden_size_per_layer_input": 8,
        "vocab_size_per_layer_input": vocab_size,
        "use_double_wide_mlp": True,
        "attention_k_eq_v": False,
        "enable_moe_block": False,
        "sliding_window": 8,
        "final_logit_softcapping": 30.0,
        "rms_norm_eps": 1e-6,
        "rope_parameters": copy.deepcopy(ROPE),
        "max_position_embeddings": 4096,
        "hidden_activation": "gelu_pytorch_tanh",
        "tie_word_embeddings": True,
        "attention_bias": False,
        "bos_token_id": None,
        "eos_token_id": eos_ids,
        "pad_token_id": pad_id,
        "torch_dtype": "float32",
    }
    config.update(overrides)
    return config


def assistant_config(target: dict, sparse: bool, **overrides) -> dict:
    text = {
        "model_type": "gemma4_text",
        "vocab_size": target["vocab_size"],
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": len(ASSISTANT_LAYERS),
        "layer_types": list(ASSISTANT_LAYERS),
        "num_attention_heads": 4,
        "num_key_value_heads": target["num_key_value_heads"],
        "head_dim": target["head_dim"],
        "global_head_dim": target["global_head_dim"],
        "num_kv_shared_layers": len(ASSISTANT_LAYERS),
        "hidden_size_per_layer_input": 0,
        "vocab_size_per_layer_input": 0,
        "use_double_wide_mlp": False,
        "enable_moe_block": False,
        "attention_k_eq_v": False,
        "sliding_window": target["sliding_window"],
        "rms_norm_eps": 1e-6,
        "rope_parameters": copy.deepcopy(ROPE),
        "max_position_embeddings": target["max_position_embeddings"],
        "hidden_activation": "gelu_pytorch_tanh",
        "final_logit_softcapping": None,
        "tie_word_embeddings": True,
        "pad_token_id": target["pad_token_id"],
    }
    config = {
        "architectures": ["Gemma4AssistantForCausalLM"],
        "model_type": "gemma4_assistant",
        "backbone_hidden_size": target["hidden_size"],
        "use_ordered_embeddings": sparse,
        "num_centroids": 16 if sparse else 2048,
        "centroid_intermediate_top_k": 4 if sparse else 32,
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
        "text_config": text,
    }
    config.update(overrides)
    return config


def _mlx_shapes(model) -> dict[str, tuple]:
    from mlx.utils import tree_flatten

    return {name: tuple(p.shape) for name, p in tree_flatten(model.parameters())}


def _random(rng: np.random.Generator, name: str, shape: tuple, weight_scale: float) -> np.ndarray:
    leaf = name.rsplit(".", 2)
    if name.endswith("layer_scalar"):
        return 1.0 + 0.1 * rng.standard_normal(shape)
    if len(shape) == 1 and "norm" in leaf[-2]:
        return 1.0 + 0.1 * rng.standard_normal(shape)
    if "embed_tokens" in name:
        return weight_scale * rng.standard_normal(shape)
    return rng.standard_normal(shape) / np.sqrt(shape[-1])


def random_weights(shapes: dict[str, tuple], seed: int, weight_scale: float) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {n: _random(rng, n, s, weight_scale).astype(np.float32) for n, s in sorted(shapes.items())}


def _tokenizer(out_dir: Path, vocab_size: int | None, tokenizer) -> tuple[int, list[int], int]:
    if tokenizer is not None:
        for name in TOKENIZER_FILES:
            (out_dir / name).write_bytes((Path(tokenizer) / name).read_bytes())
    elif vocab_size < 300:
        write_minimal_tokenizer(out_dir, vocab_size)
    else:
        train_tokenizer(builtin_corpus(), vocab_size, out_dir)
    n, special = tokenizer_info(out_dir)
    return n, [special[EOS_TOKEN], special[PAD_TOKEN]], special[PAD_TOKEN]


def write_target(out_dir, *, vocab_size: int | None = None, tokenizer=None, seed: int = 0,
                 weight_scale: float | None = None, multimodal: bool = False, **overrides) -> Path:
    """A gemma4_text checkpoint loadable by mlx-lm and transformers; ``multimodal``: laid out
    as the published ``gemma4`` checkpoints are (Gemma4ForConditionalGeneration, the text model
    under ``model.language_model``, no vision tower)."""
    from mlx_lm.models import gemma4_text

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    n, eos_ids, pad_id = _tokenizer(out_dir, vocab_size, tokenizer)
    config = target_config(n, eos_ids, pad_id, **overrides)
    model = gemma4_text.Model(gemma4_text.ModelArgs.from_dict(copy.deepcopy(config)))
    scale = weight_scale if weight_scale is not None else (0.1 if n < 300 else 0.25)
    weights = random_weights(_mlx_shapes(model), seed, scale)
    if multimodal:
        weights = {"model.language_model." + k.removeprefix("model."): v for k, v in weights.items()}
        config = {"architectures": ["Gemma4ForConditionalGeneration"], "model_type": "gemma4",
                  "vocab_size": n, "text_config": config, "eos_token_id": eos_ids, "pad_token_id": pad_id,
                  "tie_word_embeddings": True, "torch_dtype": "float32"}
    save_safetensors(out_dir / "model.safetensors", weights)
    write_config_files(out_dir, config, eos_ids, pad_id)
    return out_dir


def make_copying(weights: dict[str, np.ndarray], target_dir, seed: int) -> None:
    """Turn random assistant WEIGHTS into one that mostly proposes the token it is fed (tiny
    random targets mostly repeat tokens, so its drafts are often, not always, accepted): its
    layers' outputs scaled down (the target's K/V still move the logits a little), the input
    projection reading the target's embedding through a random map M, the tied table the
    targets' embeddings through the same map, normalised."""
    import mlx.core as mx

    target = np.array(mx.load(str(Path(target_dir) / "model.safetensors"))["model.embed_tokens.weight"],
                      dtype=np.float32)
    hidden, backbone2 = weights["pre_projection.weight"].shape
    rng = np.random.default_rng(seed + 2000)
    m = rng.standard_normal((hidden, backbone2 // 2)).astype(np.float32)
    proj = np.zeros((hidden, backbone2), np.float32)
    proj[:, : backbone2 // 2] = m
    weights["pre_projection.weight"] = proj
    mapped = target @ m.T
    weights["model.embed_tokens.weight"] = mapped / np.linalg.norm(mapped, axis=1, keepdims=True)
    for name in weights:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            weights[name] *= 0.05


def write_assistant(out_dir, target_dir, *, sparse: bool = False, seed: int = 1,
                    weight_scale: float | None = None, copying: bool = False, **overrides) -> Path:
    """A gemma4_assistant checkpoint for the target in TARGET_DIR (its tokenizer copied);
    ``copying``: one that drafts well enough to get partial accepts (see make_copying)."""
    from mlxspec.models.gemma4_assistant import Gemma4Assistant

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    target = json.loads((Path(target_dir) / "config.json").read_text())
    for name in TOKENIZER_FILES:
        (out_dir / name).write_bytes((Path(target_dir) / name).read_bytes())
    config = assistant_config(target, sparse, **overrides)
    shapes = {k: v for k, v in _mlx_shapes(Gemma4Assistant(copy.deepcopy(config))).items()
              if not k.endswith("token_ordering")}
    n = target["vocab_size"]
    scale = weight_scale if weight_scale is not None else (0.1 if n < 300 else 0.25)
    weights = random_weights(shapes, seed, scale)
    if copying:
        make_copying(weights, target_dir, seed)
    if sparse:
        save_safetensors(out_dir / "model.safetensors", weights)
        import mlx.core as mx

        arrays = dict(mx.load(str(out_dir / "model.safetensors")))
        order = np.random.default_rng(seed + 1000).permutation(n).astype(np.int64)
        arrays["masked_embedding.token_ordering"] = mx.array(order)
        mx.save_safetensors(str(out_dir / "model.safetensors"), arrays, metadata={"format": "pt"})
    else:
        save_safetensors(out_dir / "model.safetensors", weights)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    return out_dir


# ---------------------------------------------------------------------------
# The reference pair: scripts/make_gemma4_reference.py saved transformers' outputs on these

REFERENCE_FILE = Path(__file__).parent / "data" / "gemma4_assistant_reference.npz"
REFERENCE_VOCAB = 512
TARGET_SEED, DENSE_SEED, SPARSE_SEED = 11, 12, 13
PROMPT_SEED, PROMPT_LEN, BLOCK = 7, 21, 5


def reference_prompt() -> list[int]:
    return [int(t) for t in np.random.default_rng(PROMPT_SEED).integers(3, REFERENCE_VOCAB, PROMPT_LEN)]


def build_reference(folder, tokenizer) -> dict[str, Path]:
    """The target and its dense and sparse-head assistants (TOKENIZER: any 512-token one)."""
    folder = Path(folder)
    target = write_target(folder / "target", tokenizer=tokenizer, seed=TARGET_SEED)
    return {
        "target": target,
        "dense": write_assistant(folder / "dense", target, sparse=False, seed=DENSE_SEED),
        "sparse": write_assistant(folder / "sparse", target, sparse=True, seed=SPARSE_SEED),
    }
