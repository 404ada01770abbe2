"""The OpenAI-compatible wire format: request and response models, and error bodies.

Requests are checked strictly: an unknown field, a wrong type or an out-of-range value is a
400 with an OpenAI-style error body (``{"error": {"message", "type", "param", "code"}}``)
naming the field. Types are JSON's own, never coerced: a string where a number or a boolean
belongs is refused, a boolean is not a number (``"max_tokens": true``, ``"n": true``), a
number is not a boolean (``"echo": 0``); a whole-number float is not an integer. Fields OpenAI clients commonly send are accepted at the values k3 can
honour (``n`` 1, ``echo`` false, penalties 0, no logprobs, no tools) and refused otherwise,
so a request is never silently answered as something else.

Sampling follows ``k3 run``: greedy unless ``temperature`` (> 0), ``top_p``, ``top_k`` or
``seed`` is given; ``temperature`` 0 is greedy.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, field_validator

MAX_STOP_STRINGS = 4
MAX_STOP_CHARS = 256


class APIError(Exception):
    """A refusal with its HTTP status and OpenAI-style error body."""

    def __init__(self, status: int, message: str, *, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def _field_path(loc: tuple[Any, ...]) -> str:
    """``messages.0.content``: the request's own field names and list indices, without the
    union members pydantic names on the way (``str``, ``list[int]``, ``TextPart``...)."""
    parts = []
    for p in loc:
        if isinstance(p, int) or (isinstance(p, str) and p.isidentifier() and p.islower()
                                  and p not in _TYPE_TAGS):
            parts.append(str(p))
    return ".".join(parts)


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "literal"}


def json_kind(value: Any) -> str:
    """What a JSON value is, in JSON's words."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object" if isinstance(value, dict) else type(value).__name__


def validation_error(exc: ValidationError) -> APIError:
    """The most specific problem pydantic found (the deepest; for a field of several types,
    the member that got furthest), as one 400 naming the field."""
    errors = exc.errors(include_url=False)
    err = max(errors, key=lambda e: len(e.get("loc", ())))  # the first of the deepest
    loc = _field_path(tuple(err.get("loc", ())))
    kind = err.get("type", "")
    if kind == "extra_forbidden":
        msg = f"unknown field {loc!r}"
        code = "unknown_field"
    elif kind == "missing":
        msg = f"missing required field {loc!r}"
        code = "missing_field"
    else:
        text = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
        got = err.get("input")
        if kind == "literal_error" and isinstance(got, str):
            text += f", got {got[:40]!r}"
        elif kind.endswith("_type") or kind == "literal_error":
            text += f", got {json_kind(got)}"
        msg = f"{loc}: {text}" if loc else text
        code = "invalid_value"
    return APIError(400, msg, param=loc or None, code=code)


def _not_a_number(v: Any) -> Any:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"Input should be a number, got {json_kind(v)}")
    return v


def _not_a_bool(v: Any) -> Any:
    if v is not None and not isinstance(v, bool):
        raise ValueError(f"Input should be a boolean, got {json_kind(v)}")
    return v


#: literal fields checked for their JSON type first (a literal alone takes ``true`` for ``1``)
One = Annotated[Literal[1], BeforeValidator(_not_a_number)]
Zero = Annotated[Literal[0], BeforeValidator(_not_a_number)]
No = Annotated[Literal[False], BeforeValidator(_not_a_bool)]


class _Strict(BaseModel):
    """JSON types as they are: pydantic's strict mode (no string to number or boolean, no
    boolean to number)."""

    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampling(_Strict):
    model: str
    max_tokens: int | None = Field(None, ge=0)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=1)
    seed: int | None = Field(None, ge=0, lt=1 << 63)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: One = 1
    user: str | None = None
    presence_penalty: Zero = 0
    frequency_penalty: Zero = 0
    logit_bias: dict[str, float] | None = None
    stop_token_ids: list[int] | None = Field(None, max_length=8)
    ignore_eos: bool = False
    spec: Literal["off", "ngram", "auto"] | None = None  # k3's speculative decoding

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> list[str] | None:
        if v is None:
            return None
        stops = [v] if isinstance(v, str) else list(v)
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
        if any(not s or len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"each stop string must be 1..{MAX_STOP_CHARS} characters")
        return stops

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v: dict[str, float] | None) -> None:
        if v:
            raise ValueError("logit_bias is not supported")
        return None

    @property
    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: No = False
    logprobs: None = None
    best_of: One | None = None
    suffix: None = None

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v: Any) -> Any:
        if isinstance(v, list) and v and isinstance(v[0], (str, list)):
            if len(v) != 1:
                raise ValueError("one prompt per request (a batch of prompts is not supported)")
            return v[0]
        return v


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessageIn(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    reasoning_content: str | None = None
    name: str | None = None

    @property
    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ResponseFormat(_Strict):
    type: Literal["text"]


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessageIn] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=0)
    reasoning_effort: Literal["none", "low", "high", "max"] | None = None
    logprobs: No | None = None
    top_logprobs: None = None
    response_format: ResponseFormat | None = None
    tools: None = None
    tool_choice: Literal["none"] | None = None
    parallel_tool_calls: None = None

    @property
    def limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


# ---- responses ------------------------------------------------------------------------------
class PromptTokensDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: Literal["stop", "length"] | None
    logprobs: None = None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    k3: dict[str, Any] | None = None


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str
    reasoning_content: str | None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatMessageOut
    finish_reason: Literal["stop", "length"] | None
    logprobs: None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    k3: dict[str, Any] | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "k3"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def usage(prompt: int, completion: int, cached: int) -> Usage:
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))
