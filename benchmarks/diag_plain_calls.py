"""Host work of a plain token: Python calls per token of stock mlx-lm's ``generate_step`` and of
mlxspec's loop with ``--drafter none``, counted by cProfile over the same tiny 36-layer Qwen3 (any
device: the count does not depend on it).

    python3 benchmarks/diag_plain_calls.py [--tokens 200]

Where decoding is host-bound (two GPUs of one host, docs/distributed.md), extra Python work a
token would show as a lower tok/s than stock's.
"""

import argparse
import cProfile
import pstats

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.models import qwen3

from mlxspec.engine.sampling import SamplingParams
from mlxspec.engine.speculate import SpeculativeDecoder

ARGS = qwen3.ModelArgs(model_type="qwen3", hidden_size=64, num_hidden_layers=36, intermediate_size=128,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=32, rms_norm_eps=1e-6,
                       vocab_size=256, max_position_embeddings=4096, rope_theta=1e6, tie_word_embeddings=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=200)
    n = ap.parse_args().tokens
    model = qwen3.Model(ARGS)
    mx.eval(model.parameters())
    prompt = [(7 * i) % 256 for i in range(64)]

    def stock():
        for _ in generate_step(mx.array(prompt, mx.uint32), model, max_tokens=n):
            pass

    def mlxspec():
        for _ in SpeculativeDecoder(model, drafter="none", cost=None).generate(
                prompt, sampling=SamplingParams(0.0), max_tokens=n):
            pass

    for name, run in (("mlx-lm generate_step", stock), ("mlxspec --drafter none", mlxspec)):
        run()  # warm
        profile = cProfile.Profile()
        profile.enable()
        run()
        profile.disable()
        print(f"{name}: {pstats.Stats(profile).total_calls / n:.1f} Python calls a token")


if __name__ == "__main__":
    main()
