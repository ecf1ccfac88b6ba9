"""The packaged demo model loads offline through mlx-lm and writes Python-looking text."""

import json

import mlx_lm

from mlxspec.models.demo import DEMO_NAME, demo_model_path

DEMO_FILES = ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
              "special_tokens_map.json", "MODEL_CARD.md"]


def test_demo_assets_are_present_and_small():
    path = demo_model_path()
    assert DEMO_NAME == "mlxspec-demo"
    assert all((path / name).is_file() for name in DEMO_FILES)
    assert sum(f.stat().st_size for f in path.iterdir()) < 4 * 1024 * 1024
    assert json.loads((path / "config.json").read_text())["model_type"] == "qwen3"


def test_demo_answers_a_chat_prompt_with_code():
    model, tokenizer = mlx_lm.load(str(demo_model_path()))
    messages = [{"role": "user", "content": "Write a Python function that adds two numbers."}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    text = mlx_lm.generate(model, tokenizer, prompt, max_tokens=60)
    assert "def " in text or "return" in text or "self" in text
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in tokenizer.eos_token_ids
