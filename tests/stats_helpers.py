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
    if len(obs) < 2:
        return 1.0  # one cell: nothing to test
    exp = np.array(exp) * (sum(obs) / sum(exp))
    return float(chisquare(obs, exp).pvalue)


def exact_joint(model, prompt, length, params, allowed=None):
    """P(next `length` tokens) under plain sampling, by enumerating every prefix (one batched
    forward per length). ``allowed(seq)``: the tokens a constraint lets follow SEQ (a bool row
    of the vocabulary; None: all), masked out of the logits before PARAMS process them, as
    plain constrained decoding does."""
    probs = {(): 1.0}
    for _ in range(length):
        seqs = list(probs)
        logits = model(mx.array([prompt + list(seq) for seq in seqs]))[:, -1].astype(mx.float32)
        if allowed is not None:
            mask = mx.array(np.stack([np.asarray(allowed(seq), bool) for seq in seqs]))
            logits = mx.where(mask, logits, mx.array(-mx.inf, logits.dtype))
        rows = np.exp(np.array(params.logprobs(logits), dtype=np.float64))
        nxt = {}
        for seq, row in zip(seqs, rows):
            for tok, pt in enumerate(row):
                if pt > 0:
                    nxt[seq + (tok,)] = probs[seq] * pt
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
    if df < 1:
        return 0.0  # one cell: nothing to test
    return float(ncx2.sf(chi2.isf(alpha, df), df, lam))


def regroup(dist: dict, key) -> dict:
    """DIST (counts or probabilities over sequences) summed over the classes KEY maps them to."""
    out: dict = {}
    for seq, v in dist.items():
        k = key(seq)
        out[k] = out.get(k, 0) + v
    return out


def rank_at(probs: dict, position: int):
    """The map seq -> rank of its token at POSITION (0-based; rank 0 the most likely) among
    the tokens that may follow seq[:POSITION] under PROBS; -1 for one PROBS never gives.
    Regrouped by it, a sample is a probability integral transform of that position: a rule
    that moves mass between likely and unlikely tokens (drafted or not) shows there."""
    cond: dict = {}
    for seq, p in marginal(probs, position + 1).items():
        cond.setdefault(seq[:position], {})[seq[position]] = p
    rank = {head: {t: r for r, t in enumerate(sorted(c, key=lambda t: (-c[t], t)))} for head, c in cond.items()}
    return lambda seq: rank.get(seq[:position], {}).get(seq[position], -1)


def battery_keys(probs: dict, length: int = 3) -> dict:
    """The functions of a sample of LENGTH-token sequences the distribution tests score: the
    joint, the pair, and the rank of each token from the second on (rank_at)."""
    keys = {"joint": lambda s: s[:length], "pair": lambda s: s[:2]}
    keys.update({f"rank {i + 1}": rank_at(probs, i) for i in range(1, length)})
    return keys


def battery_pvalues(counts: Counter, probs: dict, n: int, keys: dict) -> dict:
    """chi_square_p of each of KEYS (battery_keys) regrouping COUNTS against PROBS."""
    return {name: chi_square_p(regroup(counts, key), regroup(probs, key), n) for name, key in keys.items()}


def simulated_power(probs: dict, alt: dict, n: int, alpha: float, keys: dict, sims: int = 4000,
                    seed: int = 0) -> float:
    """The power of the battery (each of KEYS tested with chi_square_p at ALPHA / len(KEYS),
    rejecting when any does) with N draws from ALT, by simulating SIMS samples of N at once:
    exact where the noncentral chi-square (chi_square_power) is not, for pooled cells of a
    few expected draws and the tests taken together. ALT gives no mass outside PROBS."""
    from scipy.stats import chi2

    seqs = sorted(probs)
    index = {s: i for i, s in enumerate(seqs)}
    a = np.array([alt.get(s, 0.0) for s in seqs])
    assert sum(v for s, v in alt.items() if s not in index) < 1e-12
    draws = np.random.default_rng(seed).multinomial(n, a / a.sum(), size=sims)  # (sims, seqs)
    rejected = np.zeros(sims, bool)
    for key in keys.values():
        grouped = regroup(probs, key)
        cells = pooled_cells(grouped, n)
        cell_of = {k: c for c, ks in enumerate(cells) for k in ks}
        member = np.zeros((len(seqs), len(cells)))
        for s, i in index.items():
            member[i, cell_of[key(s)]] = 1.0
        obs = draws @ member
        exp = n * np.array([sum(grouped[k] for k in ks) for ks in cells])
        if len(cells) < 2:
            continue
        stat = ((obs - exp) ** 2 / exp).sum(axis=1)
        rejected |= chi2.sf(stat, len(cells) - 1) < alpha / len(keys)
    return float(rejected.mean())
