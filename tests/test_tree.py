"""Draft trees (mlxspec.engine.tree): construction, the greedy walk, and exact acceptance at
temperature > 0.

The distribution tests run the whole commit process (walk a tree with the target's rows,
commit the path and the next token, build the next tree from the committed prefix, ...) on a
synthetic target over V = 6 tokens with a known conditional p(x_t | x_{t-2}, x_{t-1}), and
compare the joint law of the first three committed tokens (216 cells) with the exact one by
Pearson's chi-square at ALPHA.

Power. Under an alternative law p1 the statistic is about noncentral chi-square with
lambda = N * sum (p1 - p)^2 / p. Any p1 at total variation t from p has
sum (p1 - p)^2 / p >= (sum |p1 - p|)^2 = 4 t^2 (Cauchy-Schwarz). A rule off by 3 points at
position 2 (the second committed token's law moved by TV 0.03; or, the first token exact, its
law given the first moved by 0.03 on average) puts the joint law at TV >= 0.03, so
``LEAST_FAVOURABLE`` = 4 * 0.03^2 bounds them all. ``N_BIG`` = 30 000 is the smallest round N
with power >= 0.9 against it (lambda 108 on 215 degrees of freedom, critical value 284.8 at
ALPHA 1e-3: power 0.907; every cell's expected count is >= 14, none pooled); the numpy
re-implementations of the rules run at N_BIG. The real ``walk`` is slower: it runs at the N
with power >= 0.9 against the exact law of the planted bug it faces (laws by enumeration).

Planted bugs, each moving the second token by about 3 points:
(a) sampled children: accept with min(1, p/q) but, on a reject, keep p instead of the
    residual norm(max(p - q, 0)) (``_residual`` patched to return p). With the draft model
    NEAR: 3.1 points given the first token (1.2 on the marginal; joint TV 0.045).
(b) deterministic children: take the likeliest child outright whenever the target gives it
    more than ``THRESHOLD`` (sample-match done wrong; ``_deterministic_choices`` patched).
    On chain trees: 3.4 points (joint TV 0.034).
"""

import mlx.core as mx
import numpy as np
import pytest
from scipy.stats import chi2, chisquare, ncx2

from mlxspec.engine import tree as tree_mod
from mlxspec.engine.sampling import SamplingParams
from mlxspec.engine.tree import (
    DraftTree,
    draws_per_node,
    tree_from_chain_topk,
    tree_from_marginals,
    tree_from_paths,
    tree_mask,
    walk,
)

V, DEPTH, LENGTH = 6, 3, 3
CELLS = V**LENGTH
ALPHA = 1e-3
TV = 0.03
LEAST_FAVOURABLE = 4 * TV**2  # chi-square distance of any law at TV >= 0.03 from p
POWER = 0.9
N_BIG = 30_000  # numpy re-implementations (see test_big_n_has_power)
# the real walk (see test_real_n_has_power_against_the_bugs)
N_REAL = 8_500  # sampled trees of a draft model (bug (a))
N_DET = 3_000  # deterministic trees (bug (b))
N_BUILDER = 800  # the sampled builder's trees (bug (a) there moves 31 points: power 1.0 at 800, 0.998 at 400)
THRESHOLD = 0.6  # bug (b)
NEAR_MIX = 0.18
PARAMS = SamplingParams(temperature=1.0, top_p=1.0, top_k=0, min_p=0.0)
GREEDY = SamplingParams(temperature=0.0)

# -- the synthetic target and drafters ----------------------------------------------------------
# A context is the last two tokens: 0 = empty, 1 + a = (a,), 1 + V + V * a + b = (a, b).
N_CTX = 1 + V + V * V
NEXT = np.array([[1 + t if c == 0 else 1 + V + V * ((c - 1) % V) + t for t in range(V)]
                 for c in range(N_CTX)])
_rng = np.random.default_rng(20240611)


def _rows(shape, floor):
    return (1 - floor) * _rng.dirichlet(np.ones(V), size=shape) + floor / V


def _top(rows, k):
    """Keep each row's k likeliest tokens (a top-k filtered drafter), renormalised."""
    cut = np.sort(rows, axis=-1)[..., -k][..., None]
    kept = np.where(rows >= cut, rows, 0.0)
    return kept / kept.sum(axis=-1, keepdims=True)


def _log(x):
    with np.errstate(divide="ignore"):
        return np.log(x)


