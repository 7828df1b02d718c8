"""Grammar benchmark: what constrained decoding costs at batch 8.

SmolLM2-135M-Instruct on 2 threads, in the dtype the shard chooses on this
CPU (machine.serving_dtype), the shard in its own process
driven by the router's engine (as in production). Eight chat prompts ask
for JSON; they run unconstrained, under a JSON Schema (an array of at least
10 objects, so every sequence stays in the grammar for well over 100
tokens) as the router sends it (numbers bounded, max_new_tokens 160, so the
shard keeps each sequence able to finish: its shortest completion is ~120
tokens at the start, so budgets are checked most of the run), and under the
same schema as before budgets existed (unbounded, no max_new_tokens). Tokens/s counts only decode steps with all 8
sequences running, so both runs measure the same thing: the time of a
batch-8 step, grammar masks (computed by llguidance for the 8 rows, then
applied to the logits) included or not. Runs alternate and each side
reports its best (the machine is shared and noisy)."""

import asyncio
import json
import tempfile
import time

import torch
from llguidance import LLMatcher

from tgi_proto import pb
from tgi_router.scheduling.block_manager import BlockManager
from tgi_router.scheduling.client import ShardClient
from tgi_router.scheduling.engine import Engine
from tgi_router.scheduling.scheduler import Scheduler
from tgi_router.scheduling.sequence import Sequence, StoppingCriteria
from tgi_router.text.grammar import JSON_OPTIONS, json_grammar
from tgi_server.weights.gguf import load_gguf_tokenizer
from tgi_server.weights.resolve import default_model_path

from .engine import THREADS, start_shard
from .machine import dtype_name, serving_dtype

BATCH = 8
NEW_TOKENS = 160
REPEATS = 3
SCHEMA = {
    "type": "object",
    "properties": {"people": {"type": "array", "minItems": 10, "items": {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                       "city": {"type": "string"}},
        "required": ["name", "age", "city"]}}},
    "required": ["people"],
}
TOPICS = ("famous scientists", "football players", "painters", "writers", "musicians",
          "explorers", "inventors", "film directors")


def prompts(tokenizer) -> list[list[int]]:
    out = []
    for topic in TOPICS[:BATCH]:
        messages = [{"role": "user", "content": f"List ten {topic} as JSON with name, age and city."}]
        out.append(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                 return_dict=False))
    return out


async def batch8_tokens_per_s(client: ShardClient, warm: pb.WarmupResponse, prompts: list[list[int]],
                              grammar: str, budget: int, eos: frozenset[int]) -> tuple[float, int]:
    """(tokens/s over steps with all BATCH sequences decoding, such steps).
    budget: the max_new_tokens the shard is told (0: none, no budget kept)."""
    scheduler = Scheduler(BlockManager(warm.num_blocks, warm.block_size), max_batch_tokens=4096)
    engine = Engine(client, scheduler)
    for i, p in enumerate(prompts):
        params = pb.SamplingParameters(grammar=grammar, max_new_tokens=budget)
        scheduler.add(Sequence(id=i + 1, token_ids=list(p), params=params,
                               stopping=StoppingCriteria(NEW_TOKENS, eos, ignore_eos=True)))
    tokens, seconds, steps = 0, 0.0, 0
    while not engine.idle:
        full = (not scheduler.waiting and len(scheduler.running) == BATCH
                and all(s.num_computed >= s.prompt_length for s in scheduler.running))
        t = time.perf_counter()
        await engine.step()
        if full:
            tokens, seconds, steps = tokens + BATCH, seconds + time.perf_counter() - t, steps + 1
    await client.clear_cache()
    return tokens / max(seconds, 1e-9), steps


async def drive(socket: str, ids: list[list[int]], eos: frozenset[int]) -> dict:
    """Best (tokens/s, steps) of each run: free; constrained as the router sends
    it (bounded numbers, max_new_tokens, so the shard keeps budgets); and
    constrained as before budgets existed (the schema as given, no budget)."""
    runs = {"free": ("", 0), "constrained": (json_grammar(SCHEMA).text, NEW_TOKENS),
            "unbudgeted": (LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA), overrides=JSON_OPTIONS), 0)}
    client = ShardClient([socket], timeout=600)
    try:
        await client.wait_ready(180)
        warm = await client.warmup(4096, BATCH, kv_cache_bytes=1 << 30)
        for grammar, budget in runs.values():  # compile, first-call costs
            await batch8_tokens_per_s(client, warm, ids, grammar, budget, eos)
        results: dict[str, list] = {name: [] for name in runs}
        for _ in range(REPEATS):
            for name, (grammar, budget) in runs.items():
                results[name].append(await batch8_tokens_per_s(client, warm, ids, grammar, budget, eos))
        return {name: max(r) for name, r in results.items()}
    finally:
        await client.close()


def run() -> dict:
    torch.set_num_threads(THREADS)
    path = default_model_path()
    tokenizer = load_gguf_tokenizer(path)
    ids = prompts(tokenizer)
    eos = frozenset([tokenizer.eos_token_id])
    with tempfile.TemporaryDirectory() as tmp:
        shard = start_shard(path, tmp)
        try:
            r = asyncio.run(drive(f"{tmp}/shard-0", ids, eos))
        finally:
            shard.terminate()
            shard.wait(30)
    (free, free_steps), (constrained, constrained_steps) = r["free"], r["constrained"]
    unbudgeted, unbudgeted_steps = r["unbudgeted"]
    ratio = constrained / free
    print(f"\nGrammar benchmark: SmolLM2-135M {dtype_name(serving_dtype())}, {THREADS} threads, batch {BATCH}, "
          f"JSON Schema {json.dumps(SCHEMA)[:60]}...")
    print(f"{'':<28}{'tok/s (b8 decode)':>20}{'steps':>8}{'vs free':>10}")
    print(f"{'unconstrained':<28}{free:>20.1f}{free_steps:>8}{1.0:>10.2f}")
    print(f"{'JSON Schema grammar':<28}{constrained:>20.1f}{constrained_steps:>8}{ratio:>10.2f}")
    print(f"{'  without budgets (before)':<28}{unbudgeted:>20.1f}{unbudgeted_steps:>8}{unbudgeted / free:>10.2f}")
    return {"grammar_b8_free_tok_s": round(free, 1), "grammar_b8_constrained_tok_s": round(constrained, 1),
            "grammar_b8_tokens_per_s_ratio": round(ratio, 3),
            "grammar_b8_unbudgeted_tok_s": round(unbudgeted, 1),
            "grammar_b8_unbudgeted_ratio": round(unbudgeted / free, 3)}
