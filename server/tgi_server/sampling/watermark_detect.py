"""`text-generation-server watermark-detect`: the z-score of a text's green
tokens under a model's tokenizer and vocabulary (watermark.py)."""

from __future__ import annotations

import functools

import torch

from ..model_loader import open_checkpoint
from ..weights.resolve import resolve_model
from ..weights.tokenizer_export import load_tokenizer
from .watermark import Watermark

THRESHOLD = 4.0  # the paper's: z > 4 marks a text as watermarked (a false positive ~3e-5 of the time)


@functools.lru_cache(maxsize=2)
def _model(model_id: str | None):
    """(the model's tokenizer, its vocabulary size: the logits' width)."""
    source = resolve_model(model_id)
    config, _ = open_checkpoint(source, torch.float32, torch.device("cpu"))
    return load_tokenizer(source), config.vocab_size


def detect(model_id: str | None, text: str, gamma: float = 0.5) -> dict:
    """{"z", "green", "scored", "gamma", "watermarked"} for `text` written by
    `model_id` (None: the default model) with --watermark-gamma `gamma`;
    CheckpointError when the model cannot be read."""
    tokenizer, vocab = _model(model_id)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    z, green, scored = Watermark(gamma).z_score(ids, vocab)
    return {"z": round(z, 4), "green": green, "scored": scored, "gamma": gamma, "watermarked": z > THRESHOLD}
