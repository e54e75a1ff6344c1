"""The calls of one isolated instance, seen from its worker's agent: what is decided, apart
from the I/O (``worker/isolated/supervisor.py``'s :class:`~yrdask.worker.isolated.supervisor.IsolatedInstance`
runs the process, the channel and the replies; the simulation, ``tests/sim/isolated.py``,
drives this same class on virtual processes).

Rules (``docs/isolation.md``):

* A call is forwarded to the instance's child process once the child is up and its channel
  open; until then it waits, in arrival order.  If no child could be started at all (the
  spawn failed before a process existed), the calls answer that error.  A stopped instance
  answers every call with its end.
* The forwarded calls not answered yet are *pending*, in the order they were forwarded (the
  order the child received them, and so started them: ``worker/call_queue.py``).
* The child died: nothing is decided here but that it died (the scheduler's ``Lifecycle``
  owns the one restart budget: the agent reports ``RESTARTING``); calls keep waiting.
* ``START_INSTANCE`` again (restart ``incarnation``, granted by the scheduler): the pending
  calls are charged by the one rule of ``runtime/call_order.py``
  (:func:`~yrdask.runtime.call_order.charge_crash`: the oldest ``concurrency`` of them may
  have been running); those past the bound fail with ``CallCrashedError``, the rest go to
  the new child first, in order, then the calls that arrived meanwhile.  The crash counts
  live as long as this object (the instance on this worker, across its child processes);
  a lost worker is charged by each caller's ``CallOrder`` instead.
* A stop answers every call not answered yet, pending or waiting.
"""

from __future__ import annotations

from typing import Any, Callable

from yrdask.runtime.call_order import charge_crash

FORWARD = "forward"  # send it to the child now
WAIT = "wait"  # it waits for a child (kept here)
START_FAILED = "start-failed"  # answer it with the error of the start that failed
ENDED = "ended"  # answer it with the instance's end (``stopped``)


class IsolatedCalls:
    """See module docstring.  Items are opaque (``(peer, msg)`` in production, call ids in
    the simulation); calls are named by their ids."""

    __slots__ = ("instance_id", "concurrency", "incarnation", "pending", "waiting",
                 "crashes", "connected", "start_failed", "died", "stopped")

    def __init__(self, instance_id: str, concurrency: int, incarnation: int = 0) -> None:
        self.instance_id = instance_id
        self.concurrency = concurrency  # as the child's CallQueue runs them (< 1: no bound)
        self.incarnation = incarnation  # the restart the scheduler granted last
        self.pending: dict[str, Any] = {}  # forwarded to the child, not answered, in order
        self.waiting: list[tuple[str, Any]] = []  # for a child, in order
        self.crashes: dict[str, int] = {}  # call id -> times it may have been running at a death
        self.connected = False  # a child is up, its channel open
        self.start_failed = False  # no child could be started: calls answer that error
        self.died: str | None = None  # the child died (why), until a restart or a stop
        self.stopped: str | None = None  # the instance ended (why)

    def arrived(self, call_id: str, item: Any) -> str:
        """``CALL_METHOD``: :data:`FORWARD` (now pending), :data:`WAIT` (kept), or answer it
        (:data:`START_FAILED`, :data:`ENDED`)."""
        if self.stopped is not None:
            return ENDED
        if not self.connected:
            if self.start_failed and self.died is None:
                return START_FAILED
            self.waiting.append((call_id, item))
            return WAIT
        self.pending[call_id] = item
        return FORWARD

    def connect(self) -> list[tuple[str, Any]]:
        """A child is up and its channel open (its ``__init__`` ran, or raised: the child
        answers each call with that error): the calls to forward now, in order."""
        self.connected, self.start_failed = True, False
        waiting, self.waiting = self.waiting, []
        for call_id, item in waiting:
            self.pending[call_id] = item
        return waiting

    def start_failed_now(self) -> list[tuple[str, Any]]:
        """No child could be started (no process existed): the calls that waited answer the
        error, as will later ones."""
        self.start_failed = True
        waiting, self.waiting = self.waiting, []
        return waiting

    def answered(self, call_id: str) -> Any:
        """The child answered ``call_id``: its item (``None``: not pending, drop it)."""
        item = self.pending.pop(call_id, None)
        if item is not None:
            self.crashes.pop(call_id, None)
        return item

    def child_died(self, cause: str) -> bool:
        """The child died: True if the scheduler is to be told (``RESTARTING``)."""
        if self.stopped is not None or self.died is not None:
            return False
        self.connected, self.died = False, cause
        return True

    def restart(self, incarnation: int, bound: "int | Callable[[Any], int]"
                ) -> tuple[list[tuple[str, Any]], list[tuple[str, Any, int]]] | None:
        """``START_INSTANCE`` for restart ``incarnation`` after the child died: ``(calls
        delivered again, in order; (call id, item, crashes) to fail)``, the ones to deliver
        now waiting for the new child in front of the others.  ``None``: not dead (or
        stopped), ignore it.  ``bound``: the redeliveries a call may have, or a function of
        its item that says them (a method's own bound, Ray's ``max_task_retries``)."""
        if self.stopped is not None or self.died is None:
            return None
        self.died = None
        self.incarnation = max(incarnation, self.incarnation + 1)
        crashes = self.crashes

        def charge(entry: tuple[str, Any]) -> int:
            n = crashes[entry[0]] = crashes.get(entry[0], 0) + 1
            return n

        pending, self.pending = list(self.pending.items()), {}
        bound_of = bound if callable(bound) else (lambda _item: bound)
        resend, failed = charge_crash(pending, self.concurrency, charge,
                                      lambda entry: bound_of(entry[1]))
        for (call_id, _item), _n in failed:
            del crashes[call_id]
        self.waiting = resend + self.waiting
        return resend, [(cid, item, n) for (cid, item), n in failed]

    def cancel_waiting(self, call_id: str) -> Any:
        """A cancel of a call that waits for the (re)started child: its item, no longer
        waiting (it is answered unrun); ``None`` if it does not wait here."""
        for i, (cid, item) in enumerate(self.waiting):
            if cid == call_id:
                del self.waiting[i]
                return item
        return None

    def stop(self, reason: str) -> list[tuple[str, Any]]:
        """The instance ends: every call not answered yet, to answer with ``reason``."""
        if self.stopped is not None:
            return []
        self.stopped, self.connected = reason, False
        calls = [*self.pending.items(), *self.waiting]
        self.pending, self.waiting, self.crashes = {}, [], {}
        return calls

    def validate(self) -> None:
        """The invariants (the simulation checks them after every step)."""
        waiting = [cid for cid, _ in self.waiting]
        assert len(set(waiting)) == len(waiting), f"{self.instance_id}: a call waits twice"
        both = set(waiting) & set(self.pending)
        assert not both, f"{self.instance_id}: calls both pending and waiting: {sorted(both)}"
        if self.stopped is not None:
            assert not self.pending and not self.waiting and not self.connected, \
                f"{self.instance_id} ended with calls"
        if not self.connected:
            assert not self.pending or self.died is not None, \
                f"{self.instance_id}: calls pending with no child"
        else:
            assert not self.waiting, f"{self.instance_id}: calls wait with a child up"
            assert self.died is None, f"{self.instance_id}: connected and dead"
        assert set(self.crashes) <= set(self.pending) | set(waiting), \
            f"{self.instance_id}: crash counts of calls it does not hold"
