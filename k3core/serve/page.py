"""``GET /``: the chat page, one self-contained HTML file shipped in the package.

``k3core/serve/static/chat.html`` holds its CSS and JavaScript inline and loads nothing from
anywhere else (no CDN, no build step): it talks to this server's
``/v1/chat/completions`` with ``stream: true``. The page is served with a
Content-Security-Policy that allows exactly its own inline script and style (by their
SHA-256) and requests to this origin, so nothing a reply contains can run or load anything.
The page itself needs no key; a keyed server's API calls do, and the page asks for it.
"""

from __future__ import annotations

import base64
import hashlib
import re
from functools import lru_cache
from importlib import resources

from starlette.requests import Request
from starlette.responses import HTMLResponse, Response
from starlette.routing import Route

ASSET = "static/chat.html"


@lru_cache(maxsize=1)
def page() -> tuple[bytes, str]:
    """The page's bytes and its Content-Security-Policy."""
    html = resources.files("k3core.serve").joinpath(ASSET).read_bytes()
    text = html.decode("utf-8")

    def hashes(tag: str) -> str:
        blocks = re.findall(rf"<{tag}>(.*?)</{tag}>", text, flags=re.S)
        return " ".join("'sha256-" + base64.b64encode(hashlib.sha256(b.encode()).digest()).decode() + "'"
                        for b in blocks)

    csp = (f"default-src 'none'; script-src {hashes('script')}; style-src {hashes('style')}; "
           "connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; "
           "frame-ancestors 'none'")
    return html, csp


async def chat_page(request: Request) -> Response:
    html, csp = page()
    return HTMLResponse(html, headers={"Content-Security-Policy": csp, "X-Content-Type-Options": "nosniff",
                                       "Referrer-Policy": "no-referrer", "Cache-Control": "no-cache"})


def page_routes() -> list[Route]:
    return [Route("/", chat_page, methods=["GET"])]
