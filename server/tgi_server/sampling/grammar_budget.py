"""Finishing a constrained sequence within its token budget.

A sequence under a grammar with `remaining` tokens still to generate keeps a
*plan*: model tokens that complete the grammar from where it stands (a
shortest completion in bytes, tgi_proto.grammar_walk, tokenized). The
invariant is len(plan) <= remaining. Before a token is sampled the row's
candidates are checked against it: a candidate t is allowed only when the
grammar can still be completed from "after t" within remaining - 1 tokens,
and the plan's first token always passes. So the output is complete when
the budget runs out, whatever the model prefers.

Which candidates are checked:
- greedy rows: the argmax, then the next best while it fails (at most
  `_TRIES`, then the plan's token): the token the sampler takes is always
  one that fits.
- sampling rows: within `_NEAR` tokens of slack, the `_TOP` most likely
  tokens and the plan's first, and the draw is restricted to those that
  pass; with more slack, the drawn token after the draw (`settle`), replaced
  by the plan's next token in the rare case it does not fit (it commits the
  text to more than the slack, e.g. an optional key whose value has
  required parts).
The plan is kept exact at every step, for every constrained sequence: that
is the check of the chosen token, and it costs ~0.07 ms a token for
SmolLM2 writing the grammar benchmark's 10-person JSON (a 155-token plan at
the start), because the shortcuts below almost always apply.

A plan after a token is found cheaply when it can be: the old plan minus
that token; the old plan itself (a letter inside a free string changes
nothing); the old plan from one of its next few bytes on (a different
digit, a different word); else a fresh walk."""

import logging
from dataclasses import dataclass

import llguidance as llg
import torch

from tgi_proto.grammar_walk import WalkState

__all__ = ["Budget", "Plan", "PlanMaker"]

log = logging.getLogger("tgi_server")

_TRIES = 8      # greedy rows: candidates checked before taking the plan's token
_TOP = 4        # sampling rows near the end: candidates checked
_NEAR = 8       # sampling rows: slack (tokens) under which candidates are checked
_RESUME = 16    # bytes of the old plan to try resuming from
_WALK_NODES = 0  # per-step walks: the greedy dive alone (tgi_proto.grammar_walk)


@dataclass
class Plan:
    """A completion from some state: its tokens, its bytes, and the walk
    state it starts from (None when the grammar is complete or ended)."""
    tokens: list[int]
    data: bytes
    state: WalkState | None


class PlanMaker:
    """Turns bytes into plans for one model's tokenizer."""

    def __init__(self, tokenizer: llg.LLTokenizer, eos_token_ids: list[int]):
        self.tokenizer = tokenizer
        self.eos = list(eos_token_ids) or list(tokenizer.eos_tokens)  # the first is the one to write
        self._bytes: dict[int, bytes | None] = {}

    def token_bytes(self, token: int) -> bytes | None:
        """The bytes a token writes; None for special tokens (EOS ends the text)."""
        if token not in self._bytes:
            self._bytes[token] = None if token in self.eos or self.tokenizer.is_special_token(token) \
                else self.tokenizer.decode_bytes([token])
        return self._bytes[token]

    def plan(self, state: WalkState, data: bytes) -> Plan:
        return Plan(self.tokenizer.tokenize_bytes(data) if data else [], data, state)

    def after(self, plan: Plan, token: int) -> Plan | None:
        """A plan from the state after `token`, None when the grammar has no
        completion from there that the walk finds."""
        data = self.token_bytes(token)
        if data is None:  # EOS: allowed by the grammar only once complete
            return Plan([], b"", None)
        state = plan.state.copy()
        if plan.tokens and token == plan.tokens[0]:  # the plan's own token: its rest follows
            state.advance(data)
            return Plan(plan.tokens[1:], plan.data[len(data):], state)
        if not state.advance(data):
            return None
        if plan.data.startswith(data):
            return self.plan(state, plan.data[len(data):])
        for start in range(min(_RESUME, len(plan.data)) + 1):
            if state.completes(plan.data[start:]):
                return Plan(plan.tokens, plan.data, state) if start == 0 else self.plan(state, plan.data[start:])
        found = state.shortest(_WALK_NODES)
        return None if found is None else self.plan(state, found)


