"""How many prompt tokens a step may compute beside decoding sequences.

A step that computes prompt tokens delays the next token of every sequence
that decodes in it. On a GPU a few thousand prompt tokens cost a few decode
steps, but on a CPU a token costs about the same in a prompt as in a decode
(the GEMMs are compute-bound from a few dozen rows), so TGI's budget of
4,096 prompt tokens makes one step ~40x a decode step: every running stream
stalls for seconds whenever newcomers join. The pacer bounds that stall by
time, from the shards' own step times: a line of a decode-only step's
seconds against its number of decodes (least squares over recent steps,
older ones weighing less), and a prompt token's cost beside decodes (what a
step took past that line, per prompt token; quick to follow a host that
slows down). A step with decodes may then add the prompt tokens that keep
it within stall_ratio x the decode-only step of the batch about to run:
the running sequences and the waiting ones (so that a nearly empty batch
still admits its queue at a useful pace). Where prompt tokens are cheap (a
GPU, where one costs a small fraction of a decode step:
docs/tuning.md#step-pacer) the bound is far above a CPU's and the step's
budget decides, as in TGI; with nothing decoding, or before both costs have
been seen, there is no bound.

Pure Python, no model: the scheduler asks `prompt_cap` and feeds `observe`
with each step's composition and the shards' time as it applies the answer."""

from tgi_router.scheduling.decayed_line import DecayedLine

STALL_RATIO = 2.5   # a step with prompt tokens may take this many times a decode-only step
DECAY = 0.98        # weight of the previous steps at each new one (~50 steps remembered)
TOKEN_WEIGHT = 0.2  # weight of each new step in the prompt token's cost
MIN_PROMPT = 16     # prompt tokens a step needs to tell their cost from the step's noise


class StepPacer:
    def __init__(self, min_tokens: int, stall_ratio: float = STALL_RATIO, decay: float = DECAY):
        """min_tokens: the cap never goes below it (a block: progress every step)."""
        self.min_tokens = min_tokens
        self.stall_ratio = stall_ratio
        self._decodes = DecayedLine(decay)  # decode-only steps: seconds over decodes
        self._token_s: float | None = None  # EMA of a prompt token's seconds beside decodes

    def observe(self, decodes: int, prompt_tokens: int, seconds: float) -> None:
        """One step that computed `decodes` one-token decodes and
        `prompt_tokens` other tokens in `seconds` on the shards."""
        if prompt_tokens == 0:
            if decodes:
                self._decodes.add(decodes, seconds)
            return
        base = self.decode_seconds(decodes) if decodes else 0.0
        if prompt_tokens < MIN_PROMPT or base is None:
            return
        sample = max(0.0, seconds - base) / prompt_tokens
        # Quick to follow: a host that slows down must shrink the cap within a few steps.
        self._token_s = sample if self._token_s is None else (1 - TOKEN_WEIGHT) * self._token_s + TOKEN_WEIGHT * sample

    def decode_seconds(self, decodes: int) -> float | None:
        """A decode-only step's seconds at `decodes` sequences: a line fitted
        over the decode-only steps seen (their mean where their sizes hardly
        vary), or None before any."""
        fit = self._decodes.fit(min_var=1.0)
        if fit is None:
            return None
        md, mt, slope = fit
        return max(0.0, mt + (slope or 0.0) * (decodes - md))

    def prompt_cap(self, decodes: int, batch: int) -> int | None:
        """Prompt tokens allowed in a step where `decodes` sequences decode
        and the batch will soon hold `batch` sequences (decodes + the
        newcomers waiting); None: no bound beyond the step's budget."""
        if decodes == 0 or not self._token_s:
            return None
        now, reference = self.decode_seconds(decodes), self.decode_seconds(max(decodes, batch))
        if now is None or reference is None:
            return None
        # now + cap x token_s = stall_ratio x reference
        return max(self.min_tokens, int((self.stall_ratio * reference - now) / self._token_s))
