"""Quantized checkpoints served end to end on tiny random models: the
in-repo quantizer writes GPTQ / AWQ checkpoints, the shard loads them back
(method read from config.json), and its logits equal transformers' on the
dequantized weights and stay near the float model's; EETQ quantizes a float
checkpoint at load; GGUF Q4 files run on their blocks; tensor parallelism
composes with quantization."""

import asyncio

import pytest
import torch
import transformers

from tgi_kernels.native import native_ops
from tgi_proto import pb
from tgi_server import model_loader
from tgi_server.cli import main as server_cli
from tgi_server.config import ShardConfig
from tgi_server.distributed import TensorParallel
from tgi_server.model_loader import load_model, open_checkpoint
from tgi_server.model_runner import ModelRunner
from tgi_server.quant import QuantLinear, quantize_rtn
from tgi_server.shard import load_shard
from tgi_server.weights.errors import CheckpointError
from tgi_server.weights.gguf import load_gguf
from tgi_server.weights.resolve import resolve_model

from ..shard_harness import HF_CLASSES, InProcessShard, ShardProcesses, run_prompts, save_tiny_model
from .test_engine_matches_hf import engine_logits
from .test_gguf import Q, tiny_hf_tensors, write_tiny_gguf

PROMPTS = [[1, 17, 33, 91, 5, 200, 3, 4, 9, 64], list(range(3, 40))]
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
# name -> `text-generation-server quantize` flags (groups of 32: the tiny model's hidden size is 64)
METHODS = {
    "gptq": ["--method", "gptq", "--group-size", "32"],
    "gptq-act-order": ["--method", "gptq", "--group-size", "32", "--act-order"],
    "gptq-8bit": ["--method", "gptq", "--bits", "8", "--group-size", "-1"],
    "awq": ["--method", "awq", "--group-size", "32"],
}
CALIBRATION = ["--samples", "4", "--seq-len", "32"]


@pytest.fixture(scope="module")
def float_model(tmp_path_factory):
    return save_tiny_model("llama", tmp_path_factory.mktemp("float") / "m", num_attention_heads=8,
                           num_key_value_heads=4)


@pytest.fixture(scope="module", params=list(METHODS))
def quantized(request, float_model, tmp_path_factory):
    """(method name, checkpoint directory written by the CLI)."""
    out = tmp_path_factory.mktemp(request.param) / "q"
    server_cli(["quantize", str(float_model), str(out), *METHODS[request.param], *CALIBRATION])
    return request.param, out


def runner_for(path, quantize=None, device: str = "cpu") -> ModelRunner:
    """The shard's model runner for `path` (float32), warmed up."""
    config, weights = open_checkpoint(resolve_model(str(path)), torch.float32, torch.device(device), quantize)
    runner = ModelRunner(load_model(config, weights, TensorParallel()), 16, attention_backend=None,
                         kv_cache_bytes=16 << 20)
    runner.warmup(pb.WarmupRequest(max_batch_prefill_tokens=64, max_batch_size=4))
    return runner


def hf_logits(model, prompt):
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0]


def dequantized_reference(path) -> transformers.PreTrainedModel:
    """transformers' model holding what the checkpoint's tensors stand for:
    quantized linears dequantized by their format's reader, the rest as stored."""
    config, weights = open_checkpoint(resolve_model(str(path)), torch.float32, torch.device("cpu"))
    hf_config = transformers.AutoConfig.from_pretrained(path)
    del hf_config.quantization_config
    model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32).eval()
    state = {}
    for name in model.state_dict():
        prefix = name.removesuffix(".weight")
        if prefix.split(".", 3)[-1] in LINEARS:
            state[name] = weights.linear_format.read(weights, prefix).dequantize()
        elif weights.has(name):
            state[name] = weights.get(name)
    model.load_state_dict(state, strict=False)
    model.tie_weights()
    return model


