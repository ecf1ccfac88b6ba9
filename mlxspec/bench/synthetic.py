"""Random-weight models in the shapes of real checkpoints, for timing forwards.

A forward costs the same whatever the weights are, so a random model of a real shape measures
what that checkpoint's decode and verify steps cost without downloading it. Weights are made
directly in bfloat16 and quantized one decoder layer at a time, each layer evaluated before the
next is made, so even the 27B shape needs little more than its quantized size in memory.

Used by ``mlxspec bench --sweep`` / ``--real-shapes`` (which also times a DFlash drafter's block
step and tree verifies here) and the scripts in ``benchmarks/``.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from .gemma4_shapes import GEMMA4
from .gemma4_shapes import target_config as gemma4_target_config

# Dense Qwen3 shapes: hidden, layers, heads, kv heads, intermediate, head_dim, vocab, tied
# embeddings (the real checkpoints' config.json values).
DENSE = {
    "smoke": (256, 2, 4, 2, 512, 64, 1024, False),  # a quick check on a CPU
    "qwen3-0.6b": (1024, 28, 16, 8, 3072, 128, 151936, True),
    "qwen3-1.7b": (2048, 28, 16, 8, 6144, 128, 151936, True),
    "qwen3-8b": (4096, 36, 32, 8, 12288, 128, 151936, False),
}

# Qwen3.5 / 3.6 hybrids (qwen3_5: 3 of every 4 layers GatedDeltaNet, the 4th full attention).
# qwen3.6-27b is Qwen3.6-27B's text_config (as published for Qwen3.5-27B / nvidia's
# Qwen3.6-27B-NVFP4). qwen3.5-9b-like: the published Qwen3.5-9B attention and MLP sizes
# (hidden 4096, 16 heads of 256, 4 kv heads, intermediate 12288); its layer count and
# linear-attention heads are the family's pattern, not read from its config.
_HYBRID_COMMON = dict(full_attention_interval=4, linear_conv_kernel_dim=4, rms_norm_eps=1e-6,
                      linear_key_head_dim=128, linear_value_head_dim=128)
HYBRID = {
    "smoke-hybrid": dict(hidden_size=256, num_hidden_layers=4, intermediate_size=512,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                         linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64,
                         linear_value_head_dim=64, vocab_size=1024, tie_word_embeddings=False),
    "qwen3.5-9b-like": dict(hidden_size=4096, num_hidden_layers=32, intermediate_size=12288,
                            num_attention_heads=16, num_key_value_heads=4, head_dim=256,
                            linear_num_key_heads=16, linear_num_value_heads=32,
                            vocab_size=248320, tie_word_embeddings=False),
    "qwen3.6-27b": dict(hidden_size=5120, num_hidden_layers=64, intermediate_size=17408,
                        num_attention_heads=24, num_key_value_heads=4, head_dim=256,
                        linear_num_key_heads=16, linear_num_value_heads=48,
                        vocab_size=248320, tie_word_embeddings=False),
}
# Qwen3.6-35B-A3B's text_config (its published config.json): 40 layers, 256 experts of 512, 8
# routed per token plus a shared expert; each verified token activates its own experts.
HYBRID["qwen3.6-35b-a3b"] = dict(
    hidden_size=2048, num_hidden_layers=40, intermediate_size=512, num_attention_heads=16,
    num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32,
    num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
    shared_expert_intermediate_size=512, norm_topk_prob=True, vocab_size=248320,
    tie_word_embeddings=False)
HYBRID["smoke-moe"] = dict(  # a quick check of the MoE path on a CPU
    hidden_size=128, num_hidden_layers=4, intermediate_size=64, num_attention_heads=4,
    num_key_value_heads=2, head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4,
    linear_key_head_dim=64, linear_value_head_dim=64, num_experts=8, num_experts_per_tok=2,
    moe_intermediate_size=64, shared_expert_intermediate_size=64, vocab_size=1024,
    tie_word_embeddings=False)
# Gemma-4 31B and 26B-A4B (text model) and a tiny one: see gemma4_shapes.py and its sources
SHAPES = tuple(DENSE) + tuple(HYBRID) + tuple(GEMMA4)
MOE = ("qwen3.6-35b-a3b", "smoke-moe")

# DFlash block drafters (z-lab layout, models/dflash.py) of the published sizes: the target's
# width, attention heads and intermediate size, 5 layers, block 16. Qwen3-8B-DFlash-b16's layer
# count and ids are derived as z-lab's reference does (target_layer_ids by
# default_target_layer_ids(36, 5) = [1, 9, 17, 25, 33]); for Qwen3.6-27B, z-lab's
# Qwen3.5-27B-DFlash at the target's width 5120, ids default for 64 layers. Values: (draft
# layers, block size, target_layer_ids or None for the default).
DFLASH = {
    "smoke": (2, 16, [0, 1]),  # quick checks on a CPU
    "smoke-hybrid": (2, 16, [1, 3]),
    "qwen3-8b": (5, 16, None),
    "qwen3.6-27b": (5, 16, None),
}


def shape_config(shape: str, vocab: int | None = None) -> dict:
    """The mlx-lm config (``model_type`` + fields) of a named shape."""
    if shape in DENSE:
        hidden, layers, heads, kv, inter, head_dim, n_vocab, tied = DENSE[shape]
        return dict(model_type="qwen3", hidden_size=hidden, num_hidden_layers=layers,
                    intermediate_size=inter, num_attention_heads=heads, num_key_value_heads=kv,
                    head_dim=head_dim, rms_norm_eps=1e-6, vocab_size=vocab or n_vocab,
                    max_position_embeddings=32768, rope_theta=1e6, tie_word_embeddings=tied)
    if shape in HYBRID:
        moe = shape in MOE
        text = {**_HYBRID_COMMON, **HYBRID[shape],
                "model_type": "qwen3_5_moe_text" if moe else "qwen3_5_text"}
        if vocab:
            text["vocab_size"] = vocab
        text["rope_parameters"] = {"type": "default", "mrope_section": [11, 11, 10],
                                   "rope_theta": 10000000, "partial_rotary_factor": 0.25}
        return dict(model_type="qwen3_5_moe" if moe else "qwen3_5", text_config=text)
    if shape in GEMMA4:
        return gemma4_target_config(shape, vocab)
    raise KeyError(shape)


def vocab_size(shape: str) -> int:
    config = shape_config(shape)
    return config.get("text_config", config)["vocab_size"]


def _fill(path: str, p: mx.array, scale: float) -> mx.array:
    if path.endswith("A_log"):
        return mx.zeros(p.shape, mx.float32)  # kept in float32 like real checkpoints; A = -1
    if p.ndim > 1:
        return mx.random.normal(p.shape, dtype=mx.bfloat16) * scale
    return mx.ones(p.shape, mx.bfloat16)  # norms


def _randomize(module: nn.Module, scale: float, skip_layers: bool = False) -> None:
    """Replace ``module``'s parameters by random bf16 ones (all but the decoder layers' if
    ``skip_layers``); nothing is evaluated here."""
    flat = [(k, v) for k, v in tree_flatten(module.parameters())
            if not (skip_layers and ".layers." in "." + k)]
    module.update(tree_unflatten([(k, _fill(k, v, scale)) for k, v in flat]))


def _quantizable(group_size: int):
    # mlx-lm's rule: layers with to_quantized() whose rows split into whole groups
    return lambda _, m: hasattr(m, "to_quantized") and m.weight.shape[-1] % group_size == 0


def random_model(shape: str, vocab: int | None = None, bits: int = 4, group_size: int = 64,
                 seed: int = 0, kernels: bool = True) -> nn.Module:
    """A model of ``shape`` (see :data:`SHAPES`) with random bf16 weights, quantized to ``bits``
    (0: none), every array evaluated. ``vocab`` overrides the shape's vocabulary size.
    ``kernels``: install mlxspec's CUDA kernels as a loaded checkpoint gets them; False leaves
    the model (and the process) stock mlx-lm, never importing :mod:`mlxspec.kernels`."""
    config = shape_config(shape, vocab)
    if config["model_type"] == "qwen3":
        from mlx_lm.models import qwen3

        model, scale = qwen3.Model(qwen3.ModelArgs(**config)), 0.05
    elif config["model_type"] == "qwen3_5_moe":
        from mlx_lm.models import qwen3_5_moe

        model, scale = qwen3_5_moe.Model(qwen3_5_moe.ModelArgs.from_dict(config)), 0.02
    elif config["model_type"] == "gemma4_text":
        from mlx_lm.models import gemma4_text

        model, scale = gemma4_text.Model(gemma4_text.ModelArgs.from_dict(config)), 0.02
    else:
        from mlx_lm.models import qwen3_5

        model, scale = qwen3_5.Model(qwen3_5.ModelArgs(**config)), 0.02
    # Nothing above is evaluated (MLX is lazy): the float32 initial values are replaced before
    # they exist. The embedding and LM head first, one at a time (their random bf16 values, and
    # the float32 the generator makes on the way, are the largest transients: made while little
    # else is resident), then layer by layer: bf16 weights, quantized, evaluated, the next.
    mx.random.seed(seed)
    outside = lambda path: ".layers." not in "." + path  # noqa: E731
    _randomize(model, scale, skip_layers=True)
    if bits:
        fits = _quantizable(group_size)
        nn.quantize(model, group_size=group_size, bits=bits,
                    class_predicate=lambda path, m: outside(path) and fits(path, m))
    for path, value in tree_flatten(model.parameters()):
        if outside(path):
            mx.eval(value)
    # Gemma 4's routers at 8 bits, as mlx-lm converts them (the Qwen shapes keep their recorded rule)
    own = model.quant_predicate if config["model_type"] == "gemma4_text" else None
    fits = _quantizable(group_size)
    in_layer = (lambda p, m: fits(p, m) and own(p, m)) if own else fits  # noqa: E731
    for layer in model.layers:
        _randomize(layer, scale)
        if bits:
            nn.quantize(layer, group_size=group_size, bits=bits, class_predicate=in_layer)
        mx.eval(layer.parameters())
    if kernels:
        from ..kernels import install

        install(model)  # as a loaded checkpoint gets (CUDA verify kernels)
    return model


def random_mtp_head(model: nn.Module, shape: str, bits: int = 4, group_size: int = 64, seed: int = 1,
                    kernels: bool = True):
    """A one-layer Qwen3.5-layout MTP head (fc, two pre-norms, a full-attention decoder layer
    with the trunk's MLP kind, final norm; the trunk's lm_head) with random weights, bound to
    ``model``: its real cost, for timing. Dense Qwen3 shapes ship no head; theirs is the same
    layout at the trunk's sizes. ``kernels`` False: none of mlxspec's kernels installed (``bench
    --sharded`` installs them after sharding, and takes them out for its in-process baseline)."""
    from mlx_lm.models.qwen3_5 import TextModelArgs

    from ..models.mtp.head import MTPHead, QwenMTPHead
    from ..models.trunk import split_trunk

    config = shape_config(shape)
    text = dict(config.get("text_config", config))
    if "text_config" not in config:  # a dense Qwen3 shape: the head's layer at its sizes
        text.update(full_attention_interval=4, linear_num_key_heads=1, linear_num_value_heads=1,
                    linear_key_head_dim=64, linear_value_head_dim=64, linear_conv_kernel_dim=4,
                    rope_parameters={"type": "default", "rope_theta": 1e6, "partial_rotary_factor": 1.0})
    args = TextModelArgs.from_dict(text)
    module = QwenMTPHead(args, 1)
    mx.random.seed(seed)
    _randomize(module, 0.02)
    if bits:
        nn.quantize(module, group_size=group_size, bits=bits, class_predicate=_quantizable(group_size))
    mx.eval(module.parameters())
    if kernels:
        from ..kernels import install

        install(module)
    nbytes = sum(v.nbytes for _, v in tree_flatten(module.parameters()))
    return MTPHead(module, split_trunk(model), nbytes, f"random {shape} head")


def dflash_args(shape: str, vocab: int | None = None):
    """The DFlashArgs of ``shape``'s DFlash drafter (:data:`DFLASH`)."""
    from ..models.dflash import DFlashArgs, default_target_layer_ids

    layers, block, ids = DFLASH[shape]
    config = shape_config(shape, vocab)
    text = config.get("text_config", config)
    n = text["num_hidden_layers"]
    rope = text.get("rope_parameters") or {}
    return DFlashArgs(
        hidden_size=text["hidden_size"], num_hidden_layers=layers,
        num_attention_heads=text["num_attention_heads"], num_key_value_heads=text["num_key_value_heads"],
        head_dim=text["head_dim"], intermediate_size=text["intermediate_size"], vocab_size=text["vocab_size"],
        block_size=block, target_layer_ids=tuple(ids or default_target_layer_ids(n, layers)),
        num_target_layers=n, mask_token_id=text["vocab_size"] - 1,
        rope_theta=text.get("rope_theta", rope.get("rope_theta", 1e6)))