TARGET = _rows(N_CTX, 0.38)  # p(x | context), every entry >= 0.063, the largest 0.51
# Bug (b)'s trigger: one context of the second token, (PLANT_AT,) of probability 0.098, where
# the target gives PLANTED 0.65 (over THRESHOLD): forcing it moves 0.098 * 0.35 = 3.4 points.
PLANT_AT, PLANTED = 2, 0
TARGET[1 + PLANT_AT] = np.where(np.arange(V) == PLANTED, 0.65, 0.07)
# DFlash-like per-depth marginals for a tree rooted at each context: top-4 filtered, so q puts
# no mass on tokens p still gives some (the residual has to carry it).
MARGINALS = _top(0.5 * _rows((N_CTX, DEPTH), 0.0) + 0.5 * TARGET[:, None, :], 4)
DRAFT = 0.5 * TARGET + 0.5 * _rows(N_CTX, 0.0)  # an autoregressive drafter (chain, paths)
# A draft model close to the target (TV 0.03-ish a row), drawing each node's children from
# q(. | its own path): SpecInfer's setting, where bug (a) moves about 3 points.
NEAR_NOISE = _rows(N_CTX, 0.0)
NEAR = (1 - NEAR_MIX) * TARGET + NEAR_MIX * NEAR_NOISE
PATHS = [[list(_rng.choice(V, size=DEPTH, p=[.4, .3, .2, .1, 0, 0])) for _ in range(3)]
         for _ in range(N_CTX)]


def _joint_of_target():
    joint = np.zeros((V,) * LENGTH)
    for seq in np.ndindex(*joint.shape):
        c, pr = 0, 1.0
        for t in seq:
            pr *= TARGET[c, t]
            c = NEXT[c, t]
        joint[seq] = pr
    return joint.ravel()


JOINT = _joint_of_target()


def node_contexts(tree: DraftTree, root_ctx: int) -> np.ndarray:
    out = [root_ctx]
    for parent, tok in zip(tree.parents, tree.tokens):
        out.append(NEXT[out[parent], tok])
    return np.array(out)


def build_marginals(c):
    return tree_from_marginals(mx.array(_log(MARGINALS[c])), 8, max_children=3)


def build_chain(c):
    chain, rows, ctx = [], [], c
    for _ in range(DEPTH):
        rows.append(DRAFT[ctx])
        chain.append(int(np.argmax(DRAFT[ctx])))
        ctx = NEXT[ctx, chain[-1]]
    return tree_from_chain_topk(mx.array(_log(np.array(rows))), chain, 7, max_children=3)


def build_paths(c):
    return tree_from_paths(PATHS[c], 6)


SAMPLED_BUDGET = 24  # >= 4 + 4 * 2 + 8 * 1: every node above depth DEPTH gets its full draws


def build_sampled(c):
    return tree_from_marginals(mx.array(_log(MARGINALS[c])), SAMPLED_BUDGET, sampled=True)


DETERMINISTIC = {"marginals": build_marginals, "chain": build_chain, "paths": build_paths}


# -- statistics ---------------------------------------------------------------------------------

def _groups(n: int) -> list[np.ndarray]:
    """The cells of the test: each cell whose expected count is >= 5 alone, the rest pooled."""
    big = JOINT * n >= 5
    out = [np.array([i]) for i in np.flatnonzero(big)]
    return out + ([np.flatnonzero(~big)] if (~big).any() else [])


def _grouped(law: np.ndarray, groups) -> np.ndarray:
    return np.array([law[g].sum() for g in groups])


def p_value(counts: np.ndarray) -> float:
    """Pearson's chi-square of the counts of the 216 joint cells against the exact law."""
    n = int(counts.sum())
    groups = _groups(n)
    return float(chisquare(_grouped(counts, groups), _grouped(JOINT, groups) * n).pvalue)


def power(n: int, law: np.ndarray | None = None) -> float:
    """Power of :func:`p_value` at ALPHA with n draws against ``law`` (noncentral chi-square),
    or, for None, against any law at TV >= 0.03 from p (needs every cell unpooled)."""
    groups = _groups(n)
    df = len(groups) - 1
    if law is None:
        assert len(groups) == CELLS, "the bound holds for unpooled cells"
        distance = LEAST_FAVOURABLE
    else:
        p0, p1 = _grouped(JOINT, groups), _grouped(law, groups)
        distance = float(((p1 - p0) ** 2 / p0).sum())
    return float(ncx2.sf(chi2.ppf(1 - ALPHA, df), df, n * distance))


