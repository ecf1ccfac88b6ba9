"""Fill-in-the-middle (FIM): a code model's own FIM tokens, read from its vocabulary, and the
prompt that asks it for the text between a prefix and a suffix.

Layouts (the special tokens each family's tokenizer_config / tokenizer.json adds):

- ``qwen``: Qwen2.5-Coder, Qwen3-Coder (and every Qwen2/3 vocabulary): ``<|fim_prefix|>``,
  ``<|fim_suffix|>``, ``<|fim_middle|>``, ``<|fim_pad|>``, with ``<|repo_name|>`` and
  ``<|file_sep|>`` for repository-level context.
- ``starcoder``: StarCoder / StarCoder2: ``<fim_prefix>``, ``<fim_suffix>``, ``<fim_middle>``,
  ``<fim_pad>``, ``<file_sep>`` and ``<repo_name>`` (StarCoder2) or ``<reponame>`` (StarCoder).
- ``codellama``: Code Llama: ``▁<PRE>``, ``▁<SUF>``, ``▁<MID>``, the middle ending at ``▁<EOT>``.
- ``deepseek``: DeepSeek-Coder: ``<｜fim▁begin｜>`` (prefix), ``<｜fim▁hole｜>`` (suffix),
  ``<｜fim▁end｜>`` (middle).

The prompt is prefix-suffix-middle (PSM), the order every one of them was trained on:
``[BOS] [extra context] PRE prefix [prompt] SUF suffix MID``; the model writes the middle
next. Extra context (other files) follows llama.cpp's ``/infill``: with repository tokens the
repo-level pattern (``<repo> myproject\\n`` then ``<file_sep> filename\\n text`` per file and a
last ``<file_sep> filename\\n``), without them each text after a ``--- snippet ---`` line.
Code Llama's suffix is encoded without SentencePiece's leading space, as Meta's reference
code does. A tokenizer without the three tokens has no layout (``detect`` gives None;
``require`` raises NoFimTokens).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

from .tokens import plain_ids

NO_FIM_MESSAGE = "this model has no fill-in-the-middle tokens"

# family -> role -> the token's spellings (the first one in the vocabulary is taken)
FAMILIES: dict[str, dict[str, tuple[str, ...]]] = {
    "qwen": {"prefix": ("<|fim_prefix|>",), "suffix": ("<|fim_suffix|>",), "middle": ("<|fim_middle|>",),
             "pad": ("<|fim_pad|>",), "repo": ("<|repo_name|>",), "file_sep": ("<|file_sep|>",)},
    "starcoder": {"prefix": ("<fim_prefix>",), "suffix": ("<fim_suffix>",), "middle": ("<fim_middle>",),
                  "pad": ("<fim_pad>",), "repo": ("<repo_name>", "<reponame>"), "file_sep": ("<file_sep>",)},
    "codellama": {"prefix": ("▁<PRE>",), "suffix": ("▁<SUF>",), "middle": ("▁<MID>",), "eot": ("▁<EOT>",)},
    "deepseek": {"prefix": ("<｜fim▁begin｜>",), "suffix": ("<｜fim▁hole｜>",), "middle": ("<｜fim▁end｜>",)},
}
REQUIRED = ("prefix", "suffix", "middle")
OPTIONAL = ("pad", "repo", "file_sep", "eot")

# llama.cpp's /infill: the repository name it writes, the last file's name, and the separator
# before each extra text where the model has no file separator token
REPO_NAME = "myproject"
LAST_FILE = "filename"
SNIPPET_SEPARATOR = "\n\n--- snippet ---\n\n"


class NoFimTokens(ValueError):
    """The model's vocabulary has no fill-in-the-middle tokens."""

    def __init__(self, message: str = NO_FIM_MESSAGE):
        super().__init__(message)


@dataclass(frozen=True)
class FimLayout:
    """A model's FIM tokens (ids); None: the vocabulary has no such token."""

    family: str
    prefix: int
    suffix: int
    middle: int
    pad: int | None = None
    repo: int | None = None
    file_sep: int | None = None
    eot: int | None = None  # ends the middle where it is not an end-of-text token (Code Llama)
    bos: int | None = None  # put first, where the tokenizer begins every text with it

    @property
    def markers(self) -> list[int]:
        """The layout's own tokens: none belongs in a middle, so the text stops at any of them."""
        ids = (self.eot, self.file_sep, self.repo, self.prefix, self.suffix, self.middle, self.pad)
        return [t for t in ids if t is not None]


