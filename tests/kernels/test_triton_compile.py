"""The Triton kernels compile for a CUDA GPU (sm_90), checked without one."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
def test_every_kernel_compiles_to_ptx_for_sm90(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_DEFAULT_FP_FUSION="1", TRITON_CACHE_DIR=str(tmp_path))  # a real compile, not a cache hit
    done = subprocess.run([sys.executable, "-m", "tests.kernels.compile_for_cuda"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    compiled = done.stdout.splitlines()
    # two dtype/shape cases x five attention kernels (decode: one split and several) and the
    # rotary store, four plus the rotary store over an e4m3fn cache (merge_splits reads none), both
    # stores into e5m2; and two dtypes x four per-token kernels (norm with and without the add, silu, gelu)
    assert len(compiled) == 2 * 6 + 5 + 2 + 2 * 4
    assert all(line.startswith("compiled ") for line in compiled)
