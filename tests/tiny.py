"""Tiny random-weight checkpoints in real Hugging Face layouts, built offline.

Tests need models that go through exactly the same loading path as real ones
(``mlx_lm.load(path)``: config.json, model.safetensors with HF tensor names,
tokenizer.json + tokenizer_config.json) but run in ~1 ms per forward on a CPU.
Everything here is deterministic and needs no network.
"""

from __future__ import annotations

import copy
import inspect
import json
from pathlib import Path
from typing import Iterable

import numpy as np

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"

# ChatML in the style of Qwen3's template, without tools or thinking blocks.
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)

# Qwen2/Qwen3 pre-tokenizer regex. Using it (with NFC + ByteLevel) makes our
# tokenizer.json identical in structure to Qwen's, so transformers'
# Qwen2Tokenizer class and the raw tokenizers pipeline encode alike.
QWEN_SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

ENGLISH_TEXT = """\
Speculative decoding lets a small, fast model guess several tokens ahead while a
large model checks all of the guesses in a single forward pass. When the guesses
are right, the large model accepts them and the text appears faster; when they are
wrong, the large model keeps its own choice, so the output is exactly what it would
have written alone. The idea is simple, but the details matter: caches must be
rolled back, sampling must follow the rejection rule, and the tokenizer of the
draft must match the tokenizer of the target.
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins
with a single step. Write a function that adds two numbers and returns the result.
Please explain what this code does, then suggest how to make it faster and clearer.
Hello! How are you today? I am fine, thank you. What is the capital of France?
Paris is the capital of France, and Berlin is the capital of Germany.
"""

# Stdlib modules whose source makes the Python half of the built-in corpus. They
# exist on every Python install, so the corpus needs no download.
CORPUS_MODULES = ("textwrap", "string", "bisect", "heapq", "fnmatch", "shlex", "colorsys")


def builtin_corpus() -> list[str]:
    """English text plus a few stdlib source files (a few tens of KB)."""
    import importlib

    texts = [ENGLISH_TEXT]
    for name in CORPUS_MODULES:
        module = importlib.import_module(name)
        texts.append(Path(inspect.getsourcefile(module)).read_text(encoding="utf-8"))
    return texts


# ---------------------------------------------------------------------------
# Tokenizers


def _write_tokenizer_configs(out_dir: Path, tokenizer_class: str, special_ids: dict) -> None:
    """tokenizer_config.json + special_tokens_map.json in the Qwen layout."""
    added = {
        str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                 "single_word": False, "special": True}
        for t, i in special_ids.items()
    }
    config = {
        "tokenizer_class": tokenizer_class,
        "added_tokens_decoder": added,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "errors": "replace",
        "model_max_length": 32768,
        "split_special_tokens": False,
        "chat_template": CHATML_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    special_map = {
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
    }
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2))


def train_tokenizer(texts: Iterable[str], vocab_size: int, out_dir) -> Path:
    """Train a byte-level BPE tokenizer (Qwen-style pipeline) and write its files."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(list(texts), trainer)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    special_ids = {t: tokenizer.token_to_id(t) for t in SPECIAL_TOKENS}
    _write_tokenizer_configs(out_dir, "Qwen2Tokenizer", special_ids)
    return out_dir


def write_minimal_tokenizer(out_dir, vocab_size: int) -> Path:
    """A character tokenizer with exactly VOCAB_SIZE tokens: the 3 specials + letters.

    For statistical tests, where a vocabulary of ~8 makes every token's
    probability measurable. Characters outside the alphabet are dropped.
    """
    from tokenizers import Tokenizer, decoders, models

    n_letters = vocab_size - len(SPECIAL_TOKENS)
    alphabet = "abcdefghijklmnopqrstuvwxyz0123456789"
    if not 1 <= n_letters <= len(alphabet):
        raise ValueError(f"minimal tokenizer needs 4..{len(alphabet) + 3} tokens, got {vocab_size}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS + tuple(alphabet[:n_letters]))}
    # BPE without merges or unk token: splits into known characters, drops the rest.
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    tokenizer.decoder = decoders.Fuse()
    tokenizer.save(str(out_dir / "tokenizer.json"))
    _write_tokenizer_configs(out_dir, "PreTrainedTokenizerFast", {t: vocab[t] for t in SPECIAL_TOKENS})
    return out_dir


def tokenizer_info(tokenizer_dir) -> tuple[int, dict]:
    """(vocab size, {special token: id}) of a tokenizer directory."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json"))
    return tokenizer.get_vocab_size(), {t: tokenizer.token_to_id(t) for t in SPECIAL_TOKENS}


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")

# ---------------------------------------------------------------------------
# Configs

