"""A whole (non-streamed) reply awaited while its client is watched.

Both APIs (the OpenAI routes in :mod:`k3core.serve.app` and the Anthropic one in
:mod:`k3core.serve.anthropic`) answer a request without ``stream`` the same way: the
generation runs on the worker, the route waits for it, and a client that goes away before it
ends has its generation cancelled at once (the next step sees the flag) rather than left to
run to ``max_tokens`` for nobody.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import Future

from starlette.requests import Request

from k3core.serve.access import attach
from k3core.serve.service import Prepared
from k3core.serve.worker import Outcome

#: how often the client's connection is looked at while the generation runs (seconds)
POLL_SECONDS = 0.2


async def await_whole(request: Request, prep: Prepared,
                      fut: Future[Outcome]) -> asyncio.Future[Outcome] | None:
    """Wait for ``fut`` (the submitted generation of ``prep``); None when the client left.

    The request's log line is tied to the generation (:func:`attach`). A disconnect, or the
    route's own cancellation, sets the generation's cancel flag; the caller answers None
    with a 499 (nobody reads it) and reads a finished future's outcome itself.
    """
    attach(request, prep, fut)
    afut = asyncio.wrap_future(fut)
    try:
        while True:
            done, _ = await asyncio.wait({afut}, timeout=POLL_SECONDS)
            if done:
                return afut
            if await request.is_disconnected():
                prep.job.cancel.set()
                return None
    except asyncio.CancelledError:
        prep.job.cancel.set()
        raise
