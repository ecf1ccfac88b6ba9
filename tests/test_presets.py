"""Presets: the table, what `auto` picks from model capabilities and the machine, `run --preset`."""

import json

import pytest
from typer.testing import CliRunner

from mlxspec import cli, hardware, presets
from mlxspec.errors import UsageError
from mlxspec.options import DEFAULT_MAX_DEPTH

GiB = 1 << 30
BIG_MAC = hardware.Profile(os="macOS", chip="Apple M4 Pro", memory_bytes=48 * GiB,
                           working_set_bytes=40 * GiB, bandwidth_gbs=273.0)


def test_table():
    assert list(presets.PRESETS) == ["auto", "mtp", "pld", "draft", "assistant", "dflash", "off"]
    for p in presets.PRESETS.values():
        assert p.description and p.drafter in cli.DRAFTERS
        assert p.max_depth is None or p.max_depth == DEFAULT_MAX_DEPTH[p.drafter]
    assert presets.PRESETS["off"].drafter == "none" and not presets.PRESETS["off"].gates
    dflash = presets.PRESETS["dflash"]
    assert dflash.drafter == "dflash" and dflash.gates and "DFlash" in dflash.description
    assert "DFlash" in presets.PRESETS["auto"].description


def test_auto_picks_mtp_for_a_model_with_a_head(tiny_qwen3_5):
    caps = presets.model_caps(str(tiny_qwen3_5))
    assert caps.has_mtp_head and caps.model_bytes > 0
    preset, reasons = presets.choose(BIG_MAC, caps)
    assert preset.name == "mtp" and "MTP head" in reasons[0]
    assert any("273 GB/s" in r for r in reasons)


def test_auto_picks_the_draft_model_when_it_fits(tiny_qwen3, tiny_qwen3_draft):
    caps = presets.model_caps(str(tiny_qwen3), str(tiny_qwen3_draft))
    assert caps.draft_bytes > 0 and not caps.has_mtp_head
    preset, reasons = presets.choose(BIG_MAC, caps)
    assert preset.name == "draft" and "fits" in reasons[0]


def test_auto_falls_back_to_prompt_lookup(tiny_llama):
    preset, reasons = presets.choose(hardware.detect(), presets.model_caps(str(tiny_llama)))
    assert preset.name == "pld" and "no MTP head" in reasons[0]


def test_a_draft_model_too_big_for_the_working_set_is_refused(tiny_qwen3, tiny_qwen3_draft, monkeypatch):
    caps = presets.model_caps(str(tiny_qwen3), str(tiny_qwen3_draft))
    small = hardware.Profile(os="macOS", memory_bytes=caps.model_bytes, working_set_bytes=caps.model_bytes)
    preset, reasons = presets.choose(small, caps)
    assert preset.name == "pld"
    line = reasons[0]
    assert "refused" in line and "working set" in line and ">" in line and "\n" not in line
    with pytest.raises(presets.DoesNotFitError, match="does not fit: target .* \\+ draft .* > 90% of the working set"):
        presets.resolve("draft", small, caps)

    # through the CLI: one-line error with the numbers, nothing loaded
    monkeypatch.setattr(hardware, "detect", lambda fast=False: small)
    result = CliRunner().invoke(cli.app, ["run", str(tiny_qwen3), "hi", "--preset", "draft",
                                          "--draft-model", str(tiny_qwen3_draft)])
    assert result.exit_code == 1
    assert result.stderr.startswith("error: draft model") and result.stderr.count("\n") == 1
    assert "KB" in result.stderr and "working set" in result.stderr


def test_resolve_errors():
    with pytest.raises(UsageError, match="unknown preset"):
        presets.resolve("fast")
    with pytest.raises(UsageError, match="--draft-model"):
        presets.resolve("draft", BIG_MAC, presets.ModelCaps())


