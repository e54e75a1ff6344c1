"""When the workers start their zygotes ahead of need (docs/isolation.md, "Process start").

A worker starts its zygote (the interpreter its process instances are forked from) on first
use, which costs that creation ~0.4 s.  A job that creates one process instance likely
creates more, across workers (Ray's nodes keep warm worker processes for actors), so from the
cluster's first placement of a process instance on, every worker is told to start its zygote
in the background (:class:`~yrdask.protocol.WarmZygote`), and so is each worker that registers
after.  Until then none is told: a cluster of tasks and light instances starts no zygote.
``yrdask.instances.warm-zygotes: false`` tells none.  The decisions only; the extension sends.
"""

from __future__ import annotations

from typing import Callable


class ZygoteWarming:
    """Which workers to tell :class:`~yrdask.protocol.WarmZygote`, and when: ``tell(worker)``
    sends it; each worker process is told once (a new process at an address registers
    anew)."""

    def __init__(self, tell: Callable[[str], None], enabled: bool = True) -> None:
        self.tell = tell
        self.enabled = enabled
        self.on = False  # a process instance was placed: every worker is told as it registers
        self.waiting: set[str] = set()  # registered workers not told yet (while off)

    def registered(self, worker: str) -> None:
        """``worker`` registered with yr (its agent handles the worker stream's ops)."""
        if self.on:
            self.tell(worker)
        elif self.enabled:
            self.waiting.add(worker)

    def removed(self, worker: str) -> None:
        self.waiting.discard(worker)

    def placed(self, spec: dict) -> None:
        """An instance of ``spec`` is started: the first process instance turns warming on."""
        if self.on or not self.enabled or spec.get("isolation") is None:
            return
        self.on = True
        waiting, self.waiting = self.waiting, set()
        for worker in sorted(waiting):
            self.tell(worker)
