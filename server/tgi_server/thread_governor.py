"""Fits the shard's OpenMP thread count to the cores other processes leave it.

A decode step holds ~300 parallel regions, each ending with every thread
waiting for the slowest. libgomp's threads spin a while before they sleep:
on a quiet host that saves the wake-ups, but beside a busy process a
spinning thread burns the share of CPU the thread it waits for needed, and
one thread then keeps more of its quiet speed than several, spinning or
not (figures: docs/tuning.md#thread-governor). So threads spin, and there
are only as many as cores that other processes leave free: every PERIOD_S
the governor reads how busy the cores this process may run on were
(/proc/stat), takes away this process's own CPU time, and counts a core as
taken where others kept it busy at least half the time. Fewer threads
never change a result: every kernel the shard runs splits its work over
threads by output rows or heads, never by the summed dimension
(tests/server/test_thread_governor.py holds greedy tokens and logits to
that)."""

import asyncio
import logging
import os
import time
from collections.abc import Callable

import torch

log = logging.getLogger("tgi_server")

PERIOD_S = 0.5
_BUSY_FIELDS = (0, 1, 2, 5, 6, 7)  # user nice system irq softirq steal (guest time is inside user)


def busy_seconds(stat_text: str, cpus: set[int]) -> float:
    """CPU seconds the given cores spent busy since boot, from /proc/stat's
    per-core lines ("cpuN user nice system idle iowait irq softirq steal ...",
    in clock ticks)."""
    ticks = 0
    for line in stat_text.splitlines():
        name, _, rest = line.partition(" ")
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
            fields = rest.split()
            ticks += sum(int(fields[i]) for i in _BUSY_FIELDS if i < len(fields))
    return ticks / os.sysconf("SC_CLK_TCK")


def threads_for(others: float, cpus: int, ceiling: int) -> int:
    """Threads to run beside `others` cores' worth of other processes' work
    on `cpus` cores: one per core they leave at least half free, at most
    `ceiling`, at least one."""
    return max(1, min(ceiling, cpus - int(others + 0.5)))


def _read_stat() -> str:
    with open("/proc/stat") as f:
        return f.read()


class ThreadGovernor:
    """Sets torch's thread count from the load of the last period; `update`
    is cheap (two small reads) and runs between model calls, on the thread
    that makes them."""

    def __init__(self, ceiling: int, cpus: set[int] | None = None,
                 read_stat: Callable[[], str] = _read_stat,
                 own_seconds: Callable[[], float] = time.process_time,
                 clock: Callable[[], float] = time.monotonic,
                 set_threads: Callable[[int], None] = torch.set_num_threads):
        self.ceiling = ceiling
        self.cpus = cpus if cpus is not None else os.sched_getaffinity(0)
        self.threads = ceiling
        self._read_stat, self._own_seconds, self._clock, self._set_threads = read_stat, own_seconds, clock, set_threads
        self._last = self._sample()

    def _sample(self) -> tuple[float, float, float]:
        return self._clock(), busy_seconds(self._read_stat(), self.cpus), self._own_seconds()

    def update(self) -> float:
        """Measures the cores others used since the last update (cores'
        worth, averaged over the wall time between) and sets the threads
        for it; returns that figure."""
        now = self._sample()
        wall = now[0] - self._last[0]
        others = max(0.0, (now[1] - self._last[1]) - (now[2] - self._last[2])) / wall if wall > 0 else 0.0
        self._last = now
        threads = threads_for(others, len(self.cpus), self.ceiling)
        if threads != self.threads:
            log.info("%d -> %d OpenMP threads: other processes kept %.1f of the %d cores busy",
                     self.threads, threads, others, len(self.cpus))
            self._set_threads(threads)
            self.threads = threads
        return others

    async def run(self) -> None:
        """Updates every PERIOD_S until cancelled."""
        while True:
            await asyncio.sleep(PERIOD_S)
            self.update()
