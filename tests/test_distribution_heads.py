"""Temperature > 0 with the drafters that read the target (its hidden states or its cache): the
committed tokens follow plain sampling's distribution, drafted and scored at several positions.

The battery, the power computation and the planted wrong rules are tests/test_distribution.py's
(see there); the cases:
  mtp        a Qwen3.5 MTP head on its hybrid target (GatedDeltaNet + attention): partial accepts
             roll the recurrent state back while sampling
  nextn      a GLM-4.5 NextN head, through the mtp drafter
  assistant  a Gemma-4 assistant drafting from the target's own (rolled-back) K/V cache
Their heads are random, so they are accepted less often than the draft model of
test_distribution.py: each prompt and temperature was picked for rejections at positions 1, 2
and 3 as well as for a small N.
"""

from __future__ import annotations

import mlx_lm
import pytest

import tiny
from mlxspec.engine.sampling import SamplingParams
from test_distribution import Case, check_exact, check_planted, check_power


def _with_head(path):
    from mlxspec.models.mtp import load_mtp_head

    model, _, config = mlx_lm.load(str(path), return_config=True)
    return model, load_mtp_head(model, path, config)


def case_mtp(mktemp) -> Case:
    model, head = _with_head(tiny.write_checkpoint(mktemp("q35_v8"), "qwen3_5", vocab_size=8, seed=3,
                                                   num_hidden_layers=2))  # linear attention, then full
    return Case(model, [2, 3, 2, 3, 2, 3, 2], SamplingParams(temperature=0.35), n=350, planted="accept at 2",
                n_planted=60, drafter="mtp", mtp_head=head)


def case_nextn(mktemp) -> Case:
    import tiny_mtp

    model, head = _with_head(tiny_mtp.write_nextn_checkpoint(mktemp("glm_v8"), "glm4_moe", vocab_size=8, seed=1))
    return Case(model, [7, 0, 0, 7, 0, 0, 7], SamplingParams(temperature=0.5), n=250, planted="accept at 2",
                n_planted=100, drafter="mtp", mtp_head=head)


def case_assistant(mktemp) -> Case:
    import tiny_gemma4
    from mlxspec.models.gemma4_assistant import load_assistant
    from mlxspec.models.loader import load_model

    folder = mktemp("gemma4_v8")
    target_dir = tiny_gemma4.write_target(folder / "target", vocab_size=8, seed=31)
    assistant = load_assistant(tiny_gemma4.write_assistant(
        folder / "a", target_dir, sparse=True, seed=32, num_centroids=4, centroid_intermediate_top_k=2), "a")[0]
    return Case(load_model(str(target_dir)).model, [1, 3, 7, 7], SamplingParams(temperature=0.3), n=300,
                planted="accept at 2", n_planted=60, drafter="assistant", draft_model=assistant)


CASES = {"mtp": case_mtp, "nextn": case_nextn, "assistant": case_assistant}


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory) -> Case:
    """Each case built once (its models; its exact distribution on first use)."""
    return CASES[request.param](tmp_path_factory.mktemp)


def test_the_test_has_power(case):
    check_power(case)


@pytest.mark.slow
def test_sampling_is_exact_at_every_position(case, monkeypatch):
    check_exact(case, monkeypatch)


@pytest.mark.slow
def test_a_wrong_rule_at_position_2_is_caught(case, monkeypatch):
    check_planted(case, monkeypatch)
