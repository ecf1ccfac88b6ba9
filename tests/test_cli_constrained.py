"""`mlxspec run --json-schema FILE` / `--regex PATTERN`: the answer is constrained, with the
drafter on; bad files and patterns are one-line errors."""

import json

import jsonschema
from typer.testing import CliRunner

from mlxspec import cli

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                            "maximum": 9}},
          "required": ["ok", "n"], "additionalProperties": False}


def _run(*args):
    return CliRunner().invoke(cli.app, ["run", *map(str, args)])


def test_json_schema_file_constrains_the_answer(tiny_qwen3, tmp_path):
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(SCHEMA))
    for temp in ("0", "0.8"):
        result = _run(tiny_qwen3, "Hello there", "--json-schema", path, "--json", "--max-tokens", 40,
                      "--drafter", "pld", "--temp", temp, "--seed", 1)
        assert result.exit_code == 0, result.output
        out = json.loads(result.stdout)
        jsonschema.validate(json.loads(out["text"]), SCHEMA)
        assert out["stats"]["drafter"] == "pld"


def test_regex_constrains_the_answer(tiny_qwen3):
    result = _run(tiny_qwen3, "Hello there", "--regex", "(yes|no), [0-9]{2}", "--json", "--max-tokens", 20)
    assert result.exit_code == 0, result.output
    text = json.loads(result.stdout)["text"]
    assert text[:3] in ("yes", "no,") and text[-2:].isdigit()


def test_bad_schema_or_regex_is_a_one_line_error(tiny_qwen3, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    cases = [
        (["--json-schema", bad], "is not JSON"),
        (["--json-schema", tmp_path / "missing.json"], "cannot read"),
        (["--json-schema", bad, "--regex", "a"], "not both"),
        (["--regex", "[0-9"], "invalid regex"),
    ]
    for flags, message in cases:
        result = _run(tiny_qwen3, "Hi", *flags, "--max-tokens", 4)
        assert result.exit_code != 0 and message in result.output, (flags, result.output)
        assert "Traceback" not in result.output
