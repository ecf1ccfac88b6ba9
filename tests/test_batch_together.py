"""A batch's rows draft together (``Drafter.propose_together``): an MTP head's rows commit
their new pairs in one forward (pads after a shorter row's, rolled back out), then one head
forward a draft position serves every row; DFlash rows run their blocks as one forward. Both
read the rows' caches merged left-padded (each row its own length and RoPE positions, its
padding masked) and drop the merged cache after.

At the drafter: for a random-weight Qwen3.5, GLM-4.5 (NextN) and DeepSeek-V3 (NextN, MLA
attention) head, and for mini-attn's DFlash drafter, ``propose_together`` gives each of three
rows the tokens and q rows its own ``propose`` gives (MTP rows committing 1, 2 and 3 pairs
first, or one row more than a forward takes), at temperature 0 and seeded 0.8. Planted bugs
fail it for each: the merged cache's padding unmasked, one position for every row, (MTP) a
commit's pads kept, every row's chain fed the first row's hidden state.

In the engine (mini-attn, fp32), MTP rows at different depths and prompt lengths, temperature 0,
seeded above it, one constrained: each row gives its tokens alone, and a sampling row its
counts of drafts made and kept too (the same drafts, drawn from its own stream in its own order).

Pads (engine/batch_step.py): a greedy row whose rows nothing reads drafts on into positions the
step computes anyway (prompt lookup to the step's width, an MTP head as deep as the deepest
chain): its tokens stay its own alone, it makes and keeps more drafts, and seeded rows draft
exactly as alone (planted: seeded rows filling their pads give other tokens). Unseeded
sampling rows fill their pads too: tests/test_batch.py's battery scores their distribution.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.models.cache import BatchKVCache, make_prompt_cache

import mlxspec
import tiny
import tiny_mtp
from mlxspec.engine import batch_step
from mlxspec.engine.cache import ModelState
from mlxspec.engine.drafters import mtp as mtp_mod
from mlxspec.engine.drafters.dflash import DFlashDrafter
from mlxspec.engine.drafters.mtp import MTPDrafter
from mlxspec.engine.sampling import SamplingParams
from mlxspec.models.dflash import DFlashDraftModel
from mlxspec.models.mtp import load_mtp_head
from mlxspec.models.mtp.head import MTPHead
from mlxspec.options import ConstraintSpec
from stream_helpers import drain_items

MODELS = Path(__file__).resolve().parent.parent / "benchmarks" / "models"

IMPORTS = "import os\nimport sys\nimport os\nimport"
LISTS = "x = [1, 2, 3]\ny = [1, 2, 3]\nz = [1, 2,"
REVERSE = "Write a function that reverses a string."
# Every request is seeded, the greedy ones too: a seeded request's gates decide on the default
# cost curve, not on this machine's timing (an unseeded one measures it), so every run decides
# alike, alone and in a batch, on a loaded machine too.
ROWS = [  # every row the MTP head, at its own fixed depth: chains of different lengths a step
    (IMPORTS, dict(drafter="mtp", temperature=0.0, seed=0, depth=3, max_tokens=30)),
    (LISTS, dict(drafter="mtp", temperature=0.8, seed=13, depth=2, max_tokens=30)),
    (REVERSE, dict(drafter="mtp", temperature=0.6, seed=17, depth=4, max_tokens=30)),
    ("Say hi to the people of the town.", dict(drafter="mtp", temperature=0.7, seed=23, repetition_penalty=1.3,
                                                depth=3, max_tokens=30)),
    # a long prompt: the other rows' caches are merged behind a hundred and more padding slots
    (LISTS * 12, dict(drafter="mtp", temperature=0.9, seed=29, depth=2, max_tokens=30)),
    # a constraint: each chain draw masked to the language after the row's own draws so far
    (REVERSE, dict(drafter="mtp", temperature=0.5, seed=31, depth=3, max_tokens=20,
                   constraint=ConstraintSpec("regex", "[a-z ]{4,60}\\.")))
]


@pytest.fixture(scope="module")
def spec():
    s = mlxspec.load(str(MODELS / "mini-attn"))
    s.astype("float32")
    return s


def outcome(spec, prompt, options):
    """(tokens, drafts kept, drafts made) of one request served alone."""
    r = spec.generate(prompt, reuse=False, **options)
    return r.tokens, r.stats.accepted, r.stats.drafted


@pytest.fixture(scope="module")
def alone(spec):
    return [outcome(spec, p, o) for p, o in ROWS]


def in_one_batch(spec, requests, draft_together: bool = True) -> list[tuple[list[int], int, int]]:
    """REQUESTS ((prompt, options) each) in one batch from the start: each one's (tokens, drafts
    kept, drafts made)."""
    batch = spec.batch(len(requests))
    batch.draft_together = draft_together
    out = []
    for chunks in drain_items(spec.stream_in(batch, p, reuse=False, **o) for p, o in requests):
        stats = chunks[-1].stats
        out.append(([t for c in chunks for t in c.tokens], stats.accepted, stats.drafted))
    return out


def together(spec, draft_together: bool = True) -> list[tuple[list[int], int, int]]:
    return in_one_batch(spec, ROWS, draft_together)


@pytest.fixture
def widths(monkeypatch):
    """(rows, pairs a row) of every batched head forward."""
    seen = []
    real = MTPHead.forward_rows
    monkeypatch.setattr(MTPHead, "forward_rows", lambda self, tokens, hidden, cache, step=0: (
        seen.append(tuple(tokens.shape)), real(self, tokens, hidden, cache, step))[1])
    return seen


def same_as_alone(got, alone) -> list[bool]:
    """Per row of ROWS: its tokens alone, and for the rows that sample (all but the first, greedy
    one, which drafts into the pads: below) its counts of drafts made and kept too."""
    return [g == a if i else g[0] == a[0] for i, (g, a) in enumerate(zip(got, alone))]


def test_rows_draft_together_and_each_gives_what_it_gives_alone(spec, alone, widths):
    assert all(a[2] > a[1] > 0 for a in alone[:-1]), alone  # drafts kept and rejected, every row
    assert alone[-1][2] > 0, alone  # the constrained row drafted (its drafts were not kept)
    assert all(same_as_alone(together(spec), alone))
    assert sum(b >= 3 for b, _ in widths) >= 10, widths  # three rows and more, as one forward
    assert sum(w > 1 for _, w in widths) >= 5, widths  # commits of several pairs a row (pads after shorter ones)


def test_rows_told_to_draft_apart_draft_one_by_one(spec, alone, widths):
    """``draft_together=False`` (what benchmarks/diag_batch_drafting.py compares with): no head
    forward serves several rows, and each row still gives what it gives alone."""
    assert together(spec, draft_together=False) == alone
    assert not widths


def mtp_row(model, head, prompt: list[int], pending: int | None = None):
    """A head's drafter for PROMPT after MODEL's prefill of it (its final-norm hidden rows
    handed over), the next token sampled: (drafter, the committed tokens), ready to propose.
    PENDING pairs (default len(PROMPT) // 5) are left to commit, as after a verify that kept
    drafts: the rows of PROMPTS then commit 1, 2 and 3 pairs before they draft."""
    h = head.trunk.body(mx.array([prompt]), cache=make_prompt_cache(model))[0]
    d = MTPDrafter(head)
    d.start(prompt)
    d.prefill(prompt, len(prompt) + 1 - (len(prompt) // 5 if pending is None else pending), h)
    return d, prompt + [prompt[-1] + 1]


def dflash_row(target, model, prompt: list[int]):
    """A DFlash drafter after TARGET's prefill of PROMPT but its last token (the layers it reads
    handed over): (drafter, PROMPT), ready to propose."""
    state = ModelState(target, keep_hidden=True, capture=tuple(model.args.target_layer_ids))
    features = state.prefill(prompt[:-1])
    state.close()
    d = DFlashDrafter(model, target)
    d.start(prompt)
    d.prefill(prompt, len(prompt) - 1, features)
    return d, prompt


@pytest.fixture(scope="module", params=["qwen3_5", "glm4_moe", "deepseek_v3", "dflash"])
def kind(request, tmp_path_factory):
    """(the drafter class, a function PROMPT -> (drafter, tokens)) for a random tiny model of each
    MTP family with its head (the Qwen block, GLM's NextN layer, DeepSeek's with MLA attention,
    its layer in a sidecar as test_mtp_nextn keeps it), and for mini-attn's DFlash drafter."""
    out = tmp_path_factory.mktemp(request.param)
    if request.param == "dflash":
        spec = mlxspec.load(str(MODELS / "mini-attn"), draft_model=str(MODELS / "mini-attn-DFlash"))
        spec.astype("float32")
        return DFlashDrafter, lambda prompt: dflash_row(spec.target.model, spec.draft.model, prompt)
    if request.param == "qwen3_5":
        path = tiny.write_checkpoint(out, "qwen3_5", vocab_size=38, seed=4)
    elif request.param == "glm4_moe":
        path = tiny_mtp.write_nextn_checkpoint(out, "glm4_moe", vocab_size=32, seed=1)
    else:
        path = tiny_mtp.write_nextn_checkpoint(out, "deepseek_v3", vocab_size=32, seed=2, hidden_size=32,
                                               intermediate_size=64, moe_intermediate_size=16, q_lora_rank=16)
        tiny_mtp.nextn_to_sidecar(path)
    model, _, config = mlx_lm.load(str(path), return_config=True)
    head = load_mtp_head(model, path, config)
    return MTPDrafter, lambda prompt, **kw: mtp_row(model, head, prompt, **kw)


