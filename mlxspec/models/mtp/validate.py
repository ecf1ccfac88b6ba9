"""Check a found MTP / NextN head against its config: every tensor present, every shape right.

The names and shapes are those of the published checkpoints and of vLLM's and sglang's MTP
loaders. A quantized weight only has its companions' presence checked (its stored shape is
packed). Each failure is one :class:`InvalidCheckpointError` line naming the tensor.
"""

from __future__ import annotations

from ...errors import InvalidCheckpointError


def _get(cfg: dict, key: str, default=None):
    value = cfg.get(key)
    return default if value is None else value


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


def validate_head(tensors: dict, source: str, quant_mode: str | None, text: dict,
                  model_type: str, family: str, num_layers: int) -> None:
    """Raise :class:`InvalidCheckpointError` unless the head in ``tensors`` (normalised names,
    read from ``source``) has every tensor ``text`` (the text model's config) calls for."""
    checker = _Checker(tensors, source, quant_mode)
    try:
        if family == "qwen3_5":
            _validate_qwen(checker, text, num_layers)
        else:
            _validate_nextn(checker, text, model_type, num_layers)
    except KeyError as err:
        raise InvalidCheckpointError(f"config.json lacks {err.args[0]!r}, needed to check the MTP head") from None
