"""How much memory the KV cache may take when the caller names no budget."""

from pathlib import Path

import torch

CPU_FRACTION = 0.2          # of MemAvailable: the router, tokenizer and OS need the rest
CPU_CAP = 4 << 30
CUDA_FRACTION = 0.9         # of free device memory after Warmup's largest step


def kv_cache_budget(device: torch.device, world_size: int = 1) -> int:
    """Bytes for this rank's cache. The ranks of a CPU group share the host's
    memory, so each takes 1/world_size of the host's share; a GPU is a rank's own."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * CUDA_FRACTION)
    return int(min(_mem_available() * CPU_FRACTION, CPU_CAP) / world_size)


def _mem_available() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 << 30