def random_dflash(model: nn.Module, shape: str, bits: int = 4, group_size: int = 64, seed: int = 4):
    """A DFlash drafter of ``shape``'s published size (:data:`DFLASH`) with random weights,
    quantized to ``bits`` (0: bf16) as the MTP head is, checked against ``model``: its real
    block-forward cost, for timing. No CUDA kernels installed: a loaded drafter gets none."""
    from ..models.dflash import DFlashDraftModel, check_pair

    drafter = DFlashDraftModel(dflash_args(shape))
    mx.random.seed(seed)
    _randomize(drafter, 0.02)
    if bits:
        nn.quantize(drafter, group_size=group_size, bits=bits, class_predicate=_quantizable(group_size))
    mx.eval(drafter.parameters())
    check_pair(model, drafter, f"random {shape} drafter")
    return drafter


def random_assistant(model: nn.Module, assistant_config: dict, bits: int = 4, group_size: int = 64,
                     seed: int = 3):
    """A Gemma-4 assistant of ``assistant_config`` (an assistant's config.json, e.g. a real
    checkpoint's) with random weights, fitted to ``model`` (a Gemma-4 target: its hidden size
    and vocabulary) and quantized to ``bits`` (0: none): its real draft-step cost, for timing.
    A sparse head gets a random token ordering."""
    import copy

    from ..models.gemma4_assistant import Gemma4Assistant, check_pair, text_args

    args = text_args(model)
    config = copy.deepcopy(assistant_config)
    config["backbone_hidden_size"] = args.hidden_size
    config["text_config"]["vocab_size"] = args.vocab_size
    assistant = Gemma4Assistant(config)
    mx.random.seed(seed)
    _randomize(assistant, 0.02)
    if assistant.masked_embedding is not None:
        assistant.masked_embedding.token_ordering = mx.random.permutation(args.vocab_size).astype(mx.int32)
    if bits:
        nn.quantize(assistant, group_size=group_size, bits=bits, class_predicate=_quantizable(group_size))
    mx.eval(assistant.parameters())
    check_pair(model, assistant)
    return assistant


