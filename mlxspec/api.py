"""The Python API: ``mlxspec.load(model).generate(...)`` / ``.stream(...)``.

It joins the pieces in one direction: resolve + load the model (``models``), build a drafter
(``engine.drafters``), run the loop (``engine.speculate``) and turn tokens into text.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Iterator, Sequence

from .api_costs import MeasuredCosts
from .engine.batch import BatchedDecoder, RowPlan
from .engine.batch_cache import batch_refusal
from .engine.drafters.registry import check_drafter, resolve_drafter
from .engine.logprobs import TokenLogprob
from .engine.prefix_cache import PrefixCache
from .engine.ranks import agreed, checked
from .engine.row_rules import RowRules
from .engine.speculate import SpeculativeDecoder
from .engine.stats import Stats
from .errors import DrafterError, InvalidCheckpointError, ModelNotFoundError, UsageError
from .models.loader import LoadedModel, cast_floating, load_model
from .models.sharding import world

# DRAFTERS and DEFAULT_PROMPT_CACHE_BYTES stay importable from here: callers of the API read them
from .options import (  # noqa: F401
    DEFAULT_PROMPT_CACHE_BYTES,
    DRAFTERS,
    MODEL_DRAFTERS,
    ConstraintSpec,
)

# the request and result types are the API's: importable from here as before
from .request import Chunk, GenerationRequest, Result  # noqa: F401

# drafters whose rows share a batched forward (engine/batch.py; DFlash as chains); the
# assistant reads the target's own cache: served alone
BATCH_DRAFTERS = ("pld", "none", "mtp", "draft", "dflash")


class SpecModel(MeasuredCosts):
    """A loaded target (plus optional draft model) ready to generate speculatively."""

    def __init__(self, target: LoadedModel, draft: LoadedModel | None = None,
                 prompt_cache_bytes: int = DEFAULT_PROMPT_CACHE_BYTES):
        self.target = target
        self.draft = draft
        self.tokenizer = target.tokenizer
        self._mtp: tuple | None = None  # (head or None, why not) once looked for
        self._cost = None  # this machine's verify-cost curve, measured on first use
        self._draft_costs: dict[str, float] = {}  # a draft step's cost per drafter, likewise
        self._shared = None  # a sharded target's costs, rank 0's (tuning/shared.py)
        # earlier prompts' caches: a request sharing a prefix with one prefills only the rest
        self.prompt_cache = PrefixCache(prompt_cache_bytes)
        self._fixed: bool | None = None  # see _fixed_state
        self._grammar_tokenizer = None  # llguidance's view of the vocabulary, built on first use
        self._batch_refusal: tuple[str] | None = None  # why the target cannot batch ("": it can)

    def mtp_head(self):
        """The checkpoint's native MTP head (read on first use), or None; and why not."""
        if self._mtp is None:
            from .errors import MlxspecError
            from .models.mtp import load_mtp_head

            try:
                head = load_mtp_head(self.target.model, self.target.path, self.target.config, self.target.group)
                self._mtp = (head, None if head else "the checkpoint has no MTP head")
            except MlxspecError as err:
                self._mtp = (None, str(err))
        return self._mtp

    def astype(self, dtype: str) -> None:
        """Cast the floating-point weights of the target, draft model and MTP head to DTYPE
        (quantized weights stay as they are)."""
        head, _ = self.mtp_head()
        cast_floating([self.target.model] + ([self.draft.model] if self.draft else [])
                      + ([head.module] if head else []), dtype)

    def grammar_tokenizer(self):
        """llguidance's view of the vocabulary (built on first use, about 1 s for 150k tokens)."""
        if self._grammar_tokenizer is None:
            from .compat import hf_tokenizer
            from .engine.constraints import grammar_tokenizer

            self._grammar_tokenizer = grammar_tokenizer(hf_tokenizer(self.tokenizer), self.tokenizer.eos_token_id)
        return self._grammar_tokenizer

    def constraint(self, spec: ConstraintSpec):
        """SPEC compiled for this model: a fresh automaton for one request (UsageError for a
        schema, regex or grammar llguidance refuses)."""
        from .engine.constraints import TokenConstraint

        return TokenConstraint(spec, self.grammar_tokenizer(), self.target.vocab_size)

    def token_bytes(self, token: int) -> bytes:
        """A token's own bytes (logprobs show them): exact from llguidance's vocabulary; from
        decoding it alone where that tokenizer cannot be built."""
        try:
            return self.grammar_tokenizer().decode_bytes([token])
        except UsageError:
            return self.tokenizer.decode([token]).encode()

    @property
    def _fixed_state(self) -> bool:
        """Whether the model has caches that serve only the length they were stored at
        (recurrent or sliding-window): only those need extra reuse points."""
        if self._fixed is None:
            from mlx_lm.models.cache import KVCache, make_prompt_cache

            from .engine.cache import cache_leaves

            self._fixed = any(type(c) is not KVCache for c in cache_leaves(make_prompt_cache(self.target.model)))
        return self._fixed

    @property
    def name(self) -> str:
        return self.target.name

    @property
    def is_demo(self) -> bool:
        return self.target.is_demo

    # -- prompts ---------------------------------------------------------
    def encode(
        self,
        prompt: str | Sequence[int] | Sequence[dict],
        *,
        system: str | None = None,
        raw: bool = False,
        tools: list[dict] | None = None,
        template_kwargs: dict | None = None,
    ) -> list[int]:
        """Token ids for a prompt: text (chat template applied unless ``raw``), messages, or ids.
        ``tools`` (function schemas) go to the chat template, which renders them for the model;
        ``template_kwargs`` are extra template variables (e.g. ``enable_thinking``)."""
        messages = self._messages(prompt, system)
        if messages is None:
            return list(prompt)
        if not raw and getattr(self.tokenizer, "chat_template", None):
            return self._render(messages, True, tools, template_kwargs)
        text = "\n".join(m["content"] for m in messages if m.get("content"))
        return list(self.tokenizer.encode(text))

    @staticmethod
    def _messages(prompt, system: str | None) -> list[dict] | None:
        """The chat messages of a prompt; None when it is already token ids."""
        if isinstance(prompt, str):
            messages = [{"role": "user", "content": prompt}]
        elif prompt and isinstance(prompt[0], int):
            return None
        else:
            messages = list(prompt)
        if system and not any(m.get("role") == "system" for m in messages):
            messages = [{"role": "system", "content": system}] + messages
        return messages

    def _render(self, messages, generation_prompt: bool, tools, template_kwargs) -> list[int]:
        extra = dict(template_kwargs or {})
        if tools:
            extra["tools"] = tools
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt,
                                                 tokenize=True, **extra)
        if isinstance(ids, Mapping):  # transformers may return a BatchEncoding
            ids = ids["input_ids"]
        return list(ids)

    def reuse_points(self, prompt, prompt_ids: list[int], *, system: str | None = None, raw: bool = False,
                     tools: list[dict] | None = None, template_kwargs: dict | None = None) -> list[int]:
        """Prompt positions the next turn of this conversation will share: where the rendered
        conversation ends, before the generation prompt (templates re-render the assistant's
        turn differently, e.g. without its reasoning). A hybrid model's recurrent state can be
        reused only where it was stored, so the prefix cache stores it there too."""
        messages = None if raw else self._messages(prompt, system)
        if not messages or not getattr(self.tokenizer, "chat_template", None) or not self._fixed_state:
            return []
        try:
            history = self._render(messages, False, tools, template_kwargs)
        except Exception:  # a template that insists on a generation prompt: no extra point
            return []
        n = len(history)
        return [n] if 0 < n < len(prompt_ids) and history == prompt_ids[:n] else []

    # -- generation ------------------------------------------------------
    def stream(self, prompt, request: GenerationRequest | None = None, **options) -> Iterator[Chunk]:
        """Yield :class:`Chunk` s as tokens are committed; the last chunk's stats are final.

        REQUEST says how to generate; keyword OPTIONS are its fields (see
        :class:`GenerationRequest`), over REQUEST's when both are given. With ``reuse`` the
        longest prefix shared with an earlier prompt (``prompt_cache``) is not prefilled again."""
        r, group = _request(request, options), self.target.group
        timed = r.seed is None  # decisions by measured costs (a seeded run's must repeat)
        r = r if group is None else agreed(r, group)  # sharded: all ranks draw alike, prefill feeds the watchdog
        prompt_ids, max_tokens, checkpoints = self._prepare(prompt, r)
        rules, logprobs = self._rules(r)
        steps = self._decoder(r, timed, len(prompt_ids) + max_tokens).generate(
            prompt_ids,
            sampling=r.sampling,
            max_tokens=max_tokens,
            stop_tokens=set(self.tokenizer.eos_token_ids),
            seed=r.seed,
            prefix_cache=self.prompt_cache if r.reuse else None,
            checkpoints=checkpoints or (),
            prefill_step=r.prefill_step,
            on_prefill=r.on_prefill,
            constraint=rules.constraint,
            logprobs=r.logprobs,
            on_logprobs=logprobs.extend if logprobs is not None else None,
            penalties=r.penalties,
        )
        yield from self._text_chunks(steps if group is None else checked(steps, group), logprobs)

    def _prepare(self, prompt, r: GenerationRequest) -> tuple[list[int], int, Sequence[int] | None]:
        """PROMPT's token ids, the max_tokens its context leaves, the prefix cache's checkpoints."""
        prompt_ids = self.encode(prompt, system=r.system, raw=r.raw, tools=r.tools, template_kwargs=r.template_kwargs)
        if not prompt_ids:
            raise UsageError("the prompt is empty")
        max_tokens = self.check_context(len(prompt_ids), r.max_tokens)
        checkpoints = r.checkpoints
        if checkpoints is None and r.reuse:
            checkpoints = self.reuse_points(prompt, prompt_ids, system=r.system, raw=r.raw, tools=r.tools,
                                            template_kwargs=r.template_kwargs)
        return prompt_ids, max_tokens, checkpoints

    # -- batching -------------------------------------------------------------------
    def batch(self, max_rows: int) -> BatchedDecoder:
        """An engine that decodes up to MAX_ROWS requests together (:meth:`stream_in`)."""
        return BatchedDecoder(self.target.model, max_rows)

    @property
    def cannot_batch(self) -> str | None:
        """Why this model's requests cannot share a batched forward; None: they can."""
        if self._batch_refusal is None:
            self._batch_refusal = (batch_refusal(self.target.model) or "",)
        return self._batch_refusal[0] or None

    def batch_plan(self, request: GenerationRequest) -> tuple[RowPlan | None, str | None]:
        """How REQUEST decodes as a row of a batch, or (None, why not): it is served alone."""
        if self.cannot_batch:
            return None, f"{self.name} cannot batch: {self.cannot_batch}"
        dec = self._decoder(request, horizon=request.max_tokens)  # the prompt is not known yet: at least that
        name = dec.drafter.name if dec.drafter is not None else "none"
        trees = dec.tree != 0 and not (name == "dflash" and request.tree == "default")  # its default: chains here
        if name not in BATCH_DRAFTERS or trees:
            return None, f"drafter {name}{' with trees' if trees else ''} is served alone"
        return RowPlan.of(dec), None

    def stream_in(self, batch: BatchedDecoder, prompt, request: GenerationRequest | None = None, *,
                  plan: RowPlan | None = None, **options) -> Iterator[Chunk]:
        """:meth:`stream`, decoded as a row of BATCH together with its other rows (the same
        tokens as alone, at any temperature). The row is added now (it prefills over the
        batch's next steps); UsageError when :meth:`batch_plan` refuses it. PLAN: what
        :meth:`batch_plan` gave for this very request, if already asked (its drafter is used)."""
        r = _request(request, options)
        if plan is None:
            plan, why = self.batch_plan(r)
            if plan is None:
                raise UsageError(why)
        prompt_ids, max_tokens, checkpoints = self._prepare(prompt, r)
        rules, logprobs = self._rules(r)
        row = batch.add(prompt_ids, sampling=r.sampling, max_tokens=max_tokens,
                        stop_tokens=set(self.tokenizer.eos_token_ids), plan=plan, seed=r.seed,
                        prefix_cache=self.prompt_cache if r.reuse else None, checkpoints=checkpoints or (),
                        rules=rules, on_logprobs=logprobs.extend if logprobs is not None else None)
        return self._row_chunks(batch, row, logprobs)

    def _rules(self, r: GenerationRequest) -> tuple[RowRules, list[TokenLogprob] | None]:
        """REQUEST's constraint, penalties and logprobs (checked), and the list its logprobs go to."""
        constraint = self.constraint(r.constraint) if r.constraint is not None else None
        try:
            r.penalties.check_vocabulary(self.target.vocab_size)
        except ValueError as err:
            raise UsageError(str(err)) from None
        return RowRules(constraint, r.penalties, r.logprobs), [] if r.logprobs is not None else None

    def _row_chunks(self, batch: BatchedDecoder, row, logprobs: list | None) -> Iterator[Chunk]:
        updates = row.updates()
        try:
            yield from self._text_chunks(updates, logprobs)
        finally:
            updates.close()
            batch.remove(row)

    def _decoder(self, request: GenerationRequest, timed: bool | None = None, horizon: int = 0) -> SpeculativeDecoder:
        """The engine for REQUEST's drafter and depth, with this machine's measured costs (not
        when TIMED is False; None: unless REQUEST is seeded), for a request that may reach
        HORIZON tokens of context."""
        drafter = request.drafter
        head, why_not = self.mtp_head() if drafter in ("auto", "mtp") else (None, None)
        if drafter == "mtp" and head is None:
            raise DrafterError(
                f"--drafter mtp: {why_not}; use --drafter pld, or --drafter draft with --draft-model"
            )
        draft_model = self.draft.model if self.draft else None
        name = resolve_drafter(drafter, draft_model, head)
        check_drafter(name, draft_model)
        max_depth = request.max_depth
        alone = self.target.group is None  # sharded: no tune record (one process's figures)
        if request.depth is None and name != "none" and alone:
            name, max_depth = self._tuned(request, name, head)
        # Depth follows this machine's measured verify cost, except in seeded runs, whose
        # decisions must not depend on timings (they would not repeat); sharded: rank 0's.
        timed = (request.seed is None if timed is None else timed) and name != "none"
        trees = request.tree != 0 and (request.tree != "default" or name == "dflash")  # asked, or DFlash's default
        cost = draft_cost = None
        if timed and not alone:  # every rank measures together; rank 0's figures for all
            from .tuning.shared import measure_shared

            self._shared = measure_shared(self, name, trees, self._shared, request.on_status)
            cost, draft_cost = self._shared.cost, self._shared.draft_cost.get(name)
        elif timed:
            cost = self.verify_cost(request.on_status, horizon)
            from .tuning.storage import stored_draft_cost

            # `mlxspec tune` or an earlier run timed this drafter's step here
            draft_cost = stored_draft_cost(self.target, name, self.draft)
            if draft_cost is None and name in (*MODEL_DRAFTERS, "mtp"):
                draft_cost = self.draft_cost(name, request.on_status)
        if alone and cost is not None and cost.tree_factor is None and trees:
            self._measure_tree_factor(cost, request.on_status)
        return SpeculativeDecoder(
            self.target.model,
            draft_model=draft_model,
            mtp_head=head,
            drafter=name,
            depth=request.depth,
            max_depth=max_depth,
            gates=request.gates,
            cost=cost,
            draft_cost=draft_cost,
            tree=request.tree,
        )

    def _tuned(self, request: GenerationRequest, name: str, head) -> tuple[str, int | None]:
        """What `mlxspec tune` stored for this machine and model decides: ``auto``'s drafter
        (the best rated of those this run has) and the depth cap (the tuned depth, within the
        request's own cap); its note goes to ``request.on_note``."""
        from .tuning.choice import choose
        from .tuning.storage import load_result, model_info

        given = [resolve_drafter("auto", self.draft.model, None)] if self.draft else []  # draft / assistant
        available = ["pld"] + given + (["mtp"] if head is not None else [])
        draft_key = model_info(self.draft)["key"] if self.draft else None
        choice = choose(load_result(self.target), request.drafter, name, available, draft_key)
        if choice.note and request.on_note:
            request.on_note(choice.note)
        caps = [k for k in (request.max_depth, choice.max_depth) if k]
        return choice.drafter, min(caps) if caps else None

    def _text_chunks(self, steps, logprobs: list[TokenLogprob] | None = None) -> Iterator[Chunk]:
        """The decoder's (tokens, stats) steps as Chunks of text; the end-of-text tokens are
        kept in ``tokens`` but not detokenized. LOGPROBS (None: not asked for) is filled by the
        decoder before each step and emptied into that step's chunk."""
        detok = self.tokenizer.detokenizer
        detok.reset()
        stats, accepted = None, 0
        for tokens, stats in steps:
            # a verify step's accepted drafts are its first tokens (stats is the decoder's own,
            # updated in place: its count is read now); their text leads the chunk's
            drafts = min(stats.accepted - accepted, len(tokens))
            accepted = stats.accepted
            # offset: the text's length at the last segment read; the text itself is built (a
            # decode and a copy on the host) only where a step kept drafts and its own token
            start, drafted_end = detok.offset, None
            for i, t in enumerate(tokens):
                if i == drafts and drafts:
                    drafted_end = len(detok.text)
                if t in self.tokenizer.eos_token_ids:
                    continue
                detok.add_token(t)
            step = None
            if logprobs is not None:
                step = logprobs[:]
                logprobs.clear()
            text = detok.last_segment
            end = drafted_end if drafted_end is not None else start + len(text)
            drafted = min(max(end - start, 0), len(text)) if drafts else 0
            yield Chunk(text=text, tokens=tokens, stats=stats, logprobs=step, drafted_chars=drafted)
        detok.finalize()
        tail = detok.last_segment
        if tail and stats is not None:
            yield Chunk(text=tail, tokens=[], stats=stats, logprobs=None if logprobs is None else [])

    def check_context(self, prompt_tokens: int, max_tokens: int) -> int:
        """Refuse a prompt the model's context cannot hold; cut max_tokens to what is left."""
        limit = self.target.context_length
        if limit is None:
            return max_tokens
        if prompt_tokens >= limit:
            raise UsageError(f"the prompt is {prompt_tokens} tokens but {self.name} has a context of "
                             f"{limit} tokens (max_position_embeddings); shorten the prompt")
        return min(max_tokens, limit - prompt_tokens)

    def generate(self, prompt, request: GenerationRequest | None = None, **options) -> Result:
        """Run to completion; returns text, tokens and stats. Arguments as :meth:`stream`'s."""
        parts: list[str] = []
        tokens: list[int] = []
        logprobs: list[TokenLogprob] | None = None
        stats = Stats()
        for chunk in self.stream(prompt, request, **options):
            parts.append(chunk.text)
            tokens.extend(chunk.tokens)
            stats = chunk.stats
            if chunk.logprobs is not None:
                logprobs = logprobs if logprobs is not None else []
                logprobs.extend(chunk.logprobs)
        return Result(text="".join(parts), tokens=tokens, stats=stats, finish_reason=stats.finish_reason,
                      logprobs=logprobs)


