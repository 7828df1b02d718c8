"""`"watermark": true` through the launcher on the default model: answers of
200 tokens written with it score z > 4 with the detector, answers written
without it |z| < 2 (`make bench BENCH=watermark` measures 20 of each), and
the detector's command line says which is which in its exit code."""

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

from benchmarks.watermark import TOPICS, answers
from tgi_server.sampling.watermark_detect import detect

from .router_harness import launch


def test_watermarked_answers_are_detected_and_others_are_not(tmp_path):
    # a 512-token prefill budget: Warmup runs one such step (18 s at 4096 on two cores)
    proc, url = launch(None, tmp_path, "--kv-cache-bytes", "512MiB", "--max-batch-prefill-tokens", "512")
    try:
        with ThreadPoolExecutor(2) as pool:  # all eight at once: 200 steps of batch 8
            marked, plain = pool.map(lambda watermark: answers(url, TOPICS[:4], watermark), (True, False))
    finally:
        proc.terminate()
        proc.wait(30)
    assert all(n == 200 for _, n in marked + plain)
    assert all(detect(None, text)["z"] > 4 for text, _ in marked)
    assert all(abs(detect(None, text)["z"]) < 2 for text, _ in plain)
    for (text, _), code in ((marked[0], 0), (plain[0], 1)):
        done = subprocess.run([sys.executable, "-m", "tgi_server.cli", "watermark-detect"], input=text,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == code and json.loads(done.stdout) == detect(None, text)
