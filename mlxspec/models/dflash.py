"""DFlash block drafters (z-lab's block-diffusion drafter, ``DFlashDraftModel``).

One drafter forward proposes a whole block: the input is ``[last token, MASK x (B-1)]``, the
block attends to itself both ways and to a context made from the target's own hidden states:
the outputs of the target layers ``dflash_config.target_layer_ids``, concatenated per position,
projected by ``fc`` (n*H -> H) and normalised (``hidden_norm``). Every draft layer turns that
context into keys and values with its own ``k_proj`` / ``v_proj`` (``k_norm`` and RoPE at the
context positions); queries come from the block alone. The checkpoint has no embedding or LM
head: both are the target's.

Since the block's positions are all masks but the first, the distribution drafted at block
position i does not depend on the tokens drafted before it: each position has its own
marginal q_i, which is what makes Leviathan acceptance with q_i exact.

Layout (z-lab ``dflash/model_mlx.py``, SpecForge configs): ``fc``, ``hidden_norm``,
``layers.i.{input_layernorm, post_attention_layernorm, self_attn.{q,k,v,o}_proj,
self_attn.{q,k}_norm, mlp.{gate,up,down}_proj}``, ``norm``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import BatchKVCache, KVCache
from mlx_lm.models.rope_utils import initialize_rope

from ..errors import InvalidCheckpointError


@dataclass
class DFlashArgs:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    block_size: int
    target_layer_ids: tuple[int, ...]
    num_target_layers: int
    mask_token_id: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e6
    max_position_embeddings: int = 40960
    rope_scaling: dict | None = None
    quantization: dict | None = field(default=None)

    @classmethod
    def from_config(cls, cfg: dict, name: str = "drafter") -> "DFlashArgs":
        """The args of a published config.json; one-line InvalidCheckpointError when a key the
        drafter needs is missing or of the wrong kind."""
        dflash = cfg.get("dflash_config")
        if not isinstance(dflash, dict):
            raise InvalidCheckpointError(f"DFlash {name}: config.json has no dflash_config object")
        ints = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "intermediate_size", "vocab_size", "block_size", "num_target_layers")
        for key in ints:
            if not isinstance(cfg.get(key), int) or cfg[key] <= 0:
                raise InvalidCheckpointError(f"DFlash {name}: config.json needs a positive integer {key!r}")
        ids = dflash.get("target_layer_ids")
        if ids is None:
            ids = default_target_layer_ids(cfg["num_target_layers"], cfg["num_hidden_layers"])
        if not (isinstance(ids, list) and ids and all(isinstance(i, int) for i in ids)):
            raise InvalidCheckpointError(f"DFlash {name}: dflash_config.target_layer_ids must be a list of integers")
        if not all(0 <= i < cfg["num_target_layers"] for i in ids):
            raise InvalidCheckpointError(
                f"DFlash {name}: target_layer_ids {ids} outside the target's {cfg['num_target_layers']} layers")
        mask = dflash.get("mask_token_id")
        if not isinstance(mask, int) or not 0 <= mask < cfg["vocab_size"]:
            raise InvalidCheckpointError(f"DFlash {name}: dflash_config.mask_token_id must be a token id")
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        rope = cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), dict) else {}
        return cls(
            hidden_size=cfg["hidden_size"], num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=cfg["num_attention_heads"], num_key_value_heads=cfg["num_key_value_heads"],
            head_dim=head_dim, intermediate_size=cfg["intermediate_size"], vocab_size=cfg["vocab_size"],
            block_size=cfg["block_size"], target_layer_ids=tuple(ids), num_target_layers=cfg["num_target_layers"],
            mask_token_id=mask, rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=cfg.get("rope_theta", rope.get("rope_theta", 1e6)),
            max_position_embeddings=cfg.get("max_position_embeddings", 40960),
            rope_scaling=cfg.get("rope_scaling"), quantization=cfg.get("quantization"),
        )


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """z-lab's ``build_target_layer_ids``: evenly spread from layer 1 to layer N-3."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [round(1 + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers)]


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))


