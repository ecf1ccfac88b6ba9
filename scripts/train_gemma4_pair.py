"""Train the mini Gemma-4 pair (benchmarks/models/mini-gemma4 and mini-gemma4-assistant) with
PyTorch and transformers' own Gemma-4 classes, on the corpus of scripts/train_mini.py.

  mini-gemma4            gemma4_text (Gemma4ForCausalLM), ~2.8M parameters: 6 layers in Gemma-4's
                         sliding/full pattern (S S F S S F, window 128, proportional partial RoPE on
                         the full layers, wider global heads), the last 2 layers reuse the K/V of the
                         last eligible sliding (3) and full (2) layers as E2B/E4B do, per-layer inputs,
                         double-wide MLPs on the shared layers, logit soft-capping.
  mini-gemma4-assistant  gemma4_assistant (Gemma4AssistantForCausalLM), ~0.57M parameters: the real
                         assistant layout (4 layers S S S F whose attention computes queries only over
                         the target's K/V, pre/post projection, tied dense head; the sparse centroid
                         head of E2B/E4B is left out: a 4,096-token vocabulary gains nothing from it).

One loop trains both. The target learns next-token prediction; the assistant is distilled online
from it, teacher-forced the way the drafter runs it: for every position t of a batch, step j
(j < BLOCK) reads the target's embedding of token t+j joined with the hidden state of the step
before (the target's final-norm hidden state at t-1 for step 0), its queries at RoPE position t
over the target's K/V of positions < t (the last `sliding_window` of them on sliding layers), and
is trained toward the target's distribution at t+j (cross-entropy to its softmax). The assistant's
inputs are detached: its loss never moves the target.

The command for the GPU machine (device tool: one H100; files come back from $OUT; about 8 minutes:
prep ~30 s, training --minutes, evaluation and export well under a minute):

    python3 scripts/train_gemma4_pair.py --prep --work /tmp/mini --out "$OUT" --minutes 6 --seed 0 \
        2>&1 | tee "$OUT/train_gemma4.log"

then copy $OUT/mini-gemma4 and $OUT/mini-gemma4-assistant to benchmarks/models/ (the corpus
manifest of the run is mini-gemma4/corpus_manifest.json). Without --prep
it reads the token files of `scripts/train_mini.py prep --work DIR` (the same corpus, split and
tokenizer recipe). `--steps N` fixes the step count instead of the time budget (each folder's
train_metrics.json has the count reached). Checkpoints are bf16, in the real Hugging Face layout
and config schema (~6.8 MB together); reference.json in each holds fp32 CPU logits of the stored
weights on a held-out snippet (target: every position; assistant: a greedy block drafted by
transformers' own Gemma4AssistantForCausalLM.forward), which tests/test_mini_gemma4.py compares
MLX against. Needs a transformers with gemma4_assistant (5.23, the .venv's, has it).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import tiny_gemma4  # noqa: E402  (numpy-only module; mlx only inside its writers)
from tiny import EOS_TOKEN, PAD_TOKEN, TOKENIZER_FILES, tokenizer_info, write_config_files  # noqa: E402
from train_mini import autocast, batches, learning_rate  # noqa: E402  (the same schedule and sampling)

TARGET_NAME, ASSISTANT_NAME = "mini-gemma4", "mini-gemma4-assistant"
S, FULL = "sliding_attention", "full_attention"
TARGET = dict(hidden_size=128, intermediate_size=512, num_hidden_layers=6, layer_types=[S, S, FULL, S, S, FULL],
              num_attention_heads=4, num_key_value_heads=1, head_dim=32, global_head_dim=64,
              num_kv_shared_layers=2, hidden_size_per_layer_input=16, use_double_wide_mlp=True,
              sliding_window=128, final_logit_softcapping=30.0)
ASSISTANT_TEXT = dict(hidden_size=64, intermediate_size=256, num_attention_heads=4)  # layers: tiny_gemma4's
BLOCK = 4  # drafting steps trained (the real assistants draft 2-8)
REFERENCE_LEN = 160  # longer than the sliding window: the reference's shared K/V are cut by it


def require_transformers():
    import transformers

    try:
        from transformers import Gemma4AssistantForCausalLM, Gemma4ForCausalLM  # noqa: F401
    except ImportError:
        sys.exit(f"error: transformers {transformers.__version__} has no Gemma 4 assistant "
                 "(gemma4_assistant); 5.23 has it")
    from transformers.models.gemma4.configuration_gemma4 import Gemma4TextConfig

    if hasattr(Gemma4TextConfig, "kv_sharing_modes"):
        from make_gemma4_reference import allow_all_shared

        allow_all_shared()


def make_configs(vocab: int, eos_ids: list[int], pad_id: int) -> tuple[dict, dict]:
    """config.json of the target and of its assistant (the schema of tests/tiny_gemma4.py)."""
    target = tiny_gemma4.target_config(vocab, eos_ids, pad_id, **copy.deepcopy(TARGET))
    assistant = tiny_gemma4.assistant_config(target, sparse=False)
    assistant["text_config"].update(ASSISTANT_TEXT)
    return target, assistant


def build_models(target_config: dict, assistant_config: dict):
    """transformers' Gemma4ForCausalLM and Gemma4AssistantForCausalLM from the two configs."""
    from transformers import (
        Gemma4AssistantConfig,
        Gemma4AssistantForCausalLM,
        Gemma4ForCausalLM,
        Gemma4TextConfig,
    )

    target = Gemma4ForCausalLM._from_config(Gemma4TextConfig.from_dict(copy.deepcopy(target_config)),
                                            attn_implementation="sdpa")
    assistant = Gemma4AssistantForCausalLM._from_config(
        Gemma4AssistantConfig.from_dict(copy.deepcopy(assistant_config)), attn_implementation="sdpa")
    return target, assistant


