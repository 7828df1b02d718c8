"""Multi-LoRA serving on the shard: a tiny random llama and three PEFT
adapters (built with peft: different ranks, target modules and alphas, one
with rsLoRA scaling, one with a per-module alpha) served together; a batch
that mixes all three and the base gives each request the greedy tokens of
transformers + peft with its adapter merged, on one shard, on two, and on
an EETQ-quantized base (against the merged model quantized likewise)."""

import asyncio

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model

from tgi_server.quant import QuantLinear, quantize_rtn
from tgi_server.weights.errors import CheckpointError
from tgi_server.weights.lora_adapters import load_adapter, parse_spec

from ..shard_harness import HF_CLASSES, InProcessShard, ShardProcesses, hf_greedy, run_prompts, save_tiny_model

ADAPTERS = {
    "small": dict(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"]),
    "wide": dict(r=8, lora_alpha=16, use_rslora=True,
                 target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    "mlp": dict(r=4, lora_alpha=8, target_modules=["gate_proj", "down_proj", "o_proj"], alpha_pattern={"o_proj": 2}),
}
PROMPTS = [[1, 17, 33, 91, 5], list(range(3, 40)), [1, 64, 9], [1, 200, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14]]
NEW_TOKENS = 24


def save_adapter(base_path, out, seed: int, **config) -> None:
    """A PEFT adapter with random A and B (B is zero at PEFT's own init: the adapter would do nothing)."""
    model = HF_CLASSES["llama"][1].from_pretrained(base_path, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(init_lora_weights=False, **config))
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.3)
    peft_model.save_pretrained(out)


@pytest.fixture(scope="module")
def lora_model(tmp_path_factory):
    """(base path, --lora-adapters text, {adapter index: merged transformers model})."""
    root = tmp_path_factory.mktemp("lora")
    base = save_tiny_model("llama", root / "base")
    merged = {0: HF_CLASSES["llama"][1].from_pretrained(base, dtype=torch.float32).eval()}
    specs = []
    for i, (name, config) in enumerate(ADAPTERS.items(), start=1):
        save_adapter(base, root / name, seed=i, **config)
        model = HF_CLASSES["llama"][1].from_pretrained(base, dtype=torch.float32)
        merged[i] = PeftModel.from_pretrained(model, root / name).merge_and_unload().eval()
        specs.append(f"{name}={root / name}")
    return base, ",".join(specs), merged


def mixed(merged) -> tuple[list[list[int]], list[int], list[list[int]]]:
    """Every prompt under every adapter and the base: (prompts, adapters, transformers' greedy tokens)."""
    prompts, adapters, expected = [], [], []
    for prompt in PROMPTS:
        for index, model in merged.items():
            prompts.append(prompt)
            adapters.append(index)
            expected.append(hf_greedy(model, prompt, NEW_TOKENS))
    return prompts, adapters, expected


def test_a_batch_mixing_three_adapters_and_the_base_matches_peft_merged(lora_model, tmp_path):
    base, spec, merged = lora_model
    prompts, adapters, expected = mixed(merged)
    assert len({tuple(e) for e in expected[:len(merged)]}) == len(merged)  # the adapters change the answer
    with InProcessShard(tmp_path, str(base), lora_adapters=spec) as shard:
        assert list(shard.info.adapter_ids) == list(ADAPTERS)
        seqs = asyncio.run(run_prompts(shard.socket, prompts, NEW_TOKENS, adapters=adapters))
    assert [s.generated_ids for s in seqs] == expected


def test_two_shards_split_the_adapters_with_the_layers(lora_model, tmp_path):
    base, spec, merged = lora_model
    prompts, adapters, expected = mixed(merged)
    with ShardProcesses(tmp_path, str(base), 2, "--lora-adapters", spec) as group:
        seqs = asyncio.run(run_prompts(group.sockets, prompts, NEW_TOKENS, adapters=adapters))
    assert [s.generated_ids for s in seqs] == expected


def test_spec_syntax_and_bad_adapters_are_one_line_errors(lora_model, tmp_path):
    assert parse_spec("org/a, b=/x/y") == [("org/a", "org/a"), ("b", "/x/y")]
    with pytest.raises(CheckpointError, match="appears twice"):
        parse_spec("a=/x,a=/y")
    with pytest.raises(CheckpointError, match="cannot read"):
        load_adapter("none", str(tmp_path))


def test_adapters_on_an_eetq_quantized_base(lora_model, tmp_path):
    """The base's linears int8 (EETQ at load), the adapters' deltas in float
    beside them: transformers' base with each linear quantized and
    dequantized the same way, the adapter applied (unmerged) by peft."""
    base, spec, _ = lora_model
    expected, prompts, adapters = [], [], []
    for index, name in enumerate([None, *ADAPTERS]):
        model = HF_CLASSES["llama"][1].from_pretrained(base, dtype=torch.float32)
        with torch.no_grad():
            for module_name, module in model.named_modules():
                if isinstance(module, torch.nn.Linear) and module_name != "lm_head":
                    module.weight.copy_(quantize_rtn(module.weight, 8, -1, symmetric=True).dequantize())
        if name is not None:
            model = PeftModel.from_pretrained(model, base.parent / name)
        for prompt in PROMPTS:
            prompts.append(prompt)
            adapters.append(index)
            expected.append(hf_greedy(model.eval(), prompt, NEW_TOKENS))
    with InProcessShard(tmp_path, str(base), lora_adapters=spec, quantize="eetq") as shard:
        assert {m.kernel for m in shard.runner.model.modules() if isinstance(m, QuantLinear)} == {"int8"}
        seqs = asyncio.run(run_prompts(shard.socket, prompts, NEW_TOKENS, adapters=adapters))
    assert [s.generated_ids for s in seqs] == expected


def test_short_runs_take_the_cpu_kernel_and_long_ones_the_gemms_with_the_same_result():
    """LoraLinear on the CPU: runs under GEMM_ROWS rows go to the C++ kernel
    in one call, longer ones (a prefill's) to a GEMM pair each; either way
    every run gets its adapter's delta, as the all-torch path computes it."""
    from torch import nn

    from tgi_server.layers.lora import GEMM_ROWS, AdapterSet, LoraLinear

    torch.manual_seed(0)
    base = nn.Linear(48, 80, bias=False)
    deltas = {1: (torch.randn(6, 48), torch.randn(80, 6)), 3: (torch.randn(3, 48), torch.randn(80, 3))}
    adapters = AdapterSet([])
    layer = LoraLinear(base, deltas, 3, adapters.batch, None, torch.float32, torch.device("cpu"))
    x = torch.randn(GEMM_ROWS + 20, 48)
    adapters.set_segments([(1, 0, GEMM_ROWS + 2), (3, GEMM_ROWS + 2, GEMM_ROWS + 9), (2, GEMM_ROWS + 9, GEMM_ROWS + 12),
                           (1, GEMM_ROWS + 12, GEMM_ROWS + 15)])
    assert adapters.batch.long == [(1, 0, GEMM_ROWS + 2)] and len(adapters.batch.short) == 3
    want = base(x)
    for index, start, stop in adapters.batch.segments:
        if index in deltas:
            a, b = deltas[index]
            want[start:stop] += x[start:stop] @ a.t() @ b.t()
    with torch.no_grad():
        got = layer(x)
        layer.native = None
        torch_only = layer(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch_only, want, rtol=1e-5, atol=1e-5)
