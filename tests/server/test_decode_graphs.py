"""CUDA graphs for decode (--cuda-graphs): the flag from launcher to shard, the
choice of a captured batch size, padding, and (on a GPU) the capture itself."""

import pytest
import torch

from tgi_proto import pb
from tgi_router.launch.config import parse_args
from tgi_router.launch.shard_processes import shard_command
from tgi_server.batch import build_batch
from tgi_server.cli import build_parser, config_from_args
from tgi_server.config import ShardConfig
from tgi_server.decode_graphs import (
    DecodeGraphs,
    backend_supports_graphs,
    graph_batch_sizes,
    padded_batch_size,
    padding_floors,
)
from tgi_server.sequences import ShardSequence
from tgi_server.shard import load_shard

from ..shard_harness import save_tiny_model
from ..triton_interpreter import use_triton_interpreter

BLOCK = 16


# --- the flag --------------------------------------------------------------------------


def test_launcher_leaves_the_default_sizes_to_the_shard_and_passes_chosen_ones():
    config = parse_args([], {})
    assert config.cuda_graphs is None and "--cuda-graphs" not in shard_command(config, 0)
    command = shard_command(parse_args(["--cuda-graphs", "1,2,4,8,16,32"], {}), 0)
    assert command[command.index("--cuda-graphs") + 1] == "1,2,4,8,16,32"


def test_the_shards_default_sizes_are_tgis_on_cuda_and_reach_64_on_cpus():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert graph_batch_sizes(None, 256, cuda) == (1, 2, 4, 8, 16, 32)
    assert graph_batch_sizes(None, 256, cpu) == (1, 2, 4, 8, 16, 32, 64)
    assert graph_batch_sizes(None, 48, cpu) == (1, 2, 4, 8, 16, 32)


def test_launcher_flag_and_env_set_the_sizes_and_zero_turns_them_off():
    assert parse_args(["--cuda-graphs", "8,1,2"], {}).cuda_graphs == (1, 2, 8)
    assert parse_args([], {"CUDA_GRAPHS": "4"}).cuda_graphs == (4,)
    off = parse_args(["--cuda-graphs", "0"], {})
    command = shard_command(off, 0)
    assert off.cuda_graphs == () and command[command.index("--cuda-graphs") + 1] == "0"
    assert "--cuda-graphs" not in off.ignored_flags


def test_shard_flag_reaches_its_config():
    args = build_parser().parse_args(["serve", "m", "--cuda-graphs", "4,1"])
    assert config_from_args(args).cuda_graphs == (1, 4)
    assert config_from_args(build_parser().parse_args(["serve", "m"])).cuda_graphs is None  # the device's default
    assert config_from_args(build_parser().parse_args(["serve", "m", "--cuda-graphs", "0"])).cuda_graphs == ()


# --- choosing a graph ---------------------------------------------------------------------


def test_sizes_beyond_the_largest_batch_are_not_captured():
    assert graph_batch_sizes((32, 1, 4, 2, 8, 16), 10, torch.device("cpu")) == (1, 2, 4, 8)


def test_a_step_replays_the_smallest_graph_that_holds_it():
    sizes = (1, 2, 4, 8)
    assert [padded_batch_size(sizes, n) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, None]


def test_a_size_runs_the_rows_whose_padding_costs_less_than_compiling_saves():
    # Eager steps cost 5 ms flat up to 4 rows, then 0.5 ms a row; compiling
    # saves 1 ms at every size: two rows' worth of padding.
    eager = {1: 5.0, 2: 5.0, 4: 5.0, 8: 7.0, 16: 11.0, 32: 19.0}
    compiled = {n: t - 1.0 for n, t in eager.items()}
    assert padding_floors((1, 2, 4, 8, 16, 32), eager, compiled) == {1: 1, 2: 2, 4: 3, 8: 6, 16: 14, 32: 30}
    # Saving 4 ms pads by up to 8 rows, never into the size below.
    compiled = {n: t - 4.0 for n, t in eager.items()}
    assert padding_floors((1, 2, 4, 8, 16, 32), eager, compiled) == {1: 1, 2: 2, 4: 3, 8: 5, 16: 9, 32: 24}
    # The smallest size's line starts at one row, measured eagerly (1 ms a
    # row up to 4: one row of padding; 0.5 ms a row up to 8: two).
    assert padding_floors((4, 8), {1: 3.0, 4: 6.0, 8: 8.0}, {4: 5.0, 8: 7.0}) == {4: 3, 8: 6}


def test_the_median_saving_decides_and_noise_in_one_size_does_not():
    eager = {1: 5.0, 2: 5.0, 4: 5.0, 8: 7.0}
    # One size measured slower compiled (a noisy moment) still runs compiled:
    # the median of the savings is what compiling saves.
    compiled = {1: 4.0, 2: 4.0, 4: 5.5, 8: 6.0}
    assert padding_floors((1, 2, 4, 8), eager, compiled) == {1: 1, 2: 2, 4: 3, 8: 6}
    # Compiling that saves nothing runs no size compiled.
    assert padding_floors((1, 2), {1: 5.0, 2: 5.0}, {1: 5.0, 2: 5.5}) == {1: 2, 2: 3}
    # Eager times that fall with the rows (noise where rows are free): pad them all.
    assert padding_floors((2, 4), {1: 5.0, 2: 5.2, 4: 5.1}, {2: 4.0, 4: 4.0}) == {2: 1, 4: 3}


def test_only_backends_that_read_block_tables_in_kernel_are_captured():
    assert backend_supports_graphs("triton", 16)
    assert backend_supports_graphs("flash_attn", 256) and not backend_supports_graphs("flash_attn", 16)
    assert not backend_supports_graphs("sdpa", 16) and not backend_supports_graphs("reference", 256)


