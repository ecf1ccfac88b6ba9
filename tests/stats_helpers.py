"""Shared statistics for the distribution tests."""

from collections import Counter

import mlx.core as mx
import numpy as np
from scipy.stats import chisquare


def chi_square_p(counts: Counter, probs: dict, n: int) -> float:
    """Goodness of fit, pooling cells whose expected count is under 5."""
    keys = sorted(probs, key=lambda k: -probs[k])
    obs, exp, pool_o, pool_e = [], [], 0, 0.0
    for k in keys:
        e = probs[k] * n
        if e >= 5:
            obs.append(counts.get(k, 0))
            exp.append(e)
        else:
            pool_o += counts.get(k, 0)
            pool_e += e
    unexpected = sum(v for k, v in counts.items() if k not in probs or probs[k] == 0)
    if unexpected:
        return 0.0  # a sample the distribution gives zero probability
    if pool_e > 0:
        obs.append(pool_o)
        exp.append(pool_e)
    exp = np.array(exp) * (sum(obs) / sum(exp))
    return float(chisquare(obs, exp).pvalue)


def exact_joint(model, prompt, length, params):
    """P(next `length` tokens) under plain sampling, by enumerating every prefix."""
    probs = {(): 1.0}
    for _ in range(length):
        nxt = {}
        for seq, pr in probs.items():
            logits = model(mx.array(prompt + list(seq))[None])[0, -1:]
            p = np.exp(np.array(params.logprobs(logits)[0], dtype=np.float64))
            for tok, pt in enumerate(p):
                if pt > 0:
                    nxt[seq + (tok,)] = pr * pt
        probs = nxt
    return probs
