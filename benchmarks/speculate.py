"""Speculative decoding benchmark: the real launcher serving the default
model (SmolLM2-135M-Instruct, the dtype the shard chooses on this CPU, its
compiled decode steps, 2 threads) four times at once: without drafts
("off"), with n-gram drafts (--speculate SPECULATE), with a draft model
(--speculative-model: the default model itself, no smaller model with its
tokenizer being installed; --speculate DRAFT_SPECULATE) and with Medusa
heads trained here (benchmarks/medusa_heads.py: none are published for the
default model; as many drafts as heads). The sides take turns at each
workload, so that the host's noise falls on all alike.

Workloads (greedy):
- copy (/v1/chat/completions, 200 new tokens): COPY_TASKS, a paragraph to
  copy with one word changed, at concurrency 1 (every proposer) and 8
  (n-gram);
- code (the same, c1): CODE_TASKS, a function to copy with one name
  changed; the default model copies its first lines, then writes code of
  its own, so that it is only half copy-heavy;
- plain (/generate_stream): the engine benchmark's prompts (rotations of one
  text; the model goes on with the text it was given), 128 new tokens, 64
  requests at concurrency 32;
- chat (/generate_stream, chat template): 64 requests for short stories, 128
  new tokens, concurrency 32: new text, where drafts are seldom right.

Keys: each side's tokens/s, ratio to "off", acceptance rate (accepted drafts
per draft, from /metrics) and tokens per sequence and step; the headline
speculate_c1_copy_speedup (goal >= 2.0), speculate_c32_plain_ratio (goal
>= 0.97: never slower under load), speculate_c32_chat_ratio, and each
proposer's acceptance rate on the copy workload at c1
(speculate_{ngram,draft,medusa}_acceptance_rate); the tokens a step that
n-gram drafts would keep on the copy and code answers if every draft were
checked (speculate_ngram_{copy,code}_c1_tokens_per_step_ceiling: the copy
speedup's ceiling, set by the model's answers); and
how many answers equal those without drafts, beside how many answers
without drafts equal themselves from one turn to the next (in bf16 greedy
answers depend on the batch, whose size picks the kernels: see
docs/features.md, speculative decoding)."""

import asyncio
import contextlib
import re
import tempfile

import httpx

from tgi_server.speculation.ngram import NgramIndex

from . import engine as engine_bench
from .http import gather_limited, launched, load
from .machine import dtype_name, serving_dtype
from .medusa_heads import HEADS as MEDUSA_HEADS
from .medusa_heads import medusa_dir

# 1 + 7 rows fill the compiled decode step of 8 rows.
SPECULATE = 7
DRAFT_SPECULATE = 4
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
    "The museum opens at nine in the morning and closes at six in the evening, except on Mondays. Tickets can be "
    "bought at the entrance or online, and children under twelve enter for free when they come with an adult.",
    "After the storm, the volunteers cleared the fallen branches from the park, repaired the wooden bridge over "
    "the stream and planted new flowers along the path. By the weekend the park was full of families again.",
    "Please submit your application before the end of March. Include a short letter explaining why you want to "
    "join the program, a copy of your diploma and the names of two people who can recommend you.",
    "The train to the coast leaves every hour from platform four. The journey takes about ninety minutes, and "
    "the last train back to the city departs at eleven at night, so plan your evening with care.",
)
EDITS = (("cliff", "hill"), ("twelve", "fifteen"), ("ten", "five"), ("July", "August"), ("nine", "ten"),
         ("bridge", "fence"), ("March", "April"), ("four", "two"))
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
# Copy-heavy: rewrite a paragraph with one word changed (the default model copies these), and
# repeat a code block with one name changed (it copies the first lines, then writes code of its own).
COPY_TASKS = tuple(f"Copy the text below word for word, changing only '{old}' to '{new}'.\n\n{text}"
                   for text, (old, new) in zip(PARAGRAPHS, EDITS))
CODE_TASKS = tuple(f"Copy this Python code exactly, changing only the name `{old}` to `{new}`. Output only the "
                   f"code.\n\n```python\n{CODE}```" for old, new in (("total", "running"), ("out", "result"),
                                                                    ("window", "size"), ("values", "xs")))
CHAT_TASKS = tuple(f"Write a short story about a {who} who {what}." for who in (
    "fox", "robot", "baker", "sailor", "child", "dragon", "teacher", "cat") for what in (
    "loses a key", "finds a map", "learns to sing", "moves to the city", "builds a boat",
    "meets a stranger", "plants a tree", "misses a train"))


