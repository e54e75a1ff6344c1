"""Which calls of one hosted instance run now: hosting's dispatch decisions, apart from its
executors.

Rules: no call starts before ``__init__`` has finished (:meth:`CallQueue.constructed`);
calls start in arrival order (from one caller they arrive in the order it sent them, so
they start in that order), at most ``concurrency`` at a time (1: one after the other); a
stopped instance starts nothing more.  It does no I/O and keeps no clock: the caller
(``worker/hosting.py``: a thread, a thread pool or an event loop runs what it says to
start; the simulation, ``tests/sim/calls.py``: its virtual executors) holds a lock around
it where several threads use it.  Items are opaque (jobs in production, call ids in the
simulation).
"""

from __future__ import annotations

from collections import deque
from typing import Any


class CallQueue:
    """See module docstring."""

    __slots__ = ("concurrency", "ready", "stopped", "running", "waiting")

    def __init__(self, concurrency: int) -> None:
        if concurrency < 1:
            raise ValueError(f"concurrency must be at least 1, got {concurrency}")
        self.concurrency = concurrency
        self.ready = False  # __init__ has finished
        self.stopped = False
        self.running = 0
        self.waiting: deque = deque()

    def arrived(self, item: Any) -> bool:
        """A call arrived: True if it starts now (the caller runs it), else it waits."""
        if self.stopped:
            return False
        if self.ready and self.running < self.concurrency and not self.waiting:
            self.running += 1
            return True
        self.waiting.append(item)
        return False

    def constructed(self) -> list:
        """``__init__`` finished (or failed: calls then answer its error): what starts now,
        in arrival order."""
        self.ready = True
        return self._starts()

    def finished(self) -> Any:
        """A started call finished: the next one to start in its place, or None."""
        self.running -= 1
        if self.waiting and self.ready and not self.stopped:
            self.running += 1
            return self.waiting.popleft()
        return None

    def take(self, pick: Any) -> list:
        """Remove the waiting calls ``pick(item)`` selects and return them, in arrival order
        (before ``__init__`` finished: calls that an executor of their own runs, outside
        this queue's concurrency, such as Ray's concurrency groups)."""
        out = [item for item in self.waiting if pick(item)]
        if out:
            self.waiting = deque(item for item in self.waiting if not pick(item))
        return out

    def stop(self) -> list:
        """The instance stopped: the calls that never started (they are answered as the
        instance's death); nothing starts any more."""
        self.stopped = True
        left = list(self.waiting)
        self.waiting.clear()
        return left

    def _starts(self) -> list:
        out = []
        while self.waiting and self.running < self.concurrency and not self.stopped:
            self.running += 1
            out.append(self.waiting.popleft())
        return out

    def validate(self) -> None:
        assert 0 <= self.running <= self.concurrency, (self.running, self.concurrency)
        assert self.ready or self.running == 0, "a call runs before __init__ finished"
        assert not (self.stopped and self.waiting), "a stopped instance keeps calls waiting"
        if self.ready and not self.stopped:
            assert not self.waiting or self.running == self.concurrency, (
                "calls wait while a slot is free")
