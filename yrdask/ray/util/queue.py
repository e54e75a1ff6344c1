"""``ray.util.queue.Queue``: a FIFO queue shared by tasks and actors, kept by an async actor."""

from __future__ import annotations

import asyncio
import queue as _queue
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["Queue", "Empty", "Full"]


class Empty(_queue.Empty):
    """``get`` found the queue empty (non-blocking, or after ``timeout``)."""


class Full(_queue.Full):
    """``put`` found the queue full (non-blocking, or after ``timeout``)."""


class _QueueActor:
    """The actor holding the items (an ``asyncio.Queue`` on its event loop)."""

    def __init__(self, maxsize: int) -> None:
        self.maxsize = maxsize
        self.queue: asyncio.Queue | None = None

    def _q(self) -> asyncio.Queue:
        if self.queue is None:
            self.queue = asyncio.Queue(self.maxsize)
        return self.queue

    async def qsize(self) -> int:
        return self._q().qsize()

    async def empty(self) -> bool:
        return self._q().empty()

    async def full(self) -> bool:
        return self._q().full()

    async def put(self, item: Any, timeout: float | None = None) -> bool:
        try:
            await asyncio.wait_for(self._q().put(item), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    async def get(self, timeout: float | None = None) -> tuple:
        try:
            return True, await asyncio.wait_for(self._q().get(), timeout)
        except asyncio.TimeoutError:
            return False, None

    async def put_nowait(self, item: Any) -> bool:
        try:
            self._q().put_nowait(item)
            return True
        except asyncio.QueueFull:
            return False

    async def put_nowait_batch(self, items: list) -> bool:
        q = self._q()
        if q.maxsize and len(items) + q.qsize() > q.maxsize:
            return False
        for item in items:
            q.put_nowait(item)
        return True

    async def get_nowait(self) -> tuple:
        try:
            return True, self._q().get_nowait()
        except asyncio.QueueEmpty:
            return False, None

    async def get_nowait_batch(self, num_items: int) -> tuple:
        q = self._q()
        if num_items > q.qsize():
            return False, None
        return True, [q.get_nowait() for _ in range(num_items)]


class Queue:
    """A queue any task or actor can use (pass it as an argument); ``maxsize=0`` is unbounded.

    ``actor_options`` are ``@ray.remote`` options for the actor that keeps the items.
    """

    def __init__(self, maxsize: int = 0, actor_options: dict | None = None) -> None:
        from yrdask.ray.actor import ActorClass

        if isinstance(maxsize, bool) or not isinstance(maxsize, int):
            raise TypeError(f"maxsize must be an int, got {maxsize!r}")
        if maxsize < 0:
            raise ValueError(f"maxsize must be >= 0 (0: unbounded), got {maxsize!r}")
        if actor_options is not None and not isinstance(actor_options, Mapping):
            # Ray passes them on as ``.options(**actor_options)``
            raise TypeError("actor_options must be a dict of actor options, as "
                            f".options(**actor_options) takes them, got {actor_options!r}")
        self.maxsize = maxsize
        self.actor = ActorClass(_QueueActor, dict(actor_options or {})).remote(maxsize)

    def __len__(self) -> int:
        return self.size()

    def _get(self, ref: Any) -> Any:
        from yrdask.ray.worker import get

        return get(ref)

    def size(self) -> int:
        return self._get(self.actor.qsize.remote())

    qsize = size

    def empty(self) -> bool:
        return self._get(self.actor.empty.remote())

    def full(self) -> bool:
        return self._get(self.actor.full.remote())

    def put(self, item: Any, block: bool = True, timeout: float | None = None) -> None:
        """Add ``item``; waits for room if ``block`` (up to ``timeout`` s), else raises Full."""
        if not block:
            if not self._get(self.actor.put_nowait.remote(item)):
                raise Full
            return
        if timeout is not None and timeout < 0:
            raise ValueError("'timeout' must be a non-negative number")
        if not self._get(self.actor.put.remote(item, timeout)):
            raise Full

    async def put_async(self, item: Any, block: bool = True, timeout: float | None = None) -> None:
        if not block:
            if not await self.actor.put_nowait.remote(item):
                raise Full
            return
        if timeout is not None and timeout < 0:
            raise ValueError("'timeout' must be a non-negative number")
        if not await self.actor.put.remote(item, timeout):
            raise Full

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        """Remove and return the first item; waits if ``block`` (up to ``timeout`` s), else
        raises Empty."""
        if not block:
            ok, item = self._get(self.actor.get_nowait.remote())
        else:
            if timeout is not None and timeout < 0:
                raise ValueError("'timeout' must be a non-negative number")
            ok, item = self._get(self.actor.get.remote(timeout))
        if not ok:
            raise Empty
        return item

    async def get_async(self, block: bool = True, timeout: float | None = None) -> Any:
        if not block:
            ok, item = await self.actor.get_nowait.remote()
        else:
            if timeout is not None and timeout < 0:
                raise ValueError("'timeout' must be a non-negative number")
            ok, item = await self.actor.get.remote(timeout)
        if not ok:
            raise Empty
        return item

    def put_nowait(self, item: Any) -> None:
        self.put(item, block=False)

    def put_nowait_batch(self, items: list) -> None:
        """Add all ``items`` at once, or raise Full and add none."""
        if not isinstance(items, Iterable):
            raise TypeError("Argument 'items' must be an Iterable")
        items = list(items)
        if not self._get(self.actor.put_nowait_batch.remote(items)):
            raise Full(f"Cannot add {len(items)} items to queue of size {self.size()} and "
                       f"maxsize {self.maxsize}.")

    def get_nowait(self) -> Any:
        return self.get(block=False)

    def get_nowait_batch(self, num_items: int) -> list:
        """Remove and return ``num_items`` items at once, or raise Empty and remove none."""
        if isinstance(num_items, bool) or not isinstance(num_items, int):
            raise TypeError("Argument 'num_items' must be an int")
        if num_items < 0:
            raise ValueError("'num_items' must be nonnegative")
        ok, items = self._get(self.actor.get_nowait_batch.remote(num_items))
        if not ok:
            raise Empty(f"Cannot get {num_items} items from queue of size {self.size()}.")
        return items

    def shutdown(self, force: bool = False, grace_period_s: int = 5) -> None:
        """End the queue's actor (its items are lost)."""
        from yrdask.ray.worker import kill

        if self.actor is not None:
            kill(self.actor)
        self.actor = None
