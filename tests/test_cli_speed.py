"""The speed machinery as a run meets it: the verify-cost curve measured once per machine and
model and stored, the step labelled; `mlxspec tune`'s depths and drafter ratings followed (or
a note saying why not); a gated-off run said so in the stats line."""

import json

import pytest
from typer.testing import CliRunner

from mlxspec import cli, ui
from mlxspec.api import load
from mlxspec.engine.stats import GateEvent, Stats
from mlxspec.tuning import storage


@pytest.fixture
def tune_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(storage.DATA_ENV, str(tmp_path / "tune"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    for name in ("MLXSPEC_DEFAULT_MODEL", "MLXSPEC_DRAFTER", "MLXSPEC_PRESET", "MLXSPEC_TEMP"):
        monkeypatch.delenv(name, raising=False)
    return tmp_path / "tune"


def _no_measuring(*args, **kwargs):
    raise AssertionError("measure_verify_cost ran although a curve was stored")


def test_the_first_run_stores_the_cost_curve_and_labels_the_step(tune_dir, tiny_qwen3, monkeypatch):
    spec = load(str(tiny_qwen3))
    labels = []
    out = spec.generate("hello", max_tokens=4, drafter="pld", on_status=labels.append)
    assert out.stats.cost_model == "measured"
    assert "measuring" in labels[0] and all(label.startswith(labels[0]) for label in labels)
    assert labels[-1].endswith(": 100%")  # its progress follows
    stored = json.loads(storage.result_path(spec.target).read_text())
    assert stored["verify_cost"]["1"] == 1.0 and stored["model"]["key"] == storage.model_info(spec.target)["key"]
    # the next load on this machine reads it: nothing measured, nothing to label
    monkeypatch.setattr("mlxspec.engine.costs.measure_verify_cost", _no_measuring)
    labels.clear()
    again = load(str(tiny_qwen3)).generate("hello", max_tokens=4, drafter="pld", on_status=labels.append)
    assert again.stats.cost_model == "measured" and labels == []


def _record(spec, depth: dict) -> None:
    """A stored tune record for SPEC with a flat cost curve and DEPTH's choices."""
    storage.save_result(spec.target, {
        "version": storage.FORMAT_VERSION, "machine": storage.machine_info(), "model": storage.model_info(spec.target),
        "draft_model": None, "verify_cost": {str(n): 1.0 + 0.05 * (n - 1) for n in range(1, 17)},
        "draft_cost": {name: 0.0 if name == "pld" else 0.1 for name in depth},
        "depth": {name: {"depth": k, "speedup": s, "speedups": {}} for name, (k, s) in depth.items()}})


def test_a_run_uses_the_tuned_depth(tune_dir, tiny_qwen3):
    spec = load(str(tiny_qwen3))
    _record(spec, {"pld": (5, 1.4)})
    assert spec.generate("hello", max_tokens=4, drafter="pld").stats.depth == 5
    assert spec.generate("hello", max_tokens=4, drafter="pld", depth=3).stats.depth == 3  # asked for


def test_auto_follows_the_tune_ratings(tune_dir, tiny_qwen3_5):
    spec = load(str(tiny_qwen3_5))  # it has an MTP head: auto alone would pick mtp
    _record(spec, {"pld": (7, 2.57), "mtp": (2, 1.21)})
    notes = []
    out = spec.generate("hello", max_tokens=4, on_note=notes.append)
    assert (out.stats.drafter, out.stats.depth) == ("pld", 7)
    assert len(notes) == 1 and "2.57x" in notes[0] and "mtp" in notes[0]
    notes.clear()
    out = spec.generate("hello", max_tokens=4, drafter="mtp", on_note=notes.append)  # asked for: kept, said
    assert (out.stats.drafter, out.stats.depth) == ("mtp", 2)
    assert len(notes) == 1 and "pld" in notes[0] and "2.57x" in notes[0]


def test_run_prints_the_tuned_choice_once(tune_dir, tiny_qwen3_5):
    _record(load(str(tiny_qwen3_5)), {"pld": (7, 2.57), "mtp": (2, 1.21)})
    result = CliRunner().invoke(cli.app, ["run", str(tiny_qwen3_5), "hi", "--max-tokens", "3", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["stats"]["drafter"] == "pld"
    assert len([line for line in result.stderr.splitlines() if "2.57x" in line]) == 1


def test_the_preset_auto_follows_the_tune_ratings_too(tune_dir, tiny_qwen3_5):
    _record(load(str(tiny_qwen3_5)), {"pld": (7, 2.57), "mtp": (2, 1.21)})
    result = CliRunner().invoke(cli.app, ["run", str(tiny_qwen3_5), "hi", "--max-tokens", "3", "--json",
                                          "--preset", "auto"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["stats"]["drafter"] == "pld"


def test_a_gated_off_run_says_speculation_off_and_why():
    off = Stats(drafter="pld", depth=8, generated_tokens=8, prompt_tokens=11,
                gate_events=[GateEvent(0, False, "prompt repetition score 0.00 < 0.10")])
    line = ui.stats_line(off)
    assert "speculation off (prompt repetition score 0.00 < 0.10)" in line
    assert "accepted 0/0" not in line and "depth 8" not in line
    from rich.console import Console

    console = Console(record=True, width=120)
    console.print(ui.stats_table(off))
    table = console.export_text()
    assert "off (prompt repetition score 0.00 < 0.10)" in table and "accepted" not in table
    unsupported = Stats(drafter="none", generated_tokens=3, gate_events=[GateEvent(0, False, "cannot roll back")])
    assert "speculation off (cannot roll back)" in ui.stats_line(unsupported)
    on = Stats(drafter="pld", depth=8, generated_tokens=8, drafted=10, accepted=4, verify_steps=3)
    assert "pld depth 8" in ui.stats_line(on) and "accepted 4/10" in ui.stats_line(on)


def test_the_status_line_names_a_step_before_the_first_token():
    assert "measuring" in ui.status_text(None, status="measuring this machine's verify cost").plain
    assert ui.status_text(None).plain.startswith("prefilling")


@pytest.mark.parametrize("drafter", ["draft", "mtp"])
def test_a_model_drafters_step_is_timed_once_and_priced_by_the_gate(tune_dir, tiny_qwen3, tiny_qwen3_draft,
                                                                     tiny_qwen3_5, monkeypatch, drafter):
    """The gates price a draft step by its measured cost, not by the weight-bytes guess (which
    kept a draft model that ran at 0.58x plain): timed on the first run, stored, reused."""
    import mlxspec.engine.speculate as speculate
    import mlxspec.tuning.measure as measure

    def open_spec():
        if drafter == "draft":
            return load(str(tiny_qwen3), draft_model=str(tiny_qwen3_draft))
        return load(str(tiny_qwen3_5))

    seen, timed = [], []
    decoder = speculate.SpeculativeDecoder.__init__

    def spy(self, *args, **kwargs):
        decoder(self, *args, **kwargs)
        seen.append(self.drafter.cost_per_token)

    monkeypatch.setattr(speculate.SpeculativeDecoder, "__init__", spy)
    real = measure.draft_step_cost
    monkeypatch.setattr(measure, "draft_step_cost", lambda *a, **kw: timed.append(1) or 0.5 + 0 * real(*a, **kw))
    labels = []
    spec = open_spec()
    spec.generate("hello", max_tokens=3, drafter=drafter, on_status=labels.append)
    spec.generate("hello again", max_tokens=3, drafter=drafter)  # the same load: timed once
    assert timed == [1] and seen == [0.5, 0.5]
    assert any("timing the" in label for label in labels)
    stored = json.loads(storage.result_path(spec.target).read_text())
    assert stored["draft_cost"][drafter] == 0.5
    # a later load on this machine reads the stored cost: nothing timed
    open_spec().generate("hello", max_tokens=3, drafter=drafter)
    assert timed == [1] and seen[-1] == 0.5