def shift_at_position_2(law: np.ndarray) -> tuple[float, float]:
    """How far the second committed token is from p under ``law``: (the total variation of
    its law given the first token, averaged over the first token; that of its marginal)."""
    law3, p3 = law.reshape(V, V, V).sum(axis=2), JOINT.reshape(V, V, V).sum(axis=2)
    first = law3.sum(axis=1)
    given = law3 / np.maximum(first, 1e-300)[:, None] - p3 / p3.sum(axis=1, keepdims=True)
    conditional = 0.5 * float((first * np.abs(given).sum(axis=1)).sum())
    return conditional, 0.5 * float(np.abs(law3.sum(axis=0) - p3.sum(axis=0)).sum())


def encode(seqs: np.ndarray) -> np.ndarray:
    return (seqs[:, 0] * V + seqs[:, 1]) * V + seqs[:, 2]


# -- exact laws of the commit process, by enumeration -------------------------------------------

def node_law_sampled(p, q, draws, residual=True):
    """(P(descend into the child drawn as x), P(commit y)) at a node with ``draws`` i.i.d.
    draws from q under SpecInfer's rule. After j rejects p is the j-th residual whatever was
    drawn, and draw j is accepted with probability sum_x q(x) min(1, p(x)/q(x))."""
    accept, mass = np.zeros(V), 1.0
    for _ in range(draws):
        both = np.minimum(p, q)
        accept += mass * both
        mass *= 1.0 - both.sum()
        if residual:
            res = np.maximum(p - q, 0.0)
            p = res / res.sum() if res.sum() > 0 else p
    return accept, mass * p


def exact_law(step) -> np.ndarray:
    """The joint law of the first three committed tokens; ``step(ctx, state)`` lists
    (token, probability, next state) from a walk state."""
    frontier, law = [(1.0, 0, (), (0, 0))], np.zeros(CELLS)
    for _ in range(LENGTH):
        frontier = [(pr * q, NEXT[c, t], seq + (t,), nxt) for pr, c, seq, st in frontier
                    for t, q, nxt in step(c, st) if q > 0]
    for pr, _, seq, _ in frontier:
        law[encode(np.array([seq]))[0]] += pr
    return law


def sampled_law(q_of, residual=True) -> np.ndarray:
    """The sampled-tree walk where a node at depth d < DEPTH drew ``draws_per_node(d, 4)``
    children from ``q_of(root context, node context, d)`` (4, 2, 1; depth DEPTH: leaves).
    State: (context at the tree's root, depth)."""
    def step(c, state):
        root, d = state
        p = TARGET[c]
        if d < DEPTH:
            acc, com = node_law_sampled(p, q_of(root, c, d), draws_per_node(d, 4), residual)
        else:
            acc, com = np.zeros(V), p
        return ([(t, acc[t], (root, d + 1)) for t in range(V)]
                + [(t, com[t], (NEXT[c, t], 0)) for t in range(V)])
    return exact_law(step)


def q_marginals(root, c, d):
    return MARGINALS[root, d]


def q_near(root, c, d):
    return NEAR[c]


def child_table(build) -> np.ndarray:
    """(contexts, nodes + 1, V): the child of node i with token t in the tree built at each
    context, -1 for none."""
    trees = [build(c) for c in range(N_CTX)]
    table = -np.ones((N_CTX, max(len(t) for t in trees) + 1, V), dtype=np.int64)
    for c, tree in enumerate(trees):
        for i, (parent, tok) in enumerate(zip(tree.parents, tree.tokens)):
            table[c, parent, tok] = i + 1
    return table


def deterministic_law(children: np.ndarray, threshold: float | None = None) -> np.ndarray:
    """The deterministic-children walk (bug (b) with a threshold). State: (root, node)."""
    def step(c, state):
        root, node = state
        p, kids = TARGET[c], children[root, node]
        if threshold is not None and (p * (kids >= 0)).max() > threshold:
            best = int(np.argmax(p * (kids >= 0)))
            return [(best, 1.0, (root, kids[best]))]
        return [(t, p[t], (root, kids[t]) if kids[t] >= 0 else (NEXT[c, t], 0)) for t in range(V)]
    return exact_law(step)


