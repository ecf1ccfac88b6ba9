"""Fill-in-the-middle: each family's FIM layout read from hand-built tokenizers (Qwen2.5/3-Coder,
StarCoder, Code Llama, DeepSeek-Coder) and its prompt, token for token; then llama.cpp's
``/infill``, ``suffix`` on ``/v1/completions`` and on Ollama's ``/api/generate`` end to end on a
tiny checkpoint whose tokenizer has Qwen's FIM tokens: at temperature 0 the text is plain
decoding's over the same FIM prompt, with prompt lookup drafting; a model without FIM tokens and
an unknown /infill field are 400s."""

from __future__ import annotations

import json

import httpx
import pytest

import tiny
from mlxspec.api import load
from mlxspec.models import fim
from mlxspec.server.app import create_app
from mlxspec.server.common import Settings
from server_helpers import running

QWEN = ["<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"]
STARCODER = ["<fim_prefix>", "<fim_middle>", "<fim_suffix>", "<fim_pad>", "<filename>", "<gh_stars>",
             "<issue_start>", "<reponame>", "<file_sep>"]
CODELLAMA = ["▁<PRE>", "▁<SUF>", "▁<MID>", "▁<EOT>"]
DEEPSEEK = ["<｜fim▁hole｜>", "<｜fim▁begin｜>", "<｜fim▁end｜>"]
BOS = "<s>"

PREFIX = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n"
SUFFIX = "\n\n\ndef add(a, b):\n    return a + b\n"
N = 12


# -- hand-built tokenizers ----------------------------------------------------------------------

def _hf(shared_tokenizer, tokens: list[str], bos: bool = False):
    """The shared BPE tokenizer with TOKENS added as special tokens (and a BOS put before every
    text, as Llama's and DeepSeek's tokenizers do), as transformers loads it."""
    from tokenizers import Tokenizer, processors
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer.from_file(str(shared_tokenizer / "tokenizer.json"))
    tok.add_special_tokens(tokens + ([BOS] if bos else []))
    kwargs = {}
    if bos:
        tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A",
                                                           special_tokens=[(BOS, tok.token_to_id(BOS))])
        kwargs["bos_token"] = BOS
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", **kwargs)


