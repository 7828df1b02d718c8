"""GGUF files of phi3 and of the mixture-of-experts families (mixtral,
qwen2moe, qwen3moe) serve what transformers computes from the same weights.

A tiny random checkpoint of each is written as llama.cpp's converter writes
it: names from gguf's own tensor map, every projection of a layer's experts
stacked into one [experts, rows, columns] tensor, mixtral as the llama
architecture with its q/k rows permuted, qwen2moe's shared-expert gate as
one row, phi3's fused tensors as they are and its longrope factors as
tensors. The reference is transformers' model of the original checkpoint
with each linear replaced by what gguf itself dequantizes it to.
"""

import asyncio
import math
import re

import gguf
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from tgi_server.quant.quant_linear import QuantLinear
from tgi_server.weights.gguf import GGUFFile

from ..shard_harness import (
    HF_CLASSES,
    InProcessShard,
    ShardProcesses,
    hf_greedy,
    run_prompts,
    save_tiny_model,
    torch_threads,
    with_tensors,
)
from .test_engine_matches_hf import engine_logits
from .test_quant_models import hf_logits, runner_for

Q = gguf.GGMLQuantizationType
ARCHS = {"phi3": gguf.MODEL_ARCH.PHI3, "mixtral": gguf.MODEL_ARCH.LLAMA, "qwen2_moe": gguf.MODEL_ARCH.QWEN2MOE,
         "qwen3_moe": gguf.MODEL_ARCH.QWEN3MOE}
# llama.cpp's qwen2moe and qwen3moe route on every layer; Q4_0 quantizes rows
# in blocks of 32 columns, so the shared expert's 48 rows become 64.
OVERRIDES = {"qwen2_moe": {"shared_expert_intermediate_size": 64, "mlp_only_layers": []},
             "qwen3_moe": {"decoder_sparse_step": 1}}
PROMPTS = [[1, 17, 33, 91, 5], list(range(3, 40)), [1, 64]]
_EXPERT = re.compile(r"(.*\.experts)\.(\d+)\.(\w+)\.weight")


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute (rotate-half rows -> interleaved pairs)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def quantized(data: np.ndarray, qtype) -> np.ndarray:
    return data if qtype == Q.F32 else gguf.quants.dequantize(gguf.quants.quantize(data, qtype), qtype)


def _stored_in(qtype, gguf_name: str, data: np.ndarray):
    """llama.cpp's converter keeps 1-D tensors, norms and MoE routers in F32."""
    return Q.F32 if data.ndim == 1 or gguf_name.endswith(("_norm.weight", "ffn_gate_inp.weight")) else qtype


