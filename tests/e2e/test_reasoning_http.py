"""--reasoning-parser over HTTP: a tiny qwen3 whose weights are set to
write a fixed answer with thoughts, `<think>Let me count.</think>` then
`\\n\\nThe answer is four.`, comes back through the `openai` SDK with
`reasoning_content` and `content` split exactly at the markers, streamed
and not."""

import openai
import pytest
import torch
import transformers
from tokenizers import AddedToken

from ..shard_harness import save_tiny_model, save_tiny_tokenizer
from .router_harness import launch

THOUGHT, ANSWER = "Let me count.", "The answer is four."
WORDS = ["<think>", THOUGHT, "</think>", "\n\n", ANSWER]  # added tokens, each one token


@pytest.fixture(scope="module")
def thinker(tmp_path_factory) -> str:
    """The tiny qwen3 of shard_harness with added tokens for WORDS, its
    weights set so that greedy decoding after the chat prompt's last token
    ("\\n") writes WORDS then EOS: attention and MLP outputs zero (the
    residual stream stays the token's embedding), the chain's tokens embedded
    as distinct unit vectors, and the LM head row of each token's successor
    equal to the token's vector."""
    path = tmp_path_factory.mktemp("thinker") / "model"
    save_tiny_tokenizer(path)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    tokenizer.add_tokens([AddedToken(w, special=False, normalized=False) for w in WORDS])
    tokenizer.save_pretrained(path)
    save_tiny_model("qwen3", path, vocab_size=320, bos_token_id=256, eos_token_id=257)
    model = transformers.Qwen3ForCausalLM.from_pretrained(path, dtype=torch.float32)
    (newline,) = tokenizer.encode("\n", add_special_tokens=False)
    chain = [newline] + tokenizer.convert_tokens_to_ids(WORDS) + [tokenizer.eos_token_id]
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.lm_head.weight.zero_()
        for k, (token, successor) in enumerate(zip(chain, chain[1:])):
            model.model.embed_tokens.weight[token] = torch.nn.functional.one_hot(torch.tensor(k), 64).float()
            model.lm_head.weight[successor] = model.model.embed_tokens.weight[token]
    model.save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("style", ["qwen3", "deepseek_r1"])
def test_thoughts_come_back_as_reasoning_content(thinker, tmp_path, style):
    proc, url = launch(thinker, tmp_path, "--dtype", "float32", "--reasoning-parser", style)
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="-")
        messages = [{"role": "user", "content": "How many legs has a cat?"}]
        answer = client.chat.completions.create(model="tgi", messages=messages, max_tokens=16, temperature=0)
        message = answer.choices[0].message
        assert (message.reasoning_content, message.content) == (THOUGHT, "\n\n" + ANSWER)
        assert answer.choices[0].finish_reason == "stop"

        reasoning, content = [], []
        for chunk in client.chat.completions.create(model="tgi", messages=messages, max_tokens=16,
                                                    temperature=0, stream=True):
            for choice in chunk.choices:
                reasoning.append(getattr(choice.delta, "reasoning_content", None) or "")
                content.append(choice.delta.content or "")
        assert ("".join(reasoning), "".join(content)) == (THOUGHT, "\n\n" + ANSWER)
        assert "<think>" not in "".join(content + reasoning)
    finally:
        proc.terminate()
        proc.wait(30)


def test_without_a_parser_the_markers_stay_in_content(thinker, tmp_path):
    proc, url = launch(thinker, tmp_path, "--dtype", "float32")
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="-")
        message = client.chat.completions.create(model="tgi", messages=[{"role": "user", "content": "Hi"}],
                                                 max_tokens=16, temperature=0).choices[0].message
        assert message.content == f"<think>{THOUGHT}</think>\n\n{ANSWER}"
        assert getattr(message, "reasoning_content", None) is None
    finally:
        proc.terminate()
        proc.wait(30)
