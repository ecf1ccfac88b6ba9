"""Check a GGUF's metadata against the tensors it actually holds, before anything is written.

The config mlx-lm builds the model from comes from the metadata (``{arch}.block_count``, head
counts, widths), but the weights come from the tensor table: when the two disagree, mlx-lm
either builds a model of the metadata's size (``block_count`` 100,000: gigabytes allocated for
layers that have no weights) or the checkpoint written cannot load. Each disagreement is one
line naming the metadata key and the two numbers.
"""

from __future__ import annotations

import re

from ..errors import InvalidCheckpointError
from .gguf_file import GGUFHeader

_BLOCK = re.compile(r"blk\.(\d+)\.(.+)")
# present in every block of every supported architecture
CORE_BLOCK_TENSORS = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output",
                      "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")


def check_heads(header: GGUFHeader, config: dict, name: str) -> None:
    """Head counts positive, dividing each other and (without an explicit head size) the width:
    llama's rotary unpermute and mlx-lm's attention reshape by them."""
    p = header.architecture + "."
    heads, kv, hidden = config["num_attention_heads"], config["num_key_value_heads"], config["hidden_size"]
    if not isinstance(header.metadata.get(p + "attention.key_length"), int) and hidden % heads:
        raise InvalidCheckpointError(
            f"{name}: {p}attention.head_count {heads} does not divide {p}embedding_length {hidden}")
    if not isinstance(kv, int) or isinstance(kv, bool) or kv <= 0:
        raise InvalidCheckpointError(
            f"{name} has {p}attention.head_count_kv {kv!r}; it must be a positive number of heads")
    if heads % kv:
        raise InvalidCheckpointError(
            f"{name}: {p}attention.head_count_kv {kv} does not divide {p}attention.head_count {heads}")
    head_dim = config["head_dim"]
    if not isinstance(head_dim, int) or head_dim <= 0 or head_dim % 2:
        raise InvalidCheckpointError(
            f"{name} has a head size of {head_dim!r} ({p}attention.key_length); rotary embedding "
            "needs a positive even number")


def _expected_shapes(header: GGUFHeader, config: dict) -> dict[str, tuple[tuple[int, ...], str]]:
    """Block tensor suffix -> (the shape the metadata implies, the keys that imply it)."""
    p = header.architecture + "."
    hidden, ffn = config["hidden_size"], config["intermediate_size"]
    heads, kv, hd = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    width = f"{p}embedding_length {hidden}"
    q_keys = f"{p}attention.head_count {heads} x head size {hd}, {width}"
    kv_keys = f"{p}attention.head_count_kv {kv} x head size {hd}, {width}"
    ffn_keys = f"{p}feed_forward_length {ffn}, {width}"
    norm = ((hidden,), width)
    return {
        "attn_norm.weight": norm, "ffn_norm.weight": norm,
        "post_attention_norm.weight": norm, "post_ffw_norm.weight": norm,
        "attn_q.weight": ((heads * hd, hidden), q_keys), "attn_q.bias": ((heads * hd,), q_keys),
        "attn_k.weight": ((kv * hd, hidden), kv_keys), "attn_k.bias": ((kv * hd,), kv_keys),
        "attn_v.weight": ((kv * hd, hidden), kv_keys), "attn_v.bias": ((kv * hd,), kv_keys),
        "attn_output.weight": ((hidden, heads * hd), q_keys),
        "attn_q_norm.weight": ((hd,), f"head size {hd}"), "attn_k_norm.weight": ((hd,), f"head size {hd}"),
        "ffn_gate.weight": ((ffn, hidden), ffn_keys), "ffn_up.weight": ((ffn, hidden), ffn_keys),
        "ffn_down.weight": ((hidden, ffn), ffn_keys),
    }


def _check_shape(name: str, tensor: str, shape: tuple, expected: tuple, keys: str) -> None:
    if tuple(shape) != tuple(expected):
        raise InvalidCheckpointError(
            f"{name}: tensor '{tensor}' is {' x '.join(map(str, shape))} but the metadata "
            f"({keys}) implies {' x '.join(map(str, expected))}")


def check_tensors_match_metadata(header: GGUFHeader, config: dict, name: str) -> None:
    """block_count equals the blk.N groups present, numbered 0..N-1; each block has the core
    tensors and every tensor any other block has; every known tensor has the metadata's shape."""
    check_heads(header, config, name)
    p = header.architecture + "."
    blocks: dict[int, set[str]] = {}
    for tensor in header.tensors:
        m = _BLOCK.fullmatch(tensor)
        if m:
            blocks.setdefault(int(m.group(1)), set()).add(m.group(2))
    count = config["num_hidden_layers"]
    if len(blocks) != count:
        raise InvalidCheckpointError(
            f"{name}: {p}block_count is {count:,} but the file holds tensors for {len(blocks):,} blocks")
    stray = sorted(i for i in blocks if i >= count)
    if stray:
        raise InvalidCheckpointError(
            f"{name}: {p}block_count is {count:,} but the file has tensors for block {stray[0]:,}")
    every = set(f"{t}.weight" for t in CORE_BLOCK_TENSORS).union(*blocks.values())
    expected = _expected_shapes(header, config)
    for index in range(count):
        missing = sorted(every - blocks[index])
        if missing:
            raise InvalidCheckpointError(f"{name}: block {index} has no tensor blk.{index}.{missing[0]}")
        for part in sorted(blocks[index]):
            if part in expected:
                tensor = f"blk.{index}.{part}"
                _check_shape(name, tensor, header.tensors[tensor].shape, *expected[part])
    hidden = config["hidden_size"]
    for tensor in ("token_embd.weight", "output.weight"):
        info = header.tensors.get(tensor)
        if info is not None:
            _check_shape(name, tensor, info.shape, (config["vocab_size"], hidden), f"{p}embedding_length {hidden}")
    norm = header.tensors.get("output_norm.weight")
    if norm is None:
        raise InvalidCheckpointError(f"{name} has no output_norm.weight tensor")
    _check_shape(name, "output_norm.weight", norm.shape, (hidden,), f"{p}embedding_length {hidden}")
