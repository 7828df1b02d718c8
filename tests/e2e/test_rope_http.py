"""`--rope-scaling linear --rope-factor 2` through the launcher: the router's
limits follow the doubled length and a prompt past the checkpoint's own
length gets transformers' greedy tokens with the same override."""

import httpx
import torch
import transformers

from ..shard_harness import HF_CLASSES, hf_greedy, save_tiny_model, save_tiny_tokenizer
from .router_harness import launch


def test_a_linear_rope_override_doubles_the_context_and_matches_transformers(tmp_path):
    path = save_tiny_model("llama", tmp_path / "model", vocab_size=320, bos_token_id=256, eos_token_id=None)
    save_tiny_tokenizer(path)  # byte-level: one token a byte, after <s>
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    prompt = "".join(chr(97 + (i * 7) % 26) for i in range(600))  # 601 tokens: past the checkpoint's 512
    ids = tokenizer(prompt)["input_ids"]
    config = transformers.AutoConfig.from_pretrained(path)
    config.rope_parameters = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
    hf = HF_CLASSES["llama"][1].from_pretrained(path, config=config, dtype=torch.float32).eval()
    expected = hf_greedy(hf, ids, 16)
    proc, url = launch(str(path), tmp_path, "--dtype", "float32", "--rope-scaling", "linear", "--rope-factor", "2",
                       default_limits=False)
    try:
        info = httpx.get(url + "/info", timeout=10).json()
        assert (info["max_total_tokens"], info["max_input_tokens"]) == (1024, 1023)
        body = {"inputs": prompt, "parameters": {"max_new_tokens": 16, "details": True}}
        r = httpx.post(url + "/generate", json=body, timeout=120)
        assert r.status_code == 200, r.text
        assert [t["id"] for t in r.json()["details"]["tokens"]] == expected
    finally:
        proc.terminate()
        proc.wait(30)
