"""``POST /tokenize`` and ``POST /detokenize``: llama-server's shapes on the served tokenizer.

``{"content": "text"}`` -> ``{"tokens": [ids]}``, encoded as a completion's text prompt is
(a named special token spelled in the text becomes its id); ``{"tokens": [ids]}`` ->
``{"content": "text"}`` (bytes that are not UTF-8 become U+FFFD). Both are bounded as a
prompt is: text that needs more tokens than the context holds is refused before it is
tokenized in full (by its length alone, or where counting stopped), and at most the context's
count of ids is decoded. Types are strict (a string of digits is no id, a boolean is no
number), unknown fields are refused, and a server with an API key wants it here as on the
``/v1`` routes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from k3core.api.errors import UsageError
from k3core.serve.protocol import APIError, validation_error
from k3core.serve.service import Service
from k3core.tokenizer.encoding import TokenLimitExceeded


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    content: str


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    tokens: list[int]


def _parse(model: type[BaseModel], doc: dict[str, Any]) -> Any:
    try:
        return model.model_validate(doc)
    except ValidationError as exc:
        raise validation_error(exc) from None


def tokenize(service: Service, doc: dict[str, Any]) -> dict[str, Any]:
    """The ids of ``doc["content"]`` (blocks: run it off the event loop)."""
    req: TokenizeRequest = _parse(TokenizeRequest, doc)
    limit = service.worker.context
    try:
        ids = service.tok.encode(req.content, limit=limit)
    except TokenLimitExceeded as exc:
        raise APIError(400, f"the content holds more than {exc.limit} tokens ({exc.how}): over "
                            f"the model's context of {limit} tokens, the most a prompt may hold",
                       param="content", code="context_length_exceeded") from None
    return {"tokens": ids}


def detokenize(service: Service, doc: dict[str, Any]) -> dict[str, Any]:
    """The text of ``doc["tokens"]`` (blocks: run it off the event loop)."""
    req: DetokenizeRequest = _parse(DetokenizeRequest, doc)
    limit = service.worker.context
    if len(req.tokens) > limit:
        raise APIError(400, f"{len(req.tokens)} tokens are over the model's context of {limit} "
                            "tokens, the most a prompt may hold", param="tokens",
                       code="context_length_exceeded")
    bad = [i for i in req.tokens if not 0 <= i < service.vocab]
    if bad:
        raise APIError(400, f"token id {bad[0]} is outside the vocabulary 0..{service.vocab - 1}",
                       param="tokens", code="invalid_value")
    try:
        return {"content": service.tok.decode(req.tokens)}
    except UsageError as exc:  # an id the tokenizer does not have
        raise APIError(400, f"tokens: {exc}", param="tokens", code="invalid_value") from None


Handler = Callable[[Service, dict[str, Any]], dict[str, Any]]


def tokenize_routes(service: Service, check_key: Callable[[Request], None],
                    body: Callable[[Request], Awaitable[dict[str, Any]]]) -> list[Route]:
    """The two routes, keyed and bounded as the app's ``/v1`` routes are (``check_key``,
    ``body``: the app's)."""

    def route(path: str, fn: Handler) -> Route:
        async def endpoint(request: Request) -> Response:
            check_key(request)
            doc = await body(request)
            return JSONResponse(await asyncio.to_thread(fn, service, doc))  # a long text takes a while

        return Route(path, endpoint, methods=["POST"])

    return [route("/tokenize", tokenize), route("/detokenize", detokenize)]
