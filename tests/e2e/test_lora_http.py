"""--lora-adapters through the launcher on two shards: requests that name
each of three adapters or none, sent at once (one batch), get transformers
+ peft's greedy tokens with that adapter merged; the OpenAI routes pick an
adapter by `model` and refuse an unknown one (422, naming the loaded ones);
/v1/models lists them; each adapter's prompts have KV blocks of their own
in the prefix cache; tgi_lora_requests counts each adapter's requests."""

import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import torch
import transformers
from peft import PeftModel

from ..server.test_lora import ADAPTERS, save_adapter
from ..shard_harness import HF_CLASSES, free_port, hf_greedy, save_tiny_model, save_tiny_tokenizer
from .router_harness import launch

PROMPTS = ["Hello there", "The weather today is quite nice, said the"]
NEW_TOKENS = 16


def _metric(url: str, name: str, labels: str = "") -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(float(v) for v in re.findall(rf"^{name}{re.escape(labels)} (\S+)$", text, re.M))


def test_adapters_over_http_on_two_shards(tmp_path):
    base = save_tiny_model("llama", tmp_path / "base", vocab_size=320, bos_token_id=256, eos_token_id=None)
    save_tiny_tokenizer(base)
    tokenizer = transformers.AutoTokenizer.from_pretrained(base)
    expected = {}
    for i, (name, config) in enumerate([(None, None), *ADAPTERS.items()]):
        model = HF_CLASSES["llama"][1].from_pretrained(base, dtype=torch.float32)
        if name is not None:
            save_adapter(base, tmp_path / name, seed=i, **config)
            model = PeftModel.from_pretrained(model, tmp_path / name).merge_and_unload()
        expected[name] = [hf_greedy(model.eval(), tokenizer(p)["input_ids"], NEW_TOKENS) for p in PROMPTS]
    spec = ",".join(f"{name}={tmp_path / name}" for name in ADAPTERS)
    proc, url = launch(str(base), tmp_path, "--dtype", "float32", "--num-shard", "2", "--master-port",
                       str(free_port()), "--lora-adapters", spec)
    try:
        def generate(job):
            adapter, prompt = job
            body = {"inputs": prompt, "parameters": {"max_new_tokens": NEW_TOKENS, "details": True,
                                                     **({"adapter_id": adapter} if adapter else {})}}
            r = httpx.post(url + "/generate", json=body, timeout=120)
            assert r.status_code == 200, r.text
            return [t["id"] for t in r.json()["details"]["tokens"]]

        jobs = [(adapter, prompt) for adapter in expected for prompt in PROMPTS]
        with ThreadPoolExecutor(len(jobs)) as pool:
            got = list(pool.map(generate, jobs))
        assert got == [expected[a][PROMPTS.index(p)] for a, p in jobs]
        for adapter in ADAPTERS:
            assert _metric(url, "tgi_lora_requests", f'{{adapter="{adapter}"}}') == len(PROMPTS)

        # OpenAI: `model` names the adapter; "tgi" is the base model
        for model, adapter in (("wide", "wide"), ("tgi", None)):
            r = httpx.post(url + "/v1/completions", json={"model": model, "prompt": PROMPTS[1],
                                                          "max_tokens": NEW_TOKENS, "temperature": 0}, timeout=60)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == tokenizer.decode(expected[adapter][1])
        r = httpx.post(url + "/v1/chat/completions", json={"model": "nope", "messages": [
            {"role": "user", "content": "Hi"}]}, timeout=60)
        assert r.status_code == 422
        assert r.json()["error"].endswith("adapter 'nope' is not loaded; loaded adapters: small, wide, mlp")
        models = [m["id"] for m in httpx.get(url + "/v1/models", timeout=10).json()["data"]]
        assert models == [str(base), *ADAPTERS]

        # The prefix cache keys blocks by adapter: the same 3-block prompt under
        # another adapter computes its blocks again; under its own, it reuses them.
        long_prompt = "abcdefghijklmnopqrstuvwxyz" * 2
        hits = _metric(url, "tgi_prefix_cache_hit_tokens")
        for adapter in ("small", "mlp"):
            generate((adapter, long_prompt))
        assert _metric(url, "tgi_prefix_cache_hit_tokens") == hits
        generate(("mlp", long_prompt))
        assert _metric(url, "tgi_prefix_cache_hit_tokens") > hits
    finally:
        proc.terminate()
        proc.wait(30)
