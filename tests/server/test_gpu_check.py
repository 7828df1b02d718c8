"""`make gpu-check` fails fast and clearly where there is no GPU: one JSON line, exit 1."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(Path("/dev/nvidia0").exists() or shutil.which("nvidia-smi") is not None,
                    reason="a GPU is here: the check would run for real")
def test_gpu_check_without_a_gpu_prints_one_json_line_and_exits_1():
    done = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    lines = done.stdout.splitlines()
    assert done.returncode == 1 and len(lines) == 1
    result = json.loads(lines[0])
    assert result["ok"] is False and "no NVIDIA GPU" in result["env"]["error"]


def test_the_check_collects_every_file_with_gpu_tests_and_no_other():
    from benchmarks.gpu_check import gpu_test_files

    files = gpu_test_files()
    assert "tests/kernels/test_triton_kernels.py" in files and "tests/server/test_decode_graphs.py" in files
    assert "tests/e2e/test_fuzz.py" not in files  # its schemathesis import is not needed on the GPU machine
    assert "tests/server/test_gpu_check.py" not in files  # names the marker in a string only
    for name in files:
        assert "pytest.mark.gpu" in (ROOT / name).read_text()


@pytest.mark.parametrize("module", ["benchmarks.gpu_check", "benchmarks.gpu_step"])
def test_the_gpu_benchmarks_plumbing_runs_on_cpu_with_a_tiny_model(module, tmp_path):
    """Their --smoke-cpu runs: the GPU machine is lent rarely, so a broken
    benchmark must show up here first."""
    done = subprocess.run([sys.executable, "-m", module, "--smoke-cpu"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.splitlines()[-1])
    if module == "benchmarks.gpu_check":
        assert result["b1_async_same_tokens"] is True and result["b4_tok_s"] > 0
    else:  # the tiny model's greedy tokens and prompt logprobs are transformers'
        assert result["hf_greedy_same_prefix_of_16"] == 16 and result["hf_prompt_logprob_maxdiff"] < 0.01
        assert result["b4"]["step_ms"] > 0
