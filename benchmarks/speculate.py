"""Speculative decoding benchmark: the real launcher serving the default
model (SmolLM2-135M-Instruct, the dtype the shard chooses on this CPU, its
compiled decode steps, 2 threads) with --speculate 0 and with --speculate
SPECULATE, both running at once and taking turns at each workload, so that
the host's noise falls on both alike.

Workloads (greedy, /v1/chat/completions or /generate_stream):
- copy-heavy: rewrite a given paragraph with one small edit, or repeat a
  code block with one line changed (COPY_TASKS), at concurrency 1 and 8;
- plain: the engine benchmark's prompts (rotations of one text, no copying
  asked, though the model tends to go on with the text it was given), 128
  new tokens each, 64 requests at concurrency 32;
- chat: 64 requests for short stories (CHAT_TASKS, chat template, 128 new
  tokens) at concurrency 32: new text, where drafts are seldom right.

Keys: tokens/s of each side; speculate_c1_copy_speedup and
speculate_c8_copy_speedup (drafting over not, goal >= 2.0 at c1),
speculate_c32_plain_ratio (goal >= 0.97: never slower under load) and
speculate_c32_chat_ratio (the same where drafts seldom pay), the
n-gram proposer's acceptance rate (accepted drafts per draft, from
/metrics) and tokens per step on the copy workload at c1; and how many of
the answers are identical on both sides, beside how many answers of the
side without drafts are identical from one turn to the next (greedy
answers depend on the batch in bf16, where kernels change with the rows a
step computes: see docs/features.md, speculative decoding)."""

import asyncio
import re
import tempfile
import time

import httpx

from . import engine as engine_bench
from .http import gather_limited, launched, load
from .machine import dtype_name, serving_dtype

SPECULATE = 6
COPY_NEW_TOKENS = 200
REPEATS = 2  # the best of two turns per side and workload
PARAGRAPHS = (
    "The old lighthouse stood at the edge of the cliff for more than two hundred years. Every night its keeper "
    "climbed the narrow stairs, trimmed the wick and polished the great lens until it shone. Ships passing the "
    "rocky coast trusted its steady beam to guide them safely into the harbor.",
    "Our quarterly report shows that revenue grew by twelve percent, driven mostly by new customers in the "
    "northern region. Operating costs stayed flat, and the team expects the same trend next quarter if the "
    "supply issues in the spring are resolved on time.",
    "To reset the device, hold the power button for ten seconds until the light blinks twice. Then release it, "
    "wait for the light to turn green, and connect the cable again. If the light stays red, contact support "
    "with the serial number printed on the back.",
    "Maria planted tomatoes, beans and sunflowers along the south fence of the garden. By July the sunflowers "
    "were taller than the fence, the beans had climbed the old trellis, and the tomatoes were ripening faster "
    "than the family could eat them.",
)
CODE = (
    "def moving_average(values, window):\n"
    "    if window <= 0:\n"
    "        raise ValueError('window must be positive')\n"
    "    out = []\n"
    "    total = 0.0\n"
    "    for i, v in enumerate(values):\n"
    "        total += v\n"
    "        if i >= window:\n"
    "            total -= values[i - window]\n"
    "        out.append(total / min(i + 1, window))\n"
    "    return out\n")
CHAT_TASKS = tuple(f"Write a short story about a {who} who {what}." for who in (
    "fox", "robot", "baker", "sailor", "child", "dragon", "teacher", "cat") for what in (
    "loses a key", "finds a map", "learns to sing", "moves to the city", "builds a boat",
    "meets a stranger", "plants a tree", "misses a train"))
COPY_TASKS = tuple(
    [f"Rewrite the following paragraph exactly as it is, but replace the word '{old}' with '{new}':\n\n{text}"
     for text, (old, new) in zip(PARAGRAPHS, (("cliff", "hill"), ("twelve", "fifteen"), ("ten", "five"),
                                                ("July", "August")))]
    + [f"Repeat this Python function exactly, but rename the variable '{old}' to '{new}':\n\n{CODE}"
       for old, new in (("total", "running"), ("out", "result"), ("window", "size"), ("values", "xs"))])


async def _copy_one(client: httpx.AsyncClient, url: str, task: str) -> tuple[str, int]:
    r = await client.post(url + "/v1/chat/completions", json={
        "messages": [{"role": "user", "content": task}], "max_tokens": COPY_NEW_TOKENS, "temperature": 0})
    r.raise_for_status()
    body = r.json()
    return body["choices"][0]["message"]["content"], body["usage"]["completion_tokens"]


async def copy_load(url: str, concurrency: int) -> tuple[float, list[str]]:
    """(tokens/s, answers) of every COPY_TASKS request at `concurrency`."""
    async with httpx.AsyncClient(timeout=600) as client:
        results, elapsed = await gather_limited(lambda t: _copy_one(client, url, t), list(COPY_TASKS), concurrency)
    return sum(n for _, n in results) / elapsed, [text for text, _ in results]


def _metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    match = re.search(rf"^{name} (\S+)$", text, re.M)
    return float(match.group(1)) if match else 0.0


