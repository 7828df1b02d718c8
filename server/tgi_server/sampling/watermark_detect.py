"""`text-generation-server watermark-detect`: the z-score of a text's green
tokens under a model's tokenizer and vocabulary (watermark.py)."""

from __future__ import annotations

import functools

import torch

from ..weights.resolve import resolve_model
from ..weights.tokenizer_export import load_tokenizer
from .watermark import Watermark

THRESHOLD = 4.0  # the paper's: z > 4 marks a text as watermarked (a false positive ~3e-5 of the time)


@functools.lru_cache(maxsize=2)
def _model(model_id: str | None):
    """(the model's tokenizer, its vocabulary size: the logits' width)."""
    source = resolve_model(model_id)
    if source.format == "gguf":
        # The file's own config (what the shard's is built from, checked as it is), without
        # importing transformers' model configs: most of the command line's start otherwise.
        from ..weights.gguf import GGUFFile

        return load_tokenizer(source), GGUFFile(source.path).config["vocab_size"]
    from ..model_loader import open_checkpoint

    config, _ = open_checkpoint(source, torch.float32, torch.device("cpu"))
    return load_tokenizer(source), config.vocab_size


def load_scorer(model_id: str | None) -> None:
    """Loads what detect(model_id, ...) needs (the model's tokenizer and
    vocabulary size), kept for the process; CheckpointError as detect."""
    _model(model_id)


@functools.lru_cache(maxsize=4)
def _watermark(gamma: float) -> Watermark:
    """One Watermark a gamma, so that its green lists (a permutation of the
    vocabulary drawn per previous token: most of a score's time) serve every
    text scored in this process."""
    return Watermark(gamma)


def detect(model_id: str | None, text: str, gamma: float = 0.5) -> dict:
    """{"z", "green", "scored", "gamma", "watermarked"} for `text` written by
    `model_id` (None: the default model) with --watermark-gamma `gamma`;
    CheckpointError when the model cannot be read."""
    tokenizer, vocab = _model(model_id)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    # One thread: a green list is a randperm, whose fill of the vocabulary torch splits over its
    # threads, and on two busy cores that split cost 10x the draw (the same values on any count).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        z, green, scored = _watermark(gamma).z_score(ids, vocab)
    finally:
        torch.set_num_threads(threads)
    return {"z": round(z, 4), "green": green, "scored": scored, "gamma": gamma, "watermarked": z > THRESHOLD}
