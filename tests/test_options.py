"""mlxspec.options: the one check of generation options, and the preset planning every
command shares (mlxspec.presets.plan_run)."""

import pytest

from mlxspec import options, presets
from mlxspec.errors import MlxspecError, UsageError


def test_check_values_names_the_first_bad_value_as_the_caller_calls_it():
    options.check_values({"temperature": 0.0, "top_p": 1.0, "depth": None, "max_tokens": 1})
    with pytest.raises(UsageError, match=r"^--top-p must be between 0 and 1, got 1\.5$"):
        options.check_values({"temperature": 0.5, "top_p": 1.5, "top_k": -1}, {"top_p": "--top-p"})
    with pytest.raises(UsageError, match=f"^depth must be between 1 and {options.MAX_DEPTH}, got 17$"):
        options.check_values({"depth": 17})
    with pytest.raises(MlxspecError, match="must be one of auto, pld") as info:
        options.check_values({"drafter": "magic"}, error=MlxspecError)
    assert type(info.value) is MlxspecError


def test_check_choice():
    options.check_choice("drafter", "pld", options.DRAFTERS)
    expected = "^unknown drafter 'x'; choose one of auto, pld, draft, mtp, assistant, dflash, none$"
    with pytest.raises(UsageError, match=expected):
        options.check_choice("drafter", "x", options.DRAFTERS)


def test_presets_use_the_drafters_default_depth_caps():
    for name in ("mtp", "pld", "draft"):
        assert presets.PRESETS[name].max_depth == options.DEFAULT_MAX_DEPTH[name]


def test_plan_run_decides_and_leaves_printing_to_the_caller(tmp_path):
    missing = str(tmp_path / "no-such-model")  # unknown: no caps, no memory note
    plan = presets.plan_run("pld", missing, "auto", None)
    assert (plan.drafter, plan.draft_model, plan.notes) == ("pld", None, [])
    assert plan.stream_options == {"gates": True, "max_depth": options.DEFAULT_MAX_DEPTH["pld"]}
    plan = presets.plan_run("mtp", missing, "none", None, drafter_given=True)
    assert plan.drafter == "none" and plan.stream_options == {"gates": True}
    assert plan.notes == ["note: --drafter none overrides preset mtp's drafter mtp"]
    plan = presets.plan_run(None, missing, "pld", "d")
    assert (plan.drafter, plan.draft_model, plan.stream_options, plan.notes) == ("pld", "d", {}, [])