def dflash_step_ms(drafter, model, context: int, reps: int) -> float:
    """Median ms of one DFlash block step (the block forward over a context of ``context``
    positions, the LM head over the block's drafted rows, a greedy pick), through the drafter."""
    import statistics

    from ..engine.costs import call_times
    from ..engine.drafters.dflash import DFlashDrafter

    d = DFlashDrafter(drafter, model, cost_per_step=0.0)
    width = len(drafter.args.target_layer_ids) * drafter.args.hidden_size
    d.add_hidden((mx.random.normal((context, width)) * 0.5).astype(mx.bfloat16))
    tokens = [(5 * i) % drafter.args.vocab_size for i in range(context + 1)]

    def one():
        mx.eval(mx.argmax(d.block_logits(tokens, d.block - 1), axis=-1))

    return 1e3 * statistics.median(call_times(one, reps, warmup=1))


def tree_ms(model, trees: dict, context: int, reps: int, vocab: int) -> dict[int, float]:
    """Median ms of a tree verify (``engine/tree_forward``) of each tree (node count -> DraftTree)
    over a cache of ``context`` tokens, in interleaved rounds; {} where the target cannot verify
    trees. Each verify is dropped whole, so every call meets the same key length, as a bench
    cell's repetitions meet theirs (the same script each time): on CUDA, trees of 17 and 33 rows
    timed at a new key length each call cost 3x what they cost in the runs (past the verify
    kernel's 16 query rows, MLX's attention seems to build work per key length)."""
    import statistics
    import time

    from ..engine.cache import ModelState
    from ..engine.tree_forward import TreeUnsupported, keep_path, tree_forward

    state = ModelState(model)
    state.prefill([(7 * i) % vocab for i in range(context)])

    def one(tree) -> float:
        start = state.length
        t0 = time.perf_counter()
        mx.eval(tree_forward(state, tree.inputs(start % vocab), tree.parents_with_root()))
        seconds = time.perf_counter() - t0
        keep_path(state, start, [])
        return seconds

    try:
        for tree in trees.values():  # untimed: kernels are built per new shape
            one(tree)
    except TreeUnsupported:
        return {}
    times: dict[int, list[float]] = {n: [] for n in trees}
    order = list(trees)
    for rep in range(reps):
        for n in (order if rep % 2 == 0 else order[::-1]):
            times[n].append(one(trees[n]))
    return {n: 1e3 * statistics.median(t) for n, t in times.items()}
