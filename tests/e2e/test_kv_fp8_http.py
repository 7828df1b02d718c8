"""`--kv-cache-dtype fp8_e4m3fn` through the launcher: the shard gets the
flag, Warmup fits four times the float32 cache's blocks in the same
--kv-cache-bytes (twice a 16-bit cache's), the router's limits follow, and
requests are served from the float8 blocks."""

import httpx

from ..shard_harness import save_tiny_model, save_tiny_tokenizer
from .router_harness import launch

# The tiny llama's block of 16 tokens: K and V x 2 layers x 2 kv heads x 16 dims x 16 tokens,
# 4 bytes each in float32 (8 KiB), 1 in fp8. Five float32 blocks: four and the scratch block.
BUDGET = str(5 * 8192)


def _served(path, tmp_path, *flags) -> tuple[int, list[int], str]:
    """(max_total_tokens, greedy token ids of one prompt, the launcher's log)."""
    proc, url = launch(str(path), tmp_path, "--dtype", "float32", "--kv-cache-bytes", BUDGET,
                       "--max-batch-prefill-tokens", "64", *flags, default_limits=False)
    try:
        total = httpx.get(url + "/info", timeout=10).json()["max_total_tokens"]
        body = {"inputs": "the quick brown fox", "parameters": {"max_new_tokens": 24, "details": True}}
        r = httpx.post(url + "/generate", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return total, [t["id"] for t in r.json()["details"]["tokens"]], (tmp_path / "launcher.log").read_text()
    finally:
        proc.terminate()
        proc.wait(30)


def test_fp8_kv_cache_holds_four_times_the_float32_tokens_and_serves(tmp_path):
    path = save_tiny_model("llama", tmp_path / "model", vocab_size=320, bos_token_id=256, eos_token_id=None)
    save_tiny_tokenizer(path)
    float_total, float_ids, _ = _served(path, tmp_path / "float")
    fp8_total, fp8_ids, log = _served(path, tmp_path / "fp8", "--kv-cache-dtype", "fp8_e4m3fn")
    assert (float_total, fp8_total) == (4 * 16, 19 * 16)  # (budget // block bytes - the scratch block) blocks
    assert "KV cache blocks in fp8_e4m3fn: 0 of 2 layers with the checkpoint's k/v scales" in log
    assert len(fp8_ids) == len(float_ids) == 24
