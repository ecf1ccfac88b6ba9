"""How often a DFlash drafter's tokens are kept under three exact-or-not acceptance rules, on
real text, per block position: what our Leviathan/Chen rule gains over "sample-match".

At block position i, with p the target's processed distribution there (temperature, top-p...
applied, given the text before it) and q the drafter's:
- ours (Leviathan/Chen with q_i): the draft is drawn from q and kept with min(1, p/q):
  P(keep) = sum_x min(p(x), q(x)); exact.
- sample-match (z-lab's and mlx-vlm's temperature > 0 path): the draft is drawn from q, the
  target draws its own token from p, the draft is kept when they are equal: sum_x p(x) q(x);
  exact too, but it throws away agreeing mass.
- greedy draft + target draw: the draft is argmax q, kept when the target's draw equals it:
  p(argmax q).
These are the chances that position i is kept given positions before it were (the text's own
tokens stand for the accepted prefix). Usage (CPU is fine for the mini models):

    python scripts/acceptance_rules.py TARGET DRAFTER --text FILE [--temps 0.7,1.0] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from mlxspec.engine.cache import ModelState  # noqa: E402
from mlxspec.engine.drafters.dflash import DFlashDrafter  # noqa: E402
from mlxspec.engine.sampling import SamplingParams  # noqa: E402
from mlxspec.models.loader import load_model  # noqa: E402


def probabilities(logprobs: mx.array) -> np.ndarray:
    return np.exp(np.array(logprobs.astype(mx.float32), np.float64))


def rule_rates(target, drafter_model, ids: list[int], temps: list[float], anchors: int, seed: int = 0) -> dict:
    """Mean keep-probabilities per block position and rule, at each temperature."""
    drafter = DFlashDrafter(drafter_model, target)
    k = drafter.block - 1
    state = ModelState(target, keep_hidden=True, capture=drafter.capture_layers)
    feats = state.prefill(ids)
    state.close()
    logits_all = target(mx.array(ids)[None])[0]  # the target's rows along the text
    rng = np.random.default_rng(seed)
    points = sorted(rng.choice(np.arange(16, len(ids) - k - 1), size=min(anchors, len(ids) - k - 17), replace=False))
    out = {}
    for temp in temps:
        sampling = SamplingParams(temperature=temp)
        sums = np.zeros((3, k))
        for a in points:  # tokens[:a+1] committed: the block starts at token a
            drafter.start(ids[: a + 1])
            drafter.add_hidden(feats[:a])
            q = probabilities(sampling.logprobs(drafter.block_logits(ids[: a + 1], k)))
            p = probabilities(sampling.logprobs(logits_all[a : a + k]))  # the target after tokens a..a+k-1
            sums[0] += np.minimum(p, q).sum(-1)
            sums[1] += (p * q).sum(-1)
            sums[2] += p[np.arange(k), q.argmax(-1)]
        rates = sums / len(points)
        out[str(temp)] = {"ours": rates[0].round(4).tolist(), "sample_match": rates[1].round(4).tolist(),
                          "greedy_draft": rates[2].round(4).tolist()}
    return {"anchors": len(points), "block": drafter.block, "by_temperature": out}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("target")
    ap.add_argument("drafter")
    ap.add_argument("--text", required=True, help="held-out text file")
    ap.add_argument("--temps", default="0.7,1.0")
    ap.add_argument("--anchors", type=int, default=200)
    ap.add_argument("--max-tokens", type=int, default=2048)
    ap.add_argument("--json")
    args = ap.parse_args()
    target = load_model(args.target)
    drafter = load_model(args.drafter)
    ids = target.tokenizer.encode(Path(args.text).read_text(encoding="utf-8"))[: args.max_tokens]
    result = rule_rates(target.model, drafter.model, ids, [float(t) for t in args.temps.split(",")], args.anchors)
    result.update(target=args.target, drafter=args.drafter, text=args.text, tokens=len(ids))
    text = json.dumps(result, indent=1)
    if args.json:
        Path(args.json).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
