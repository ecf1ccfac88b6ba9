"""DeepSeek-V3 / GLM-4.5-style NextN heads (the extra layer at ``model.layers.{num_hidden_layers}``).

For a pair (h_t, x_{t+1}) — the trunk's final-norm hidden state at position t and the token
that followed — the head computes (as DeepSeek-V3's and GLM-4.5's public inference code, vLLM
``deepseek_mtp.py`` / ``glm4_moe_mtp.py`` and sglang ``deepseek_nextn.py`` /
``glm4_moe_nextn.py`` do)::

    e   = enorm(embed(x_{t+1}))           # the layer's own embed_tokens if shipped, else the trunk's
    h   = hnorm(h_t)
    x   = eh_proj(cat[e, h])              # Linear 2H -> H, no bias; embedding first
    x   = block(x)                        # one decoder layer of the family, its own KV cache
    out = shared_head.norm(x)
    logits = shared_head.head(out)        # if shipped, else the trunk's lm_head

``out`` is also the hidden fed back as h for the next step of a draft chain (sglang applies
``shared_head.norm`` inside the NextN forward and recycles its output; vLLM's newer
``deepseek_mtp.py`` likewise recycles the ``shared_head``-normed hidden).

Norms are standard RMSNorm (``x * w``; no zero-centred +1). The block is mlx-lm's own decoder
layer class built with layer index ``num_hidden_layers``, so it gets the dense or MoE MLP by the
same rule as the real model's layer at that index (MoE for DeepSeek-V3 and GLM-4.5).

Position 0: vLLM zeroes the embedding of the token at position 0 (``inputs_embeds[positions ==
0] = 0``, "not needed by MTP"); sglang does not. Our first pair is (h_0, x_1), a real pair whose
token embedding carries information, so nothing is zeroed here (sglang's behaviour). It only
affects the head's very first cache entry.

Only the first NextN layer is used (DeepSeek-V3 and GLM-4.5 ship exactly one; sglang asserts
one): it is reused for every step of a chain, as both vLLM and sglang do with one layer.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache

from ...errors import InvalidCheckpointError
from ..trunk import Trunk, split_trunk
from .head import MTPHead, to_switch_mlp

# the layer's own tensors; everything else belongs to the decoder block
OWN = ("enorm.", "hnorm.", "eh_proj.", "shared_head.", "embed_tokens.")
FP8_ERROR = "fp8 NextN weights are not supported; convert to bf16 or MLX first"


def _decoder_layer(model_type: str):
    if model_type == "deepseek_v3":
        from mlx_lm.models.deepseek_v3 import DeepseekV3DecoderLayer

        return DeepseekV3DecoderLayer
    if model_type == "glm4_moe":
        from mlx_lm.models.glm4_moe import DecoderLayer

        return DecoderLayer
    raise InvalidCheckpointError(f"NextN heads of {model_type} models are not supported")


class SharedHead(nn.Module):
    def __init__(self, hidden: int, vocab: int, eps: float, with_head: bool):
        super().__init__()
        self.norm = nn.RMSNorm(hidden, eps=eps)
        if with_head:
            self.head = nn.Linear(hidden, vocab, bias=False)


class NextNHead(nn.Module):
    """One NextN layer: enorm/hnorm -> eh_proj -> decoder block -> shared_head."""

    def __init__(self, args, own_embed: bool = False, own_head: bool = False):
        super().__init__()
        model_type = args.model_type
        h, eps = args.hidden_size, args.rms_norm_eps
        self.enorm = nn.RMSNorm(h, eps=eps)
        self.hnorm = nn.RMSNorm(h, eps=eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        # layer index num_hidden_layers: the real model's rule picks dense vs MoE for it
        self.block = _decoder_layer(model_type)(args, args.num_hidden_layers)
        self.shared_head = SharedHead(h, args.vocab_size, eps, own_head)
        if own_embed:
            self.embed_tokens = nn.Embedding(args.vocab_size, h)
        # mlx-lm's DeepSeek MLA attention needs an array mask (it feeds it to mx.where)
        self._array_mask = model_type == "deepseek_v3"

    def make_cache(self) -> list[KVCache]:
        # neither deepseek_v3 nor glm4_moe defines make_cache: mlx-lm gives each layer a KVCache
        return [KVCache()]

    def embed(self, tokens: mx.array, trunk: Trunk) -> mx.array:
        return self.embed_tokens(tokens) if "embed_tokens" in self else trunk.embed(tokens)

    def logits(self, out: mx.array, trunk: Trunk) -> mx.array:
        return self.shared_head.head(out) if "head" in self.shared_head else trunk.head(out)

    def __call__(self, embeds: mx.array, hidden: mx.array, cache: list, step: int = 0) -> mx.array:
        """embeds, hidden: (1, n, H) -> the post-``shared_head.norm`` hidden (1, n, H)."""
        x = self.eh_proj(mx.concatenate([self.enorm(embeds), self.hnorm(hidden)], axis=-1))
        mask = create_attention_mask(x, cache[0], return_array=self._array_mask)
        x = self.block(x, mask=mask, cache=cache[0])
        return self.shared_head.norm(x)


class NextNMTPHead(MTPHead):
    """An MTPHead whose embedding and logits come from the NextN layer where it ships them."""

    def embed(self, tokens: mx.array) -> mx.array:
        return self.module.embed(tokens, self.trunk)

    def logits(self, out: mx.array) -> mx.array:
        return self.module.logits(out, self.trunk)


def _quant_params(path: str, module: nn.Module, tensors: dict, mode: str) -> dict:
    """bits / group_size a stored weight was packed with (the module is still unquantized)."""
    try:
        from mlx_lm.utils import infer_quant_config

        return infer_quant_config(path, module, tensors)
    except ImportError:  # older mlx-lm
        in_dims = module.weight.shape[-1]
        return {"group_size": in_dims // tensors[f"{path}.scales"].shape[-1],
                "bits": tensors[f"{path}.weight"].shape[-1] * 32 // in_dims, "mode": mode}


def load_nextn_head(model: nn.Module, weights) -> NextNMTPHead:
    """The first NextN layer of WEIGHTS (family "nextn") bound to MODEL's trunk."""
    quant = weights.quantization or {}
    if quant.get("mode") == "fp8" or any(k.endswith(".weight_scale_inv") for k in weights.tensors):
        raise InvalidCheckpointError(f"{FP8_ERROR} ({weights.source})")
    lm = getattr(model, "language_model", model)
    args = lm.args
    prefix = "nextn.layers.0."
    raw = {k[len(prefix):]: v for k, v in weights.tensors.items() if k.startswith(prefix)}
    nbytes = sum(v.nbytes for v in raw.values())

    # mlx-lm's own sanitize turns the HF layer into its module layout (per-expert tensors ->
    # switch_mlp, DeepSeek kv_b_proj -> embed_q/unembed_out, int4 compressed-tensors -> affine):
    # hand it the layer under the name of trunk layer 0, which every sanitize converts and keeps.
    as_layer0 = {"model.layers.0." + k: v for k, v in raw.items() if not k.endswith("rotary_emb.inv_freq")}
    if hasattr(lm, "sanitize"):
        as_layer0 = lm.sanitize(as_layer0)
    tensors = to_switch_mlp({k[len("model.layers.0."):]: v for k, v in as_layer0.items()})
    tensors = {k if k.startswith(OWN) else "block." + k: v for k, v in tensors.items()}
    gate = "block.mlp.gate."
    if gate + "weight" in tensors and gate + "e_score_correction_bias" not in tensors:
        # optional in the checkpoint (weights.py); mlx-lm's gate always adds it: zero is no bias
        tensors[gate + "e_score_correction_bias"] = mx.zeros((tensors[gate + "weight"].shape[0],))

    module = NextNHead(args, own_embed="embed_tokens.weight" in tensors,
                       own_head="shared_head.head.weight" in tensors)
    if any(k.endswith(".scales") for k in tensors):
        mode = quant.get("mode", "affine")
        nn.quantize(
            module,
            group_size=quant.get("group_size", 64),
            bits=quant.get("bits", 4),
            mode=mode,
            class_predicate=lambda p, m: (hasattr(m, "to_quantized") and f"{p}.scales" in tensors
                                          and _quant_params(p, m, tensors, mode)),
        )
    try:
        module.load_weights(list(tensors.items()), strict=True)
    except ValueError as err:
        msg = " ".join(str(err).split())[:200]
        raise InvalidCheckpointError(f"NextN head in {weights.source} does not fit the model: {msg}") from None
    module.eval()
    mx.eval(module.parameters())
    return NextNMTPHead(module, split_trunk(model), nbytes, weights.source)
