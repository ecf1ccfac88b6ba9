"""mlxspec bench --chat on tiny random shapes (CPU): the conversation plan, what the prefix
cache restores on each turn, identity with and without reuse, the JSON and its redraw, and
one-line errors for bad flags."""

import json

import pytest
from typer.testing import CliRunner

from mlxspec import cli
from mlxspec.bench.chat import LOW_ID, check_plan, default_user_tokens, first_block, run_chat, summarize, user_blocks
from mlxspec.bench.synthetic import random_model, vocab_size
from mlxspec.errors import UsageError

TURNS, CONTEXT, USER, ANSWER, REPS = 3, 240, 32, 8, 2


@pytest.fixture(scope="module", params=["smoke", "smoke-hybrid"])
def chat(request):
    shape = request.param
    model = random_model(shape, bits=0)  # bf16: CPU 4-bit matmuls are slow
    steps = []
    result = run_chat(model, turns=TURNS, context=CONTEXT, user_tokens=USER, answer_tokens=ANSWER,
                      reps=REPS, vocab=vocab_size(shape), label=shape,
                      on_step=lambda *a: steps.append(a))
    return shape, result, steps


def test_prompts_grow_by_answer_and_user_block_to_the_context(chat):
    _, result, _ = chat
    first = CONTEXT - (TURNS - 1) * (USER + ANSWER)
    assert [t["prompt_tokens"] for t in result["turns"]] == [first + k * (USER + ANSWER) for k in range(TURNS)]
    assert result["turns"][-1]["prompt_tokens"] == CONTEXT
    assert len(result["runs"]) == REPS * TURNS
    assert all(len(r["answer"]) == ANSWER for r in result["runs"])


def test_each_turn_restores_everything_but_the_last_answer_token(chat):
    """The reuse run stores the target's cache after its answer: the previous prompt and all
    answer tokens but the last (which was never fed). The next prompt starts with all of it."""
    _, result, _ = chat
    for r in result["runs"]:
        if r["turn"] == 1:
            assert r["cached_tokens"] == 0
        else:
            before = r["prompt_tokens"] - USER  # the previous prompt + its answer
            assert r["cached_tokens"] == before - 1, r
        assert r["no_reuse_cached_tokens"] == 0
    assert [t["cached_tokens"] for t in result["turns"]] == [0] + [t["prompt_tokens"] - USER - 1
                                                                   for t in result["turns"][1:]]


def test_reuse_gives_the_same_tokens_and_times_are_positive(chat):
    shape, result, steps = chat
    for r in result["runs"]:
        assert r["identical"] is True, (shape, r["turn"], r["rep"])
        assert all(v > 0 for v in r["ttft_ms"].values())
    for t in result["turns"]:
        assert t["identical"] and t["same_answers"]  # temperature 0 on the CPU: every rep alike
        ms = t["ttft_ms"]
        assert t["ratio"] == pytest.approx(ms["no_reuse"] / ms["reuse"], rel=1e-2)
    assert steps[0][0] == f"{shape}: warm-up" and steps[-1] == (f"{shape}: done", REPS * TURNS, REPS * TURNS)


def test_summary_medians_and_a_difference_is_reported():
    def run(rep, turn, ms, identical=True, answer=(1, 2)):
        return {"rep": rep, "turn": turn, "prompt_tokens": 10 * turn, "cached_tokens": 5 * (turn - 1),
                "ttft_ms": {"no_reuse": ms, "reuse": ms / 4, "mlx_lm": ms * 1.1}, "identical": identical,
                "identical_mlx_lm": True, "answer": list(answer)}

    runs = [run(0, 1, 10.0), run(1, 1, 30.0), run(2, 1, 20.0),
            run(0, 2, 8.0), run(1, 2, 8.0, identical=False, answer=(1, 3)), run(2, 2, 8.0)]
    first, second = summarize(runs)
    assert first["ttft_ms"] == {"no_reuse": 20.0, "reuse": 5.0, "mlx_lm": 22.0} and first["ratio"] == 4.0
    assert first["identical"] and first["same_answers"]
    assert second["cached_tokens"] == 5 and not second["identical"] and not second["same_answers"]