def convert(model_type: str, source, out, qtype) -> dict[str, np.ndarray]:
    """Write the checkpoint at `source` to the GGUF file `out` with linears
    in `qtype`; returns HF name -> the values the file stands for."""
    config = HF_CLASSES[model_type][0].from_pretrained(source)
    tensors = load_file(str(source / "model.safetensors"))
    arch = ARCHS[model_type]
    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    writer = gguf.GGUFWriter(out, gguf.MODEL_ARCH_NAMES[arch])
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    if model_type != "phi3":
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
        writer.add_expert_count(getattr(config, "num_experts", None) or config.num_local_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
    if model_type in ("qwen2_moe", "qwen3_moe"):
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    if model_type == "qwen2_moe":
        writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
    if model_type == "phi3":
        rope = config.rope_parameters
        writer.add_rope_dimension_count(int(head_dim * rope["partial_rotary_factor"]))
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        writer.add_sliding_window(config.sliding_window)
        scale = config.max_position_embeddings / rope["original_max_position_embeddings"]
        writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(
            rope["original_max_position_embeddings"])) if scale > 1 else 1.0)
        writer.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], np.float32))
        writer.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], np.float32))
    # Row-wise block quantization commutes with mixtral's row permutation:
    # each HF tensor stands for its own rows quantized.
    stands_for, stacks = {}, {}
    for name, data in tensors.items():
        if match := _EXPERT.fullmatch(name):
            stacks.setdefault(f"{match[1]}.{match[3]}", {})[int(match[2])] = name
            stands_for[name] = quantized(data, qtype)
            continue
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        stored = _stored_in(qtype, gguf_name, data)
        stands_for[name] = quantized(data, stored)
        if model_type == "mixtral" and ".q_proj." in name:
            data = permute(data, config.num_attention_heads)
        if model_type == "mixtral" and ".k_proj." in name:
            data = permute(data, config.num_key_value_heads)
        if name.endswith("shared_expert_gate.weight"):
            data = data[0]  # llama.cpp's [hidden]
        writer.add_tensor(gguf_name, gguf.quants.quantize(data, stored), raw_dtype=stored)
    for merged, experts in stacks.items():
        data = np.stack([tensors[experts[e]] for e in range(len(experts))])  # [experts, rows, columns]
        gguf_name = names.get_name(merged + ".weight", try_suffixes=(".weight",))
        writer.add_tensor(gguf_name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return stands_for


def reference(model_type: str, source, stands_for: dict[str, np.ndarray], tmp_path):
    """transformers' model of `source` holding the `stands_for` tensors
    (saved beside its config, so transformers loads them as it would the
    original, experts renamed as it does)."""
    tensors = {name: torch.from_numpy(np.ascontiguousarray(v)) for name, v in stands_for.items()}
    directory = with_tensors(source, tensors, tmp_path / f"{model_type}-reference")
    return HF_CLASSES[model_type][1].from_pretrained(directory, dtype=torch.float32).eval()


@pytest.fixture(params=sorted(ARCHS))
def model_type(request):
    return request.param


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models in this process (transformers', an in-process shard's) on
    one torch thread, as the shard processes here run: beside other work, two
    OpenMP threads wait on each other in every op (torch_threads)."""
    with torch_threads(1):
        yield


def _file(model_type, tmp_path, qtype):
    source = save_tiny_model(model_type, tmp_path / model_type, **OVERRIDES.get(model_type, {}))
    path = tmp_path / f"{model_type}.{qtype.name}.gguf"
    stands_for = convert(model_type, source, path, qtype)
    return source, path, stands_for


def test_the_file_names_every_tensor_of_the_checkpoint_and_its_config(model_type, tmp_path):
    source, path, stands_for = _file(model_type, tmp_path, Q.F32)
    file = GGUFFile(path)
    assert set(file.names) == set(stands_for)
    for name, want in stands_for.items():
        np.testing.assert_array_equal(file.tensor(name), want, err_msg=name)
    ours = HF_CLASSES[model_type][0](**{k: v for k, v in file.config.items() if k != "model_type"})
    theirs = HF_CLASSES[model_type][0].from_pretrained(source)
    facts = ["num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size",
             "num_experts_per_tok", "num_experts", "num_local_experts", "moe_intermediate_size",
             "shared_expert_intermediate_size", "norm_topk_prob", "sliding_window", "mlp_only_layers",
             "decoder_sparse_step"]
    for fact in facts:
        assert getattr(ours, fact, None) == getattr(theirs, fact, None), fact
    if model_type == "phi3":
        assert ours.rope_parameters == {**theirs.rope_parameters, "attention_factor": 1.0}


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0], ids=lambda q: q.name)
def test_prefill_logits_equal_transformers_on_the_dequantized_weights(model_type, qtype, tmp_path):
    """Q8_0 is served dequantized; Q4_0 linears (each expert's rows of the
    stacked tensors too) run the int4 kernel on the file's blocks."""
    source, path, stands_for = _file(model_type, tmp_path, qtype)
    runner = runner_for(path)
    kernels = {m.kernel for m in runner.model.modules() if isinstance(m, QuantLinear)}
    assert kernels == ({"int4"} if qtype == Q.Q4_0 else set())
    model = reference(model_type, source, stands_for, tmp_path)
    # Q4_0's int4 kernel sums in another order than transformers: as in test_quant_models, within 4e-3.
    tolerance = 4e-3 if qtype == Q.Q4_0 else 1e-4
    for prompt in PROMPTS:
        assert (engine_logits(runner, prompt) - hf_logits(model, prompt)).abs().max() < tolerance


def test_greedy_tokens_equal_transformers_with_one_shard_and_two(model_type, tmp_path):
    """The two-shard group's processes start (import, load) while
    transformers and the in-process shard generate here."""
    source, path, stands_for = _file(model_type, tmp_path, Q.Q8_0)
    group = ShardProcesses(tmp_path, str(path), 2)
    try:
        model = reference(model_type, source, stands_for, tmp_path)
        expected = [hf_greedy(model, prompt, 16) for prompt in PROMPTS]
        with InProcessShard(tmp_path, str(path)) as shard:
            one = [s.generated_ids for s in asyncio.run(run_prompts(shard.socket, PROMPTS, 16))]
    except BaseException:
        group.__exit__(None, None, None)
        raise
    with group:
        two = [s.generated_ids for s in asyncio.run(run_prompts(group.sockets, PROMPTS, 16))]
    assert one == expected
    assert two == expected
