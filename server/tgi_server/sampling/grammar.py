"""Constrained decoding: llguidance matchers that mask the tokens a grammar forbids.

A grammar arrives as llguidance's own format (what `LLMatcher.grammar_from_json_schema`,
`grammar_from_regex` or `grammar_from_lark` return), built and validated by the
router. Each constrained sequence owns an `LLMatcher` that has consumed exactly
the tokens the sequence has generated; before sampling, its row of the logits
keeps only the tokens the matcher allows next. A complete grammar (or a matcher
in an error state) allows EOS alone: llguidance's mask does that itself, so the
sequence ends cleanly. A sequence that knows its max_new_tokens also keeps a
Budget (grammar_budget.py), which narrows the mask near the end so that the
grammar completes within it."""

import copy
import functools
import logging
import time
from collections import OrderedDict
from collections.abc import Sequence

import llguidance as llg

# llguidance.numpy, not llguidance.torch: the latter decorates a function with
# torch.compile at import, which imports dynamo and inductor (~1.6 s of every
# shard's start) for a kernel this module does not use.
import llguidance.numpy as llg_numpy
import numpy as np
import torch

from tgi_proto.grammar_walk import walk

from .grammar_budget import Budget, PlanMaker

__all__ = ["GrammarCompiler", "GrammarError", "GrammarMask", "SequenceGrammar"]

log = logging.getLogger("tgi_server")


class GrammarError(ValueError):
    """A grammar this shard cannot use: it does not compile, or llguidance cannot use
    the model's tokenizer."""


class SequenceGrammar:
    """One sequence's position in its grammar: a matcher that has consumed exactly the
    tokens the sequence generated.

    Should the matcher enter an error state (it should not: the mask allows only valid
    tokens; but a step may exhaust its fuel), one warning is logged and from then on
    llguidance's mask allows EOS only, so the sequence ends cleanly."""

    def __init__(self, seq_id: int, matcher: llg.LLMatcher, budget: Budget | None = None):
        self.seq_id = seq_id
        self.matcher = matcher
        self.budget = budget
        self.failed = False

    @property
    def complete(self) -> bool:
        """Whether the text so far is a complete document of the grammar."""
        return not self.failed and self.matcher.is_accepting()

    def check(self) -> None:
        """Logs the warning when the matcher has just entered an error state."""
        if not self.failed and self.matcher.is_error():
            self.failed = True
            log.warning("sequence %d left its grammar (%s); only EOS is allowed from now on",
                        self.seq_id, _first_line(self.matcher.get_error()))


