"""Write tests/data/gemma4_assistant_reference.npz: what transformers' Gemma-4 target and
``Gemma4AssistantForCausalLM`` compute on the tiny checkpoints of tests/tiny_gemma4.py (rebuilt
from their seeds), so the tests check mlxspec's assistant against it without torch.

Needs torch (CPU) and transformers:  .venv/bin/python scripts/make_gemma4_reference.py

For each head (dense, sparse): the target fed the prompt but its last token (no cache), its
final-norm hidden state at the last position and the K/V it shares, then a greedy block of
BLOCK drafts the way transformers' SinglePositionMultiTokenCandidateGenerator makes them:
queries at the position of the prompt's last token, input = concat(the target's scaled
embedding of the last token, h_prev), h_prev := the assistant's projected output.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))


def loaded(cls, path):
    """CLS from PATH in float32, refusing a checkpoint transformers would fill in at random."""
    import torch

    model, info = cls.from_pretrained(path, dtype=torch.float32, attn_implementation="eager",
                                      output_loading_info=True)
    bad = {k: v for k, v in info.items() if k in ("missing_keys", "unexpected_keys", "mismatched_keys") and v}
    if bad:
        raise SystemExit(f"{path.name}: {bad}")
    return model.eval()


def allow_all_shared() -> None:
    """transformers 5.23's ``Gemma4TextConfig.kv_sharing_modes`` raises when every layer reuses
    shared K/V (no layer of the assistant produces any), which is what an assistant is: there,
    every layer is a "reuse" layer (what ``Gemma4AssistantConfig`` validates)."""
    from transformers.models.gemma4.configuration_gemma4 import Gemma4TextConfig

    original = Gemma4TextConfig.kv_sharing_modes.fget

    def modes(self):
        if self.num_kv_shared_layers == self.num_hidden_layers:
            return ["reuse"] * self.num_hidden_layers
        return original(self)

    Gemma4TextConfig.kv_sharing_modes = property(modes)


def main() -> None:
    import torch
    from transformers import Gemma4AssistantForCausalLM, Gemma4ForCausalLM

    from tiny import builtin_corpus, train_tokenizer
    from tiny_gemma4 import BLOCK, REFERENCE_FILE, REFERENCE_VOCAB, build_reference, reference_prompt

    torch.manual_seed(0)
    allow_all_shared()
    out: dict[str, np.ndarray] = {}
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = train_tokenizer(builtin_corpus(), REFERENCE_VOCAB, Path(tmp) / "tokenizer")
        paths = build_reference(Path(tmp), tokenizer)
        target = loaded(Gemma4ForCausalLM, paths["target"])
        ids = reference_prompt()
        out["prompt"] = np.array(ids, np.int64)
        with torch.no_grad():
            full = target(input_ids=torch.tensor([ids]), use_cache=False)
            out["target_logits"] = full.logits[0].numpy()
            fed = target(input_ids=torch.tensor([ids[:-1]]), use_cache=False, output_hidden_states=True,
                         return_shared_kv_states=True)
        # transformers' bidirectional window is inclusive (W + 1 keys), but a sliding layer's
        # cache in mlx-lm (RotatingKVCache) holds the last W tokens after a 1-token step: the
        # assistant reads what the target's cache holds, so the reference gets those W
        window = target.config.sliding_window
        shared = {kind: (k[:, :, -window:], v[:, :, -window:]) if kind == "sliding_attention" else (k, v)
                  for kind, (k, v) in fed.shared_kv_states.items()}
        for head in ("dense", "sparse"):
            assistant = loaded(Gemma4AssistantForCausalLM, paths[head])
            h = fed.hidden_states[-1][:, -1:]
            token = torch.tensor([[ids[-1]]])
            position = torch.tensor([[len(ids) - 1]])
            logits, drafted = [], []
            with torch.no_grad():
                for _ in range(BLOCK):
                    embeds = torch.cat([target.get_input_embeddings()(token), h], dim=-1)
                    step = assistant(inputs_embeds=embeds, position_ids=position,
                                     shared_kv_states=shared, use_cache=False)
                    logits.append(step.logits[0, -1].numpy())
                    token = step.logits.argmax(-1)
                    drafted.append(int(token))
                    h = step.last_hidden_state
            out[f"{head}_logits"] = np.stack(logits)
            out[f"{head}_tokens"] = np.array(drafted, np.int64)
    REFERENCE_FILE.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(REFERENCE_FILE, **out)
    print(f"wrote {REFERENCE_FILE.relative_to(ROOT)}: " + ", ".join(f"{k} {v.shape}" for k, v in out.items()))


if __name__ == "__main__":
    main()
