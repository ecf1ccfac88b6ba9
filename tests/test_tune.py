"""mlxspec tune: measures on a tiny model, stores JSON per (machine, model), read back by load."""

import json

import pytest
from typer.testing import CliRunner

from mlxspec import cli
from mlxspec.api import load
from mlxspec.tuning import measure, storage

KEYS = {"version", "created", "machine", "model", "draft_model", "verify_cost", "draft_cost",
        "acceptance", "depth", "tune_depth"}


@pytest.fixture
def dirs(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.delenv(storage.DATA_ENV, raising=False)
    for name in ("MLXSPEC_DEFAULT_MODEL", "MLXSPEC_DRAFTER", "MLXSPEC_TEMP", "MLXSPEC_MAX_TOKENS"):
        monkeypatch.delenv(name, raising=False)
    return tmp_path


def _no_measuring(*args, **kwargs):
    raise AssertionError("measure_verify_cost ran although a tune result was stored")


def test_tune_with_draft_model_stores_and_is_read_back(dirs, tiny_qwen3, tiny_qwen3_draft, monkeypatch):
    spec = load(str(tiny_qwen3), draft_model=str(tiny_qwen3_draft))
    steps = []
    result = measure.run_tune(spec, max_tokens=24, reps=1, context=32,
                              on_step=lambda message, done, total: steps.append((done, total)))
    path = storage.result_path(spec.target)
    assert str(path) == result["path"] and path.is_file()
    assert str(path).startswith(str(dirs / "data" / "mlxspec" / "tune" / storage.machine_key()))
    stored = json.loads(path.read_text())
    assert KEYS <= stored.keys()
    assert [int(n) for n in stored["verify_cost"]] == list(range(1, 17))
    assert stored["verify_cost"]["1"] == 1.0
    assert set(stored["draft_cost"]) == {"pld", "draft"} and stored["draft_cost"]["pld"] == 0.0
    assert stored["draft_cost"]["draft"] > 0
    for name in ("pld", "draft"):
        assert set(stored["acceptance"][name]) == set(measure.PROMPTS) | {"all"}
        row = stored["acceptance"][name]["all"]
        assert len(row["position_drafted"]) == len(row["position_accepted"]) == measure.TUNE_DEPTH
    # the draft model drafts every step at depth 8: its depth is chosen from data
    assert stored["acceptance"]["draft"]["all"]["position_drafted"][0] > 0
    assert 1 <= stored["depth"]["draft"]["depth"] <= measure.TUNE_DEPTH
    assert steps[-1][0] == steps[-1][1]  # the progress reached its total

    # a fresh load of the same model reads the stored curve and does not measure
    monkeypatch.setattr("mlxspec.engine.costs.measure_verify_cost", _no_measuring)
    again = load(str(tiny_qwen3))
    cost = again.verify_cost()
    assert cost.measured and cost.curve == {int(n): c for n, c in stored["verify_cost"].items()}
    out = again.generate("hello", max_tokens=4, drafter="pld")
    assert out.stats.cost_model == "measured"
    # the tuned draft-step cost replaces the weight-bytes estimate, for the tuned pair only
    from mlxspec.engine.drafters.draft_model import DraftModelDrafter

    costs = []
    original = DraftModelDrafter.propose
    monkeypatch.setattr(DraftModelDrafter, "propose",
                        lambda self, *a: costs.append(self.cost_per_token) or original(self, *a))
    paired = load(str(tiny_qwen3), draft_model=str(tiny_qwen3_draft))
    paired.generate("hello", max_tokens=4, drafter="draft", gates=False)  # draft whatever the costs
    assert costs and costs[0] == stored["draft_cost"]["draft"]
    assert storage.stored_draft_cost(paired.target, "draft", None) is None


def test_tune_mtp_head(dirs, tiny_qwen3_5):
    spec = load(str(tiny_qwen3_5))
    result = measure.run_tune(spec, max_tokens=16, reps=1, context=32)
    assert set(result["draft_cost"]) == {"pld", "mtp"} and result["draft_cost"]["mtp"] > 0
    assert result["acceptance"]["mtp"]["all"]["position_drafted"][0] > 0
    assert 1 <= result["depth"]["mtp"]["depth"] <= measure.TUNE_DEPTH


def test_unreadable_result_is_ignored(dirs, tiny_qwen3):
    spec = load(str(tiny_qwen3))
    path = storage.result_path(spec.target)
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    assert storage.stored_cost(spec.target) is None


def test_depth_choice_uses_the_gate_formula():
    from mlxspec.engine.gates import CostModel

    cost = CostModel(curve={n: 1.0 for n in range(1, 17)}, measured=True)  # free verification
    perfect = measure.depth_speedups([100] * 8, [100] * 8, cost, 0.0)
    assert max(perfect, key=perfect.get) == 8
    never = measure.depth_speedups([100] * 8, [0] * 8, CostModel(slope=0.5), 0.1)
    assert max(never, key=never.get) == 1 and never[1] < 1


def test_tune_json_cli(dirs, tiny_qwen3, monkeypatch):
    """The JSON record and the table, each ending with the conclusion in words."""
    from mlxspec.tuning.choice import conclusion

    real = measure.run_tune
    monkeypatch.setattr(measure, "run_tune", lambda spec, **kw: real(spec, **{**kw, "reps": 1, "context": 32}))
    res = CliRunner().invoke(cli.app, ["tune", str(tiny_qwen3), "--json", "--max-tokens", "12"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert KEYS <= data.keys() and data["depth"].keys() == {"pld"}
    said = data.pop("conclusion")
    assert said == conclusion(data) and "run will use" in said
    res = CliRunner().invoke(cli.app, ["tune", str(tiny_qwen3), "--max-tokens", "12"])
    assert res.exit_code == 0, res.output
    assert "verify cost" in res.stdout and "pld" in res.stdout
    # the curve over the long contexts tune timed, beside the short one
    assert data["verify_cost_context"]["at"] and "over 4K" in res.stdout and "plain token" in res.stdout
    flat = " ".join(res.stdout.split())  # Rich wraps long lines
    assert "conclusion: " in flat and "run will use" in flat.split("conclusion: ", 1)[1]


def test_tune_dflash_drafter(dirs, tiny_qwen3, tmp_path):
    import tiny_dflash

    drafter_dir = tiny_dflash.write_dflash_checkpoint(tmp_path / "Qwen3-Tiny-DFlash-b8", tiny_qwen3, seed=3)
    spec = load(str(tiny_qwen3), draft_model=str(drafter_dir))
    result = measure.run_tune(spec, max_tokens=16, reps=1, context=32)
    assert set(result["draft_cost"]) == {"pld", "dflash"} and result["draft_cost"]["dflash"] > 0
    row = result["acceptance"]["dflash"]["all"]
    # counted on chains (the block is 8: depth 7 at most), one row per position
    assert row["position_drafted"][0] > 0 and row["position_drafted"][measure.TUNE_DEPTH - 1] == 0
    assert row["position_drafted"][0] >= row["position_drafted"][6]
    # a cost tuned with this drafter belongs to it: another drafter does not read it
    assert storage.stored_draft_cost(spec.target, "dflash", spec.draft) == result["draft_cost"]["dflash"]
    assert storage.stored_draft_cost(spec.target, "dflash", None) is None


# -- the conclusion in words ---------------------------------------------------------


def _rated(depth: dict, draft_key=None) -> dict:
    """A tune record's fields that the conclusion reads: DEPTH is name -> (depth, speedup)."""
    return {"draft_model": {"key": draft_key} if draft_key else None,
            "depth": {name: {"depth": k, "speedup": s, "speedups": {}} for name, (k, s) in depth.items()}}


def test_the_conclusion_says_what_run_will_do():
    from mlxspec.tuning.choice import choose, conclusion

    slow = _rated({"pld": (1, 0.88)})
    assert conclusion(slow) == ("speculation does not pay on this machine for this model: best pld 0.88x; "
                                "run will use plain decoding")
    # and run does it: auto runs plain decoding, an explicit drafter is kept
    assert choose(slow, "auto", "pld", ["pld"]).drafter == "none"
    assert choose(slow, "pld", "pld", ["pld"]).drafter == "pld"
    # a drafter this run has but the record did not rate may pay: auto keeps speculating
    assert choose(slow, "auto", "mtp", ["pld", "mtp"]).drafter != "none"
    both_slow = _rated({"pld": (2, 0.71), "mtp": (1, 0.93)})
    assert "best mtp 0.93x; run will use plain decoding" in conclusion(both_slow)
    assert conclusion(_rated({"pld": (4, 1.12), "mtp": (3, 1.6)})) == (
        "run will use mtp at depth 3 (1.60x expected over plain decoding)")
    assert conclusion(_rated({"pld": (7, 2.57), "mtp": (2, 1.21)})) == (
        "run will use pld at depth 7 (2.57x expected over plain decoding)")
    paired = _rated({"pld": (2, 0.9), "draft": (3, 1.6)}, draft_key="k")
    assert conclusion(paired) == ("run will use draft with this --draft-model at depth 3 "
                                  "(1.60x expected over plain decoding)")
    none_drafted = {"depth": {"pld": {"depth": None, "speedup": None, "speedups": {}}}}
    assert conclusion(none_drafted).startswith("no drafter made drafts on the tune prompts; run will use pld")


def test_a_run_follows_a_record_where_speculation_does_not_pay(dirs, tiny_qwen3):
    spec = load(str(tiny_qwen3))
    storage.save_result(spec.target, {
        "version": storage.FORMAT_VERSION, "machine": storage.machine_info(), "model": storage.model_info(spec.target),
        "draft_model": None, "verify_cost": {str(n): 1.0 + 0.5 * (n - 1) for n in range(1, 17)},
        "draft_cost": {"pld": 0.0}, "depth": {"pld": {"depth": 1, "speedup": 0.88, "speedups": {"1": 0.88}}}})
    notes = []
    out = spec.generate("hello", max_tokens=4, on_note=notes.append)  # drafter auto
    assert out.stats.drafter == "none" and out.stats.drafted == 0
    assert len(notes) == 1 and "auto -> none" in notes[0] and "pld 0.88x" in notes[0]
    assert spec.generate("hello", max_tokens=4, drafter="pld").stats.drafter == "pld"  # asked for: kept


