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

from ..shard_harness import InProcessShard, hf_greedy, run_prompts, save_tiny_model

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


@pytest.mark.slow
def test_smollm2_float32_compiled_greedy_is_transformers_and_eager(tmp_path, smollm2_hf, compiling, monkeypatch):
    hf, tokenizer, gguf_path = smollm2_hf
    # Every row count runs compiled, whatever each Warmup measures: padded steps are what this checks.
    monkeypatch.setattr(decode_graphs, "padding_floors", lambda sizes, *_: dict.fromkeys(sizes, 1))
    prompts = [tokenizer(t)["input_ids"] for t in TEXTS]
    expected = [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    with InProcessShard(_dir(tmp_path / "eager"), str(gguf_path), kv_cache_bytes=64 << 20) as shard:
        eager = asyncio.run(run_prompts(shard.socket, prompts, NEW_TOKENS))
        assert shard.runner.graphs is None
    with InProcessShard(_dir(tmp_path / "compiled"), str(gguf_path), kv_cache_bytes=64 << 20,
                        cuda_graphs=(1, 4)) as shard:
        runner = shard.runner
        ran = _counted(monkeypatch)
        together = asyncio.run(run_prompts(shard.socket, prompts, NEW_TOKENS))
        assert runner.graphs is not None and runner.graphs.sizes == (1, 4)
        alone = asyncio.run(run_prompts(shard.socket, prompts[:1], NEW_TOKENS))
        three = asyncio.run(run_prompts(shard.socket, prompts[1:], NEW_TOKENS))  # padded to 4
        assert ran == [4] * (NEW_TOKENS - 1) + [1] * (NEW_TOKENS - 1) + [4] * (NEW_TOKENS - 1)  # every decode step
    assert [s.generated_ids for s in together] == expected == [s.generated_ids for s in eager]
    assert [s.generated_ids for s in alone + three] == expected


def test_a_compiled_step_gives_the_eager_logits_whatever_its_padding(tmp_path, compiling):
    """Up to float32's rounding: a GEMM over 4 rows may block its sums
    differently from one over 3 (as in test_decode_graphs)."""
    path = save_tiny_model("llama", tmp_path / "llama")
    with InProcessShard(tmp_path, str(path), cuda_graphs=(2, 4)) as shard:
        runner = shard.runner
        runner.warmup(pb.WarmupRequest(max_batch_prefill_tokens=64, max_batch_size=8))
        assert runner.backend == "cpu" and runner.graphs is not None
        runner.graphs.floors = {2: 1, 4: 1}  # pad whatever Warmup measured
        tables = [[1, 2, 3], [4, 5], [6]]
        for lens in ([40, 20, 9], [40]):  # 3 rows padded to 4, one padded to 2
            batch = _decode_batch(runner, lens, tables[:len(lens)])
            with torch.inference_mode():
                want = runner.model.logits(runner.model(batch.input_ids, runner.context(batch)), None)
                got, _ = runner.logits(batch)  # (logits, normed hidden states with Medusa heads)
            torch.testing.assert_close(got, want)


def test_warmup_measures_which_rows_each_size_runs_and_fewer_run_eagerly(tmp_path, compiling, caplog):
    path = save_tiny_model("llama", tmp_path / "llama")
    with InProcessShard(tmp_path, str(path), cuda_graphs=(2, 4)) as shard, caplog.at_level(logging.INFO, "tgi_server"):
        runner = shard.runner
        runner.warmup(pb.WarmupRequest(max_batch_prefill_tokens=64, max_batch_size=8))
        graphs = runner.graphs
        # Each size runs from some row count above the size below it (or none: size + 1).
        assert set(graphs.floors) == {2, 4}
        assert 1 <= graphs.floors[2] <= 3 and 3 <= graphs.floors[4] <= 5
        assert any("a step runs compiled from" in r.getMessage() for r in caplog.records)
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


def test_a_step_under_another_thread_count_runs_eagerly_without_recompiling(tmp_path, compiling):
    """The thread governor changes torch's thread count under load; dynamo
    guards on it. Such a step runs eagerly instead of compiling again."""
    path = save_tiny_model("llama", tmp_path / "llama")
    with InProcessShard(tmp_path, str(path), cuda_graphs=(2,)) as shard:
        runner = shard.runner
        runner.warmup(pb.WarmupRequest(max_batch_prefill_tokens=64, max_batch_size=8))
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
