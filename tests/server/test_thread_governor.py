"""The shard's OpenMP threads follow the cores other processes leave free,
and a thread count never changes what the model computes."""

import os
import subprocess
import sys
import time

import pytest
import torch

from tgi_proto import pb
from tgi_server.batch import build_batch
from tgi_server.config import ShardConfig
from tgi_server.sequences import ShardSequence
from tgi_server.shard import load_shard
from tgi_server.thread_governor import ThreadGovernor, busy_seconds, threads_for

TICK = os.sysconf("SC_CLK_TCK")


def stat(*cores: tuple[int, int]) -> str:
    """/proc/stat text: one (busy ticks, idle ticks) pair a core, the busy
    ticks spread over user, system and steal."""
    total = [sum(c) for c in zip(*cores)]
    lines = [f"cpu  {total[0] - 2} 0 1 {total[1]} 0 0 0 1 0 0"]
    lines += [f"cpu{i} {busy - 2} 0 1 {idle} 0 0 0 1 0 0" for i, (busy, idle) in enumerate(cores)]
    return "\n".join(lines + ["intr 12 0 0", "ctxt 99"]) + "\n"


def test_busy_seconds_sums_the_busy_fields_of_the_given_cores():
    text = ("cpu  9 9 9 9 9 9 9 9 0 0\ncpu0 1 2 3 100 50 4 5 6 7 8\ncpu1 10 0 0 0 0 0 0 0 0 0\n"
            "cpu7 5 0 0 0 0 0 0 0 0 0\n")
    # user nice system irq softirq steal; idle, iowait and guest time (inside user) left out
    assert busy_seconds(text, {0}) == pytest.approx(21 / TICK)
    assert busy_seconds(text, {0, 7}) == pytest.approx(26 / TICK)
    assert busy_seconds(text, {3}) == 0


@pytest.mark.parametrize("others, cpus, ceiling, expected", [
    (0.0, 2, 2, 2), (0.4, 2, 2, 2), (0.6, 2, 2, 1), (1.0, 2, 2, 1), (2.0, 2, 2, 1), (1.6, 8, 4, 4),
    (5.7, 8, 8, 2), (0.0, 8, 1, 1)])
def test_one_thread_a_core_others_leave_at_least_half_free(others, cpus, ceiling, expected):
    assert threads_for(others, cpus, ceiling) == expected


class FakeHost:
    """Two cores, a clock, this process's CPU time, all moved by the test."""

    def __init__(self):
        self.now, self.own, self.busy = 100.0, 5.0, [0, 0]
        self.set_to: list[int] = []

    def run(self, seconds: float, ours: float, others: float):
        """`seconds` pass; this process spends `ours` CPU seconds, others `others`."""
        self.now += seconds
        self.own += ours
        ticks = round((ours + others) * TICK)
        self.busy = [self.busy[0] + ticks // 2, self.busy[1] + ticks - ticks // 2]

    def governor(self, ceiling: int = 2) -> ThreadGovernor:
        return ThreadGovernor(ceiling, {0, 1}, read_stat=lambda: stat(*((b + 2, 1000) for b in self.busy)),
                              own_seconds=lambda: self.own, clock=lambda: self.now, set_threads=self.set_to.append)


def test_threads_drop_while_another_process_keeps_a_core_and_come_back_when_it_leaves():
    host = FakeHost()
    g = host.governor()
    host.run(0.5, ours=0.9, others=0.05)  # the router and clients: a few percent
    assert g.update() == pytest.approx(0.1, abs=0.05) and g.threads == 2 and host.set_to == []
    host.run(0.5, ours=0.5, others=0.5)   # a competitor shares both cores: a core's worth
    assert g.update() == pytest.approx(1.0, abs=0.05)
    assert g.threads == 1 and host.set_to == [1]
    host.run(0.5, ours=0.4, others=0.6)
    g.update()
    assert host.set_to == [1]             # set once, not at every update
    host.run(0.5, ours=0.5, others=0.0)
    g.update()
    assert g.threads == 2 and host.set_to == [1, 2]


def test_the_ceiling_is_the_configured_count():
    host = FakeHost()
    g = host.governor(ceiling=1)
    host.run(0.5, ours=0.5, others=0.0)
    g.update()
    assert g.threads == 1 and host.set_to == []


def test_the_real_host_is_read():
    """/proc/stat and this process's CPU time: a busy child on this
    process's cores counts as others' work, this process's own spin does
    not. Against the host's own load over a quiet second first (a shared
    machine may have another process busy throughout)."""
    g = ThreadGovernor(torch.get_num_threads(), set_threads=lambda n: None)
    g.update()
    time.sleep(1.0)
    base = g.update()
    if base > len(os.sched_getaffinity(0)) - 0.8:
        pytest.skip(f"other processes keep {base:.1f} cores busy: no room for the child to show")
    child = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(1.0)
        assert g.update() > base + 0.6  # the child kept about a core busy
    finally:
        child.kill()
        child.wait()
    g.update()
    deadline = time.perf_counter() + 1.0
    while time.perf_counter() < deadline:  # this process busy, nobody else
        pass
    assert g.update() < base + 0.5


def _logits(runner, prompt: list[int]) -> torch.Tensor:
    """[len(prompt) + 1, vocab]: the prompt's prefill logits, then one decode
    step's (the prompt's last token again, read against the cached rest)."""
    blocks = list(range(-(-(len(prompt) + 1) // runner.block_size)))
    prefill = ShardSequence(id=1, token_ids=list(prompt), prompt_length=len(prompt), num_computed=0,
                            block_table=blocks, params=None, prefill_logprobs=True, scheduled=len(prompt))
    decode = ShardSequence(id=1, token_ids=[*prompt, prompt[-1]], prompt_length=len(prompt),
                           num_computed=len(prompt), block_table=blocks, params=None, prefill_logprobs=False,
                           scheduled=1)
    out = []
    with torch.inference_mode():
        for seq in (prefill, decode):
            batch = build_batch([seq], runner.block_size, runner.device)
            out.append(runner.model.logits(runner.model(batch.input_ids, runner.context(batch)),
                                           batch.logits_rows))
    return torch.cat(out)


@pytest.mark.slow
def test_logits_do_not_depend_on_the_thread_count(tmp_path, smollm2_hf):
    """The governor changes torch's threads between steps: the default
    model's kernels (int4 GEMV on int8 activations, the int8 head, paged
    attention, norms) and the dense float32 GEMMs must split their work
    without reordering a sum. Bitwise, prefill and decode."""
    hf, tokenizer, gguf = smollm2_hf
    dense = tmp_path / "dense"
    hf.save_pretrained(dense)
    tokenizer.save_pretrained(dense)
    prompt = tokenizer("The capital of France is Paris, and the capital of Italy is").input_ids
    threads = torch.get_num_threads()
    try:
        for model in (gguf, dense):
            runner, _ = load_shard(ShardConfig(
                model_id=str(model), revision=None, uds_path=str(tmp_path / "s"), dtype="float32", device="cpu",
                block_size=16, kv_cache_bytes=64 << 20, attention_backend=None, num_threads=0))
            runner.warmup(pb.WarmupRequest(max_batch_prefill_tokens=64, max_batch_size=4))
            by_threads = []
            for n in (1, 2):
                torch.set_num_threads(n)
                by_threads.append(_logits(runner, prompt))
            assert torch.equal(*by_threads), model
    finally:
        torch.set_num_threads(threads)
