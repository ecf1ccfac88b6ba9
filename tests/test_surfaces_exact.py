"""Every drafter through every surface gives plain decoding's output at temperature 0.

Drafters: pld, draft (a separate draft model), mtp (a Qwen3.5 MTP head), nextn (the mtp
drafter on a GLM-4.5-style NextN checkpoint), assistant (Gemma-4's assistant drafter) and
dflash. Surfaces: OpenAI chat completions (whole, and streamed with logprobs), OpenAI
completions (logprobs), Anthropic messages (whole and streamed), Ollama /api/chat (logprobs)
and /api/generate (streamed), and ``mlxspec run --json``. Each request asks for its drafter at
depth 3. The reference is the engine's plain decoding (drafter none, no prefix cache) of the
same prompt, compared token for token: the text, the logprobs' tokens, values and alternatives
where the surface gives them, the CLI's token ids. Each surface with drafter none gives that
reference too (test_the_reference_is_the_surface_without_speculation). The answer's stats must
name the requested drafter, which must have drafted and had drafts accepted (most answers also
have rejections): verification, partial accepts, the caches' rollback, DFlash's trees and, for
a case's later surfaces, its own prefix-cache entries all run behind the servers.

The targets are the committed trained mini models (benchmarks/models/, cast to float32 on
disk: bf16 ties may break identity, see docs/benchmarks.md), whose drafters really agree with them, and a
tiny random GLM-4.5 whose NextN layer drafts the token it was given (its target repeats
letters). One server per target serves all of its drafters. The verify and draft costs come
from a stored tune record written here, not from timing this machine: on a busy machine
measured costs would change the gates' decisions from run to run, and measuring them would
take longer than the whole test.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import mlx.core as mx
import pytest
from typer.testing import CliRunner

import tiny_mtp
from mlxspec import cli
from mlxspec.api import load
from mlxspec.engine.gates import CostModel
from mlxspec.server.app import create_app
from mlxspec.server.common import Settings
from mlxspec.tuning.storage import save_cost, save_draft_cost, save_tree_factor
from server_helpers import start_server

MODELS = Path(__file__).resolve().parents[1] / "benchmarks" / "models"
NAME = "m"
N = 16  # tokens per answer
DEPTH = 3
LOGPROB_TOL = 2e-4  # float32 (0 seen on the CPU: a verify's rows can round unlike 1-row forwards)

CODE = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):\n"
# per target: its files (None: the NextN checkpoint built here)
FAMILIES = {
    "hybrid": ("mini-hybrid", "mini-draft"),
    "attn": ("mini-attn", "mini-attn-DFlash"),
    "gemma4": ("mini-gemma4", "mini-gemma4-assistant"),
    "glm": (None, None),
}
# case -> (target family, the drafter asked for, its name in the stats, the prompt): the chat
# message's text and the completions' raw prompt. Each case has a prompt of its own, so no
# request restores a prefix another drafter stored (an MTP head resuming one starts with no
# history, its first drafts miss and the gate turns it off); prompts chosen for accepts in both
# forms.
CASES = {
    "pld": ("hybrid", "pld", "pld", "# pld\n" + CODE),
    "draft": ("hybrid", "draft", "draft", "# draft\n" + CODE),
    "mtp": ("hybrid", "mtp", "mtp", "# mtp\n" + CODE),
    "nextn": ("glm", "mtp", "mtp", "abcabcabcabc"),
    "assistant": ("gemma4", "assistant", "assistant", CODE),
    "dflash": ("attn", "dflash", "dflash", "x = 1\ny = 2\nx = 1\ny = 2\n"),
}
SURFACES = ("openai_chat", "openai_chat_stream", "openai_completions", "anthropic", "anthropic_stream",
            "ollama_chat", "ollama_generate_stream", "cli")
FINISH = {"anthropic": "max_tokens", "anthropic_stream": "max_tokens"}  # the others: "length"

pytestmark = pytest.mark.skipif(not (MODELS / "mini-hybrid" / "model.safetensors").is_file(),
                                reason="the committed mini models are not in benchmarks/models")


# -- the checkpoints, tune records and servers -------------------------------------------------

@pytest.fixture(scope="module", autouse=True)
def _tune_records_apart(tmp_path_factory):
    """One tune folder for the module (overrides conftest's per-test one): the records written
    for the servers' models are the CLI's too. No user config, an offline cache, no colours."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLXSPEC_TUNE_DIR", str(tmp_path_factory.mktemp("tune")))
        mp.setenv("XDG_CONFIG_HOME", str(tmp_path_factory.mktemp("config")))
        mp.setenv("HF_HUB_CACHE", str(tmp_path_factory.mktemp("hub")))
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setenv("NO_COLOR", "1")
        for name in ("MLXSPEC_DEFAULT_MODEL", "MLXSPEC_DEBUG"):
            mp.delenv(name, raising=False)
        yield


