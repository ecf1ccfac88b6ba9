"""Train the mini model family (benchmarks/models/) with PyTorch on the GPU machine.

Three models share one byte-level BPE tokenizer trained on the corpus (scripts/mini_corpus.py):
  mini-hybrid  Qwen3.5 hybrid (Qwen3_5ForConditionalGeneration schema: GatedDeltaNet layers with a
               full-attention layer every 4th) plus its native MTP head (`mtp.*`), trained jointly:
               the head predicts token t+2 from the trunk's final-norm hidden at t and token t+1.
  mini-attn    the same config with `full_attention_interval: 1` (every layer full attention),
               same tensor layout and MTP head: what the hybrid costs without a per-token GDN loop.
  mini-draft   a much smaller dense Qwen3 model, the draft for both.

The command that made the committed checkpoints (one GPU, three trainings side by side):

    python3 scripts/train_mini.py all --work /tmp/mini --out OUT --minutes 6 --seed 0

`all` = `prep` (corpus, split, tokenizer, token files) then `train hybrid|attn|draft` in parallel.
`--steps N` fixes the step count instead of the time budget (the count each run reached is in
OUT/<model>/train_metrics.json, so `--steps` reproduces a run exactly up to GPU nondeterminism).
Checkpoints are written in bf16 in the real Hugging Face layout, with reference.json: fp32
logits (trunk and MTP head) of a held-out snippet, which the CPU tests compare MLX against.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import mini_corpus  # noqa: E402
from tiny import (  # noqa: E402  (numpy-only module)
    EOS_TOKEN,
    PAD_TOKEN,
    TOKENIZER_FILES,
    make_config,
    tokenizer_info,
    write_config_files,
)

# Sizes: ~2.5M (targets) and ~0.8M (draft) parameters; bf16 checkpoints ~12 MiB together.
HYBRID = dict(hidden_size=128, num_hidden_layers=8, intermediate_size=384, num_attention_heads=2,
              num_key_value_heads=1, head_dim=64, linear_key_head_dim=32, linear_value_head_dim=32,
              linear_num_key_heads=2, linear_num_value_heads=4, full_attention_interval=4,
              tie_word_embeddings=True, max_position_embeddings=4096,
              rope_parameters={"mrope_interleaved": True, "mrope_section": [3, 3, 2],
                               "rope_type": "default", "rope_theta": 10000000,
                               "partial_rotary_factor": 0.25})
MODELS = {
    "hybrid": ("qwen3_5", HYBRID),
    "attn": ("qwen3_5", {**HYBRID, "full_attention_interval": 1}),
    "draft": ("qwen3", dict(hidden_size=128, num_hidden_layers=2, intermediate_size=256,
                            num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                            tie_word_embeddings=True)),
}
MTP_WEIGHT = 0.5


# ---------------------------------------------------------------------------
# Models


class QwenMTP(nn.Module):
    """The Qwen3.5 MTP block: fc(cat[norm_e(embed(x_{t+1})), norm_h(h_t)]) -> a full-attention
    decoder layer -> norm; logits through the trunk's (tied) lm_head. Names = checkpoint names."""

    def __init__(self, config):
        super().__init__()
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer, Qwen3_5RMSNorm

        h, eps = config.hidden_size, config.rms_norm_eps
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.pre_fc_norm_embedding = Qwen3_5RMSNorm(h, eps=eps)
        self.pre_fc_norm_hidden = Qwen3_5RMSNorm(h, eps=eps)
        full = config.layer_types.index("full_attention")
        self.layers = nn.ModuleList([Qwen3_5DecoderLayer(config, full)])
        self.norm = Qwen3_5RMSNorm(h, eps=eps)

    def forward(self, embeds, hidden, position_embeddings):
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)], -1))
        x = self.layers[0](x, position_embeddings=position_embeddings, attention_mask=None)
        return self.norm(x)


