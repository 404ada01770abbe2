"""Cross-origin requests: off unless ``--cors-origin ORIGIN`` names the pages allowed.

Without the flag the server sends no ``Access-Control-*`` header, so a browser keeps a page
from another origin from reading any answer (and a preflight ``OPTIONS`` is a 405). Each
``--cors-origin`` (repeatable) allows one origin, ``scheme://host[:port]`` as a browser
sends it in ``Origin``, or ``*`` for any: a preflight from it is answered (methods ``GET``
and ``POST``, headers ``Authorization`` and ``Content-Type``, cached 10 minutes) and its
requests get ``Access-Control-Allow-Origin``. A preflight from any other origin is a 400
OpenAI-style error body naming what was refused. No cookies are allowed along (the key is a
bearer header, which the page sends itself).
"""

from __future__ import annotations

from collections.abc import Sequence
from urllib.parse import urlsplit

from starlette.datastructures import Headers
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import JSONResponse, Response

from k3core.api.errors import UsageError
from k3core.serve.protocol import APIError

METHODS = ("GET", "POST")
HEADERS = ("Authorization", "Content-Type")
MAX_AGE = 600


def check_origins(origins: Sequence[str]) -> list[str]:
    """The ``--cors-origin`` values, each ``*`` or ``scheme://host[:port]`` (exit 2 otherwise)."""
    out: list[str] = []
    for origin in origins:
        if origin != "*":
            try:
                parts = urlsplit(origin)
                port = parts.port  # a bad port raises
            except ValueError:
                parts, port = None, None
            if (parts is None or parts.scheme not in ("http", "https") or not parts.hostname
                    or parts.path or parts.query or parts.fragment or parts.username is not None
                    or origin != origin.strip() or origin.endswith(":")):
                raise UsageError(f"--cors-origin {origin!r} is not an origin: give it as a browser "
                                 "sends it, scheme://host[:port] (no path, no trailing slash), or '*'")
            del port
        if origin not in out:
            out.append(origin)
    return out


class _CORS(CORSMiddleware):
    def preflight_response(self, request_headers: Headers) -> Response:
        resp = super().preflight_response(request_headers)
        if resp.status_code != 400:
            return resp
        what = bytes(resp.body).decode().removeprefix("Disallowed CORS ")
        err = APIError(400, f"CORS preflight refused ({what}): this server allows origins "
                            f"{', '.join(self.allow_origins) or 'none'}, methods {', '.join(METHODS)} "
                            f"and headers {', '.join(HEADERS)} (--cors-origin)", code="cors_refused")
        headers = {k: v for k, v in resp.headers.items() if k.lower() not in ("content-length", "content-type")}
        return JSONResponse(err.body(), status_code=400, headers=headers)


def cors_middleware(origins: Sequence[str]) -> list[Middleware]:
    """The middleware for ``origins`` (none at all when there are none)."""
    if not origins:
        return []
    return [Middleware(_CORS, allow_origins=list(origins), allow_methods=list(METHODS),
                       allow_headers=list(HEADERS), allow_credentials=False, max_age=MAX_AGE)]
