"""Write GGUF files from tiny random checkpoints, the way llama.cpp's convert_hf_to_gguf does.

Independent of mlxspec's reader: tensor names come from the ``gguf`` package's own name map,
metadata from its writer's ``add_*`` methods, Llama Q/K rows are permuted with llama.cpp's
formula and Gemma norms stored as ``1 + w`` (llama.cpp's convention).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

ARCH_OF = {"llama": "LLAMA", "qwen2": "QWEN2", "qwen3": "QWEN3", "gemma": "GEMMA", "gemma2": "GEMMA2",
           "gemma3_text": "GEMMA3"}


def model_config(model_type: str, vocab_size: int, hidden: int = 64, intermediate: int = 128) -> dict:
    heads, kv = 4, 2
    config = {"model_type": model_type, "hidden_size": hidden, "intermediate_size": intermediate,
              "num_hidden_layers": 2, "num_attention_heads": heads, "num_key_value_heads": kv,
              "head_dim": hidden // heads, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
              "vocab_size": vocab_size, "max_position_embeddings": 2048,
              "tie_word_embeddings": model_type != "llama"}
    if model_type == "gemma2":
        config.update(attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                      query_pre_attn_scalar=hidden // heads)
    if model_type == "gemma3_text":  # llama.cpp's fixed Gemma 3 values, and a window the prompt fits
        config.update(query_pre_attn_scalar=hidden // heads, sliding_window=512, sliding_window_pattern=6,
                      rope_local_base_freq=10000.0, num_hidden_layers=6)  # mlx-lm needs a whole pattern
    return config


def random_checkpoint(out: Path, config: dict, tokenizer_dir: Path, seed: int = 0) -> Path:
    """An HF-layout checkpoint (config, float32 safetensors, tokenizer files) with random weights."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from mlxspec.compat import model_classes

    model_cls, args_cls = model_classes(config)
    model = model_cls(args_cls.from_dict(config))
    rng = np.random.default_rng(seed)
    gemma = config["model_type"].startswith("gemma")
    weights = {}
    for name, value in tree_flatten(model.parameters()):
        shape = tuple(value.shape)
        if "norm" in name:
            w = 0.1 * rng.standard_normal(shape) + (0.0 if gemma else 1.0)
        elif name.endswith(".bias"):
            w = 0.1 * rng.standard_normal(shape)
        elif "embed_tokens" in name or name.startswith("lm_head"):
            w = 0.5 * rng.standard_normal(shape)
        else:
            w = rng.standard_normal(shape) / np.sqrt(shape[-1])
        weights[name] = mx.array(w.astype(np.float32))
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (out / name).write_bytes((tokenizer_dir / name).read_bytes())
    return out


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.LlamaModel.permute."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(checkpoint: Path, out_file: Path, qtype: str = "F32", chat_template: str | None = None) -> dict:
    """CHECKPOINT (float32, from random_checkpoint) as a GGUF file with 2-D weights in QTYPE
    (F32, F16, Q8_0, Q4_0, Q4_1). Returns {hf name: the weight as the file holds it, decoded
    with gguf's reference decoder}: what a faithful reader must reproduce."""
    import gguf
    import mlx.core as mx
    from gguf.quants import dequantize, quantize

    config = json.loads((checkpoint / "config.json").read_text())
    arch = ARCH_OF[config["model_type"]]
    names = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, arch), config["num_hidden_layers"])
    writer = gguf.GGUFWriter(str(out_file), gguf.MODEL_ARCH_NAMES[getattr(gguf.MODEL_ARCH, arch)])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(config["rope_theta"])
    if "sliding_window" in config:
        writer.add_sliding_window(config["sliding_window"])
    if "attn_logit_softcapping" in config:
        writer.add_attn_logit_softcapping(config["attn_logit_softcapping"])
        writer.add_final_logit_softcapping(config["final_logit_softcapping"])
    _write_tokenizer(writer, checkpoint, chat_template)

    decoded = {}
    weights = {k: np.array(v) for k, v in mx.load(str(checkpoint / "model.safetensors")).items()}
    for name, w in sorted(weights.items()):
        stem, _, suffix = name.rpartition(".")
        target = "output" if stem == "lm_head" else names.get_name(stem)
        assert target is not None, name
        hf = w  # quantization works row by row, so it commutes with the row permutation below
        if config["model_type"] == "llama" and stem.endswith(("q_proj", "k_proj")):
            heads = config["num_attention_heads" if stem.endswith("q_proj") else "num_key_value_heads"]
            w = llama_cpp_permute(w, heads)
        if config["model_type"].startswith("gemma") and name.endswith("norm.weight"):
            w = w + 1
        kind = qtype if w.ndim == 2 else "F32"
        if kind == "F32":
            writer.add_tensor(f"{target}.{suffix}", w.astype(np.float32))
            stored = hf.astype(np.float32)
        elif kind == "F16":
            writer.add_tensor(f"{target}.{suffix}", w.astype(np.float16))
            stored = hf.astype(np.float16).astype(np.float32)
        else:
            q_type = gguf.GGMLQuantizationType[kind]
            writer.add_tensor(f"{target}.{suffix}", quantize(w.astype(np.float32), q_type), raw_dtype=q_type)
            stored = dequantize(quantize(hf.astype(np.float32), q_type), q_type).reshape(w.shape)
        decoded[name] = stored
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return decoded


def _write_tokenizer(writer, checkpoint: Path, chat_template: str | None) -> None:
    data = json.loads((checkpoint / "tokenizer.json").read_text())
    vocab = dict(data["model"]["vocab"])
    special = {t["content"]: t["id"] for t in data["added_tokens"]}
    vocab.update(special)
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in special else 1 for t in tokens])
    writer.add_token_merges(merges)
    cfg = json.loads((checkpoint / "tokenizer_config.json").read_text())
    writer.add_eos_token_id(vocab[cfg["eos_token"]])
    writer.add_add_bos_token(False)
    writer.add_chat_template(chat_template or cfg["chat_template"])
