"""How much memory Warmup gives the KV cache when no budget is named."""

import pytest
import torch

from tgi_server.memory import CUDA_FRACTION, cuda_budget, kv_cache_budget

GIB = 1 << 30


@pytest.mark.parametrize("free,fraction,expected", [
    (60 * GIB, 1.0, 60 * GIB),     # the whole GPU may be used: what is free
    (60 * GIB, 0.5, 20 * GIB),     # TGI's get_free_memory: free - (1 - 0.5) * 80 GiB
    (30 * GIB, 0.5, 0),            # more than the fraction is held already: nothing left
])
def test_cuda_memory_fraction_holds_back_its_share_of_the_total(free, fraction, expected):
    assert cuda_budget(free, 80 * GIB, fraction) == int(expected * CUDA_FRACTION)


def test_on_cpu_the_fraction_does_not_apply_and_ranks_split_the_host_share():
    one = kv_cache_budget(torch.device("cpu"), 1, memory_fraction=0.25)
    assert one == kv_cache_budget(torch.device("cpu"), 1) > 0
    assert kv_cache_budget(torch.device("cpu"), 2) == pytest.approx(one / 2, rel=0.05)
