"""The OpenAI-compatible wire format: request and response models, and error bodies.

Requests are checked strictly: an unknown field, a wrong type or an out-of-range value is a
400 with an OpenAI-style error body (``{"error": {"message", "type", "param", "code"}}``)
naming the field. Types are JSON's own, never coerced: a string where a number or a boolean
belongs is refused, a boolean is not a number (``"max_tokens": true``, ``"n": true``), a
number is not a boolean (``"echo": 0``); a whole-number float is not an integer. Fields that
do not change the answer (``store``, ``metadata``, ``user``, ``service_tier``,
``prediction``, ...) are accepted and ignored; anything k3 cannot honour (image or audio
input, ``suffix``, ``best_of`` other than ``n``) is refused in words that say so, so a
request is never silently answered as something else.

Sampling follows ``k3 run``: greedy unless ``temperature`` (> 0), ``top_p``, ``top_k`` or
``seed`` is given; ``temperature`` 0 is greedy.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
)

from k3core.api.safejson import json_kind

MAX_STOP_STRINGS = 4
#: the most tools one request may declare
MAX_TOOLS = 128
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
MAX_STOP_CHARS = 256
#: the most rows one request may ask for (``n``): they are decoded one after the other
MAX_N = 16
#: the most alternatives per token (``top_logprobs``, a completion's ``logprobs``)
MAX_TOP_LOGPROBS = 20
#: content part types and what k3 says of them
_NOT_TEXT = {"image_url": "image", "input_image": "image", "image": "image",
             "input_audio": "audio", "audio": "audio", "file": "file", "input_file": "file"}


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
    elif kind == "none_required":
        msg = f"{loc}: k3 does not support this field (send null or leave it out)"
        code = "invalid_value"
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


class _Strict(BaseModel):
    """JSON types as they are: pydantic's strict mode (no string to number or boolean, no
    boolean to number)."""

    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False
    include_obfuscation: bool | None = None  # ignored: k3 pads no stream chunks


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
    n: int = Field(1, ge=1, le=MAX_N)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    # accepted and ignored: they do not change the answer
    user: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
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
    def _bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (v or {}).items():
            if not (key.isascii() and key.isdigit()):
                raise ValueError(f"keys are token ids written as decimal strings (\"42\"), got {key[:40]!r}")
            if not -100 <= bias <= 100:
                raise ValueError(f"the bias of token {key} must be in -100..100, got {bias}")
        return v

    @property
    def bias(self) -> dict[int, float]:
        """``logit_bias`` by id (zero biases left out)."""
        return {int(k): v for k, v in (self.logit_bias or {}).items() if v}

    @property
    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    best_of: int | None = Field(None, ge=1, le=MAX_N)
    suffix: str | None = None

    @field_validator("suffix")
    @classmethod
    def _suffix(cls, v: str | None) -> None:
        if v:
            raise ValueError("k3 does not fill in the middle: a suffix after the completion is not "
                             "supported (put everything in prompt)")
        return None

    @field_validator("best_of")
    @classmethod
    def _best_of(cls, v: int | None, info: ValidationInfo) -> int | None:
        n = info.data.get("n", 1)
        if v is not None and v != n:
            raise ValueError(f"{v} with n {n}: k3 returns every row it generates, so "
                             "best_of must equal n (or be left out)")
        return v

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


def refuse_non_text(v: Any, not_text: dict[str, str], noun: str) -> list[str | None]:
    """Refuse, in words, the first content item of list ``v`` whose type ``not_text`` names.

    ``not_text`` maps a content type (``image_url``, ``document``...) to what it is called in
    the message; ``noun`` is what the API calls an item (``part``, ``block``). Returns each
    item's type (None where an item has none) for a caller's own further checks; a ``v`` that
    is not a list gives an empty list (the model's own validation speaks of it).
    """
    kinds: list[str | None] = []
    if isinstance(v, list):
        for i, item in enumerate(v):
            kind = item.get("type") if isinstance(item, dict) else None
            kind = kind if isinstance(kind, str) else None
            what = not_text.get(kind) if kind is not None else None
            if what is not None:
                raise ValueError(f"k3 does not take {what} input: {noun} {i} is of type {kind!r}; "
                                 f"this model reads text only (send text {noun}s)")
            kinds.append(kind)
    return kinds


def _text_parts(v: Any) -> Any:
    """Content parts k3 cannot read (an image, audio, a file) refused in words."""
    refuse_non_text(v, _NOT_TEXT, "part")
    return v


class FunctionCallIn(_Strict):
    name: str
    arguments: str | dict[str, Any] = "{}"  # JSON text, as OpenAI sends it (an object taken too)


class ToolCallIn(_Strict):
    """An assistant message's call, sent back in the history."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessageIn(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Annotated[str | list[TextPart] | None, BeforeValidator(_text_parts)] = None
    reasoning_content: str | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None

    @field_validator("tool_call_id")
    @classmethod
    def _answer(cls, v: str | None, info: ValidationInfo) -> str | None:
        role = info.data.get("role")
        if v is not None and role != "tool":
            raise ValueError("only a tool message carries a tool_call_id")
        return v

    @field_validator("tool_calls")
    @classmethod
    def _calls(cls, v: list[ToolCallIn] | None, info: ValidationInfo) -> list[ToolCallIn] | None:
        if v and info.data.get("role") != "assistant":
            raise ValueError("only an assistant message carries tool_calls")
        return v

    @property
    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class FunctionDef(_Strict):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not v:
            raise ValueError("a tool needs a name")
        if not TOOL_NAME.fullmatch(v):
            raise ValueError(f"a tool's name is 1 to 64 letters, digits, _ or -, got {v[:70]!r}")
        return v


class ToolDef(_Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(_Strict):
    name: str
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    """``text``, ``json_object`` (any JSON object) or ``json_schema`` (constrained to the schema)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @field_validator("json_schema")
    @classmethod
    def _schema(cls, v: JsonSchemaFormat | None, info: ValidationInfo) -> JsonSchemaFormat | None:
        if (v is not None) != (info.data.get("type") == "json_schema"):
            raise ValueError("json_schema goes with type json_schema (and only with it)")
        return v


class Prediction(_Strict):
    """Predicted output (accepted and ignored: it may make OpenAI faster, never other)."""

    type: Literal["content"]
    content: str | list[TextPart]


def _text_only(v: Any) -> Any:
    if isinstance(v, list) and any(m != "text" for m in v):
        raise ValueError("k3 answers in text only (audio output is not supported): send "
                         "[\"text\"] or leave modalities out")
    return v


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessageIn] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=0)
    reasoning_effort: Literal["none", "low", "high", "max"] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    response_format: ResponseFormat | None = None
    tools: list[ToolDef] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    prediction: Prediction | None = None
    modalities: Annotated[list[str] | None, BeforeValidator(_text_only)] = None

    @field_validator("top_logprobs")
    @classmethod
    def _top(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v is not None and not info.data.get("logprobs"):
            raise ValueError("needs logprobs: true")
        return v

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
    logprobs: dict[str, Any] | None = None


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
    content: str | None
    reasoning_content: str | None = None
    #: the calls the model made (``finish_reason`` ``tool_calls``)
    tool_calls: list[dict[str, Any]] | None = None
    #: k3's word on the reply, when there is one to say (max_tokens spent thinking)
    k3_note: str | None = None
    #: what k3 could not read of the reply (a malformed tool call, returned as text)
    k3_warning: str | None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatMessageOut
    finish_reason: Literal["stop", "length", "tool_calls"] | None
    logprobs: dict[str, Any] | None = None


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
