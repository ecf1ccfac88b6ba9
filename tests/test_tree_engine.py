"""Draft trees in the loop: temperature 0 gives exactly plain decoding for trees over every
drafter, on dense and hybrid targets, with partial accepts at every depth; a target that cannot
verify a tree falls back to chains; the policy picks chains where trees do not pay."""

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.generate import generate_step

import tiny
import tiny_dflash
from mini_workloads import run_decoder
from mlxspec.engine.drafters.draft_model import DraftModelDrafter
from mlxspec.engine.drafters.pld import PromptLookupDrafter
from mlxspec.engine.gates import CostModel
from mlxspec.engine.tree import DraftTree
from mlxspec.engine.tree_step import TreeOutcome, TreePolicy, chain_accepted
from mlxspec.models.loader import load_model
from mlxspec.models.mtp import load_mtp_head
from test_dflash import SteeredDFlash

N_TOKENS = 40
TEXTS = ["def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return",
         "x = 1\ny = 2\nx = 1\ny = 3\nx = 1\ny = 2\nx = 1\ny ="]


def greedy(model, prompt, n=N_TOKENS):
    return [t for (t, _), _ in zip(generate_step(mx.array(prompt), model, max_tokens=n), range(n))]


def run(model, prompt, n=N_TOKENS, **kw):
    return run_decoder(model, prompt, n, **kw)


@pytest.fixture(scope="module")
def targets(tiny_qwen3, tiny_llama, tiny_qwen3_5):
    out = {}
    for name, path in [("qwen3", tiny_qwen3), ("llama", tiny_llama), ("qwen3_5", tiny_qwen3_5)]:
        loaded = load_model(str(path))
        out[name] = (loaded, path)
    return out


@pytest.fixture(scope="module")
def near_copy(tmp_path_factory, shared_tokenizer):
    """Rescaled copies of the targets' weights: draft models right often, not always."""
    return {arch: mlx_lm.load(str(tiny.write_checkpoint(tmp_path_factory.mktemp(f"near_{arch}"), arch,
                                                         tokenizer=shared_tokenizer, seed=seed, weight_scale=0.23)))[0]
            for arch, seed in [("qwen3", 1), ("qwen3_5", 4)]}


def _partial_everywhere(stats, depth):
    return all(0 < stats.position_accepted[i] < stats.position_drafted[i] for i in range(depth))


@pytest.mark.parametrize("arch", ["qwen3", "llama", "qwen3_5"])
def test_dflash_trees_are_plain_decoding(targets, arch, tmp_path_factory):
    loaded, path = targets[arch]
    drafter_dir = tiny_dflash.write_dflash_checkpoint(tmp_path_factory.mktemp(f"{arch}-DFlash"), path, seed=3)
    model = load_model(str(drafter_dir)).model
    prompt = loaded.tokenizer.encode(TEXTS[0])
    ref = greedy(loaded.model, prompt)
    for depth, budget in [(2, 6), (4, 12), (7, 24)]:
        steered = SteeredDFlash(model, loaded.model, script=ref, prompt_len=len(prompt), rate=0.8, seed=depth)
        out, stats = run(loaded.model, prompt, drafter=steered, depth=depth, tree=budget)
        assert out == ref, (depth, budget)
        assert stats.tree_steps == stats.verify_steps > 0 and stats.tree_nodes > stats.drafted
        assert _partial_everywhere(stats, depth), (stats.position_drafted, stats.position_accepted)


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5"])
def test_draft_model_and_lookup_trees_are_plain_decoding(targets, near_copy, arch):
    loaded, _ = targets[arch]
    for text in TEXTS:
        prompt = loaded.tokenizer.encode(text)
        ref = greedy(loaded.model, prompt)
        chain, chain_stats = run(loaded.model, prompt, drafter=DraftModelDrafter(near_copy[arch]), depth=3, tree=0)
        out, stats = run(loaded.model, prompt, drafter=DraftModelDrafter(near_copy[arch]), depth=3, tree=9)
        assert out == chain == ref and stats.tree_steps > 0
        # at temperature 0 the tree holds the chain: it keeps at least as many tokens a step
        assert stats.accepted / stats.verify_steps >= chain_stats.accepted / chain_stats.verify_steps
        lookup = PromptLookupDrafter(max_ngram=3, min_ngram=1)
        out, stats = run(loaded.model, prompt, drafter=lookup, depth=5, tree=12)
        assert out == ref


