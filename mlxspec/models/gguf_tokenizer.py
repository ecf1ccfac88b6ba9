"""A Hugging Face tokenizer (tokenizer.json + tokenizer_config.json) from a GGUF's metadata.

GGUF keeps the vocabulary, merges or scores, token types and the chat template under
``tokenizer.*``; mlx-lm loads tokenizers through transformers, which wants the files. Two
models are rebuilt: ``gpt2`` (byte-level BPE: Llama 3, Qwen2/3, SmolLM, ...) with the
pre-tokenizer llama.cpp names in ``tokenizer.ggml.pre``, and ``llama`` (SentencePiece BPE with
byte fallback: Llama 2, Mistral, Gemma), whose merges are recovered from the token scores.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import InvalidCheckpointError

# llama.cpp token types
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# tokenizer.ggml.pre -> (split regex, digits one by one first, NFC first)
PRE_TOKENIZERS = {
    "qwen2": (QWEN2_REGEX, False, True),
    "deepseek-r1-qwen": (QWEN2_REGEX, False, True),
    "llama-bpe": (LLAMA3_REGEX, False, False),
    "llama3": (LLAMA3_REGEX, False, False),
    "smollm": (GPT2_REGEX, True, False),
    "starcoder": (GPT2_REGEX, True, False),
    "gpt-2": (GPT2_REGEX, False, False),
}


def _meta(metadata: dict, key: str, default=None):
    return metadata.get(f"tokenizer.ggml.{key}", default)


def _byte_level(metadata: dict, tokens: list[str]):
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    merges = _meta(metadata, "merges")
    if not isinstance(merges, list) or not merges:
        raise InvalidCheckpointError("the GGUF's gpt2 tokenizer has no merges (tokenizer.ggml.merges)")
    pairs = [tuple(m.split(" ", 1)) for m in merges if " " in m]
    vocab = {t: i for i, t in enumerate(tokens)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    regex, digits, nfc = PRE_TOKENIZERS.get(_meta(metadata, "pre", "gpt-2"), PRE_TOKENIZERS["gpt-2"])
    steps = [pre_tokenizers.Digits(individual_digits=True)] if digits else []
    steps += [pre_tokenizers.Split(Regex(regex), behavior="isolated"),
              pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(steps)
    if nfc:
        tokenizer.normalizer = normalizers.NFC()
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _sentencepiece(metadata: dict, tokens: list[str], types: list[int]):
    """SentencePiece BPE: merges ranked by the score of the piece they make (as SentencePiece
    itself merges), byte fallback through the <0xNN> tokens."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    scores = _meta(metadata, "scores")
    if not isinstance(scores, list) or len(scores) != len(tokens):
        raise InvalidCheckpointError("the GGUF's SentencePiece tokenizer has no scores (tokenizer.ggml.scores)")
    vocab = {t: i for i, t in enumerate(tokens)}
    mergeable = {t: i for i, t in enumerate(tokens) if types[i] in (NORMAL, USER_DEFINED)}
    merges = []
    for piece, i in mergeable.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in mergeable and right in mergeable:
                merges.append((-scores[i], i, left, right))
    merges.sort()
    unk = _meta(metadata, "unknown_token_id")
    model = models.BPE(vocab=vocab, merges=[(a, b) for _, _, a, b in merges], byte_fallback=True, fuse_unk=True,
                       unk_token=tokens[unk] if isinstance(unk, int) and 0 <= unk < len(tokens) else None)
    tokenizer = Tokenizer(model)
    prefix = _meta(metadata, "add_space_prefix", True)
    steps = [normalizers.Prepend("▁")] if prefix else []
    tokenizer.normalizer = normalizers.Sequence(steps + [normalizers.Replace(" ", "▁")])
    decode = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    tokenizer.decoder = decoders.Sequence(decode + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    return tokenizer


def _token(tokens: list[str], key: str, metadata: dict) -> str | None:
    i = _meta(metadata, key)
    return tokens[i] if isinstance(i, int) and 0 <= i < len(tokens) else None


def eos_token_ids(metadata: dict) -> list[int]:
    """The end-of-sequence ids: eos, then end-of-turn / end-of-message where the GGUF names them."""
    ids = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        i = _meta(metadata, key)
        if isinstance(i, int) and i not in ids:
            ids.append(i)
    return ids


def write_tokenizer(metadata: dict, out: Path) -> None:
    """Write tokenizer.json and tokenizer_config.json (with the chat template) into OUT."""
    from tokenizers import AddedToken, processors

    kind = _meta(metadata, "model")
    tokens = _meta(metadata, "tokens")
    if not isinstance(tokens, list) or not tokens:
        raise InvalidCheckpointError("the GGUF has no tokenizer vocabulary (tokenizer.ggml.tokens)")
    types = _meta(metadata, "token_type") or [NORMAL] * len(tokens)
    if kind == "gpt2":
        tokenizer = _byte_level(metadata, tokens)
    elif kind == "llama":
        tokenizer = _sentencepiece(metadata, tokens, types)
    else:
        raise InvalidCheckpointError(
            f"the GGUF's tokenizer model is '{kind}'; only 'gpt2' (byte-level BPE) and 'llama' "
            "(SentencePiece) are converted")
    specials = [i for i, t in enumerate(types) if t == CONTROL]
    user = [i for i, t in enumerate(types) if t == USER_DEFINED]
    tokenizer.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False) for i in specials])
    tokenizer.add_tokens([AddedToken(tokens[i], special=False, normalized=False) for i in user])
    bos = _token(tokens, "bos_token_id", metadata)
    add_bos = bool(_meta(metadata, "add_bos_token", kind == "llama"))
    if add_bos and bos is not None:
        bos_id = _meta(metadata, "bos_token_id")
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)])
    tokenizer.save(str(out / "tokenizer.json"))

    eos_ids = eos_token_ids(metadata)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": tokens[eos_ids[0]] if eos_ids else None,
        "pad_token": _token(tokens, "padding_token_id", metadata),
        "unk_token": _token(tokens, "unknown_token_id", metadata),
        "add_bos_token": add_bos,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1 << 30,
        "added_tokens_decoder": {
            str(i): {"content": tokens[i], "lstrip": False, "normalized": False, "rstrip": False,
                     "single_word": False, "special": types[i] == CONTROL}
            for i in specials + user},
    }
    template = metadata.get("tokenizer.chat_template")
    if isinstance(template, str) and template.strip():
        config["chat_template"] = template
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False), encoding="utf-8")
