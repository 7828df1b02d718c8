"""How many tokens each decoding sequence may draft in a step (--speculate).

A draft costs what any token of the step costs and is worth the chance that
it is accepted. With a sequence's acceptance rate a (each draft accepted
with probability a once the one before it was), its i-th draft adds a^i
tokens in expectation. The step's time is modelled as a line over the
tokens it computes, seconds = base + per_token x tokens (decayed least
squares over recent decode-only steps, as measured by the shards), so
that the i-th draft is worth computing when it adds tokens at least at the
rate the step yields them without it:

    a^i / per_token >= tokens out / seconds,  i.e.  a^i >= per_token x B / (base + per_token x B)

for a step of B decoding sequences. On a CPU a one-token step of a small
model is mostly the weights' read (base >> per_token): at B = 1 even a
draft accepted one time in ten pays, and a sequence copying its prompt
drafts all N. At B = 32 the step is compute-bound (per_token x B ~ 5 x
base): only drafts accepted ~85% of the time or more pass, so a loaded
server barely drafts and is never slowed by it. A sequence's rate starts
at the rate over all sequences (PRIOR drafts' worth) and follows its own
drafts after; steps with prompt tokens do not enter the line.

Both estimates change only from the steps that drafting shapes, so either
could lock speculation off for good, and neither may:
- The line. One slow step of a single sequence (the host's hiccup) can
  tilt it to a steep slope and a negative base, clamped to 0: the threshold
  becomes 1, nothing drafts again, every step computes one token, and a
  line needs steps of different sizes to change its slope (seen in an A/B:
  docs/tuning.md#speculation-policy). A step now enters as at most
  OUTLIER x the line's time for it, and a line whose base comes out
  negative is forgotten: the next steps draft in full and measure it again.
- The rates. After a sequence that writes text of its own (its drafts
  rejected) the global rate, and every new sequence's with it, can fall
  below the threshold. A sequence the rule gives no draft is allowed one,
  a probe, once every P steps, with P = threshold / PROBE_COST: a probe
  costs per_token seconds of a step of base + per_token x B for B
  sequences, so probes from all of them cost threshold / P = PROBE_COST
  of the step's time at most. At B = 1 on a CPU that is a probe every few
  steps; under load, every hundred or so.

Pure Python: the scheduler asks `drafts`, and `observe` reads each step's
answer."""

from collections.abc import Iterable

from tgi_proto import pb
from tgi_router.scheduling.decayed_line import DecayedLine
from tgi_router.scheduling.sequence import Sequence

DECAY = 0.97        # weight of the previous steps in the cost line at each new one
SEQ_DECAY = 0.9     # weight of a sequence's older drafts in its rate
PRIOR = 4.0         # drafts' worth of the global rate in a new sequence's rate
START_RATE = 0.5    # the global rate before any draft was checked
PROBE_COST = 0.01   # share of a step's time that probes may cost
OUTLIER = 3.0       # a step enters the cost line as at most this many times the line's time for it


class SpeculationPolicy:
    def __init__(self, max_drafts: int):
        self.max_drafts = max_drafts
        self._steps = DecayedLine(DECAY)  # decode-only steps: seconds over tokens computed
        self._slope: float | None = None  # the last per-token cost the steps' spread could tell
        self._cost_line: tuple[float, float] | None = None  # refitted as each decode-only step enters
        self._accepted = 0.0  # all sequences, decayed like a sequence's rate
        self._checked = 0.0
        self.total_drafted = 0   # since start: drafts the shards checked
        self.total_accepted = 0  # ... and accepted

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafts per drafted token since start (0 before any draft)."""
        return self.total_accepted / self.total_drafted if self.total_drafted else 0.0

    def rate(self, seq: Sequence) -> float:
        """seq's acceptance rate: each draft's chance, once the one before it was accepted."""
        prior = self._accepted / self._checked if self._checked else START_RATE
        return (seq.draft_accepted + PRIOR * prior) / (seq.draft_checked + PRIOR)

    def drafts(self, decoding: Iterable[Sequence], batch: int) -> dict[int, int]:
        """Draft tokens for each of `decoding` in a step of `batch` decoding
        sequences (ids with 0 are left out). Called once per step planned:
        it counts each sequence's steps without drafts, for its probes."""
        out = {}
        threshold = self._threshold(batch)
        probe_every = threshold / PROBE_COST
        for seq in decoding:
            a, k = self.rate(seq), 0
            reach = a
            while k < self.max_drafts and reach >= threshold:
                k += 1
                reach *= a
            if not k and self.max_drafts and seq.steps_undrafted + 1 >= probe_every:
                k = 1
            if k:
                out[seq.id] = k
                seq.steps_undrafted = 0
            else:
                seq.steps_undrafted += 1
        return out

    @property
    def cost_line(self) -> tuple[float, float] | None:
        """(base seconds, seconds per token) of a decode-only step as the policy
        models it now, or None before any such step."""
        return self._cost_line

    def _threshold(self, batch: int) -> float:
        """The least expected tokens a draft must add: per_token x B / step seconds."""
        line = self._cost_line
        if line is None:
            return 0.0  # no measure yet: draft, and learn the costs
        base, per_token = line
        seconds = base + per_token * batch
        return per_token * batch / seconds if seconds > 0 else 0.0

    def _refit(self) -> None:
        """The cost line of the steps seen so far."""
        fit = self._steps.fit(min_var=0.25)
        if fit is None:
            return
        mn, mt, slope = fit
        if slope is not None:  # steps of different sizes seen: their spread measures a token's cost
            self._slope = slope
        slope = self._slope or 0.0
        if mt - slope * mn < 0:  # not a line of these steps: forget the slope, draft, and learn it again
            self._slope = None
            self._cost_line = mt, 0.0
        else:
            self._cost_line = mt - slope * mn, slope

    def observe(self, seqs: list[tuple[Sequence, int]], drafts: dict[int, int],
                generations: dict[int, pb.Generation], seconds: float) -> None:
        """A step's answer: (sequence, tokens scheduled incl. drafts) as sent,
        the drafts allowed, each sequence's generation, the shards' seconds."""
        computed, decode_only = 0, True
        for seq, n in seqs:
            gen = generations[seq.id]
            allowed = drafts.get(seq.id, 0)
            computed += n - allowed + gen.num_drafted
            decode_only &= n - allowed == 1 and seq.num_generated > 0
            if gen.num_drafted:
                accepted = len(gen.next_tokens)
                checked = accepted + (accepted < gen.num_drafted)
                seq.draft_accepted = SEQ_DECAY * seq.draft_accepted + accepted
                seq.draft_checked = SEQ_DECAY * seq.draft_checked + checked
                self._accepted = SEQ_DECAY * self._accepted + accepted
                self._checked = SEQ_DECAY * self._checked + checked
                self.total_drafted += gen.num_drafted
                self.total_accepted += accepted
        if decode_only and seqs:
            line = self._cost_line
            if line is not None:  # a hiccup of the host enters as OUTLIER x the line's time at most
                seconds = min(seconds, OUTLIER * (line[0] + line[1] * computed))
            self._steps.add(computed, seconds)
            self._refit()