class Mini(nn.Module):
    def __init__(self, kind: str, vocab: int, eos_ids: list[int], pad_id: int):
        super().__init__()
        arch, sizes = MODELS[kind]
        self.kind, self.arch = kind, arch
        self.hf_config = make_config(arch, vocab, eos_ids, pad_id, **sizes)
        if arch == "qwen3_5":
            from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

            text = {k: v for k, v in self.hf_config["text_config"].items() if k != "model_type"}
            self.config = Qwen3_5TextConfig(**text)
            self.lm = Qwen3_5ForCausalLM(self.config)
            self.mtp = QwenMTP(self.config)
            self.mtp.apply(self.lm._init_weights)
        else:
            from transformers import Qwen3Config, Qwen3ForCausalLM

            cfg = {k: v for k, v in self.hf_config.items() if k not in ("architectures", "model_type")}
            self.config = Qwen3Config(**cfg)
            self.lm = Qwen3ForCausalLM(self.config)
            self.mtp = None

    def losses(self, ids: torch.Tensor) -> dict:
        """ids (B, L+1): next-token loss over L positions; MTP loss for t+2 over L-1 pairs."""
        x = ids[:, :-1]
        hidden = self.lm.model(input_ids=x).last_hidden_state
        logits = self.lm.lm_head(hidden)
        out = {"lm": F.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten())}
        if self.mtp is not None:
            n = x.shape[1] - 1
            pos = torch.arange(n, device=ids.device).view(1, 1, -1).expand(3, ids.shape[0], -1)
            pe = self.lm.model.rotary_emb(hidden, pos)
            head = self.mtp(self.lm.model.embed_tokens(ids[:, 1:-1]), hidden[:, :-1], pe)
            mlogits = self.lm.lm_head(head)
            out["mtp"] = F.cross_entropy(mlogits.flatten(0, 1).float(), ids[:, 2:].flatten())
            out["mtp_acc"] = (mlogits.argmax(-1) == ids[:, 2:]).float().mean()
        out["acc"] = (logits.argmax(-1) == ids[:, 1:]).float().mean()
        return out

    def hf_tensors(self) -> dict[str, torch.Tensor]:
        """The checkpoint's tensors under their real names (tied lm_head left out)."""
        out = {}
        for k, v in self.lm.state_dict().items():
            if k == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            if self.arch == "qwen3_5" and k.startswith("model."):
                k = "model.language_model." + k[len("model."):]
            out[k] = v
        if self.mtp is not None:
            out.update({"mtp." + k: v for k, v in self.mtp.state_dict().items()})
        return out


# ---------------------------------------------------------------------------
# Training


def batches(data: torch.Tensor, batch: int, length: int, gen: torch.Generator):
    span = torch.arange(length + 1, device=data.device)
    while True:
        starts = torch.randint(0, len(data) - length - 1, (batch,), generator=gen, device="cpu")
        yield data[starts.to(data.device)[:, None] + span].long()


