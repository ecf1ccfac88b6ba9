"""Check a GGUF's metadata against the tensors it actually holds, before anything is written.

The config mlx-lm builds the model from comes from the metadata (``{arch}.block_count``, head
counts, widths), but the weights come from the tensor table: when the two disagree, mlx-lm
either builds a model of the metadata's size (``block_count`` 100,000: gigabytes allocated for
layers that have no weights) or the checkpoint written cannot load. Each disagreement is one
line naming the metadata key and the two numbers.
"""

from __future__ import annotations

import math
import re

from ..errors import InvalidCheckpointError
from .gguf_file import GGUFHeader

_BLOCK = re.compile(r"blk\.(\d+)\.(.+)")
# present in every block of every supported architecture
CORE_BLOCK_TENSORS = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output",
                      "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")
# the longest context a model may declare: above every released model (10M), and low enough
# that a lying value cannot size a cache or a mask into the terabytes
MAX_CONTEXT = 1 << 24
# tokenizer.ggml.* ids that index the vocabulary
# (padding and unknown ids out of range are dropped: tokenizer_config names no such token)
TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id", "eot_token_id", "eom_token_id")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check_metadata_values(header: GGUFHeader, name: str) -> None:
    """The metadata values the config takes as they are, in range: context length (zero or
    absurd: refused, not clamped), rotary base, norm epsilon, scaling factors, sliding window."""
    p = header.architecture + "."
    meta = header.metadata
    context = meta.get(p + "context_length")
    if context is not None and not (_is_int(context) and 0 < context <= MAX_CONTEXT):
        raise InvalidCheckpointError(
            f"{name} has {p}context_length {context!r}; it must be a number of tokens from 1 to {MAX_CONTEXT:,}")
    window = meta.get(p + "attention.sliding_window")
    if window is not None and not (_is_int(window) and 0 < window <= MAX_CONTEXT):
        raise InvalidCheckpointError(
            f"{name} has {p}attention.sliding_window {window!r}; it must be a number of tokens from 1 "
            f"to {MAX_CONTEXT:,}")
    # key -> (lowest allowed, exclusive; highest allowed, exclusive)
    bounds = {"rope.freq_base": (0, math.inf), "attention.layer_norm_rms_epsilon": (0, 1),
              "rope.scaling.factor": (0, math.inf), "attn_logit_softcapping": (0, math.inf),
              "final_logit_softcapping": (0, math.inf)}
    for key, (low, high) in bounds.items():
        value = meta.get(p + key)
        if value is not None and not (_is_number(value) and low < value < high):
            allowed = "a positive number" if high == math.inf else f"a number between {low} and {high}"
            raise InvalidCheckpointError(f"{name} has {p}{key} {value!r}; it must be {allowed}")


def check_vocabulary(header: GGUFHeader, name: str) -> None:
    """One vocabulary size everywhere: the token embedding's rows, the output head's rows,
    ``{arch}.vocab_size`` and the tokenizer's token list (llama.cpp refuses a file where they
    differ); the special-token ids inside it. A token id past the embedding reads memory that
    is not the model's."""
    p = header.architecture + "."
    meta = header.metadata
    embed = header.tensors.get("token_embd.weight")
    if embed is None:
        raise InvalidCheckpointError(f"{name} has no token_embd.weight tensor")
    rows = embed.shape[0]
    output = header.tensors.get("output.weight")
    if output is not None and output.shape[0] != rows:
        raise InvalidCheckpointError(
            f"{name}: tensor 'output.weight' has {output.shape[0]:,} rows (tokens) but 'token_embd.weight' "
            f"has {rows:,}")
    declared = meta.get(p + "vocab_size")
    if declared is not None and declared != rows:
        raise InvalidCheckpointError(
            f"{name} has {p}vocab_size {declared!r} but tensor 'token_embd.weight' has {rows:,} rows (tokens)")
    tokens = meta.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
        raise InvalidCheckpointError(
            f"{name} has no tokenizer vocabulary (tokenizer.ggml.tokens, a list of strings)")
    if len(tokens) != rows:
        raise InvalidCheckpointError(
            f"{name}: the tokenizer has {len(tokens):,} tokens (tokenizer.ggml.tokens) but tensor "
            f"'token_embd.weight' has {rows:,} rows")
    for key in ("token_type", "scores"):
        values = meta.get(f"tokenizer.ggml.{key}")
        if values is not None and (not isinstance(values, list) or len(values) != len(tokens)):
            count = f"{len(values):,} values" if isinstance(values, list) else repr(values)
            raise InvalidCheckpointError(
                f"{name} has tokenizer.ggml.{key} of {count} for {len(tokens):,} tokens")
    for key in TOKEN_ID_KEYS:
        value = meta.get(f"tokenizer.ggml.{key}")
        if value is not None and not (_is_int(value) and 0 <= value < len(tokens)):
            raise InvalidCheckpointError(
                f"{name} has tokenizer.ggml.{key} {value!r}, not a token of its {len(tokens):,}")


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