def test_lookup_trees_hold_several_matches(targets):
    lookup = PromptLookupDrafter(max_ngram=2, min_ngram=1)
    tokens = [5, 1, 2, 9, 5, 1, 3, 9, 5, 1, 4, 9, 5, 1]
    lookup.start(tokens)
    tree = lookup.propose_tree(tokens, 3, 12, None)
    firsts = [tree.tokens[c - 1] for c in tree.children(0)]
    assert firsts == [4, 3, 2]  # the latest match first, then earlier ones
    loaded, _ = targets["qwen3"]
    prompt = loaded.tokenizer.encode(TEXTS[1])
    ref = greedy(loaded.model, prompt)
    out, stats = run(loaded.model, prompt, drafter=PromptLookupDrafter(max_ngram=2, min_ngram=1), depth=4, tree=10)
    assert out == ref and stats.tree_steps > 0


def test_mtp_trees_are_plain_decoding(targets):
    loaded, path = targets["qwen3_5"]
    head = load_mtp_head(loaded.model, path, loaded.config)
    for text in TEXTS:
        prompt = loaded.tokenizer.encode(text)
        ref = greedy(loaded.model, prompt)
        out, stats = run(loaded.model, prompt, drafter="mtp", mtp_head=head, depth=3, tree=8)
        assert out == ref and stats.tree_steps > 0 and stats.drafter == "mtp"


def test_a_target_that_cannot_verify_trees_falls_back_to_chains(tiny_swa, tmp_path_factory):
    loaded = load_model(str(tiny_swa))  # sliding windows of 8: any tree past them is refused
    prompt = loaded.tokenizer.encode(TEXTS[1])
    ref = greedy(loaded.model, prompt)
    out, stats = run(loaded.model, prompt, drafter=PromptLookupDrafter(max_ngram=2, min_ngram=1), depth=3, tree=8)
    assert out == ref and stats.tree_steps == 0 and stats.verify_steps > 0
    assert stats.tree_note.startswith("this target cannot verify trees")


def test_the_chain_inside_a_tree():
    tree = DraftTree([7, 8, 9, 3], [0, 1, 2, 1])  # chain 7 8 9, and 3 as 7's second child
    assert chain_accepted(tree, [0, 1, 2, 3]) == 3
    assert chain_accepted(tree, [0, 1, 4]) == 1  # the chain would have stopped after 7
    assert chain_accepted(tree, [0]) == 0


def test_the_policy_picks_chains_where_trees_do_not_pay():
    flat = CostModel(curve={n: 1.0 + 0.01 * (n - 1) for n in range(1, 34)}, measured=True)
    steep = CostModel(curve={n: float(n) for n in range(1, 34)}, measured=True)
    assert TreePolicy(None, flat).budget(4, 3.0) == 32  # wide verifies cost nearly nothing
    assert TreePolicy(None, steep).budget(4, 3.0) == 5  # every row costs a forward: one extra node
    hybrid = TreePolicy(None, flat, tree_factor=2.0)  # a hybrid whose tree forward costs 2x
    assert hybrid.budget(4, 3.0) == 0 and "would cost 2.0" in hybrid.why_chain
    policy = TreePolicy(None, flat)
    for _ in range(10):
        policy.observe(TreeOutcome([1], 0, 4, 0))  # trees that keep 1 token a step
    assert policy.budget(4, 3.0) == 0 and policy.off_for > 0  # the chain keeps 3: chains
    assert policy.why_chain.startswith("trees of 32 nodes kept 1.00 tokens a step")
    assert TreePolicy(0, flat).budget(4, 3.0) == 0 and TreePolicy(6, steep).budget(4, 3.0) == 6