def test_profile_model_shows_the_auto_choice(tiny_qwen3_5):
    result = CliRunner().invoke(cli.app, ["profile", "--json", str(tiny_qwen3_5)])
    assert result.exit_code == 0, result.output
    auto = json.loads(result.stdout)["auto"]
    assert auto["preset"] == "mtp" and auto["has_mtp_head"] and auto["reasons"]
    text = CliRunner().invoke(cli.app, ["profile", str(tiny_qwen3_5)]).stdout
    assert [line for line in text.splitlines() if line.startswith("auto ")][0].count("mtp")


class FakeSpec:
    name, is_demo = "fake", False

    class tokenizer:  # what starts_in_reasoning reads of the prompt
        all_special_ids = []

        @staticmethod
        def decode(ids):
            return ""

    def __init__(self):
        self.calls = []

    def encode(self, prompt, **options):
        return [1, 2, 3]

    def stream(self, prompt, request, **options):
        from mlxspec.api import Chunk
        from mlxspec.engine.stats import Stats

        self.calls.append({k: v for k, v in vars(request).items() if v is not None} | options)  # the fields set
        yield Chunk(text="ok", tokens=[1], stats=Stats(drafter="pld", depth=4))


@pytest.fixture
def fake_load(monkeypatch, tmp_path):
    monkeypatch.setenv("MLXSPEC_CONFIG_DIR", str(tmp_path))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    for name in ("MLXSPEC_DRAFTER", "MLXSPEC_DEFAULT_MODEL"):
        monkeypatch.delenv(name, raising=False)
    loaded = []

    def load(model_ref, draft_model=None):
        loaded.append((model_ref, draft_model, FakeSpec()))
        return loaded[-1][2]

    monkeypatch.setattr("mlxspec.api.load", load)
    return loaded


def test_run_preset_pld_passes_the_drafter_through(fake_load, tiny_llama):
    result = CliRunner().invoke(cli.app, ["run", str(tiny_llama), "hi", "--preset", "pld", "--no-stats"])
    assert result.exit_code == 0, result.output
    options = fake_load[-1][2].calls[0]
    assert options["drafter"] == "pld" and options["max_depth"] == 8 and options["gates"] is True


def test_explicit_drafter_wins_over_the_preset(fake_load, tiny_llama):
    result = CliRunner().invoke(cli.app, ["run", str(tiny_llama), "hi", "--preset", "mtp", "--drafter", "none",
                                          "--no-stats"])
    assert result.exit_code == 0, result.output
    options = fake_load[-1][2].calls[0]
    assert options["drafter"] == "none" and "max_depth" not in options
    assert "overrides preset mtp" in result.stderr


def test_run_preset_auto_drops_a_refused_draft_model(fake_load, tiny_qwen3, tiny_qwen3_draft, monkeypatch):
    caps = presets.model_caps(str(tiny_qwen3), str(tiny_qwen3_draft))
    small = hardware.Profile(os="Linux", memory_bytes=caps.model_bytes)
    monkeypatch.setattr(hardware, "detect", lambda fast=False: small)
    result = CliRunner().invoke(cli.app, ["run", str(tiny_qwen3), "hi", "--preset", "auto", "--no-stats",
                                          "--draft-model", str(tiny_qwen3_draft)])
    assert result.exit_code == 0, result.output
    model_ref, draft_ref, spec = fake_load[-1]
    # the engine's auto, without the refused draft model, picks prompt lookup as the preset did
    assert draft_ref is None and spec.calls[0]["drafter"] == "auto" and "max_depth" not in spec.calls[0]
    assert "refused" in result.stderr and "RAM" in result.stderr and "preset auto -> pld" in result.stderr


def test_run_warns_before_loading_a_model_larger_than_memory(fake_load, tiny_llama, monkeypatch):
    monkeypatch.setattr(hardware, "detect", lambda fast=False: hardware.Profile(os="Linux", memory_bytes=1000))
    result = CliRunner().invoke(cli.app, ["run", str(tiny_llama), "hi", "--no-stats"])
    assert result.exit_code == 0, result.output
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "RAM" in warnings[0]