def vocabulary(tokenizer) -> dict[str, int]:
    """TOKENIZER's tokens (added special tokens included) -> id; empty when it cannot say."""
    try:
        vocab = tokenizer.get_vocab()
    except Exception:  # a stand-in tokenizer
        return {}
    return vocab if isinstance(vocab, dict) else {}


def _bos(tokenizer) -> int | None:
    """The token the tokenizer puts before every text (Llama's, DeepSeek's <s>), or None."""
    try:
        with_specials = list(tokenizer.encode("a"))
    except Exception:
        return None
    bare = plain_ids(tokenizer, "a")
    if len(with_specials) > len(bare) and with_specials[len(with_specials) - len(bare):] == bare:
        first = with_specials[0]
        return first if first == getattr(tokenizer, "bos_token_id", first) else None
    return None


def detect(tokenizer) -> FimLayout | None:
    """The FIM layout of TOKENIZER's vocabulary (the first family whose prefix, suffix and
    middle tokens are all there), or None."""
    vocab = vocabulary(tokenizer)
    for family, roles in FAMILIES.items():
        found = {}
        for role, spellings in roles.items():
            found[role] = next((vocab[s] for s in spellings if s in vocab), None)
        if all(found[r] is not None for r in REQUIRED):
            return FimLayout(family, **found, bos=_bos(tokenizer))
    return None


def model_layout(tokenizer, vocab_size) -> FimLayout | None:
    """detect's layout where the model can read it: None where its tokens lie past the model's
    embedding (VOCAB_SIZE; None: not known), tokens the tokenizer adds that are not the model's."""
    found = detect(tokenizer)
    if found is not None and isinstance(vocab_size, int) and max(found.markers + [found.bos or 0]) >= vocab_size:
        return None
    return found


def require(tokenizer) -> FimLayout:
    """detect's layout; NoFimTokens where there is none."""
    layout = detect(tokenizer)
    if layout is None:
        raise NoFimTokens()
    return layout


def _suffix_ids(tokenizer, layout: FimLayout, text: str) -> list[int]:
    """The suffix's ids. Code Llama's SentencePiece puts a space before a text's first piece;
    the suffix follows ``▁<SUF>``, whose own ``▁`` is that space, so it is encoded behind a
    newline and the newline's ids dropped (Meta's ``encode_infilling``)."""
    if layout.family != "codellama" or not text:
        return plain_ids(tokenizer, text)
    newline = plain_ids(tokenizer, "\n")
    ids = plain_ids(tokenizer, "\n" + text)
    return ids[len(newline):] if ids[:len(newline)] == newline else plain_ids(tokenizer, text)


def extra_ids(tokenizer, layout: FimLayout, extra: Iterable[tuple[str, str]]) -> list[int]:
    """The other files' context, as llama.cpp's /infill writes it: EXTRA is (filename, text)."""
    out: list[int] = []
    if layout.repo is not None and layout.file_sep is not None:
        out += [layout.repo] + plain_ids(tokenizer, REPO_NAME + "\n")
    for filename, text in extra:
        if layout.file_sep is not None:
            out += [layout.file_sep] + plain_ids(tokenizer, filename + "\n")
        else:
            out += plain_ids(tokenizer, SNIPPET_SEPARATOR)
        out += plain_ids(tokenizer, text)
    if layout.file_sep is not None:
        out += [layout.file_sep] + plain_ids(tokenizer, LAST_FILE + "\n")
    return out


def prompt_ids(tokenizer, layout: FimLayout, prefix: str, suffix: str, *,
               extra: Sequence[tuple[str, str]] | None = None, prompt: str = "") -> list[int]:
    """The PSM prompt: ``[BOS] [extra] PRE prefix prompt SUF suffix MID``. EXTRA: other files
    as (filename, text), None for none (a list, even empty, adds llama.cpp's repo-level lines
    where the model has their tokens); PROMPT: text right after the prefix (llama.cpp's)."""
    head = [layout.bos] if layout.bos is not None else []
    context = extra_ids(tokenizer, layout, extra) if extra is not None else []
    return (head + context + [layout.prefix] + plain_ids(tokenizer, prefix) + plain_ids(tokenizer, prompt)
            + [layout.suffix] + _suffix_ids(tokenizer, layout, suffix) + [layout.middle])


def stop_texts(tokenizer, layout: FimLayout) -> list[str]:
    """The layout's tokens as text: where a generated middle ends."""
    out = []
    for token in layout.markers:
        try:
            text = tokenizer.decode([token])
        except Exception:
            continue
        if text and text not in out:
            out.append(text)
    return out
