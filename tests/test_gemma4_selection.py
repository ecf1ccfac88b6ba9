"""Choosing and loading the Gemma-4 assistant: recognised by its config as --draft-model, found
beside its target, picked by ``auto`` and the presets, converted and quantized by `mlxspec
convert`, refused for a target it does not fit."""

from pathlib import Path

import numpy as np
import pytest

import mlxspec
import tiny_gemma4
from mlxspec import hardware, presets
from mlxspec.engine.drafters.assistant import AssistantDrafter
from mlxspec.engine.speculate import SpeculativeDecoder
from mlxspec.errors import DrafterError, UsageError
from mlxspec.models.convert import convert_checkpoint
from mlxspec.models.gemma4_assistant import Gemma4Assistant
from mlxspec.models.loader import load_model

GiB = 1 << 30
BIG_MAC = hardware.Profile(os="macOS", chip="Apple M4 Pro", memory_bytes=48 * GiB,
                           working_set_bytes=40 * GiB, bandwidth_gbs=273.0)
PROMPT = [5, 3, 6, 5, 3, 6, 5, 3, 4, 7, 5, 3]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """gemma-tiny and, beside it, gemma-tiny-assistant (a copying one: it gets accepts)."""
    folder = tmp_path_factory.mktemp("pair")
    target = tiny_gemma4.write_target(folder / "gemma-tiny", vocab_size=16, seed=41)
    assistant = tiny_gemma4.write_assistant(folder / "gemma-tiny-assistant", target, seed=42, copying=True)
    return target, assistant


def _ids(spec, **options):
    return spec.generate(PROMPT, max_tokens=30, seed=0, **options)


def test_draft_model_is_recognised_by_its_config(pair):
    target, assistant = pair
    spec = mlxspec.load(str(target), draft_model=str(assistant))
    assert isinstance(spec.draft.model, Gemma4Assistant)
    plain = _ids(spec, drafter="none")
    first = _ids(spec)  # auto: the assistant
    assert first.stats.drafter == "assistant" and first.stats.accepted > 0
    assert first.tokens == plain.tokens
    again = _ids(spec)  # the prompt's prefix now comes from the prefix cache, with the drafter's row
    assert again.tokens == plain.tokens and again.stats.cached_tokens > 0 and again.stats.accepted > 0
    with pytest.raises(UsageError, match="--drafter assistant"):
        _ids(spec, drafter="draft")


def test_an_assistant_for_another_target_is_refused(pair, tiny_qwen3):
    _, assistant = pair
    with pytest.raises(DrafterError, match="Gemma-4") as err:
        mlxspec.load(str(tiny_qwen3), draft_model=str(assistant))
    assert "\n" not in str(err.value)


def test_auto_picks_the_assistant_given_or_found_beside(pair, tiny_llama):
    target, assistant = pair
    given = presets.model_caps(str(target), str(assistant))
    assert given.draft_is_assistant and not given.draft_found
    preset, reasons = presets.choose(BIG_MAC, given)
    assert preset.name == "assistant" and "Gemma-4 assistant" in reasons[0] and "given" in reasons[0]

    found = presets.model_caps(str(target))
    assert found.draft_found == str(Path(assistant).resolve()) and found.draft_is_assistant
    preset, reasons = presets.choose(BIG_MAC, found)
    assert preset.name == "assistant" and "found beside the target" in reasons[0]
    assert presets.model_caps(str(target), look_for_assistant=False).draft_name is None
    assert presets.model_caps(str(tiny_llama)).draft_name is None  # only Gemma-4 targets look

    plan = presets.plan_run("auto", str(target), "auto", None)
    assert plan.draft_model == str(Path(assistant).resolve()) and plan.drafter == "auto"
    assert "preset auto -> assistant" in plan.notes[-1]
    plan = presets.plan_run(None, str(target), "auto", None)  # no preset: the engine's auto
    assert plan.draft_model == str(Path(assistant).resolve())
    assert any("found beside the target" in n for n in plan.notes)
    plan = presets.plan_run("assistant", str(target), "auto", None)
    assert plan.drafter == "assistant" and plan.stream_options["max_depth"] == 6
    assert presets.plan_run(None, str(target), "pld", None).draft_model is None


