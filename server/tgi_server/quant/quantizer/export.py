"""Writes quantized checkpoints in the layouts other engines load (TGI,
vLLM, transformers with gptqmodel / autoawq): config.json with
quantization_config, model.safetensors with each quantized linear as
qweight / qzeros / scales (/ g_idx) and every other tensor in float16."""

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..packing import awq_pack, pack
from ..quantized_matrix import QuantizedMatrix


def gptq_tensors(prefix: str, m: QuantizedMatrix) -> dict[str, torch.Tensor]:
    """GPTQ v1 ("gptq" checkpoint_format): zeros stored minus one (the
    solver keeps zeros >= 1, so nothing wraps)."""
    zeros = torch.round(-m.offsets / m.scales).to(torch.int64)  # [N, G]
    return {f"{prefix}.qweight": pack(m.q.T, m.bits, dim=0),
            f"{prefix}.qzeros": pack(zeros.T - 1, m.bits, dim=1),
            f"{prefix}.scales": m.scales.T.contiguous().to(torch.float16),
            f"{prefix}.g_idx": m.group.to(torch.int32)}


def awq_tensors(prefix: str, m: QuantizedMatrix) -> dict[str, torch.Tensor]:
    """AWQ's GEMM layout (version "gemm")."""
    zeros = torch.round(-m.offsets / m.scales).to(torch.int64)
    return {f"{prefix}.qweight": awq_pack(m.q.T),
            f"{prefix}.qzeros": awq_pack(zeros.T),
            f"{prefix}.scales": m.scales.T.contiguous().to(torch.float16)}


def quantization_config(method: str, bits: int, group_size: int, act_order: bool, symmetric: bool) -> dict:
    if method == "gptq":
        return {"quant_method": "gptq", "bits": bits, "group_size": group_size, "desc_act": act_order,
                "sym": symmetric, "true_sequential": True, "checkpoint_format": "gptq"}
    return {"quant_method": "awq", "bits": bits, "group_size": group_size, "zero_point": True,
            "version": "gemm"}


def save_quantized(model, matrices: dict[str, QuantizedMatrix], out: Path, method: str, group_size: int,
                   act_order: bool, symmetric: bool, tokenizer=None) -> None:
    """model: the (AWQ-rescaled) float model; matrices: linear prefix ->
    its quantized weight. Writes config.json, model.safetensors and the
    tokenizer files into `out`."""
    out.mkdir(parents=True, exist_ok=True)
    to_tensors = gptq_tensors if method == "gptq" else awq_tensors
    state = {name: t.detach().to(torch.float16).contiguous() for name, t in model.state_dict().items()
             if name.removesuffix(".weight") not in matrices}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    for prefix, m in matrices.items():
        state.update(to_tensors(prefix, m))
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    bits = next(iter(matrices.values())).bits
    config.update(quantization_config=quantization_config(method, bits, group_size, act_order, symmetric),
                  torch_dtype="float16", dtype="float16")
    (out / "config.json").write_text(json.dumps(config, indent=2, default=str))
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
