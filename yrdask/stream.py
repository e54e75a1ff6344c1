"""A low-latency batched sender over a Dask comm, shared by every yr stream.

Dask's ``BatchedSend`` wakes a tornado coroutine with timed waits even at ``interval=0``,
which costs ~150 µs per message on a small machine.  ``StreamSender`` writes at once when
idle (at the end of the current loop pass) and coalesces whatever arrives meanwhile into
one batch, so a single call pays one ``comm.write`` and a burst of calls shares them.  It speaks Dask's
stream format (a list of message dicts per write), so either end may use Dask's reader.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from distributed.comm.core import CommClosedError

logger = logging.getLogger("yrdask.stream")


class StreamSender:
    """Batched one-way messages on ``comm`` (see module docstring); call on the loop."""

    __slots__ = ("comm", "buffer", "writing", "closed", "loop", "_task")

    def __init__(self, comm: Any) -> None:
        # yr messages carry user objects as pickled bytes: msgpack copies them quickly, so
        # skip Dask's per-write sizeof walk that decides whether to serialize off the loop.
        comm.allow_offload = False
        self.comm = comm
        self.buffer: list = []
        self.writing = False
        self.closed = False
        self.loop = asyncio.get_running_loop()
        self._task: asyncio.Task | None = None

    def send(self, *msgs: Any) -> None:
        if self.closed:
            raise CommClosedError(f"stream to {self.comm.peer_address} is closed")
        self.buffer.extend(msgs)
        if not self.writing:
            self.writing = True
            self.loop.call_soon(self._kick)  # what else is sent this loop pass joins in

    def send_now(self, *msgs: Any) -> None:
        """:meth:`send`, written on this stack when idle: for a caller that batched
        ``msgs`` already (one wake-up of the loop for what other threads handed over)."""
        if self.closed:
            raise CommClosedError(f"stream to {self.comm.peer_address} is closed")
        self.buffer.extend(msgs)
        if not self.writing:
            self.writing = True
            self._kick()

    def _kick(self) -> None:
        self._start(self._flush())

    def _start(self, coro: Any) -> None:
        """Run ``coro`` now, on this stack; only if it suspends does it become a task.

        A Dask TCP write with offloading off serializes and queues the bytes on the tornado
        stream without suspending, so the usual case costs no task object.
        """
        try:
            waiting = coro.send(None)
        except StopIteration:
            return
        self._task = self.loop.create_task(_resume(coro, waiting))

    async def _flush(self) -> None:
        try:
            while self.buffer:
                batch, self.buffer = self.buffer, []
                await self.comm.write(batch, on_error="raise")
        except (CommClosedError, OSError):
            self.closed = True
        except Exception:
            logger.exception("yr stream write to %s failed", self.comm.peer_address)
            self.closed = True
            self.comm.abort()
        finally:
            self.writing = False

    async def close(self) -> None:
        """Flush what is buffered, then close the comm."""
        if self._task is not None and not self._task.done():
            try:
                await asyncio.wait_for(asyncio.shield(self._task), 5)
            except Exception:
                pass
        self.closed = True
        if not self.comm.closed():
            await self.comm.close()


async def _resume(coro: Any, waiting: Any) -> None:
    """Finish a coroutine that was started by hand and suspended on ``waiting``."""
    while True:
        try:
            if waiting is None:  # a bare yield: give the loop one pass
                await asyncio.sleep(0)
                result = None
            else:
                result = await waiting
        except BaseException as e:  # noqa: BLE001 - handed to the coroutine
            step = coro.throw, e
        else:
            step = coro.send, result
        try:
            waiting = step[0](step[1])
        except StopIteration:
            return