# ---------------------------------------------------------------------------
# The drafting computation, teacher-forced over every position at once


def drafting_masks(n_keys: int, window: int, device) -> dict[str, torch.Tensor]:
    """Query row i drafts at position t = i + 1 and may see keys k < t (full layers) or the last
    WINDOW of them (sliding: what mlx-lm's ring holds after 1-token steps). True = attend."""
    q = torch.arange(n_keys - 1, device=device)[:, None]
    k = torch.arange(n_keys, device=device)[None, :]
    return {FULL: (k <= q)[None, None], S: ((k <= q) & (k > q - window))[None, None]}


def drafting_logits(target, assistant, x: torch.Tensor, block: int = BLOCK) -> dict:
    """x (B, L) tokens. The target's logits (B, L, V) and, for step j < BLOCK, the assistant's
    logits (B, L-1-j, V) at drafting positions t = 1 .. L-1-j, step j fed token t+j (row t-1)."""
    out = target(input_ids=x, return_shared_kv_states=True, output_hidden_states=True, use_cache=False)
    shared = {kind: (k.detach(), v.detach()) for kind, (k, v) in out.shared_kv_states.items()}
    embeds = target.get_input_embeddings()(x).detach()  # scaled by sqrt(hidden), as the drafter does
    h = out.hidden_states[-1][:, :-1].detach()  # final-norm hidden state at t-1
    length = x.shape[1]
    masks = drafting_masks(length, assistant.config.get_text_config().sliding_window, x.device)
    positions = torch.arange(1, length, device=x.device)[None].expand(x.shape[0], -1)
    steps = []
    for j in range(block):
        n = length - 1 - j
        inputs = assistant.pre_projection(torch.cat([embeds[:, 1 + j:], h[:, :n]], dim=-1))
        # output_hidden_states: keeps transformers from slicing the queries before the kv-shared
        # layers (its decoding shortcut; every layer of an assistant is one, it has no per-layer input)
        hidden = assistant.model(inputs_embeds=inputs, position_ids=positions[:, :n], use_cache=False,
                                 attention_mask={kind: m[:, :, :n] for kind, m in masks.items()},
                                 shared_kv_states=shared, output_hidden_states=True).last_hidden_state
        steps.append(assistant.lm_head(hidden))
        h = assistant.post_projection(hidden)
    return {"target": out.logits, "steps": steps}


