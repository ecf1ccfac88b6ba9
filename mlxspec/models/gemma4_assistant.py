"""Gemma 4's "assistant" drafter (``model_type: gemma4_assistant``): a small Gemma-4 text stack
whose attention layers compute queries only, over the keys and values the target already holds.

One step reads ``concat(target_embedding(token) * sqrt(target_hidden), h_prev)``, projects it
to the assistant's width (``pre_projection``), runs the layers with queries rotated at one
fixed position (that of the token being drafted from) against the target's last eligible
full-attention and sliding-attention layers' K/V, normalises, and gives the next ``h_prev``
(``post_projection``, back to the target's width) and logits from the tied LM head: dense, or
the sparse centroid head of E2B/E4B (``masked_embedding``: only the top clusters' tokens get
real logits, the rest the minimum less one), as ``transformers.models.gemma4_assistant`` does.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import gemma4_text

from ..errors import DrafterError, InvalidCheckpointError
from .gemma4_pairs import TARGET_TYPES, UNSUPPORTED_ASSISTANT_TYPES


class MaskedEmbedder(nn.Module):
    """The sparse head: logits for the tokens of the top ``top_k`` of ``num_centroids``
    clusters; every other slot gets the smallest of those less one."""

    def __init__(self, hidden: int, num_centroids: int, top_k: int, vocab: int):
        super().__init__()
        if vocab % num_centroids:
            raise InvalidCheckpointError(f"vocab_size {vocab} is not a multiple of num_centroids {num_centroids}")
        self.top_k = top_k
        self.num_centroids = num_centroids
        self.vocab = vocab
        self.centroids = nn.Linear(hidden, num_centroids, bias=False)
        self.token_ordering = mx.zeros((vocab,), mx.int32)

    def __call__(self, h: mx.array, embed: nn.Module) -> mx.array:
        """h (n, H) -> logits (n, V), with EMBED's rows as the (tied) LM head."""
        n = h.shape[0]
        scores = self.centroids(h)
        top = mx.argpartition(-scores, kth=self.top_k - 1, axis=-1)[:, : self.top_k]  # the top set
        per_cluster = self.token_ordering.reshape(self.num_centroids, -1)
        picked = per_cluster[top].reshape(n, -1)  # (n, top_k * V/C) token ids
        rows = embed(picked)  # (n, m, H): dequantized rows of a quantized table too
        logits = (rows @ h[:, :, None])[..., 0]
        fill = logits.min(axis=-1, keepdims=True) - 1.0
        out = mx.broadcast_to(fill, (n, self.vocab))
        return mx.put_along_axis(out, picked, logits, axis=-1)


class Gemma4Assistant(nn.Module):
    """The assistant checkpoint as an MLX module; parameter names are the checkpoint's."""

    def __init__(self, config: dict):
        super().__init__()
        text = dict(config["text_config"])
        text["num_kv_shared_layers"] = text["num_hidden_layers"]  # every layer reads shared K/V
        text.setdefault("hidden_size_per_layer_input", 0)
        text.setdefault("use_double_wide_mlp", False)
        self.text_args = gemma4_text.ModelArgs.from_dict(text)
        args = self.text_args
        self.backbone_hidden_size = int(config["backbone_hidden_size"])
        self.vocab_size = args.vocab_size
        self.sliding_window = args.sliding_window
        self.model = _AssistantStack(args)
        self.pre_projection = nn.Linear(2 * self.backbone_hidden_size, args.hidden_size, bias=False)
        self.post_projection = nn.Linear(args.hidden_size, self.backbone_hidden_size, bias=False)
        self.tied = config.get("tie_word_embeddings", True)
        if not self.tied:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        self.masked_embedding = None
        if config.get("use_ordered_embeddings"):
            self.masked_embedding = MaskedEmbedder(
                args.hidden_size, int(config["num_centroids"]), int(config["centroid_intermediate_top_k"]),
                args.vocab_size,
            )

    def layer_types(self) -> set[str]:
        return set(self.text_args.layer_types)

    def __call__(self, inputs: mx.array, shared: dict, position: int) -> tuple[mx.array, mx.array]:
        """One drafting step. inputs (n, 2 * backbone): target embedding and h_prev, joined;
        shared: layer type -> (keys, values) (1, kv_heads, S, D); position: the queries' RoPE
        position. Returns (logits (n, V), next h_prev (n, backbone))."""
        h = self.pre_projection(inputs)[None]
        for layer in self.model.layers:
            h, _, _ = layer(h, None, None, shared_kv=shared[layer.layer_type], offset=position)
        h = self.model.norm(h)[0]
        if self.masked_embedding is not None:
            logits = self.masked_embedding(h, self.model.embed_tokens)
        elif self.tied:
            logits = self.model.embed_tokens.as_linear(h)
        else:
            logits = self.lm_head(h)
        return logits, self.post_projection(h)

    def sanitize(self, weights: dict) -> dict:
        out = {}
        for k, v in weights.items():
            if "rotary_emb" in k or (self.tied and k.startswith("lm_head.")):
                continue
            if k.endswith("token_ordering"):
                v = v.astype(mx.int32)  # int64 on disk; ids fit in 32 bits
            out[k] = v
        return out


