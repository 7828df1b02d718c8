"""Per-request sampling parameters, as the shard receives them.

Validated once at the edge (the router); the sampler trusts every field."""

from dataclasses import dataclass


@dataclass(frozen=True)
class SamplingParams:
    """How one request chooses its next token (TGI's NextTokenChooser parameters).

    The watermark's bias applies first, then penalties, then logits
    processors (grammar), then, for sampling requests only, the warpers in
    the order temperature, top_k, top_p, typical_p, min_p, each with Hugging
    Face semantics."""

    do_sample: bool = False  # False: argmax of the penalized, processed logits
    temperature: float = 1.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1.0: off
    typical_p: float = 1.0  # 1.0: off
    min_p: float = 0.0  # 0.0: off; drop tokens with prob < min_p * max prob
    # HF semantics (logit > 0 -> logit / p, else logit * p) over every token so
    # far, prompt and generated.
    repetition_penalty: float = 1.0
    # OpenAI semantics over generated tokens only: logit -= freq * count ...
    frequency_penalty: float = 0.0
    # ... and logit -= pres * (count > 0).
    presence_penalty: float = 0.0
    seed: int = 0  # with the token's position, fixes a sampling draw
    top_n_tokens: int = 0  # how many most likely alternatives to report
    watermark: bool = False  # bias the green list of the previous token (watermark.py), before the penalties

    @property
    def needs_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0
                or self.presence_penalty != 0.0)