def relative_error(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return float((ours - theirs).abs().mean() / theirs.abs().mean())


def test_the_method_comes_from_config_json_and_every_linear_is_quantized(quantized):
    name, path = quantized
    model = runner_for(path).model
    kernels = {m.kernel for m in model.modules() if isinstance(m, QuantLinear)}
    assert sum(isinstance(m, QuantLinear) for m in model.modules()) == 2 * 4
    assert kernels == ({"int8"} if name == "gptq-8bit" else {"int4"})


def test_logits_equal_the_dequantized_reference(quantized):
    _, path = quantized
    runner, reference = runner_for(path), dequantized_reference(path)
    for prompt in PROMPTS:
        assert (engine_logits(runner, prompt) - hf_logits(reference, prompt)).abs().max() < 1e-3


def kernel_input_dtype(layer: QuantLinear) -> torch.dtype:
    """The dtype a quantized layer's kernel computes x in: torch's int4 and int8 kernels
    take kernel_dtype (their scales' dtype); our int4 kernels the layer's own dtype."""
    if layer.kernel == "int4" and layer.native is not None:
        return layer.scale_offset.dtype
    return (layer.scale_zeros if layer.kernel == "int4" else layer.scale8).dtype


def test_without_dtype_a_cpu_lacking_bf16_feeds_its_quantized_kernels_bf16(quantized, tmp_path, monkeypatch):
    """The shard's default there: a float32 model whose torch int4/int8 kernels take
    bf16 (torch vectorizes them for bf16 only) and whose int4 GEMV (ours) rounds x
    to int8 where it can; --dtype float32 stays exact. Our int4 kernels take x in
    float32 either way."""
    _, path = quantized
    monkeypatch.setattr(model_loader, "_cpu_has_bf16", lambda: False)
    reference = dequantized_reference(path)

    def shard(dtype: str | None) -> tuple[ModelRunner, list[QuantLinear]]:
        runner, info = load_shard(ShardConfig(
            model_id=str(path), revision=None, uds_path=str(tmp_path / "s"), dtype=dtype, device="cpu",
            block_size=16, kv_cache_bytes=16 << 20, attention_backend=None, num_threads=0))
        runner.warmup(pb.WarmupRequest(max_batch_prefill_tokens=64, max_batch_size=4))
        assert info.dtype == "float32"
        return runner, [m for m in runner.model.modules() if isinstance(m, QuantLinear)]

    for dtype, kernel_dtype, tolerance in [(None, torch.bfloat16, 2e-2), ("float32", torch.float32, 1e-5)]:
        runner, layers = shard(dtype)
        ours = layers[0].kernel == "int4" and layers[0].native is not None
        assert {kernel_input_dtype(m) for m in layers} == {torch.float32 if ours else kernel_dtype}
        if ours and kernel_dtype == torch.bfloat16 and layers[0].gemv == native_ops().int4_gemv_int8x:
            # x rounded to int8 per 32 columns (llama.cpp's Q8 activations) in every GEMV of
            # up to gemv_max_rows rows: more error than bf16 activations give on these random
            # 2-layer models (figures: docs/tuning.md#quantized-logit-tolerances-in-tests).
            tolerance = 6e-2
        elif ours:
            tolerance = 1e-5
        for prompt in PROMPTS:
            ours = engine_logits(runner, prompt)
            assert ours.dtype == torch.float32 and relative_error(ours, hf_logits(reference, prompt)) < tolerance


@pytest.mark.gpu
def test_on_cuda_every_linear_runs_the_triton_kernel_with_the_cpu_s_logits(quantized):
    _, path = quantized
    runner, cpu = runner_for(path, device="cuda"), runner_for(path)
    assert {m.kernel for m in runner.model.modules() if isinstance(m, QuantLinear)} == {"triton"}
    for prompt in PROMPTS:
        ours = engine_logits(runner, prompt).float().cpu()
        assert (ours - engine_logits(cpu, prompt)).abs().max() < 1e-3  # float32 on both: summation order only


def test_logits_stay_close_to_the_float_model(quantized, float_model):
    name, path = quantized
    runner = runner_for(path)
    full = transformers.LlamaForCausalLM.from_pretrained(float_model).eval()
    # A random model amplifies weight noise: int8 per row moves its logits by ~2%, 4 bits by 30-45%.
    bound = 0.05 if name == "gptq-8bit" else 0.6
    for prompt in PROMPTS:
        assert relative_error(engine_logits(runner, prompt), hf_logits(full, prompt)) < bound


def test_a_flag_that_contradicts_the_checkpoint_is_refused(quantized):
    name, path = quantized
    other = "gptq" if name == "awq" else "awq"
    with pytest.raises(CheckpointError, match=f"--quantize {other} does not match"):
        runner_for(path, quantize=other)


def test_eetq_quantizes_a_float_checkpoint_to_int8_per_channel_at_load(float_model):
    runner = runner_for(float_model, quantize="eetq")
    assert {m.kernel for m in runner.model.modules() if isinstance(m, QuantLinear)} == {"int8"}
    full = transformers.LlamaForCausalLM.from_pretrained(float_model).eval()
    reference = transformers.LlamaForCausalLM.from_pretrained(float_model).eval()
    with torch.no_grad():
        for name, module in reference.named_modules():
            if isinstance(module, torch.nn.Linear) and name != "lm_head":
                module.weight.copy_(quantize_rtn(module.weight, 8, -1, symmetric=True).dequantize())
    for prompt in PROMPTS:
        ours = engine_logits(runner, prompt)
        assert (ours - hf_logits(reference, prompt)).abs().max() < 1e-4
        assert relative_error(ours, hf_logits(full, prompt)) < 0.05


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1], ids=lambda q: q.name)
def test_gguf_q4_linears_run_on_their_blocks_and_match_the_dequantized_file(qtype, tmp_path):
    path = write_tiny_gguf(tmp_path / "m.gguf", "llama", tiny_hf_tensors(bias=False, tied=False), qtype)
    runner = runner_for(path)
    assert {m.kernel for m in runner.model.modules() if isinstance(m, QuantLinear)} == {"int4"}
    assert runner.model.lm_head.gemv is None  # a Q4 head stays dense
    prompt = [1, 5, 9, 13, 40, 3, 77]
    # Against the exact product (the reference in float64): Q4_1's offsets make the kernel's
    # scale * sum(x q) + offset * sum(x) cancel, so float32 orders of summation differ by
    # more than transformers' own float32 run does from float64, though well under the
    # tolerance (figures: docs/tuning.md#quantized-logit-tolerances-in-tests). A wrong
    # nibble, scale or offset moves them by 1e-1 and more.
    exact = hf_logits(gguf_reference(path).double(), prompt).float()
    assert (engine_logits(runner, prompt) - exact).abs().max() < 4e-3


