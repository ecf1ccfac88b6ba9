"""Native MTP heads as MLX modules, and the trunk split they need.

Qwen3.5 / Qwen3.6 / Qwen3-Next: ``fc(cat[pre_fc_norm_embedding(embed(x_{t+1})),
pre_fc_norm_hidden(h_t)])`` -> one full-attention decoder layer (its own KV cache) -> ``norm``
-> the trunk's shared lm_head. ``h_t`` is the trunk's hidden state after its final norm; the
head's own post-norm output is recycled as ``h`` for the next draft step.
"""

from __future__ import annotations

import re

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache

from ..trunk import Trunk


def text_args(model: nn.Module):
    lm = getattr(model, "language_model", model)
    return lm.args


class QwenMTPHead(nn.Module):
    """The Qwen3.5/3.6/Qwen3-Next MTP block (dense or MoE MLP, like the trunk's)."""

    def __init__(self, args, num_layers: int):
        super().__init__()
        from mlx_lm.models.qwen3_5 import DecoderLayer

        h = args.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.pre_fc_norm_embedding = nn.RMSNorm(h, eps=args.rms_norm_eps)
        self.pre_fc_norm_hidden = nn.RMSNorm(h, eps=args.rms_norm_eps)
        # layer_idx chosen so mlx-lm builds a full-attention layer (MTP is never linear)
        full_idx = args.full_attention_interval - 1
        self.layers = [DecoderLayer(args, layer_idx=full_idx) for _ in range(num_layers)]
        self.norm = nn.RMSNorm(h, eps=args.rms_norm_eps)

    def make_cache(self) -> list[KVCache]:
        return [KVCache() for _ in self.layers]

    def __call__(self, embeds: mx.array, hidden: mx.array, cache: list, step: int = 0) -> mx.array:
        """embeds, hidden: (1, n, H) -> the head's post-norm hidden (1, n, H)."""
        x = mx.concatenate(
            [self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)], axis=-1
        )
        x = self.fc(x)
        i = step % len(self.layers)
        mask = create_attention_mask(x, cache[i])
        x = self.layers[i](x, mask=mask, cache=cache[i])
        return self.norm(x)


def shard_head(module: QwenMTPHead, group) -> None:
    """MODULE's decoder layers split over GROUP as mlx-lm's ``shard()`` splits the trunk's
    full-attention layers (heads and MLP columns; the MoE's experts' columns): each draft step
    then all-sums twice over the group and reads 1/N of the layer's weights. ``fc`` and the norms
    stay whole (the hidden state is whole on every rank)."""
    from ...compat import shard_qwen3_5_layers

    shard_qwen3_5_layers(module.layers, group)
    mx.eval(module.parameters())
    mx.clear_cache()


class MTPHead:
    """A loaded head bound to its trunk: what the MTP drafter drives."""

    def __init__(self, module: QwenMTPHead, trunk: Trunk, nbytes: int, source: str):
        self.module = module
        self.trunk = trunk
        self.nbytes = nbytes
        self.source = source

    def make_cache(self):
        return self.module.make_cache()

    def embed(self, tokens: mx.array) -> mx.array:
        return self.trunk.embed(tokens)

    def logits(self, out: mx.array) -> mx.array:
        return self.trunk.head(out)

    def forward(self, tokens: mx.array, hidden: mx.array, cache, step: int = 0) -> mx.array:
        """Pairs (h_t, x_{t+1}): tokens (n,), hidden (n, H) -> the head's hidden (n, H)."""
        return self.module(self.embed(tokens)[None], hidden[None], cache, step)[0]

    def step(self, tokens: mx.array, hidden: mx.array, cache, step: int = 0) -> tuple[mx.array, mx.array]:
        """Pairs (h_t, x_{t+1}): tokens (n,), hidden (n, H) -> (logits (n, V), head hidden (n, H))."""
        out = self.forward(tokens, hidden, cache, step)
        return self.logits(out), out

    def forward_rows(self, tokens: mx.array, hidden: mx.array, cache, step: int = 0) -> mx.array:
        """W pairs for each of B requests: tokens (B, W), hidden (B, W, H), CACHE their caches as
        one batch (mlx-lm's BatchKVCache: each row its own length and RoPE offset, its padding
        masked) -> the head's hidden (B, W, H)."""
        assert tokens.shape == hidden.shape[:2], (tokens.shape, hidden.shape)
        return self.module(self.embed(tokens), hidden, cache, step)

    def step_rows(self, tokens: mx.array, hidden: mx.array, cache, step: int = 0) -> tuple[mx.array, mx.array]:
        """One pair for each of B requests (:meth:`forward_rows`): tokens (B,), hidden (B, H) ->
        (logits (B, V), head hidden (B, H))."""
        out = self.forward_rows(tokens[:, None], hidden[:, None], cache, step)[:, 0]
        return self.logits(out), out


def to_switch_mlp(tensors: dict) -> dict:
    """Routed experts, HF fused (``experts.gate_up_proj``) or per-expert (``experts.{e}.*``),
    -> mlx-lm's stacked ``switch_mlp.{gate,up,down}_proj.weight`` (as its sanitize does)."""
    out = dict(tensors)
    for key in [k for k in tensors if k.endswith("mlp.experts.gate_up_proj")]:
        p = key[: -len("experts.gate_up_proj")]
        gate_up = out.pop(key)
        mid = gate_up.shape[-2] // 2
        out[p + "switch_mlp.gate_proj.weight"] = gate_up[..., :mid, :]
        out[p + "switch_mlp.up_proj.weight"] = gate_up[..., mid:, :]
        out[p + "switch_mlp.down_proj.weight"] = out.pop(p + "experts.down_proj")
    per_expert = re.compile(r"^(.*mlp\.)experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
    groups: dict[tuple[str, str], dict[int, str]] = {}
    for key in tensors:
        m = per_expert.match(key)
        if m:
            groups.setdefault((m.group(1), m.group(3)), {})[int(m.group(2))] = key
    for (p, proj), keys in groups.items():
        out[f"{p}switch_mlp.{proj}.weight"] = mx.stack([out.pop(keys[e]) for e in sorted(keys)])
    return out
