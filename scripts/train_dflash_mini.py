"""Train a DFlash block drafter (benchmarks/models/mini-attn-DFlash) for the FROZEN mini target
benchmarks/models/mini-attn, with PyTorch, on the corpus of scripts/train_mini.py.

The drafter is z-lab's DFlashDraftModel layout (what mlxspec/models/dflash.py loads): 2 draft
layers of the target's width (128, MLP 384; 4 query and 4 KV heads of 32 where the target has 2
and 1 of 64: --heads), block size 8, conditioned on the outputs of target layers [1, 5] (z-lab's
build_target_layer_ids for 8 target layers and 2 draft layers). It has no embedding or LM head:
both are the target's, frozen.

Training (the DFlash recipe, teacher-forced on corpus windows): the frozen target runs each
window once; its layer-1 and layer-5 outputs are the context features of every position. In each
window N anchors a are sampled; block j is [token at a, MASK x 7] at RoPE positions a..a+7 and
attends (no causal mask) to the context rows of positions < a and to its own 8 positions, never
to another block (one attention over all blocks, with that mask). Block position i (1..7) is
trained toward the token at a+i with a position weight exp(-(i-1)/gamma) (the paper's decay;
gamma 2 by default, steeper than the paper's 4 for block 8: acceptance is cumulative, so a
drafter of this size gains most at the first positions).
Its label is the frozen target's own next-token distribution there (soft cross-entropy;
--teacher-weight 1, the default): z-lab trains on the target's own generations, so "the true
next token" is the target's; our corpus was not written by the target. --teacher-weight 0 trains
on the corpus tokens instead (hard cross-entropy); values between mix the two.

The mask token is a special token of the target's tokenizer the corpus (almost) never uses:
the one of <|im_start|>, <|im_end|> with the fewest occurrences in the training tokens (both
appear only where Python sources spell chat templates); dflash_config.mask_token_id records it
and train_metrics.json the counts.

The command for the GPU machine (device tool, one H100; no MLX needed; ~5 minutes: corpus ~20 s,
training --minutes, evaluation, export and the fp32 CPU reference a few seconds):

    python3 scripts/train_dflash_mini.py --prep --work /tmp/mini --out "$OUT" --minutes 3.5 --seed 0

(scripts/dflash_mini_gpu.sh runs it and then measures the result with mlxspec on MLX's CUDA
backend, in one call), then copy OUT/mini-attn-DFlash to benchmarks/models/. --prep tokenizes the
corpus of scripts/mini_corpus.py (same files, split and seed) with the COMMITTED target's
tokenizer; without it, --work must hold train.bin / heldout.bin made with that tokenizer. Checkpoint: bf16
model.safetensors (tensors fc, hidden_norm, layers.*, norm) and config.json exactly as published
drafters write them (tests/tiny_dflash.py), train_metrics.json, and reference.json: fp32 CPU block
logits of the stored weights after two held-out prefixes, computed with the target's trunk norms
rounded as MLX loads them (bf16(1 + w), mlxspec/models/attention_only.py), so that
tests/test_mini_dflash.py can hold MLX to fp32 tolerance.
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
import tiny_dflash  # noqa: E402  (numpy-only module)
from tiny import EOS_TOKEN, PAD_TOKEN, SPECIAL_TOKENS, tokenizer_info  # noqa: E402
from train_mini import Mini, autocast, batches, learning_rate  # noqa: E402  (the family's schedule)

TARGET_DIR = ROOT / "benchmarks" / "models" / "mini-attn"
NAME = "mini-attn-DFlash"
BLOCK = 8
LAYERS = 2
GAMMA = 2.0  # position-weight decay (DFlash uses 4 for block 8; a weak drafter is judged by its first positions)
HEADS = (4, 4, 32)  # query heads, KV heads, head dim: 4 retrieval patterns per layer where the target has 2
ROPE_THETA = 10000.0
REFERENCE_PREFIXES = (40, 160)  # held-out prefix lengths the reference drafts after


# ---------------------------------------------------------------------------
# Corpus: mini_corpus.build's files, split and order, tokenized with the target's own tokenizer


def prep(work: Path, tokenizer_dir: Path, max_train_mb: float, edit_fraction: float, seed: int) -> dict:
    from tokenizers import Tokenizer

    import mini_corpus

    work.mkdir(parents=True, exist_ok=True)
    roots = mini_corpus.source_roots()
    code = mini_corpus.collect(roots, (".py",))
    rng = random.Random(seed)
    kept, held, edits = mini_corpus.split_code(code, max_train_mb, edit_fraction, rng)
    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    eos = tok.token_to_id(PAD_TOKEN)

    docs = [t for _, _, t in kept] + edits
    rng.shuffle(docs)
    train_ids = mini_corpus.encode_documents(tok, docs, eos, work / "train.bin")
    held_ids = mini_corpus.encode_documents(tok, [t for _, _, t in held], eos, work / "heldout.bin")
    manifest = {"roots": [str(r) for r in roots], "python": sys.version.split()[0], "code_files": len(code),
                "train_files_used": len(kept), "edit_documents": len(edits), "heldout_files": len(held),
                "train_tokens": int(len(train_ids)), "heldout_tokens": int(len(held_ids)),
                "tokenizer": str(tokenizer_dir / "tokenizer.json"),
                "held_out_rule": f"sha1(content) % {mini_corpus.HELD_OUT_EVERY} == 0", "seed": seed}
    (work / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return manifest


def choose_mask_token(train: np.ndarray, tokenizer_dir: Path) -> tuple[int, dict]:
    """The special token (not the document separator) the training tokens use least."""
    _, special = tokenizer_info(tokenizer_dir)
    counts = np.bincount(train, minlength=max(special.values()) + 1)
    candidates = [t for t in SPECIAL_TOKENS if t != PAD_TOKEN]
    uses = {t: int(counts[special[t]]) for t in SPECIAL_TOKENS}
    best = min(candidates, key=lambda t: (uses[t], special[t]))
    return special[best], {"mask_token": best, "special_token_counts": uses}


# ---------------------------------------------------------------------------
# The frozen target (transformers' Qwen3.5 through train_mini.Mini) and its layer outputs


def load_target(target_dir: Path, layer_ids: list[int]):
    """The committed target as Qwen3_5ForCausalLM (fp32 copy of the bf16 weights), frozen, with
    hooks keeping the outputs of LAYER_IDS."""
    from safetensors.torch import load_file

    vocab, special = tokenizer_info(target_dir)
    mini = Mini("attn", vocab, [special[EOS_TOKEN], special[PAD_TOKEN]], special[PAD_TOKEN])
    tensors = load_file(str(target_dir / "model.safetensors"))
    lm_tensors = {"model." + k[len("model.language_model."):]: v.float() for k, v in tensors.items()
                  if k.startswith("model.language_model.")}
    missing, unexpected = mini.lm.load_state_dict(lm_tensors, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    lm = mini.lm.eval().requires_grad_(False)
    lm.captured = {}
    for i in layer_ids:
        def keep(_module, _args, out, i=i):
            lm.captured[i] = out[0] if isinstance(out, tuple) else out
        lm.model.layers[i].register_forward_hook(keep)
    lm.layer_ids = list(layer_ids)
    return lm


def target_features(lm, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (B, L) -> the concatenated outputs of the hooked layers (B, L, n*H) and the final-norm
    hidden (B, L, H)."""
    final = lm.model(input_ids=x, use_cache=False).last_hidden_state
    feats = torch.cat([lm.captured.pop(i) for i in lm.layer_ids], dim=-1)
    return feats, final


