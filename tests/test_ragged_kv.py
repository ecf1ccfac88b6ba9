"""The batch's attention cache (engine/ragged_kv.py): rows that end at different places, each
written at its own end and rolled back by moving its end alone. Checked against one mlx-lm
``KVCache`` per row through a random run of writes, per-row rollbacks, rows leaving and rows
joining: every row's keys and values, and attention through the layer's mask, are the row's
own. Planted bugs (a mask that ignores the rows' ends, a rollback by the rows' common junk
only, a write at the longest row's end) fail it."""

from __future__ import annotations

import random

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache

from mlxspec.engine import ragged_kv
from mlxspec.engine.ragged_kv import RaggedKVCache

H, D = 2, 8
# fp32 on the CPU: the batch's attention equals each row's to float rounding. On a CUDA GPU the
# masked batched call and the single call (no mask or "causal") take different kernels, and they
# differed by ~1e-4 there (an H200, 2026-11-27; fp32 matmuls there may round as TF32).
TOL = 1e-5 if mx.default_device() == mx.cpu else 2e-3


def fresh(n: int) -> KVCache:
    cache = KVCache()
    if n:
        cache.update_and_fetch(mx.random.normal((1, H, n, D)), mx.random.normal((1, H, n, D)))
    return cache


def attend(q: mx.array, k: mx.array, v: mx.array, mask) -> mx.array:
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=D ** -0.5, mask=mask)


def check_step(batch: RaggedKVCache, alone: list[KVCache], width: int) -> None:
    """Write WIDTH new positions a row into both; attention of the new queries through the
    batch's mask equals each row's attention over its own cache."""
    new_k, new_v = mx.random.normal((len(alone), H, width, D)), mx.random.normal((len(alone), H, width, D))
    q = mx.random.normal((len(alone), H, width, D))
    mask = batch.make_mask(width)
    k, v = batch.update_and_fetch(new_k, new_v)
    got = attend(q, k, v, mask)
    for b, c in enumerate(alone):
        rk, rv = c.update_and_fetch(new_k[b: b + 1], new_v[b: b + 1])
        want = attend(q[b: b + 1], rk, rv, None if width == 1 else "causal")
        assert mx.allclose(got[b: b + 1], want, atol=TOL).item(), (b, batch.ends)


def check_rows(batch: RaggedKVCache, alone: list[KVCache]) -> None:
    assert batch.ends == [c.offset for c in alone]
    assert batch.offset.tolist() == batch.ends
    for b, c in enumerate(alone):
        row = batch.extract(b)
        assert row.offset == c.offset
        if c.offset:
            assert mx.array_equal(row.keys, c.keys[..., : c.offset, :]).item()
            assert mx.array_equal(row.values, c.values[..., : c.offset, :]).item()


def random_run(seed: int, steps: int = 40) -> None:
    rng = random.Random(seed)
    mx.random.seed(seed)
    alone = [fresh(rng.randrange(0, 40)) for _ in range(3)]
    batch = RaggedKVCache.of_rows(alone)
    for _ in range(steps):
        check_rows(batch, alone)
        op = rng.random()
        if op < 0.1 and len(alone) > 1:  # a row leaves
            keep = sorted(rng.sample(range(len(alone)), len(alone) - 1))
            batch.filter(keep)
            alone = [alone[i] for i in keep]
        elif op < 0.2 and len(alone) < 5:  # a row joins, prefilled alone
            row = fresh(rng.randrange(0, 300))
            batch.extend(RaggedKVCache.of_rows([row]))
            alone.append(row)
        else:  # a verify of a width, then each row keeps its own count
            width = rng.choice([1, 2, 5])
            check_step(batch, alone, width)
            junk = [rng.randrange(0, width) for _ in alone]
            batch.retreat(junk)
            for c, j in zip(alone, junk):
                c.trim(j)
    check_rows(batch, alone)


@pytest.mark.parametrize("seed", range(4))
def test_rows_match_their_own_caches_through_a_random_run(seed):
    random_run(seed)


def test_a_uniform_batch_needs_no_mask():
    """Rows that end together: no mask for one token, "causal" for several (a KVCache's)."""
    batch = RaggedKVCache.of_rows([fresh(5), fresh(5)])
    assert batch.make_mask(1) is None and batch.make_mask(3) == "causal"
    batch.retreat([1, 0])
    assert isinstance(batch.make_mask(1), mx.array)


