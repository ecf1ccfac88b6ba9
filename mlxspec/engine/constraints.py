"""Constrained output: a request's ConstraintSpec compiled into a token-mask automaton.

llguidance turns a JSON schema, a regex or a Lark grammar into a matcher over the tokenizer's
vocabulary; this module wraps it for the loop. Plain constrained decoding masks the one row it
samples from; a verify masks each of its rows with the matcher advanced by the draft tokens
before that row, and the draft is cut at its first token outside the language (the target
could never accept it), so speculation samples from exactly the rows plain decoding would.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from ..errors import UsageError
from ..options import ConstraintSpec
from .sampling import SamplingParams

# OpenAI's json_object: any JSON object
ANY_JSON_OBJECT = {"type": "object"}
# JSON laid out as Python's json.dumps does, with no free whitespace between tokens: a model
# may otherwise spend its whole answer on whitespace the schema allows (a schema's own
# "x-guidance" options override these)
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _llguidance():
    """llguidance, imported on first use: only requests with a constraint need it, and the
    engine loads without it (a bench or a plain run)."""
    import llguidance
    import llguidance.hf
    import llguidance.numpy

    return llguidance


class DecodedVocabulary:
    """A vocabulary as llguidance's TokenizerWrapper reads it: each token's bytes by decoding it
    alone (special tokens marked, as llguidance marks them, by a leading 0xFF byte). For
    tokenizers whose tokenizer.json llguidance cannot read (a decoder it does not know); exact
    for tokens that are whole characters."""

    def __init__(self, hf_tokenizer, eos_token_id: int | None):
        self.hf = hf_tokenizer
        special = set(hf_tokenizer.all_special_ids)
        self.eos_token_id, self.bos_token_id = eos_token_id, None
        self.special_token_ids = sorted(special)
        self.tokens = [b"\xff" + hf_tokenizer.convert_ids_to_tokens(i).encode() if i in special
                       else hf_tokenizer.decode([i]).encode() for i in range(len(hf_tokenizer))]

    def __call__(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=False)


def grammar_tokenizer(hf_tokenizer, eos_token_id: int | None):
    """llguidance's view of a Hugging Face tokenizer (about 1 s for a 150k vocabulary: build it
    once per model). EOS_TOKEN_ID is what a finished answer may end with."""
    try:
        return _llguidance().hf.from_tokenizer(hf_tokenizer, eos_token=eos_token_id)
    except ValueError:  # a slow tokenizer, or a tokenizer.json llguidance cannot read
        pass
    try:
        llguidance = _llguidance()
        wrapper = llguidance.TokenizerWrapper(DecodedVocabulary(hf_tokenizer, eos_token_id))
        return llguidance.LLTokenizer(wrapper, eos_token=eos_token_id)
    except Exception as err:  # llguidance refuses the vocabulary itself
        raise UsageError(f"constrained output cannot read this tokenizer: {' '.join(str(err).split())[:200]}") \
            from None


def grammar_of(spec: ConstraintSpec) -> str:
    """llguidance's grammar text for SPEC."""
    if spec.kind in ("json", "json_schema"):
        schema = ANY_JSON_OBJECT if spec.kind == "json" else spec.value
        try:
            return _llguidance().LLMatcher.grammar_from_json_schema(schema, defaults=JSON_LAYOUT)
        except ValueError as err:
            raise UsageError(f"invalid JSON schema: {err}") from None
    if spec.kind == "regex":
        return _llguidance().LLMatcher.grammar_from_regex(spec.value)
    return _llguidance().LLMatcher.grammar_from_lark(spec.value)


