"""How much memory the KV cache may take when the caller names no budget."""

from pathlib import Path

import torch

CPU_FRACTION = 0.2          # of MemAvailable: the router, tokenizer and OS need the rest
CPU_CAP = 4 << 30
CUDA_FRACTION = 0.9         # of free device memory after Warmup's largest step


def kv_cache_budget(device: torch.device, world_size: int = 1, memory_fraction: float = 1.0) -> int:
    """Bytes for this rank's cache. The ranks of a CPU group share the host's
    memory, so each takes 1/world_size of the host's share; a GPU is a rank's
    own, of which the shard may hold `memory_fraction` (--cuda-memory-fraction,
    as TGI: what is free beyond (1 - fraction) of the device's total)."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return cuda_budget(free, total, memory_fraction)
    return int(min(_mem_available() * CPU_FRACTION, CPU_CAP) / world_size)


def cuda_budget(free: int, total: int, memory_fraction: float) -> int:
    """The cache's bytes on a GPU with `free` of `total` bytes free after
    Warmup's largest step, when the shard may use `memory_fraction` of it all."""
    return int(max(0.0, free - (1.0 - memory_fraction) * total) * CUDA_FRACTION)


def _mem_available() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 << 30