# -- the rules re-implemented in numpy, vectorised over many runs of the commit process ---------

def _draw(probs: np.ndarray, rng) -> np.ndarray:
    """One token per row (inverse CDF)."""
    cdf = probs.cumsum(axis=1)
    u = rng.random(len(probs))[:, None] * cdf[:, -1:]
    return np.minimum((cdf <= u).sum(axis=1), V - 1)


def _node_numpy(p, q, d, rng, residual):
    """SpecInfer's rule at one node per row: (committed or descended-into token, descended)."""
    p, rows = p.copy(), np.arange(len(p))
    token, open_ = np.zeros(len(p), dtype=np.int64), np.ones(len(p), dtype=bool)
    for _ in range(draws_per_node(d, 4) if d < DEPTH else 0):
        x, u = _draw(q, rng), rng.random(len(p))
        ok = open_ & (u * q[rows, x] < p[rows, x])
        token[ok] = x[ok]
        rejected = open_ & ~ok
        if residual and rejected.any():
            res = np.maximum(p[rejected] - q[rejected], 0.0)
            total = res.sum(axis=1, keepdims=True)
            p[rejected] = np.where(total > 0, res / np.maximum(total, 1e-300), p[rejected])
        open_ &= ~ok
    token[open_] = _draw(p[open_], rng)
    return token, ~open_


def numpy_sampled(q_of, n, seed, residual=True) -> np.ndarray:
    """Counts of the first three tokens over n runs with sampled trees (draws made when the
    walk reaches a node, which has the same law as drawing the whole tree first)."""
    rng = np.random.default_rng(seed)
    ctx, root, depth = (np.zeros(n, dtype=np.int64) for _ in range(3))
    out = np.zeros((n, LENGTH), dtype=np.int64)
    for pos in range(LENGTH):
        accepted = np.zeros(n, dtype=bool)
        for d in range(DEPTH + 1):
            at = np.flatnonzero(depth == d)
            if at.size:
                q = q_of(root[at], ctx[at], d) if d < DEPTH else None
                out[at, pos], accepted[at] = _node_numpy(TARGET[ctx[at]], q, d, rng, residual)
        depth = np.where(accepted, depth + 1, 0)
        ctx = NEXT[ctx, out[:, pos]]
        root = np.where(accepted, root, ctx)
    return np.bincount(encode(out), minlength=CELLS)


def numpy_deterministic(children, n, seed, threshold=None) -> np.ndarray:
    """Counts over n runs with the deterministic trees in ``children`` (bug (b) with a
    threshold)."""
    rng, rows = np.random.default_rng(seed), np.arange(n)
    ctx, root, node = (np.zeros(n, dtype=np.int64) for _ in range(3))
    out = np.zeros((n, LENGTH), dtype=np.int64)
    for pos in range(LENGTH):
        p, kids = TARGET[ctx], children[root, node]
        x = _draw(p, rng)
        if threshold is not None:
            kid_p = np.where(kids >= 0, p, 0.0)
            best = kid_p.argmax(axis=1)
            x = np.where(kid_p[rows, best] > threshold, best, x)
        child = kids[rows, x]
        out[:, pos] = x
        ctx = NEXT[ctx, x]
        node, root = np.maximum(child, 0), np.where(child >= 0, root, ctx)
    return np.bincount(encode(out), minlength=CELLS)


# -- the real walk -------------------------------------------------------------------------------

def run_walk(build, n, seed, cache=True) -> np.ndarray:
    """Counts of the first three committed tokens over n runs of the commit process with the
    real :func:`walk` (``cache``: deterministic trees kept per context, since the builders
    are functions of it; sampled trees are drawn afresh at every step)."""
    mx.random.seed(seed)
    made, counts = {}, np.zeros(CELLS, dtype=np.int64)
    for _ in range(n):
        c, out = 0, []
        while len(out) < LENGTH:
            if not (cache and c in made):
                tree = build(c)
                made[c] = tree, _rows_for(tree, c)
            tree, rows = made[c]
            path, nxt = walk(tree, rows, PARAMS)
            for t in [tree.tokens[i - 1] for i in path[1:]] + [nxt]:
                out.append(t)
                c = NEXT[c, t]
        counts[encode(np.array([out[:LENGTH]]))[0]] += 1
    return counts


def _rows_for(tree, c=0):
    """The target's rows for the tree forward of ``tree`` built at context c."""
    return mx.array(_log(TARGET[node_contexts(tree, c)]).astype(np.float32))