class GrammarCompiler:
    """Compiles grammar texts into matchers for one model's tokenizer and vocabulary.

    The llguidance tokenizer is built on first use (~0.5 s for a 50k vocabulary), so a
    shard that never sees a grammar never pays for it. Compiled matchers are kept as
    templates in an LRU cache keyed by the grammar text; every sequence gets a deep
    copy, so a grammar repeated across requests compiles once.

    Work is bounded by llguidance's default `LLParserLimits`: compiling and each mask
    step run on "fuel" budgets, and a grammar that exhausts them leaves its matcher in
    an error state instead of stalling the shard.

    Not thread-safe: the shard calls it from its one model thread."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: Sequence[int],
                 cache_size: int = 256):
        """tokenizer_json: the `tokenizers` JSON text of the model's tokenizer (non-empty);
        vocab_size: the width V of the logits (may exceed the tokenizer's vocabulary);
        eos_token_ids: the model's end-of-sequence ids (empty: the tokenizer's own)."""
        self.tokenizer_json = tokenizer_json
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.cache_size = cache_size
        self._tokenizer: llg.LLTokenizer | None = None
        self._plans: PlanMaker | None = None
        self._templates: OrderedDict[str, llg.LLMatcher] = OrderedDict()

    def start(self, seq_id: int, grammar: str, generated: Sequence[int], max_new_tokens: int = 0,
              greedy: bool = True) -> SequenceGrammar:
        """Sequence `seq_id`'s state in `grammar` after `generated` (the tokens it already
        produced, non-empty when a preempted sequence is re-sent); max_new_tokens > 0 is
        its budget, which the grammar then completes within (0: none), greedy whether it
        takes the argmax. Raises GrammarError when the grammar does not compile."""
        state = SequenceGrammar(seq_id, self._template(grammar).deep_copy(),
                                self._budget(grammar, max_new_tokens, greedy))
        if generated:
            state.matcher.consume_tokens(list(generated))
            state.check()
            if state.budget is not None:
                for token in generated:
                    state.budget.advance(self._plans, token)
        return state

    def mask(self, rows: Sequence[int], grammars: Sequence[SequenceGrammar],
             prefixes: Sequence[Sequence[int]] | None = None) -> "GrammarMask":
        """The logits processor that masks batch row rows[i] with grammars[i],
        as it stands after prefixes[i] (drafts before that row's position,
        which the grammar allows; none by default)."""
        return GrammarMask(list(rows), list(grammars), self._plans,
                           [list(p) for p in prefixes] if prefixes is not None else [[] for _ in rows])

    def settle(self, mask: "GrammarMask", tokens: Sequence[int]) -> list[int]:
        """The tokens to keep for each row of `mask` given the tokens sampled
        there: the token, or one the row's budget puts in its place (Budget.settle)."""
        return [b.settle(self._plans, token) if b is not None else token for b, token in zip(mask.budgets, tokens)]

    def allowed_prefix(self, grammar: SequenceGrammar, tokens: Sequence[int]) -> int:
        """How many leading tokens of `tokens` the grammar allows after what it consumed."""
        return 0 if grammar.failed else grammar.matcher.validate_tokens(list(tokens))

    def consume(self, chosen: Sequence[tuple[SequenceGrammar, int]]) -> None:
        """Advances each (grammar, sampled token) by its token."""
        live = [(g, token) for g, token in chosen if not g.failed]
        for g, token in live:
            g.matcher.consume_token(token)
            if g.budget is not None:
                g.budget.advance(self._plans, token)
        for g, _ in live:
            g.check()

    def _budget(self, grammar: str, max_new_tokens: int, greedy: bool) -> Budget | None:
        if max_new_tokens <= 0:
            return None
        if self._plans is None:
            self._plans = PlanMaker(self._get_tokenizer(), self.eos_token_ids)
        try:
            grammar_walk = walk(grammar)
        except ValueError:  # compiles for the model's vocabulary, not for bytes: no budget
            return None
        shortest = grammar_walk.shortest()
        if shortest is None:
            log.warning("no completion of a grammar found; its sequences may end unfinished")
            return None
        return Budget(max_new_tokens, self._plans.plan(grammar_walk.start(), shortest), greedy)

    def _template(self, grammar: str) -> llg.LLMatcher:
        template = self._templates.get(grammar)
        if template is not None:
            self._templates.move_to_end(grammar)
            return template
        start = time.perf_counter()
        # log_level=0: llguidance reports errors through is_error(), not stderr.
        template = llg.LLMatcher(self._get_tokenizer(), grammar, log_level=0)
        if template.is_error():
            raise GrammarError(f"the grammar does not compile: {_first_line(template.get_error())}")
        log.debug("compiled a grammar of %d characters in %.1f ms", len(grammar),
                  (time.perf_counter() - start) * 1e3)
        self._templates[grammar] = template
        if len(self._templates) > self.cache_size:
            self._templates.popitem(last=False)
        return template

    def _get_tokenizer(self) -> llg.LLTokenizer:
        if self._tokenizer is None:
            try:
                self._tokenizer = llg.LLTokenizer(self.tokenizer_json, n_vocab=self.vocab_size,
                                                  eos_token=self.eos_token_ids or None)
            except (ValueError, RuntimeError) as err:
                raise GrammarError(f"llguidance cannot use the model's tokenizer: {err}") from None
        return self._tokenizer


