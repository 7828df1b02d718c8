"""Watermark benchmark: the default model (SmolLM2-135M-Instruct) behind the
real launcher writes 20 answers of 200 tokens with `"watermark": true` and
20 without (sampled at temperature 1, one seed per prompt, all 40 at
once), and `text-generation-server watermark-detect`'s scoring (distinct
(previous, token) pairs, gamma 0.5) gives each its z-score. The prompts
open encyclopedia articles, which the model continues past 200 tokens (a
chat question is often answered, and ended, sooner)."""

import tempfile
from concurrent.futures import ThreadPoolExecutor

import httpx

from tgi_server.sampling.watermark_detect import detect

from .http import launched

TOPICS = ("the history of the bicycle", "how volcanoes form", "why the sky is blue", "the life of honeybees",
          "how to bake bread", "the rules of chess", "the water cycle", "how airplanes fly", "the moon landing",
          "learning a new language", "the invention of the printing press", "how batteries work",
          "the Roman Empire", "caring for a houseplant", "how the internet works", "the migration of birds",
          "the first computers", "how rainbows appear", "training for a marathon", "the deep ocean")
NEW_TOKENS = 200


def answers(url: str, topics: tuple[str, ...], watermark: bool) -> list[tuple[str, int]]:
    """(text, tokens generated) of one answer per topic."""
    def one(topic: str) -> tuple[str, int]:
        body = {"inputs": f"An encyclopedia article about {topic}.\n\nChapter 1\n\n",
                "parameters": {"max_new_tokens": NEW_TOKENS, "watermark": watermark, "do_sample": True,
                               "temperature": 1.0, "seed": sum(map(ord, topic)), "details": True}}
        r = httpx.post(url + "/generate", json=body, timeout=600)
        r.raise_for_status()
        return r.json()["generated_text"], r.json()["details"]["generated_tokens"]

    with ThreadPoolExecutor(len(topics)) as pool:
        return list(pool.map(one, topics))


def run() -> dict:
    with tempfile.TemporaryDirectory() as tmp, launched(tmp, ("--max-total-tokens", "1024")) as (url, _):
        with ThreadPoolExecutor(2) as pool:
            marked, plain = pool.map(lambda w: answers(url, TOPICS, w), (True, False))
    marked_z = [detect(None, text)["z"] for text, _ in marked]
    plain_z = [detect(None, text)["z"] for text, _ in plain]
    print(f"watermark: z of 20 watermarked answers {sorted(marked_z)}; of 20 others {sorted(plain_z)}", flush=True)
    return {"watermark_min_z": min(marked_z), "watermark_unmarked_max_abs_z": max(map(abs, plain_z)),
            "watermark_answers_tokens": min(n for _, n in marked + plain)}