# NEAR's rows as numpy's Generator.choice(V, p=row) uses them (cumsum, over its last entry):
# uniforms from rng.random looked up there are the tokens choice draws from the same stream,
# without choice's checks of p on every call (a third of the real walk tests' time)
_NEAR_CDF = NEAR.cumsum(axis=1)
_NEAR_CDF /= _NEAR_CDF[:, -1:]
_NEAR_LOGQ = _log(NEAR).astype(np.float32)


def near_builder(seed):
    """A draft model drawing each node's children i.i.d. from NEAR(. | the node's context),
    ``draws_per_node(depth, 4)`` of them, down to DEPTH."""
    rng = np.random.default_rng(seed)

    def build(c):
        tokens, parents, draws, ctxs, todo = [], [], {}, [c], [(0, 0)]
        for node, d in todo:
            if d == DEPTH:
                continue
            uniforms = rng.random(draws_per_node(d, 4))  # = rng.choice(V, size=..., p=NEAR[ctxs[node]])
            draws[node] = [int(x) for x in _NEAR_CDF[ctxs[node]].searchsorted(uniforms, side="right")]
            for x in dict.fromkeys(draws[node]):
                tokens.append(x)
                parents.append(node)
                ctxs.append(NEXT[ctxs[node], x])
                todo.append((len(tokens), d + 1))
        child_q = mx.array(_NEAR_LOGQ[ctxs])
        return DraftTree(tokens, parents, sampled=True, draws=draws, child_q=child_q)
    return build


# -- construction ----------------------------------------------------------------------------------

def _random_logprobs(shape, seed):
    z = np.random.default_rng(seed).normal(size=shape) * 2.0
    return mx.array((z - np.log(np.exp(z).sum(axis=-1, keepdims=True))).astype(np.float32))


def test_tree_helpers():
    tree = DraftTree([5, 6, 7, 8], [0, 1, 1, 0])
    assert len(tree) == 4
    assert [tree.depth(i) for i in range(5)] == tree.depths() == [0, 1, 2, 2, 1]
    assert tree.children(0) == [1, 4] and tree.children(1) == [2, 3] and tree.children(2) == []
    assert tree.ancestors(3) == [0, 1] and tree.ancestors(0) == []
    assert tree.path_tokens(3) == [5, 7] and tree.path_tokens(0) == []
    assert tree.parents_with_root() == [-1, 0, 1, 1, 0]
    assert tree.inputs(9).tolist() == [9, 5, 6, 7, 8]
    with pytest.raises(ValueError):
        DraftTree([1, 2], [0, 2])  # a parent after its child
    with pytest.raises(ValueError):
        DraftTree([1], [0], sampled=True)  # no draws


def test_mask_is_ancestor_or_self():
    rng = np.random.default_rng(3)
    parents = [-1] + [int(rng.integers(0, i)) for i in range(1, 30)]
    mask = np.array(tree_mask(parents))
    for i in range(30):
        chain, j = {i}, i
        while parents[j] >= 0:
            j = parents[j]
            chain.add(j)
        assert set(np.flatnonzero(mask[i])) == chain
    assert np.array(tree_mask([-1])).tolist() == [[True]]
    with pytest.raises(ValueError):
        tree_mask([-1, 2, 0])


def _score(lp, tree, i):
    """Cumulative draft log-probability of node i's path (per-depth rows)."""
    return sum(float(lp[d, t]) for d, t in enumerate(tree.path_tokens(i)))


def test_marginals_chain_first_then_best_first():
    lp = _random_logprobs((4, 10), 0)
    top1 = np.argmax(np.array(lp), axis=-1).tolist()
    chain = tree_from_marginals(lp, 4, max_children=3)
    assert chain.tokens == top1 and chain.parents == [0, 1, 2, 3]
    assert tree_from_marginals(lp, 2).tokens == top1[:2]
    assert len(tree_from_marginals(lp, 0)) == 0
    tree = tree_from_marginals(lp, 20, max_children=3)
    assert tree.tokens[:4] == top1 and len(tree) == 20
    scores = [_score(np.array(lp), tree, i) for i in range(5, 21)]
    assert scores == sorted(scores, reverse=True)  # best-first after the chain
    # the same nodes as the 16 best prefixes over each depth's top 3, the chain's left out
    top3 = np.argsort(-np.array(lp), axis=-1)[:, :3]
    prefixes = [tuple(top3[d, r] for d, r in enumerate(ranks)) for n in range(1, 5)
                for ranks in np.ndindex(*(3,) * n) if any(ranks)]
    best = sorted(prefixes, key=lambda s: -sum(float(lp[d, t]) for d, t in enumerate(s)))[:16]
    assert {tuple(tree.path_tokens(i)) for i in range(5, 21)} == set(best)
    full = tree_from_marginals(lp, 1000, max_children=3)
    assert len(full) == 3 + 9 + 27 + 81
    assert all(c <= 3 for c in map(len, (full.children(i) for i in range(len(full) + 1))))


