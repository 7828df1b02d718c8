"""Compiled decode steps on the CPU (decode_graphs.DecodeGraphs, mode "compile"):
the greedy tokens of SmolLM2 in float32 are transformers' and the eager
path's, a sequence's logits do not depend on the bucket it is padded into,
and a shard whose compile fails decodes eagerly."""

import asyncio
import logging

import pytest
import torch

from tgi_proto import pb
from tgi_server import decode_graphs
from tgi_server.batch import build_batch
from tgi_server.sequences import ShardSequence

from ..shard_harness import InProcessShard, hf_greedy, run_prompts, save_tiny_model, torch_threads

NEW_TOKENS = 12
TEXTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time,", "The three primary colors are"]


@pytest.fixture
def compiling(monkeypatch):
    monkeypatch.setenv(decode_graphs.COMPILE_ENV, "1")


def _counted(monkeypatch) -> list[int]:
    """The padded size of every compiled step run from now on."""
    ran, run = [], decode_graphs.DecodeGraphs.run

    def counted(self, batch):
        ran.append(decode_graphs.padded_batch_size(self.sizes, batch.num_decode_tokens))
        return run(self, batch)
    monkeypatch.setattr(decode_graphs.DecodeGraphs, "run", counted)
    return ran


def _dir(path):
    path.mkdir(parents=True, exist_ok=True)
    return path


def _decode_batch(runner, prompt_lens: list[int], block_tables: list[list[int]]):
    seqs = [ShardSequence(id=i, token_ids=[(7 * i + j) % 100 for j in range(n)], prompt_length=n - 1,
                          num_computed=n - 1, block_table=table, params=None, prefill_logprobs=False,
                          scheduled=1)
            for i, (n, table) in enumerate(zip(prompt_lens, block_tables))]
    return build_batch(seqs, runner.block_size, runner.device)


@pytest.fixture(scope="module")
def llama_graphs(tmp_path_factory):
    """(the runner of a tiny llama whose decode steps of 2 and 4 rows one
    Warmup compiled, the floors that Warmup measured, its log lines): one
    compile for the tests below, each of which sets the floors it needs."""
    tmp = tmp_path_factory.mktemp("compiled_llama")
    path = save_tiny_model("llama", tmp / "llama")
    logger, lines = logging.getLogger("tgi_server"), []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    level = logger.level
    with pytest.MonkeyPatch.context() as patch, InProcessShard(tmp, str(path), cuda_graphs=(2, 4)) as shard:
        patch.setenv(decode_graphs.COMPILE_ENV, "1")
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        try:
            shard.runner.warmup(pb.WarmupRequest(max_batch_prefill_tokens=64, max_batch_size=8))
        finally:
            logger.removeHandler(handler)
            logger.setLevel(level)
        yield shard.runner, dict(shard.runner.graphs.floors), lines


