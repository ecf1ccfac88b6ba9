"""Gemma-4 shapes for the real-shape benchmark: the text configs of Gemma-4 31B and 26B-A4B and
of their assistants, as public sources state them (``gemma4_configs/``, where SOURCES.md names
each source), and tiny shapes of the same layouts for CPU tests (``smoke-gemma4`` as the
31B, ``smoke-gemma4-moe`` with the 26B-A4B's MoE block; MLX's CPU has no unquantized bf16 MoE
matmul, so only the dense one runs at ``--bits 0`` there).

Targets are built text-only (``gemma4_text``): the bench times the text model, and the vision
tower of the multimodal checkpoints is not on the decode path.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

CONFIGS = Path(__file__).parent / "gemma4_configs"
# shape name -> the checkpoint whose config it is (None: a tiny CPU shape below)
GEMMA4 = {"gemma-4-31b": "gemma-4-31B-it", "gemma-4-26b-a4b": "gemma-4-26B-A4B-it", "smoke-gemma4": None,
          "smoke-gemma4-moe": None}

_ROPE = {"full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1000000.0, "rope_type": "proportional"},
         "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"}}
# The 31B layout shrunk: 5 sliding layers then a full one, K = V and fewer KV heads on the full
# layer; the window shorter than a test's prompt. The MoE variant adds the 26B-A4B's experts.
_SMOKE_TARGET = {
    "model_type": "gemma4_text", "hidden_size": 128, "intermediate_size": 128, "num_hidden_layers": 6,
    "layer_types": ["sliding_attention"] * 5 + ["full_attention"], "num_attention_heads": 4,
    "num_key_value_heads": 2, "num_global_key_value_heads": 1, "head_dim": 64, "global_head_dim": 128,
    "attention_k_eq_v": True, "sliding_window": 16, "final_logit_softcapping": 30.0,
    "hidden_size_per_layer_input": 0, "num_kv_shared_layers": 0, "use_double_wide_mlp": False,
    "enable_moe_block": False, "vocab_size": 1024, "vocab_size_per_layer_input": 1024, "rms_norm_eps": 1e-06,
    "max_position_embeddings": 4096, "rope_parameters": _ROPE, "tie_word_embeddings": True,
}
_SMOKE_MOE = {**_SMOKE_TARGET, "enable_moe_block": True, "num_experts": 8, "top_k_experts": 2,
               "moe_intermediate_size": 64}
_SMOKE_ASSISTANT = {
    "model_type": "gemma4_assistant", "backbone_hidden_size": 128, "use_ordered_embeddings": False,
    "num_centroids": 2048, "centroid_intermediate_top_k": 32, "tie_word_embeddings": True,
    "text_config": {
        "model_type": "gemma4_text", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
        "layer_types": ["sliding_attention"] * 3 + ["full_attention"], "num_attention_heads": 4,
        "num_key_value_heads": 2, "num_global_key_value_heads": 1, "head_dim": 64, "global_head_dim": 128,
        "attention_k_eq_v": True, "num_kv_shared_layers": 4, "hidden_size_per_layer_input": 0,
        "vocab_size_per_layer_input": 0, "use_double_wide_mlp": False, "enable_moe_block": False,
        "sliding_window": 16, "final_logit_softcapping": None, "rms_norm_eps": 1e-06,
        "max_position_embeddings": 4096, "rope_parameters": _ROPE, "tie_word_embeddings": True,
        "vocab_size": 1024,
    },
}


def _read(name: str) -> dict:
    return json.loads((CONFIGS / f"{name}.json").read_text(encoding="utf-8"))


def target_config(shape: str, vocab: int | None = None) -> dict:
    """The ``gemma4_text`` config of a Gemma-4 shape (``vocab`` overrides its vocabulary)."""
    name = GEMMA4[shape]
    smoke = _SMOKE_MOE if shape == "smoke-gemma4-moe" else _SMOKE_TARGET
    text = copy.deepcopy(smoke if name is None else _read(name)["text_config"])
    if vocab:
        text["vocab_size"] = text["vocab_size_per_layer_input"] = vocab
    return text


def assistant_config(shape: str) -> dict:
    """The ``gemma4_assistant`` config of a Gemma-4 shape's assistant."""
    name = GEMMA4[shape]
    return copy.deepcopy(_SMOKE_ASSISTANT if name is None else _read(f"{name}-assistant"))