def test_preset_assistant_needs_one(pair, tiny_llama):
    target, assistant = pair
    with pytest.raises(UsageError, match="needs a Gemma-4 assistant"):
        presets.resolve("assistant", BIG_MAC, presets.model_caps(str(tiny_llama)))
    with pytest.raises(UsageError, match="--preset assistant"):
        presets.resolve("draft", BIG_MAC, presets.model_caps(str(target), str(assistant)))


def test_convert_quantizes_an_assistant(pair, tmp_path):
    target, assistant = pair
    out = tmp_path / "assistant-4bit"
    result = convert_checkpoint(str(assistant), out, q_bits=4, q_group_size=32)
    assert result.q_bits == 4 and (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
    quantized = load_model(str(out)).model
    assert type(quantized.pre_projection).__name__ == "QuantizedLinear"
    assert type(quantized.model.embed_tokens).__name__ == "QuantizedEmbedding"
    target_model = load_model(str(target)).model
    full = load_model(str(assistant)).model

    def first_logits(model):
        from mlxspec.engine.cache import ModelState

        drafter = AssistantDrafter(model, target_model)
        state = ModelState(target_model, keep_hidden=True)
        drafter.bind_target(state)
        drafter.start(PROMPT)
        drafter.prefill(PROMPT, len(PROMPT) - 1, state.prefill(PROMPT[:-1]))
        import mlx.core as mx

        return np.array(drafter.stepper(len(PROMPT) - 1)(0, mx.array(PROMPT[-1:], mx.uint32)))

    a, b = first_logits(full), first_logits(quantized)
    assert np.corrcoef(a.ravel(), b.ravel())[0, 1] > 0.9  # the same model, 4-bit
    plain = [t for toks, _ in SpeculativeDecoder(target_model, drafter="none").generate(PROMPT, max_tokens=30)
             for t in toks]
    dec = SpeculativeDecoder(target_model, draft_model=quantized, depth=3, gates=False)
    assert [t for toks, _ in dec.generate(PROMPT, max_tokens=30) for t in toks] == plain
    with pytest.raises(mlxspec.errors.InvalidCheckpointError, match="already quantized"):
        convert_checkpoint(str(out), tmp_path / "again", q_bits=4, q_group_size=32)


def test_random_assistant_for_timing_real_shapes(pair):
    """bench's hook: a random-weight assistant of a given config.json, fitted to a target."""
    import json

    from mlxspec.bench.synthetic import random_assistant

    target, assistant = pair
    config = json.loads((Path(assistant) / "config.json").read_text())
    config.update(use_ordered_embeddings=True, num_centroids=4, centroid_intermediate_top_k=2,
                  backbone_hidden_size=1)  # fitted to the target
    model = load_model(str(target)).model
    timed = random_assistant(model, config, bits=4, group_size=32)
    assert timed.backbone_hidden_size == 64 and type(timed.pre_projection).__name__ == "QuantizedLinear"
    assert sorted(np.array(timed.masked_embedding.token_ordering).tolist()) == list(range(16))
    plain = [t for toks, _ in SpeculativeDecoder(model, drafter="none").generate(PROMPT, max_tokens=20)
             for t in toks]
    dec = SpeculativeDecoder(model, draft_model=timed, depth=2, gates=False)
    out, stats = [], None
    for toks, stats in dec.generate(PROMPT, max_tokens=20):
        out.extend(toks)
    assert out == plain and stats.drafted > 0


def test_run_drafts_with_the_assistant_found_beside(pair, monkeypatch, tmp_path):
    from typer.testing import CliRunner

    from mlxspec import cli

    monkeypatch.setenv("MLXSPEC_CONFIG_DIR", str(tmp_path))
    for name in ("MLXSPEC_DRAFTER", "MLXSPEC_DEFAULT_MODEL", "MLXSPEC_PRESET"):
        monkeypatch.delenv(name, raising=False)
    target, _ = pair
    result = CliRunner().invoke(cli.app, ["run", str(target), "fdcfdc", "--raw", "-n", "20", "--temp", "0",
                                          "--seed", "0"])
    assert result.exit_code == 0, result.output
    assert "found beside the target" in result.stderr and "assistant depth" in result.stderr
