"""`mlxspec run`'s flag names from the tools users come from (issue 33, section 2): -m/--model
once only (mlx-lm's own -m is --max-tokens: said so, not silently taken for a model),
-p/--prompt, mlx-lm's --num-draft-tokens and llama.cpp's --draft-max for --depth, llama.cpp's
-md for --draft-model; each usage error one line with exit code 2. In process, fake model."""

# ruff: noqa: F811  (the fixtures imported from test_cli_input are test arguments)

import re

import pytest

from test_cli import ROOT
from test_cli_input import env, fake_load, invoke, one_error_line  # noqa: F401  fixtures


@pytest.mark.parametrize("args, named", [
    (["-m", "first", "-m", "second", "hi"], ["'first'", "'second'", "-m/--model"]),
    (["--model", "first", "-m", "second"], ["'first'", "'second'"]),
    (["-m", "first", "./second", ], ["'first'", "'./second'"]),
    (["-m", "first", "org/second"], ["'first'", "'org/second'"]),
    (["-m", "first", "second", "the prompt"], ["'first'", "'second'"]),
    (["-m", "first", "second", "-p", "the prompt"], ["'first'", "'second'"]),
])
def test_a_second_model_is_an_error_naming_both(fake_load, args, named):
    line = one_error_line(invoke("run", *args), 2, "MODEL given twice", *named)
    assert not fake_load, line  # nothing loaded


def test_a_model_folder_beside_m_is_a_second_model(fake_load, tiny_llama, tmp_path):
    one_error_line(invoke("run", "-m", tmp_path, tiny_llama), 2, "MODEL given twice", str(tiny_llama))


def test_m_with_a_number_says_it_is_the_model_here(fake_load):
    one_error_line(invoke("run", "-m", "256", "hi"), 2, "-m/--model is the model", "-n/--max-tokens 256")


def test_m_with_a_prompt_is_model_and_prompt(fake_load, tiny_llama):
    result = invoke("run", "-m", tiny_llama, "write a haiku")
    assert result.exit_code == 0, result.output
    assert fake_load[-1].model_ref == str(tiny_llama) and fake_load[-1].calls[0][0] == "write a haiku"


@pytest.mark.parametrize("args", [["-p", "the prompt"], ["--prompt", "the prompt"], ["-p", "the prompt", "MODEL"],
                                  ["-m", "MODEL", "-p", "the prompt"]])
def test_prompt_option(fake_load, tiny_llama, args):
    args = [str(tiny_llama) if a == "MODEL" else a for a in args]
    result = invoke("run", *args)
    assert result.exit_code == 0, result.output
    model = str(tiny_llama) if str(tiny_llama) in args else None
    assert fake_load[-1].model_ref == model and fake_load[-1].calls[0][0] == "the prompt"


def test_prompt_option_dash_reads_stdin(fake_load, tiny_llama):
    result = invoke("run", tiny_llama, "-p", "-", input="from stdin\n")
    assert result.exit_code == 0, result.output
    assert fake_load[-1].calls[0][0] == "from stdin"


def test_a_second_prompt_is_an_error_naming_both(fake_load, tiny_llama):
    one_error_line(invoke("run", tiny_llama, "one", "-p", "two"), 2, "PROMPT given twice", "'two'", "'one'")
    assert not fake_load


@pytest.mark.parametrize("flag", ["--depth", "--num-draft-tokens", "--draft-max"])
def test_depth_aliases(fake_load, flag):
    result = invoke("run", "m", "p", "--drafter", "pld", flag, "3")
    assert result.exit_code == 0, result.output
    assert fake_load[-1].calls[0][1]["depth"] == 3
    one_error_line(invoke("run", "m", "p", flag, "0"), 2, "--depth")


def test_a_flag_and_its_alias_is_an_error_naming_both(fake_load):
    one_error_line(invoke("run", "m", "p", "--depth", "3", "--draft-max", "5"), 2, "--depth given twice", "3", "5")
    one_error_line(invoke("run", "m", "p", "-md", "a", "--draft-model", "b"), 2, "--draft-model given twice",
                   "a", "b")
    assert not fake_load


@pytest.mark.parametrize("flag", ["--draft-model", "-md"])
def test_draft_model_aliases(fake_load, flag):
    result = invoke("run", "m", "p", "--drafter", "draft", flag, "the-draft")
    assert result.exit_code == 0, result.output
    assert fake_load[-1].model_ref == "m" and fake_load[-1].draft_ref == "the-draft"


def test_help_lists_the_aliases():
    text = invoke("run", "--help").stdout
    for name in ("--num-draft-tokens", "--draft-max", "-md", "--prompt", "-p", "-m", "--model"):
        assert re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", text), name


def test_cli_docs_do_not_call_m_mlx_lm_s_model_flag():
    text = (ROOT / "docs" / "cli.md").read_text()  # the README's run section moved there
    line = next(line for line in text.splitlines() if "mlx-lm's names work too" in line)
    assert "-m/--model" not in line
    assert "--num-draft-tokens" in text and "--draft-max" in text and "-md" in text and "-p/--prompt" in text