class _AssistantStack(nn.Module):
    """``model.*``: embedding (the tied head), decoder layers, final norm."""

    def __init__(self, args: gemma4_text.ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [gemma4_text.DecoderLayer(args, layer_idx=i) for i in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)


def load_assistant(path: Path, name: str) -> tuple[Gemma4Assistant, dict]:
    """Load an assistant checkpoint folder (float or mlx-quantized); one-line errors."""
    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise InvalidCheckpointError(f"cannot read config.json of assistant '{name}': {err}") from None
    if config.get("model_type") in UNSUPPORTED_ASSISTANT_TYPES:
        raise InvalidCheckpointError(
            f"assistant '{name}' is a {config['model_type']} checkpoint, which mlxspec does not support yet; "
            "use a gemma4_assistant checkpoint (E2B, E4B, 26B-A4B, 31B)"
        )
    files = sorted(path.glob("model*.safetensors"))
    if not files:
        raise InvalidCheckpointError(f"assistant '{name}' ({path}) has no weights (model*.safetensors files)")
    try:
        model = Gemma4Assistant(copy.deepcopy(config))
        weights = {}
        for f in files:
            weights.update(mx.load(str(f)))
        weights = model.sanitize(weights)
        quant = config.get("quantization") or config.get("quantization_config")
        if quant and "bits" in quant:
            nn.quantize(
                model, group_size=quant.get("group_size", 64), bits=quant["bits"],
                mode=quant.get("mode", "affine"),
                class_predicate=lambda p, m: f"{p}.scales" in weights,
            )
        model.load_weights(list(weights.items()))
    except (KeyError, TypeError, ValueError) as err:
        raise InvalidCheckpointError(f"cannot load assistant '{name}': {' '.join(str(err).split())[:200]}") from None
    mx.eval(model.parameters())
    model.eval()
    return model, config


def text_args(target: nn.Module):
    """The gemma4_text arguments of a Gemma-4 target (text-only or the multimodal wrapper)."""
    lm = getattr(target, "language_model", target)
    args = getattr(lm, "args", None)
    return args if getattr(args, "model_type", None) in TARGET_TYPES else None


def shared_layers(target: nn.Module) -> dict[str, int]:
    """Layer type -> index of the target's last layer of that type that keeps its own K/V
    (below ``num_hidden_layers - num_kv_shared_layers``): the K/V the assistant reads. Its cache
    is entry ``index`` of the target's cache list (mlx-lm makes caches for those layers only)."""
    args = text_args(target)
    if args is None:
        raise DrafterError("the Gemma-4 assistant drafts for Gemma-4 targets only")
    eligible = args.num_hidden_layers - (args.num_kv_shared_layers or 0)
    return {t: i for i, t in enumerate(args.layer_types[:eligible])}


def check_pair(target: nn.Module, assistant: Gemma4Assistant) -> None:
    """Refuse an assistant made for another target: widths, vocabulary, head dims."""
    args = text_args(target)
    if args is None:
        raise DrafterError("a Gemma-4 assistant drafts for Gemma-4 targets only (gemma4, gemma4_text)")
    problems = []
    if assistant.backbone_hidden_size != args.hidden_size:
        problems.append(f"it was made for hidden size {assistant.backbone_hidden_size}, "
                        f"the target has {args.hidden_size}")
    if assistant.vocab_size != args.vocab_size:
        problems.append(f"it outputs {assistant.vocab_size} logits, the target {args.vocab_size}")
    layers = shared_layers(target)
    missing = assistant.layer_types() - set(layers)
    if missing:
        problems.append(f"the target has no {', '.join(sorted(missing))} layer to share")
    a = assistant.text_args
    for kind in sorted(assistant.layer_types() & set(layers)):
        full = kind == "full_attention"
        a_dim = (a.global_head_dim or a.head_dim) if full else a.head_dim
        t_dim = (args.global_head_dim or args.head_dim) if full else args.head_dim
        if a_dim != t_dim:
            problems.append(f"its {kind} head dim is {a_dim}, the target's {t_dim}")
    if problems:
        raise DrafterError("this assistant does not fit the target: " + "; ".join(problems))


def save_assistant(source: Path, out: Path, q_bits: int | None, q_group_size: int, dtype: str | None) -> dict:
    """Write the assistant at SOURCE into OUT (a new folder) as an mlxspec-loadable checkpoint:
    floating tensors cast to DTYPE (None: as stored), linear and embedding weights quantized to
    Q_BITS (affine) where their width allows; its other files (tokenizer) copied. Returns the
    written config."""
    import shutil

    from mlx.utils import tree_flatten

    model, config = load_assistant(source, source.name)
    if q_bits is not None and (config.get("quantization") or config.get("quantization_config")):
        raise InvalidCheckpointError(f"assistant '{source.name}' is already quantized; convert from the float one")
    if dtype is not None:
        cast = getattr(mx, dtype)
        model.apply(lambda x: x.astype(cast) if mx.issubdtype(x.dtype, mx.floating) else x)
    if q_bits is not None:
        nn.quantize(model, group_size=q_group_size, bits=q_bits,
                    class_predicate=lambda p, m: hasattr(m, "to_quantized") and m.weight.shape[-1] % q_group_size == 0)
        config["quantization"] = {"group_size": q_group_size, "bits": q_bits, "mode": "affine"}
    out.mkdir(parents=True, exist_ok=True)
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    for f in source.iterdir():
        if f.is_file() and f.name != "config.json" and not f.name.endswith(".safetensors") and \
                not f.name.endswith(".safetensors.index.json"):
            shutil.copy2(f, out / f.name)
    (out / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    return config