def _request(request: GenerationRequest | None, options: dict) -> GenerationRequest:
    if request is None:
        return GenerationRequest(**options)
    return replace(request, **options) if options else request


def load(model=None, draft_model=None, *, prompt_cache_bytes: int = DEFAULT_PROMPT_CACHE_BYTES) -> SpecModel:
    """Load MODEL (path / cached repo id / None for the default or demo) and an optional draft;
    earlier prompts' caches are kept up to PROMPT_CACHE_BYTES (``SpecModel.prompt_cache``)."""
    target = load_model(model, world())  # world(): the mlx.launch group, None for one process
    if target.tokenizer is None:  # a drafter-only checkpoint (DFlash, Gemma-4 assistant)
        raise UsageError(f"{target.name} is a drafter, not a model: use it as draft_model for its target")
    draft = None
    if draft_model is not None:
        from .engine.drafters.draft_model import check_compatible
        from .models.gemma4_assistant import Gemma4Assistant, check_pair

        try:
            draft = load_model(draft_model)
        except (ModelNotFoundError, InvalidCheckpointError) as err:  # say which of the two models
            text = str(err)
            raise type(err)(f"draft {text}" if text.startswith("model ") else f"draft model: {text}") from None
        from .models import dflash

        if isinstance(draft.model, Gemma4Assistant):  # drafts from the target's own cache
            check_pair(target.model, draft.model)
        elif isinstance(draft.model, dflash.DFlashDraftModel):  # drafts from the target's layers
            dflash.check_pair(target.model, draft.model, draft.name)
        else:
            check_compatible(target, draft)
    return SpecModel(target, draft, prompt_cache_bytes)
