"""The verify-cost measurement a first run makes is bounded in time, shows its progress and
stops on Ctrl-C: on a slow CPU the unbounded one (11 widths x 6 forwards over a 128-token
context) took 110 s of a 135M model's first run before any token."""

import json
import os
import sys

import pytest

from mlxspec.engine import costs
from mlxspec.tuning import storage


class Clock:
    """time.perf_counter for costs.py: advanced only by the fake model's forwards."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def fake_state(clock, per_row: float, calls: list):
    """A ModelState whose forward of n rows takes PER_ROW * n seconds of CLOCK (the CPU pays
    about per row)."""

    class State:
        def __init__(self, model):
            self.length = 0

        def prefill(self, tokens):
            clock.now += per_row * len(tokens)
            self.length += len(tokens)
            calls.append(("prefill", len(tokens)))

        def forward(self, tokens, rollback=True):
            clock.now += per_row * tokens.size
            self.length += tokens.size
            calls.append(("forward", tokens.size))
            return tokens.reshape(-1, 1)  # logits [n, V] of a one-token vocabulary

        def rollback_to(self, n):
            self.length = n

        def commit(self):
            pass

    return State


@pytest.fixture
def slow_machine(monkeypatch):
    clock, calls = Clock(), []
    monkeypatch.setattr(costs.time, "perf_counter", clock)
    monkeypatch.setattr(costs, "ModelState", fake_state(clock, 0.1, calls))
    return clock, calls


def test_a_bounded_measurement_ends_within_its_budget(slow_machine):
    clock, calls = slow_machine
    progress = []
    cost = costs.measure_verify_cost(None, context=128, reps=5, budget_s=2.0,
                                     on_progress=lambda d, t: progress.append((d, t)))
    # the unbounded one: 128 rows of prefill, then (1 + 81) rows x 6 = 61 s of this machine
    assert clock.now <= 2.0 + 1e-9
    prefilled = sum(n for kind, n in calls if kind == "prefill")
    assert 0 < prefilled <= 8  # a quarter of the budget: one chunk
    assert cost.partial and cost.curve[1] == 1.0 and len(cost.curve) >= 2
    # the widths left out follow the measured slope (here exactly linear: 1 per row)
    assert cost.slope == pytest.approx(1.0)
    assert cost.verify(16) == pytest.approx(16.0)
    assert progress[-1][0] == progress[-1][1] and len(progress) >= 3
    assert [d for d, _ in progress] == sorted(d for d, _ in progress)


def test_an_unbounded_measurement_times_every_width(slow_machine):
    clock, calls = slow_machine
    cost = costs.measure_verify_cost(None, widths=(1, 2, 4), context=32, reps=2)
    assert set(cost.curve) == {1, 2, 4} and not cost.partial
    # the curve's context, then the pipelined plain tokens' (timed too without a budget)
    assert [n for kind, n in calls if kind == "prefill"] == [32, costs.PLAIN_CONTEXT]


def test_width_one_is_timed_even_when_nothing_fits(slow_machine):
    clock, _ = slow_machine
    cost = costs.measure_verify_cost(None, context=128, reps=5, budget_s=0.01)
    assert cost.curve == {1: 1.0} and cost.partial and cost.slope > 0


def test_a_partial_curve_is_stored_with_its_slope(tmp_path, monkeypatch, tiny_qwen3):
    from mlxspec.api import load
    from mlxspec.engine.gates import CostModel

    monkeypatch.setenv(storage.DATA_ENV, str(tmp_path / "tune"))
    spec = load(str(tiny_qwen3))
    storage.save_cost(spec.target, CostModel(curve={1: 1.0, 2: 1.9}, measured=True, slope=0.9, partial=True))
    record = json.loads(storage.result_path(spec.target).read_text())
    assert record["verify_slope"] == 0.9
    again = storage.stored_cost(spec.target)
    assert again.partial and again.verify(4) == pytest.approx(3.7)


def test_ctrl_c_while_measuring_stops_the_run_and_stores_nothing(tmp_path, monkeypatch, tiny_qwen3):
    """Ctrl-C during the measurement: exit 130 at once, no record (the next run measures)."""
    from typer.testing import CliRunner

    from mlxspec import cli

    monkeypatch.setenv(storage.DATA_ENV, str(tmp_path / "tune"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    seen = []

    def interrupted(done, total):
        seen.append(done)
        if done == 2:
            raise KeyboardInterrupt

    real = costs.measure_verify_cost

    def measure(*args, **kwargs):
        return real(*args, **{**kwargs, "on_progress": interrupted})

    monkeypatch.setattr(costs, "measure_verify_cost", measure)
    result = CliRunner().invoke(cli.app, ["run", str(tiny_qwen3), "hi", "--drafter", "pld", "--max-tokens", "3"])
    assert result.exit_code == 130, result.output
    assert seen == [1, 2] and "Traceback" not in result.output
    assert not list((tmp_path / "tune").rglob("*.json"))


def test_the_real_model_first_run_measures_within_the_budget(smollm2, tmp_path, monkeypatch):
    """SmolLM2 on this CPU, as a first run measures it (the budget plus at most one forward
    of the widest width it started; the unbounded pass took 110 s)."""
    import time

    from mlxspec.options import VERIFY_COST_BUDGET_S

    monkeypatch.setenv(storage.DATA_ENV, str(tmp_path / "tune"))
    smollm2._cost = None
    labels = []
    t0 = time.perf_counter()
    cost = smollm2.verify_cost(labels.append)
    seconds = time.perf_counter() - t0
    assert cost.measured and cost.curve[1] == 1.0
    assert seconds < VERIFY_COST_BUDGET_S + 10, seconds
    assert "measuring" in labels[0] and labels[-1].endswith("100%")


@pytest.mark.skipif(sys.platform == "win32", reason="pty")
def test_ctrl_c_in_a_terminal_during_the_first_run(smollm2_folder, tmp_path):
    """The real model's first run on a pseudo-terminal: the measuring step is shown with its
    progress, and Ctrl-C ends the run with 130 within seconds, without a traceback."""
    from test_cli import ROOT, Pty

    env = {**os.environ, "PYTHONPATH": str(ROOT), "XDG_CONFIG_HOME": str(tmp_path / "config"),
           storage.DATA_ENV: str(tmp_path / "tune"), "HF_HUB_OFFLINE": "1", "NO_COLOR": "1"}
    run = Pty([sys.executable, "-m", "mlxspec", "run", str(smollm2_folder), "--drafter", "pld",
               "What is the capital of France?", "--max-tokens", "400"], env)
    run.expect("measuring this machine's verify cost", timeout=120)
    run.send("\x03")
    assert run.wait(timeout=15) == 130
    assert "Traceback" not in run.output
