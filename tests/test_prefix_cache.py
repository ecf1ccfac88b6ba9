"""Prefix reuse across requests: snapshots, the LRU cache, and the engine's exactness with it."""

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import mlxspec
from mlxspec.engine.cache import ModelState, Snapshot
from mlxspec.engine.prefix_cache import PrefixCache
from mlxspec.errors import UsageError
from mlxspec.models.loader import load_model

MODELS = Path(__file__).resolve().parent.parent / "benchmarks" / "models"
TURNS = [
    "def add(a, b):\n    return a + b\n\nWrite a test for add.",
    "Now write one for subtract.",
    "And one for multiply, with a docstring.",
]


def _ids(n, seed=0, vocab=500):
    return np.random.default_rng(seed).integers(3, vocab, size=n).tolist()


# -- snapshots -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def models(tiny_qwen3, tiny_qwen3_5, tiny_swa):
    return {"dense": load_model(str(tiny_qwen3)).model, "hybrid": load_model(str(tiny_qwen3_5)).model,
            "sliding": load_model(str(tiny_swa)).model}


@pytest.mark.parametrize("kind", ["dense", "hybrid", "sliding"])
def test_a_restored_snapshot_continues_exactly_and_never_changes(models, kind):
    model, prompt, more = models[kind], _ids(20), _ids(6, seed=1)
    live = ModelState(model)
    live.prefill(prompt)
    snap = live.snapshot()
    assert snap.length == 20 and snap.trimmable == (kind == "dense")
    # the live cache goes on writing into its buffers (one token at a time: in place)
    for t in more:
        live.forward(mx.array([t], mx.uint32), rollback=False)
    restored = ModelState(model)
    restored.restore(snap, 20)
    fresh = ModelState(model)
    fresh.prefill(prompt)
    x = mx.array(more, mx.uint32)
    got, want = restored.forward(x, rollback=False), fresh.forward(x, rollback=False)
    assert np.array_equal(np.array(got), np.array(want))
    # and the snapshot still serves the next request the same way
    again = ModelState(model)
    again.restore(snap, 20)
    assert np.array_equal(np.array(again.forward(x, rollback=False)), np.array(want))


def test_an_attention_snapshot_serves_any_shorter_prefix(models):
    model, prompt = models["dense"], _ids(30, seed=2)
    full = ModelState(model)
    full.prefill(prompt)
    snap = full.snapshot()
    short = ModelState(model)
    short.restore(snap, 17)
    assert short.length == 17
    got = short.forward(mx.array(prompt[17:] + [5], mx.uint32), rollback=False)[-1]
    want = full.forward(mx.array([5], mx.uint32), rollback=False)[-1]
    # (CUDA's fp32 GEMMs round differently per shape: equal to 1e-3 there, 1e-5 on the CPU)
    assert np.allclose(np.array(got), np.array(want), atol=1e-3, rtol=1e-3)
    assert int(mx.argmax(got)) == int(mx.argmax(want))


def test_recurrent_state_is_only_restored_where_it_was_taken(models):
    state = ModelState(models["hybrid"])
    state.prefill(_ids(12))
    snap = state.snapshot()
    with pytest.raises(ValueError):
        ModelState(models["hybrid"]).restore(snap, 8)


# -- the LRU cache -------------------------------------------------------------------------