def _fp32_copy(name: str, out: Path) -> Path:
    """benchmarks/models/NAME with its floating tensors in float32."""
    folder = out / name
    shutil.copytree(MODELS / name, folder)
    weights, meta = mx.load(str(folder / "model.safetensors"), return_metadata=True)
    weights = {k: v.astype(mx.float32) if mx.issubdtype(v.dtype, mx.floating) else v for k, v in weights.items()}
    mx.eval(weights)
    mx.save_safetensors(str(folder / "model.safetensors"), weights, metadata=meta)
    return folder


def _copying_nextn(out: Path) -> Path:
    """A tiny GLM-4.5 (vocab 32) whose NextN layer drafts the token it was given again: the
    block adds nothing (o_proj, down_proj zero), eh_proj passes the normed embedding through,
    the head is the embedding. Its target repeats letters, so drafts are accepted, not always."""
    path = tiny_mtp.write_nextn_checkpoint(out / "glm", "glm4_moe", vocab_size=32, seed=1)
    config = json.loads((path / "config.json").read_text())
    n, h = config["num_hidden_layers"], config["hidden_size"]
    weights, meta = mx.load(str(path / "model.safetensors"), return_metadata=True)
    mx.eval(weights)  # read before the file is rewritten
    p = f"model.layers.{n}."
    for k in [k for k in weights if k.startswith(p) and k.endswith(("o_proj.weight", "down_proj.weight"))]:
        weights[k] = mx.zeros_like(weights[k])
    for norm in ("enorm", "hnorm", "shared_head.norm"):
        weights[f"{p}{norm}.weight"] = mx.ones((h,), mx.float32)
    weights[p + "eh_proj.weight"] = mx.concatenate([mx.eye(h), mx.zeros((h, h))], axis=1)
    weights[p + "shared_head.head.weight"] = weights[p + "embed_tokens.weight"]
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata=meta)
    return path


def _store_costs(spec, drafters) -> None:
    """The record `mlxspec tune` would leave: cheap verifies, cheap draft steps, trees at par."""
    curve = {n: 1.0 + 0.05 * (n - 1) for n in range(1, 17)}
    assert save_cost(spec.target, CostModel(curve=curve, measured=True)) is not None
    for drafter in drafters:
        if drafter in ("draft", "mtp", "assistant", "dflash"):
            assert save_draft_cost(spec.target, drafter, 0.05, spec.draft) is not None
    assert save_tree_factor(spec.target, 1.0) is not None


class Answer:
    """What a surface (or the engine) answered: text, finish reason, logprobs as the surface
    shows them where asked (token, logprob, alternatives), token ids where given, and the
    speculation stats."""

    def __init__(self, text, finish, spec=None, logprobs=None, tokens=None):
        self.text, self.finish, self.spec, self.logprobs, self.tokens = text, finish, spec, logprobs, tokens


