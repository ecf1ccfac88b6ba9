"""Find and read a checkpoint's native MTP / NextN head tensors (mlx-lm drops them on load).

Two families:

* ``qwen3_5`` — Qwen3.5 / Qwen3.6 dense (``qwen3_5``), MoE (``qwen3_5_moe``) and Qwen3-Next
  (``qwen3_next``): a top-level ``mtp.*`` namespace (also seen as ``model.mtp.``,
  ``language_model.mtp.``, ``model.language_model.mtp.``, ``language_model.model.mtp.``), all
  normalised to ``mtp.``.
* ``nextn`` — DeepSeek-V3 (``deepseek_v3``) and GLM-4.5/4.7 (``glm4_moe``): extra decoder layers
  appended at ``model.layers.{num_hidden_layers + i}.``, normalised to ``nextn.layers.{i}.``.

Where the tensors may live, in the order looked at: a sidecar (``mtp.safetensors``,
``mtp/weights.safetensors``, ``model-mtp.safetensors``); the main shards through
``model.safetensors.index.json``; the ``model*.safetensors`` files themselves. Files are opened
with ``mx.load``, which is lazy: only the head's tensors are ever read from disk.

Tensors keep their stored dtype and are never dequantized. The names and shapes are those of
the published checkpoints and of vLLM's and sglang's MTP loaders.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

from ...errors import InvalidCheckpointError

QWEN_TYPES = ("qwen3_5", "qwen3_5_moe", "qwen3_next")
NEXTN_TYPES = ("deepseek_v3", "glm4_moe")
SIDECARS = ("mtp.safetensors", "mtp/weights.safetensors", "model-mtp.safetensors")
INDEX = "model.safetensors.index.json"

# longest first: "model.language_model.mtp." must not be read as "model." + something
QWEN_PREFIXES = (
    "model.language_model.mtp.",
    "language_model.model.mtp.",
    "language_model.mtp.",
    "model.mtp.",
    "mtp.",
)

# Qwen head norms stored zero-centred by Hugging Face checkpoints (y = norm(x) * (1 + w))
QWEN_NORM_SUFFIXES = (
    "pre_fc_norm_embedding.weight",
    "pre_fc_norm_hidden.weight",
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
    "self_attn.q_norm.weight",
    "self_attn.k_norm.weight",
)

# below this median |w| the head's norm weights are taken as zero-centred (see _zero_centred)
ZERO_CENTRED_MEDIAN = 0.5


@dataclass
class MTPWeights:
    family: str  # "qwen3_5" or "nextn"
    tensors: dict[str, mx.array]  # normalised names: "mtp.fc.weight", "nextn.layers.0.eh_proj.weight"
    num_layers: int
    source: str  # human-readable: "mtp.safetensors", "model.safetensors.index.json (1 of 2 shards)"
    quantization: dict | None  # {"group_size", "bits", "mode"} (+ per-module overrides) or None
    norms_shifted: bool  # zero-centred RMSNorm weights were converted (+1) to mlx's convention


# -- config -------------------------------------------------------------------------------


def _text_config(config: dict) -> dict:
    text = config.get("text_config")
    return text if isinstance(text, dict) and text else config


def _model_type(config: dict) -> str | None:
    for cfg in (config, _text_config(config)):
        mt = cfg.get("model_type")
        if isinstance(mt, str):
            mt = mt[: -len("_text")] if mt.endswith("_text") else mt
            if mt in QWEN_TYPES or mt in NEXTN_TYPES:
                return mt
    return None


def _get(cfg: dict, key: str, default=None):
    value = cfg.get(key)
    return default if value is None else value


def _configured_layers(config: dict, family: str) -> int | None:
    text = _text_config(config)
    keys = ("mtp_num_hidden_layers", "num_nextn_predict_layers") if family == "qwen3_5" else (
        "num_nextn_predict_layers",)
    for key in keys:
        for cfg in (text, config):
            if isinstance(cfg.get(key), int):
                return cfg[key]
    return None


# -- locating -------------------------------------------------------------------------------


def _normaliser(family: str, config: dict):
    """A function raw key -> normalised name, or None when the key is not a head tensor."""
    if family == "qwen3_5":
        def norm_qwen(key: str) -> str | None:
            for prefix in QWEN_PREFIXES:
                if key.startswith(prefix):
                    return "mtp." + key[len(prefix):]
            return None

        return norm_qwen

    n = _text_config(config).get("num_hidden_layers")
    if not isinstance(n, int):
        raise InvalidCheckpointError("config.json has no num_hidden_layers: cannot tell where the NextN layers are")
    pattern = re.compile(r"^model\.layers\.(\d+)\.(.+)$")

    def norm_nextn(key: str) -> str | None:
        m = pattern.match(key)
        if m is None or int(m.group(1)) < n:
            return None
        return f"nextn.layers.{int(m.group(1)) - n}.{m.group(2)}"

    return norm_nextn


def _load(path: Path, model_path: Path) -> dict[str, mx.array]:
    try:
        return mx.load(str(path))  # lazy: nothing is read until a tensor is evaluated
    except Exception as err:  # mlx raises ValueError/RuntimeError for broken files
        msg = " ".join(str(err).split())[:160]
        raise InvalidCheckpointError(f"cannot read {path.relative_to(model_path)}: {msg}") from None


def _pick(arrays: dict, normalise, where: str, out: dict) -> None:
    for key, value in arrays.items():
        name = normalise(key)
        if name is None:
            continue
        if name in out:
            raise InvalidCheckpointError(f"MTP head tensor {name} appears twice ({key} in {where})")
        out[name] = value


def _trunk_raw(arrays: dict, normalise) -> bool | None:
    """mlx-lm's rule: a trunk ``conv1d.weight`` whose last dim != 1 is an unconverted HF tensor.

    True (raw HF trunk), False (converted by mlx-lm), None (no trunk conv1d visible).
    """
    seen = None
    for key, value in arrays.items():
        if key.endswith("conv1d.weight") and normalise(key) is None:
            if value.shape[-1] != 1:
                return True
            seen = False
    return seen


@dataclass
class _Found:
    tensors: dict
    source: str
    trunk_raw: bool | None  # conversion state of the trunk stored in the same files as the head


def _locate(model_path: Path, normalise) -> _Found | None:
    for name in SIDECARS:
        path = model_path / name
        if path.is_file():
            tensors: dict = {}
            _pick(_load(path, model_path), normalise, name, tensors)
            if not tensors:
                raise InvalidCheckpointError(f"{name} holds no MTP head tensors")
            # a sidecar carries no trunk: its own norm statistics decide
            return _Found(tensors, name, None)

    index = model_path / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as err:
            raise InvalidCheckpointError(f"{INDEX} is not a valid index: {type(err).__name__}") from None
        by_shard: dict[str, list[str]] = {}
        for key, shard in weight_map.items():
            if normalise(key) is not None:
                by_shard.setdefault(shard, []).append(key)
        if not by_shard:
            return None
        tensors = {}
        for shard, keys in sorted(by_shard.items()):
            path = model_path / shard
            if not path.is_file():
                raise InvalidCheckpointError(f"{INDEX} names {shard} for MTP tensor {keys[0]}, but the file is missing")
            arrays = _load(path, model_path)
            missing = [k for k in keys if k not in arrays]
            if missing:
                raise InvalidCheckpointError(f"{INDEX} puts {missing[0]} in {shard}, but that file lacks it")
            _pick({k: arrays[k] for k in keys}, normalise, shard, tensors)
        trunk_raw = None
        conv = next((k for k in weight_map if k.endswith("conv1d.weight") and normalise(k) is None), None)
        if conv is not None and (model_path / weight_map[conv]).is_file():
            shard_arrays = _load(model_path / weight_map[conv], model_path)
            if conv in shard_arrays:
                trunk_raw = shard_arrays[conv].shape[-1] != 1
        n_shards = len(set(weight_map.values()))
        return _Found(tensors, f"{INDEX} ({len(by_shard)} of {n_shards} shards)", trunk_raw)

    files = [p for p in sorted(model_path.glob("model*.safetensors")) if p.name not in SIDECARS]
    tensors, used, trunk_raw = {}, [], None
    for path in files:
        arrays = _load(path, model_path)
        before = len(tensors)
        _pick(arrays, normalise, path.name, tensors)
        if len(tensors) > before:
            used.append(path.name)
        raw = _trunk_raw(arrays, normalise)
        trunk_raw = raw if trunk_raw is None else (trunk_raw or bool(raw))
    if not tensors:
        return None
    return _Found(tensors, ", ".join(used), trunk_raw)


# -- validation -----------------------------------------------------------------------------


class _Checker:
    def __init__(self, tensors: dict, source: str, quant_mode: str | None):
        self.t = tensors
        self.source = source
        self.quant_mode = quant_mode or "affine"

    def fail_missing(self, name: str, shape) -> None:
        expected = f" (expected shape {tuple(shape)})" if shape is not None else ""
        raise InvalidCheckpointError(f"MTP head tensor {name} is missing from {self.source}{expected}")

    def tensor(self, name: str, shape, required: bool = True) -> None:
        if name not in self.t:
            if required:
                self.fail_missing(name, shape)
            return
        found = tuple(self.t[name].shape)
        if shape is not None and found != tuple(shape):
            raise InvalidCheckpointError(
                f"MTP head tensor {name} has shape {found}, expected {tuple(shape)} ({self.source})"
            )

    def linear(self, name: str, shape, required: bool = True) -> None:
        """A weight that may be quantized: then only its companions' presence is checked."""
        base = name[: -len(".weight")] if name.endswith(".weight") else name
        if base + ".scales" in self.t:
            if name not in self.t:
                self.fail_missing(name, None)
            if self.quant_mode == "affine" and base + ".biases" not in self.t:
                self.fail_missing(base + ".biases", None)
            return
        if base + ".weight_packed" in self.t:  # compressed-tensors int4 (DeepSeek exports)
            return
        self.tensor(name, shape, required)

    def has_prefix(self, prefix: str) -> bool:
        return any(k.startswith(prefix) for k in self.t)

    def experts(self, p: str, n_experts: int, inter: int, hidden: int, required: bool = True) -> None:
        """Routed experts under P (".../mlp."): HF fused, per-expert, or mlx-lm switch_mlp."""
        e, i, h = n_experts, inter, hidden
        if p + "experts.gate_up_proj" in self.t or p + "experts.down_proj" in self.t:
            self.tensor(p + "experts.gate_up_proj", (e, 2 * i, h))
            self.tensor(p + "experts.down_proj", (e, h, i))
        elif self.has_prefix(p + "experts."):
            for x in range(e):
                q = f"{p}experts.{x}."
                self.linear(q + "gate_proj.weight", (i, h))
                self.linear(q + "up_proj.weight", (i, h))
                self.linear(q + "down_proj.weight", (h, i))
        elif self.has_prefix(p + "switch_mlp."):
            self.linear(p + "switch_mlp.gate_proj.weight", (e, i, h))
            self.linear(p + "switch_mlp.up_proj.weight", (e, i, h))
            self.linear(p + "switch_mlp.down_proj.weight", (e, h, i))
        elif required:
            self.fail_missing(p + "experts.gate_up_proj", (e, 2 * i, h))

    def dense_mlp(self, p: str, inter: int, hidden: int) -> None:
        self.linear(p + "gate_proj.weight", (inter, hidden))
        self.linear(p + "up_proj.weight", (inter, hidden))
        self.linear(p + "down_proj.weight", (hidden, inter))