def losses(target, assistant, ids: torch.Tensor, block: int = BLOCK) -> dict:
    """ids (B, L+1): the target's next-token loss over L positions; the assistant's distillation
    loss (mean over steps) and its top-1 agreement with the target per step; `accepted`: tokens
    a greedy block of BLOCK drafts would keep on average, teacher-forced."""
    x = ids[:, :-1]
    res = drafting_logits(target, assistant, x, block)
    logits = res["target"]
    out = {"lm": F.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten()),
           "acc": (logits.argmax(-1) == ids[:, 1:]).float().mean()}
    teacher = logits.detach().float()
    probs, best = teacher.softmax(-1), teacher.argmax(-1)
    distill, agree = [], []
    for j, step in enumerate(res["steps"]):
        rows = slice(1 + j, None)  # the target's distribution at t + j
        distill.append(-(probs[:, rows] * step.float().log_softmax(-1)).sum(-1).mean())
        agree.append(step.argmax(-1) == best[:, rows])
        out[f"agree{j}"] = agree[-1].float().mean()
    out["distill"] = torch.stack(distill).mean()
    n = agree[-1].shape[1]  # positions with every step labelled
    kept = torch.stack([a[:, :n] for a in agree]).float().cumprod(0)
    out["accepted"] = kept.sum(0).mean()
    return out


# ---------------------------------------------------------------------------
# Training


@torch.no_grad()
def evaluate(target, assistant, data: torch.Tensor, length: int, windows: int, batch: int = 16) -> dict:
    target.eval()
    assistant.eval()
    starts = np.linspace(0, len(data) - length - 2, windows).astype(np.int64)
    span = torch.arange(length + 1, device=data.device)
    sums: dict[str, float] = {}
    for i in range(0, windows, batch):
        s = torch.as_tensor(starts[i: i + batch], device=data.device)
        with autocast(data.device):
            out = losses(target, assistant, data[s[:, None] + span].long())
        for k, v in out.items():
            sums[k] = sums.get(k, 0.0) + float(v) * len(s)
    target.train()
    assistant.train()
    res = {f"heldout_{k}": round(v / windows, 4) for k, v in sums.items()}
    res["heldout_ppl"] = round(math.exp(res["heldout_lm"]), 3)
    return res


def _load_tokens(path: Path, device) -> torch.Tensor:
    return torch.from_numpy(np.fromfile(path, dtype=np.uint16).astype(np.int32)).to(device)


def _optimizer(modules, lr: float, fused: bool):
    params = [p for m in modules for p in m.parameters()]
    decay = [p for p in params if p.ndim >= 2]
    rest = [p for p in params if p.ndim < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.95), fused=fused)


