"""What a benchmark figure was measured on: the CPU and the dtype the shard
chooses on it. Every CPU benchmark runs its model and its baselines in
`serving_dtype()`, the shard's own default rule, so that a CPU without
native bf16 is measured in float32 rather than in emulated bf16."""

import os
import platform
from pathlib import Path

import torch

from tgi_server.model_loader import default_dtype

CPU = torch.device("cpu")
# The flags that decide which kernels run: vector width, bf16 and int8 dot products.
FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_bf16", "amx_int8")


def serving_dtype() -> torch.dtype:
    """The dtype the shard serves in on this CPU when --dtype is not given."""
    return default_dtype(CPU)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def machine_facts() -> dict:
    """Keys every benchmark JSON line carries: the CPU's model, flags and
    cores, the kernels torch and oneDNN dispatch (ATEN_CPU_CAPABILITY and
    ONEDNN_MAX_CPU_ISA lower them), and the serving dtype. (Each benchmark
    sets its own thread count: THREADS in its module.)"""
    model, flags = platform.processor(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
    except OSError:
        pass
    return {"dtype": dtype_name(serving_dtype()), "cpu_model": model,
            "cpu_flags": " ".join(f for f in FLAGS if f in flags),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "onednn_bf16": torch.ops.mkldnn._is_mkldnn_bf16_supported(), "cores": os.cpu_count()}