def test_plan_blocks_and_defaults():
    assert first_block(5, 4096, 256, 64) == 4096 - 4 * 320
    blocks = user_blocks(3, 300, 40, 8, vocab=1024)
    assert [len(b) for b in blocks] == [204, 40, 40] and blocks == user_blocks(3, 300, 40, 8, vocab=1024)
    assert all(LOW_ID <= t < 1024 for b in blocks for t in b)
    assert default_user_tokens(5, 4096, 64) == 256
    small = default_user_tokens(5, 1024, 64)
    assert small < 256 and first_block(5, 1024, small, 64) >= 1024 // 2
    with pytest.raises(UsageError, match="too small for 5 turns"):
        check_plan(5, 1000, 256, 64)
    with pytest.raises(UsageError, match="at least 2"):
        check_plan(1, 1000, 256, 64)


# -- the CLI --------------------------------------------------------------------------------

def test_cli_prints_the_table_writes_json_and_redraws_it(tmp_path):
    out = tmp_path / "chat.json"
    args = ["bench", "--chat", "--chat-shapes", "smoke", "--bits", "0", "--chat-context", "200",
            "--chat-turns", "3", "--max-tokens", "8", "--reps", "1", "--json", str(out)]
    result = CliRunner().invoke(cli.app, args)
    assert result.exit_code == 0, result.output
    assert "time to first token per chat turn" in result.stdout and "speedup" in result.stdout
    doc = json.loads(out.read_text())
    assert doc["schema"] == "mlxspec-bench/1" and doc["kind"] == "chat"
    assert {"mlx", "mlx_lm", "mlxspec", "device", "command", "argv"} <= doc["environment"].keys()
    config, (model,) = doc["chat"]["config"], doc["chat"]["models"]
    assert config["turns"] == 3 and config["context"] == 200 and config["answer_tokens"] == 8
    assert config["first_user_tokens"] + 2 * (config["user_tokens"] + 8) == 200
    assert model["name"] == "smoke" and model["random_weights"] and model["bits"] == 0
    assert [r["turn"] for r in model["runs"]] == [1, 2, 3] and len(model["turns"]) == 3
    assert model["turns"][2]["prompt_tokens"] == 200 and model["turns"][2]["identical"]
    redraw = CliRunner().invoke(cli.app, ["bench", "--from-json", str(out)])
    assert redraw.exit_code == 0 and redraw.stdout == result.stdout
    pytest.importorskip("matplotlib")
    png = tmp_path / "chat.png"
    drawn = CliRunner().invoke(cli.app, ["bench", "--from-json", str(out), "--png", str(png)])
    assert drawn.exit_code == 0 and png.stat().st_size > 1000


def test_cli_on_a_loaded_model(tiny_qwen3, tmp_path):
    out = tmp_path / "chat.json"
    result = CliRunner().invoke(cli.app, ["bench", "--chat", str(tiny_qwen3), "--chat-context", "120",
                                          "--chat-turns", "2", "--max-tokens", "4", "--reps", "1",
                                          "--drafter", "none", "--json", str(out)])
    assert result.exit_code == 0, result.output
    (model,) = json.loads(out.read_text())["chat"]["models"]
    assert model["model_type"] == "qwen3" and not model["random_weights"]
    assert model["turns"][1]["cached_tokens"] == model["turns"][0]["prompt_tokens"] + 4 - 1
    too_long = CliRunner().invoke(cli.app, ["bench", "--chat", str(tiny_qwen3), "--chat-context", "4095"])
    assert too_long.exit_code == 2 and "exceed" in too_long.stderr


@pytest.mark.parametrize("args,fragment", [
    (["--chat", "--chat-shapes", "smoke", "--chat-context", "100", "--chat-user-tokens", "50"],
     "--chat-context 100 is too small for 5 turns"),
    (["--chat", "--chat-shapes", "smoke", "--chat-turns", "1"], "--chat-turns must be at least 2"),
    (["--chat-shapes", "smoke"], "--chat-shapes needs --chat"),
    (["--drafter", "pld"], "--drafter needs --chat"),
    (["--chat", "--sweep", "smoke"], "give one"),
    (["--chat", "--chat-shapes", "qwen9"], "unknown shape for --chat-shapes 'qwen9'"),
    (["--chat", "--chat-shapes", "smoke", "--drafter", "mtp"], "must be pld or none"),
    (["--chat", "--chat-shapes", "smoke", "some/model"], "give no MODEL"),
    (["--chat", "--chat-shapes", "smoke", "--bits", "7"], "--bits must be"),
    (["--chat", "--chat-shapes", "smoke", "--reps", "0"], "--reps must be at least 1"),
    (["--chat", "--from-json", "x.json"], "--from-json only redraws"),
])
def test_bad_flags_are_one_line_usage_errors(args, fragment):
    result = CliRunner().invoke(cli.app, ["bench", *args])
    assert result.exit_code == 2, result.output
    assert fragment in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
