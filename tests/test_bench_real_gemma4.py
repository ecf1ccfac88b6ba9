"""bench --real-shapes with Gemma-4 shapes: the configs of the real checkpoints (sizes as
published, target and assistant fitting each other), and the assistant engine on the CPU's tiny
shape, identical to the script at temperature 0 with forced depths and with its own choice."""

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models import gemma4_text

from mlxspec.bench.gemma4_shapes import GEMMA4, assistant_config
from mlxspec.bench.real_shapes import (
    BASELINE,
    STOCK_DRAFT,
    WITH_KERNELS,
    Cell,
    ShapeBench,
    parse_shapes,
    plan,
    run_real_shapes,
)
from mlxspec.bench.synthetic import SHAPES, random_assistant, random_model, shape_config
from mlxspec.models.gemma4_assistant import Gemma4Assistant, check_pair, shared_layers


def _count(module) -> int:
    # the arrays are never evaluated: a 31B model of lazy initializers costs nothing
    return sum(v.size for _, v in tree_flatten(module.parameters()))


@pytest.mark.parametrize("shape, target_b, assistant_m", [("gemma-4-31b", 30.7, 470), ("gemma-4-26b-a4b", 25.2, 420)])
def test_real_configs_have_the_published_sizes_and_fit_their_assistants(shape, target_b, assistant_m):
    config = shape_config(shape)
    model = gemma4_text.Model(gemma4_text.ModelArgs.from_dict(config))
    assistant = Gemma4Assistant(assistant_config(shape))
    assert abs(_count(model) / 1e9 - target_b) < 0.05
    assert abs(_count(assistant) / 1e6 - assistant_m) < 3
    check_pair(model, assistant)  # widths, vocabulary, head dims of the shared layers
    layers = shared_layers(model)  # the assistant reads the last sliding and the last full layer
    assert layers == {"sliding_attention": config["num_hidden_layers"] - 2,
                      "full_attention": config["num_hidden_layers"] - 1}
    assert assistant.backbone_hidden_size == config["hidden_size"] and assistant.masked_embedding is None
    assert config["enable_moe_block"] == (shape == "gemma-4-26b-a4b")


def test_gemma_shapes_are_listed_and_plan_their_assistant():
    assert set(GEMMA4) <= set(SHAPES)
    assert parse_shapes("gemma-4-31b,gemma-4-26b-a4b") == ["gemma-4-31b", "gemma-4-26b-a4b"]
    cells = plan(["echo", "scripted-a0.8", "scripted-a1.0"], False, (2, 8), 0.7, assistant=True)
    engines = {c.engine for c in cells}
    assert {"mlxspec-assistant", "mlxspec-pld", BASELINE} <= engines
    assert not engines & {"mlxspec-mtp", "mlxspec-draft", STOCK_DRAFT}
    assert Cell("scripted-a0.8", "mlxspec-assistant", 8) in cells  # every depth, not only <= 4
    assert Cell("scripted-a0.8", "mlxspec-assistant", None, 0.7) in cells
    qwen = plan(["scripted-a0.8"], True, (2, 8), None)  # the Qwen plan is unchanged
    assert [c.engine for c in qwen if c.depth is None] == [BASELINE, WITH_KERNELS, "mlxspec-mtp", "mlxspec-draft",
                                                           STOCK_DRAFT]


def test_random_smoke_pair_is_quantized_in_the_real_layout():
    model = random_model("smoke-gemma4-moe", bits=4)
    assistant = random_assistant(model, assistant_config("smoke-gemma4-moe"), bits=4)
    layer = model.layers[0]
    assert layer.enable_moe and layer.router.proj.bits == 8  # routers at 8 bits, as mlx-lm converts
    assert layer.self_attn.q_proj.bits == 4 and assistant.pre_projection.bits == 4
    assert not hasattr(model.layers[5].self_attn, "v_proj")  # the full layer's K = V
    logits = model(mx.array([list(range(40))]))
    assert logits.shape == (1, 40, 1024) and bool(mx.all(mx.isfinite(logits)))


def test_assistant_engine_on_smoke_gemma4_is_identical_to_the_script():
    # prompt (48) longer than the sliding window (16): the assistant reads a wrapped ring
    result = run_real_shapes(["smoke-gemma4"], bits=0, prompt_tokens=48, max_tokens=16, reps=1,
                             depths=(1, 3), workloads=("echo", "scripted-a0.8", "scripted-a1.0"),
                             temperature=None)
    cells = result["cells"]
    assert all(c["identical"] for c in cells), [c for c in cells if not c["identical"]]
    assert {c["engine"] for c in cells} == {BASELINE, WITH_KERNELS, "mlxspec-none", "mlxspec-pld", "mlxspec-assistant"}
    mine = {(c["workload"], c["depth"]): c for c in cells if c["engine"] == "mlxspec-assistant"}
    assert set(mine) == {("echo", "auto"), ("scripted-a0.8", "auto"), ("scripted-a0.8", 1),
                         ("scripted-a0.8", 3), ("scripted-a1.0", "auto"), ("scripted-a1.0", 1),
                         ("scripted-a1.0", 3)}
    forced = mine[("scripted-a1.0", 3)]  # every draft accepted: 4 tokens a verify
    assert forced["acceptance"] == 1.0 and forced["tokens_per_step"] > 2.5 and forced["ideal"] > 0
    partial = mine[("scripted-a0.8", 3)]  # partial accepts: the assistant drafts after rollbacks
    assert 0.5 < partial["acceptance"] < 1.0 and partial["mean_depth"] == 3
    assert mine[("scripted-a1.0", "auto")]["acceptance"] == 1.0
    shape = result["shapes"][0]
    assert shape["draft_step_ms"]["mlxspec-assistant"] > 0 and "mlxspec-mtp" not in shape["draft_step_ms"]


def test_steered_assistant_pays_its_real_step():
    bench = ShapeBench("smoke-gemma4", bits=0, prompt_tokens=24, max_tokens=8, workloads=["scripted-a1.0"],
                       reps=1, widest=3, stock=False)
    assert bench.head is None and bench.draft is None and bench.assistant is not None
    run = bench.run(Cell("scripted-a1.0", "mlxspec-assistant", 2))
    assert run.tokens == bench.scripts["scripted-a1.0"].continuation[:8]
    assert run.stats["drafted"] > 0 and run.stats["accepted"] == run.stats["drafted"]


def test_cli_real_shapes_runs_the_assistant(tmp_path):
    import json

    from typer.testing import CliRunner

    from mlxspec import cli

    out = tmp_path / "rs.json"
    res = CliRunner().invoke(cli.app, ["bench", "--real-shapes", "smoke-gemma4", "--bits", "0", "--reps", "1",
                                       "--max-tokens", "8", "--prompt-tokens", "24", "--workloads", "scripted-a0.8",
                                       "--depths", "2", "--no-temp-pass", "--json", str(out)])
    assert res.exit_code == 0, res.output
    cells = json.loads(out.read_text())["cells"]
    assert [(c["engine"], c["depth"]) for c in cells] == [(BASELINE, "auto"), (WITH_KERNELS, "auto"),
                                                          ("mlxspec-assistant", "auto"), ("mlxspec-assistant", 2)]
    assert all(c["identical"] for c in cells)
