"""GracefulServer: a uvicorn server that drains requests in flight and ends the rest with an error."""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import Callable
from types import FrameType

import uvicorn

logger = logging.getLogger("uvicorn.error")

# After the engine's requests are ended, their responses (an error event, then [DONE]) need only
# a moment to be written; this bounds the wait should a client not read them.
FLUSH_SECONDS = 2.0
# What uvicorn itself then gives the connections left (see run_serve's Config).
FINAL_GRACE_SECONDS = 1.0


class GracefulServer(uvicorn.Server):
    """Shuts down in order, on SIGTERM, Ctrl-C or ``should_exit``:

    1. ``stop_admitting()``: new requests get 503 (the listener stays open so they are told why);
    2. requests in flight get ``drain_timeout`` seconds to finish;
    3. ``abort_all()`` ends those left: each stream then gets an error event and ``data: [DONE]``;
    4. their responses get up to :data:`FLUSH_SECONDS` to be written;
    5. only then does uvicorn's own shutdown close the connections (and cancel what is left
       after ``config.timeout_graceful_shutdown``).

    uvicorn alone would cancel streams at step 5 with no error event and no ``[DONE]``. A second
    signal cuts the wait of step 2 short. The signal is not raised again once the server has
    stopped (uvicorn does that), so a graceful stop exits with status 0.
    """

    def __init__(self, config: uvicorn.Config, *, drain_timeout: float, stop_admitting: Callable[[], None],
                 abort_all: Callable[[], int]) -> None:
        super().__init__(config)
        if drain_timeout < 0:
            raise ValueError(f"the shutdown timeout must be >= 0 seconds, got {drain_timeout}")
        self.drain_timeout = drain_timeout
        self._stop_admitting, self._abort_all = stop_admitting, abort_all
        self.hurry = False

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # not recorded in _captured_signals: uvicorn would raise it again after the shutdown
        if self.should_exit:
            self.hurry = True
            self.force_exit = self.force_exit or sig == signal.SIGINT
        self.should_exit = True

    async def shutdown(self, sockets=None) -> None:
        await self.drain()
        await super().shutdown(sockets=sockets)

    async def drain(self) -> None:
        """Steps 1-4 above; returns when no request is in flight, or when the waits are over."""
        # both take the engine's lock, which a step holds: off the event loop, so streams keep flowing
        await asyncio.to_thread(self._stop_admitting)
        tasks = self.server_state.tasks
        if tasks:
            logger.info("Draining: %d request(s) in flight get up to %g s to finish; new ones get 503",
                        len(tasks), self.drain_timeout)
        await self._wait_for_tasks(self.drain_timeout, interruptible=True)
        ended = await asyncio.to_thread(self._abort_all)
        if ended:
            if self.hurry or self.force_exit:
                logger.warning("Ended %d request(s) still running: a second signal cut the wait short", ended)
            else:
                logger.warning("Ended %d request(s) still running after %g s (the shutdown timeout)",
                               ended, self.drain_timeout)
            # not cut short by a signal: bounded and brief, and it is what delivers their [DONE]
            await self._wait_for_tasks(FLUSH_SECONDS, interruptible=False)

    async def _wait_for_tasks(self, seconds: float, *, interruptible: bool) -> None:
        deadline = time.monotonic() + seconds
        while self.server_state.tasks and time.monotonic() < deadline:
            if interruptible and (self.hurry or self.force_exit):
                return
            await asyncio.sleep(0.05)