# --- padding and replay (eager "graphs" on CPU, captured ones on a GPU) --------------------------


def _runner(tmp_path, device: str, backend: str, cuda_graphs=(), dtype: str | None = None):
    path = save_tiny_model("llama", tmp_path / "llama", seed=2)
    config = ShardConfig(model_id=str(path), revision=None, uds_path=str(tmp_path / "s"), dtype=dtype,
                         device=device, block_size=BLOCK, kv_cache_bytes=8 << 20, attention_backend=backend,
                         num_threads=0, cuda_graphs=cuda_graphs)
    runner, _ = load_shard(config)
    runner.warmup(pb.WarmupRequest(max_batch_prefill_tokens=64, max_batch_size=8))
    gen = torch.Generator().manual_seed(0)
    for k, v in runner.cache.layers:  # a random context for every block
        k.copy_(torch.randn(k.shape, generator=gen))
        v.copy_(torch.randn(v.shape, generator=gen))
    return runner


def _decode_batch(runner, context_lens: list[int]):
    seqs, next_block = [], 0
    for i, n in enumerate(context_lens):
        blocks = list(range(next_block, next_block + -(-(n + 1) // BLOCK)))
        next_block += len(blocks)
        seqs.append(ShardSequence(id=i, token_ids=[(7 * i + j) % 200 + 3 for j in range(n + 1)], prompt_length=1,
                                  num_computed=n, block_table=blocks, params=None, prefill_logprobs=False,
                                  scheduled=1))
    return build_batch(seqs, BLOCK, runner.device)


def _graphs(runner, sizes, mode):
    return DecodeGraphs(runner.model, runner.cache.layers, runner.backend, BLOCK, 8, runner.cache.scratch_block,
                        sizes, runner.device, mode=mode)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_padded_replay_gives_the_eager_hidden_states_and_leaves_real_blocks_alone(tmp_path, dtype):
    """The padding row writes only the scratch block: every other slot keeps
    its bits. The step's own slots are written again with the same values
    up to the dtype's rounding (a GEMM over 4 rows may block its sums
    differently from one over 3: it does in float32, on AVX2 and AVX-512)."""
    runner = _runner(tmp_path, "cpu", "sdpa", dtype=dtype)
    batch = _decode_batch(runner, [5, 16, 40])
    with torch.inference_mode():
        want = runner.model(batch.input_ids, runner.context(batch))  # writes the step's K/V
        cache_after_eager = [(k.clone(), v.clone()) for k, v in runner.cache.layers]
        graphs = _graphs(runner, (1, 4, 8), "eager")
        got = graphs.run(batch)
    assert graphs.outputs[4].shape[0] == 4  # 3 sequences ran padded to 4
    torch.testing.assert_close(got, want)
    step_slots = batch.slot_mapping
    for after, before in zip(runner.cache.layers, cache_after_eager):
        for now, then in zip(after, before):  # K and V: [blocks, BLOCK, kv_heads, head_dim]
            now_slots, then_slots = now.flatten(0, 1), then.flatten(0, 1)  # [blocks * BLOCK, kv_heads, head_dim]
            untouched = torch.ones(now_slots.shape[0], dtype=torch.bool)
            untouched[step_slots] = False
            untouched[runner.cache.scratch_block * BLOCK:(runner.cache.scratch_block + 1) * BLOCK] = False
            assert torch.equal(now_slots[untouched], then_slots[untouched])
            torch.testing.assert_close(now_slots[step_slots], then_slots[step_slots])


def test_replays_in_turn_each_give_the_eager_hidden_states(tmp_path):
    """Each replay sends its own inputs over what the last one left (wider
    tables, more rows, other padding): nothing stale is read."""
    runner = _runner(tmp_path, "cpu", "sdpa")
    graphs = _graphs(runner, (1, 4, 8), "eager")
    for lens in ([5, 16, 40, 70, 2], [3], [33, 1, 17], [100]):
        batch = _decode_batch(runner, lens)
        with torch.inference_mode():
            want = runner.model(batch.input_ids, runner.context(batch))
            got = graphs.run(batch)
        torch.testing.assert_close(got, want)


def test_steps_that_fit_no_graph_run_eagerly(tmp_path):
    runner = _runner(tmp_path, "cpu", "sdpa")
    graphs = _graphs(runner, (1, 2), "eager")
    assert graphs.can_run(_decode_batch(runner, [3, 9]))
    assert not graphs.can_run(_decode_batch(runner, [3, 9, 4]))  # more sequences than the largest graph
    assert not graphs.can_run(_decode_batch(runner, [200]))  # a table wider than the captured one


def test_graphs_are_not_captured_on_cpu(tmp_path):
    runner = _runner(tmp_path, "cpu", "sdpa", cuda_graphs=(1, 2, 4))
    assert runner.graphs is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not use_triton_interpreter(), reason="needs CUDA and triton")
def test_captured_graphs_replay_the_eager_forward_on_cuda(tmp_path):
    runner = _runner(tmp_path, "cuda", "triton", cuda_graphs=(1, 2, 4, 8))
    assert runner.graphs is not None and runner.graphs.sizes == (1, 2, 4, 8)
    for lens in ([5], [5, 16, 40], [1, 2, 3, 4, 17, 33, 64]):
        batch = _decode_batch(runner, lens)
        with torch.inference_mode():
            want = runner.model.logits(runner.model(batch.input_ids, runner.context(batch)), None)
            got, _ = runner.logits(batch)  # (logits, normed hidden states with Medusa heads)
        torch.testing.assert_close(got, want, atol=2e-3, rtol=1e-2)
