"""Every dense family over HTTP through the real launcher: a tiny random
checkpoint of each (built with transformers' own config class: GQA, windows
shorter than the prompts, the family's mechanisms switched on; see
shard_harness.TINY_EXTRA) gives transformers' greedy tokens and its prompt
logprobs over two shards with chunked prefill at a 16-token budget, and
again with the prompts served from the prefix cache. (One shard without
chunking: tests/server/test_engine_matches_hf.py.)"""

import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from ..shard_harness import HF_CLASSES, TINY_EXTRA, hf_greedy, save_tiny_model, save_tiny_tokenizer
from .router_harness import free_port, launch

# Mixed lengths (the tokenizer is byte-level: one token a byte, after <s>);
# the two longer ones outrun the 24-token windows and the 16-token budget.
PROMPTS = ["Hi", "The weather today is", "Once upon a time, in a land far away,",
           "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15"]
NEW_TOKENS = 32
FAMILIES = sorted(TINY_EXTRA)


def _generate(url: str, prompt: str, prompt_logprobs: bool) -> dict:
    body = {"inputs": prompt, "parameters": {"max_new_tokens": NEW_TOKENS, "details": True,
                                             "decoder_input_details": prompt_logprobs}}
    r = httpx.post(url + "/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["details"]


def _serve(url: str, prompt_logprobs: bool = True) -> list[dict]:
    """PROMPTS sent at once (they share steps), each request's details;
    prompt_logprobs: ask for them (such a prompt is computed, never taken
    from the prefix cache)."""
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(lambda p: _generate(url, p, prompt_logprobs), PROMPTS))


def _metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    """(model_type, checkpoint path, transformers' answer per prompt:
    (prompt ids, greedy ids, logprob of each prompt token after the first))."""
    model_type = request.param
    path = tmp_path_factory.mktemp(model_type) / "model"
    save_tiny_model(model_type, path, vocab_size=320, bos_token_id=256, eos_token_id=None)
    save_tiny_tokenizer(path)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    hf = HF_CLASSES[model_type][1].from_pretrained(path, dtype=torch.float32).eval()
    expected = []
    for prompt in PROMPTS:
        ids = tokenizer(prompt)["input_ids"]
        with torch.no_grad():
            logprobs = torch.log_softmax(hf(torch.tensor([ids])).logits[0].double(), -1)
        prompt_logprobs = [logprobs[i, ids[i + 1]].item() for i in range(len(ids) - 1)]
        expected.append((ids, hf_greedy(hf, ids, NEW_TOKENS), prompt_logprobs))
    return model_type, path, expected


def _check(answers: list[dict], expected: list) -> None:
    for details, (ids, greedy, prompt_logprobs) in zip(answers, expected):
        assert [t["id"] for t in details["tokens"]] == greedy
        if details["prefill"]:
            assert [t["id"] for t in details["prefill"]] == ids
            ours = [t["logprob"] for t in details["prefill"][1:]]
            assert max(abs(a - b) for a, b in zip(ours, prompt_logprobs)) < 1e-4


def test_chunked_prefill_prefix_hits_and_two_shards_match_transformers(family, tmp_path):
    """One launch for all three (a launch costs ~7 s on two cores): two
    shards, a 16-token prefill budget (every prompt but the first is
    computed in chunks), then the same prompts again from the prefix cache."""
    model_type, path, expected = family
    proc, url = launch(str(path), tmp_path, "--dtype", "float32", "--num-shard", "2",
                       "--master-port", str(free_port()), "--max-batch-prefill-tokens", "16",
                       "--max-input-tokens", "64", "--max-total-tokens", "128")
    try:
        _check(_serve(url), expected)  # computes the prompts, filling the cache
        assert _metric(url, "tgi_prefix_cache_hit_tokens") == 0
        _check(_serve(url, prompt_logprobs=False), expected)  # the same prompts: full blocks from the cache
        # the full 16-token blocks before each prompt's last token (21, 39 and 50 tokens: 1, 2 and 3)
        assert _metric(url, "tgi_prefix_cache_hit_tokens") == 16 * (1 + 2 + 3)
    finally:
        proc.terminate()
        proc.wait(30)
