"""Per-lease admission of pushed tasks on a worker: ``slots`` run at once, the rest wait briefly.

Submitters pipeline: with a backlog of short tasks, a lease may have a few more tasks pushed
than it may run, so the worker starts the next one the moment one ends instead of waiting a
round trip for it.  The gate holds the extra ones, but never for long:

* a task blocked in ``yr.get`` lends its slot (as it lends its CPU to the scheduler);
* a task that has waited ``patience_s`` is handed back (``bounce``): its submitter queues it
  again, for a lease that is free, and stops pipelining that shape.

So a wrong guess that tasks are short costs one round trip, never a deadlock between tasks
that wait for each other by other means (a file, an event, an instance) and never more
tasks running than the lease has slots.  Thread-safe: pushes and timers run on the loop,
tasks end on executor threads.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from typing import Any, Callable

PATIENCE_S = 0.05


class _Lease:
    __slots__ = ("slots", "running", "blocked", "waiting", "timer")

    def __init__(self, slots: int) -> None:
        self.slots = slots
        self.running = 0
        self.blocked = 0
        self.waiting: deque = deque()  # (enqueued at, item)
        self.timer: asyncio.TimerHandle | None = None


class LeaseGate:
    """Admits pushed tasks per lease and starts them with ``start(item)``."""

    def __init__(self, start: Callable[[Any], None], bounce: Callable[[Any], None],
                 loop: asyncio.AbstractEventLoop, patience_s: float = PATIENCE_S) -> None:
        self.start = start
        self.bounce = bounce
        self.loop = loop
        self.patience_s = patience_s
        self.leases: dict[str, _Lease] = {}
        self.lock = threading.Lock()

    def push(self, lease_id: str, slots: int, item: Any) -> None:
        """A task arrived for a lease (loop thread)."""
        with self.lock:
            lease = self.leases.get(lease_id)
            if lease is None:
                lease = self.leases[lease_id] = _Lease(slots)
            lease.waiting.append((time.monotonic(), item))
            ready = self._admit(lease)
            if lease.waiting and lease.timer is None:
                lease.timer = self.loop.call_later(self.patience_s, self._expire, lease_id)
        self._run(ready)

    def done(self, lease_id: str) -> None:
        """A task of the lease ended: start the next one waiting."""
        with self.lock:
            lease = self.leases.get(lease_id)
            if lease is None:
                return
            lease.running -= 1
            ready = self._admit(lease)
            if lease.running <= 0 and not lease.waiting:
                del self.leases[lease_id]
        self._run(ready)

    def blocked(self, lease_id: str, blocked: bool) -> None:
        """A task of the lease waits in ``yr.get`` (or runs again): its slot is lent."""
        with self.lock:
            lease = self.leases.get(lease_id)
            if lease is None:
                return
            lease.blocked += 1 if blocked else -1
            ready = self._admit(lease)
        self._run(ready)

    def queued(self) -> int:
        return sum(len(lease.waiting) for lease in self.leases.values())

    def _expire(self, lease_id: str) -> None:
        """Hand back the tasks that waited too long (loop thread)."""
        late = []
        with self.lock:
            lease = self.leases.get(lease_id)
            if lease is None:
                return
            lease.timer = None
            cutoff = time.monotonic() - self.patience_s
            while lease.waiting and lease.waiting[0][0] <= cutoff:
                late.append(lease.waiting.popleft()[1])
            if lease.waiting:
                wait = lease.waiting[0][0] + self.patience_s - time.monotonic()
                lease.timer = self.loop.call_later(max(0.0, wait), self._expire, lease_id)
            elif lease.running <= 0:
                del self.leases[lease_id]
        for item in late:
            self.bounce(item)

    def _run(self, items: list) -> None:
        for item in items:
            self.start(item)

    @staticmethod
    def _admit(lease: _Lease) -> list:
        ready = []
        while lease.waiting and lease.running - lease.blocked < lease.slots:
            lease.running += 1
            ready.append(lease.waiting.popleft()[1])
        return ready
