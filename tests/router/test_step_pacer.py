"""The step pacer (prompt tokens a step may add beside decodes, from measured
step times) and the scheduler under its cap. No model: times are made up."""

import pytest

from tgi_router.scheduling.block_manager import BlockManager
from tgi_router.scheduling.scheduler import Scheduler
from tgi_router.scheduling.step_pacer import StepPacer

from .test_scheduler import answer, seq


def cpu_like(pacer: StepPacer, token_s: float = 0.002) -> None:
    """Decode-only steps cost 0.04 + 0.0025 x decodes seconds; a prompt token
    `token_s` more beside them."""
    for decodes in (8, 64, 32, 64, 16):
        pacer.observe(decodes, 0, 0.04 + 0.0025 * decodes)
    for _ in range(20):
        pacer.observe(64, 128, 0.2 + 128 * token_s)


def test_no_cap_before_steps_are_seen_or_without_decodes():
    pacer = StepPacer(min_tokens=16)
    assert pacer.prompt_cap(64, 64) is None
    pacer.observe(64, 0, 0.2)
    assert pacer.prompt_cap(64, 64) is None  # no prompt token's cost yet
    cpu_like(pacer)
    assert pacer.prompt_cap(0, 64) is None  # nobody waits on this step


def test_a_step_with_decodes_stays_within_the_stall_ratio():
    pacer = StepPacer(min_tokens=16, stall_ratio=2.5)
    cpu_like(pacer)
    assert pacer.decode_seconds(64) == pytest.approx(0.2)
    assert pacer.decode_seconds(8) == pytest.approx(0.06)
    # 0.2 + cap x 0.002 = 2.5 x 0.2
    assert pacer.prompt_cap(64, 64) == pytest.approx(150, abs=1)
    # a small batch alone: 0.06 + cap x 0.002 = 2.5 x 0.06
    assert pacer.prompt_cap(8, 8) == pytest.approx(45, abs=1)
    # a small batch with a queue about to fill it paces against the full batch's step
    assert pacer.prompt_cap(8, 64) == pytest.approx(220, abs=1)


def test_cheap_prompt_tokens_leave_the_budget_to_decide():
    """A GPU: a decode step of 12 ms, a prompt token 30 us beside it."""
    pacer = StepPacer(min_tokens=16)
    for decodes in (8, 64, 32):
        pacer.observe(decodes, 0, 0.011 + decodes / 64 * 0.001)
    for _ in range(20):
        pacer.observe(64, 2048, 0.012 + 2048 * 3e-5)
    assert pacer.prompt_cap(64, 64) == pytest.approx(600, abs=2)


def test_the_cap_follows_a_host_that_slows_down_within_a_few_steps():
    pacer = StepPacer(min_tokens=16)
    cpu_like(pacer)
    before = pacer.prompt_cap(64, 64)
    for _ in range(10):
        pacer.observe(64, 128, 0.2 + 128 * 0.004)  # prompt tokens now cost twice as much
    assert pacer.prompt_cap(64, 64) < 0.6 * before


def test_the_cap_never_goes_below_min_tokens():
    pacer = StepPacer(min_tokens=16)
    cpu_like(pacer, token_s=0.5)
    assert pacer.prompt_cap(64, 64) == 16


class FixedCap:
    """A pacer whose cap is given; records what it was told."""

    def __init__(self, cap: int):
        self.cap, self.seen = cap, []

    def prompt_cap(self, decodes: int, batch: int) -> int | None:
        return self.cap if decodes else None

    def observe(self, decodes: int, prompt_tokens: int, seconds: float) -> None:
        self.seen.append((decodes, prompt_tokens))


def test_prompt_tokens_beside_decodes_are_capped_and_a_cut_join_goes_on():
    pacer = FixedCap(6)
    # The ratio would keep newcomers out while 2 run and fewer than 20 wait.
    s = Scheduler(BlockManager(64, 4), max_batch_tokens=64, waiting_served_ratio=10.0, max_waiting_tokens=100,
                  pacer=pacer)
    a, b = seq(1, 3, max_new=50), seq(2, 3, max_new=50)
    s.add(a)
    s.add(b)
    step = s.schedule()  # nothing decodes yet: no cap
    assert [(x.id, n) for x, n in step.seqs] == [(1, 3), (2, 3)]
    s.update(step, answer(step))
    # 22 newcomers: enough for the ratio (>= 10 x 2 running) to let them join
    newcomers = [seq(i, 5, max_new=50) for i in range(3, 25)]
    for n in newcomers:
        s.add(n)
    step = s.schedule()
    assert [(x.id, n) for x, n in step.seqs] == [(1, 1), (2, 1), (3, 5), (4, 1)]  # 6 prompt tokens
    s.update(step, answer(step))
    # 20 still wait against 4 running: under the ratio, but the join goes on
    step = s.schedule()
    assert [(x.id, n) for x, n in step.seqs] == [(1, 1), (2, 1), (3, 1), (4, 4), (5, 2)]
    s.update(step, answer(step))
    assert pacer.seen == [(0, 6), (2, 6), (3, 6)]  # decodes: sequences past their prompt


def test_schedule_ahead_caps_prompt_tokens_too():
    s = Scheduler(BlockManager(64, 4), max_batch_tokens=64, pacer=FixedCap(4))
    a = seq(1, 3, max_new=50)
    s.add(a)
    first = s.schedule()
    s.to_request(first, 1)
    s.add(seq(2, 10, max_new=5))
    ahead = s.schedule_ahead(first)  # a samples in the step in flight: it decodes in this one
    assert [(x.id, n) for x, n in ahead.seqs] == [(1, 1), (2, 4)]