def test_marginals_skip_filtered_tokens():
    lp = np.full((3, 8), -np.inf, dtype=np.float32)
    lp[:, :2] = np.log(0.5)
    tree = tree_from_marginals(mx.array(lp), 50, max_children=4)
    assert len(tree) == 2 + 4 + 8 and set(tree.tokens) == {0, 1}


def test_sampled_marginals_record_their_draws():
    lp = _random_logprobs((3, 5), 1)
    tree = tree_from_marginals(lp, 24, sampled=True, key=mx.random.key(4))
    assert tree.sampled and len(tree) <= 24
    depths = tree.depths()
    for node in range(len(tree) + 1):
        xs = tree.draws.get(node)
        if depths[node] < 3:  # the budget never binds at 24: every node draws in full
            assert len(xs) == draws_per_node(depths[node], 4)
            assert [tree.tokens[c - 1] for c in tree.children(node)] == list(dict.fromkeys(xs))
            assert np.allclose(np.array(tree.child_q[node]), np.array(lp[depths[node]]))
        else:
            assert xs is None and tree.children(node) == []
    assert any(len(set(xs)) < len(xs) for xs in tree.draws.values())  # duplicates kept
    again = tree_from_marginals(lp, 24, sampled=True, key=mx.random.key(4))
    assert (again.tokens, again.parents, again.draws) == (tree.tokens, tree.parents, tree.draws)
    small = tree_from_marginals(lp, 5, sampled=True, key=mx.random.key(5))
    assert len(small) <= 5 and sum(map(len, small.draws.values())) <= 5 + 3


def test_sampled_draws_follow_the_rows():
    """The root's draws, pooled over many trees, are i.i.d. from row 0 (10 tokens: blocks of
    4 in the two-stage sampler, the last one padded; a filtered token never drawn)."""
    lp = np.array(_random_logprobs((2, 10), 2))
    lp[0, 3] = -np.inf
    lp[0] -= np.log(np.exp(lp[0]).sum())
    mx.random.seed(11)
    counts = np.zeros(10)
    for _ in range(500):
        for x in tree_from_marginals(mx.array(lp), 8, sampled=True).draws[0]:
            counts[x] += 1
    q = np.exp(lp[0].astype(np.float64))
    assert counts[3] == 0
    keep = q > 0
    assert chisquare(counts[keep], q[keep] / q.sum() * counts.sum()).pvalue > ALPHA


def test_chain_topk_siblings_hang_off_the_chain():
    lp = _random_logprobs((3, 10), 5)
    chain = [int(np.argsort(-np.array(lp[d]))[1]) for d in range(3)]  # the second best, say
    tree = tree_from_chain_topk(lp, chain, 9, max_children=3)
    assert tree.tokens[:3] == chain and tree.parents[:3] == [0, 1, 2]
    assert len(tree) == 9 and all(p in (0, 1, 2) for p in tree.parents[3:])
    for i in range(4, 10):
        d = tree.parents[i - 1]
        assert tree.tokens[i - 1] != chain[d] and tree.children(i) == []
        assert tree.tokens[i - 1] in np.argsort(-np.array(lp[d]))[:3]
    scores = [_score(np.array(lp), DraftTree(chain[:tree.parents[i - 1]] + [tree.tokens[i - 1]],
                                            list(range(tree.parents[i - 1] + 1))), tree.parents[i - 1] + 1)
              for i in range(4, 10)]
    assert scores == sorted(scores, reverse=True)
    assert tree_from_chain_topk(lp, chain, 2).tokens == chain[:2]
    assert len(tree_from_chain_topk(lp, chain, 100, max_children=3)) == 3 + 3 * 2


