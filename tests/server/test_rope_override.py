"""--rope-scaling / --rope-factor on the shard: the override replaces the
checkpoint's RoPE scaling, as TGI's ROPE_SCALING / ROPE_FACTOR do, the
model's length grows by the factor, and the logits past the checkpoint's
own length equal transformers' with the same override in its config."""

import copy

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from tgi_proto import pb
from tgi_server.config import ShardConfig
from tgi_server.distributed import TensorParallel
from tgi_server.model_loader import load_model, open_checkpoint
from tgi_server.model_runner import ModelRunner
from tgi_server.models import ModelConfig
from tgi_server.models.rope_override import override_rope
from tgi_server.shard import load_shard
from tgi_server.weights.errors import CheckpointError
from tgi_server.weights.resolve import resolve_model

from ..shard_harness import HF_CLASSES, save_tiny_model
from .test_engine_matches_hf import engine_logits
from .test_quant_models import hf_logits


def _hf_config(model_type: str, tmp_path):
    return HF_CLASSES[model_type][0].from_pretrained(save_tiny_model(model_type, tmp_path / model_type))


def test_linear_scaling_past_the_checkpoint_s_length_matches_transformers_with_the_override(tmp_path):
    path = save_tiny_model("llama", tmp_path / "m")  # max_position_embeddings 512
    config, weights = open_checkpoint(resolve_model(str(path)), torch.float32, torch.device("cpu"),
                                      rope=("linear", 2.0))
    assert config.max_position_embeddings == 1024
    runner = ModelRunner(load_model(config, weights, TensorParallel()), 16, attention_backend=None,
                         kv_cache_bytes=16 << 20)
    runner.warmup(pb.WarmupRequest(max_batch_prefill_tokens=64, max_batch_size=4))
    hf_config = transformers.AutoConfig.from_pretrained(path)
    hf_config.rope_parameters = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
    theirs = HF_CLASSES["llama"][1].from_pretrained(path, config=hf_config, dtype=torch.float32).eval()
    unscaled = HF_CLASSES["llama"][1].from_pretrained(path, dtype=torch.float32).eval()
    prompt = [(i * 37 + 11) % 250 + 3 for i in range(700)]  # 700 positions: past the checkpoint's 512
    ours = engine_logits(runner, prompt)
    assert (ours - hf_logits(theirs, prompt)).abs().max() < 1e-4
    assert (ours - hf_logits(unscaled, prompt)).abs().max() > 1e-2  # the override did change RoPE


def test_dynamic_scaling_fixes_the_base_transformers_computes_at_the_longest_sequence(tmp_path):
    hf = _hf_config("llama", tmp_path)
    reference = copy.deepcopy(hf)
    reference.rope_parameters = {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0}
    inv_freq, _ = ROPE_INIT_FUNCTIONS["dynamic"](reference, torch.device("cpu"), seq_len=2048)
    assert override_rope(hf, "dynamic", 4.0) == 2048
    table = ModelConfig.from_hf(hf).ropes[0]
    torch.testing.assert_close(torch.tensor(table.inv_freq), inv_freq.float(), rtol=1e-6, atol=0)


def test_yarn_scales_from_the_checkpoint_s_length_as_transformers_does(tmp_path):
    hf = _hf_config("qwen2", tmp_path)
    reference = copy.deepcopy(hf)
    assert override_rope(hf, "yarn", 4.0) == 2048
    reference.rope_parameters = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                 "original_max_position_embeddings": 512}
    inv_freq, scaling = ROPE_INIT_FUNCTIONS["yarn"](reference, torch.device("cpu"))
    table = ModelConfig.from_hf(hf).ropes[0]
    torch.testing.assert_close(torch.tensor(table.inv_freq), inv_freq.float())
    assert table.attention_scaling == pytest.approx(scaling) and scaling > 1


def test_a_model_with_a_rope_table_per_layer_type_is_refused_in_one_line(tmp_path):
    with pytest.raises(CheckpointError, match="one per layer type"):
        override_rope(_hf_config("gemma3_text", tmp_path), "linear", 2.0)


def test_info_reports_the_longer_model_so_the_router_s_limits_follow(tmp_path):
    path = save_tiny_model("llama", tmp_path / "m")
    config = ShardConfig(model_id=str(path), revision=None, uds_path=str(tmp_path / "s"), dtype="float32",
                         device="cpu", block_size=16, kv_cache_bytes=16 << 20, attention_backend=None,
                         num_threads=0, rope=("linear", 2.0))
    _, info = load_shard(config)
    assert info.max_position_embeddings == 1024
