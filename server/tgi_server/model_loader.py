"""Loads a resolved checkpoint into our model on the serving device and dtype:
`open_checkpoint` reads the model's facts (no weights yet), `load_model`
builds this rank's slice of the model from them."""

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import AutoConfig, PretrainedConfig

from .distributed import TensorParallel
from .layers.lora import AdapterSet
from .models import ModelConfig, build_model
from .models.rope_override import override_rope
from .quant import linear_format
from .weights.errors import CheckpointError
from .weights.lora_adapters import load_adapters
from .weights.resolve import ModelSource
from .weights.source import GGUFSource, SafetensorsSource, TensorSource

DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16,
          "float16": torch.float16}


@dataclass(frozen=True)
class LoadedModel:
    model: nn.Module
    config: ModelConfig         # the whole model's facts (head counts of all ranks together)
    dtype: torch.dtype
    device: torch.device
    tp: TensorParallel          # the group the model is a slice for
    weight_bytes: int           # this rank's parameters, prepacked ones included
    adapters: AdapterSet | None = None  # LoRA adapters its linears add (--lora-adapters)


def default_dtype(device: torch.device) -> torch.dtype:
    """bfloat16 where the hardware computes it natively, float32 elsewhere on
    CPU, float16 on GPUs without bfloat16."""
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if _cpu_has_bf16() else torch.float32


def default_quant_kernel_dtype(device: torch.device, dtype: torch.dtype) -> torch.dtype | None:
    """Where the serving dtype was not asked for: bfloat16 activations in the
    quantized CPU kernels of a float32 model. torch's int4 and int8 kernels are
    vectorized only for bf16, on AVX2 too (figures:
    docs/tuning.md#bf16-kernels-for-float32-models); and float32
    is the default only on CPUs that lack bf16, where bf16 GEMMs elsewhere
    would be slow. --dtype float32 keeps float32 exact throughout."""
    return torch.bfloat16 if device.type == "cpu" and dtype == torch.float32 else None


def _cpu_has_bf16() -> bool:
    """True where this process computes bf16 natively: the CPU has
    AVX512-BF16 or AMX-BF16, ATen dispatches its AVX-512 kernels and oneDNN
    may use bf16. ATEN_CPU_CAPABILITY and ONEDNN_MAX_CPU_ISA lower the last
    two, which is how an AVX2-only CPU is emulated on a newer one: there
    bf16 is emulated several times slower than float32."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return (("avx512_bf16" in flags or "amx_bf16" in flags)
            and torch.backends.cpu.get_cpu_capability() == "AVX512"
            and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def open_checkpoint(source: ModelSource, dtype: torch.dtype, device: torch.device,
                    quantize: str | None = None, quant_kernel_dtype: torch.dtype | None = None,
                    rope: tuple[str, float] | None = None, lora_adapters: str | None = None,
                    kv_scales: bool = False) -> tuple[ModelConfig, TensorSource]:
    """The model's facts and a source of its tensors in (dtype, device); reads
    no weight. `quantize` (gptq | awq | eetq; None: config.json's
    quantization_config, if any) picks how linears load; a GGUF file serves
    its Q4_0/Q4_1 blocks quantized. quant_kernel_dtype: the activations'
    dtype inside quantized CPU kernels (QuantLinear's kernel_dtype; None:
    dtype). rope: (scaling, factor) replacing the checkpoint's RoPE scaling
    (models/rope_override.py). lora_adapters: --lora-adapters' list, read
    now (weights/lora_adapters.py) and added by the linears they target.
    kv_scales: attention layers read the checkpoint's KV cache scales (the
    cache is float8). CheckpointError when the checkpoint cannot be served."""
    config, weights = _open(source, dtype, device, quantize, quant_kernel_dtype, rope)
    weights.kv_scales = kv_scales
    if lora_adapters:
        weights.lora = AdapterSet(load_adapters(lora_adapters))
    return config, weights


def _open(source: ModelSource, dtype: torch.dtype, device: torch.device, quantize: str | None,
          quant_kernel_dtype: torch.dtype | None, rope: tuple[str, float] | None) -> tuple[ModelConfig, TensorSource]:
    if source.format == "gguf":
        from .quant.gguf_linear import GGUFFormat
        from .quant.quant_linear import PACKED_KERNEL_DTYPES
        from .weights.gguf import GGUFFile

        if quantize is not None:
            raise CheckpointError(f"--quantize {quantize} applies to safetensors checkpoints; "
                                  "a GGUF file is served with its own quantization")
        file = GGUFFile(source.path)
        weights = GGUFSource(file, dtype, device)
        weights.quant_kernel_dtype = quant_kernel_dtype
        # In float64 (exact comparisons) the file is served dequantized, as
        # torch's packed kernels take 16- and 32-bit activations only.
        if dtype in PACKED_KERNEL_DTYPES:
            weights.linear_format = GGUFFormat(file)
        return _model_config(_config_from_dict(file.config), rope), weights
    try:
        # Never the hub's code: a model that needs it fails here, without a prompt.
        hf_config = AutoConfig.from_pretrained(source.path, trust_remote_code=False)
    except (OSError, ValueError, KeyError) as err:
        raise CheckpointError(f"{source.path}/config.json: {str(err).splitlines()[0]}") from None
    quant = getattr(hf_config, "quantization_config", None)
    if quant is not None and not isinstance(quant, dict):
        quant = quant.to_dict()
    weights = SafetensorsSource(source.path, dtype, device)
    weights.linear_format = linear_format(quantize, quant)
    weights.quant_kernel_dtype = quant_kernel_dtype
    return _model_config(hf_config, rope), weights


def _model_config(hf_config: PretrainedConfig, rope: tuple[str, float] | None) -> ModelConfig:
    if rope is None:
        return ModelConfig.from_hf(hf_config)
    length = override_rope(hf_config, *rope)
    return dataclasses.replace(ModelConfig.from_hf(hf_config), max_position_embeddings=length)


def load_model(config: ModelConfig, weights: TensorSource, tp: TensorParallel) -> LoadedModel:
    """This rank's slice of the model; the caller has checked that `config`
    splits over tp.world_size (ModelConfig.check_tensor_parallel)."""
    with torch.device(weights.device):
        model = build_model(weights, config, tp).eval()
    if weights.lora is not None:
        weights.lora.check_all_used()
    return LoadedModel(model, config, weights.dtype, weights.device, tp, weight_bytes(model), weights.lora)


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's distinct weights: parameters (a tied weight once;
    quantized layers hold their packed values as parameters) and the dense
    linears' weights in their GEMM's layout (oneDNN-prepacked, or ours),
    which are not parameters."""
    seen: dict[int, int] = {}
    for module in model.modules():
        tensors = list(module.parameters(recurse=False))
        for layout in ("packed", "lanes"):
            held = getattr(module, layout, None)
            if isinstance(held, torch.Tensor):
                tensors.append(held)
        for t in tensors:
            # A prepacked (opaque) tensor has no data pointer to share: key it by identity.
            key = id(t) if t.is_mkldnn else t.data_ptr()
            seen[key] = t.numel() * t.element_size()
    return sum(seen.values())


def _config_from_dict(config: dict) -> PretrainedConfig:
    values = dict(config)
    model_type = values.pop("model_type", None)
    try:
        return AutoConfig.for_model(model_type, **values)
    except ValueError:
        raise CheckpointError(f"unsupported architecture {model_type!r}") from None
