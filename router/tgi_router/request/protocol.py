"""TGI's native wire schemas: the bodies of `/generate`, `/generate_stream`,
`/` (compat), `/tokenize` and `/info`, with TGI's field names, defaults and
JSON shape (TGI router/src/lib.rs).

Requests follow serde's rules as TGI applies them: unknown fields are ignored,
`null` is accepted only where TGI has an `Option`, JSON types are strict (no
"5" for 5, no 1.0 for an integer), integers keep their Rust widths, and floats
are rounded to f32 as TGI parses them, so bounds checks see TGI's numbers.

Responses omit exactly the fields TGI marks `skip_serializing_if` and write a
non-finite logprob (the first prompt token's is NaN) as null, like serde_json.
"""

import math
import struct
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    RootModel,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    field_serializer,
    field_validator,
    model_serializer,
)

U32_MAX = 2**32 - 1
U64_MAX = 2**64 - 1
USIZE_MAX = 2**64 - 1
I32_MIN, I32_MAX = -(2**31), 2**31 - 1


def to_f32(value: float) -> float:
    """The f32 nearest `value`; out-of-range values become ±inf, as serde's cast."""
    try:
        return struct.unpack("<f", struct.pack("<f", value))[0]
    except OverflowError:
        return math.copysign(math.inf, value)


F32 = Annotated[StrictFloat, AfterValidator(to_f32)]
U32 = Annotated[StrictInt, Field(ge=0, le=U32_MAX)]
U64 = Annotated[StrictInt, Field(ge=0, le=U64_MAX)]
USize = Annotated[StrictInt, Field(ge=0, le=USIZE_MAX)]
I32 = Annotated[StrictInt, Field(ge=I32_MIN, le=I32_MAX)]

FinishReason = Literal["length", "eos_token", "stop_sequence"]


class _Request(BaseModel):
    # serde ignores unknown fields; JSON has no NaN.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, frozen=True)


# ---------------------------------------------------------------- requests


class JsonSchemaConfig(_Request):
    """`value` of a `json_schema` grammar (OpenAI's response_format shape);
    other keys such as `strict` are ignored."""
    name: StrictStr | None = None
    schema_: Any = Field(alias="schema")

    model_config = ConfigDict(validate_by_name=True, serialize_by_alias=True)


class JsonGrammar(_Request):
    """A JSON Schema, as an object or as a string holding one. TGI also
    accepts `json_object` as the tag and answers with `json`."""
    type: Literal["json", "json_object"]
    value: Any

    @field_validator("type")
    @classmethod
    def _alias(cls, value: str) -> str:
        return "json"


class RegexGrammar(_Request):
    type: Literal["regex"]
    value: StrictStr


class JsonSchemaGrammar(_Request):
    type: Literal["json_schema"]
    value: JsonSchemaConfig


Grammar = Annotated[JsonGrammar | RegexGrammar | JsonSchemaGrammar,
                    Field(discriminator="type")]


class GenerateParameters(_Request):
    """TGI's `GenerateParameters`. `max_new_tokens` omitted means "as many as
    the context allows" (TGI ≥ 3.0, see validation); TGI 1.x–2.x defaulted it
    to 20 then 100."""
    best_of: USize | None = None
    temperature: F32 | None = None
    repetition_penalty: F32 | None = None
    frequency_penalty: F32 | None = None
    top_k: I32 | None = None
    top_p: F32 | None = None
    typical_p: F32 | None = None
    do_sample: StrictBool = False
    max_new_tokens: U32 | None = None
    return_full_text: StrictBool | None = None
    stop: list[StrictStr] = Field(default_factory=list)
    truncate: USize | None = None
    watermark: StrictBool = False
    details: StrictBool = False
    decoder_input_details: StrictBool = False
    seed: U64 | None = None
    top_n_tokens: U32 | None = None
    grammar: Grammar | None = None
    adapter_id: StrictStr | None = None


def default_parameters() -> GenerateParameters:
    """What TGI uses when the `parameters` key is absent. Unlike `{}`, this
    samples: TGI's `default_parameters()` sets `do_sample: true`."""
    return GenerateParameters(do_sample=True)


