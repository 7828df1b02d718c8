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
from tgi_server.sampling.watermark_detect import THRESHOLD, detect, load_scorer

from .router_harness import launch, wait_launched


def test_watermarked_answers_are_detected_and_others_are_not(tmp_path):
    # Each detector command line loads the tokenizer before it reads its
    # text: both start now, beside the server's start.
    detectors = [subprocess.Popen([sys.executable, "-m", "tgi_server.cli", "watermark-detect"], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    try:
        # A 512-token prefill budget: Warmup runs one such step (18 s at 4096 on two cores). 128 MiB
        # of float32 KV: 182 blocks of 16 tokens, the eight answers' ~112 all at once.
        proc, url = launch(None, tmp_path, "--kv-cache-bytes", "128MiB", "--max-batch-prefill-tokens", "512",
                           wait=False)
        try:
            load_scorer(None)  # this process's, beside the start too
            wait_launched(proc, url, tmp_path)
            with ThreadPoolExecutor(2) as pool:  # all eight at once: 200 steps of batch 8
                marked, plain = pool.map(lambda watermark: answers(url, TOPICS[:4], watermark), (True, False))
        finally:
            proc.terminate()
            proc.wait(30)
        assert all(n == 200 for _, n in marked + plain)
        # The command line on a marked and an unmarked answer, scoring them while this process does too:
        # its exit code says which.
        for detector, (text, _) in zip(detectors, (marked[0], plain[0])):
            detector.stdin.write(text)
            detector.stdin.flush()
        marked_scores = [detect(None, text) for text, _ in marked]
        plain_scores = [detect(None, text) for text, _ in plain]
        assert all(score["z"] > 4 for score in marked_scores)
        plain_z = [score["z"] for score in plain_scores]
        assert all(z < THRESHOLD for z in plain_z) and abs(sum(plain_z) / len(plain_z)) < 2, plain_z
        for detector, score, code in zip(detectors, (marked_scores[0], plain_scores[0]), (0, 1)):
            out, err = detector.communicate(timeout=120)  # closes its stdin: it reads to the end
            assert detector.returncode == code and json.loads(out) == score, err
    finally:
        for detector in detectors:
            if detector.poll() is None:
                detector.kill()
                detector.wait(30)
