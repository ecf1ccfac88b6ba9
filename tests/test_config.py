"""User settings: flag > $MLXSPEC_* > config.toml > default; `mlxspec config show|path`."""

import json

import pytest
from typer.testing import CliRunner

from mlxspec import cli, config, hub
from mlxspec.errors import MlxspecError


@pytest.fixture
def cfg(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    for _, _, env, _ in config.SETTINGS.values():
        monkeypatch.delenv(env, raising=False)
    path = tmp_path / "config" / "mlxspec" / "config.toml"
    path.parent.mkdir(parents=True)
    return path


def test_defaults(cfg):
    got = config.settings_with_sources()
    assert got["temp"] == (0.0, "default") and got["max_tokens"] == (512, "default")
    assert got["drafter"] == ("auto", "default")


def test_precedence_flag_env_file_default(cfg, monkeypatch):
    cfg.write_text('drafter = "pld"\n[sampling]\ntemp = 0.5\ntop_k = 20\nmax_tokens = 64\n'
                   '[server]\nport = 9000\n[aliases]\nq = "some/repo"\n')
    monkeypatch.setenv("MLXSPEC_TEMP", "0.7")
    monkeypatch.setenv("MLXSPEC_MAX_TOKENS", "128")
    got = config.settings_with_sources({"max_tokens": 32, "temp": None})
    assert got["max_tokens"] == (32, "flag")
    assert got["temp"] == (0.7, "env")
    assert got["top_k"] == (20, "file") and got["drafter"] == ("pld", "file")
    assert got["port"] == (9000, "file")
    assert got["top_p"] == (1.0, "default")
    assert config.settings()["max_tokens"] == 128
    assert hub.expand_alias("q") == "some/repo" and hub.expand_alias("x") == "x"


def test_config_show_json_and_path(cfg, monkeypatch):
    cfg.write_text('[sampling]\ntop_p = 0.9\n')
    monkeypatch.setenv("MLXSPEC_DRAFTER", "none")
    res = CliRunner().invoke(cli.app, ["config", "show", "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert data["file"] == str(cfg) and data["file_exists"]
    s = data["settings"]
    assert s["top_p"]["value"] == 0.9 and s["top_p"]["source"] == "file"
    assert s["drafter"]["value"] == "none" and s["drafter"]["source"] == "env"
    assert s["temp"]["source"] == "default"
    res = CliRunner().invoke(cli.app, ["config", "path"])
    assert res.exit_code == 0 and res.stdout.strip() == str(cfg)
    res = CliRunner().invoke(cli.app, ["config", "show"])
    assert res.exit_code == 0 and "top_p" in res.stdout and "file" in res.stdout


def test_run_uses_the_settings(cfg, monkeypatch):
    """The run command: flag beats env beats file; the API sees the resolved values."""
    seen = {}

    class Fake:
        is_demo = False
        name = "fake"

        def generate(self, prompt, request):
            seen.update(vars(request))
            raise MlxspecError("stop here")

        stream = generate

    monkeypatch.setattr("mlxspec.api.load", lambda *a, **k: Fake())
    cfg.write_text('drafter = "pld"\n[sampling]\ntemp = 0.5\ntop_k = 20\nmax_tokens = 64\n')
    monkeypatch.setenv("MLXSPEC_TEMP", "0.7")
    res = CliRunner().invoke(cli.app, ["run", "m", "hi", "--json", "--max-tokens", "8"])
    assert res.exit_code != 0 and "stop here" in res.stderr, res.output
    assert seen["max_tokens"] == 8 and seen["temperature"] == 0.7
    assert seen["top_k"] == 20 and seen["drafter"] == "pld" and seen["top_p"] == 1.0


@pytest.mark.parametrize("text, env, fragment", [
    ("[sampling\ntemp = 1", {}, "cannot read the config file"),
    ('[sampling]\ntemp = "hot"\n', {}, "sampling.temp in"),
    ('[sampling]\ntop_p = 2.0\n', {}, "sampling.top_p in"),
    ('drafter = "magic"\n', {}, "drafter in"),
    ('[server]\nport = 0\n', {}, "server.port in"),
    ("", {"MLXSPEC_MAX_TOKENS": "lots"}, "$MLXSPEC_MAX_TOKENS must be an integer"),
])
def test_bad_values_are_one_line(cfg, monkeypatch, text, env, fragment):
    cfg.write_text(text)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    res = CliRunner().invoke(cli.app, ["config", "show"])
    assert res.exit_code != 0
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and fragment in lines[0], res.stderr
    if not env:
        assert str(cfg) in lines[0]
    res = CliRunner().invoke(cli.app, ["run", "./m", "hi"])
    assert res.exit_code != 0 and len(res.stderr.strip().splitlines()) == 1 and fragment in res.stderr


def test_preset_from_the_file_reaches_run(cfg, monkeypatch):
    from mlxspec.cli import machine as cli_machine

    seen = []
    monkeypatch.setattr(cli_machine, "prepare_run", lambda preset, model, drafter, draft_model, *rest:
                        seen.append(preset) or (drafter, draft_model, {}))
    monkeypatch.setattr("mlxspec.api.load", lambda *a, **k: (_ for _ in ()).throw(MlxspecError("stop")))
    cfg.write_text('preset = "pld"\n')
    CliRunner().invoke(cli.app, ["run", "./m", "hi"])
    CliRunner().invoke(cli.app, ["run", "./m", "hi", "--preset", "mtp"])
    assert seen == ["pld", "mtp"]


def test_a_mistyped_key_gets_a_warning_naming_it(cfg):
    cfg.write_text('drafter = "pld"\nmax_tokens = 64\n[sampling]\ntemperature = 0.5\n[server]\nport = 9000\n'
                   '[aliases]\nanything = "some/repo"\n')
    res = CliRunner().invoke(cli.app, ["config", "show", "--json"])
    assert res.exit_code == 0, res.output
    warnings = [line for line in res.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 2 and all(str(cfg) in line for line in warnings), res.stderr
    top, sampling = sorted(warnings, key=lambda line: "sampling.temperature" in line)
    assert "'max_tokens'" in top and "sampling.max_tokens" in top
    assert "'sampling.temperature'" in sampling and "sampling.temp'" in sampling
    assert config.unknown_keys({"sampling": {"temp": 1}, "aliases": {"x": "y"}, "server": {"host": "h"}}) == []