def test_it_serves_a_model_as_its_caches():
    """A tiny model over the batch's caches gives each row the logits of its forward alone."""
    from mlx_lm.models import llama

    args = llama.ModelArgs(model_type="llama", hidden_size=32, num_hidden_layers=2, intermediate_size=64,
                           num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=50)
    mx.random.seed(0)
    model = llama.Model(args)
    prompts = [[1, 2, 3, 4, 5, 6, 7], [8, 9, 10], [11, 12, 13, 14, 15]]
    alone = []
    for p in prompts:
        caches = [KVCache() for _ in model.layers]
        model(mx.array([p]), cache=caches)
        alone.append(caches)
    batch = [RaggedKVCache.of_rows([a[i] for a in alone]) for i in range(len(model.layers))]
    feed = [[20, 21, 22], [23, 24, 25], [26, 27, 28]]
    got = model(mx.array(feed), cache=batch)
    for b, (caches, f) in enumerate(zip(alone, feed)):
        want = model(mx.array([f]), cache=caches)
        assert mx.allclose(got[b: b + 1], want, atol=TOL).item(), b
    # row 1 keeps one of its three, the others two: each goes on from there alone
    junk = [1, 2, 1]
    for layer in batch:
        layer.retreat(junk)
    for caches, j in zip(alone, junk):
        for c in caches:
            c.trim(j)
    got = model(mx.array([[30], [31], [32]]), cache=batch)
    for b, caches in enumerate(alone):
        assert mx.allclose(got[b: b + 1], model(mx.array([[30 + b]]), cache=caches), atol=TOL).item(), b


def ends_ignored(self, N, return_array=False, window_size=None, **_):
    """PLANTED: every row masked as if it ended where the longest one does."""
    return None if N == 1 else "causal"


def common_junk(self, junk, offset=None):
    """PLANTED: every row rolled back by the junk all rows share."""
    m = min(junk)
    self.ends = [e - m for e in self.ends]
    self.offset = mx.array(self.ends, mx.int32)
    return m


def write_at_longest(self, keys, values):
    """PLANTED: every row written where the longest row ends (BatchKVCache's one write index)."""
    N = keys.shape[2]
    e = max(self.ends)
    self._reserve(e + N, keys, values)
    self.keys[..., e: e + N, :] = keys
    self.values[..., e: e + N, :] = values
    self.ends = [x + N for x in self.ends]
    self.offset = self.offset + N
    return self.keys[..., : e + N, :], self.values[..., : e + N, :]


@pytest.mark.parametrize("plant", [ends_ignored, common_junk, write_at_longest], ids=lambda f: f.__name__)
def test_the_planted_bugs_are_caught(plant, monkeypatch):
    name = {ends_ignored: "make_mask", common_junk: "retreat", write_at_longest: "update_and_fetch"}[plant]
    monkeypatch.setattr(ragged_kv.RaggedKVCache, name, plant)
    with pytest.raises(AssertionError):
        for seed in range(4):
            random_run(seed)



def _nodes(*arrays: mx.array) -> int:
    """Operations in the graph of ARRAYS (``mx.export_to_dot``'s operation nodes)."""
    import io
    import re

    dot = io.StringIO()
    mx.export_to_dot(dot, *arrays)
    return len(re.findall(r'\[label\s*=\s*"', dot.getvalue()))


def test_a_layer_more_costs_its_own_writes_and_reads_only():
    """On CUDA every node of a forward's graph costs the host time (docs/benchmarks.md): layers
    that share the rows' offset array (as RaggedCache's do) build the write positions, and
    their broadcast to the keys' shape, once a forward. Each layer more adds its own 2 writes
    (keys, values) and 2 reads (up to the extent): 4 nodes. Before: 6 (a broadcast of the
    positions a write)."""
    def graph(layers: int) -> int:
        rows = [[fresh(n) for n in (3, 5, 8)] for _ in range(layers)]
        caches = [RaggedKVCache.of_rows(r) for r in rows]
        for c in caches[1:]:
            c.offset = caches[0].offset
        mx.eval([(c.keys, c.values, c.offset) for c in caches])
        new = [(mx.random.normal((3, H, 2, D)), mx.random.normal((3, H, 2, D))) for _ in caches]
        mx.eval(new)
        return _nodes(*[a for c, (k, v) in zip(caches, new) for a in c.update_and_fetch(k, v)])

    assert graph(3) - graph(2) == 4


def test_joined_layers_share_one_offset_array():
    """After rows join or leave, every attention layer of the batch holds one offset array, so
    the first forward after it builds its write positions once, not once a layer (7 nodes a
    layer of the 8B shape's 36 before, diag-op-census-h200-8b.json)."""
    from mlx_lm.models import llama

    from mlxspec.engine.batch_cache import RaggedCache

    args = llama.ModelArgs(model_type="llama", hidden_size=32, num_hidden_layers=3, intermediate_size=64,
                           num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=50)
    mx.random.seed(0)
    model = llama.Model(args)
    cache = RaggedCache(model)
    for i, n in enumerate((9, 12, 16)):
        row = [KVCache() for _ in model.layers]
        model(mx.array([[(3 * t + i) % 50 for t in range(n)]]), cache=row)
        cache.join(row)
        if i:
            assert len({id(c.offset) for c in cache.layers}) == 1, i
    cache.keep([0, 2])
    assert len({id(c.offset) for c in cache.layers}) == 1
    assert cache.layers[0].ends == [9, 16]
