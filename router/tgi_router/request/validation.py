"""TGI's request validation: the rules, their order and their exact messages
(TGI router/src/validation.rs `Validation::validate`, `validate_input`,
`validate_best_of`, and the two stream-only rules of server.rs
`generate_stream_internal`), freezing a request into `ValidGenerateRequest`.

Tokenization goes through a callable (`str -> list[int]`, special tokens
included as the model wants them), so this module needs no tokenizer library.

One length guard runs before tokenizing: with `limits.max_input_chars` set
(max_input_tokens times the tokenizer's characters-per-token bound, see
input_bound), an input longer than that cannot fit and is refused without
tokenizing it, reporting a lower bound of its tokens ("Given: at least Y").
Without truncate only: with `truncate` a long input is legal, as in TGI. The
request body limit (413, --payload-limit) bounds the tokenizer's work in the
other cases.
"""

import json
import random
from dataclasses import dataclass
from typing import Callable

from tgi_router.errors import ValidationError
from tgi_router.request.protocol import GenerateParameters, GenerateRequest, JsonSchemaGrammar, RegexGrammar
from tgi_router.text.grammar import ValidGrammar, json_grammar, regex_grammar

__all__ = ["DEFAULT_GENERATION_LENGTH", "ValidationError", "ValidationLimits",
           "ValidGrammar", "ValidParameters", "ValidStoppingParameters",
           "ValidGenerateRequest", "check_grammar_budget", "check_input_chars", "tokenize_text", "validate"]

# TGI: a request without max_new_tokens is scheduled this many tokens at a
# time, up to max_total_new_tokens.
DEFAULT_GENERATION_LENGTH = 1024

_SYSTEM_RNG = random.SystemRandom()


@dataclass(frozen=True, kw_only=True)
class ValidationLimits:
    """The launcher's limits (--max-input-tokens, --max-total-tokens, ...)."""
    max_input_tokens: int
    max_total_tokens: int
    max_best_of: int = 2
    max_stop_sequences: int = 4
    max_top_n_tokens: int = 5
    disable_grammar_support: bool = False
    max_input_chars: int | None = None  # longer inputs cannot fit max_input_tokens; None: no guard
    adapters: tuple[str, ...] = ()  # LoRA adapters the shards loaded (--lora-adapters), in their order
    model_id: str = ""              # the base model's id: as an adapter id, it names no adapter


@dataclass(frozen=True)
class ValidParameters:
    """Sampling parameters with TGI's neutral values filled in."""
    temperature: float           # 1.0 = off
    top_k: int                   # 0 = off
    top_p: float                 # 1.0 = off
    typical_p: float             # 1.0 = off
    # Sample (else greedy). As TGI's shards decide it: the client's do_sample,
    # or any warper set away from neutral (temperature != 1, top_k, top_p,
    # typical_p). An explicit temperature of 1.0 alone stays greedy.
    do_sample: bool
    seed: int                    # u64; drawn at random when the client gave none
    repetition_penalty: float    # 1.0 = off
    frequency_penalty: float     # 0.0 = off
    watermark: bool
    grammar: ValidGrammar | None
    presence_penalty: float = 0.0  # OpenAI's; 0.0 = off


@dataclass(frozen=True)
class ValidStoppingParameters:
    # TGI's per-schedule budget: the client's value, else
    # min(max_total_new_tokens, DEFAULT_GENERATION_LENGTH).
    max_new_tokens: int
    # The real limit on generated tokens: the client's max_new_tokens, else
    # max_total_tokens - input_length.
    max_total_new_tokens: int
    stop_sequences: tuple[str, ...]
    ignore_eos_token: bool = False