ARCHS = ("llama", "qwen3", "llama_swa", "qwen3_5", "qwen3_5_moe")

DEFAULT_SIZES = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
}


def make_config(arch: str, vocab_size: int, eos_ids: list[int], pad_id: int, **overrides) -> dict:
    """config.json contents for ARCH in the real HF schema, tiny sizes."""
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; expected one of {ARCHS}")
    if arch == "qwen3_5":
        return _qwen3_5_config(vocab_size, eos_ids, pad_id, **overrides)
    if arch == "qwen3_5_moe":
        return _qwen3_5_moe_config(vocab_size, eos_ids, pad_id, **overrides)
    sizes = {**DEFAULT_SIZES, **overrides}
    common = {
        **sizes,
        "vocab_size": vocab_size,
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "bos_token_id": None,
        "eos_token_id": eos_ids,
        "pad_token_id": pad_id,
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": "float32",
    }
    if arch == "qwen3":
        return {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
                "tie_word_embeddings": sizes.get("tie_word_embeddings", True),
                "attention_dropout": 0.0, **common}
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
              "tie_word_embeddings": False, "mlp_bias": False, "pretraining_tp": 1, **common}
    if arch == "llama_swa":
        # Alternate sliding/full layers; a window of 8 makes mlx-lm's
        # RotatingKVCache wrap within a few dozen generated tokens.
        n = config["num_hidden_layers"]
        config.setdefault("sliding_window", 8)
        config["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention"
                                 for i in range(n)]
    return config


def _qwen3_5_config(vocab_size: int, eos_ids: list[int], pad_id: int, **overrides) -> dict:
    """Qwen3.5 hybrid (GatedDeltaNet + gated attention) text config, wrapped like
    Qwen3_5ForConditionalGeneration (the vision tower is left out)."""
    text = {
        "attention_bias": False, "attention_dropout": 0.0, "attn_output_gate": True,
        "dtype": "float32", "eos_token_id": eos_ids[-1], "pad_token_id": pad_id,
        "full_attention_interval": 2, "num_hidden_layers": 4,
        "hidden_act": "silu", "hidden_size": 64, "intermediate_size": 128,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32,
        "linear_conv_kernel_dim": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4,
        "initializer_range": 0.02, "max_position_embeddings": 4096, "mlp_only_layers": [],
        "model_type": "qwen3_5_text", "mtp_num_hidden_layers": 1,
        "mtp_use_dedicated_embeddings": False, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False, "use_cache": True, "vocab_size": vocab_size,
        "mamba_ssm_dtype": "float32",
        "rope_parameters": {
            "mrope_interleaved": True,
            # sums to the rotary half-width: head_dim 32 * 0.25 / 2 = 4
            "mrope_section": [2, 1, 1],
            "rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
        },
    }
    text.update(overrides)
    interval = text["full_attention_interval"]
    text["layer_types"] = [
        "full_attention" if (i + 1) % interval == 0 else "linear_attention"
        for i in range(text["num_hidden_layers"])
    ]
    return {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "text_config": text,
        "tie_word_embeddings": text["tie_word_embeddings"],
        "transformers_version": "4.57.0.dev0",
    }


def _qwen3_5_moe_config(vocab_size: int, eos_ids: list[int], pad_id: int, **overrides) -> dict:
    """Qwen3.5-35B-A3B's config shrunk: every layer MoE (routed experts + a gated shared expert)."""
    moe = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
           "shared_expert_intermediate_size": 32, "router_aux_loss_coef": 0.001}
    config = _qwen3_5_config(vocab_size, eos_ids, pad_id, **{**moe, **overrides})
    config["text_config"].pop("intermediate_size", None)  # as in the real MoE config
    config["text_config"]["model_type"] = "qwen3_5_moe_text"
    config["model_type"] = "qwen3_5_moe"
    config["architectures"] = ["Qwen3_5MoeForConditionalGeneration"]
    return config


# ---------------------------------------------------------------------------
# Weights


def mlx_parameter_shapes(config: dict) -> dict[str, tuple]:
    """Parameter names and shapes of the mlx-lm model built from CONFIG."""
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes

    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(copy.deepcopy(config)))
    return {name: tuple(p.shape) for name, p in tree_flatten(model.parameters())}


def hf_name_and_shape(arch: str, name: str, shape: tuple) -> tuple[str, tuple]:
    """Undo mlx-lm's sanitize: mlx parameter name/shape -> HF checkpoint name/shape."""
    if not arch.startswith("qwen3_5"):
        return name, shape
    if name.startswith("language_model.model."):
        name = "model.language_model." + name[len("language_model.model."):]
    elif name.startswith("language_model."):
        name = name[len("language_model."):]
    if name.endswith("conv1d.weight"):
        shape = (shape[0], shape[2], shape[1])  # mlx (C, K, 1) -> torch (C, 1, K)
    return name, shape