def _snap(length, trimmable=True, nbytes_per_token=4):
    k = mx.zeros((1, 1, length, nbytes_per_token // 4))
    return Snapshot(length, [("kv", k, mx.zeros((1, 1, 0, 1)))], trimmable)


def test_lookup_picks_the_longest_usable_prefix():
    cache = PrefixCache(1 << 20)
    cache.store([1, 2, 3, 4, 5, 6], _snap(6))
    cache.store([1, 2, 9, 9], _snap(4, trimmable=False))
    cache.store([1, 2, 3], _snap(3, trimmable=False))
    entry, n = cache.lookup([1, 2, 3, 4, 7, 7, 7], limit=6)
    assert n == 4 and entry.target.length == 6  # trimmable: cut to the common prefix
    entry, n = cache.lookup([1, 2, 9, 9, 9], limit=4)
    assert n == 4 and not entry.target.trimmable  # exact entry, whole
    assert cache.lookup([1, 2, 9, 8, 8], limit=4)[1] == 2  # the hybrid one cannot be cut: trimmable wins
    assert cache.lookup([7, 1, 2], limit=2) is None
    assert cache.lookup([1, 2, 3, 4, 5, 6, 7], limit=3)[1] == 3  # the limit keeps a token to feed


def test_a_trimmable_entry_replaces_the_prefixes_it_covers_and_the_budget_evicts_lru():
    cache = PrefixCache(1 << 20)
    cache.store([1, 2, 3], _snap(3))
    cache.store([1, 2, 3, 4, 5], _snap(5))
    assert len(cache) == 1
    cache.store([8, 8], _snap(2, trimmable=False))
    cache.store([8, 8, 8], _snap(3, trimmable=False))
    assert len(cache) == 3  # recurrent snapshots at different points are all kept

    small = PrefixCache(max_bytes=80)  # 8 bytes per token: 4 of cache in these fakes, 4 of token id
    small.store([1] * 4, _snap(4))
    small.store([2] * 4, _snap(4))
    small.lookup([1] * 5, limit=4)  # 1s now most recent
    small.store([3] * 4, _snap(4))
    assert small.lookup([2] * 5, limit=4) is None and small.lookup([1] * 5, limit=4) is not None
    small.store([4] * 20, _snap(20))  # bigger than the whole budget: not kept
    assert small.lookup([4] * 21, limit=20) is None and small.nbytes <= 80
    off = PrefixCache(0)
    off.store([1, 2], _snap(2))
    assert len(off) == 0


def brute_force(stored, tokens, limit):
    """The scan the index replaced: every entry read; the longest usable prefix."""
    want = list(tokens[:limit])
    best = 0
    for seq, trimmable in stored:
        n = next((i for i, (a, b) in enumerate(zip(seq, want)) if a != b), min(len(seq), len(want)))
        if trimmable or n == len(seq):
            best = max(best, n)
    return best


@pytest.mark.parametrize("seed", range(4))
def test_the_index_finds_what_a_scan_of_every_entry_finds(seed):
    """Random conversations sharing prefixes (a common system prompt, branches, prefixes of
    each other), both kinds of entry: every lookup's length is the scan's."""
    rng = np.random.default_rng(seed)
    cache, stored = PrefixCache(1 << 30), []
    trunks = [[int(t) for t in rng.integers(0, 5, rng.integers(1, 12))] for _ in range(6)]
    for _ in range(120):
        tokens = trunks[int(rng.integers(len(trunks)))] + [int(t) for t in rng.integers(0, 4, rng.integers(0, 10))]
        trimmable = bool(rng.random() < 0.5)
        cache.store(tokens, _snap(len(tokens), trimmable=trimmable))
        if trimmable:  # it replaces the entries that are its prefixes
            stored = [(s, t) for s, t in stored if not (len(s) <= len(tokens) and tokens[:len(s)] == s)]
        stored = [(s, t) for s, t in stored if s != tokens] + [(tokens, trimmable)]
        assert len(cache) == len(stored)
        query = trunks[int(rng.integers(len(trunks)))] + [int(t) for t in rng.integers(0, 4, rng.integers(0, 12))]
        limit = int(rng.integers(1, len(query) + 1))
        found = cache.lookup(query, limit)
        expected = brute_force(stored, query, limit)
        assert (found[1] if found else 0) == expected, (query, limit)
        if found:  # the entry really holds that prefix
            entry, n = found
            assert list(entry.tokens[:n]) == query[:n]


def test_a_lookup_and_a_store_read_a_few_entries_not_all(monkeypatch):
    """10k entries sharing a system prompt, as a soak left 1,883: a lookup compares a few
    sequences (the scan compared all 10k: 33 ms a lookup, 88 ms a store on this machine)."""
    from mlxspec.engine import prefix_index

    cache = PrefixCache(1 << 34)
    system = list(range(100, 400))
    snap = _snap(1)
    for i in range(10_000):
        tokens = system + [i % 97, i // 97, 7, i]
        cache.store(tokens, Snapshot(len(tokens), snap.leaves, True))
    calls = []
    real = prefix_index.shared_tokens
    monkeypatch.setattr(prefix_index, "shared_tokens", lambda a, b: calls.append(1) or real(a, b))
    entry, n = cache.lookup(system + [5, 3, 7, 5 + 3 * 97, 1, 2], limit=500)
    assert n == len(system) + 4 and len(calls) <= 4
    calls.clear()
    cache.store(system + [5, 3, 7, 999], Snapshot(len(system) + 4, snap.leaves, True))
    assert len(calls) <= 4 and len(cache) == 10_001
    monkeypatch.undo()
    import time

    t0 = time.perf_counter()
    for i in range(200):
        cache.lookup(system + [i % 97, 1, 2], limit=500)
    assert (time.perf_counter() - t0) / 200 < 0.005


def test_shared_tokens():
    from mlxspec.engine.prefix_index import encode, shared_tokens

    a = encode([1, 2, 3, 4])
    assert shared_tokens(a, encode([1, 2, 3, 4, 5])) == 4
    assert shared_tokens(a, encode([1, 2, 0])) == 2
    assert shared_tokens(a, encode([1, 2 + 256, 3])) == 1  # a difference in any byte of a token
    assert shared_tokens(a, encode([])) == 0


# -- the engine: reuse gives the same tokens ---------------------------------------------

@pytest.fixture(scope="module")
def minis():
    hybrid = mlxspec.load(str(MODELS / "mini-hybrid"))
    attn = mlxspec.load(str(MODELS / "mini-attn"), draft_model=str(MODELS / "mini-draft"))
    for spec in (hybrid, attn):
        spec.astype("float32")
    return {"hybrid": hybrid, "attn": attn}


def _chat(spec, drafter, reuse, turns=TURNS, max_tokens=24):
    history, out = [], []
    for text in turns:
        history.append({"role": "user", "content": text})
        r = spec.generate(list(history), max_tokens=max_tokens, drafter=drafter, reuse=reuse)
        history.append({"role": "assistant", "content": r.text})
        out.append(r)
    return out


@pytest.mark.parametrize("model,drafter", [("hybrid", "mtp"), ("hybrid", "pld"), ("hybrid", "none"),
                                           ("attn", "mtp"), ("attn", "draft"), ("attn", "pld")])
def test_a_chat_with_reuse_writes_exactly_what_it_writes_without(minis, model, drafter):
    spec = minis[model]
    spec.prompt_cache.clear()
    with_reuse = _chat(spec, drafter, reuse=True)
    without = _chat(spec, drafter, reuse=False)
    assert [r.tokens for r in with_reuse] == [r.tokens for r in without]
    assert with_reuse[0].stats.cached_tokens == 0
    for before, r in zip(with_reuse, with_reuse[1:]):
        # at least the whole previous prompt came from the cache
        assert r.stats.cached_tokens >= before.stats.prompt_tokens - 1, r.stats.to_dict()
    assert all(r.stats.cached_tokens == 0 for r in without)
    if drafter in ("mtp", "draft"):  # drafting from restored drafter state still works
        assert sum(r.stats.accepted for r in with_reuse) > 0


def test_interleaved_conversations_each_reuse_their_own_prefix(minis):
    spec = minis["hybrid"]
    spec.prompt_cache.clear()
    a, b, before = [], [], {}
    for i in range(2):
        for name, history, text in (("a", a, TURNS[i]), ("b", b, "Say something about lists. " * (i + 1))):
            history.append({"role": "user", "content": text})
            r = spec.generate(list(history), max_tokens=12, drafter="mtp")
            history.append({"role": "assistant", "content": r.text})
            if i:  # the other conversation ran in between: its entries did not replace these
                assert r.stats.cached_tokens >= before[name] - 1
            before[name] = r.stats.prompt_tokens
    assert spec.prompt_cache.stats()["hits"] >= 2


def test_a_prompt_diverging_inside_a_cached_answer_restarts_the_head_one_token_early(minis):
    """mini-attn's cache is trimmable: the new prompt reuses a cut prefix of the old answer;
    the MTP head had committed pairs past it, so the target restores one token less.
    Gates off: a gate that switched the head off (measured costs, a loaded CI machine) leaves
    it behind the target, and its state is then not stored at all."""
    spec = minis["attn"]
    spec.prompt_cache.clear()
    prompt = spec.encode("Write a function that reverses a string.")
    first = spec.generate(prompt, max_tokens=30, drafter="mtp", gates=False)
    branch = prompt + first.tokens[:12] + spec.encode("x = 1", raw=True)
    got = spec.generate(branch, max_tokens=20, drafter="mtp", gates=False)
    want = spec.generate(branch, max_tokens=20, drafter="mtp", reuse=False, gates=False)
    assert got.tokens == want.tokens
    assert got.stats.cached_tokens == len(prompt) + 12 - 1
    assert got.stats.accepted > 0


def test_budget_and_disabled_cache_keep_outputs(minis):
    spec = minis["attn"]
    spec.prompt_cache = PrefixCache(max_bytes=1)  # nothing fits
    assert [r.tokens for r in _chat(spec, "pld", True)] == [r.tokens for r in _chat(spec, "pld", False)]
    assert len(spec.prompt_cache) == 0
    spec.prompt_cache = PrefixCache(2 << 30)


# -- chunked prefill and the context limit -------------------------------------------------

def test_chunked_prefill_reports_progress_and_changes_nothing(minis):
    spec = minis["hybrid"]
    prompt = spec.encode(TURNS[0] * 4)
    seen = []
    small = spec.generate(prompt, max_tokens=16, drafter="mtp", reuse=False, prefill_step=7,
                          on_prefill=lambda done, total: seen.append((done, total)))
    whole = spec.generate(prompt, max_tokens=16, drafter="mtp", reuse=False)
    assert small.tokens == whole.tokens
    total = len(prompt) - 1
    assert [d for d, _ in seen] == sorted(d for d, _ in seen) and seen[-1] == (total, total)
    assert len(seen) >= total // 7


def test_a_prompt_over_the_context_is_refused_and_max_tokens_is_cut(minis, monkeypatch):
    spec = minis["attn"]
    limit = 64
    monkeypatch.setitem(spec.target.config, "max_position_embeddings", limit)
    with pytest.raises(UsageError, match="context of 64 tokens"):
        spec.generate(_ids(64, vocab=300), max_tokens=4)
    r = spec.generate(_ids(60, vocab=300), max_tokens=50, drafter="none")
    assert len(r.tokens) <= 4


def test_prefill_step_must_be_positive(minis):
    with pytest.raises(UsageError):
        minis["attn"].generate("hi", max_tokens=2, prefill_step=0)


def test_a_thinking_template_reuses_the_conversation_up_to_the_last_user_turn(minis, monkeypatch):
    """Qwen3.6's template opens <think> in the generation prompt and drops older turns'
    reasoning when it renders them again: the hybrid's state from the end of the prompt or
    answer is never a prefix of the next prompt, the checkpoint before the generation prompt is."""
    spec, THINK = minis["hybrid"], {"enable_thinking": True}
    template = (Path(__file__).parent / "data" / "chat_templates" / "Qwen3.6.jinja").read_text()
    monkeypatch.setattr(spec.tokenizer._tokenizer, "chat_template", template)
    spec.prompt_cache.clear()

    def chat(reuse):
        history, out = [], []
        for text in TURNS:
            history.append({"role": "user", "content": text})
            ids = spec.encode(history, template_kwargs=THINK)
            boundary = spec.reuse_points(history, ids, template_kwargs=THINK)
            r = spec.generate(list(history), max_tokens=12, drafter="mtp", reuse=reuse, template_kwargs=THINK)
            # (a fixed answer: this model's random text could itself start like "<think>")
            history.append({"role": "assistant", "content": "<think>\nLet me see.\n</think>\n\nDone."})
            out.append((r, boundary))
        return out

    got, want = chat(True), chat(False)
    assert [r.tokens for r, _ in got] == [r.tokens for r, _ in want]
    assert spec.tokenizer.decode(spec.encode("x", template_kwargs=THINK)).endswith("assistant\n<think>\n")
    for (before, boundary), (r, _) in zip(got, got[1:]):
        assert boundary and r.stats.cached_tokens == boundary[0]


# -- the server: several clients, each reusing its own conversation ---------------------------

def test_the_server_reuses_each_clients_conversation_and_says_so_in_usage(minis):
    anthropic = pytest.importorskip("anthropic")
    openai = pytest.importorskip("openai")
    import httpx

    from mlxspec.server.app import create_app
    from mlxspec.server.common import Settings
    from server_helpers import running

    spec = minis["hybrid"]
    spec.prompt_cache = PrefixCache(2 << 30)
    app = create_app(spec, Settings(model_name="mini"))
    a_history, b_history, a_prompt, b_prompt = [], [], 0, 0
    with running(app) as url:
        oa = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        an = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0)
        for i in range(3):
            a_history.append({"role": "user", "content": TURNS[i]})
            r = oa.chat.completions.create(model="mini", messages=a_history, max_tokens=12, temperature=0)
            a_history.append({"role": "assistant", "content": r.choices[0].message.content})
            cached = r.usage.prompt_tokens_details.cached_tokens
            assert (cached >= a_prompt - 1) if i else cached == 0
            a_prompt = r.usage.prompt_tokens

            b_history.append({"role": "user", "content": "Lists and tuples, turn %d." % i})
            m = an.messages.create(model="mini", messages=b_history, max_tokens=12, extra_body={"temperature": 0})
            b_history.append({"role": "assistant", "content": m.content[0].text if m.content else ""})
            assert (m.usage.cache_read_input_tokens >= b_prompt - 1) if i else m.usage.cache_read_input_tokens == 0
            b_prompt = m.usage.input_tokens
        metrics = httpx.get(url + "/metrics").text
        assert "mlxspec_prompt_cache_hits_total 4" in metrics
        reused = [a_history[-1]["content"], b_history[-1]["content"]]
        spec.prompt_cache.max_bytes = 0  # the same last turns again, nothing reused
        r = oa.chat.completions.create(model="mini", messages=a_history[:-1], max_tokens=12, temperature=0)
        m = an.messages.create(model="mini", messages=b_history[:-1], max_tokens=12, extra_body={"temperature": 0})
        assert r.usage.prompt_tokens_details.cached_tokens == 0
        assert [r.choices[0].message.content, m.content[0].text if m.content else ""] == reused
    spec.prompt_cache.max_bytes = 2 << 30


def test_serve_refuses_a_bad_prompt_cache_size():
    from typer.testing import CliRunner

    from mlxspec import cli

    result = CliRunner().invoke(cli.app, ["serve", "--prompt-cache-bytes", "lots"])
    assert result.exit_code == 2
    assert "--prompt-cache-bytes must be a size such as 2GiB" in result.output


def test_sizes_parse():
    from mlxspec.config import parse_bytes

    assert parse_bytes("2GiB") == 2 << 30 and parse_bytes("512MB") == 512 * 10**6
    assert parse_bytes("0") == 0 and parse_bytes("1.5g") == 1_500_000_000 and parse_bytes("100") == 100
    with pytest.raises(UsageError):
        parse_bytes("-1")


def test_a_smaller_budget_evicts_at_once_and_zero_empties_the_cache():
    cache = PrefixCache(1 << 20)
    for i in range(3):
        cache.store([i] * 4, _snap(4))
    cache.max_bytes = 64  # two entries of 4 tokens (4 + 4 bytes each)
    assert len(cache) == 2 and cache.lookup([0] * 5, limit=4) is None
    cache.max_bytes = 0
    assert len(cache) == 0 and cache.lookup([2] * 5, limit=4) is None


def test_run_shows_prefill_progress_and_reused_tokens():
    from mlxspec.engine.stats import Stats
    from mlxspec.ui import stats_line, status_text

    assert "prefilling 512/2048 prompt tokens (25%)" in status_text(None, (512, 2048)).plain
    assert status_text(None).plain == "prefilling…"
    line = stats_line(Stats(prompt_tokens=900, cached_tokens=850, generated_tokens=3))
    assert "prompt 900 tok" in line and "(850 reused)" in line