def mlx_rounded_norms(lm):
    """A copy of LM whose zero-centred trunk norms are (1 + w) rounded to bf16, minus 1: what MLX
    computes after mlxspec's loader adds the 1 to the bf16 weights."""
    lm = copy.deepcopy(lm).cpu().float()
    with torch.no_grad():
        for name, p in lm.named_parameters():
            if name.endswith("norm.weight") and p.ndim == 1:
                p.copy_((1.0 + p).to(torch.bfloat16).float() - 1.0)
    return lm


# ---------------------------------------------------------------------------
# The drafter (z-lab's DFlashDraftModel computation, tensor names of the published layout)


class Norm(nn.Module):
    """RMSNorm with a plain gain (Qwen3's, MLX's nn.RMSNorm), computed in fp32."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        y = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * y).to(x.dtype)


def rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate-half RoPE over the whole head: x (B, heads, S, hd), pos (B, S)."""
    hd = x.shape[-1]
    inv = theta ** (-torch.arange(0, hd, 2, device=x.device, dtype=torch.float32) / hd)
    ang = pos.float()[..., None] * inv
    cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]
    x1, x2 = x.float().chunk(2, dim=-1)
    return (x.float() * cos + torch.cat([-x2, x1], -1) * sin).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        h, self.hd = cfg["hidden_size"], cfg["head_dim"]
        self.nh, self.nkv, self.theta = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["rope_theta"]
        self.q_proj = nn.Linear(h, self.nh * self.hd, bias=False)
        self.k_proj = nn.Linear(h, self.nkv * self.hd, bias=False)
        self.v_proj = nn.Linear(h, self.nkv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.nh * self.hd, h, bias=False)
        self.q_norm = Norm(self.hd, cfg["rms_norm_eps"])
        self.k_norm = Norm(self.hd, cfg["rms_norm_eps"])

    def keys_values(self, x, pos):
        b, s, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(b, s, self.nkv, self.hd)).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.nkv, self.hd).transpose(1, 2)
        return rope(k, pos, self.theta), v

    def forward(self, x, pos, ctx_kv, mask):
        b, q_len, _ = x.shape
        q = rope(self.q_norm(self.q_proj(x).view(b, q_len, self.nh, self.hd)).transpose(1, 2), pos, self.theta)
        k, v = self.keys_values(x, pos)
        rep = self.nh // self.nkv
        k = torch.cat([ctx_kv[0], k], dim=2).repeat_interleave(rep, dim=1)
        v = torch.cat([ctx_kv[1], v], dim=2).repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask, scale=self.hd**-0.5)
        return self.o_proj(out.transpose(1, 2).reshape(b, q_len, -1))


