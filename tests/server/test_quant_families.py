"""GPTQ and AWQ checkpoints of the families our quantizer does not write
(gemma2/3, phi3, smollm3 and the MoE families) load through the same
linears as llama's and serve transformers' logits on their dequantized
weights: each linear of a tiny checkpoint rounded to 4 bits in groups of 32
and written in the format's layout (quantizer/export.py), phi3's fused
tensors and every expert's projections included, the MoE routers and
qwen2_moe's shared-expert gate left in float."""

import re

import pytest
import torch
import transformers
from safetensors.torch import load_file

from tgi_server.model_loader import open_checkpoint
from tgi_server.quant import QuantLinear, quantize_rtn
from tgi_server.quant.quantizer.export import awq_tensors, gptq_tensors, quantization_config
from tgi_server.weights.resolve import resolve_model

from ..shard_harness import HF_CLASSES, save_tiny_model, with_tensors
from .test_engine_matches_hf import engine_logits
from .test_quant_models import hf_logits, runner_for

FAMILIES = ["gemma2", "gemma3_text", "phi3", "smollm3", "mixtral", "qwen2_moe", "qwen3_moe"]
# Groups of 32 columns: the shared expert's 48 rows become 64.
OVERRIDES = {"qwen2_moe": {"shared_expert_intermediate_size": 64}}
LINEAR = re.compile(r".*\.(\w*proj|w[123])\.weight")
PROMPTS = [[1, 17, 33, 91, 5, 200, 3, 4, 9, 64], list(range(3, 40))]


def quantize_checkpoint(source, out, method: str) -> tuple[dict[str, torch.Tensor], int]:
    """Write `source` as a `method` checkpoint at `out`; returns (the
    checkpoint's tensors with each quantized linear as the format's reader
    dequantizes it (float16 scales), how many linears were quantized)."""
    tensors = load_file(str(source / "model.safetensors"))
    to_tensors = gptq_tensors if method == "gptq" else awq_tensors
    state, linears = {}, []
    for name, tensor in tensors.items():
        if LINEAR.fullmatch(name):
            state.update(to_tensors(name.removesuffix(".weight"), quantize_rtn(tensor, 4, 32, symmetric=False)))
            linears.append(name)
        else:
            state[name] = tensor
    with_tensors(source, state, out)
    config = transformers.AutoConfig.from_pretrained(source).to_dict()
    config["quantization_config"] = quantization_config(method, 4, 32, act_order=False, symmetric=False)
    (out / "config.json").write_text(transformers.AutoConfig.for_model(**config).to_json_string())
    _, weights = open_checkpoint(resolve_model(str(out)), torch.float32, torch.device("cpu"))
    stands_for = {name: tensor for name, tensor in tensors.items() if name not in linears}
    for name in linears:
        stands_for[name] = weights.linear_format.read(weights, name.removesuffix(".weight")).dequantize()
    return stands_for, len(linears)


@pytest.mark.parametrize("method", ["gptq", "awq"])
@pytest.mark.parametrize("model_type", FAMILIES)
def test_a_quantized_checkpoint_serves_its_dequantized_weights(model_type, method, tmp_path):
    source = save_tiny_model(model_type, tmp_path / "float", **OVERRIDES.get(model_type, {}))
    stands_for, count = quantize_checkpoint(source, tmp_path / "q", method)
    runner = runner_for(tmp_path / "q")
    layers = [m for m in runner.model.modules() if isinstance(m, QuantLinear)]
    assert {m.kernel for m in layers} == {"int4"}
    # q, k and v run as one layer, gate and up (w1 and w3) as one
    merged = sum(2 * n.endswith(".v_proj.weight") + n.endswith((".up_proj.weight", ".w3.weight")) for n in stands_for)
    assert len(layers) == count - merged
    reference_dir = with_tensors(source, stands_for, tmp_path / "reference")
    reference = HF_CLASSES[model_type][1].from_pretrained(reference_dir, dtype=torch.float32).eval()
    for prompt in PROMPTS:
        assert (engine_logits(runner, prompt) - hf_logits(reference, prompt)).abs().max() < 1e-3