def test_paths_merge_into_a_trie():
    tree = tree_from_paths([[1, 2, 3], [1, 2, 4], [1, 5], [6]], 100)
    assert tree.tokens == [1, 2, 3, 4, 5, 6] and tree.parents == [0, 1, 2, 2, 1, 0]
    cut = tree_from_paths([[1, 2, 3], [1, 2, 4], [1, 5], [6]], 4)
    assert cut.tokens == [1, 2, 3, 4]
    assert len(tree_from_paths([[7, 8]], 1)) == 1 and len(tree_from_paths([], 5)) == 0


# -- the walk: greedy, and its details ------------------------------------------------------------

@pytest.mark.parametrize("build", [build_marginals, build_chain, build_paths, build_sampled,
                                   near_builder(0)])
def test_greedy_walk_is_plain_greedy(build):
    mx.random.seed(0)
    for c in range(N_CTX):
        tree = build(c)
        path, nxt = walk(tree, _rows_for(tree, c), GREEDY)
        greedy, ctx = [], c
        for _ in range(len(path)):
            greedy.append(int(np.argmax(TARGET[ctx])))
            ctx = NEXT[ctx, greedy[-1]]
        assert [tree.tokens[i - 1] for i in path[1:]] + [nxt] == greedy
        assert nxt not in [tree.tokens[k - 1] for k in tree.children(path[-1])]


def test_walk_key_reproducible_and_rows_checked():
    for tree in (build_sampled(0), build_marginals(0)):
        runs = [walk(tree, _rows_for(tree), PARAMS, key=mx.random.key(k)) for k in [1, *range(1, 30)]]
        assert runs[0] == runs[1] and len(set(map(str, runs))) > 2
        with pytest.raises(ValueError):
            walk(tree, _rows_for(tree)[:-1], PARAMS)


def test_residual_of_equal_rows_is_the_row():
    p = mx.array([[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]])
    q = mx.array([[0.5, 0.5, 0.0], [0.4, 0.1, 0.5]])
    assert np.allclose(np.array(tree_mod._residual(p, q)), [[0.5, 0.5, 0.0], [0.0, 1.0, 0.0]])


def test_walk_one_node_with_filtered_rows():
    """One expanded root, four draws from a peaked q that gives two tokens nothing (so draws
    repeat and rejects are frequent), a target that filters two others: the token after the
    root (accepted child or committed) is a draw from p. Plain chi-square over 6 cells."""
    p = np.array([0.3, 0.25, 0.2, 0.25, 0.0, 0.0])
    q = np.array([0.05, 0.0, 0.0, 0.15, 0.5, 0.3])
    rng, n, counts = np.random.default_rng(12), 3_000, np.zeros(V)
    mx.random.seed(12)
    rows = mx.array(_log(np.stack([p] * 5)).astype(np.float32))
    for _ in range(n):
        xs = [int(x) for x in rng.choice(V, size=4, p=q)]
        kids = list(dict.fromkeys(xs))
        tree = DraftTree(kids, [0] * len(kids), sampled=True, draws={0: xs},
                         child_q=mx.array(_log(np.stack([q] * (len(kids) + 1))).astype(np.float32)))
        path, nxt = walk(tree, rows[:len(kids) + 1], PARAMS)
        counts[kids[path[1] - 1] if len(path) > 1 else nxt] += 1
    assert counts[4:].sum() == 0
    assert chisquare(counts[:4], p[:4] * n).pvalue > ALPHA


def test_walk_never_commits_what_the_target_filters():
    """Rows with -inf (top-k / top-p filtered target) are never committed, sampled or not."""
    mx.random.seed(1)
    filtered = np.where(TARGET >= np.sort(TARGET, axis=1)[:, -3:-2], TARGET, 0.0)
    for build in (build_sampled, build_marginals):
        for _ in range(50):
            tree = build(0)
            ctxs = node_contexts(tree, 0)
            path, nxt = walk(tree, mx.array(_log(filtered[ctxs]).astype(np.float32)), PARAMS)
            assert filtered[ctxs[path[-1]], nxt] > 0
            assert all(filtered[ctxs[tree.parents[i - 1]], tree.tokens[i - 1]] > 0 for i in path[1:])


# -- exactness at temperature > 0 -------------------------------------------------------------------

