"""The model's tokenizer in a form the router loads without transformers:
the `tokenizers` JSON and a small config (chat template, special tokens)."""

import json

from .errors import CheckpointError
from .resolve import ModelSource


def export_tokenizer(source: ModelSource) -> tuple[str, str]:
    """(tokenizer.json text, tokenizer config JSON text) for the checkpoint;
    ("", "") when a directory or GGUF file holds no tokenizer (a shard serves
    token ids only; the router refuses to start without a tokenizer)."""
    if not has_tokenizer_files(source):
        return "", ""
    tokenizer = load_tokenizer(source)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise CheckpointError(f"{source.path}: the tokenizer has no fast (tokenizers) implementation")
    config = {
        "chat_template": tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else None,
        "bos_token": tokenizer.bos_token,
        "eos_token": tokenizer.eos_token,
        "pad_token": tokenizer.pad_token,
        "all_special_ids": list(tokenizer.all_special_ids),
    }
    return backend.to_str(), json.dumps(config)


def load_tokenizer(source: ModelSource):
    """The checkpoint's transformers tokenizer; CheckpointError if it cannot be loaded."""
    if source.format == "gguf":
        from .gguf import load_gguf_tokenizer

        return load_gguf_tokenizer(source.path)
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(source.path)
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{source.path}: cannot load the tokenizer ({str(err).splitlines()[0]})") from None


def has_tokenizer_files(source: ModelSource) -> bool:
    """Whether a checkpoint directory holds a tokenizer (transformers 5
    builds an empty one for some model types rather than fail without), or
    a GGUF file a vocabulary."""
    if source.format == "gguf":
        from .gguf import has_vocabulary

        return has_vocabulary(source.path)
    names = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")
    return any((source.path / n).exists() for n in names)