def qwen3_5_mtp_shapes(text_config: dict) -> dict[str, tuple]:
    """The `mtp.*` tensors of a dense Qwen3.5 checkpoint (see mtp_tensors.md)."""
    h = text_config["hidden_size"]
    d = text_config["head_dim"]
    n_q = text_config["num_attention_heads"]
    n_kv = text_config["num_key_value_heads"]
    inter = text_config.get("intermediate_size")
    shapes = {
        "mtp.fc.weight": (h, 2 * h),
        "mtp.norm.weight": (h,),
        "mtp.pre_fc_norm_embedding.weight": (h,),
        "mtp.pre_fc_norm_hidden.weight": (h,),
    }
    for i in range(text_config["mtp_num_hidden_layers"]):
        p = f"mtp.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (2 * n_q * d, h),  # query + output gate
            p + "self_attn.k_proj.weight": (n_kv * d, h),
            p + "self_attn.v_proj.weight": (n_kv * d, h),
            p + "self_attn.o_proj.weight": (h, n_q * d),
            p + "self_attn.q_norm.weight": (d,),
            p + "self_attn.k_norm.weight": (d,),
        })
        if text_config.get("num_experts", 0) > 0:
            shapes.update(_qwen3_5_moe_mlp_shapes(p + "mlp.", text_config))
        else:
            shapes.update({
                p + "mlp.gate_proj.weight": (inter, h),
                p + "mlp.up_proj.weight": (inter, h),
                p + "mlp.down_proj.weight": (h, inter),
            })
    return shapes


def _qwen3_5_moe_mlp_shapes(prefix: str, text_config: dict) -> dict[str, tuple]:
    """A Qwen3.5-MoE sparse block in HF layout: fused 3-D experts (gate then up along dim -2)."""
    h = text_config["hidden_size"]
    e = text_config["num_experts"]
    i = text_config["moe_intermediate_size"]
    s = text_config["shared_expert_intermediate_size"]
    return {
        prefix + "gate.weight": (e, h),
        prefix + "experts.gate_up_proj": (e, 2 * i, h),
        prefix + "experts.down_proj": (e, h, i),
        prefix + "shared_expert.gate_proj.weight": (s, h),
        prefix + "shared_expert.up_proj.weight": (s, h),
        prefix + "shared_expert.down_proj.weight": (h, s),
        prefix + "shared_expert_gate.weight": (1, h),
    }


def _fuse_switch_mlp_shapes(shapes: dict[str, tuple]) -> dict[str, tuple]:
    """Undo mlx-lm's qwen3_5_moe sanitize: switch_mlp.{gate,up,down}_proj -> experts.{gate_up,down}_proj."""
    out = {}
    for name, shape in shapes.items():
        if ".switch_mlp." not in name:
            out[name] = shape
        elif name.endswith("switch_mlp.gate_proj.weight"):
            out[name.replace("switch_mlp.gate_proj.weight", "experts.gate_up_proj")] = (
                shape[0], 2 * shape[1], shape[2])
        elif name.endswith("switch_mlp.down_proj.weight"):
            out[name.replace("switch_mlp.down_proj.weight", "experts.down_proj")] = shape
    return out


def random_tensor(rng: np.random.Generator, name: str, shape: tuple, *,
                  zero_centred_norms: bool, weight_scale: float) -> np.ndarray:
    """Random values of the kind each tensor holds in a trained model.

    Embeddings and the LM head get WEIGHT_SCALE so logits have a spread of about
    WEIGHT_SCALE * sqrt(hidden): large enough that greedy picks are never near ties.
    """
    if name.endswith("A_log"):
        return np.log(rng.uniform(1.0, 16.0, shape))
    if name.endswith("dt_bias"):
        return 1.0 + 0.1 * rng.standard_normal(shape)
    if name.endswith(".bias"):
        return np.zeros(shape)
    if "norm" in name.rsplit(".", 2)[-2] and len(shape) == 1:
        # Qwen3.5 stores RMSNorm weights as offsets from 1, except the gated
        # linear-attention norm, which is a plain scale.
        offset = 0.0 if zero_centred_norms and "linear_attn.norm" not in name else 1.0
        return offset + 0.1 * rng.standard_normal(shape)
    if "embed_tokens" in name or name.startswith("lm_head"):
        return weight_scale * rng.standard_normal(shape)
    if name.endswith("conv1d.weight"):
        return rng.standard_normal(shape) / np.sqrt(shape[-1])
    return rng.standard_normal(shape) / np.sqrt(shape[-1])  # unit-gain projection