def test_the_rules_are_exact_by_enumeration():
    """The exact law of the commit process under each rule is p's, to rounding; each planted
    bug moves the second token by about 3 points."""
    for q_of in (q_marginals, q_near):
        assert np.abs(sampled_law(q_of) - JOINT).max() < 1e-12
    for build in DETERMINISTIC.values():
        assert np.abs(deterministic_law(child_table(build)) - JOINT).max() < 1e-12
    bug_a = sampled_law(q_near, residual=False)
    bug_b = deterministic_law(child_table(build_chain), THRESHOLD)
    assert 0.025 < shift_at_position_2(bug_a)[0] < 0.04  # 0.031 (its marginal 0.012)
    assert 0.025 < shift_at_position_2(bug_b)[1] < 0.04  # 0.034 (the conditional the same)


def test_big_n_has_power():
    """N_BIG: power >= 0.9 at ALPHA against any rule off by TV 0.03 (the noncentral
    chi-square with lambda = N * 4 * 0.03^2 on 215 degrees of freedom: 0.907 at 30 000;
    28 000 would give 0.86)."""
    assert power(N_BIG) >= POWER > power(N_BIG - 2_000)


def test_real_n_has_power_against_the_bugs():
    """Power >= 0.9 against the exact law of the planted bug each real-walk test faces:
    N_REAL against bug (a) with the draft model (0.913; 8 000 would give 0.875), N_DET against
    bug (b) on chain trees (0.973), N_BUILDER against bug (a) on the builder's trees (1.0 at 800)."""
    assert power(N_REAL, sampled_law(q_near, residual=False)) >= POWER
    assert power(N_REAL - 500, sampled_law(q_near, residual=False)) < POWER
    assert power(N_DET, deterministic_law(child_table(build_chain), THRESHOLD)) >= POWER
    assert power(N_BUILDER, sampled_law(q_marginals, residual=False)) >= POWER


@pytest.mark.parametrize("q_of", [q_marginals, q_near], ids=["marginals", "near"])
def test_sampled_rule_numpy(q_of):
    assert p_value(numpy_sampled(q_of, N_BIG, seed=1)) > ALPHA


def test_sampled_rule_numpy_catches_bug_a():
    assert p_value(numpy_sampled(q_near, N_BIG, seed=2, residual=False)) < ALPHA


@pytest.mark.parametrize("seed, name", list(enumerate(DETERMINISTIC, start=3)))
def test_deterministic_rule_numpy(seed, name):
    assert p_value(numpy_deterministic(child_table(DETERMINISTIC[name]), N_BIG, seed)) > ALPHA


def test_deterministic_rule_numpy_catches_bug_b():
    counts = numpy_deterministic(child_table(build_chain), N_BIG, seed=10, threshold=THRESHOLD)
    assert p_value(counts) < ALPHA


@pytest.mark.parametrize("name", DETERMINISTIC)
def test_walk_deterministic_trees(name):
    assert p_value(run_walk(DETERMINISTIC[name], N_DET, seed=5)) > ALPHA


def test_walk_sampled_trees_of_the_builder():
    assert p_value(run_walk(build_sampled, N_BUILDER, seed=6, cache=False)) > ALPHA


def test_walk_sampled_trees_of_a_draft_model():
    assert p_value(run_walk(near_builder(7), N_REAL, seed=7, cache=False)) > ALPHA


def bug_b(sample):
    """Bug (b) over the real rule ``sample``: the likeliest child outright wherever the
    target gives it more than THRESHOLD, the sample elsewhere."""
    def choices(tree, target_logprobs, key):
        choice = sample(tree, target_logprobs, key)
        p = np.exp(np.array(target_logprobs, dtype=np.float64))
        for node in range(len(tree) + 1):
            kids = [tree.tokens[k - 1] for k in tree.children(node)]
            best = max(kids, key=lambda t: p[node, t], default=None)
            if best is not None and p[node, best] > THRESHOLD:
                choice[node] = best
        return choice
    return choices


def test_walk_catches_bug_a(monkeypatch):
    monkeypatch.setattr(tree_mod, "_residual", lambda p, q: p)
    assert p_value(run_walk(near_builder(8), N_REAL, seed=8, cache=False)) < ALPHA


def test_walk_catches_bug_b(monkeypatch):
    monkeypatch.setattr(tree_mod, "_deterministic_choices", bug_b(tree_mod._deterministic_choices))
    assert p_value(run_walk(build_chain, N_DET, seed=9)) < ALPHA
