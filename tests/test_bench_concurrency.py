"""`mlxspec bench --concurrency`: the three engines at each concurrency, paired ratios, the
batch's tokens checked against the serial engine's; bad flags are one-line errors."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from mlxspec import cli
from mlxspec.bench.concurrency import ENGINES, parse_levels
from mlxspec.errors import UsageError


def test_cli_runs_every_engine_at_each_concurrency(tmp_path):
    out = tmp_path / "c.json"
    result = CliRunner().invoke(cli.app, ["bench", "--concurrency", "1,3", "--prompts", "2", "--max-tokens", "8",
                                          "--reps", "1", "--temp", "0", "--join-tokens", "700",
                                          "--json", str(out)])
    assert result.exit_code == 0, result.output
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "concurrency" and doc["levels"] == [1, 3] and doc["reps"] == 1
    cells = {(c["concurrency"], c["engine"]): c for c in doc["cells"]}
    assert set(cells) == {(n, e) for n in (1, 3) for e in ENGINES}
    for n in (1, 3):
        batched = cells[(n, "mlxspec batched")]
        assert batched["identical"] is True  # the batch's tokens are the serial engine's
        assert batched["tokens"] == cells[(n, "mlxspec serial")]["tokens"] > 0
        assert len(batched["vs_serial_iqr"]) == 2 and batched["vs_serial"] > 0
        assert batched["aggregate_tps"] > 0 and batched["per_request_tps"] > 0
    assert "requests at once" in result.output and "identical" in result.output
    join = doc["join"]  # the running request got a token between every prefill chunk of the joiner
    assert join["join_tokens"] == 700 and join["steps"] >= 2 and join["worst_gap_ms"] >= join["gap_ms_during"] > 0


@pytest.mark.parametrize("flags, message", [
    (["--concurrency", "0"], "--concurrency must be a comma-separated list"),
    (["--concurrency", "2,x"], "--concurrency must be a comma-separated list"),
    (["--concurrency", "2", "--chat"], "--concurrency is a benchmark of its own"),
    (["--join-tokens", "100"], "--join-tokens needs --concurrency"),
    (["--concurrency", "2", "--drafter", "dflash"], "--drafter dflash needs --draft-model"),
])
def test_bad_flags_are_one_line_errors(flags, message):
    result = CliRunner().invoke(cli.app, ["bench", *flags])
    assert result.exit_code == 2 and message in result.output, result.output


def test_levels_parse():
    assert parse_levels("4,1,2,2") == [1, 2, 4]
    with pytest.raises(UsageError):
        parse_levels("65")