def _ids(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("family, tokens, marks", [
    ("qwen", QWEN, ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>")),
    ("starcoder", STARCODER, ("<fim_prefix>", "<fim_suffix>", "<fim_middle>")),
    ("deepseek", DEEPSEEK, ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>")),
])
def test_each_family_is_read_from_its_tokens_and_its_prompt_is_psm(shared_tokenizer, family, tokens, marks):
    tok = _hf(shared_tokenizer, tokens)
    layout = fim.detect(tok)
    p, s, m = (tok.convert_tokens_to_ids(t) for t in marks)
    assert (layout.family, layout.prefix, layout.suffix, layout.middle, layout.bos) == (family, p, s, m, None)
    assert fim.prompt_ids(tok, layout, PREFIX, SUFFIX) == [p, *_ids(tok, PREFIX), s, *_ids(tok, SUFFIX), m]
    # llama.cpp's `prompt` goes right after the prefix
    assert fim.prompt_ids(tok, layout, "a", "b", prompt="c") == [p, *_ids(tok, "a"), *_ids(tok, "c"), s,
                                                                 *_ids(tok, "b"), m]
    assert set(fim.stop_texts(tok, layout)) >= set(marks)


def test_repo_level_context_where_the_model_has_repo_and_file_tokens(shared_tokenizer):
    for tokens, repo, sep in ((QWEN, "<|repo_name|>", "<|file_sep|>"), (STARCODER, "<reponame>", "<file_sep>")):
        tok = _hf(shared_tokenizer, tokens)
        layout = fim.detect(tok)
        r, f = tok.convert_tokens_to_ids(repo), tok.convert_tokens_to_ids(sep)
        assert (layout.repo, layout.file_sep) == (r, f)
        ids = fim.prompt_ids(tok, layout, "x", "y", extra=[("a.py", "A = 1\n"), ("b.py", "B = 2\n")])
        assert ids == [r, *_ids(tok, "myproject\n"), f, *_ids(tok, "a.py\n"), *_ids(tok, "A = 1\n"),
                       f, *_ids(tok, "b.py\n"), *_ids(tok, "B = 2\n"), f, *_ids(tok, "filename\n"),
                       layout.prefix, *_ids(tok, "x"), layout.suffix, *_ids(tok, "y"), layout.middle]


def test_codellama_puts_bos_first_snippets_for_context_and_ends_at_eot(shared_tokenizer):
    tok = _hf(shared_tokenizer, CODELLAMA, bos=True)
    layout = fim.detect(tok)
    pre, suf, mid, eot = (tok.convert_tokens_to_ids(t) for t in CODELLAMA)
    bos = tok.convert_tokens_to_ids(BOS)
    assert (layout.family, layout.prefix, layout.suffix, layout.middle, layout.eot, layout.bos) == \
        ("codellama", pre, suf, mid, eot, bos)
    assert fim.prompt_ids(tok, layout, "x = 1", "y = 2") == [bos, pre, *_ids(tok, "x = 1"), suf, *_ids(tok, "y = 2"),
                                                             mid]
    ids = fim.prompt_ids(tok, layout, "x", "y", extra=[("a.py", "A = 1")])
    assert ids == [bos, *_ids(tok, fim.SNIPPET_SEPARATOR), *_ids(tok, "A = 1"), pre, *_ids(tok, "x"), suf,
                   *_ids(tok, "y"), mid]
    assert fim.stop_texts(tok, layout)[0] == tok.decode([eot])  # the middle's end first


def test_a_tokenizer_without_fim_tokens_has_no_layout(shared_tokenizer):
    tok = _hf(shared_tokenizer, [])
    assert fim.detect(tok) is None
    with pytest.raises(fim.NoFimTokens, match="no fill-in-the-middle tokens"):
        fim.require(tok)
    assert fim.detect(object()) is None  # a stand-in with no vocabulary
    # two of three is not a layout
    assert fim.detect(_hf(shared_tokenizer, ["<|fim_prefix|>", "<|fim_suffix|>"])) is None


def test_prompt_lookup_drafts_from_the_suffix_and_the_other_files(shared_tokenizer):
    """The suffix and the extra context are in the prompt's tokens, so a middle that begins to
    echo either is continued from there by prompt lookup."""
    from mlxspec.engine.drafters.pld import PromptLookupDrafter

    tok = _hf(shared_tokenizer, QWEN)
    layout = fim.detect(tok)
    suffix, other = "    return total + count\n", "class Parser:\n    def parse(self, text):\n"
    ids = fim.prompt_ids(tok, layout, "def f(total, count):\n", suffix, extra=[("p.py", other)])
    for echoed in (_ids(tok, suffix), _ids(tok, other)):
        assert len(echoed) >= 7
        drafter = PromptLookupDrafter()
        drafter.start(ids)
        assert drafter.lookup(ids + echoed[:3], 4) == echoed[3:7]


# -- end to end ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def fim_checkpoint(shared_tokenizer, tmp_path_factory):
    """tiny_qwen3's shape with the shared tokenizer plus Qwen's FIM tokens (in tokenizer.json's
    added tokens and tokenizer_config's added_tokens_decoder, as Qwen's files have them)."""
    folder = tiny.with_special_tokens(shared_tokenizer, tmp_path_factory.mktemp("fim_tokenizer"), QWEN)
    return tiny.write_checkpoint(tmp_path_factory.mktemp("tiny_fim"), "qwen3", tokenizer=folder, seed=1)


@pytest.fixture(scope="module")
def fim_spec(fim_checkpoint):
    return load(str(fim_checkpoint))


@pytest.fixture(scope="module")
def served(fim_spec):
    app = create_app(fim_spec, Settings(model_name="tiny", max_tokens_cap=64))
    with running(app) as url:
        yield url


@pytest.fixture(scope="module")
def plain(tiny_qwen3):
    app = create_app(load(str(tiny_qwen3)), Settings(model_name="tiny", max_tokens_cap=64))
    with running(app) as url:
        yield url


def _reference(spec, extra=None) -> str:
    """Plain decoding (drafter none, no prefix cache) of the FIM prompt, cut at the layout's tokens."""
    layout = fim.require(spec.tokenizer)
    ids = fim.prompt_ids(spec.tokenizer, layout, PREFIX, SUFFIX, extra=extra)
    r = spec.generate(ids, max_tokens=N, temperature=0, drafter="none", reuse=False)
    assert r.stats.drafted == 0 and r.text
    cuts = [r.text.find(s) for s in fim.stop_texts(spec.tokenizer, layout) if s in r.text]
    return r.text[:min(cuts)] if cuts else r.text


PLD = {"drafter": "pld", "depth": 3}


def test_infill_is_plain_decoding_of_the_fim_prompt_and_prompt_lookup_drafts(served, fim_spec):
    extra = [{"filename": "a.py", "text": PREFIX + SUFFIX, "time": 1}]
    body = {"input_prefix": PREFIX, "input_suffix": SUFFIX, "input_extra": extra, "n_predict": N,
            "temperature": 0, "speculation": PLD, "cache_prompt": True}
    r = httpx.post(served + "/infill", json=body, timeout=60)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["content"] == _reference(fim_spec, extra=[("a.py", PREFIX + SUFFIX)])
    assert out["stop"] is True and out["tokens_predicted"] >= 1 and out["tokens_evaluated"] > 20
    assert out["stop_type"] in ("limit", "eos") and "predicted_per_second" in out["timings"]
    assert out["speculation"]["drafter"] == "pld" and out["speculation"]["drafted"] > 0


def test_infill_streams_llama_cpp_chunks(served, fim_spec):
    body = {"input_prefix": PREFIX, "input_suffix": SUFFIX, "n_predict": N, "temperature": 0, "stream": True}
    with httpx.stream("POST", served + "/infill", json=body, timeout=60) as r:
        assert r.status_code == 200
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    assert all(e["stop"] is False for e in events[:-1]) and events[-1]["stop"] is True
    assert "".join(e["content"] for e in events) == _reference(fim_spec, extra=[])


def test_completions_suffix_and_ollama_generate_suffix_are_the_same_fill(served, fim_spec):
    want = _reference(fim_spec)
    r = httpx.post(served + "/v1/completions", json={"prompt": PREFIX, "suffix": SUFFIX, "max_tokens": N,
                                                     "temperature": 0, "speculation": PLD}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == want
    assert r.json()["usage"]["speculation"]["drafted"] > 0
    r = httpx.post(served + "/api/generate", json={"model": "tiny", "prompt": PREFIX, "suffix": SUFFIX,
                                                   "stream": False, "speculation": PLD,
                                                   "options": {"temperature": 0, "num_predict": N}}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["response"] == want


def test_a_model_without_fim_tokens_is_a_400(plain):
    cases = [("/infill", {"input_prefix": "a", "input_suffix": "b"}),
             ("/v1/completions", {"prompt": "a", "suffix": "b"}),
             ("/api/generate", {"model": "tiny", "prompt": "a", "suffix": "b", "stream": False})]
    for path, body in cases:
        r = httpx.post(plain + path, json=body, timeout=60)
        assert r.status_code == 400, (path, r.text)
        assert "no fill-in-the-middle tokens" in r.text, r.text


def test_infill_refuses_what_it_does_not_take(served):
    r = httpx.post(served + "/infill", json={"input_prefix": "a", "input_suffix": "b", "n_predcit": 3})
    assert r.status_code == 400 and "n_predcit" in r.json()["error"]["message"]
    assert "did you mean n_predict?" in r.json()["error"]["message"]
    r = httpx.post(served + "/infill", json={"input_prefix": "a", "input_suffix": "b",
                                             "input_extra": [{"text": "x", "name": "a.py"}]})
    assert r.status_code == 400 and "name" in r.json()["error"]["message"]
    r = httpx.post(served + "/infill", json={"input_suffix": "b"})
    assert r.status_code == 400 and "input_prefix" in r.text
    r = httpx.post(served + "/v1/completions", json={"prompt": [1, 2], "suffix": "b"})
    assert r.status_code == 400 and "text prompt" in r.text
    r = httpx.post(served + "/infill", json={"input_prefix": "a", "input_suffix": "b", "n_predict": 3, "stop": [""]})
    assert r.status_code == 400 and "stop.0 is empty" in r.json()["error"]["message"]


def test_fuzzed_infill_bodies_get_no_5xx(fim_spec):
    """test_server_fuzz's fuzzer over /infill (fuzz_bodies.INFILL) on the FIM checkpoint: no 5xx,
    shaped errors, the kept-alive connection serves on, and some bodies are served."""
    from fuzz_bodies import MODEL
    from test_server_fuzz import fuzz

    app = create_app(fim_spec, Settings(model_name=MODEL, max_tokens_cap=4))
    with running(app) as url:
        statuses, failures = fuzz(int(url.rsplit(":", 1)[1]), "/infill", 120)
    assert not failures, "\n".join(failures[:12])
    assert sum(v for k, v in statuses.items() if k < 300) >= 12, statuses


def test_fim_tokens_past_the_models_embedding_are_not_used(fim_spec, monkeypatch):
    """A tokenizer that adds FIM tokens the model's embedding has no rows for: no FIM (a 400),
    never ids past the vocabulary."""
    from mlxspec.server.fim import layout

    class Target:
        vocab_size = fim.require(fim_spec.tokenizer).prefix  # the FIM ids are past it

    class Server:
        spec = type("Spec", (), {"tokenizer": fim_spec.tokenizer, "target": Target})()

    with pytest.raises(Exception, match="no fill-in-the-middle tokens"):
        layout(Server(), "suffix")