PROMPTS = [[3, 5, 7, 9, 11], [2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22], list(range(1, 18))]
DEPTHS = [3, 1, 4]


def alone_and_together(kind, temperature):
    """Three rows (prompts of 5, 11 and 17 tokens; depths 3, 1 and 4), each drafted by its own
    propose, then again (the same start) by propose_together: (alone, together, drafters)."""
    cls, make = kind

    def rows():
        drafters, tokens = zip(*(make(p) for p in PROMPTS))
        samplings = [SamplingParams(temperature=temperature).for_request(seed) for seed in (1, 2, 3)]
        return list(drafters), list(tokens), samplings

    drafters, tokens, samplings = rows()
    alone = [d.propose(t, k, s) for d, t, k, s in zip(drafters, tokens, DEPTHS, samplings)]
    drafters, tokens, samplings = rows()
    return alone, cls.propose_together(drafters, tokens, DEPTHS, samplings), drafters


def same(a, g) -> bool:
    return a.host_tokens() == g.host_tokens() and mx.allclose(a.rows, g.rows, atol=1e-5).item()


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_drafts_made_together_are_each_made_alone(kind, temperature):
    """Each row gets the tokens and q rows its own propose gives, from the same random stream."""
    alone, got, drafters = alone_and_together(kind, temperature)
    for a, g, k in zip(alone, got, DEPTHS):
        assert same(a, g) and len(g) == k
        assert (a.logprobs is None) == (g.logprobs is None) == (temperature == 0)
    # each row's cache holds its committed context only (MTP: every pair, those committed
    # together too): what was drafted went to the merged cache
    stored = [len(p) - (kind[0] is DFlashDrafter) for p in PROMPTS]
    assert [d.cache[0].offset for d in drafters] == stored