class GenerateRequest(_Request):
    """Body of `/generate`, `/generate_stream` and `/tokenize`."""
    inputs: StrictStr
    parameters: GenerateParameters = Field(default_factory=default_parameters)


class CompatGenerateRequest(_Request):
    """Body of `/`: a `GenerateRequest` plus `stream`."""
    inputs: StrictStr
    parameters: GenerateParameters = Field(default_factory=default_parameters)
    stream: StrictBool = False

    def to_generate_request(self) -> GenerateRequest:
        return GenerateRequest(inputs=self.inputs, parameters=self.parameters)


# --------------------------------------------------------------- responses


class _Response(BaseModel):
    """Serializes like TGI's serde derive: fields in `omit_if_none` vanish
    when None, fields in `omit_if_empty` vanish when empty."""
    omit_if_none: ClassVar[tuple[str, ...]] = ()
    omit_if_empty: ClassVar[tuple[str, ...]] = ()

    @model_serializer(mode="wrap")
    def _omit(self, handler):
        data = handler(self)
        for name in self.omit_if_none:
            if data.get(name, 0) is None:
                del data[name]
        for name in self.omit_if_empty:
            if name in data and not data[name]:
                del data[name]
        return data


def _finite_or_none(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


class PrefillToken(_Response):
    id: int
    text: str
    logprob: float | None

    @field_serializer("logprob")
    def _logprob(self, value: float | None) -> float | None:
        return _finite_or_none(value)


class Token(_Response):
    id: int
    text: str
    logprob: float | None
    special: bool

    @field_serializer("logprob")
    def _logprob(self, value: float | None) -> float | None:
        return _finite_or_none(value)


class BestOfSequence(_Response):
    omit_if_empty = ("top_tokens",)
    generated_text: str
    finish_reason: FinishReason
    generated_tokens: int
    seed: int | None
    prefill: list[PrefillToken]
    tokens: list[Token]
    top_tokens: list[list[Token]] = Field(default_factory=list)


class Details(_Response):
    """`seed` is written even when null; it is set only for sampled requests."""
    omit_if_none = ("best_of_sequences",)
    omit_if_empty = ("top_tokens",)
    finish_reason: FinishReason
    generated_tokens: int
    seed: int | None
    prefill: list[PrefillToken]
    tokens: list[Token]
    best_of_sequences: list[BestOfSequence] | None = None
    top_tokens: list[list[Token]] = Field(default_factory=list)


class GenerateResponse(_Response):
    """`/generate` answers one; `/` answers a list of one."""
    omit_if_none = ("details",)
    generated_text: str
    details: Details | None = None


class StreamDetails(_Response):
    finish_reason: FinishReason
    generated_tokens: int
    seed: int | None
    input_length: int


class StreamResponse(_Response):
    """One SSE event of `/generate_stream`. `index` counts events from 1;
    `generated_text` and `details` are written as null until the last one."""
    omit_if_empty = ("top_tokens",)
    index: int
    token: Token
    top_tokens: list[Token] = Field(default_factory=list)
    generated_text: str | None = None
    details: StreamDetails | None = None


class ErrorResponse(_Response):
    error: str
    error_type: str


class Info(_Response):
    """`/info` as TGI 3.x writes it (nulls included; no model_dtype or
    model_device_type, which TGI dropped from the router)."""
    model_config = ConfigDict(protected_namespaces=())
    model_id: str
    model_sha: str | None = None
    model_pipeline_tag: str | None = None
    max_concurrent_requests: int
    max_best_of: int
    max_stop_sequences: int
    max_input_tokens: int
    max_total_tokens: int
    validation_workers: int
    max_client_batch_size: int
    router: str = "text-generation-router"
    version: str
    sha: str | None = None
    docker_label: str | None = None


class SimpleToken(_Response):
    """A token of `/tokenize`: `start`/`stop` are offsets into the input."""
    id: int
    text: str
    start: int
    stop: int


class TokenizeResponse(RootModel[list[SimpleToken]]):
    """`/tokenize` answers a bare JSON list of `SimpleToken`."""


class ChatTokenizeResponse(_Response):
    tokenize_response: TokenizeResponse
    templated_text: str