@pytest.mark.slow
def test_smollm2_float32_compiled_greedy_is_transformers_and_eager(tmp_path, smollm2_hf, compiling, monkeypatch):
    """One shard, one Warmup (another would compile both sizes again): its
    compiled steps of 4 rows, of 1 and of 3 padded to 4, then the 4 prompts
    again with every step eager (floors above every size: the path of a
    shard that compiles nothing)."""
    hf, tokenizer, gguf_path = smollm2_hf
    # Every row count runs compiled, whatever Warmup would measure: padded steps are what this checks.
    monkeypatch.setattr(decode_graphs.DecodeGraphs, "_calibrate", lambda self: dict.fromkeys(self.sizes, 1))
    prompts = [tokenizer(t)["input_ids"] for t in TEXTS]
    # One thread (shard_harness.torch_threads): on two cores shared with other work, transformers' greedy
    # took 74-84 s here with two, 8-10 s with one; the shard compiles its steps for one.
    with torch_threads(1):
        expected = [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
        with InProcessShard(tmp_path, str(gguf_path), kv_cache_bytes=64 << 20, cuda_graphs=(1, 4)) as shard:
            runner = shard.runner
            ran = _counted(monkeypatch)

            def generate(ps: list[list[int]], warmup: bool = False) -> list[list[int]]:
                seqs = asyncio.run(run_prompts(shard.socket, ps, NEW_TOKENS, warmup=warmup))
                return [s.generated_ids for s in seqs]
            together = generate(prompts, warmup=True)
            assert runner.graphs is not None and runner.graphs.sizes == (1, 4) and runner.graphs.threads == 1
            alone = generate(prompts[:1])
            three = generate(prompts[1:])  # padded to 4
            assert ran == [4] * (NEW_TOKENS - 1) + [1] * (NEW_TOKENS - 1) + [4] * (NEW_TOKENS - 1)  # every step
            runner.graphs.floors = {1: 2, 4: 5}
            eager = generate(prompts)
            assert len(ran) == 3 * (NEW_TOKENS - 1)  # none of its steps compiled
    assert together == expected == eager
    assert alone + three == expected


def test_a_compiled_step_gives_the_eager_logits_whatever_its_padding(llama_graphs):
    """Up to float32's rounding: a GEMM over 4 rows may block its sums
    differently from one over 3 (as in test_decode_graphs)."""
    runner = llama_graphs[0]
    assert runner.backend == "cpu" and runner.graphs is not None
    runner.graphs.floors = {2: 1, 4: 1}  # pad whatever Warmup measured
    tables = [[1, 2, 3], [4, 5], [6]]
    for lens in ([40, 20, 9], [40]):  # 3 rows padded to 4, one padded to 2
        batch = _decode_batch(runner, lens, tables[:len(lens)])
        with torch.inference_mode():
            want = runner.model.logits(runner.model(batch.input_ids, runner.context(batch)), None)
            got, _ = runner.logits(batch)  # (logits, normed hidden states with Medusa heads)
        torch.testing.assert_close(got, want)


def test_warmup_measures_which_rows_each_size_runs_and_fewer_run_eagerly(llama_graphs):
    runner, floors, lines = llama_graphs
    graphs = runner.graphs
    # Each size runs from some row count above the size below it (or none: size + 1).
    assert set(floors) == {2, 4}
    assert 1 <= floors[2] <= 3 and 3 <= floors[4] <= 5
    assert any("a step runs compiled from" in line for line in lines)
    graphs.floors = {2: 1, 4: 4}  # three rows would cost more padded than eager
    three = _decode_batch(runner, [40, 20, 9], [[1, 2, 3], [4, 5], [6]])
    four = _decode_batch(runner, [40, 20, 9, 5], [[1, 2, 3], [4, 5], [6], [7]])
    assert not graphs.can_run(three) and graphs.can_run(four)
    with torch.inference_mode():
        want = runner.model.logits(runner.model(three.input_ids, runner.context(three)), None)
        got, _ = runner.logits(three)
    torch.testing.assert_close(got, want, rtol=0, atol=0)  # the eager path itself


def test_a_failed_compile_decodes_eagerly_with_one_line(tmp_path, compiling, monkeypatch, caplog):
    def broken(*args, **kwargs):
        raise RuntimeError("no compiler here\nsecond line")
    monkeypatch.setattr(torch, "compile", broken)
    path = save_tiny_model("llama", tmp_path / "llama")
    with InProcessShard(tmp_path, str(path), cuda_graphs=(1, 2)) as shard, caplog.at_level(logging.INFO, "tgi_server"):
        seqs = asyncio.run(run_prompts(shard.socket, [[1, 2, 3]], 4))
        assert shard.runner.graphs is None
    assert len(seqs[0].generated_ids) == 4
    assert [r.getMessage() for r in caplog.records if "compiled decode steps off" in r.getMessage()] == [
        "compiled decode steps off, decoding eagerly: RuntimeError: no compiler here"]


def test_the_switch_and_the_attention_backend_turn_compiling_off(tmp_path, monkeypatch, caplog):
    path = save_tiny_model("llama", tmp_path / "llama")
    monkeypatch.setenv(decode_graphs.COMPILE_ENV, "0")
    assert decode_graphs.compile_available() == "TGI_CPU_COMPILE=0"
    with caplog.at_level(logging.INFO, "tgi_server"):
        with InProcessShard(_dir(tmp_path / "off"), str(path), cuda_graphs=(1, 2)) as shard:
            asyncio.run(run_prompts(shard.socket, [[1, 2, 3]], 2))
            assert shard.runner.graphs is None
        monkeypatch.setenv(decode_graphs.COMPILE_ENV, "1")
        with InProcessShard(_dir(tmp_path / "sdpa"), str(path), cuda_graphs=(1, 2), backend="sdpa") as shard:
            asyncio.run(run_prompts(shard.socket, [[1, 2, 3]], 2))
            assert shard.runner.graphs is None
    off = [r.getMessage() for r in caplog.records if "compiled decode steps off" in r.getMessage()]
    assert off == ["compiled decode steps off: TGI_CPU_COMPILE=0",
                   "compiled decode steps off: the sdpa attention backend (only our C++ kernels' is compiled)"]


def test_a_step_under_another_thread_count_runs_eagerly_without_recompiling(llama_graphs):
    """The thread governor changes torch's thread count under load; dynamo
    guards on it. Such a step runs eagerly instead of compiling again."""
    runner = llama_graphs[0]
    runner.graphs.floors = {2: 1, 4: 1}  # two rows run compiled, whatever Warmup measured
    batch = _decode_batch(runner, [30, 12], [[1, 2], [3]])
    threads = torch.get_num_threads()
    assert runner.graphs.can_run(batch)
    try:
        torch.set_num_threads(1 if threads > 1 else 2)
        assert not runner.graphs.can_run(batch)
        with torch.inference_mode():
            want = runner.model.logits(runner.model(batch.input_ids, runner.context(batch)), None)
            got, _ = runner.logits(batch)  # (logits, normed hidden states with Medusa heads)
        torch.testing.assert_close(got, want)
    finally:
        torch.set_num_threads(threads)
    assert runner.graphs.can_run(batch)
