"""--kv-cache-dtype fp8_e4m3fn | fp8_e5m2 on the shard: Warmup fits 2x the
blocks of a 16-bit cache (4x of float32) in the same bytes, the model reads
the rounded cache (logits move a little, not a lot), per-layer k/v scales
come from the checkpoint. (SmolLM2's perplexity and greedy text with
either format: `make bench BENCH=kv_fp8`.)

Logprobs here come from chunked prefills (`chunked_logprobs`): a chunk's own
keys are the step's fresh ones, so a single prefill of the whole text would
never read the cache; in chunks of a few tokens most keys are read back from
the float8 blocks (the benchmark feeds its text one token a step, as decode
reads the cache)."""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tgi_kernels import key_rotation, select_backend
from tgi_proto import pb
from tgi_server.config import ShardConfig
from tgi_server.layers.attention import Attention
from tgi_server.model_runner import ModelRunner
from tgi_server.shard import load_shard
from tgi_server.weights.errors import CheckpointError

from ..shard_harness import chunked_logprobs, save_tiny_model, with_tensors

FP8 = ("fp8_e4m3fn", "fp8_e5m2")


def runner_for(path: str | None, kv_cache_dtype: str | None, dtype: str = "float32",
               kv_cache_bytes: int = 8 << 20, backend: str | None = None) -> ModelRunner:
    config = ShardConfig(model_id=path, revision=None, uds_path="/unused", dtype=dtype, device="cpu",
                         block_size=16, kv_cache_bytes=kv_cache_bytes, attention_backend=backend, num_threads=0,
                         kv_cache_dtype=kv_cache_dtype)
    runner, _ = load_shard(config)
    runner.warmup(pb.WarmupRequest(max_batch_prefill_tokens=256, max_batch_size=4))
    return runner


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return save_tiny_model("llama", tmp_path_factory.mktemp("fp8") / "llama")


@pytest.mark.parametrize("dtype, ratio", [("bfloat16", 2), ("float32", 4)])
@pytest.mark.parametrize("kv_cache_dtype", FP8)
def test_warmup_fits_the_blocks_of_one_byte_elements(tiny, kv_cache_dtype, dtype, ratio):
    plain = runner_for(str(tiny), None, dtype).cache.num_blocks
    runner = runner_for(str(tiny), kv_cache_dtype, dtype)
    assert runner.cache.layers[0][0].dtype == getattr(torch, kv_cache_dtype.replace("fp8_", "float8_"))
    # one block of the budget stays the scratch block
    assert runner.cache.num_blocks + 1 == ratio * (plain + 1)


def test_every_backend_reads_the_rounded_cache_alike(tiny):
    """The fused C++ rotary + fp8 store and the C++ kernels (cpu), the torch
    store and SDPA over widened blocks (sdpa) and the reference agree on the
    fp8 cache; its logprobs differ from the float cache's, e5m2 (2 mantissa
    bits) about twice as much as e4m3fn (3 bits). The tiny random model is
    sensitive: its mean |logprob| is ~6, its mean drift ~0.06 (e4m3fn)."""
    ids = list(range(3, 99))
    backends = ["reference", "sdpa"] + (["cpu"] if select_backend(torch.device("cpu")) == "cpu" else [])
    exact = chunked_logprobs(runner_for(str(tiny), None, backend="reference"), ids, chunk=4)
    drift = {}
    for kv_cache_dtype in FP8:
        runs = [chunked_logprobs(runner_for(str(tiny), kv_cache_dtype, backend=b), ids, chunk=4) for b in backends]
        for backend, logprobs in zip(backends[1:], runs[1:]):
            assert (logprobs - runs[0]).abs().max() < 1e-3, (kv_cache_dtype, backend)
        drift[kv_cache_dtype] = (runs[0] - exact).abs().mean().item()
    assert 1e-3 < drift["fp8_e4m3fn"] < drift["fp8_e5m2"] < 0.03 * exact.abs().mean().item(), drift


def _scaled_checkpoint(tiny: Path, out: Path, scales: dict[str, float]) -> Path:
    tensors = load_file(str(tiny / "model.safetensors"))
    for layer in range(2):
        for name, value in scales.items():
            tensors[f"model.layers.{layer}.self_attn.{name}"] = torch.tensor(value)
    return with_tensors(tiny, tensors, out)


