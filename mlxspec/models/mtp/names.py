"""Which checkpoints carry a native MTP / NextN head, and how its tensors are named.

Two families:

* ``qwen3_5`` — Qwen3.5 / Qwen3.6 dense (``qwen3_5``), MoE (``qwen3_5_moe``) and Qwen3-Next
  (``qwen3_next``): a top-level ``mtp.*`` namespace (also seen as ``model.mtp.``,
  ``language_model.mtp.``, ``model.language_model.mtp.``, ``language_model.model.mtp.``), all
  normalised to ``mtp.``.
* ``nextn`` — DeepSeek-V3 (``deepseek_v3``) and GLM-4.5/4.7 (``glm4_moe``): extra decoder layers
  appended at ``model.layers.{num_hidden_layers + i}.``, normalised to ``nextn.layers.{i}.``.
"""

from __future__ import annotations

import re

from ...errors import InvalidCheckpointError

QWEN_TYPES = ("qwen3_5", "qwen3_5_moe", "qwen3_next")
NEXTN_TYPES = ("deepseek_v3", "glm4_moe")

# longest first: "model.language_model.mtp." must not be read as "model." + something
QWEN_PREFIXES = (
    "model.language_model.mtp.",
    "language_model.model.mtp.",
    "language_model.mtp.",
    "model.mtp.",
    "mtp.",
)


def text_config(config: dict) -> dict:
    """The text model's config: ``text_config`` for multimodal checkpoints, else the config."""
    text = config.get("text_config")
    return text if isinstance(text, dict) and text else config


def mtp_model_type(config: dict) -> str | None:
    """The model_type of a family with a head (``_text`` suffix dropped), else None."""
    for cfg in (config, text_config(config)):
        mt = cfg.get("model_type")
        if isinstance(mt, str):
            mt = mt[: -len("_text")] if mt.endswith("_text") else mt
            if mt in QWEN_TYPES or mt in NEXTN_TYPES:
                return mt
    return None


def configured_layers(config: dict, family: str) -> int | None:
    """The head's layer count from the config, or None when the config does not say."""
    text = text_config(config)
    keys = ("mtp_num_hidden_layers", "num_nextn_predict_layers") if family == "qwen3_5" else (
        "num_nextn_predict_layers",)
    for key in keys:
        for cfg in (text, config):
            if isinstance(cfg.get(key), int):
                return cfg[key]
    return None


def normaliser(family: str, config: dict):
    """A function raw key -> normalised name, or None when the key is not a head tensor."""
    if family == "qwen3_5":
        def norm_qwen(key: str) -> str | None:
            for prefix in QWEN_PREFIXES:
                if key.startswith(prefix):
                    return "mtp." + key[len(prefix):]
            return None

        return norm_qwen

    n = text_config(config).get("num_hidden_layers")
    if not isinstance(n, int):
        raise InvalidCheckpointError("config.json has no num_hidden_layers: cannot tell where the NextN layers are")
    pattern = re.compile(r"^model\.layers\.(\d+)\.(.+)$")

    def norm_nextn(key: str) -> str | None:
        m = pattern.match(key)
        if m is None or int(m.group(1)) < n:
            return None
        return f"nextn.layers.{int(m.group(1)) - n}.{m.group(2)}"

    return norm_nextn