@pytest.mark.skipif(native_ops() is None, reason="the C++ CPU kernels did not build here")
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_a_q8_0_gguf_head_runs_its_int8_blocks_at_few_rows_and_equals_the_dequantized_file(tied, tmp_path):
    path = write_tiny_gguf(tmp_path / "m.gguf", "llama", tiny_hf_tensors(bias=False, tied=tied), Q.Q8_0)
    runner = runner_for(path)
    assert runner.model.lm_head.gemv is not None
    reference = gguf_reference(path)
    # 3 logits rows take the int8 GEMV, 37 the dense head
    for prompt in ([1, 5, 9], list(range(3, 40))):
        assert (engine_logits(runner, prompt) - hf_logits(reference, prompt)).abs().max() < 1e-3


def gguf_reference(path) -> transformers.PreTrainedModel:
    """transformers' Llama on the GGUF file's tensors as gguf dequantizes them, in float32."""
    checkpoint = load_gguf(path, torch.float32)
    values = dict(checkpoint.config)
    reference = transformers.LlamaForCausalLM(transformers.AutoConfig.for_model(values.pop("model_type"), **values))
    reference.load_state_dict(checkpoint.tensors, strict=False)
    reference.tie_weights()
    return reference.eval()


def test_quantize_on_a_gguf_file_is_refused(tmp_path):
    path = write_tiny_gguf(tmp_path / "m.gguf", "llama", tiny_hf_tensors(bias=False, tied=False), Q.Q4_0)
    with pytest.raises(CheckpointError, match="GGUF file is served with its own quantization"):
        runner_for(path, quantize="gptq")


