"""`"watermark": true` through the launcher on the default model: answers of
200 tokens written with it score z > 4 with the detector; answers written
without it score below the detector's threshold each, and near 0 together
(|mean z| < 2; `make bench BENCH=watermark` measures 20 of each); and the
detector's command line says which is which in its exit code.

An unmarked answer's z is a draw from about N(0, 1), and which one the
server writes depends on which requests shared its steps (the int4 GEMMs'
rows): each of four under 2 holds in only ~83% of runs (draws seen:
docs/tuning.md#watermark-test-bounds). Their mean's spread is half a z."""

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

from benchmarks.watermark import TOPICS, answers
from tgi_server.sampling.watermark_detect import THRESHOLD, detect

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
    plain_z = [detect(None, text)["z"] for text, _ in plain]
    assert all(z < THRESHOLD for z in plain_z) and abs(sum(plain_z) / len(plain_z)) < 2, plain_z
    for (text, _), code in ((marked[0], 0), (plain[0], 1)):
        done = subprocess.run([sys.executable, "-m", "tgi_server.cli", "watermark-detect"], input=text,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == code and json.loads(done.stdout) == detect(None, text)
