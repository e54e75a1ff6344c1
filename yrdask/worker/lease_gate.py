"""Per-lease admission of pushed tasks on a worker: ``slots`` run at once, the rest wait briefly.

Submitters pipeline: with a backlog of short tasks, a lease may have a few more tasks pushed
than it may run, so the worker starts the next one the moment one ends instead of waiting a
round trip for it.  The gate holds the extra ones, but never for long:

* a task blocked in ``yr.get`` lends its slot (as it lends its CPU to the scheduler);
* a task that has waited ``patience_s`` is handed back (``BounceTask``): its submitter queues
  it again, for a lease that is free, and stops pipelining that shape.

So a wrong guess that tasks are short costs one round trip, never a deadlock between tasks
that wait for each other by other means (a file, an event, an instance) and never more
tasks running than the lease has slots (plus the ones that lent theirs).

:class:`LeaseGate` is a pure state machine (``yrdask/statemachine.py``, contract in
``docs/state-machines.md``): no lock, no loop, no clock.  The worker agent holds a lock
around :meth:`LeaseGate.handle` (task threads end tasks and lend slots), stamps events with
its loop's clock and turns ``WakeAt`` into ``loop.call_at``.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from yrdask.statemachine import Event, Instruction, Story, fast_init

PATIENCE_S = 0.05


# -- events ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TaskArrived(Event):
    """A task was pushed for ``lease_id``, which may run ``slots`` tasks at once."""

    task_id: str
    lease_id: str
    slots: int
    now: float


@dataclass(frozen=True, slots=True)
class TaskEnded(Event):
    """A started task ended (whatever its outcome)."""

    task_id: str


@dataclass(frozen=True, slots=True)
class SlotLent(Event):
    """A task of ``lease_id`` blocks in ``yr.get`` (``blocked``) or runs again."""

    lease_id: str
    blocked: bool


@dataclass(frozen=True, slots=True)
class Tick(Event):
    """A timer asked for with ``WakeAt`` fired (or time simply passed)."""

    now: float


# -- instructions ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StartTask(Instruction):
    """Run the task now."""

    task_id: str


@dataclass(frozen=True, slots=True)
class BounceTask(Instruction):
    """Hand the task back unrun (``TASK_DONE`` with ``requeue``); the gate forgot it."""

    task_id: str


@dataclass(frozen=True, slots=True)
class WakeAt(Instruction):
    """Send ``Tick(now)`` at or after ``at``."""

    at: float


# -- the machine -----------------------------------------------------------------------------


class _Lease:
    __slots__ = ("slots", "running", "blocked", "waiting")

    def __init__(self, slots: int) -> None:
        self.slots = slots
        self.running: set[str] = set()
        self.blocked = 0  # running tasks of the lease blocked in yr.get (slots lent)
        self.waiting: deque[tuple[float, str]] = deque()  # (deadline, task id), oldest first

    def free(self) -> bool:
        return len(self.running) - self.blocked < self.slots


class LeaseGate:
    """Admits pushed tasks per lease (see module docstring)."""

    def __init__(self, patience_s: float = PATIENCE_S, story_len: int = 10_000) -> None:
        self.patience_s = patience_s
        self.leases: dict[str, _Lease] = {}
        self.lease_of: dict[str, str] = {}  # task id (waiting or running) -> lease id
        self.next_wake: float | None = None  # earliest WakeAt not yet answered by a Tick
        self.story = Story(story_len)
        # the hot path appends flat tuples itself: (stimulus_id, name, *ids), one allocation
        # each, untracked by the collector (statemachine.Story)
        self._entries = self.story.entries
        # the last lease forgotten idle, reused for the next one (sequential tasks forget
        # and remake their lease once per task: no _Lease, set and deque per task)
        self._spare: _Lease | None = None

    # -- queries ---------------------------------------------------------------------------

    def queued(self) -> int:
        """Tasks waiting for a slot."""
        return len(self.lease_of) - self.running()

    def waits_after(self, task_id: str) -> bool:
        """Whether a task of ``task_id``'s lease waits for a slot (a read-only peek)."""
        lease_id = self.lease_of.get(task_id)
        lease = self.leases.get(lease_id) if lease_id is not None else None
        return lease is not None and bool(lease.waiting)

    def running(self) -> int:
        """Tasks started and not ended."""
        return sum(len(lease.running) for lease in self.leases.values())

    def active(self) -> int:
        """Tasks started, not ended and not blocked in ``yr.get`` (each uses a thread)."""
        return sum(len(lease.running) - lease.blocked for lease in self.leases.values())

    def story_of(self, *keys: str) -> list:
        """The story entries mentioning any task or lease id in ``keys``."""
        return self.story.about(*keys)

    # -- events ----------------------------------------------------------------------------

    def handle(self, event: Event) -> list[Instruction]:
        """Apply ``event``; returns what the adapter must do, in order."""
        kind = type(event)
        if kind is TaskArrived:
            return self.arrived(event.stimulus_id, event.task_id, event.lease_id, event.slots,
                                event.now)
        if kind is TaskEnded:
            return self.ended(event.stimulus_id, event.task_id)
        if kind is SlotLent:
            return self.lent(event.stimulus_id, event.lease_id, event.blocked)
        if kind is Tick:
            return self._tick(event)
        self.story.log(event.stimulus_id, ("unknown-event", type(event).__name__), ())
        return []

    # The hot path's events, by their fields: ``handle(TaskArrived(sid, ...))`` is
    # ``arrived(sid, ...)``, and so for ``TaskEnded`` and ``SlotLent``.  The task side calls
    # these directly (no event object per task); handle() is the one way in for the rest.

    def arrived(self, sid: str, task_id: str, lease_id: str, slots: int,
                now: float) -> list[Instruction]:
        """``TaskArrived`` (see :meth:`handle`)."""
        if task_id in self.lease_of:
            self.story.log(sid, ("duplicate-ignored", task_id, lease_id), (task_id, lease_id))
            return []
        lease = self.leases.get(lease_id)
        if lease is None:
            lease = self._spare
            if lease is None:
                lease = _Lease(slots)
            else:  # idle when kept: nothing running, blocked or waiting
                self._spare = None
                lease.slots = slots
            self.leases[lease_id] = lease
        self.lease_of[task_id] = lease_id
        running = lease.running
        if not lease.waiting and len(running) - lease.blocked < lease.slots:  # free()
            running.add(task_id)
            # one entry for the common case (the hot path): it arrived and started at once
            self._entries.append((sid, "arrived-start", task_id, lease_id))
            return [StartTask(sid, task_id)]
        deadline = now + self.patience_s
        lease.waiting.append((deadline, task_id))
        # one entry (pipelined tasks wait here on the hot path): it arrived and waits
        self._entries.append((sid, ("arrived-wait", task_id, lease_id, deadline),
                              (task_id, lease_id)))
        next_wake = self.next_wake  # _wake, inline
        if next_wake is not None and next_wake <= deadline:
            return []
        self.next_wake = deadline
        return [WakeAt(sid, deadline)]

    def ended(self, sid: str, task_id: str) -> list[Instruction]:
        """``TaskEnded`` (see :meth:`handle`)."""
        lease_id = self.lease_of.get(task_id)
        lease = self.leases.get(lease_id) if lease_id is not None else None
        if lease is None or task_id not in lease.running:
            self.story.log(sid, ("end-ignored", task_id), (task_id,))
            return []
        lease.running.discard(task_id)
        del self.lease_of[task_id]
        if lease.blocked > len(lease.running):  # a blocked task ended without unblocking
            lease.blocked = len(lease.running)
        self._entries.append((sid, "ended", task_id, lease_id))
        if lease.waiting:
            return self._admit(sid, lease_id, lease)
        if not lease.running:  # _forget_if_idle, inline (the hot path)
            del self.leases[lease_id]
            self._spare = lease  # idle: blocked is 0 (at most len(running), above)
        return []

    def lent(self, sid: str, lease_id: str, blocked: bool) -> list[Instruction]:
        """``SlotLent`` (see :meth:`handle`)."""
        lease = self.leases.get(lease_id)
        if lease is None:  # an instance's holding, or a lease with nothing here any more
            return []
        if blocked:
            if lease.blocked >= len(lease.running):
                self.story.log(sid, ("lend-ignored", lease_id), (lease_id,))
                return []
            lease.blocked += 1
        else:
            if lease.blocked <= 0:
                self.story.log(sid, ("unlend-ignored", lease_id), (lease_id,))
                return []
            lease.blocked -= 1
        self._entries.append((sid, "lent" if blocked else "unlent", lease_id, lease.blocked))
        if blocked and lease.waiting:  # else _admit has nobody to start
            return self._admit(sid, lease_id, lease)
        return []

    def _tick(self, ev: Tick) -> list[Instruction]:
        self.next_wake = None  # the timer that brought this Tick is spent
        out: list[Instruction] = []
        for lease_id, lease in list(self.leases.items()):
            waiting = lease.waiting
            while waiting and waiting[0][0] <= ev.now:
                _, task_id = waiting.popleft()
                del self.lease_of[task_id]
                self.story.log(ev.stimulus_id, ("bounce", task_id), (task_id, lease_id))
                out.append(BounceTask(ev.stimulus_id, task_id))
            self._forget_if_idle(lease_id, lease)
        earliest = min((lease.waiting[0][0] for lease in self.leases.values() if lease.waiting),
                       default=None)
        if earliest is not None:
            out.extend(self._wake(ev.stimulus_id, earliest))
        return out

    # -- helpers ---------------------------------------------------------------------------

    def _admit(self, stimulus_id: str, lease_id: str, lease: _Lease) -> list[Instruction]:
        out: list[Instruction] = []
        waiting, running, slots = lease.waiting, lease.running, lease.slots
        while waiting and len(running) - lease.blocked < slots:  # free(), inline
            _, task_id = waiting.popleft()
            running.add(task_id)
            self._entries.append((stimulus_id, "start", task_id, lease_id))
            out.append(StartTask(stimulus_id, task_id))
        return out

    def _wake(self, stimulus_id: str, at: float) -> list[Instruction]:
        if self.next_wake is not None and self.next_wake <= at:
            return []
        self.next_wake = at
        return [WakeAt(stimulus_id, at)]

    def _forget_if_idle(self, lease_id: str, lease: _Lease) -> None:
        if not lease.running and not lease.waiting:
            del self.leases[lease_id]

    # -- invariants ------------------------------------------------------------------------

    def validate(self) -> None:
        """Check the gate's invariants (the simulation calls this after every step)."""
        seen: dict[str, str] = {}
        for lease_id, lease in self.leases.items():
            assert lease.running or lease.waiting, f"idle lease {lease_id} kept"
            assert 0 <= lease.blocked <= len(lease.running), (lease_id, lease.blocked)
            assert not lease.waiting or not lease.free(), \
                f"lease {lease_id} has a free slot while tasks wait"
            deadlines = [d for d, _ in lease.waiting]
            assert deadlines == sorted(deadlines), f"lease {lease_id} waiting out of order"
            for task_id in [t for _, t in lease.waiting] + list(lease.running):
                assert task_id not in seen, f"task {task_id} twice in the gate"
                seen[task_id] = lease_id
            if lease.waiting:
                assert self.next_wake is not None and self.next_wake <= lease.waiting[0][0], \
                    f"lease {lease_id} has waiting tasks and no timer"
        assert seen == self.lease_of, "lease_of disagrees with the leases"

# built per task on the hot path: slots written directly (statemachine.fast_init)
fast_init(*[c for c in list(globals().values())
            if isinstance(c, type) and issubclass(c, (Event, Instruction))])