def _counts(url: str) -> dict[str, float]:
    return {k: _metric(url, f"tgi_{k}") for k in (
        "speculative_draft_tokens", "speculative_accepted_tokens", "request_skipped_tokens_count",
        "request_skipped_tokens_sum")}


def run() -> dict:
    model, tokenizer, _ = engine_bench.hf_model(serving_dtype())
    del model
    plain = [tokenizer.decode(p) for p in engine_bench.make_prompts(tokenizer, 64)]
    chat = [tokenizer.apply_chat_template([{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True)
            for t in CHAT_TASKS]
    results: dict[str, dict] = {"off": {}, "on": {}}
    answers: dict[tuple[str, int], list[list[str]]] = {}  # (side, concurrency) -> each turn's answers
    with tempfile.TemporaryDirectory() as off_dir, tempfile.TemporaryDirectory() as on_dir, \
            launched(off_dir) as (off_url, _), \
            launched(on_dir, ("--speculate", str(SPECULATE))) as (on_url, _):
        urls = {"off": off_url, "on": on_url}
        for url in urls.values():  # warm up: first requests pay one-time costs
            asyncio.run(copy_load(url, 8))
        for workload, c in (("copy", 1), ("copy", 8), ("plain", 32), ("chat", 32)):
            for _ in range(REPEATS):
                for side, url in urls.items():
                    before = _counts(url)
                    start = time.perf_counter()
                    if workload == "copy":
                        tok_s, texts = asyncio.run(copy_load(url, c))
                        answers.setdefault((side, c), []).append(texts)
                    else:
                        tok_s = asyncio.run(load(url, plain if workload == "plain" else chat, c))["tok_s"]
                    after = _counts(url)
                    delta = {k: after[k] - before[k] for k in after}
                    key = f"{workload}_c{c}"
                    best = results[side].get(key)
                    if best is None or tok_s > best["tok_s"]:
                        results[side][key] = {"tok_s": tok_s, "seconds": time.perf_counter() - start, **delta}
    out = {"speculate_n": SPECULATE, "speculate_dtype": dtype_name(serving_dtype())}
    print(f"\nSpeculation benchmark: SmolLM2-135M {dtype_name(serving_dtype())}, {engine_bench.THREADS} threads, "
          f"--speculate {SPECULATE} against 0, {len(COPY_TASKS)} copy tasks ({COPY_NEW_TOKENS} new tokens), "
          f"{len(plain)} plain prompts")
    print(f"{'workload':<12}{'off tok/s':>10}{'on tok/s':>10}{'ratio':>8}{'accept':>8}{'tok/step':>9}")
    for key in results["off"]:
        off, on = results["off"][key], results["on"][key]
        ratio = on["tok_s"] / off["tok_s"]
        rate = on["speculative_accepted_tokens"] / max(on["speculative_draft_tokens"], 1)
        # tokens per sequence-step: 1 + the accepted drafts it got, from tgi_request_skipped_tokens
        per_step = 1 + on["request_skipped_tokens_sum"] / max(on["request_skipped_tokens_count"], 1)
        print(f"{key:<12}{off['tok_s']:>10.1f}{on['tok_s']:>10.1f}{ratio:>8.2f}{rate:>8.2f}{per_step:>9.2f}")
        out.update({f"speculate_{key}_off_tok_s": round(off["tok_s"], 1), f"speculate_{key}_on_tok_s": round(on["tok_s"], 1),
                    f"speculate_{key}_acceptance_rate": round(rate, 3), f"speculate_{key}_tokens_per_step": round(per_step, 2),
                    f"speculate_{key}_drafted": int(on["speculative_draft_tokens"])})
    out["speculate_c1_copy_speedup"] = round(results["on"]["copy_c1"]["tok_s"] / results["off"]["copy_c1"]["tok_s"], 2)
    out["speculate_c8_copy_speedup"] = round(results["on"]["copy_c8"]["tok_s"] / results["off"]["copy_c8"]["tok_s"], 2)
    for workload in ("plain", "chat"):
        out[f"speculate_c32_{workload}_ratio"] = round(
            results["on"][f"{workload}_c32"]["tok_s"] / results["off"][f"{workload}_c32"]["tok_s"], 2)
    out["speculate_ngram_acceptance_rate"] = out["speculate_copy_c1_acceptance_rate"]
    for c in (1, 8):
        # drafting against not, turn by turn; and not drafting against itself (the batch's own variance)
        off, on = answers[("off", c)], answers[("on", c)]
        same = sum(a == b for turn_off, turn_on in zip(off, on) for a, b in zip(turn_off, turn_on))
        self_same = sum(a == b for a, b in zip(off[0], off[-1]))
        out[f"speculate_copy_c{c}_identical"] = f"{same}/{sum(map(len, off))}"
        out[f"speculate_copy_c{c}_off_self_identical"] = f"{self_same}/{len(off[0])}"
        print(f"copy answers at c{c} identical with and without drafts: {same}/{sum(map(len, off))} "
              f"(without drafts, turn against turn: {self_same}/{len(off[0])})")
    return out
