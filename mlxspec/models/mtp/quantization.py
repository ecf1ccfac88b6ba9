"""How an MTP head's stored weights are quantized, read from the config and the tensors.

The result is mlx-lm's shape of a quantization block (``{"group_size", "bits", "mode"}`` plus
per-module overrides under the head's normalised names), or an FP8 description for
DeepSeek-style block FP8, or None for an unquantized head. Tensors are never dequantized.
"""

from __future__ import annotations

from .names import normaliser, text_config


def quantization(tensors: dict, config: dict, family: str) -> dict | None:
    text = text_config(config)
    block = None
    for cfg in (config, text):
        for key in ("quantization", "quantization_config"):
            if isinstance(cfg.get(key), dict):
                block = cfg[key]
                break
        if block is not None:
            break
    if any(k.endswith(".weight_scale_inv") for k in tensors):  # DeepSeek-style block FP8
        block = block or {}
        return {"mode": "fp8", "bits": 8, "group_size": None,
                "weight_block_size": block.get("weight_block_size")}
    scaled = sorted(k[: -len(".scales")] for k in tensors if k.endswith(".scales"))
    if not scaled:
        return None
    block = block or {}
    mode = block.get("mode", "affine")
    # the input width of the head's first projection is known: infer bits/group_size from it
    probe = "mtp.fc" if family == "qwen3_5" else "nextn.layers.0.eh_proj"
    inferred = {}
    if probe in scaled and probe + ".weight" in tensors:
        in_dim = 2 * text["hidden_size"]
        w, s = tensors[probe + ".weight"], tensors[probe + ".scales"]
        inferred = {"bits": w.shape[-1] * 32 // in_dim, "group_size": in_dim // s.shape[-1]}
    quant = {
        "group_size": block.get("group_size", inferred.get("group_size", 64)),
        "bits": block.get("bits", inferred.get("bits", 4)),
        "mode": mode,
    }
    # per-module overrides, mlx-lm style ({"<module path>": {"group_size", "bits"}}), for head
    # modules the config lists under their stored names
    normalise = normaliser(family, config)
    for key, value in block.items():
        if isinstance(value, dict) or value is False:
            name = normalise(key + ".weight")
            if name is not None:
                quant[name[: -len(".weight")]] = value
    return quant