class Attention(nn.Module):
    """Queries from the block; keys/values from the cached context plus the block itself."""

    def __init__(self, args: DFlashArgs):
        super().__init__()
        dim, hd = args.hidden_size, args.head_dim
        self.n_heads, self.n_kv_heads = args.num_attention_heads, args.num_key_value_heads
        self.scale = hd**-0.5
        self.q_proj = nn.Linear(dim, self.n_heads * hd, bias=False)
        self.k_proj = nn.Linear(dim, self.n_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(dim, self.n_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(self.n_heads * hd, dim, bias=False)
        self.q_norm = nn.RMSNorm(hd, eps=args.rms_norm_eps)
        self.k_norm = nn.RMSNorm(hd, eps=args.rms_norm_eps)

    def keys_values(self, x: mx.array, rope, offset: int) -> tuple[mx.array, mx.array]:
        """x (1, S, H) at positions offset.. -> keys, values (1, kv_heads, S, head_dim)."""
        B, S, _ = x.shape
        k = self.k_norm(self.k_proj(x).reshape(B, S, self.n_kv_heads, -1)).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(B, S, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        return rope(k, offset=offset), v

    def __call__(self, x: mx.array, rope, cache: KVCache | BatchKVCache, position: int | mx.array,
                 mask: mx.array | None = None) -> mx.array:
        """x (B, L, H): one block a row at positions position.. (an int, or (B,) for rows at their
        own positions) over CACHE's context; MASK (B, 1, 1, context + L): what each row sees
        (rows of a batch: not the padding before a shorter context)."""
        B, L, _ = x.shape
        q = self.q_norm(self.q_proj(x).reshape(B, L, self.n_heads, -1)).transpose(0, 2, 1, 3)
        q = rope(q, offset=position)
        k, v = self.keys_values(x, rope, position)
        stored = cache.size()  # context slots (a batch's: its longest row's, the others left-padded)
        if stored:
            k = mx.concatenate([cache.keys[..., :stored, :], k], axis=2)
            v = mx.concatenate([cache.values[..., :stored, :], v], axis=2)
        # the block attends to itself both ways: no causal mask
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


class DecoderLayer(nn.Module):
    def __init__(self, args: DFlashArgs):
        super().__init__()
        self.self_attn = Attention(args)
        self.mlp = MLP(args.hidden_size, args.intermediate_size)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, x: mx.array, rope, cache: KVCache | BatchKVCache, position: int | mx.array,
                 mask: mx.array | None = None) -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x), rope, cache, position, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashDraftModel(nn.Module):
    """The drafter; ``embed`` and ``head`` are the target's (:meth:`bind`)."""

    def __init__(self, args: DFlashArgs):
        super().__init__()
        self.args = args
        self.fc = nn.Linear(len(args.target_layer_ids) * args.hidden_size, args.hidden_size, bias=False)
        self.hidden_norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.layers = [DecoderLayer(args) for _ in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.rope = initialize_rope(args.head_dim, base=args.rope_theta, traditional=False,
                                    scaling_config=args.rope_scaling,
                                    max_position_embeddings=args.max_position_embeddings)

    @property
    def block_size(self) -> int:
        return self.args.block_size

    def make_cache(self) -> list[KVCache]:
        return [KVCache() for _ in self.layers]

    def context(self, features: mx.array) -> mx.array:
        """Target features (S, n*H) -> the context rows every layer reads (1, S, H)."""
        return self.hidden_norm(self.fc(features[None]))

    def add_context(self, features: mx.array, cache: list[KVCache], position: int) -> None:
        """Append the context keys/values of target positions position.. (features (S, n*H))."""
        ctx = self.context(features)
        for layer, c in zip(self.layers, cache):
            k, v = layer.self_attn.keys_values(ctx, self.rope, position)
            c.update_and_fetch(k, v)

    def __call__(self, embedded: mx.array, cache: list[KVCache], position: int) -> mx.array:
        """Block embeddings (1, B, H) at positions position.. -> final-norm hidden (1, B, H);
        the block's own keys/values are not kept."""
        h = embedded
        for layer, c in zip(self.layers, cache):
            h = layer(h, self.rope, c, position)
        return self.norm(h)

    def forward_rows(self, embedded: mx.array, cache: list[BatchKVCache], positions: mx.array) -> mx.array:
        """Blocks of B requests at once: embedded (B, S, H), row b's at positions positions[b]..
        (B,), CACHE their contexts merged left-padded (mlx-lm's BatchKVCache) -> final-norm
        hidden (B, S, H). Row b sees its own context (slots from its left padding on) and its
        whole block."""
        assert embedded.shape[0] == positions.shape[0], (embedded.shape, positions.shape)
        stored, rows = cache[0].size(), embedded.shape[0]
        slots = mx.arange(stored + embedded.shape[1])
        padding = cache[0].left_padding if stored else mx.zeros((rows,), mx.int32)
        mask = (slots[None] >= padding[:, None])[:, None, None, :]  # (B, 1, 1, context + S)
        h = embedded
        for layer, c in zip(self.layers, cache):
            h = layer(h, self.rope, c, positions, mask)
        return self.norm(h)


def check_weights(weights: dict, args: DFlashArgs, name: str) -> None:
    """One line naming what a checkpoint lacks or has too much of."""
    model = DFlashDraftModel(args)
    from mlx.utils import tree_flatten

    expected = {k for k, _ in tree_flatten(model.parameters())}
    given = {k for k in weights if not k.endswith((".scales", ".biases"))}
    missing = sorted(expected - given)
    extra = sorted(k for k in given - expected if not k.startswith(("embed_tokens", "lm_head")))
    if missing:
        raise InvalidCheckpointError(f"DFlash {name} lacks {len(missing)} tensor(s), e.g. {missing[0]!r}")
    if extra:
        raise InvalidCheckpointError(f"DFlash {name} has unknown tensor(s), e.g. {extra[0]!r}")


def load_dflash(path: Path, name: str) -> tuple[DFlashDraftModel, dict]:
    """The drafter in PATH (bf16/fp16/fp32 or mlx-quantized), checked; (model, config)."""
    try:
        cfg = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise InvalidCheckpointError(f"DFlash {name}: cannot read config.json ({err})") from None
    args = DFlashArgs.from_config(cfg, name)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise InvalidCheckpointError(f"DFlash {name} ({path}) has no .safetensors weights")
    weights = {}
    for f in files:
        try:
            weights.update(mx.load(str(f)))
        except Exception as err:  # mlx raises several types for a broken file
            raise InvalidCheckpointError(f"DFlash {name}: cannot read {f.name} ({err})") from None
    weights = {k.removeprefix("model."): v for k, v in weights.items()}
    check_weights(weights, args, name)
    model = DFlashDraftModel(args)
    if args.quantization:
        q = args.quantization
        nn.quantize(model, group_size=q.get("group_size", 64), bits=q.get("bits", 4),
                    class_predicate=lambda p, m: isinstance(m, nn.Linear) and f"{p}.scales" in weights)
    model.load_weights([(k, v) for k, v in weights.items() if not k.startswith(("embed_tokens", "lm_head"))])
    mx.eval(model.parameters())
    return model, cfg


def check_pair(target: nn.Module, drafter: DFlashDraftModel, name: str = "drafter") -> None:
    """One-line DrafterError when DRAFTER was not made for TARGET: its width, its layer count
    and the vocabulary (it borrows the target's embedding and LM head)."""
    from ..errors import DrafterError
    from .layer_capture import layer_count
    from .trunk import split_trunk

    args = drafter.args
    layers = layer_count(target)
    embed = split_trunk(target).embed
    vocab = embed.weight.shape[0]
    width = embed.weight.shape[1] * (32 // embed.bits if hasattr(embed, "bits") else 1)
    if width != args.hidden_size:
        raise DrafterError(f"the DFlash {name} is {args.hidden_size} wide, the target {width}: not its drafter")
    if layers != args.num_target_layers:
        raise DrafterError(f"the DFlash {name} was made for a {args.num_target_layers}-layer target, "
                           f"this one has {layers}")
    if args.mask_token_id >= vocab:
        raise DrafterError(f"the DFlash {name}'s mask token {args.mask_token_id} is outside the target's "
                           f"{vocab}-token vocabulary")
