"""`serve --max-batch`: concurrent requests decode as rows of one batch, each answer exactly
the one served alone (temperature 0 and seeded > 0, logprobs too); a request the batch cannot
take (draft trees) runs alone between them; a client that leaves frees its row; /metrics counts the batch."""

from __future__ import annotations

import re
import threading
from pathlib import Path

import httpx
import pytest

import mlxspec
from mlxspec.server.app import create_app
from mlxspec.server.common import Settings
from server_helpers import running, until

MODELS = Path(__file__).resolve().parent.parent / "benchmarks" / "models"
PLD = {"drafter": "pld"}
BODIES = [
    {"prompt": "import os\nimport sys\nimport os\nimport", "max_tokens": 40, "temperature": 0, "speculation": PLD},
    {"prompt": "Write a function that reverses a string.", "max_tokens": 30, "temperature": 0.8, "seed": 3,
     "speculation": PLD},
    {"prompt": "x = [1, 2, 3]\ny = [1, 2, 3]\nz = [1, 2,", "max_tokens": 36, "temperature": 0,
     "speculation": {"enabled": False}},
    {"prompt": "List three colors.", "max_tokens": 24, "temperature": 0.7, "top_p": 0.9, "seed": 5,
     "speculation": PLD},
    {"prompt": "Say hi.", "max_tokens": 12, "temperature": 0, "logprobs": 2, "speculation": PLD},
    # draft trees are served alone: it runs between the rows, the ones behind it wait
    {"prompt": "import os\nimport sys\nimport os\nimport", "max_tokens": 20, "temperature": 0,
     "speculation": {"drafter": "pld", "tree": 4}},
    {"prompt": "def add(a, b):", "max_tokens": 30, "temperature": 0.5, "seed": 9, "speculation": PLD},
    {"prompt": "import os\nimport sys\nimport", "max_tokens": 30, "temperature": 0.6, "seed": 21,
     "speculation": {"drafter": "mtp"}},
]


@pytest.fixture(scope="module")
def spec():
    s = mlxspec.load(str(MODELS / "mini-attn"))
    s.astype("float32")
    return s


def _answer(url: str, body: dict) -> str:
    r = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


@pytest.fixture(scope="module")
def alone(spec):
    with running(create_app(spec, Settings(model_name="tiny", max_batch=1))) as url:
        return [_answer(url, b) for b in BODIES]


def _metric(text: str, name: str) -> float:
    return float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))


def test_concurrent_requests_decode_together_each_as_alone(spec, alone):
    app = create_app(spec, Settings(model_name="tiny", max_batch=4))
    with running(app) as url:
        got = [None] * len(BODIES)

        def post(i):
            got[i] = _answer(url, BODIES[i])

        threads = [threading.Thread(target=post, args=(i,)) for i in range(len(BODIES))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert got == alone
        metrics = httpx.get(url + "/metrics").text
    assert _metric(metrics, "mlxspec_batch_max_rows") == 4
    steps, rows = _metric(metrics, "mlxspec_batch_steps_total"), _metric(metrics, "mlxspec_batch_row_steps_total")
    assert steps > 0 and rows / steps > 1.5, (steps, rows)  # several rows a forward, on average
    per_request = _metric(metrics, "mlxspec_request_decode_tokens_total") / _metric(
        metrics, "mlxspec_request_decode_seconds_total")
    assert per_request > 0


def test_a_client_that_leaves_frees_its_row(spec, alone):
    app = create_app(spec, Settings(model_name="tiny", max_batch=4))
    worker = app.state.server.worker
    with running(app) as url:
        got = {}

        def post(i):
            got[i] = _answer(url, BODIES[i])

        threads = [threading.Thread(target=post, args=(i,)) for i in (0, 1)]
        for t in threads:
            t.start()
        body = {"prompt": "x", "max_tokens": 2000, "temperature": 0.8, "stream": True, "speculation": PLD}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            for _ in zip(r.iter_lines(), range(4)):
                pass
        for t in threads:
            t.join(120)
        assert got == {0: alone[0], 1: alone[1]}
        assert until(lambda: worker.depth == 0, 20)
        assert _answer(url, BODIES[2]) == alone[2]  # and the batch serves on


def test_max_batch_flag_default_and_banner(spec, monkeypatch):
    from typer.testing import CliRunner

    from mlxspec import cli
    from mlxspec.cli import serve
    from mlxspec.presets import default_max_batch

    for bad in ("0", "65"):
        result = CliRunner().invoke(cli.app, ["serve", "--max-batch", bad])
        assert result.exit_code == 2 and "--max-batch must be from 1 to 64" in result.output
    # an 8B model at 4 bits (4.5 GB; 36 layers x 8 KV heads x 128 x K and V x bf16 = 144 KiB a
    # token) on a 16 GiB budget: (17.18 GB - 4.5 GB) / 2 = 6.34 GB over 1.21 GB a row of 8192
    # tokens = 5.2: 5 rows
    assert default_max_batch(16 << 30, 4_500_000_000, 36 * 8 * 128 * 2 * 2)[0] == 5
    assert default_max_batch(None, 1, 1) == (1, "memory unknown")
    assert default_max_batch(512 << 30, 1, 1)[0] == 8  # capped
    rows, note = serve._max_batch(spec, None)
    assert rows >= 1 and "default:" in note
    assert serve._max_batch(spec, 3) == (3, "up to 3 requests decode together (--max-batch); requests with "
                                            "the Gemma-4 assistant or draft trees run alone (DFlash drafts chains)")
    gemma = mlxspec.load(str(MODELS / "mini-gemma4"))  # sliding-window layers
    rows, note = serve._max_batch(gemma, 4)
    assert rows == 1 and "cannot batch" in note and "RotatingKVCache" in note
