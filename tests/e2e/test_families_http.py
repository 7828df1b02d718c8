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

from ..shard_harness import HF_CLASSES, TINY_EXTRA, hf_greedy, save_tiny_model, save_tiny_tokenizer, torch_threads
from .router_harness import free_port, launch, wait_launched

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


@pytest.fixture(scope="module")
def launches(request, tmp_path_factory):
    """start(model_type) -> (launcher, URL, its folder, checkpoint path):
    the family's tiny checkpoint saved and its server launched (two shards,
    a 16-token prefill budget: every prompt but the first is computed in
    chunks), not waited for; once per family. Stops what is left at the end."""
    started = {}

    def start(model_type: str):
        if model_type not in started:
            tmp = tmp_path_factory.mktemp(model_type)
            path = tmp / "model"
            save_tiny_model(model_type, path, vocab_size=320, bos_token_id=256, eos_token_id=None)
            save_tiny_tokenizer(path)
            proc, url = launch(str(path), tmp, "--dtype", "float32", "--num-shard", "2",
                               "--master-port", str(free_port()), "--max-batch-prefill-tokens", "16",
                               "--max-input-tokens", "64", "--max-total-tokens", "128", wait=False)
            started[model_type] = proc, url, tmp, path
        return started[model_type]
    yield start
    for proc, *_ in started.values():
        if proc.poll() is None:
            proc.terminate()
            proc.wait(30)


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, launches):
    """(the URL of the family's server, transformers' answer per prompt). A
    launch costs ~5 s on two cores, most of it two shard processes importing
    torch and transformers, so none waits alone: transformers' answers are
    computed while the family's shards load (on one torch thread: beside
    them, two would wait on each other in every parallel region), and once
    its server is up the next selected family's launcher starts, to load
    while this family's requests run (round trips between three processes,
    which leave the cores mostly idle)."""
    model_type = request.param
    proc, url, tmp, path = launches(model_type)
    try:
        with torch_threads(1):
            expected = _reference(model_type, path)
        wait_launched(proc, url, tmp)
        selected = _selected_families(request)
        if model_type in selected[:-1]:
            launches(selected[selected.index(model_type) + 1])
        yield url, expected
    finally:
        proc.terminate()
        proc.wait(30)


def _selected_families(request) -> list[str]:
    """The families of this module's tests in this run, in their order."""
    families = []
    for item in request.session.items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if item.module is request.module and params.get("family") not in (None, *families):
            families.append(params["family"])
    return families


def _reference(model_type: str, path) -> list:
    """transformers' answer per prompt: (prompt ids, greedy ids, logprob of
    each prompt token after the first)."""
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
    return expected


def _check(answers: list[dict], expected: list) -> None:
    for details, (ids, greedy, prompt_logprobs) in zip(answers, expected):
        assert [t["id"] for t in details["tokens"]] == greedy
        if details["prefill"]:
            assert [t["id"] for t in details["prefill"]] == ids
            ours = [t["logprob"] for t in details["prefill"][1:]]
            assert max(abs(a - b) for a, b in zip(ours, prompt_logprobs)) < 1e-4


def test_chunked_prefill_prefix_hits_and_two_shards_match_transformers(family):
    """The prompts computed over two shards in chunks, then again from the
    prefix cache (the server: `family`)."""
    url, expected = family
    _check(_serve(url), expected)  # computes the prompts, filling the cache
    assert _metric(url, "tgi_prefix_cache_hit_tokens") == 0
    _check(_serve(url, prompt_logprobs=False), expected)  # the same prompts: full blocks from the cache
    # the full 16-token blocks before each prompt's last token (21, 39 and 50 tokens: 1, 2 and 3)
    assert _metric(url, "tgi_prefix_cache_hit_tokens") == 16 * (1 + 2 + 3)
