"""The tiny checkpoints load through mlx-lm exactly like real ones and behave sanely."""

import json

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import RotatingKVCache, make_prompt_cache
from safetensors import safe_open

import tiny

ALL_FIXTURES = ["tiny_llama", "tiny_qwen3", "tiny_qwen3_draft", "tiny_swa", "tiny_qwen3_5",
                "tiny_vocab8", "tiny_mismatched_vocab"]
BPE_FIXTURES = [f for f in ALL_FIXTURES if f != "tiny_vocab8"]


def _load(path):
    return mlx_lm.load(str(path))


def _config_vocab(path):
    config = json.loads((path / "config.json").read_text())
    return config.get("text_config", config)["vocab_size"]


def _greedy_tokens(model, tokenizer, prompt, n):
    return [r.token for r in mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=n)]


@pytest.mark.parametrize("name", ALL_FIXTURES)
def test_loads_and_generates_greedily(request, name):
    path = request.getfixturevalue(name)
    model, tokenizer = _load(path)
    prompt = tokenizer.encode("abc" if name == "tiny_vocab8" else "def add(a, b):")
    first = _greedy_tokens(model, tokenizer, prompt, 20)
    assert 0 < len(first) <= 20
    assert len(first) == 20 or first[-1] in tokenizer.eos_token_ids
    assert all(0 <= t < _config_vocab(path) for t in first)
    assert _greedy_tokens(model, tokenizer, prompt, 20) == first  # greedy is deterministic
    assert isinstance(mlx_lm.generate(model, tokenizer, prompt, max_tokens=20), str)


@pytest.mark.parametrize("name", ALL_FIXTURES)
def test_tokenizer_and_chat_template(request, name):
    path = request.getfixturevalue(name)
    model, tokenizer = _load(path)
    n_tokens, special = tiny.tokenizer_info(path)
    assert n_tokens == _config_vocab(path) == model(mx.array([[0]])).shape[-1]
    assert {special["<|im_end|>"], special["<|endoftext|>"]} <= set(tokenizer.eos_token_ids)
    assert tokenizer.chat_template is not None

    text = "abcde" if name == "tiny_vocab8" else "def add(a, b):\n    return a + b  # héllo, wörld ✓\n"
    assert tokenizer.decode(tokenizer.encode(text)) == text

    messages = [{"role": "user", "content": "Write a function."}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert ids[0] == special["<|im_start|>"] and special["<|im_end|>"] in ids
    if name != "tiny_vocab8":  # the character tokenizer drops what it cannot spell
        rendered = tokenizer.decode(ids)
        assert rendered == "<|im_start|>user\nWrite a function.<|im_end|>\n<|im_start|>assistant\n"


def test_draft_shares_tokenizer_and_mismatch_does_not(tiny_qwen3, tiny_qwen3_draft, tiny_mismatched_vocab):
    assert (tiny_qwen3 / "tokenizer.json").read_text() == (tiny_qwen3_draft / "tokenizer.json").read_text()
    assert _config_vocab(tiny_qwen3) == _config_vocab(tiny_qwen3_draft)
    assert _config_vocab(tiny_mismatched_vocab) != _config_vocab(tiny_qwen3)
    draft_config = json.loads((tiny_qwen3_draft / "config.json").read_text())
    assert draft_config["hidden_size"] < json.loads((tiny_qwen3 / "config.json").read_text())["hidden_size"]


@pytest.mark.parametrize("name", ["tiny_llama", "tiny_qwen3", "tiny_qwen3_5"])
def test_greedy_logits_are_not_near_ties(request, name):
    model, tokenizer = _load(request.getfixturevalue(name))
    logits = model(mx.array([tokenizer.encode("import os\nprint('hello world')\n")]))[0]
    top2 = mx.sort(logits, axis=-1)[:, -2:]
    gaps = (top2[:, 1] - top2[:, 0]).tolist()
    assert sorted(gaps)[len(gaps) // 2] > 1e-2
    assert sum(g > 1e-3 for g in gaps) >= 0.9 * len(gaps)


def test_vocab8_distributions_are_broad(tiny_vocab8):
    model, tokenizer = _load(tiny_vocab8)
    probs = mx.softmax(model(mx.array([tokenizer.encode("abcdeabcde")]))[0], axis=-1)
    assert probs.shape[-1] == 8
    assert mx.max(probs).item() < 0.9
    assert mx.min(mx.sum(probs > 0.05, axis=-1)).item() >= 3  # several tokens carry real mass


def test_swa_cache_rotates(tiny_swa):
    model, tokenizer = _load(tiny_swa)
    window = json.loads((tiny_swa / "config.json").read_text())["sliding_window"]
    cache = make_prompt_cache(model)
    assert any(isinstance(c, RotatingKVCache) for c in cache)
    prompt = mx.array(tokenizer.encode("def f(x):"))
    steps = list(zip(range(60), generate_step(prompt, model, prompt_cache=cache)))
    assert len(steps) == 60
    rotating = [c for c in cache if isinstance(c, RotatingKVCache)]
    assert all(c.offset > window and c.keys.shape[2] == window for c in rotating)


def test_qwen3_5_checkpoint_layout(tiny_qwen3_5):
    config = json.loads((tiny_qwen3_5 / "config.json").read_text())
    text = config["text_config"]
    assert config["architectures"] == ["Qwen3_5ForConditionalGeneration"]
    assert "linear_attention" in text["layer_types"] and "full_attention" in text["layer_types"]
    with safe_open(tiny_qwen3_5 / "model.safetensors", framework="numpy") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        mtp_norm = f.get_tensor("mtp.norm.weight")
        trunk_norm = f.get_tensor("model.language_model.norm.weight")
    assert shapes == {**{k: v for k, v in shapes.items() if not k.startswith("mtp.")},
                      **tiny.qwen3_5_mtp_shapes(text)}
    assert len([k for k in shapes if k.startswith("mtp.")]) == 15
    h = text["hidden_size"]
    assert shapes["mtp.fc.weight"] == (h, 2 * h)
    assert shapes["mtp.layers.0.self_attn.q_proj.weight"] == (2 * text["num_attention_heads"] * text["head_dim"], h)
    assert "lm_head.weight" in shapes
    assert "model.language_model.layers.0.linear_attn.in_proj_qkv.weight" in shapes
    assert "model.language_model.layers.1.self_attn.q_norm.weight" in shapes
    conv = shapes["model.language_model.layers.0.linear_attn.conv1d.weight"]
    assert conv[1:] == (1, text["linear_conv_kernel_dim"])  # HF (C, 1, K)
    # Zero-centred RMSNorm weights, as in the real HF checkpoint.
    assert abs(float(mtp_norm.mean())) < 0.5 and abs(float(trunk_norm.mean())) < 0.5

    model, _ = _load(tiny_qwen3_5)  # mlx-lm drops mtp.*, adds +1 to the trunk norms
    assert abs(float(model.language_model.model.norm.weight.mean().item()) - 1.0) < 0.5
    assert [type(c).__name__ for c in make_prompt_cache(model)] == [
        "ArraysCache", "KVCache", "ArraysCache", "KVCache"]