def train(work: Path, out: Path, minutes: float, steps: int | None, seed: int, batch: int, length: int,
          lr: float, eval_windows: int = 64) -> dict:
    require_transformers()
    torch.manual_seed(seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    vocab, special = tokenizer_info(work / "tokenizer")
    target_config, assistant_config = make_configs(vocab, [special[EOS_TOKEN], special[PAD_TOKEN]],
                                                   special[PAD_TOKEN])
    target, assistant = build_models(target_config, assistant_config)
    target.to(device).train()
    assistant.to(device).train()
    train_data = _load_tokens(work / "train.bin", device)
    held_data = _load_tokens(work / "heldout.bin", device)
    opt = _optimizer((target, assistant), lr, fused=device.type == "cuda")
    gen = torch.Generator().manual_seed(seed)
    stream = batches(train_data, batch, length, gen)
    budget, total = minutes * 60, steps or 10**9
    t0, log, step = time.perf_counter(), [], 0
    while step < total:
        for g in opt.param_groups:
            g["lr"] = learning_rate(step, total, lr)
        with autocast(device):
            parts = losses(target, assistant, next(stream))
            loss = parts["lm"] + parts["distill"]  # disjoint parameters: each its own gradient
        opt.zero_grad(set_to_none=True)
        loss.backward()
        for m in (target, assistant):  # clipped apart, so one's spikes do not scale the other down
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        opt.step()
        step += 1
        if steps is None and step == 30:  # fix the schedule's length from the measured step time
            per_step = (time.perf_counter() - t0) / step
            total = max(200, int(budget / per_step))
            print(f"[gemma4] {per_step * 1000:.0f} ms/step -> {total} steps", flush=True)
        if step % 200 == 0 or step == total:
            row = {"step": step, "s": round(time.perf_counter() - t0, 1),
                   **{k: round(float(v.detach()), 4) for k, v in parts.items()}}
            log.append(row)
            print(f"[gemma4] {row}", flush=True)
    metrics = {"models": [TARGET_NAME, ASSISTANT_NAME],
               "params": {TARGET_NAME: _count(target), ASSISTANT_NAME: _count(assistant)},
               "steps": step, "batch": batch, "seq_len": length, "tokens_seen": step * batch * length,
               "lr": lr, "seed": seed, "block": BLOCK, "train_seconds": round(time.perf_counter() - t0, 1),
               "device": str(device), "torch": torch.__version__, "transformers": _transformers_version(),
               "final_train": log[-1] if log else None,
               **evaluate(target, assistant, held_data, length, eval_windows)}
    snippet = _snippet(held_data)
    for name, model, config in ((TARGET_NAME, target, target_config),
                                (ASSISTANT_NAME, assistant, assistant_config)):
        export(model, config, work / "tokenizer", out / name)
    write_references(target, assistant, snippet, out / TARGET_NAME, out / ASSISTANT_NAME)
    if (work / "manifest.json").is_file():  # which corpus this run read (prep writes it)
        (out / TARGET_NAME / "corpus_manifest.json").write_text((work / "manifest.json").read_text())
    for name in (TARGET_NAME, ASSISTANT_NAME):
        (out / name / "train_metrics.json").write_text(json.dumps({**metrics, "log": log}, indent=1))
    print(f"[gemma4] done {json.dumps({k: v for k, v in metrics.items() if k != 'final_train'})}", flush=True)
    return metrics


def _count(model) -> int:
    return sum(p.numel() for p in model.parameters())


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


def _snippet(held: torch.Tensor) -> list[int]:
    start = max(0, min(1000, len(held) - REFERENCE_LEN - 1))
    return held[start: start + REFERENCE_LEN].tolist()


# ---------------------------------------------------------------------------
# Export


def export(model, config: dict, tokenizer: Path, out: Path) -> None:
    """bf16 safetensors under transformers' own names (the tied LM head left out), config.json
    (+ generation_config.json for the target) and the tokenizer files."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    config = {**config, "torch_dtype": "bfloat16"}
    tensors = {k: v.detach().to(torch.bfloat16).contiguous().cpu() for k, v in model.state_dict().items()
               if k != "lm_head.weight"}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    if config["model_type"] == "gemma4_assistant":
        (out / "config.json").write_text(json.dumps(config, indent=2))
    else:
        write_config_files(out, config, config["eos_token_id"], config["pad_token_id"])
    for name in TOKENIZER_FILES:
        (out / name).write_bytes((tokenizer / name).read_bytes())


def stored(model):
    """A float32 CPU copy of MODEL with its weights rounded as bf16 stores them."""
    model = copy.deepcopy(model).cpu().float().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    return model


@torch.no_grad()
def inference_block(target, assistant, prompt: list[int], block: int = BLOCK, forced: list[int] | None = None):
    """A block drafted as transformers' candidate generator does (Gemma4AssistantForCausalLM's own
    forward): the target fed PROMPT but its last token, the sliding K/V cut to the window the
    target's cache keeps; each step fed the one before's argmax, or FORCED[j] after step j.
    Returns (per-step logits (V,), the argmax of each step)."""
    fed = target(input_ids=torch.tensor([prompt[:-1]]), return_shared_kv_states=True,
                 output_hidden_states=True, use_cache=False)
    window = target.config.sliding_window
    shared = {kind: (k[:, :, -window:], v[:, :, -window:]) if kind == S else (k, v)
              for kind, (k, v) in fed.shared_kv_states.items()}
    h, token = fed.hidden_states[-1][:, -1:], torch.tensor([[prompt[-1]]])
    position = torch.tensor([[len(prompt) - 1]])
    logits, drafted = [], []
    for j in range(block):
        embeds = torch.cat([target.get_input_embeddings()(token), h], dim=-1)
        step = assistant(inputs_embeds=embeds, position_ids=position, shared_kv_states=shared, use_cache=False)
        logits.append(step.logits[0, -1])
        drafted.append(int(step.logits[0, -1].argmax()))
        fed_next = drafted[-1] if forced is None or j >= len(forced) else forced[j]
        token, h = torch.tensor([[fed_next]]), step.last_hidden_state
    return logits, drafted


def _top(logits: torch.Tensor, k: int = 8) -> list[dict]:
    v, i = logits.topk(k, dim=-1)
    return [{"ids": a.tolist(), "logits": [round(x, 5) for x in b.tolist()]} for a, b in zip(i, v)]


@torch.no_grad()
def write_references(target, assistant, tokens: list[int], target_dir: Path, assistant_dir: Path) -> None:
    """fp32 CPU logits of the stored (bf16) weights: the target's top-8 at every position of
    TOKENS; the assistant's top-8 at each step of a greedy block drafted after TOKENS."""
    target, assistant = stored(target), stored(assistant)
    logits = target(input_ids=torch.tensor([tokens]), use_cache=False).logits[0]
    (target_dir / "reference.json").write_text(json.dumps({"tokens": tokens, "trunk": _top(logits)}))
    steps, drafted = inference_block(target, assistant, tokens)
    (assistant_dir / "reference.json").write_text(json.dumps(
        {"tokens": tokens, "drafted": drafted, "steps": _top(torch.stack(steps))}))


