"""The gRPC service: Info, Health, Warmup, Step, Release, ClearCache, and
clear statuses for bad calls."""

import asyncio

import pytest
import torch

from tgi_kernels import select_backend
from tgi_proto import pb
from tgi_proto.rpc import StatusCode
from tgi_router.scheduling.client import ShardClient, ShardError

from ..shard_harness import InProcessShard, save_tiny_model


@pytest.fixture(scope="module")
def shard(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("svc")
    path = save_tiny_model("llama", tmp / "llama", seed=2)
    with InProcessShard(tmp, str(path), kv_cache_bytes=1 << 20) as s:
        yield s


def call(socket, fn):
    async def go():
        client = ShardClient([socket], timeout=30)
        try:
            return await fn(client)
        finally:
            await client.close()
    return asyncio.run(go())


def new_seq(i, tokens, blocks, scheduled=None, **params):
    return pb.NewSequence(id=i, token_ids=tokens, num_scheduled_tokens=scheduled or len(tokens),
                          block_table=blocks, parameters=pb.SamplingParameters(**params))


def test_info_reports_model_facts(shard):
    info = call(shard.socket, lambda c: c.info())
    assert (info.model_type, info.dtype, info.device) == ("llama", "float32", "cpu")
    assert info.block_size == 16 and info.num_layers == 2 and info.num_kv_heads == 2 and info.head_dim == 16
    assert list(info.eos_token_ids) == [2] and info.attention_backend == select_backend(torch.device("cpu"))


def test_warmup_sizes_cache_from_budget(shard):
    warm = call(shard.socket, lambda c: c.warmup(128, 8, kv_cache_bytes=1 << 20))
    per_block = 2 * 2 * 2 * 16 * 16 * 4  # K+V, layers, kv heads, head dim, block size, fp32
    assert warm.num_blocks == (1 << 20) // per_block - 1
    assert warm.max_supported_total_tokens == warm.num_blocks * 16
    assert call(shard.socket, lambda c: c.info()).num_blocks == warm.num_blocks


def test_health_passes(shard):
    call(shard.socket, lambda c: c.health())


def test_step_returns_tokens_logprobs_top_n_and_timings(shard):
    call(shard.socket, lambda c: c.warmup(128, 8))
    req = pb.StepRequest(step_id=7, new_sequences=[
        new_seq(1, [1, 5, 9, 13], [0], top_n_tokens=3, prefill_logprobs=True)])
    resp = call(shard.socket, lambda c: c.step(req))
    (gen,) = resp.generations
    assert resp.step_id == 7 and gen.sampled and gen.num_computed_tokens == 4
    assert [t.token_id for t in gen.top_tokens][0] == gen.token_id  # greedy picks the best
    assert len(gen.top_tokens) == 3 and gen.top_tokens[0].logprob == pytest.approx(gen.logprob)
    assert [t.token_id for t in gen.prefill_tokens] == [1, 5, 9, 13]
    assert gen.prefill_tokens[0].logprob != gen.prefill_tokens[0].logprob  # NaN for the first token
    assert all(t.logprob <= 0 for t in gen.prefill_tokens[1:])
    assert resp.timings.total_ns >= resp.timings.forward_ns > 0
    call(shard.socket, lambda c: c.release([1]))


def test_chunked_prefill_returns_no_token_until_the_last_chunk(shard):
    call(shard.socket, lambda c: c.warmup(128, 8))
    tokens = list(range(3, 40))
    first = call(shard.socket, lambda c: c.step(pb.StepRequest(new_sequences=[new_seq(5, tokens, [0, 1, 2], 20)])))
    assert not first.generations[0].sampled and first.generations[0].num_computed_tokens == 20
    second = call(shard.socket, lambda c: c.step(pb.StepRequest(running=[
        pb.RunningSequence(id=5, num_scheduled_tokens=17)])))
    assert second.generations[0].sampled and second.generations[0].num_computed_tokens == 37
    call(shard.socket, lambda c: c.clear_cache())


def test_a_step_sent_ahead_waits_for_the_step_it_follows(shard):
    """Async scheduling: step 11 reaches the shard before step 10, whose
    token it computes; it runs after step 10 and matches the steps sent in order."""
    call(shard.socket, lambda c: c.warmup(128, 8))
    first = pb.StepRequest(step_id=10, new_sequences=[new_seq(3, [1, 5, 9, 13], [0, 1])])
    second = pb.StepRequest(step_id=11, after_step_id=10, running=[pb.RunningSequence(id=3, num_scheduled_tokens=1)])
    in_order = [call(shard.socket, lambda c: c.step(first)), call(shard.socket, lambda c: c.step(second))]
    call(shard.socket, lambda c: c.release([3]))

    async def reversed_(client):
        late = asyncio.ensure_future(client.step(second))
        await asyncio.sleep(0.2)  # it waits on the shard meanwhile
        assert not late.done()
        return [await client.step(first), await late]
    out_of_order = call(shard.socket, reversed_)
    call(shard.socket, lambda c: c.release([3]))
    assert [r.generations[0].token_id for r in out_of_order] == [r.generations[0].token_id for r in in_order]
    assert out_of_order[1].generations[0].num_computed_tokens == 5  # the shard appended its own token


@pytest.mark.parametrize("request_, message", [
    (pb.StepRequest(running=[pb.RunningSequence(id=99, num_scheduled_tokens=1)]), "unknown"),
    (pb.StepRequest(new_sequences=[new_seq(1, [1, 2, 3], [], 3)]), "blocks cannot hold"),
    (pb.StepRequest(new_sequences=[new_seq(1, [1, 2, 3], [0], 5)]), "remain"),
    (pb.StepRequest(new_sequences=[new_seq(1, [1, 2, 3], [10 ** 6], 3)]), "out of range"),
    (pb.StepRequest(new_sequences=[new_seq(1, [1, 2, 256], [0], 3)]), "outside the vocabulary"),
])
def test_bad_steps_are_invalid_argument(shard, request_, message):
    call(shard.socket, lambda c: c.warmup(128, 8))
    with pytest.raises(ShardError) as err:
        call(shard.socket, lambda c: c.step(request_))
    assert err.value.code is StatusCode.INVALID_ARGUMENT and message in err.value.details
    call(shard.socket, lambda c: c.health())  # the shard keeps working


def test_duplicate_new_sequence_is_rejected_and_release_frees_the_id(shard):
    call(shard.socket, lambda c: c.warmup(128, 8))
    step = pb.StepRequest(new_sequences=[new_seq(3, [1, 2], [0])])
    call(shard.socket, lambda c: c.step(step))
    with pytest.raises(ShardError, match="already live"):
        call(shard.socket, lambda c: c.step(step))
    call(shard.socket, lambda c: c.release([3]))
    assert call(shard.socket, lambda c: c.step(step)).generations[0].sampled
    call(shard.socket, lambda c: c.clear_cache())


def test_health_fails_when_the_model_cannot_run(tmp_path):
    path = save_tiny_model("llama", tmp_path / "m")
    with InProcessShard(tmp_path, str(path)) as s:
        s.runner.model.norm.weight.data.fill_(float("nan"))
        with pytest.raises(ShardError) as err:
            call(s.socket, lambda c: c.health())
    assert err.value.code is StatusCode.UNAVAILABLE


def test_step_before_warmup_is_failed_precondition(tmp_path):
    path = save_tiny_model("llama", tmp_path / "m")
    with InProcessShard(tmp_path, str(path)) as s:
        with pytest.raises(ShardError) as err:
            call(s.socket, lambda c: c.step(pb.StepRequest(new_sequences=[new_seq(1, [1, 2], [0])])))
    assert err.value.code is StatusCode.FAILED_PRECONDITION