@pytest.mark.parametrize("plant", ["unmasked padding", "one position", "commit pads kept", "first row's hidden"])
def test_the_planted_merged_cache_bugs_are_caught_for_every_drafter(kind, plant, monkeypatch):
    """PLANTED: the merged cache's padding attended; every row at the longest row's position;
    (MTP) the pads after a row's shorter commit left in the merged cache the chain reads; every
    row's chain continued from the first row's hidden state."""
    if plant in ("commit pads kept", "first row's hidden") and kind[0] is DFlashDrafter:
        pytest.skip("a DFlash block commits nothing and feeds no hidden state back")
    if plant == "commit pads kept":
        monkeypatch.setattr(mtp_mod, "roll_rows", lambda layers, shifts: None)
    if plant == "first row's hidden":
        real_step = MTPHead.step_rows
        monkeypatch.setattr(MTPHead, "step_rows", lambda self, tokens, hidden, cache, step=0: real_step(
            self, tokens, mx.broadcast_to(hidden[:1], hidden.shape), cache, step))
    real = BatchKVCache.merge

    def planted(caches):
        cache = real(caches)
        if plant == "unmasked padding":
            cache.left_padding = mx.zeros_like(cache.left_padding)
        elif plant == "one position":
            cache.offset = mx.full(cache.offset.shape, cache._idx, cache.offset.dtype)
        return cache

    monkeypatch.setattr(BatchKVCache, "merge", planted)
    if plant == "one position" and kind[0] is DFlashDrafter:  # its positions come from the tokens
        real_rows = DFlashDraftModel.forward_rows
        monkeypatch.setattr(DFlashDraftModel, "forward_rows", lambda self, embedded, cache, positions: real_rows(
            self, embedded, cache, mx.full(positions.shape, positions.max().item(), positions.dtype)))
    alone, got, _ = alone_and_together(kind, 0.8)
    assert not all(same(a, g) for a, g in zip(alone, got))


