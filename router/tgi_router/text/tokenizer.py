"""The router's tokenizer: the `tokenizers` library alone (transformers
imports torch, which the router never does), built from what shard 0's Info
sends: the tokenizer JSON and a small config with the chat template and
special tokens."""

import json
from dataclasses import dataclass

from tokenizers import Tokenizer


@dataclass(frozen=True)
class TokenizerConfig:
    chat_template: str | None
    bos_token: str | None
    eos_token: str | None
    all_special_ids: frozenset[int]


class RouterTokenizer:
    """encode / decode / offsets, and the facts TGI's routes need."""

    def __init__(self, tokenizer_json: str, config_json: str):
        if not tokenizer_json:
            raise ValueError("the model has no tokenizer (tokenizer.json or equivalent); "
                             "the router needs one to serve text")
        self._tok = Tokenizer.from_str(tokenizer_json)
        raw = json.loads(config_json or "{}")
        self.config = TokenizerConfig(
            chat_template=raw.get("chat_template"), bos_token=raw.get("bos_token"),
            eos_token=raw.get("eos_token"), all_special_ids=frozenset(raw.get("all_special_ids", ())))

    @property
    def all_special_ids(self) -> frozenset[int]:
        return self.config.all_special_ids

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_with_offsets(self, text: str, add_special_tokens: bool = True) -> list[tuple[int, str, int, int]]:
        """[(id, token text, start, stop)] with character offsets into text."""
        enc = self._tok.encode(text, add_special_tokens=add_special_tokens)
        return [(i, text[a:b], a, b) for i, (a, b) in zip(enc.ids, enc.offsets)]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)