class Budget:
    """One constrained sequence's budget: tokens it may still generate, and its plan."""

    def __init__(self, remaining: int, plan: Plan, greedy: bool):
        self.remaining = remaining
        self.plan: Plan | None = plan  # None: no completion known any more (logged)
        self.greedy = greedy
        self._checked: dict[int, Plan] = {}  # this step's candidates that fit, with their plans
        self._warned = False

    def restrict(self, maker: PlanMaker, row: torch.Tensor) -> None:
        """Before sampling: forbids in `row` ([V] float32 logits, grammar mask
        applied) the candidates that would leave no completion within budget."""
        self._checked = {}
        if self.plan is None or self.plan.state is None:
            return
        if self.greedy:
            for _ in range(_TRIES):
                token = int(row.argmax())
                if row[token] == float("-inf"):
                    break
                if self._fits(maker, token):
                    return
                row[token] = float("-inf")
            self._only_plan(maker, row)
        elif self.remaining - len(self.plan.tokens) <= _NEAR:
            top = torch.topk(row, min(_TOP, row.shape[0]))
            keep = [int(t) for v, t in zip(top.values, top.indices)
                    if v != float("-inf") and self._fits(maker, int(t))]
            if not keep:
                self._only_plan(maker, row)
            else:
                keep.extend(self._plan_next(maker, row))
                values = row[keep].clone()
                row.fill_(float("-inf"))
                row[keep] = values

    def settle(self, maker: PlanMaker, token: int) -> int:
        """After the draw: `token` when a completion within budget remains after
        it, else the plan's next token (EOS once complete). Only a sampling
        row's draw with more than `_NEAR` tokens of slack, which `restrict`
        does not check, can be replaced."""
        if self.plan is None or token in self._checked or self._fits(maker, token):
            return token
        return self.plan.tokens[0] if self.plan.tokens else maker.eos[0]

    def advance(self, maker: PlanMaker, token: int) -> None:
        """After sampling `token` (settled)."""
        self.remaining -= 1
        if self.plan is None or self.plan.state is None:  # unknown, or ended with EOS
            return
        plan = self._checked.get(token) or maker.after(self.plan, token)
        self._checked = {}
        if plan is None or len(plan.tokens) > self.remaining:
            if not self._warned:
                self._warned = True
                log.warning("a constrained sequence may not finish its grammar within max_new_tokens "
                            "(%d tokens left, completion %s)", self.remaining,
                            "unknown" if plan is None else f"{len(plan.tokens)} tokens")
        self.plan = plan

    def _fits(self, maker: PlanMaker, token: int) -> bool:
        if self.plan.state is None:  # ended (EOS): nothing follows
            return True
        plan = maker.after(self.plan, token)
        if plan is None or len(plan.tokens) > self.remaining - 1:
            return False
        self._checked[token] = plan
        return True

    def _plan_next(self, maker: PlanMaker, row: torch.Tensor) -> list[int]:
        """The tokens that surely fit: the plan's next, or the EOS tokens the
        grammar allows once it is complete."""
        if self.plan.tokens:
            self._fits(maker, self.plan.tokens[0])
            return [self.plan.tokens[0]]
        return [t for t in maker.eos if t < row.shape[0] and row[t] != float("-inf")]

    def _only_plan(self, maker: PlanMaker, row: torch.Tensor) -> None:
        """Leaves `row` only the tokens that surely fit."""
        keep = self._plan_next(maker, row)
        if not keep:
            return
        values = row[keep].clone()
        row.fill_(float("-inf"))
        # The plan's token is allowed by the grammar (its bytes complete it); should
        # llguidance's mask disagree, the plan still wins: it is the budget's guarantee.
        row[keep] = torch.where(values == float("-inf"), 0.0, values)