async def _copy_one(client: httpx.AsyncClient, url: str, task: str) -> tuple[str, int]:
    r = await client.post(url + "/v1/chat/completions", json={
        "messages": [{"role": "user", "content": task}], "max_tokens": COPY_NEW_TOKENS, "temperature": 0})
    r.raise_for_status()
    body = r.json()
    return body["choices"][0]["message"]["content"], body["usage"]["completion_tokens"]


async def copy_load(url: str, tasks: tuple[str, ...], concurrency: int) -> tuple[float, list[str]]:
    """(tokens/s, answers) of every task's request at `concurrency`."""
    async with httpx.AsyncClient(timeout=600) as client:
        results, elapsed = await gather_limited(lambda t: _copy_one(client, url, t), list(tasks), concurrency)
    return sum(n for _, n in results) / elapsed, [text for text, _ in results]


def _metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    match = re.search(rf"^{name} (\S+)$", text, re.M)
    return float(match.group(1)) if match else 0.0


def _counts(url: str) -> dict[str, float]:
    return {k: _metric(url, f"tgi_{k}") for k in (
        "speculative_draft_tokens", "speculative_accepted_tokens", "request_skipped_tokens_count",
        "request_skipped_tokens_sum")}


# (workload, concurrency) -> the sides that run it
WORKLOADS = {("copy", 1): ("off", "ngram", "draft", "medusa"), ("copy", 8): ("off", "ngram"),
             ("code", 1): ("off", "ngram"),
             ("plain", 32): ("off", "ngram"), ("chat", 32): ("off", "ngram")}


def _turn(url: str, workload: str, c: int, prompts: dict[str, list[str]]) -> tuple[float, list[str]]:
    if workload in ("copy", "code"):
        return asyncio.run(copy_load(url, COPY_TASKS if workload == "copy" else CODE_TASKS, c))
    return asyncio.run(load(url, prompts[workload], c))["tok_s"], []


def run() -> dict:
    model, tokenizer, path = engine_bench.hf_model(serving_dtype())
    del model
    prompts = {"plain": [tokenizer.decode(p) for p in engine_bench.make_prompts(tokenizer, 64)],
               "chat": [tokenizer.apply_chat_template([{"role": "user", "content": t}], tokenize=False,
                                                      add_generation_prompt=True) for t in CHAT_TASKS]}
    flags = {"off": (), "ngram": ("--speculate", str(SPECULATE)),
             # No smaller model with its tokenizer is installed: the default model drafts for itself.
             "draft": ("--speculate", str(DRAFT_SPECULATE), "--speculative-model", str(path)),
             "medusa": ("--model-id", str(medusa_dir()))}
    results: dict[str, dict] = {side: {} for side in flags}
    answers: dict[tuple[str, str, int], list[list[str]]] = {}  # (side, workload, c) -> each turn's answers
    with contextlib.ExitStack() as stack:
        urls = {side: stack.enter_context(launched(stack.enter_context(tempfile.TemporaryDirectory()), f))[0]
                for side, f in flags.items()}
        for url in urls.values():  # warm up: first requests pay one-time costs
            asyncio.run(copy_load(url, COPY_TASKS[:2], 2))
        for (workload, c), sides in WORKLOADS.items():
            for _ in range(REPEATS):
                for side in sides:  # taking turns: the host's drift reaches every side alike
                    url = urls[side]
                    before = _counts(url)
                    tok_s, texts = _turn(url, workload, c, prompts)
                    answers.setdefault((side, workload, c), []).append(texts)
                    delta = {k: v - before[k] for k, v in _counts(url).items()}
                    best = results[side].get(f"{workload}_c{c}")
                    if best is None or tok_s > best["tok_s"]:
                        results[side][f"{workload}_c{c}"] = {"tok_s": tok_s, **delta}
    ceilings = {workload: ngram_ceiling(tokenizer, tasks, answers[("off", workload, 1)][0])
                for workload, tasks in (("copy", COPY_TASKS), ("code", CODE_TASKS))}
    return _report(results, answers, ceilings)


def ngram_ceiling(tokenizer, tasks: tuple[str, ...], answers: list[str]) -> float:
    """Tokens a sequence-step that n-gram drafts of up to SPECULATE tokens
    keep on these greedy answers (their text tokenized again) when every
    draft is checked: what `--speculate SPECULATE` keeps at c=1 before the
    policy trims drafts. The copy speedup cannot pass it, even with checking
    steps as cheap as one-token steps: the model's answers bound it, not the
    server. The first token of each answer comes from the prefill."""
    kept = steps = 0
    for task, answer in zip(tasks, answers):
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": task}], tokenize=False,
                                               add_generation_prompt=True)
        out = tokenizer(answer, add_special_tokens=False).input_ids
        seq, index, i = tokenizer(prompt, add_special_tokens=False).input_ids + out[:1], NgramIndex(), 1
        while i < len(out):
            drafts = index.propose(seq, SPECULATE)
            accepted = next((j for j, (d, t) in enumerate(zip(drafts, out[i:])) if d != t),
                            min(len(drafts), len(out) - i))
            n = min(accepted + 1, len(out) - i)
            seq.extend(out[i:i + n])
            i, kept, steps = i + n, kept + n, steps + 1
    return kept / max(steps, 1)