def test_a_row_with_many_pairs_pending_commits_in_pieces_and_drafts_with_the_others(kind):
    """A row that decoded plainly for a while has more pairs to commit than one forward takes
    (ONE_PIECE): the rows then commit alone, in pieces, and still draft together."""
    cls, make = kind
    if cls is not MTPDrafter:
        pytest.skip("a DFlash block commits nothing")
    prompts = [[(7 * i) % 30 + 1 for i in range(40)], [3, 5, 7, 9, 11, 13]]

    def rows():
        made = [make(prompts[0], pending=mtp_mod.ONE_PIECE + 5), make(prompts[1])]
        return [d for d, _ in made], [t for _, t in made], [SamplingParams(0.8).for_request(s) for s in (4, 5)]

    drafters, tokens, samplings = rows()
    assert len(tokens[0]) - 1 - drafters[0].pairs == mtp_mod.ONE_PIECE + 5
    alone = [d.propose(t, k, s) for d, t, k, s in zip(drafters, tokens, (3, 2), samplings)]
    drafters, tokens, samplings = rows()
    got = cls.propose_together(drafters, tokens, [3, 2], samplings)
    assert all(same(a, g) for a, g in zip(alone, got))
    assert [d.pairs for d in drafters] == [len(t) - 1 for t in tokens]


# -- pads: a greedy row drafts into the positions the step computes anyway --------------------

PADDED = [  # greedy rows at depths the others exceed, and sampling rows that must not fill
    (IMPORTS, dict(drafter="pld", seed=0, depth=2, max_tokens=40)),
    (LISTS, dict(drafter="pld", seed=0, depth=6, max_tokens=40)),
    (LISTS * 3, dict(drafter="pld", seed=0, depth=3, max_tokens=40)),
    (IMPORTS, dict(drafter="mtp", seed=0, depth=1, max_tokens=30)),
    (LISTS, dict(drafter="mtp", seed=0, depth=3, max_tokens=30)),
    (LISTS * 3, dict(drafter="pld", temperature=0.3, seed=41, depth=2, max_tokens=40)),
    (IMPORTS, dict(drafter="mtp", temperature=0.8, seed=37, depth=1, max_tokens=30)),
]
FILLS = [0, 1, 2, 3, 4]  # PADDED's greedy rows (rows 1 and 4 are their kinds' deepest)
SEEDED = [5, 6]


@pytest.fixture(scope="module")
def padded_alone(spec):
    """PADDED served alone: (tokens, drafts kept, drafts made) each."""
    return [outcome(spec, p, o) for p, o in PADDED]


def test_greedy_rows_draft_into_the_pads_and_give_what_they_give_alone(spec, padded_alone):
    """Greedy rows at depths below the step's width draft on into it (prompt lookup to the
    width, an MTP head as deep as its kinds' deepest chain): each gives its tokens alone, and
    makes and keeps more drafts. The seeded rows draft exactly as alone."""
    alone, got = padded_alone, in_one_batch(spec, PADDED)
    assert [g[0] for g in got] == [a[0] for a in alone]
    assert [got[i] for i in SEEDED] == [alone[i] for i in SEEDED]  # drafts, draws, tokens: their own
    more = [i for i in FILLS if got[i][2] > alone[i][2]]
    assert {0, 2, 3} <= set(more), (got, alone)  # the shallower greedy rows drafted more
    assert sum(got[i][1] for i in FILLS) > sum(alone[i][1] for i in FILLS)  # and kept more


def test_the_planted_seeded_rows_filling_their_pads_are_caught(spec, padded_alone, monkeypatch):
    """PLANTED: every row fills its pads, the seeded ones too (their draws then fall on other
    drafts): their tokens are not their own alone."""
    monkeypatch.setattr(batch_step, "fills_pads", lambda row: True)
    alone, got = padded_alone, in_one_batch(spec, PADDED)
    assert all(got[i][0] != alone[i][0] for i in SEEDED)