class TokenConstraint:
    """One request's automaton: which tokens may come next, advanced by the committed tokens.

    ``width`` is the model's logits size (it may exceed the tokenizer's vocabulary: padded rows
    are never allowed)."""

    def __init__(self, spec: ConstraintSpec, tokenizer, width: int):
        self.spec = spec
        self.width = width
        self.matcher = _llguidance().LLMatcher(tokenizer, grammar_of(spec), log_level=0)
        self._numpy = _llguidance().numpy
        if self.matcher.is_error():
            what = {"json_schema": "JSON schema", "regex": "regex", "grammar": "grammar"}.get(spec.kind, spec.kind)
            raise UsageError(f"invalid {what}: {self._error()}")
        self.vocab = tokenizer.vocab_size
        # llguidance does not count an end-of-text token among those rollback undoes: a draft
        # is never advanced past one (what follows it is never emitted anyway)
        self.eos = set(tokenizer.eos_tokens)
        self._bits = self._numpy.allocate_token_bitmask(1, self.vocab)

    def _error(self) -> str:
        """llguidance's error in one line: its first, and the reason a regex's parse error gives
        lines later ("error: unclosed group"), past the pattern drawn with carets."""
        first, *rest = self.matcher.get_error().strip().splitlines()
        reason = next((line.strip()[len("error:"):].strip() for line in rest if line.strip().startswith("error:")), "")
        return f"{first} {reason}" if reason else first

    def _allowed(self) -> np.ndarray:
        """The current state's allowed tokens, as a bool row of the logits' width."""
        if self.matcher.is_error():
            raise UsageError(f"constrained output failed: {self._error()}")
        self._numpy.fill_next_token_bitmask(self.matcher, self._bits, 0)
        row = np.unpackbits(self._bits.view(np.uint8), bitorder="little")[: self.vocab].astype(bool)
        if self.width > self.vocab:
            row = np.concatenate([row, np.zeros(self.width - self.vocab, bool)])
        return row[: self.width]

    def masks(self, draft: list[int]) -> tuple[int, mx.array]:
        """The masks of a verify whose inputs after the committed token are DRAFT: (cut, masks)
        where ``cut`` is how many leading draft tokens lie inside the language (the rest are
        dropped before the verify) and ``masks`` (cut + 1, width) the allowed tokens of each
        row, the matcher advanced by the draft tokens before it. The matcher ends as it began."""
        rows = [self._allowed()]
        cut = consumed = 0
        for token in draft:
            if not rows[-1][token]:
                break
            cut += 1
            if token in self.eos:  # the end: the row after it is never sampled from
                rows.append(rows[-1])
                break
            self.matcher.consume_token(token)
            consumed += 1
            rows.append(self._allowed())
        if consumed:
            self.matcher.rollback(consumed)
        return cut, mx.array(np.stack(rows))

    def mask_after(self, tokens: list[int]) -> mx.array | None:
        """The allowed tokens (1, width) once TOKENS follow what is committed; None when TOKENS
        leave the language. The matcher ends as it began."""
        if self.eos.intersection(tokens) or self.matcher.validate_tokens(tokens) < len(tokens):
            return None  # checked first: a refused token would put the matcher in its error state
        self.matcher.consume_tokens(tokens)
        try:
            row = self._allowed()
            return mx.array(row[None]) if row.any() else None  # nothing allowed (past the end)
        finally:
            if tokens:
                self.matcher.rollback(len(tokens))

    def advance(self, tokens: list[int]) -> None:
        """Commit TOKENS (sampled under the masks, so inside the language) up to an end of
        text, which ends the answer (a stopped matcher refuses it in consume_tokens)."""
        for token in tokens:
            if token in self.eos:
                return
            self.matcher.consume_token(token)


def apply_mask(logits: mx.array, masks: mx.array) -> mx.array:
    """LOGITS (rows, V) with every token outside its row's mask at -inf."""
    return mx.where(masks, logits, mx.array(-mx.inf, logits.dtype))


@dataclass(frozen=True)
class MaskedChainSampling(SamplingParams):
    """The sampling a model drafter gets for one draft chain under a constraint: each draw is
    masked to what the language allows after the chain so far, so the drafter proposes inside
    it instead of being cut. Its q is the masked distribution it drew from, which acceptance
    uses as it is: exactness does not depend on this (a cut draft is exact too), acceptance
    does. Each draw is read on the host (the next mask needs it)."""

    constraint: TokenConstraint | None = None
    drafted: list[int] = field(default_factory=list)

    def sample_with_logprobs(self, logits: mx.array) -> tuple[mx.array, mx.array]:
        mask = self.constraint.mask_after(self.drafted) if self.constraint is not None else None
        if mask is not None:
            logits = apply_mask(logits, mask)
        tok, lp = super().sample_with_logprobs(logits)
        self.drafted.append(int(tok.reshape(-1)[0].item()))
        return tok, lp