class GrammarMask:
    """A `LogitsProcessor` (see sampler.py): sets to -inf, in the rows it governs, every
    token their matchers forbid; other rows are untouched.

    The masks are computed when the processor is called, after the forward has been
    queued: on a GPU, unless something earlier in the step waited for the device
    (e.g. penalties), llguidance's CPU work overlaps the model's kernels."""

    def __init__(self, rows: list[int], grammars: list[SequenceGrammar], plans: PlanMaker | None,
                 prefixes: list[list[int]]):
        self.rows = rows
        self.grammars = grammars
        self.plans = plans
        self.prefixes = prefixes
        # Per row, the budget as it stands at the row's position (a copy past
        # drafts), filled when the mask is applied; None: no budget.
        self.budgets: list[Budget | None] = [None] * len(rows)

    def __call__(self, logits: torch.Tensor) -> None:
        """logits [B, V] float32, modified in place; V is the vocabulary size the
        compiler was built with."""
        batch, vocab = logits.shape
        # One bit per token, 32 tokens per int32 word: [R, ceil(V / 32)], filled on the
        # CPU row by row (~30 us a row for JSON Schema on a 49k vocabulary).
        # Not llguidance's parallel fill (LLExecutor): its worker threads
        # compete with torch's for the cores during the forward.
        words = np.empty(llg_numpy.get_bitmask_shape(len(self.rows), vocab), dtype=np.int32)
        for i, (g, prefix) in enumerate(zip(self.grammars, self.prefixes)):
            if prefix:  # the state after the drafts, then back
                g.matcher.consume_tokens(prefix)
            llg_numpy.fill_next_token_bitmask(g.matcher, words, i)
            if prefix:
                g.matcher.rollback(len(prefix))
            self.budgets[i] = self._budget(g, prefix)
        for g in self.grammars:
            g.check()
        bitmask = torch.from_numpy(words)  # [R, ceil(V / 32)] int32, sharing the words
        # Unpacked on the logits' device (a GPU receives 1/8 of the bytes of a bool
        # mask). Seen as bytes (little-endian), byte b holds tokens 8b..8b+7, lowest bit
        # first. A table maps each byte to its 8 additive biases (0 allowed, -inf
        # forbidden): one gather and one add, several times faster on a CPU than
        # shifting bits or masked_fill with a bool mask.
        mask_bytes = bitmask.to(logits.device).view(torch.uint8).view(-1)  # [R * 4 * NW]
        bias = _byte_biases(logits.device).index_select(0, mask_bytes.int())  # [R * 4 * NW, 8]
        bias = bias.view(len(self.rows), -1)[:, :vocab]  # [R, V] float32
        if self.rows == list(range(batch)):
            logits.add_(bias)
        else:
            index = torch.tensor(self.rows, device=logits.device)  # [R]
            logits.index_add_(0, index, bias)
        for row, budget in zip(self.rows, self.budgets):
            if budget is not None:
                budget.restrict(self.plans, logits[row])

    def _budget(self, g: SequenceGrammar, prefix: list[int]) -> Budget | None:
        """g's budget at a row after `prefix`: its own, or a copy advanced past the drafts."""
        if g.budget is None or g.failed:
            return None
        if not prefix:
            return g.budget
        budget = copy.copy(g.budget)
        for token in prefix:
            budget.advance(self.plans, token)
        return budget


@functools.cache
def _byte_biases(device: torch.device) -> torch.Tensor:
    """[256, 8] float32: row b holds, lowest bit first, 0 for each bit of byte b that
    is set (allowed) and -inf for each that is clear (forbidden)."""
    bits = (torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1  # [256, 8]
    return torch.where(bits == 1, 0.0, float("-inf")).to(device)


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else "unknown error"