def _reference(spec, prompt, raw: bool) -> dict:
    """Plain decoding by the engine (drafter none, no prefix cache) of PROMPT as a chat
    message (RAW: as a completions prompt), with its logprobs as each surface renders them."""
    messages = prompt if raw else [{"role": "user", "content": prompt}]
    r = spec.generate(messages, max_tokens=N, temperature=0, drafter="none", reuse=False, logprobs=2, raw=raw)
    assert r.finish_reason == "length" and r.text.strip() and len(r.tokens) == N  # a real answer, cut
    assert r.stats.drafted == 0

    def tok(t):
        return spec.token_bytes(t).decode("utf-8", errors="replace")

    chat = [(tok(p.token), p.logprob, [(tok(t), v) for t, v in p.top]) for p in r.logprobs]
    completion = [(tok(p.token), p.logprob, sorted({tok(t): v for t, v in p.top}.items())) for p in r.logprobs]
    return {"text": r.text, "tokens": r.tokens, "chat": chat, "completion": completion}


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    """family -> {"spec", "url", "target", "draft", "refs": {(case, raw): reference}}: each
    target loaded, its references decoded and its server started on first use."""
    out = tmp_path_factory.mktemp("surfaces")
    started, stops = {}, []

    def get(family: str) -> dict:
        if family not in started:
            target_name, draft_name = FAMILIES[family]
            if target_name is None:
                target, draft = _copying_nextn(out), None
            else:
                target, draft = _fp32_copy(target_name, out), _fp32_copy(draft_name, out)
            spec = load(str(target), str(draft) if draft else None)
            cases = [c for c, (fam, *_) in CASES.items() if fam == family]
            _store_costs(spec, [CASES[c][1] for c in cases])
            refs = {(c, raw): _reference(spec, CASES[c][3], raw) for c in cases for raw in (False, True)}
            url, stop = start_server(create_app(spec, Settings(model_name=NAME, max_tokens_cap=64)))
            stops.append(stop)
            started[family] = {"spec": spec, "url": url, "target": target, "draft": draft, "refs": refs}
        return started[family]

    yield get
    for stop in stops:
        stop()


# -- one answer through each surface -----------------------------------------------------------

def _sse(text: str):
    """The JSON payloads of an SSE body (OpenAI's ``data: [DONE]`` left out)."""
    for line in text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line[len("data: "):])


def _chat_logprobs(content: list[dict]) -> list:
    return [(c["token"], c["logprob"], [(t["token"], t["logprob"]) for t in c["top_logprobs"]]) for c in content]


def _post(url: str, path: str, body: dict) -> httpx.Response:
    r = httpx.post(url + path, json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r


def ask(fam: dict, surface: str, prompt: str, drafter: str) -> Answer:
    """PROMPT through SURFACE with DRAFTER (at depth DEPTH), at temperature 0."""
    url = fam["url"]
    messages = [{"role": "user", "content": prompt}]
    speculation = {"drafter": drafter} if drafter == "none" else {"drafter": drafter, "depth": DEPTH}
    common = {"model": NAME, "temperature": 0, "speculation": speculation}
    if surface == "openai_chat":
        r = _post(url, "/v1/chat/completions", {**common, "messages": messages, "max_tokens": N}).json()
        choice = r["choices"][0]
        return Answer(choice["message"]["content"], choice["finish_reason"], r["usage"]["speculation"])
    if surface == "openai_chat_stream":
        body = {**common, "messages": messages, "max_tokens": N, "stream": True,
                "stream_options": {"include_usage": True}, "logprobs": True, "top_logprobs": 2}
        chunks = list(_sse(_post(url, "/v1/chat/completions", body).text))
        text, logprobs, finish = "", [], None
        for c in chunks:
            for choice in c.get("choices") or []:
                text += choice["delta"].get("content") or ""
                logprobs += _chat_logprobs((choice.get("logprobs") or {}).get("content") or [])
                finish = choice.get("finish_reason") or finish
        return Answer(text, finish, chunks[-1]["usage"]["speculation"], logprobs)
    if surface == "openai_completions":
        r = _post(url, "/v1/completions", {**common, "prompt": prompt, "max_tokens": N, "logprobs": 2}).json()
        choice = r["choices"][0]
        lp = choice["logprobs"]
        logprobs = [(t, v, sorted(top.items())) for t, v, top in
                    zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], strict=True)]
        return Answer(choice["text"], choice["finish_reason"], r["usage"]["speculation"], logprobs)
    if surface == "anthropic":
        r = _post(url, "/v1/messages", {**common, "messages": messages, "max_tokens": N}).json()
        text = "".join(b["text"] for b in r["content"] if b["type"] == "text")
        return Answer(text, r["stop_reason"], r["usage"]["speculation"])
    if surface == "anthropic_stream":
        body = {**common, "messages": messages, "max_tokens": N, "stream": True}
        events = list(_sse(_post(url, "/v1/messages", body).text))
        assert not [e for e in events if e["type"] == "error"], events
        text = "".join(e["delta"]["text"] for e in events
                       if e["type"] == "content_block_delta" and e["delta"]["type"] == "text_delta")
        (end,) = [e for e in events if e["type"] == "message_delta"]
        return Answer(text, end["delta"]["stop_reason"], end["usage"]["speculation"])
    options = {"temperature": 0, "num_predict": N}
    if surface == "ollama_chat":
        body = {"model": NAME, "messages": messages, "stream": False, "options": options,
                "speculation": speculation, "logprobs": True, "top_logprobs": 2}
        r = _post(url, "/api/chat", body).json()
        return Answer(r["message"]["content"], r["done_reason"], r["speculation"], _chat_logprobs(r["logprobs"]))
    if surface == "ollama_generate_stream":
        body = {"model": NAME, "prompt": prompt, "stream": True, "options": options, "speculation": speculation}
        lines = [json.loads(line) for line in _post(url, "/api/generate", body).text.splitlines() if line.strip()]
        assert lines[-1]["done"] and not any(line.get("done") for line in lines[:-1])
        return Answer("".join(line.get("response", "") for line in lines), lines[-1]["done_reason"],
                      lines[-1]["speculation"])
    assert surface == "cli"
    args = ["run", str(fam["target"]), prompt, "--json", "--temp", "0", "--max-tokens", str(N), "--drafter", drafter]
    if drafter != "none":
        args += ["--depth", str(DEPTH)]
    if drafter in ("draft", "assistant", "dflash"):
        args += ["--draft-model", str(fam["draft"])]
    result = CliRunner().invoke(cli.app, args)
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    return Answer(out["text"], out["finish_reason"], out["stats"], tokens=out["tokens"])