def random_hf_weights(config: dict, arch: str, seed: int, weight_scale: float) -> dict[str, np.ndarray]:
    """All tensors of the HF checkpoint for CONFIG, random, keyed by HF names."""
    shapes = dict(hf_name_and_shape(arch, n, s) for n, s in mlx_parameter_shapes(config).items())
    if arch == "qwen3_5_moe":
        shapes = _fuse_switch_mlp_shapes(shapes)
    if arch.startswith("qwen3_5"):
        shapes.update(qwen3_5_mtp_shapes(config["text_config"]))
    rng = np.random.default_rng(seed)
    return {
        name: random_tensor(rng, name, shape, zero_centred_norms=arch.startswith("qwen3_5"),
                            weight_scale=weight_scale).astype(np.float32)
        for name, shape in sorted(shapes.items())
    }


def save_safetensors(path, weights: dict[str, np.ndarray], dtype: str = "float32") -> None:
    """Write WEIGHTS in DTYPE (float32, float16 or bfloat16) as a HF safetensors file."""
    import mlx.core as mx

    target = getattr(mx, dtype)
    arrays = {k: mx.array(v).astype(target) for k, v in weights.items()}
    mx.save_safetensors(str(path), arrays, metadata={"format": "pt"})


# ---------------------------------------------------------------------------
# Checkpoints


def write_config_files(out_dir: Path, config: dict, eos_ids: list[int], pad_id: int) -> None:
    """config.json + generation_config.json (which carries the full eos list, as Qwen's does)."""
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    generation = {"eos_token_id": eos_ids, "pad_token_id": pad_id, "do_sample": False}
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2))


def write_checkpoint(out_dir, arch: str, *, vocab_size: int | None = None, seed: int = 0,
                     dtype: str = "float32", tokenizer=None, weight_scale: float | None = None,
                     **overrides) -> Path:
    """Write a random-weight ARCH checkpoint loadable by ``mlx_lm.load(out_dir)``.

    TOKENIZER is a directory written by train_tokenizer / write_minimal_tokenizer
    (its files are copied); when None one is made: a character tokenizer with
    exactly VOCAB_SIZE tokens if VOCAB_SIZE < 300, else BPE trained on the
    built-in corpus. The model's vocab is the tokenizer's size. OVERRIDES change
    config fields (hidden_size, num_hidden_layers, sliding_window, ...).
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if tokenizer is None:
        if vocab_size is None:
            raise ValueError("pass vocab_size or a tokenizer directory")
        if vocab_size < 300:
            write_minimal_tokenizer(out_dir, vocab_size)
        else:
            train_tokenizer(builtin_corpus(), vocab_size, out_dir)
    else:
        for name in TOKENIZER_FILES:
            (out_dir / name).write_bytes((Path(tokenizer) / name).read_bytes())
    n_tokens, special_ids = tokenizer_info(out_dir)
    if vocab_size is not None and vocab_size != n_tokens:
        raise ValueError(f"vocab_size {vocab_size} != tokenizer size {n_tokens}")
    if weight_scale is None:
        # Tiny vocabularies are for sampling statistics: keep distributions broad.
        weight_scale = 0.1 if n_tokens < 300 else 0.25
    eos_ids = [special_ids[EOS_TOKEN], special_ids[PAD_TOKEN]]
    pad_id = special_ids[PAD_TOKEN]
    config = make_config(arch, n_tokens, eos_ids, pad_id, **overrides)
    if arch.startswith("qwen3_5"):
        config["text_config"]["dtype"] = dtype
    else:
        config["torch_dtype"] = dtype
    weights = random_hf_weights(config, arch, seed, weight_scale)
    save_safetensors(out_dir / "model.safetensors", weights, dtype)
    write_config_files(out_dir, config, eos_ids, pad_id)
    return out_dir


# ---------------------------------------------------------------------------


def with_special_tokens(shared_tokenizer, folder, tokens) -> Path:
    """FOLDER: the shared tokenizer's files plus TOKENS as special added tokens (in
    tokenizer.json's added tokens and tokenizer_config's added_tokens_decoder, as Qwen's files
    have its FIM tokens)."""
    import shutil

    from tokenizers import Tokenizer

    folder = Path(folder)
    for name in TOKENIZER_FILES:
        shutil.copy(Path(shared_tokenizer) / name, folder / name)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.add_special_tokens(list(tokens))
    tok.save(str(folder / "tokenizer.json"))
    config = json.loads((folder / "tokenizer_config.json").read_text())
    for t in tokens:
        config["added_tokens_decoder"][str(tok.token_to_id(t))] = {
            "content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
            "special": True}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return folder