def test_checkpoint_scales_are_read_and_applied(tiny, tmp_path):
    """k_scale 1/2 and v_scale 1/4 are powers of two: the cache holds the same
    mantissas as with scales of 1, so the logits barely move when they are
    applied right. kv_scale alone serves both: at 3 the rounding differs but
    drifts from the float cache as much as with scales of 1 (a scale dropped
    on either side would scale the scores or outputs by 3: a drift of whole
    units). Keys under a checkpoint's scale are stored as they are."""
    ids = list(range(3, 99))
    exact = chunked_logprobs(runner_for(str(tiny), None), ids, chunk=4)
    ones = runner_for(str(_scaled_checkpoint(tiny, tmp_path / "ones", {"k_scale": 1.0, "v_scale": 1.0})),
                      "fp8_e4m3fn")
    assert all(m.key_rotation is None for m in ones.model.modules() if isinstance(m, Attention))
    unscaled = chunked_logprobs(ones, ids, chunk=4)
    runner = runner_for(str(_scaled_checkpoint(tiny, tmp_path / "pow2", {"k_scale": 0.5, "v_scale": 0.25})),
                        "fp8_e4m3fn")
    assert {m.kv_scales for m in runner.model.modules() if isinstance(m, Attention)} == {(0.5, 0.25)}
    assert (chunked_logprobs(runner, ids, chunk=4) - unscaled).abs().max() < 2e-3
    both = runner_for(str(_scaled_checkpoint(tiny, tmp_path / "kv", {"kv_scale": 3.0})), "fp8_e4m3fn")
    assert {m.kv_scales for m in both.model.modules() if isinstance(m, Attention)} == {(3.0, 3.0)}
    drift, base = ((lp - exact).abs().mean().item() for lp in (chunked_logprobs(both, ids, chunk=4), unscaled))
    assert abs(drift - base) < 0.25 * base, (drift, base)
    # the same checkpoint with a 16-bit cache ignores the scales
    plain = runner_for(str(_scaled_checkpoint(tiny, tmp_path / "plain", {"kv_scale": 3.0})), None)
    assert {m.kv_scales for m in plain.model.modules() if isinstance(m, Attention)} == {(1.0, 1.0)}


@pytest.mark.parametrize("head_dim", [16, 32])
def test_turned_keys_give_the_same_logprobs(tmp_path, head_dim):
    """A float8 cache without checkpoint scales holds keys turned by
    key_rotation, and queries turn alike; in a float32 cache (where nothing is
    rounded) the same turn leaves every backend's logprobs as they were, its
    factor 2 (head_dim 32) folded into the softmax scale."""
    path = save_tiny_model("llama", tmp_path / "llama", head_dim=head_dim)
    layers = [m for m in runner_for(str(path), "fp8_e5m2").model.modules() if isinstance(m, Attention)]
    assert all(torch.equal(m.key_rotation, key_rotation(head_dim, torch.float32, torch.device("cpu"))[0])
               for m in layers)
    ids = list(range(3, 99))
    backends = ["reference", "sdpa"] + (["cpu"] if select_backend(torch.device("cpu")) == "cpu" else [])
    for backend in backends:
        plain = runner_for(str(path), None, backend=backend)
        want = chunked_logprobs(plain, ids, chunk=4)
        for m in plain.model.modules():
            if isinstance(m, Attention):
                m.key_rotation, factor = key_rotation(head_dim, torch.float32, torch.device("cpu"))
                m.scale /= factor
        torch.testing.assert_close(chunked_logprobs(plain, ids, chunk=4), want, atol=1e-4, rtol=0, msg=backend)


def test_a_bad_checkpoint_scale_is_a_checkpoint_error(tiny, tmp_path):
    path = _scaled_checkpoint(tiny, tmp_path / "zero", {"k_scale": 0.0, "v_scale": 1.0})
    with pytest.raises(CheckpointError, match="k_scale is 0.0: a KV cache scale must be positive"):
        runner_for(str(path), "fp8_e5m2")


def test_the_default_backend_is_one_that_reads_fp8(monkeypatch):
    """On CUDA, flash_attn (which reads float8 blocks through 16-bit copies) gives way to
    triton (which reads them in place)."""
    import tgi_kernels.attention as attention
    monkeypatch.setattr(attention, "available_backends", lambda device: ["reference", "sdpa", "flash_attn",
                                                                        "triton"])
    assert attention.select_backend(torch.device("cuda")) == "flash_attn"
    assert attention.select_backend(torch.device("cuda"), fp8_kv=True) == "triton"