def check_plain(got: Answer, ref: dict, surface: str) -> None:
    """GOT is the engine's plain decoding REF as SURFACE shows it."""
    assert got.text == ref["text"]
    assert got.finish == FINISH.get(surface, "length")
    if got.logprobs is not None:
        want = ref["completion" if surface == "openai_completions" else "chat"]
        assert [g[0] for g in got.logprobs] == [w[0] for w in want]  # the tokens
        for (token, lp, top), (_, want_lp, want_top) in zip(got.logprobs, want):
            assert lp == pytest.approx(want_lp, abs=LOGPROB_TOL), token
            assert [t for t, _ in top] == [t for t, _ in want_top], token
            assert [v for _, v in top] == pytest.approx([v for _, v in want_top], abs=LOGPROB_TOL), token
    if got.tokens is not None:
        assert got.tokens == ref["tokens"]


@pytest.mark.parametrize("surface", SURFACES)
@pytest.mark.parametrize("case", list(CASES))
def test_drafter_through_surface_is_plain_decoding(families, case, surface):
    family, drafter, reported, prompt = CASES[case]
    fam = families(family)
    got = ask(fam, surface, prompt, drafter)
    check_plain(got, fam["refs"][case, surface == "openai_completions"], surface)
    s = got.spec
    assert s["drafter"] == reported, s  # the requested drafter ran ...
    assert s["drafted"] > 0 and s["accepted"] > 0, s  # ... drafted, and had drafts accepted


@pytest.mark.parametrize("surface", SURFACES)
def test_the_reference_is_the_surface_without_speculation(families, surface):
    """Each surface with drafter none gives the engine's plain decoding: the reference above is
    what the surface itself answers without speculation."""
    fam = families("hybrid")
    got = ask(fam, surface, CASES["draft"][3], "none")
    check_plain(got, fam["refs"]["draft", surface == "openai_completions"], surface)
    assert got.spec["drafter"] == "none" and got.spec["drafted"] == 0


def test_a_model_loaded_on_another_thread_serves():
    """The server generates on its worker thread, not on the thread that loaded the model: an
    array a model computes lazily at load (the RoPE frequencies of Gemma-4's proportional RoPE,
    as of Llama-3's and YaRN's) must be evaluated by then, or every request fails with "There
    is no Stream(cpu, 0) in current thread" (MLX streams are per thread). As `mlxspec serve`
    does: load, then serve, with nothing generated on the loading thread."""
    spec = load(str(MODELS / "mini-gemma4"), str(MODELS / "mini-gemma4-assistant"))
    url, stop = start_server(create_app(spec, Settings(model_name=NAME)))
    try:
        for drafter in ("none", "assistant"):  # the target's RoPE, then the assistant's
            body = {"model": NAME, "messages": [{"role": "user", "content": CODE}], "max_tokens": 4,
                    "temperature": 0, "seed": 0, "speculation": {"drafter": drafter}}  # seeded: no timing
            r = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["speculation"]["drafter"] == drafter
    finally:
        stop()