@dataclass(frozen=True)
class ValidGenerateRequest:
    """A request that passed validation; inner code trusts every field.
    For best_of > 1 the engine runs `best_of` sequences, each with its own
    fresh seed (TGI validates each copy and draws a seed per copy)."""
    inputs: str
    input_ids: tuple[int, ...]   # the last `input_length` ids of the encoding
    input_length: int
    truncate: int                # the client's truncate, else max_input_tokens
    parameters: ValidParameters
    stopping: ValidStoppingParameters
    top_n_tokens: int            # 0 = none
    best_of: int                 # >= 1
    details: bool
    decoder_input_details: bool
    return_full_text: bool | None  # None: the route's default
    adapter_id: str | None       # the LoRA adapter's name; None: the base model
    adapter: int = 0             # its index in ValidationLimits.adapters, plus 1; 0: the base model


def validate(request: GenerateRequest, tokenize: Callable[[str], list[int]],
             limits: ValidationLimits, *, stream: bool = False,
             rng: random.Random | None = None,
             count_tokens: Callable[[str], int] | None = None) -> ValidGenerateRequest:
    """Apply TGI's rules in TGI's order; raise `ValidationError` whose detail
    is TGI's message for the first rule broken. `count_tokens` counts the
    tokens of generated text (default: len(tokenize(text))), for the grammar's
    budget check (`check_grammar_budget`). `stream` adds the rules of
    `/generate_stream` (and of `/` with `"stream": true`)."""
    p = request.parameters
    best_of = _check_best_of(p, limits, stream)
    sampling = _check_sampling(p, best_of)
    _check_counts(p, limits)
    seed = _pick_seed(p, best_of, rng or _SYSTEM_RNG)
    top_n_tokens = _check_top_n_tokens(p, limits)
    if request.inputs == "":
        raise ValidationError("`inputs` cannot be empty")
    adapter = _check_adapter(p.adapter_id, limits)
    truncate = _check_truncate(p, limits)
    if truncate is None:
        check_input_chars(request.inputs, limits)
    ids = _tokenize(request.inputs, tokenize)
    input_length = min(len(ids), truncate) if truncate is not None else len(ids)
    max_new, max_total_new = _check_lengths(p, input_length, limits)
    grammar = _valid_grammar(p, limits)
    check_grammar_budget(grammar, max_total_new, count_tokens or (lambda text: len(tokenize(text))))
    return ValidGenerateRequest(
        inputs=request.inputs,
        input_ids=tuple(ids[len(ids) - input_length:]),
        input_length=input_length,
        truncate=truncate if truncate is not None else limits.max_input_tokens,
        parameters=ValidParameters(seed=seed, watermark=p.watermark,
                                   grammar=grammar, **sampling),
        stopping=ValidStoppingParameters(max_new, max_total_new, tuple(p.stop)),
        top_n_tokens=top_n_tokens,
        best_of=best_of,
        details=p.details,
        decoder_input_details=p.decoder_input_details,
        return_full_text=p.return_full_text,
        adapter_id=limits.adapters[adapter - 1] if adapter else None,
        adapter=adapter,
    )


def _check_adapter(adapter_id: str | None, limits: ValidationLimits) -> int:
    """The adapter's index + 1; 0 for none (no id, "", or the base model's id)."""
    if not adapter_id or adapter_id == limits.model_id:
        return 0
    if adapter_id in limits.adapters:
        return limits.adapters.index(adapter_id) + 1
    loaded = ", ".join(limits.adapters) if limits.adapters else "none (--lora-adapters)"
    raise ValidationError(f"adapter {adapter_id!r} is not loaded; loaded adapters: {loaded}")


def _check_best_of(p: GenerateParameters, limits: ValidationLimits,
                   stream: bool) -> int:
    """The route-level rules TGI checks before `validate`; returns the number
    of sequences to run. A best_of of 0 outside streaming runs one, as TGI."""
    if stream:
        if (1 if p.best_of is None else p.best_of) != 1:
            raise ValidationError("`best_of` != 1 is not supported when streaming tokens")
        if p.decoder_input_details:
            raise ValidationError(
                "`decoder_input_details` == true is not supported when streaming tokens")
        return 1
    if p.best_of is None or p.best_of <= 1:
        return 1
    if limits.max_best_of == 1:
        raise ValidationError("`best_of` != 1 is not allowed for this endpoint")
    if p.best_of > limits.max_best_of:
        raise ValidationError(
            f"`best_of` must be > 0 and <= {limits.max_best_of}. Given: {p.best_of}")
    return p.best_of