class Layer(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        h = cfg["hidden_size"]
        self.self_attn = Attention(cfg)
        self.mlp = nn.Module()
        self.mlp.gate_proj = nn.Linear(h, cfg["intermediate_size"], bias=False)
        self.mlp.up_proj = nn.Linear(h, cfg["intermediate_size"], bias=False)
        self.mlp.down_proj = nn.Linear(cfg["intermediate_size"], h, bias=False)
        self.input_layernorm = Norm(h, cfg["rms_norm_eps"])
        self.post_attention_layernorm = Norm(h, cfg["rms_norm_eps"])

    def forward(self, x, pos, ctx_kv, mask):
        h = x + self.self_attn(self.input_layernorm(x), pos, ctx_kv, mask)
        y = self.post_attention_layernorm(h)
        return h + self.mlp.down_proj(F.silu(self.mlp.gate_proj(y)) * self.mlp.up_proj(y))


class DFlash(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        h = cfg["hidden_size"]
        self.fc = nn.Linear(len(cfg["dflash_config"]["target_layer_ids"]) * h, h, bias=False)
        self.hidden_norm = Norm(h, cfg["rms_norm_eps"])
        self.layers = nn.ModuleList([Layer(cfg) for _ in range(cfg["num_hidden_layers"])])
        self.norm = Norm(h, cfg["rms_norm_eps"])
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=0.02)

    def forward(self, feats, ctx_pos, block_embeds, block_pos, mask):
        """Context features (B, S, n*H) at ctx_pos (B, S); block embeddings (B, Q, H) at
        block_pos (B, Q); mask (B, 1, Q, S+Q) True = attend. -> final-norm hidden (B, Q, H)."""
        ctx = self.hidden_norm(self.fc(feats))
        h = block_embeds
        for layer in self.layers:
            h = layer(h, block_pos, layer.self_attn.keys_values(ctx, ctx_pos), mask)
        return self.norm(h)


def drafter_config(mask_id: int, heads: tuple[int, int, int] = HEADS) -> dict:
    target = tiny_dflash.target_text_config(TARGET_DIR)
    ids = default_target_layer_ids(target["num_hidden_layers"], LAYERS)
    cfg = tiny_dflash.dflash_config(target, layers=LAYERS, block_size=BLOCK, mask_token_id=mask_id,
                                    target_layer_ids=ids)
    cfg.update(num_attention_heads=heads[0], num_key_value_heads=heads[1], head_dim=heads[2], rope_theta=ROPE_THETA,
               max_position_embeddings=target["max_position_embeddings"], torch_dtype="bfloat16")
    return cfg


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """z-lab's rule (mlxspec.models.dflash.default_target_layer_ids; that module needs MLX)."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [round(1 + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers)]


# ---------------------------------------------------------------------------
# Teacher-forced blocks


def block_inputs(x: torch.Tensor, anchors: torch.Tensor, mask_id: int, block: int):
    """Tokens (B, N*block), positions (B, N*block) and the attention mask (B, 1, N*block, L+N*block)
    of one block per anchor: [x[a], MASK...] at a..a+block-1, seeing context positions < a and
    its own block."""
    b, n = anchors.shape
    length = x.shape[1]
    tokens = torch.full((b, n, block), mask_id, dtype=x.dtype, device=x.device)
    tokens[:, :, 0] = x.gather(1, anchors)
    offsets = torch.arange(block, device=x.device)
    pos = (anchors[:, :, None] + offsets).flatten(1)
    ctx_ok = torch.arange(length, device=x.device)[None, None, :] < anchors[:, :, None]
    ctx_ok = ctx_ok.repeat_interleave(block, dim=1)
    blocks = torch.arange(n * block, device=x.device) // block
    own = (blocks[:, None] == blocks[None, :]).expand(b, -1, -1)
    return tokens.flatten(1), pos, torch.cat([ctx_ok, own], dim=-1)[:, None]


def losses(lm, drafter, x: torch.Tensor, anchors: torch.Tensor, mask_id: int, teacher_weight: float,
           gamma: float = GAMMA, block: int = BLOCK) -> dict:
    """x (B, L) a window, anchors (B, N) in [1, L-block]: the weighted loss and per-position
    top-1 agreement with the target (agree_i) and with the corpus (acc_i); `accepted`: drafts a
    greedy block would keep on average, teacher-forced."""
    b, n = anchors.shape
    with torch.no_grad():
        feats, final = target_features(lm, x)
    embed = lm.model.embed_tokens.weight.detach()
    tokens, pos, mask = block_inputs(x, anchors, mask_id, block)
    ctx_pos = torch.arange(x.shape[1], device=x.device)[None].expand(b, -1)
    h = drafter(feats, ctx_pos, F.embedding(tokens, embed), pos, mask)
    h = h.view(b, n, block, -1)[:, :, 1:]
    logits = F.linear(h, embed).float()  # (B, N, block-1, V): the target's tied LM head
    where = anchors[:, :, None] + torch.arange(1, block, device=x.device)  # the predicted positions
    labels = x.gather(1, where.flatten(1)).view_as(where)
    with torch.no_grad():
        prev = final.gather(1, (where - 1).flatten(1)[..., None].expand(-1, -1, final.shape[-1]))
        teacher = F.linear(prev, embed).float().view(*where.shape, -1)
    logp = logits.log_softmax(-1)
    hard = -logp.gather(-1, labels[..., None])[..., 0]
    soft = -(teacher.softmax(-1) * logp).sum(-1)
    per_pos = (teacher_weight * soft + (1 - teacher_weight) * hard).mean(dim=(0, 1))
    weights = torch.exp(-torch.arange(block - 1, device=x.device, dtype=torch.float32) / gamma)
    out = {"loss": (per_pos * weights).sum() / weights.sum(), "soft": soft.mean(), "hard": hard.mean()}
    best = logits.argmax(-1)
    agree = best == teacher.argmax(-1)
    for i in range(block - 1):
        out[f"agree{i + 1}"] = agree[..., i].float().mean()
        out[f"acc{i + 1}"] = (best[..., i] == labels[..., i]).float().mean()
    out["accepted"] = agree.float().cumprod(-1).sum(-1).mean()
    return out


def random_anchors(b: int, length: int, n: int, device, block: int = BLOCK) -> torch.Tensor:
    """N distinct anchors per row, uniform over 1..length-block."""
    return torch.rand(b, length - block, device=device).topk(n, dim=-1).indices + 1


# ---------------------------------------------------------------------------
# Training


@torch.no_grad()
def evaluate(lm, drafter, data: torch.Tensor, length: int, windows: int, mask_id: int, teacher_weight: float,
             gamma: float = GAMMA, batch: int = 16, stride: int = 16) -> dict:
    drafter.eval()
    starts = np.linspace(0, len(data) - length - 1, windows).astype(np.int64)
    span = torch.arange(length, device=data.device)
    anchors = torch.arange(1, length - BLOCK + 1, stride, device=data.device)
    sums: dict[str, float] = {}
    for i in range(0, windows, batch):
        s = torch.as_tensor(starts[i: i + batch], device=data.device)
        with autocast(data.device):
            out = losses(lm, drafter, data[s[:, None] + span].long(), anchors[None].expand(len(s), -1),
                         mask_id, teacher_weight, gamma)
        for k, v in out.items():
            sums[k] = sums.get(k, 0.0) + float(v) * len(s)
    drafter.train()
    return {f"heldout_{k}": round(v / windows, 4) for k, v in sums.items()}


def _tokens(path: Path, device) -> torch.Tensor:
    return torch.from_numpy(np.fromfile(path, dtype=np.uint16).astype(np.int32)).to(device)


def train(a) -> dict:
    torch.manual_seed(a.seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    train_np = np.fromfile(a.work / "train.bin", dtype=np.uint16)
    mask_id, mask_info = choose_mask_token(train_np, a.target)
    cfg = drafter_config(mask_id, tuple(a.heads))
    lm = load_target(a.target, cfg["dflash_config"]["target_layer_ids"]).to(device)
    drafter = DFlash(cfg).to(device).train()
    train_data, held_data = _tokens(a.work / "train.bin", device), _tokens(a.work / "heldout.bin", device)
    decay = [p for p in drafter.parameters() if p.ndim >= 2]
    rest = [p for p in drafter.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                            lr=a.lr, betas=(0.9, 0.95), fused=device.type == "cuda")
    gen = torch.Generator().manual_seed(a.seed)
    stream = batches(train_data, a.batch, a.seq_len - 1, gen)  # windows of seq_len tokens
    budget, total = a.minutes * 60, a.steps or 10**9
    t0 = t10 = time.perf_counter()
    log, step = [], 0
    while step < total:
        for g in opt.param_groups:
            g["lr"] = learning_rate(step, total, a.lr)
        x = next(stream)
        with autocast(device):
            parts = losses(lm, drafter, x, random_anchors(x.shape[0], x.shape[1], a.anchors, device), mask_id,
                           a.teacher_weight, a.gamma)
        opt.zero_grad(set_to_none=True)
        parts["loss"].backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        opt.step()
        step += 1
        if a.steps is None and step == 10:
            t10 = time.perf_counter()
        if a.steps is None and step == 50:  # fix the schedule's length from steps 11-50 (past warm-up)
            per_step = (time.perf_counter() - t10) / 40
            total = max(100, step + int((budget - (time.perf_counter() - t0)) / per_step))
            print(f"[dflash] {per_step * 1000:.0f} ms/step -> {total} steps", flush=True)
        if step % 200 == 0 or step == total:
            row = {"step": step, "s": round(time.perf_counter() - t0, 1),
                   **{k: round(float(v.detach()), 4) for k, v in parts.items()}}
            log.append(row)
            print(f"[dflash] {row}", flush=True)
    seconds = round(time.perf_counter() - t0, 1)
    metrics = {"model": NAME, "target": a.target.name, "params": sum(p.numel() for p in drafter.parameters()),
               "block_size": BLOCK, "draft_layers": LAYERS,
               "target_layer_ids": cfg["dflash_config"]["target_layer_ids"],
               "mask_token_id": mask_id, **mask_info, "heads": a.heads, "gamma": a.gamma,
               "teacher_weight": a.teacher_weight,
               "anchors_per_window": a.anchors, "steps": step, "batch": a.batch, "seq_len": a.seq_len,
               "windows_seen": step * a.batch, "lr": a.lr, "seed": a.seed, "train_seconds": seconds,
               "device": str(device), "gpu": torch.cuda.get_device_name() if device.type == "cuda" else None,
               "torch": torch.__version__, "transformers": _transformers_version(),
               "final_train": log[-1] if log else None,
               **evaluate(lm, drafter, held_data, a.seq_len, a.eval_windows, mask_id, a.teacher_weight, a.gamma)}
    out = a.out / NAME
    export(drafter, cfg, out)
    snippet = held_data[1000: 1000 + max(REFERENCE_PREFIXES)].tolist()
    (out / "reference.json").write_text(json.dumps(reference(lm, drafter, cfg, snippet)))
    if (a.work / "manifest.json").is_file():
        metrics["corpus"] = json.loads((a.work / "manifest.json").read_text())
    (out / "train_metrics.json").write_text(json.dumps({**metrics, "log": log}, indent=1))
    print(f"[dflash] done {json.dumps({k: v for k, v in metrics.items() if k not in ('final_train', 'corpus')})}",
          flush=True)
    return metrics


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


# ---------------------------------------------------------------------------
# Export and the fp32 reference


def export(drafter: DFlash, cfg: dict, out: Path) -> None:
    """bf16 safetensors under the published names and config.json (no embedding, no LM head)."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to(torch.bfloat16).contiguous().cpu() for k, v in drafter.state_dict().items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2))


@torch.no_grad()
def block_logits(lm, drafter: DFlash, prompt: list[int], mask_id: int) -> torch.Tensor:
    """What the MLX drafter computes after PROMPT (its last token not fed to the target yet):
    context = features of PROMPT[:-1], block = [PROMPT[-1], MASK...]; logits (block-1, V) of
    block positions 1.."""
    x = torch.tensor([prompt])
    feats, _ = target_features(lm, x[:, :-1])
    t = len(prompt) - 1
    embed = lm.model.embed_tokens.weight
    tokens = torch.tensor([[prompt[-1]] + [mask_id] * (BLOCK - 1)])
    pos = torch.arange(t, t + BLOCK)[None]
    mask = torch.ones(1, 1, BLOCK, t + BLOCK, dtype=torch.bool)
    h = drafter(feats, torch.arange(t)[None], F.embedding(tokens, embed), pos, mask)
    return F.linear(h[0, 1:], embed)


def reference(lm, drafter: DFlash, cfg: dict, tokens: list[int], top: int = 16) -> dict:
    """fp32 CPU top-TOP block logits of the stored (bf16) drafter after each prefix of TOKENS in
    REFERENCE_PREFIXES, the target's norms as MLX rounds them."""
    lm_ref = mlx_rounded_norms(lm)
    lm_ref.captured, lm_ref.layer_ids = {}, lm.layer_ids
    for i in lm.layer_ids:  # deepcopy keeps the hooks' closures on the original: hook the copy
        lm_ref.model.layers[i]._forward_hooks.clear()

        def keep(_module, _args, out, i=i):
            lm_ref.captured[i] = out[0] if isinstance(out, tuple) else out
        lm_ref.model.layers[i].register_forward_hook(keep)
    ref = copy.deepcopy(drafter).cpu().float().eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    mask_id = cfg["dflash_config"]["mask_token_id"]
    blocks = []
    for n in REFERENCE_PREFIXES:
        logits = block_logits(lm_ref, ref, tokens[:n], mask_id)
        v, i = logits.topk(top, dim=-1)
        blocks.append({"prefix": n, "drafted": logits.argmax(-1).tolist(),
                       "positions": [{"ids": a.tolist(), "logits": [round(x, 5) for x in b.tolist()]}
                                     for a, b in zip(i, v)]})
    return {"tokens": tokens, "block_size": BLOCK, "mask_token_id": mask_id, "blocks": blocks,
            "note": "fp32 CPU; target norms bf16(1 + w) as mlxspec's loader makes them"}


# ---------------------------------------------------------------------------
# CLI


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prep", action="store_true", help="tokenize the corpus first (the target's tokenizer)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/mini"))
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "models")
    ap.add_argument("--target", type=Path, default=TARGET_DIR, help="the frozen target (mini-attn)")
    ap.add_argument("--minutes", type=float, default=3.5, help="training time budget")
    ap.add_argument("--steps", type=int, help="fixed step count (overrides --minutes)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--anchors", type=int, default=512, help="blocks trained per window")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--gamma", type=float, default=GAMMA, help="position weights exp(-(i-1)/gamma)")
    ap.add_argument("--heads", type=int, nargs=3, default=list(HEADS), metavar=("Q", "KV", "DIM"),
                    help="query heads, KV heads, head dim")
    ap.add_argument("--teacher-weight", type=float, default=1.0,
                    help="1: the target's distribution as label; 0: the corpus token")
    ap.add_argument("--eval-windows", type=int, default=64, help="held-out windows evaluated at the end")
    ap.add_argument("--max-train-mb", type=float, default=150.0, help="--prep: training text read")
    ap.add_argument("--edit-fraction", type=float, default=0.1, help="--prep: share of edit documents")
    a = ap.parse_args(argv)
    if a.prep:
        t = time.perf_counter()
        manifest = prep(a.work, a.target, a.max_train_mb, a.edit_fraction, a.seed)
        print(f"prep {time.perf_counter() - t:.0f}s {json.dumps(manifest)}", flush=True)
    if not (a.work / "train.bin").is_file():
        ap.error(f"no token files in {a.work}: run with --prep")
    train(a)


if __name__ == "__main__":
    main()
