"""Does a drafter that needs the target's hidden rows (MTP heads, Gemma 4's assistant) change
the graph of a plain step? Builds a random model of each shape, feeds a short prompt, and
counts the MLX operations of one 1-token forward and its greedy sample with the target run
as `--drafter none` runs it (``ModelState(model)``) and as a hidden-row drafter needs it
(``keep_hidden=True``: the trunk and the head called apart, the last hidden row kept). On CUDA
the host builds and encodes every operation, so a plain step that grew would cost a drafter
switched off by its gate time on every token. Nothing is evaluated but the prompt.

    python3 benchmarks/diag_plain_graph.py --shapes smoke-moe,smoke-gemma4-moe
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.diag_op_census import census  # noqa: E402
from mlxspec.bench.synthetic import random_model  # noqa: E402
from mlxspec.engine.cache import ModelState  # noqa: E402


def plain_step(model, keep_hidden: bool) -> collections.Counter:
    state = ModelState(model, keep_hidden=keep_hidden)
    state.forward(mx.array(list(range(1, 40)), mx.uint32), rollback=False)
    mx.eval([c.state for c in state.cache])
    token = mx.argmax(state.forward(mx.array([5], mx.uint32), rollback=False)[-1:], axis=-1)
    return census(token, *([state.hidden[-1:]] if keep_hidden else []))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="smoke-moe,smoke-gemma4-moe")
    args = ap.parse_args()
    for shape in args.shapes.split(","):
        model = random_model(shape, bits=4)
        plain, hidden = plain_step(model, False), plain_step(model, True)
        differ = {k: (plain[k], hidden[k]) for k in sorted(set(plain) | set(hidden)) if plain[k] != hidden[k]}
        print(f"{shape}: {sum(plain.values())} operations as `none`, {sum(hidden.values())} keeping the "
              f"hidden row; differing: {differ}")


if __name__ == "__main__":
    main()