@pytest.mark.parametrize("method", ["gptq", "gptq-act-order"])
def test_two_shards_with_quantize_gptq_give_one_shard_s_greedy_text(method, float_model, tmp_path):
    out = tmp_path / "q"
    server_cli(["quantize", str(float_model), str(out), *METHODS[method], *CALIBRATION])
    with InProcessShard(tmp_path, str(out)) as shard:
        one = [s.generated_ids for s in asyncio.run(run_prompts(shard.socket, PROMPTS, 12))]
    with ShardProcesses(tmp_path, str(out), 2, "--quantize", "gptq") as group:
        two = [s.generated_ids for s in asyncio.run(run_prompts(group.sockets, PROMPTS, 12))]
    assert two == one


@pytest.mark.parametrize("model_type", sorted(set(HF_CLASSES) - {"llama"}))
def test_eetq_quantizes_every_family_s_linears_at_load(model_type, tmp_path):
    """EETQ on the other families: every linear the decoder loads (fused qkv
    and gate_up slices, each expert's, the shared expert's) is int8 per
    channel, and the logits equal transformers' with those weights
    quantized-dequantized (the MoE routers and qwen2_moe's one-row shared
    expert gate stay float, in both)."""
    path = save_tiny_model(model_type, tmp_path / model_type)
    runner = runner_for(path, quantize="eetq")
    assert {m.kernel for m in runner.model.modules() if isinstance(m, QuantLinear)} == {"int8"}
    reference = HF_CLASSES[model_type][1].from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in reference.named_parameters():
            if name.endswith("shared_expert_gate.weight") or "lm_head" in name or "embed_tokens" in name:
                continue
            if p.dim() == 2 and not name.endswith("gate.weight"):  # a linear (not a router)
                p.copy_(quantize_rtn(p, 8, -1, symmetric=True).dequantize())
            elif p.dim() == 3:  # experts stacked [E, out, in]
                for e in range(p.shape[0]):
                    p[e] = quantize_rtn(p[e], 8, -1, symmetric=True).dequantize()
    for prompt in PROMPTS:
        assert (engine_logits(runner, prompt) - hf_logits(reference, prompt)).abs().max() < 1e-4


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_a_quantized_qwen3_serves_its_dequantized_weights(method, tmp_path):
    """The quantizer follows qwen3's layers (its q/k norms sit inside the
    attention it runs whole); the checkpoint loads and its logits equal
    transformers' Qwen3 on the dequantized weights."""
    out = tmp_path / "q"
    server_cli(["quantize", str(save_tiny_model("qwen3", tmp_path / "m")), str(out), *METHODS[method], *CALIBRATION])
    runner, reference = runner_for(out), dequantized_reference(out)
    assert sum(isinstance(m, QuantLinear) for m in runner.model.modules()) == 3 * 4
    for prompt in PROMPTS:
        assert (engine_logits(runner, prompt) - hf_logits(reference, prompt)).abs().max() < 1e-3


def test_the_quantizer_refuses_layers_it_does_not_follow(tmp_path, capsys):
    with pytest.raises(SystemExit):
        server_cli(["quantize", str(save_tiny_model("gemma3_text", tmp_path / "m")), str(tmp_path / "q"),
                    *METHODS["gptq"], *CALIBRATION])
    assert "the quantizer follows the decoder layers of llama, mistral, qwen2, qwen3, not gemma3_text's" \
        in capsys.readouterr().err