def _check_sampling(p: GenerateParameters, best_of: int) -> dict:
    # The router's notion of sampling, used only for this best_of rule.
    asked_sampling = (p.do_sample or p.temperature is not None or p.top_k is not None
                      or p.top_p is not None or p.typical_p is not None)
    if best_of > 1 and not asked_sampling:
        raise ValidationError("you must use sampling when `best_of` is > 1")
    temperature = 1.0 if p.temperature is None else p.temperature
    if temperature <= 0.0:
        raise ValidationError("`temperature` must be strictly positive")
    repetition_penalty = 1.0 if p.repetition_penalty is None else p.repetition_penalty
    if repetition_penalty <= 0.0:
        raise ValidationError("`repetition_penalty` must be strictly positive")
    frequency_penalty = 0.0 if p.frequency_penalty is None else p.frequency_penalty
    if not -2.0 <= frequency_penalty <= 2.0:
        raise ValidationError("`frequency_penalty` must be >= -2.0 and <= 2.0")
    if p.top_p is not None and not 0.0 < p.top_p < 1.0:
        raise ValidationError("`top_p` must be > 0.0 and < 1.0")
    if p.typical_p is not None and not 0.0 < p.typical_p < 1.0:
        raise ValidationError("`typical_p` must be > 0.0 and < 1.0")
    if p.top_k is not None and p.top_k <= 0:
        raise ValidationError("`top_k` must be strictly positive")
    top_p = 1.0 if p.top_p is None else p.top_p
    typical_p = 1.0 if p.typical_p is None else p.typical_p
    top_k = 0 if p.top_k is None else p.top_k
    do_sample = (p.do_sample or temperature != 1.0 or top_k != 0
                 or top_p < 1.0 or typical_p < 1.0)
    return dict(temperature=temperature, top_k=top_k, top_p=top_p,
                typical_p=typical_p, do_sample=do_sample,
                repetition_penalty=repetition_penalty,
                frequency_penalty=frequency_penalty)


def _check_counts(p: GenerateParameters, limits: ValidationLimits) -> None:
    if p.max_new_tokens == 0:
        raise ValidationError("`max_new_tokens` must be strictly positive")
    if len(p.stop) > limits.max_stop_sequences:
        raise ValidationError(f"`stop` supports up to {limits.max_stop_sequences} "
                              f"stop sequences. Given: {len(p.stop)}")


def _pick_seed(p: GenerateParameters, best_of: int, rng: random.Random) -> int:
    if p.seed is None:
        return rng.getrandbits(64)
    if best_of > 1:
        raise ValidationError("`seed` must not be set when `best_of` > 1")
    return p.seed


def _check_top_n_tokens(p: GenerateParameters, limits: ValidationLimits) -> int:
    if p.top_n_tokens is None:
        return 0
    if p.top_n_tokens > limits.max_top_n_tokens:
        raise ValidationError(f"`top_n_tokens` must be >= 0 and <= "
                              f"{limits.max_top_n_tokens}. Given: {p.top_n_tokens}")
    return p.top_n_tokens


def _check_truncate(p: GenerateParameters, limits: ValidationLimits) -> int | None:
    if p.truncate is not None and not 0 < p.truncate <= limits.max_input_tokens:
        raise ValidationError(f"`truncate` must be strictly positive and less than "
                              f"{limits.max_input_tokens}. Given: {p.truncate}")
    return p.truncate


