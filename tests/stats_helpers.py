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


def marginal(probs: dict, length: int) -> dict:
    """The distribution of the first LENGTH tokens of a joint over sequences."""
    out: dict = {}
    for seq, p in probs.items():
        out[seq[:length]] = out.get(seq[:length], 0.0) + p
    return out


def shift_at(probs: dict, position: int, points: float = 0.03) -> dict:
    """PROBS with the token at POSITION (0-based) made off by POINTS of probability: in every
    context, POINTS of its conditional move from the most likely token there to the least
    likely one (what the rest of the sequence does given it is unchanged). The named
    alternative the distribution tests' power is computed against."""
    ctx: dict = {}
    for seq, p in marginal(probs, position + 1).items():
        ctx.setdefault(seq[:position], {})[seq[position]] = p
    moved = {}
    for head, cond in ctx.items():
        total = sum(cond.values())
        top, low = max(cond, key=cond.get), min(cond, key=cond.get)
        moved[head] = {top: -points * total, low: points * total}
    out = {}
    for seq, p in probs.items():
        tok_p = ctx[seq[:position]][seq[position]]  # P(head, token)
        delta = moved[seq[:position]].get(seq[position], 0.0)
        out[seq] = p * (tok_p + delta) / tok_p if tok_p > 0 else 0.0
    return out


def pooled_cells(probs: dict, n: int) -> list[list]:
    """The cells chi_square_p tests: keys with expected count >= 5 alone, the rest pooled."""
    keys = sorted(probs, key=lambda k: -probs[k])
    big = [[k] for k in keys if probs[k] * n >= 5]
    small = [k for k in keys if probs[k] * n < 5]
    return big + ([small] if small else [])


def chi_square_power(probs: dict, alt: dict, n: int, alpha: float) -> float:
    """Power of chi_square_p at level ALPHA with N draws when the draws follow ALT instead of
    PROBS: the noncentral chi-square with noncentrality n * sum (alt - p)^2 / p over the
    tested (pooled) cells."""
    from scipy.stats import chi2, ncx2

    cells = pooled_cells(probs, n)
    p = np.array([sum(probs[k] for k in c) for c in cells])
    a = np.array([sum(alt.get(k, 0.0) for k in c) for c in cells])
    lam = n * float(((a - p) ** 2 / p).sum())
    df = len(cells) - 1
    return float(ncx2.sf(chi2.isf(alpha, df), df, lam))
