"""The token budget of one step, and the one rule by which a sequence takes
its tokens from it."""

from dataclasses import dataclass


@dataclass
class StepBudget:
    """Tokens one step may still compute: `tokens` in all, of which at most
    `prompt` go to sequences that need more than one (a prompt's chunk, or
    a preempted sequence's recompute); a sequence that needs one decodes
    and is bounded by `tokens` only.

    The one accounting rule: a sequence needs `len(token_ids) - computed`
    more tokens, whether it prefills, prefills in chunks or decodes."""
    tokens: int
    prompt: int

    def offer(self, needed: int) -> int:
        """Tokens a sequence that needs `needed` more (at least 1) may
        compute in this step; 0: none this step."""
        n = min(needed, self.tokens)
        return min(n, self.prompt) if needed > 1 else n

    def take(self, needed: int, n: int) -> None:
        """Charges the `n` tokens (at most `offer(needed)`) that a sequence
        needing `needed` computes in this step."""
        self.tokens -= n
        if needed > 1:
            self.prompt -= n
