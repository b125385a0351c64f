"""Work for an HTTP request that stops when its client leaves.

A non-streaming answer is written only at the end, so without this a request whose client has
gone (a timeout, a closed tab) would keep its sequences running and its pages held until it
finished. Streaming answers need none of it: writing to a closed connection ends them.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from typing import TypeVar

from starlette.requests import Request

T = TypeVar("T")
POLL_SECONDS = 0.2  # how often the connection is checked while the work runs


class ClientGone(Exception):
    """The client of a request closed its connection before the answer was ready."""


async def unless_client_leaves(request: Request, work: Awaitable[T], *, period: float = POLL_SECONDS) -> T:
    """``work``'s result. If ``request``'s client closes its connection first, ``work`` is
    cancelled (engine streams abort their requests and free their pages when cancelled) and
    :class:`ClientGone` is raised."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=period)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                raise ClientGone("the client closed the connection before the answer was ready")
    finally:
        if not task.done():  # the handler itself was cancelled
            task.cancel()
