"""A head trained to be right is accepted often; the same head with raw zero-centred norms
left unfixed is not. Shows the whole MTP path (hidden states, pairs, chain, cache) works."""

import shutil

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import mlx_lm
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step

from mlxspec.engine.speculate import SpeculativeDecoder
from mlxspec.models.mtp import load_mtp_head
from mlxspec.models.trunk import split_trunk

N_SEQ, PROMPT_LEN, GEN = 12, 8, 40


def greedy(model, prompt, n):
    return [t for (t, _), _ in zip(generate_step(mx.array(prompt), model, max_tokens=n), range(n))]


def train_head(model, head, seqs, steps=80):
    """Fit the head to predict x_{t+2} from (h_t, x_{t+1}) on the target's own outputs.
    Measured (CPU): acceptance is already 1.00 after 60 steps (loss 0.003) and stays there; 80
    keeps a margin over the 0.9 the tests ask for (150 took twice the time for the same 1.00)."""
    trunk = split_trunk(model)
    x = mx.array(seqs)
    hidden = mx.stop_gradient(trunk.body(x))
    emb = mx.stop_gradient(trunk.embed(x[:, 1:-1]))
    targets = x[:, 2:]

    def loss_fn(module):
        out = module(emb, hidden[:, :-2], [None] * len(module.layers))
        return nn.losses.cross_entropy(trunk.head(out), targets, reduction="mean")

    opt = optim.Adam(learning_rate=3e-3)
    step = nn.value_and_grad(head.module, loss_fn)
    for _ in range(steps):
        loss, grads = step(head.module)
        opt.update(head.module, grads)
        mx.eval(head.module.parameters(), opt.state)
    return loss.item()


def acceptance(model, head, prompts, references, depth=1):
    """Depth 1: the head was trained on trunk hidden states, not on its own recycled ones.
    REFERENCES: each prompt's plain greedy decoding (computed once, in the fixture)."""
    drafted = accepted = 0
    for prompt, reference in zip(prompts, references, strict=True):
        dec = SpeculativeDecoder(model, mtp_head=head, drafter="mtp", depth=depth, gates=False)
        out, stats = [], None
        for toks, stats in dec.generate(prompt, max_tokens=GEN):
            out.extend(toks)
        assert out == reference  # exact whatever the head does
        drafted += stats.drafted
        accepted += stats.accepted
    return accepted / drafted


@pytest.fixture(scope="module")
def trained(tiny_qwen3_5, tmp_path_factory):
    model, _, config = mlx_lm.load(str(tiny_qwen3_5), return_config=True)
    head = load_mtp_head(model, tiny_qwen3_5, config)
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(3, 500, PROMPT_LEN)] for _ in range(N_SEQ)]
    # plain greedy decoding of every prompt: the training sequences, and the references the
    # speculative outputs below must equal (deterministic, so computed once, not per check)
    references = [greedy(model, p, GEN) for p in prompts]
    seqs = [p + r for p, r in zip(prompts, references)]
    before = acceptance(model, head, prompts[:4], references[:4])
    loss = train_head(model, head, seqs)
    return model, head, config, prompts, references, before, loss


def test_trained_head_is_accepted(trained):
    model, head, _, prompts, references, before, loss = trained
    after = acceptance(model, head, prompts[:4], references[:4])
    print(f"acceptance untrained {before:.2f}, trained {after:.2f} (loss {loss:.3f})")
    assert before < 0.2
    assert after > 0.9


def test_zero_centred_checkpoint_round_trip(trained, tiny_qwen3_5, tmp_path):
    """Save the trained head as a raw Hugging Face checkpoint stores it (norms as w - 1):
    the loader adds the 1 back and acceptance stays; skipping that fix ruins it."""
    model, head, config, prompts, references, _, _ = trained
    raw = {}
    for name, value in tree_flatten(head.module.parameters()):
        raw["mtp." + name] = value - 1.0 if name.endswith("norm.weight") else value
    path = tmp_path / "ckpt"
    shutil.copytree(tiny_qwen3_5, path)
    weights = {k: v for k, v in mx.load(str(path / "model.safetensors")).items() if not k.startswith("mtp.")}
    mx.save_safetensors(str(path / "model.safetensors"), {**weights, **raw}, metadata={"format": "pt"})
    loaded = load_mtp_head(model, path, config)
    fixed = acceptance(model, loaded, prompts[:4], references[:4])
    assert fixed > 0.9
    # the same tensors loaded without the +1: the head is wrong and drafts are rejected
    loaded.module.load_weights([(k[4:], v) for k, v in raw.items() if k.endswith("norm.weight")], strict=False)
    assert acceptance(model, loaded, prompts[:4], references[:4]) < 0.2
