"""Streaming detokenizer benchmark: the router's tokenizer for the default
model (SmolLM2-135M-Instruct, as its shard exports it) turns 2,000 tokens of
mixed text (prose, code, emoji, CJK, accents) into text one token at a time,
as a stream does (`IncrementalDetokenizer.add`, then `flush`). Reported: the
best of REPEATS runs (the machines are shared and noisy), in ms for all
2,000 tokens and in µs a token. The target: well under 100 ms for the 2,000
(a token's text is then a negligible share of a decode step's time)."""

import time

from tgi_router.text.detokenizer import IncrementalDetokenizer
from tgi_router.text.tokenizer import RouterTokenizer

TOKENS = 2000
REPEATS = 3
TEXT = " ".join([
    "Hello, world! How are you today? I'm fine -- thanks.",
    "def f(x):\n    if x > 0:\n        return x * 2\n\treturn -x  # done\n\n",
    "Llamas 🦙 and rockets 🚀; family 👨‍👩‍👧 and flags 🇫🇷!",
    "中文文本测试，日本語のテキスト、한국어 텍스트。",
    "Ça va? Crème brûlée, naïve café, e\u0301 (combining), Ωμέγα, مرحبا.",
    "mixed: x=42 → y≈3.14 ✓ «quoted» 🦙中 é\n  - item\n",
])


def router_tokenizer() -> RouterTokenizer:
    """The default model's tokenizer as the router builds it from shard 0's Info."""
    from tgi_server.weights.resolve import resolve_model
    from tgi_server.weights.tokenizer_export import export_tokenizer

    return RouterTokenizer(*export_tokenizer(resolve_model(None)))


def stream_seconds(tokenizer: RouterTokenizer, prompt: list[int], ids: list[int]) -> float:
    """Seconds to stream `ids` through a fresh detokenizer, flush included."""
    detok = IncrementalDetokenizer(tokenizer, prompt)
    start = time.perf_counter()
    for i in ids:
        detok.add(i)
    detok.flush()
    return time.perf_counter() - start


def run() -> dict:
    tokenizer = router_tokenizer()
    ids = tokenizer.encode(TEXT * 20, add_special_tokens=False)[:TOKENS]  # TEXT: 188 tokens
    assert len(ids) == TOKENS, f"the text gave {len(ids)} tokens"
    prompt = tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False)
    best = min(stream_seconds(tokenizer, prompt, ids) for _ in range(REPEATS))
    print(f"\nDetokenizer: {TOKENS} tokens streamed in {best * 1e3:.1f} ms "
          f"({best / TOKENS * 1e6:.1f} µs a token), best of {REPEATS}", flush=True)
    return {"detokenize_2000_tokens_ms": round(best * 1e3, 2),
            "detokenize_us_per_token": round(best / TOKENS * 1e6, 2)}


if __name__ == "__main__":
    print(run())