def _validate_qwen(c: _Checker, text: dict, num_layers: int) -> None:
    h = text["hidden_size"]
    n_q = text["num_attention_heads"]
    n_kv = _get(text, "num_key_value_heads", n_q)
    d = _get(text, "head_dim", h // n_q)
    gate = 2 if _get(text, "attn_output_gate", True) else 1  # Qwen3-Next's config omits it: gated
    c.linear("mtp.fc.weight", (h, 2 * h))
    for name in ("mtp.norm.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight"):
        c.tensor(name, (h,))
    n_experts = _get(text, "num_experts", 0)
    for i in range(num_layers):
        p = f"mtp.layers.{i}."
        c.tensor(p + "input_layernorm.weight", (h,))
        c.tensor(p + "post_attention_layernorm.weight", (h,))
        c.linear(p + "self_attn.q_proj.weight", (gate * n_q * d, h))
        c.linear(p + "self_attn.k_proj.weight", (n_kv * d, h))
        c.linear(p + "self_attn.v_proj.weight", (n_kv * d, h))
        c.linear(p + "self_attn.o_proj.weight", (h, n_q * d))
        c.tensor(p + "self_attn.q_norm.weight", (d,))
        c.tensor(p + "self_attn.k_norm.weight", (d,))
        m = p + "mlp."
        if n_experts > 0:
            c.linear(m + "gate.weight", (n_experts, h))
            c.experts(m, n_experts, text["moe_intermediate_size"], h)
            shared = _get(text, "shared_expert_intermediate_size", 0)
            if shared > 0:
                c.dense_mlp(m + "shared_expert.", shared, h)
                c.linear(m + "shared_expert_gate.weight", (1, h))
        else:
            c.dense_mlp(m, text["intermediate_size"], h)


def _validate_nextn(c: _Checker, cfg: dict, model_type: str, num_layers: int) -> None:
    h = cfg["hidden_size"]
    vocab = cfg.get("vocab_size")
    n_q = cfg["num_attention_heads"]
    for i in range(num_layers):
        p = f"nextn.layers.{i}."
        c.linear(p + "eh_proj.weight", (h, 2 * h))
        for name in ("enorm.weight", "hnorm.weight", "shared_head.norm.weight",
                     "input_layernorm.weight", "post_attention_layernorm.weight"):
            c.tensor(p + name, (h,))
        # both are copies of the trunk's; some exports leave them out
        c.linear(p + "embed_tokens.weight", (vocab, h) if vocab else None, required=False)
        c.linear(p + "shared_head.head.weight", (vocab, h) if vocab else None, required=False)
        a = p + "self_attn."
        if model_type == "deepseek_v3":
            nope, rope = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"]
            v_dim, kv_lora = cfg["v_head_dim"], cfg["kv_lora_rank"]
            q_lora = cfg.get("q_lora_rank")
            if q_lora:
                c.linear(a + "q_a_proj.weight", (q_lora, h))
                c.tensor(a + "q_a_layernorm.weight", (q_lora,))
                c.linear(a + "q_b_proj.weight", (n_q * (nope + rope), q_lora))
            else:
                c.linear(a + "q_proj.weight", (n_q * (nope + rope), h))
            c.linear(a + "kv_a_proj_with_mqa.weight", (kv_lora + rope, h))
            c.tensor(a + "kv_a_layernorm.weight", (kv_lora,))
            if a + "embed_q.weight" not in c.t:  # mlx-lm splits kv_b_proj into embed_q/unembed_out
                c.linear(a + "kv_b_proj.weight", (n_q * (nope + v_dim), kv_lora))
            c.linear(a + "o_proj.weight", (h, n_q * v_dim))
        else:  # glm4_moe
            n_kv = _get(cfg, "num_key_value_heads", n_q)
            d = _get(cfg, "head_dim", h // n_q)
            for proj, out in (("q_proj", n_q * d), ("k_proj", n_kv * d), ("v_proj", n_kv * d)):
                c.linear(a + proj + ".weight", (out, h))
                c.tensor(a + proj + ".bias", (out,), required=bool(cfg.get("attention_bias")))
            c.linear(a + "o_proj.weight", (h, n_q * d))
            if cfg.get("use_qk_norm"):
                c.tensor(a + "q_norm.weight", (d,))
                c.tensor(a + "k_norm.weight", (d,))
        m = p + "mlp."
        n_experts = _get(cfg, "n_routed_experts", 0)
        index = cfg["num_hidden_layers"] + i  # the MoE/dense choice follows the trunk's rule
        if (n_experts > 0 and index >= _get(cfg, "first_k_dense_replace", 0)
                and index % _get(cfg, "moe_layer_freq", 1) == 0):
            inter = cfg["moe_intermediate_size"]
            c.linear(m + "gate.weight", (n_experts, h))
            c.tensor(m + "gate.e_score_correction_bias", (n_experts,), required=False)
            c.experts(m, n_experts, inter, h)
            n_shared = _get(cfg, "n_shared_experts", 0)
            if n_shared:
                c.dense_mlp(m + "shared_experts.", inter * n_shared, h)
        else:
            c.dense_mlp(m, cfg["intermediate_size"], h)


# -- norms ----------------------------------------------------------------------------------


def _qwen_norm_names(tensors: dict) -> list[str]:
    return sorted(
        k for k in tensors
        if (k == "mtp.norm.weight" or k.endswith(QWEN_NORM_SUFFIXES)) and tensors[k].ndim == 1
    )


def _zero_centred(found: _Found, norm_names: list[str]) -> bool:
    """Whether the Qwen head's RMSNorm weights are stored zero-centred (raw Hugging Face).

    Hugging Face Qwen3.5 / Qwen3-Next checkpoints store every RMSNorm weight as an offset
    (``y = norm(x) * (1 + w)``, initialised to 0); mlx-lm's modules compute ``norm(x) * w``, so
    such weights need +1. The rule, in order:

    1. The head was read from the same files as the trunk and the trunk shows a ``conv1d.weight``
       whose last dim != 1: an unconverted Hugging Face checkpoint, exactly the test mlx-lm's
       ``qwen3_5.sanitize`` uses to add +1 to the trunk's norms -> zero-centred.
    2. Otherwise (a sidecar, whose conversion state the trunk says nothing about; a trunk already
       converted by mlx-lm, whose sanitize drops ``mtp.*`` and so never shifted a head stored
       with it; or no trunk conv1d visible): the head's own norm weights decide. Trained
       zero-centred offsets sit near 0, converted gains near 1: zero-centred when the median
       |w| over all the head's norm weights is below ``ZERO_CENTRED_MEDIAN`` (0.5).
    """
    if found.trunk_raw:
        return True
    if not norm_names:
        return False
    values = mx.concatenate([found.tensors[k].astype(mx.float32).reshape(-1) for k in norm_names])
    median = float(mx.sort(mx.abs(values))[values.size // 2].item())
    return median < ZERO_CENTRED_MEDIAN


# -- quantization ---------------------------------------------------------------------------


def _quantization(tensors: dict, config: dict, family: str) -> dict | None:
    text = _text_config(config)
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
        in_dim = 2 * _text_config(config)["hidden_size"]
        w, s = tensors[probe + ".weight"], tensors[probe + ".scales"]
        inferred = {"bits": w.shape[-1] * 32 // in_dim, "group_size": in_dim // s.shape[-1]}
    quant = {
        "group_size": block.get("group_size", inferred.get("group_size", 64)),
        "bits": block.get("bits", inferred.get("bits", 4)),
        "mode": mode,
    }
    # per-module overrides, mlx-lm style ({"<module path>": {"group_size", "bits"}}), for head
    # modules the config lists under their stored names
    normalise = _normaliser(family, config)
    for key, value in block.items():
        if isinstance(value, dict) or value is False:
            name = normalise(key + ".weight")
            if name is not None:
                quant[name[: -len(".weight")]] = value
    return quant


# -- entry point ----------------------------------------------------------------------------


def find_mtp_weights(model_path: Path, config: dict) -> MTPWeights | None:
    """The checkpoint's native MTP / NextN head tensors, or None when it has no head.

    Raises InvalidCheckpointError (one line, naming the tensor) when a head is present but a
    tensor is missing or mis-shaped.
    """
    model_path = Path(model_path)
    model_type = _model_type(config)
    if model_type is None:
        return None
    family = "qwen3_5" if model_type in QWEN_TYPES else "nextn"
    configured = _configured_layers(config, family)
    if configured == 0:
        return None
    normalise = _normaliser(family, config)
    found = _locate(model_path, normalise)
    if found is None:
        return None  # e.g. an mlx-lm conversion: its sanitize drops the head
    tensors = found.tensors

    if configured is None:  # Qwen3-Next has no count in its config: count the layers present
        layers = {int(m.group(1)) for k in tensors
                  if (m := re.match(r"^(?:mtp|nextn)\.layers\.(\d+)\.", k))}
        configured = max(layers) + 1 if layers else 0
        if configured == 0:
            raise InvalidCheckpointError(f"MTP head in {found.source} has no layers")

    quant = _quantization(tensors, config, family)
    checker = _Checker(tensors, found.source, quant.get("mode") if quant else None)
    text = _text_config(config)
    try:
        if family == "qwen3_5":
            _validate_qwen(checker, text, configured)
        else:
            _validate_nextn(checker, text, model_type, configured)
    except KeyError as err:
        raise InvalidCheckpointError(f"config.json lacks {err.args[0]!r}, needed to check the MTP head") from None

    shifted = False
    if family == "qwen3_5":  # DeepSeek / GLM norms are standard (x * w): never shifted
        norm_names = _qwen_norm_names(tensors)
        if _zero_centred(found, norm_names):
            for k in norm_names:
                tensors[k] = tensors[k] + 1  # python scalar: the stored dtype is kept
            shifted = True

    return MTPWeights(
        family=family,
        tensors=tensors,
        num_layers=configured,
        source=found.source,
        quantization=quant,
        norms_shifted=shifted,
    )