def check_input_chars(text: str, limits: ValidationLimits) -> None:
    """Refuses, before tokenizing, a text too long to be max_input_tokens."""
    if limits.max_input_chars is not None and len(text) > limits.max_input_chars:
        at_least = -(-len(text) * limits.max_input_tokens // limits.max_input_chars)
        raise ValidationError(f"`inputs` must have less than {limits.max_input_tokens} "
                              f"tokens. Given: at least {at_least}")


def _tokenize(inputs: str, tokenize: Callable[[str], list[int]]) -> list[int]:
    try:
        return list(tokenize(inputs))
    except Exception as err:  # the tokenizer's own failure, reported as TGI does
        raise ValidationError(f"tokenizer error {err}") from err


def tokenize_text(tokenizer, text: str, add_special_tokens: bool = True) -> list[tuple[int, str, int, int]]:
    """`tokenizer.encode_with_offsets` for /tokenize and /chat_tokenize, its
    failure (e.g. a lone surrogate, which JSON can escape but no tokenizer
    encodes) a ValidationError as in `validate`."""
    return _tokenize(text, lambda t: tokenizer.encode_with_offsets(t, add_special_tokens=add_special_tokens))


def _check_lengths(p: GenerateParameters, input_length: int,
                   limits: ValidationLimits) -> tuple[int, int]:
    """(max_new_tokens, max_total_new_tokens). TGI checks the total before
    the input length, so an over-long input usually reports the total."""
    if p.max_new_tokens is not None:
        max_new = max_total_new = p.max_new_tokens
    else:
        max_total_new = max(limits.max_total_tokens - input_length, 0)
        max_new = min(max_total_new, DEFAULT_GENERATION_LENGTH)
    if input_length + max_new > limits.max_total_tokens:
        raise ValidationError(
            f"`inputs` tokens + `max_new_tokens` must be <= {limits.max_total_tokens}. "
            f"Given: {input_length} `inputs` tokens and {max_new} `max_new_tokens`")
    if input_length > limits.max_input_tokens:
        raise ValidationError(f"`inputs` must have less than {limits.max_input_tokens} "
                              f"tokens. Given: {input_length}")
    return max_new, max_total_new


def check_grammar_budget(grammar: ValidGrammar | None, max_new_tokens: int,
                         count_tokens: Callable[[str], int]) -> None:
    """A 422 when the grammar's shortest complete output needs more tokens
    than the request may generate: the shard guarantees a complete output
    within max_new_tokens only from that many on."""
    if grammar is None or grammar.shortest is None:
        return
    needed = count_tokens(grammar.shortest)
    if max_new_tokens < needed:
        raise ValidationError(
            f"`max_new_tokens` must be at least {needed} for this grammar: its shortest valid output, "
            f"{grammar.shortest!r}, is {needed} tokens. Given: {max_new_tokens}")


def _valid_grammar(p: GenerateParameters,
                   limits: ValidationLimits) -> ValidGrammar | None:
    """TGI's grammar checks (minus the JSON Schema meta-schema validation of
    TGI's jsonschema crate), then llguidance's own: a schema or regex it
    cannot compile is a 422 here, never a failed step."""
    grammar = p.grammar
    if grammar is None:
        return None
    if limits.disable_grammar_support:
        raise ValidationError("grammar is not supported")
    if isinstance(grammar, RegexGrammar):
        return regex_grammar(grammar.value)
    if isinstance(grammar, JsonSchemaGrammar):
        schema = grammar.value.schema_
    elif isinstance(grammar.value, str):
        try:
            schema = json.loads(grammar.value)
        except json.JSONDecodeError as err:
            raise ValidationError(f"grammar is not valid: {err}") from err
    elif isinstance(grammar.value, dict):
        schema = grammar.value
    else:
        raise ValidationError("grammar is not supported")
    if not isinstance(schema, (dict, bool)):  # what the meta-schema admits
        raise ValidationError(
            f"grammar is not valid: {json.dumps(schema)} is not of types \"boolean\", \"object\"")
    if not isinstance(schema, dict) or "properties" not in schema:
        raise ValidationError("grammar is not valid: Grammar must have a 'properties' field")
    return json_grammar(schema)
