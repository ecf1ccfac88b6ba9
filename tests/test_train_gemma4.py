"""scripts/train_gemma4_pair.py on the CPU: a few steps on a tiny corpus, then what it exports
loads in mlxspec, reproduces the trainer's reference logits, and drafts with the assistant to
exactly plain decoding's output at temperature 0. The teacher-forced drafting the assistant is
trained on must be what transformers' own assistant forward computes one position at a time.
"""

import json
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the trainer needs torch (CPU is enough)")
pytest.importorskip("transformers", reason="the trainer needs transformers' Gemma-4 classes")

import mlx.core as mx  # noqa: E402
from mlx.utils import tree_map  # noqa: E402

import mlxspec  # noqa: E402
from mlxspec.engine.cache import ModelState  # noqa: E402
from mlxspec.engine.speculate import SpeculativeDecoder  # noqa: E402
from mlxspec.models.gemma4_assistant import Gemma4Assistant  # noqa: E402
from tiny import PAD_TOKEN, builtin_corpus, train_tokenizer  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import train_gemma4_pair as trainer  # noqa: E402

try:
    from transformers import Gemma4AssistantForCausalLM  # noqa: F401
except ImportError:
    pytest.skip("this transformers has no gemma4_assistant", allow_module_level=True)

TOL = 1e-3  # fp32 both sides; MLX and torch differ only in summation order


def _tiny_work(work: Path) -> Path:
    """The files `train_mini.py prep` writes, from the built-in corpus: tokenizer, token files."""
    from tokenizers import Tokenizer

    train_tokenizer(builtin_corpus(), 512, work / "tokenizer")
    tok = Tokenizer.from_file(str(work / "tokenizer" / "tokenizer.json"))
    ids = []
    for text in builtin_corpus():
        ids += tok.encode(text, add_special_tokens=False).ids + [tok.token_to_id(PAD_TOKEN)]
    tokens = np.asarray(ids, np.uint16)
    cut = len(tokens) * 3 // 4
    tokens[:cut].tofile(work / "train.bin")
    tokens[cut:].tofile(work / "heldout.bin")
    return work


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    work = _tiny_work(tmp_path_factory.mktemp("g4work"))
    out = tmp_path_factory.mktemp("g4out")
    trainer.main(["--work", str(work), "--out", str(out), "--steps", "3", "--batch", "1", "--seq-len", "96",
                  "--eval-windows", "1"])
    return out / trainer.TARGET_NAME, out / trainer.ASSISTANT_NAME


def _fp32(module):
    module.update(tree_map(lambda p: p.astype(mx.float32), module.parameters()))
    return module


def _worst(logits: mx.array, ref: dict) -> float:
    return float(np.abs(np.array(logits[mx.array(ref["ids"])]) - np.array(ref["logits"])).max())


def test_export_is_loadable_and_matches_the_reference(trained):
    target_dir, assistant_dir = trained
    metrics = json.loads((target_dir / "train_metrics.json").read_text())
    assert metrics["steps"] == 3 and len(metrics["log"]) == 1
    assert 0 <= metrics["heldout_accepted"] <= trainer.BLOCK
    size = sum((d / "model.safetensors").stat().st_size for d in trained)
    assert size < 8 * 2**20  # the committed pair's budget (this one has a 512-token vocabulary)
    model = mlxspec.load(str(target_dir), draft_model=str(assistant_dir))
    assert isinstance(model.draft.model, Gemma4Assistant)
    target, assistant = _fp32(model.target.model), _fp32(model.draft.model)
    ref = json.loads((target_dir / "reference.json").read_text())
    logits = target(mx.array([ref["tokens"]]))[0]
    assert max(_worst(logits[p], r) for p, r in enumerate(ref["trunk"])) < TOL
    ref = json.loads((assistant_dir / "reference.json").read_text())
    assert len(ref["tokens"]) > 128  # longer than the sliding window: the shared K/V are cut
    dec = SpeculativeDecoder(target, draft_model=assistant, drafter="assistant", gates=False)
    drafter = dec.drafter
    state = ModelState(target, keep_hidden=True)
    drafter.bind_target(state)
    drafter.start(ref["tokens"])
    drafter.prefill(ref["tokens"], len(ref["tokens"]) - 1, state.prefill(ref["tokens"][:-1]))
    step = drafter.stepper(len(ref["tokens"]) - 1)
    fed = [ref["tokens"][-1]] + ref["drafted"][:-1]
    rows = [step(i, mx.array([t], mx.uint32))[0] for i, t in enumerate(fed)]
    assert max(_worst(r, s) for r, s in zip(rows, ref["steps"])) < TOL


def test_assistant_output_is_plain_decoding(trained):
    target_dir, assistant_dir = trained
    model = mlxspec.load(str(target_dir), draft_model=str(assistant_dir))
    prompt = json.loads((target_dir / "reference.json").read_text())["tokens"][:140]

    def run(**kw):
        out, stats = [], None
        for toks, stats in SpeculativeDecoder(model.target.model, gates=False, **kw).generate(prompt, max_tokens=24):
            out.extend(toks)
        return out, stats

    plain, _ = run(drafter="none")
    for depth in (1, 4):
        out, stats = run(drafter="assistant", draft_model=model.draft.model, depth=depth)
        assert out == plain, depth
        assert stats.drafter == "assistant" and stats.drafted > 0


def _scrambled(model, seed: int):
    """Weights far from initialisation, so every input and key moves the logits."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5 * (3 if "embed" in name else 1))
            else:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
    return model.eval()


def test_training_drafts_as_the_assistant_forward_does():
    trainer.require_transformers()
    target_config, assistant_config = trainer.make_configs(64, [1, 0], 0)
    target, assistant = trainer.build_models(target_config, assistant_config)
    target, assistant = _scrambled(target, 1), _scrambled(assistant, 2)
    window = target_config["sliding_window"]
    x = torch.randint(3, 64, (1, window + 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        steps = trainer.drafting_logits(target, assistant, x)["steps"]
    tokens = x[0].tolist()
    for t in (3, window - 1, window, window + 1, window + 19):  # inside, at and past the window
        ref, _ = trainer.inference_block(target, assistant, tokens[: t + 1], forced=tokens[t + 1: t + trainer.BLOCK])
        for j, logits in enumerate(ref):
            ours = steps[j][0, t - 1]
            assert torch.allclose(ours, logits, atol=1e-4), (t, j, float((ours - logits).abs().max()))
            assert float(logits.std()) > 0.1  # weights far enough from init for a wrong key to show
    # a mask shifted by one key does show: the check can tell
    masks = trainer.drafting_masks(x.shape[1], window, "cpu")
    shifted = {k: torch.roll(m, 1, dims=-1) for k, m in masks.items()}
    original = trainer.drafting_masks
    trainer.drafting_masks = lambda *a: shifted
    try:
        with torch.no_grad():
            wrong = trainer.drafting_logits(target, assistant, x)["steps"][0][0, window + 18]
    finally:
        trainer.drafting_masks = original
    ref, _ = trainer.inference_block(target, assistant, tokens[: window + 20], forced=[0] * trainer.BLOCK)
    assert not torch.allclose(wrong, ref[0], atol=1e-2)