def _report(results: dict[str, dict], answers: dict, ceilings: dict[str, float]) -> dict:
    out = {"speculate_n": SPECULATE, "speculate_dtype": dtype_name(serving_dtype())}
    print(f"\nSpeculation benchmark: SmolLM2-135M {dtype_name(serving_dtype())}, {engine_bench.THREADS} threads; "
          f"n-gram --speculate {SPECULATE}, draft model (itself) --speculate {DRAFT_SPECULATE}, "
          f"{MEDUSA_HEADS} Medusa heads, against 0")
    print(f"{'workload':<12}{'side':<7}{'off tok/s':>10}{'on tok/s':>10}{'ratio':>8}{'accept':>8}{'tok/step':>9}")
    for (workload, c), sides in WORKLOADS.items():
        key = f"{workload}_c{c}"
        off = results["off"][key]
        for side in sides[1:]:
            on = results[side][key]
            ratio = on["tok_s"] / off["tok_s"]
            rate = on["speculative_accepted_tokens"] / max(on["speculative_draft_tokens"], 1)
            # tokens per sequence-step: 1 + the accepted drafts, from tgi_request_skipped_tokens
            per_step = 1 + on["request_skipped_tokens_sum"] / max(on["request_skipped_tokens_count"], 1)
            print(f"{key:<12}{side:<7}{off['tok_s']:>10.1f}{on['tok_s']:>10.1f}{ratio:>8.2f}{rate:>8.2f}"
                  f"{per_step:>9.2f}")
            name = f"speculate_{side}_{key}"
            out.update({f"{name}_off_tok_s": round(off["tok_s"], 1), f"{name}_on_tok_s": round(on["tok_s"], 1),
                        f"{name}_ratio": round(ratio, 2), f"{name}_acceptance_rate": round(rate, 3),
                        f"{name}_tokens_per_step": round(per_step, 2)})
    out["speculate_c1_copy_speedup"] = out["speculate_ngram_copy_c1_ratio"]
    out["speculate_c8_copy_speedup"] = out["speculate_ngram_copy_c8_ratio"]
    out["speculate_c1_code_speedup"] = out["speculate_ngram_code_c1_ratio"]
    out["speculate_c32_plain_ratio"] = out["speculate_ngram_plain_c32_ratio"]
    out["speculate_c32_chat_ratio"] = out["speculate_ngram_chat_c32_ratio"]
    out["speculate_ngram_acceptance_rate"] = out["speculate_ngram_copy_c1_acceptance_rate"]
    out["speculate_draft_acceptance_rate"] = out["speculate_draft_copy_c1_acceptance_rate"]
    out["speculate_medusa_acceptance_rate"] = out["speculate_medusa_copy_c1_acceptance_rate"]
    for workload, ceiling in ceilings.items():
        out[f"speculate_ngram_{workload}_c1_tokens_per_step_ceiling"] = round(ceiling, 2)
        print(f"{workload} at c1: n-gram drafts checked in full would keep {ceiling:.2f} tokens a step "
              f"on the answers without drafts (the ceiling of its speedup)")
    for side, workload, c in (("ngram", "copy", 1), ("draft", "copy", 1), ("medusa", "copy", 1), ("ngram", "copy", 8),
                              ("ngram", "code", 1)):
        # drafting against not, turn by turn; and not drafting against itself (the batch's own variance)
        off, on = answers[("off", workload, c)], answers[(side, workload, c)]
        same = sum(a == b for turn_off, turn_on in zip(off, on) for a, b in zip(turn_off, turn_on))
        self_same = sum(a == b for a, b in zip(off[0], off[-1]))
        out[f"speculate_{side}_{workload}_c{c}_identical"] = f"{same}/{sum(map(len, off))}"
        out[f"speculate_off_{workload}_c{c}_self_identical"] = f"{self_same}/{len(off[0])}"
        print(f"{workload} answers at c{c}, {side}: identical to those without drafts {same}/{sum(map(len, off))} "
              f"(without drafts, turn against turn: {self_same}/{len(off[0])})")
    return out
