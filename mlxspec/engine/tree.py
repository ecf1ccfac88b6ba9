"""Draft trees: build one from a drafter's rows, then walk it exactly with the target's rows.

Node ids: 0 is the root (the last committed token, which the tree does not store); nodes
1..N are ``tokens[i - 1]`` hanging off ``parents[i - 1]``, and a parent always comes before
its children. Row i of the target's tree forward (``target_logprobs[i]``) is the distribution
of the token after the path root..i.

Two kinds of tree:

- deterministic (``sampled=False``): the children were chosen by the drafter's ranking (top-k,
  best-first, a trie of lookups). At temperature > 0 the walk draws x from the target's row and
  descends if x is a child, else commits x: each committed token is a draw from p.
- sampled (``sampled=True``): each expanded node's children were drawn i.i.d. from
  ``child_q[node]``, the draws kept in order with their duplicates (``draws``). The walk runs
  SpecInfer's multi-candidate rejection per node: draw j is accepted with probability
  min(1, p(x_j) / q(x_j)); a reject replaces p by norm(max(p - q, 0)); when every draw is
  rejected the committed token is drawn from the last p. Exact in distribution too.

At temperature 0 both walk the target's argmax (plain greedy decoding).

The walk decides every node of the tree at once on device (at most a few draws per node, so
a handful of array ops) and reads two (N + 1,) arrays back once; the path is then followed on
the host. Building reads back once too: each row's top-k, or a pool of draws per depth
(sampled trees, drawn on device by a two-stage inverse CDF), never a whole (D, V) array.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from .sampling import SamplingParams


@dataclass
class DraftTree:
    """Draft tokens as a tree; see the module docstring for the node-id convention.

    ``draws`` (sampled trees): for each expanded node id (0 = root), its draws in order,
    duplicates kept; its children are the distinct draws, in order of first draw.
    ``child_q`` (sampled trees): (N + 1, V) processed draft log-probabilities node i's children
    were drawn from (row 0 = root); rows of nodes never expanded are not read.
    """

    tokens: list[int]
    parents: list[int]
    sampled: bool = False
    draws: dict[int, list[int]] | None = None
    child_q: mx.array | None = None

    def __post_init__(self):
        if len(self.tokens) != len(self.parents):
            raise ValueError("tokens and parents differ in length")
        for i, parent in enumerate(self.parents):
            if not 0 <= parent <= i:
                raise ValueError(f"node {i + 1}: parent {parent} does not come before it")
        if self.sampled and (self.draws is None or self.child_q is None):
            raise ValueError("a sampled tree needs draws and child_q")

    def __len__(self) -> int:
        """N, the number of draft nodes (the root not counted)."""
        return len(self.tokens)

    def depth(self, i: int) -> int:
        """Edges from the root to node i (the root is at depth 0)."""
        d = 0
        while i:
            i = self.parents[i - 1]
            d += 1
        return d

    def depths(self) -> list[int]:
        """depth(i) for i = 0..N (the position offsets of the tree forward's inputs)."""
        out = [0]
        for parent in self.parents:
            out.append(out[parent] + 1)
        return out

    def children(self, i: int) -> list[int]:
        """Node i's children, in id order."""
        return [j + 1 for j, parent in enumerate(self.parents) if parent == i]

    def ancestors(self, i: int) -> list[int]:
        """Ids from the root down to node i's parent (empty for the root)."""
        out = []
        while i:
            i = self.parents[i - 1]
            out.append(i)
        return out[::-1]

    def path_tokens(self, i: int) -> list[int]:
        """The tokens of the path root..i, the root's excluded."""
        return [self.tokens[j - 1] for j in self.ancestors(i)[1:] + ([i] if i else [])]

    def parents_with_root(self) -> list[int]:
        """[-1, parents...]: the parent of every node 0..N, -1 for the root."""
        return [-1, *self.parents]

    def inputs(self, root_token: int) -> mx.array:
        """(N + 1,) uint32: the tree forward's input tokens, the root first."""
        return mx.array([root_token, *self.tokens], mx.uint32)


def tree_mask(parents_with_root) -> mx.array:
    """(N + 1, N + 1) bool: ``mask[i, j]`` is True where j is i or an ancestor of i (query i
    may attend key j). Parents must come before their children."""
    parents = list(parents_with_root)
    n = len(parents)
    mask = np.zeros((n, n), dtype=bool)
    for i, parent in enumerate(parents):
        if parent >= 0:
            if parent >= i:
                raise ValueError(f"node {i}: parent {parent} does not come before it")
            mask[i] = mask[parent]
        mask[i, i] = True
    return mx.array(mask)


# -- building trees ------------------------------------------------------------------------

def _top_candidates(logprobs: mx.array, k: int, chain: list[int] | None = None):
    """Each row's k most likely tokens and their log-probabilities, best first, and, given a
    chain, the log-probability of chain[d] in row d: host arrays, read back at once."""
    lp = logprobs.astype(mx.float32)
    k = min(k, lp.shape[-1])
    if k < lp.shape[-1]:
        idx = mx.argpartition(-lp, kth=k - 1, axis=-1)[:, :k]
    else:
        idx = mx.broadcast_to(mx.arange(k), lp.shape)
    vals = mx.take_along_axis(lp, idx, axis=-1)
    order = mx.argsort(-vals, axis=-1)
    idx = mx.take_along_axis(idx, order, axis=-1)
    vals = mx.take_along_axis(vals, order, axis=-1)
    if chain is None:
        mx.eval(idx, vals)
        return np.array(idx, dtype=np.int64), np.array(vals, dtype=np.float64)
    on_chain = mx.take_along_axis(lp, mx.array(chain)[:, None], axis=-1)[:, 0]
    mx.eval(idx, vals, on_chain)
    return (np.array(idx, dtype=np.int64), np.array(vals, dtype=np.float64),
            np.array(on_chain, dtype=np.float64))


def _best_first(tok: np.ndarray, val: np.ndarray, budget: int) -> DraftTree:
    """DDTree's construction over per-depth candidates (D, k): the top-1 chain first, then
    prefixes best-first by cumulative log-probability. A heap holds the frontier: popping a
    prefix adds it and pushes its next sibling and its first child, both no better than it."""
    depth, k = tok.shape
    tokens, parents, heap = [], [], []

    def push(score, d, rank, parent):
        if d < depth and rank < k and np.isfinite(val[d, rank]):
            heapq.heappush(heap, (-(score + val[d, rank]), d, rank, parent, score))

    score, parent = 0.0, 0
    for d in range(min(depth, budget)):  # the top-1 chain
        if not np.isfinite(val[d, 0]):
            break
        push(score, d, 1, parent)
        tokens.append(int(tok[d, 0]))
        parents.append(parent)
        score, parent = score + val[d, 0], len(tokens)
    while heap and len(tokens) < budget:
        neg, d, rank, parent, prefix = heapq.heappop(heap)
        tokens.append(int(tok[d, rank]))
        parents.append(parent)
        push(prefix, d, rank + 1, parent)
        push(-neg, d + 1, 0, len(tokens))
    return DraftTree(tokens, parents)


def draws_per_node(depth: int, max_children: int) -> int:
    """How many children a sampled tree draws at a node of this depth: ``max_children`` at
    the root, half as many one level down, and so on, never fewer than one."""
    return max(1, max_children >> depth)


def _below(total: mx.array) -> mx.array:
    """The largest float32 below ``total`` (> 0) or nearly: u * total, u < 1, can round up to
    total, and a draw must land strictly inside the mass."""
    return total * (1.0 - 2.0**-23)


def _draw_rows(probs: mx.array, count: int, key) -> mx.array:
    """(D, count) i.i.d. draws from each row of ``probs`` (D, V) by inverse CDF in two stages,
    a block of about sqrt(V) tokens and then a token in it, so that nothing of count * V
    elements is made; zero-probability tokens are never drawn."""
    rows, vocab = probs.shape
    width = max(1, int(np.ceil(np.sqrt(vocab))))
    n_blocks = -(-vocab // width)
    blocks = mx.pad(probs, [(0, 0), (0, n_blocks * width - vocab)]).reshape(rows, n_blocks, width)
    u = mx.random.uniform(shape=(2, rows, count), key=key)
    cdf = mx.cumsum(blocks.sum(axis=-1), axis=-1)  # (D, blocks)
    target = mx.minimum(u[0] * cdf[:, -1:], _below(cdf[:, -1:]))
    block = (cdf[:, None, :] <= target[..., None]).sum(axis=-1)  # (D, count)
    inside = mx.cumsum(mx.take_along_axis(blocks, block[..., None], axis=1), axis=-1)
    target = mx.minimum(u[1][..., None] * inside[..., -1:], _below(inside[..., -1:]))
    offset = (inside <= target).sum(axis=-1)  # (D, count, width) -> (D, count)
    return block * width + offset


def _sampled_pool(logprobs: mx.array, per_depth: int, key) -> tuple[np.ndarray, np.ndarray]:
    """(D, per_depth) i.i.d. draws from each row and their log-probabilities (host arrays)."""
    lp = logprobs.astype(mx.float32)
    pool = _draw_rows(mx.exp(lp), per_depth, key)
    pool_lp = mx.take_along_axis(lp, pool, axis=-1)
    mx.eval(pool, pool_lp)
    return np.array(pool, dtype=np.int64), np.array(pool_lp, dtype=np.float64)


def _sampled_tree(logprobs: mx.array, budget: int, max_children: int, key) -> DraftTree:
    """Expand nodes best-first by cumulative draft log-probability; a node at depth d draws
    ``min(draws_per_node(d), budget left)`` children i.i.d. from row d (the count is fixed
    before the draws, as the exact walk needs). Nodes at depth D are leaves."""
    depth = logprobs.shape[0]
    pool, pool_lp = _sampled_pool(logprobs, max(budget, 1) * max_children, key)
    used = [0] * depth
    tokens, parents, draws = [], [], {}
    heap = [(-0.0, 0, 0)]  # (-score, node, depth)
    while heap and len(tokens) < budget:
        neg, node, d = heapq.heappop(heap)
        if d >= depth:
            continue
        m = min(draws_per_node(d, max_children), budget - len(tokens))
        at = slice(used[d], used[d] + m)
        used[d] += m
        draws[node] = [int(x) for x in pool[d, at]]
        for x, x_lp in dict(zip(draws[node], pool_lp[d, at])).items():
            tokens.append(x)
            parents.append(node)
            heapq.heappush(heap, (neg - x_lp, len(tokens), d + 1))
    rows = np.minimum(DraftTree(tokens, parents).depths(), depth - 1)
    child_q = mx.take(logprobs, mx.array(rows), axis=0)
    return DraftTree(tokens, parents, sampled=True, draws=draws, child_q=child_q)


def tree_from_marginals(
    logprobs: mx.array, budget: int, *, sampled: bool = False, max_children: int = 4, key=None,
) -> DraftTree:
    """A tree from per-depth distributions (D, V): row d is the draft distribution of the token
    at depth d + 1 whatever the tokens before it (DFlash's block).

    Deterministic: each depth's candidates are row d's top ``max_children``; the top-1 chain
    comes first (a budget of D gives exactly that chain), then prefixes best-first by
    cumulative log-probability (DDTree) until ``budget`` nodes.

    ``sampled``: each expanded node draws its children i.i.d. from its depth's row, with
    :func:`draws_per_node` draws (4, 2, 1, 1, ... for ``max_children`` 4) capped by the budget
    left, nodes expanded best-first; duplicates are kept in ``draws``. ``key`` (mx.random.key)
    for the draws, else the global generator.
    """
    if budget <= 0 or logprobs.shape[0] == 0:
        if not sampled:
            return DraftTree([], [])
        root = logprobs[:1] if logprobs.shape[0] else mx.zeros((1, logprobs.shape[-1]))
        return DraftTree([], [], sampled=True, draws={}, child_q=root)
    if sampled:
        return _sampled_tree(logprobs, budget, max_children, key)
    tok, val = _top_candidates(logprobs, max_children)
    return _best_first(tok, val, budget)


def tree_from_chain_topk(
    logprobs: mx.array, chain: list[int], budget: int, max_children: int = 4,
) -> DraftTree:
    """The chain plus, best-first, siblings that hang off it (deterministic).

    ``logprobs`` (>= len(chain), V): row d is the draft distribution at depth d + 1 given the
    chain's tokens before it (an MTP head's or a draft model's rows). Nodes 1..len(chain) are
    the chain (cut to the budget); then the other tokens of each row's top ``max_children``
    (at most ``max_children - 1`` per row), ranked by the cumulative log-probability of
    chain[:d] plus their own, hang off chain node d (0 = root). They are leaves: the
    distributions after them are unknown.
    """
    n = min(len(chain), max(budget, 0))
    if n == 0:
        return DraftTree([], [])
    tok, val, chain_lp = _top_candidates(logprobs[:n], max_children, chain[:n])
    prefix = np.concatenate([[0.0], np.cumsum(chain_lp)])
    found = []
    for d in range(n):
        row = [(t, v) for t, v in zip(tok[d], val[d]) if t != chain[d] and np.isfinite(v)]
        found += [(-(prefix[d] + v), d, r, int(t)) for r, (t, v) in enumerate(row[:max_children - 1])]
    found.sort()
    tokens, parents = [int(t) for t in chain[:n]], list(range(n))
    for _, d, _, t in found[:budget - n]:
        tokens.append(t)
        parents.append(d)
    return DraftTree(tokens, parents)


def tree_from_paths(paths: list[list[int]], budget: int) -> DraftTree:
    """Several candidate continuations merged into a trie, first path first, each path's
    tokens in order, until ``budget`` nodes (deterministic)."""
    tokens, parents, index = [], [], {}
    for path in paths:
        node = 0
        for t in path:
            child = index.get((node, int(t)))
            if child is None:
                if len(tokens) >= budget:
                    break
                tokens.append(int(t))
                parents.append(node)
                child = index[(node, int(t))] = len(tokens)
            node = child
        if len(tokens) >= budget:
            break
    return DraftTree(tokens, parents)


# -- walking a tree with the target's rows ---------------------------------------------------

def _child_index(tree: DraftTree) -> dict[tuple[int, int], int]:
    return {(parent, tok): i + 1 for i, (parent, tok) in enumerate(zip(tree.parents, tree.tokens))}


def _follow(tree: DraftTree, choice: list[int]) -> tuple[list[int], int]:
    """Descend while node i's choice is one of its children; the first choice that is not
    is the token to commit."""
    kids, path = _child_index(tree), [0]
    while (child := kids.get((path[-1], choice[path[-1]]))) is not None:
        path.append(child)
    return path, choice[path[-1]]


def _deterministic_choices(tree: DraftTree, target_logprobs: mx.array, key) -> list[int]:
    """One draw from the target's row at every node (only those on the walk are used)."""
    return np.array(mx.random.categorical(target_logprobs, key=key)).tolist()


def _residual_rows(p: mx.array, q: mx.array) -> mx.array:
    """norm(max(p - q, 0)) per row; p itself where that is all zeros."""
    res = mx.maximum(p - q, 0.0)
    total = res.sum(axis=-1, keepdims=True)
    return mx.where(total > 0, res / total, p)


# one fused kernel for any shape (it has no shape-dependent step)
_residual = mx.compile(_residual_rows, shapeless=True)


def _draw_table(tree: DraftTree, nodes: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """(len(nodes), M) the nodes' draws, padded, and which entries are real."""
    width = max(len(tree.draws[node]) for node in nodes)
    table = np.zeros((len(nodes), width), np.int32)
    real = np.zeros((len(nodes), width), bool)
    for row, node in enumerate(nodes):
        xs = tree.draws[node]
        table[row, :len(xs)] = xs
        real[row, :len(xs)] = True
    return table, real


def _multi_candidate(tree: DraftTree, target_logprobs: mx.array, key) -> tuple[list[int], list[int]]:
    """SpecInfer's rule at every node at once. Per node: the index of its accepted draw (its
    number of draws or more where none is, a leaf included), and the token drawn from the p
    left after all its draws are rejected (p itself at a leaf).

    The p after j rejects is the j-th residual of p against q whichever tokens were drawn
    (a draw of a token already rejected is rejected for sure and still moves p), so the
    residuals are computed first, for the expanded nodes only, and each draw is tried
    against its own."""
    n = len(tree) + 1
    expanded = [node for node, xs in (tree.draws or {}).items() if xs]
    k_u, k_x = mx.random.split(key) if key is not None else (None, None)
    lp = target_logprobs.astype(mx.float32)
    if not expanded:
        return [0] * n, np.array(mx.random.categorical(lp, key=k_x)).tolist()
    table, real = _draw_table(tree, expanded)
    width = table.shape[1]
    rows = mx.array(expanded)
    p, q = mx.exp(lp[rows]), mx.exp(tree.child_q[rows].astype(mx.float32))
    chain = [p]
    for _ in range(width):
        chain.append(_residual(chain[-1], q))
    ps = mx.stack(chain)  # (M + 1, E, V): p after 0..M rejects
    x = mx.array(table)
    px = mx.take_along_axis(ps[:-1], x.T[:, :, None], axis=-1)[..., 0].T  # (E, M)
    qx = mx.take_along_axis(q, x, axis=-1)
    u = mx.random.uniform(shape=table.shape, key=k_u)
    ok = (u * qx < px) & mx.array(real)  # u < p / q (q > 0 for a drawn token)
    accepted = mx.where(ok.any(axis=1), mx.argmax(ok.astype(mx.int32), axis=1), width)
    last = ps[mx.array(real.sum(axis=1)), mx.arange(len(expanded))]
    final = mx.random.categorical(mx.concatenate([lp, mx.log(last)]), key=k_x)
    mx.eval(accepted, final)
    chosen, final = [width] * n, np.array(final).tolist()
    for row, (node, j) in enumerate(zip(expanded, np.array(accepted).tolist())):
        chosen[node], final[node] = j, final[n + row]
    return chosen, final[:n]


def _follow_draws(tree: DraftTree, accepted: list[int], final: list[int]) -> tuple[list[int], int]:
    kids, path, draws = _child_index(tree), [0], tree.draws or {}
    while True:
        node = path[-1]
        xs = draws.get(node, [])
        if accepted[node] >= len(xs):
            return path, final[node]
        path.append(kids[(node, xs[accepted[node]])])


def walk(
    tree: DraftTree, target_logprobs: mx.array, sampling: SamplingParams, *, key=None,
) -> tuple[list[int], int]:
    """Exact acceptance of a draft tree.

    ``target_logprobs`` (N + 1, V): the processed target rows (``sampling.logprobs`` of the
    tree forward's logits), row i the distribution after the path root..i. Returns (the
    accepted node ids from 0 down, the token to commit after the last of them): the committed
    tokens are ``tree.tokens[i - 1]`` for the path's nodes past the root, then that token.

    Temperature 0: the target's argmax at each node, descending while it is a child (plain
    greedy decoding). Otherwise the rule of the tree's kind (module docstring). ``key``
    (mx.random.key, consumed: split yours per call) for the draws, else the global generator.
    """
    if target_logprobs.shape[0] != len(tree) + 1:
        raise ValueError(f"{target_logprobs.shape[0]} target rows for a tree of {len(tree)} nodes")
    if sampling.greedy:
        return _follow(tree, np.array(mx.argmax(target_logprobs, axis=-1)).tolist())
    if not tree.sampled:
        return _follow(tree, _deterministic_choices(tree, target_logprobs, key))
    return _follow_draws(tree, *_multi_candidate(tree, target_logprobs, key))