# ---------------------------------------------------------------------------
# CLI


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prep", action="store_true", help="build the corpus first (scripts/train_mini.py prep)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/mini"))
    ap.add_argument("--out", type=Path, default=Path("benchmarks/models"))
    ap.add_argument("--minutes", type=float, default=6.0, help="training time budget")
    ap.add_argument("--steps", type=int, help="fixed step count (overrides --minutes)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--eval-windows", type=int, default=64, help="held-out windows evaluated at the end")
    ap.add_argument("--vocab", type=int, default=4096, help="--prep: tokenizer size")
    ap.add_argument("--max-train-mb", type=float, default=150.0, help="--prep: training text read")
    ap.add_argument("--edit-fraction", type=float, default=0.1, help="--prep: share of edit documents")
    a = ap.parse_args(argv)
    if a.prep:
        import mini_corpus

        t = time.perf_counter()
        manifest = mini_corpus.build(a.work, a.vocab, a.max_train_mb, a.edit_fraction, a.seed)
        print(f"prep {time.perf_counter() - t:.0f}s {json.dumps(manifest)}", flush=True)
    if not (a.work / "train.bin").is_file():
        ap.error(f"no token files in {a.work}: run with --prep or scripts/train_mini.py prep --work {a.work}")
    train(a.work, a.out, a.minutes, a.steps, a.seed, a.batch, a.seq_len, a.lr, a.eval_windows)


if __name__ == "__main__":
    main()
