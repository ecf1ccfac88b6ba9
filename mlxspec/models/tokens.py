"""Token ids of a text as the model's tokenizer writes them, without the special tokens it
adds around a whole text (BOS / EOS): for pieces that go inside a prompt already begun."""

from __future__ import annotations


def plain_ids(tokenizer, text: str) -> list[int]:
    """TEXT's token ids with no BOS / EOS added."""
    if not text:
        return []
    try:
        return list(tokenizer.encode(text, add_special_tokens=False))
    except TypeError:  # an encode without the keyword adds none
        return list(tokenizer.encode(text))