def learning_rate(step: int, total: int, peak: float, warmup: int = 100) -> float:
    """Linear warm-up (at most a tenth of a short run), then cosine decay to 10% of PEAK."""
    warmup = min(warmup, max(1, total // 10))
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


@torch.no_grad()
def evaluate(model: Mini, data: torch.Tensor, length: int, n: int = 64, batch: int = 16) -> dict:
    model.eval()
    starts = np.linspace(0, len(data) - length - 2, n).astype(np.int64)
    sums: dict[str, float] = {}
    span = torch.arange(length + 1, device=data.device)
    for i in range(0, n, batch):
        s = torch.as_tensor(starts[i : i + batch], device=data.device)
        with autocast(data.device):
            out = model.losses(data[s[:, None] + span].long())
        for k, v in out.items():
            sums[k] = sums.get(k, 0.0) + float(v) * len(s)
    model.train()
    res = {f"heldout_{k}": round(v / n, 4) for k, v in sums.items()}
    res["heldout_ppl"] = round(math.exp(res["heldout_lm"]), 3)
    return res


def autocast(device: torch.device):
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")


def train(kind: str, work: Path, out: Path, minutes: float, steps: int | None, seed: int,
          batch: int, length: int, lr: float) -> dict:
    torch.manual_seed(seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    vocab, special = tokenizer_info(work / "tokenizer")
    eos_ids = [special[EOS_TOKEN], special[PAD_TOKEN]]
    model = Mini(kind, vocab, eos_ids, special[PAD_TOKEN]).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    train_data = torch.from_numpy(np.fromfile(work / "train.bin", dtype=np.uint16).astype(np.int32)).to(device)
    held_data = torch.from_numpy(np.fromfile(work / "heldout.bin", dtype=np.uint16).astype(np.int32)).to(device)
    decay = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.95), fused=device.type == "cuda")
    gen = torch.Generator().manual_seed(seed)
    stream = batches(train_data, batch, length, gen)
    budget = minutes * 60
    total = steps or 10**9
    t0 = time.perf_counter()
    log = []
    step = 0
    while step < total:
        for g in opt.param_groups:
            g["lr"] = learning_rate(step, total, lr)
        with autocast(device):
            parts = model.losses(next(stream))
            loss = parts["lm"] + MTP_WEIGHT * parts.get("mtp", 0.0)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if steps is None and step == 30:  # fix the schedule's length from the measured step time
            per_step = (time.perf_counter() - t0) / step
            total = max(200, int(budget / per_step))
            print(f"[{kind}] {per_step * 1000:.0f} ms/step -> {total} steps", flush=True)
        if step % 200 == 0 or step == total:
            row = {"step": step, "s": round(time.perf_counter() - t0, 1),
                   **{k: round(float(v.detach()), 4) for k, v in parts.items()}}
            log.append(row)
            print(f"[{kind}] {row}", flush=True)
    metrics = {"model": f"mini-{kind}", "params": n_params, "steps": step, "batch": batch,
               "seq_len": length, "tokens_seen": step * batch * length, "lr": lr, "seed": seed,
               "train_seconds": round(time.perf_counter() - t0, 1), "device": str(device),
               "torch": torch.__version__, "mtp_weight": MTP_WEIGHT if model.mtp is not None else None,
               "final_train": log[-1] if log else None, **evaluate(model, held_data, length)}
    export(model, work, out / f"mini-{kind}", held_data)
    (out / f"mini-{kind}" / "train_metrics.json").write_text(json.dumps({**metrics, "log": log}, indent=1))
    print(f"[{kind}] done {json.dumps({k: v for k, v in metrics.items() if k != 'final_train'})}", flush=True)
    return metrics


# ---------------------------------------------------------------------------
# Export


@torch.no_grad()
def reference(model: Mini, tokens: list[int], top: int = 8) -> dict:
    """fp32 logits of the bf16-rounded weights: top-TOP ids and values at every position."""
    model = model.float().eval()
    for p in model.parameters():  # weights as stored (bf16); buffers (RoPE frequencies) stay fp32
        p.data = p.data.to(torch.bfloat16).float()
    ids = torch.tensor([tokens], device=next(model.parameters()).device)
    hidden = model.lm.model(input_ids=ids).last_hidden_state
    logits = model.lm.lm_head(hidden)[0]
    ref = {"tokens": tokens, "trunk": _top(logits, top)}
    if model.mtp is not None:
        n = len(tokens) - 1
        pos = torch.arange(n, device=ids.device).view(1, 1, -1).expand(3, 1, -1)
        pe = model.lm.model.rotary_emb(hidden, pos)
        head = model.mtp(model.lm.model.embed_tokens(ids[:, 1:]), hidden[:, :-1], pe)
        ref["mtp"] = _top(model.lm.lm_head(head)[0], top)
    return ref


def _top(logits: torch.Tensor, k: int) -> list[dict]:
    v, i = logits.topk(k, dim=-1)
    return [{"ids": a.tolist(), "logits": [round(x, 5) for x in b.tolist()]} for a, b in zip(i, v)]


def export(model: Mini, work: Path, out: Path, held_data: torch.Tensor) -> None:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    if model.arch == "qwen3_5":
        model.hf_config["text_config"]["dtype"] = "bfloat16"
    else:
        model.hf_config["torch_dtype"] = "bfloat16"
    tensors = {k: v.detach().to(torch.bfloat16).contiguous().cpu() for k, v in model.hf_tensors().items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    eos_ids = model.hf_config.get("eos_token_id") or model.hf_config["text_config"]["eos_token_id"]
    eos_ids = eos_ids if isinstance(eos_ids, list) else [eos_ids, model.config.pad_token_id]
    write_config_files(out, model.hf_config, eos_ids, model.config.pad_token_id)
    for name in TOKENIZER_FILES:
        (out / name).write_bytes((work / "tokenizer" / name).read_bytes())
    snippet = held_data[1000:1048].tolist()
    (out / "reference.json").write_text(json.dumps(reference(model, snippet)))


def rereference(folder: Path) -> None:
    """Recompute FOLDER/reference.json on the CPU in fp32 from the exported checkpoint itself
    (GPU references carry TF32 rounding; this one is what the MLX tests compare against)."""
    from safetensors.torch import load_file

    config = json.loads((folder / "config.json").read_text())
    kind = "draft" if config["model_type"] == "qwen3" else (
        "attn" if config["text_config"]["full_attention_interval"] == 1 else "hybrid")
    vocab, special = tokenizer_info(folder)
    model = Mini(kind, vocab, [special[EOS_TOKEN], special[PAD_TOKEN]], special[PAD_TOKEN])
    tensors = load_file(str(folder / "model.safetensors"))
    lm = {("model." + k[len("model.language_model."):]) if k.startswith("model.language_model.") else k: v
          for k, v in tensors.items() if not k.startswith("mtp.")}
    missing, unexpected = model.lm.load_state_dict(lm, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    if model.mtp is not None:
        model.mtp.load_state_dict({k[len("mtp."):]: v for k, v in tensors.items() if k.startswith("mtp.")})
    tokens = json.loads((folder / "reference.json").read_text())["tokens"]
    (folder / "reference.json").write_text(json.dumps(reference(model.float(), tokens)))


# ---------------------------------------------------------------------------
# CLI


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["prep", "train", "all", "reference"])
    ap.add_argument("kind", nargs="?", help="train: hybrid, attn or draft; reference: a model folder")
    ap.add_argument("--work", type=Path, default=Path("/tmp/mini"))
    ap.add_argument("--out", type=Path, default=Path("benchmarks/models"))
    ap.add_argument("--minutes", type=float, default=6.0, help="training time budget per model")
    ap.add_argument("--steps", type=int, help="fixed step count (overrides --minutes)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--max-train-mb", type=float, default=150.0)
    ap.add_argument("--edit-fraction", type=float, default=0.1)
    a = ap.parse_args(argv)
    if a.what in ("prep", "all"):
        t = time.perf_counter()
        manifest = mini_corpus.build(a.work, a.vocab, a.max_train_mb, a.edit_fraction, a.seed)
        print(f"prep {time.perf_counter() - t:.0f}s {json.dumps(manifest)}", flush=True)
    if a.what == "reference":
        rereference(Path(a.kind))
    if a.what == "train":
        if a.kind not in MODELS:
            ap.error(f"train needs a model kind: {', '.join(sorted(MODELS))}")
        train(a.kind, a.work, a.out, a.minutes, a.steps, a.seed, a.batch, a.seq_len, a.lr)
    if a.what == "all":
        common = ["--work", str(a.work), "--out", str(a.out), "--minutes", str(a.minutes),
                  "--seed", str(a.seed), "--batch", str(a.batch), "--seq-len", str(a.seq_len),
                  "--lr", str(a.lr)] + (["--steps", str(a.steps)] if a.steps else [])
        procs = [subprocess.Popen([sys.executable, __file__, "train", k, *common], env=os.environ)
                 for k in sorted(MODELS)]
        codes = [p.wait() for p in procs]
        if any(codes):
            sys.exit(f"training failed: exit codes {codes}")


if __name__ == "__main__":
    main()
