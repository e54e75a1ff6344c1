"""The submitter's rules as a pure state machine: shape queues, leases, pushes, retries.

One :class:`SubmitQueue` per process (driver or worker).  How a task travels:

1. The adapter (``runtime/submitter.py``) waits for a task's owned ref arguments, then says
   :class:`TaskQueued`; the task joins the queue of its *key* (resources, schedule timeout,
   concurrency, affinity: tasks that may share a lease).
2. A queue with tasks and no lease that can take them asks for leases (:class:`RequestLease`),
   up to ``max_pending_requests`` outstanding per queue.  A lease is the right to run
   ``slots`` tasks of that key at once on one worker.
3. A lease with a free slot takes the queue's next task (:class:`PushTask`).  Short tasks
   (the queue's moving average of ``took`` at most ``pipeline_below_s``) are *pipelined*
   when there is a backlog: up to ``pipeline_depth`` tasks per slot are pushed at once and
   the worker's lease gate starts each as the previous ends.  A pipelined lease takes more
   only once it has room for ``pipeline_refill`` tasks (or a free slot): with many workers,
   each refill then carries several tasks in one message instead of one task per message.
4. A lease idle for ``lease_idle_s`` goes back (:class:`ReturnLeases`), and at once when the
   scheduler revokes it: an idle one at once, a busy one after the task it runs.  A revoke
   with ``keep`` (the scheduler sends it for a waiter whose queue runs already) lets a busy
   lease be *kept* a while: it goes on taking its queue's tasks until it runs out of them
   (then it goes back at once) or until ``keep_revoked_s`` has passed since the revoke (0:
   never kept), as Ray's owner keeps a leased worker for its backlog until the lease
   expires; a plain revoke of a kept lease ends the keeping.  Queues that all have a
   backlog and all wait for more leases (nested fan-out: every parent's children queue)
   therefore do not trade their leases after every task, each trade leaving a CPU idle for
   a round trip through the scheduler, while a waiter still gets a lease within a bound.
5. A queue that *drains* (no task queued and none running on its leases) while lease
   requests of it are unanswered withdraws them (:class:`WithdrawRequests`): they would
   only be granted later and returned at once, a CPU held away from the queues that wait
   meanwhile (and their revokes taking others' leases).  Only a drained queue withdraws: a
   queue whose tasks still run may be refilled (requeues, retries, the rest of a burst), so
   a burst does not withdraw and ask again.  A grant that crosses the withdraw is kept if
   its queue has tasks again, else returned at once.
6. A lost worker voids its leases: its tasks go back to the front of their queues (not counted
   against ``retries``) at most ``max_crash_retries`` times each (or their own ``max_crashes``),
   except that a task without its own bound (yr's) whose process crashed by its own hand
   (``WorkerLost.crashed``: openYuanrong's "core dump") spends one of its ``retries`` and fails
   with none left; lease requests avoid it
   for ``avoid_lost_s``, or until a new process registers at its address
   (:class:`WorkerJoined`: the requests sent meanwhile are withdrawn and asked again).  A user exception reruns a task while its ``retries`` last; a task
   the worker's gate handed back unrun (``"requeue"``) is queued again and its queue stops
   pipelining.

Invariants (checked by :meth:`SubmitQueue.validate`, enforced at the end of every
:meth:`SubmitQueue.handle`): every queued task is settled exactly once; a queue with tasks has
a lease that can take one (not revoked) or an outstanding request, so nothing stalls; no
queued task waits while a lease of its queue has a free slot.  No I/O, no clock, no asyncio:
the contract is in ``docs/state-machines.md``.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

from yrdask.errors import CancelledError, ScheduleError, TaskCrashedError
from yrdask.statemachine import Event, Instruction, Story, fast_init, remember

# -- events ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TaskQueued(Event):
    """A task whose owned ref arguments are ready; ``key`` groups tasks that share leases."""

    task_id: str
    key: Any
    shape: dict
    timeout_ms: int
    slots: int
    affinity: tuple
    retries: int
    data_home: str | None
    name: str
    max_crashes: int | None = None  # reruns after a lost worker; None: the queue's bound, -1: no bound


@dataclass(frozen=True, slots=True)
class LeaseGranted(Event):
    """The scheduler's grant of a :class:`RequestLease`."""

    request_id: str
    lease_id: str
    worker: str
    now: float


@dataclass(frozen=True, slots=True)
class LeaseRefused(Event):
    """No worker could meet a :class:`RequestLease` in time, or the request failed."""

    request_id: str
    reason: str


@dataclass(frozen=True, slots=True)
class TaskFinished(Event):
    """``TASK_DONE`` of a pushed task: ``outcome`` is ``"ok"``, ``"error"`` (final),
    ``"retryable"`` (a user exception ``retries`` may rerun) or ``"requeue"`` (handed back
    unrun); ``error`` is the opaque error of the two error outcomes."""

    task_id: str
    outcome: str
    took: float | None
    error: Any
    now: float


@dataclass(frozen=True, slots=True)
class CancelRequested(Event):
    """``yr.cancel`` of the task (``force``: end the worker process running it;
    ``recursive``: its worker cancels the tasks it submitted too)."""

    task_id: str
    force: bool = False
    recursive: bool = False


@dataclass(frozen=True, slots=True)
class LeasesRevoked(Event):
    """The scheduler wants these leases back; ``keep``: a busy one may run its queue's
    backlog first, for up to ``keep_revoked_s`` (rule 4)."""

    lease_ids: tuple
    keep: bool = False


@dataclass(frozen=True, slots=True)
class WorkerLost(Event):
    """The channel to ``worker`` broke, or the scheduler said it is gone.  ``crashed``: its
    process crashed by its own hand (an exit code, a core-dump signal: see
    :func:`yrdask.errors.crashed_by_itself`), which yr's tasks count against ``retries``."""

    worker: str
    now: float
    crashed: bool = False


@dataclass(frozen=True, slots=True)
class WorkerJoined(Event):
    """A new process registered at the address of a lost ``worker`` (the scheduler said so):
    requests stop avoiding it."""

    worker: str
    now: float


@dataclass(frozen=True, slots=True)
class Tick(Event):
    """Time passed (a :class:`WakeAt` fired, maybe early)."""

    now: float


@dataclass(frozen=True, slots=True)
class Closing(Event):
    """The runtime ends: leases go back, later grants are returned at once."""


# -- instructions ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RequestLease(Instruction):
    """Ask the scheduler for a lease; answer with :class:`LeaseGranted` or
    :class:`LeaseRefused`."""

    request_id: str
    queue: str
    shape: dict
    timeout_ms: int
    near: str | None
    avoid: tuple
    affinity: tuple


@dataclass(frozen=True, slots=True)
class PushTask(Instruction):
    """Send ``RUN_TASK`` for the task to ``worker`` under ``lease_id``."""

    task_id: str
    lease_id: str
    worker: str
    slots: int


@dataclass(frozen=True, slots=True)
class SendCancel(Instruction):
    """Send ``CANCEL_TASK`` to the worker running the task."""

    task_id: str
    worker: str
    force: bool = False
    recursive: bool = False


@dataclass(frozen=True, slots=True)
class ReturnLeases(Instruction):
    """Give these leases back to the scheduler (``RETURN_LEASES``)."""

    lease_ids: tuple


@dataclass(frozen=True, slots=True)
class WithdrawRequests(Instruction):
    """The queue of these unanswered :class:`RequestLease` drained: withdraw them
    (``WITHDRAW_LEASE_REQUESTS``).  Each is still answered, a refusal or a crossing grant."""

    request_ids: tuple


@dataclass(frozen=True, slots=True)
class TaskSucceeded(Instruction):
    """Settle the task's refs with the results of its ``TASK_DONE``."""

    task_id: str


@dataclass(frozen=True, slots=True)
class TaskFailed(Instruction):
    """Settle the task's refs with ``error`` (an exception object, or the opaque error of
    its ``TASK_DONE``)."""

    task_id: str
    error: Any


@dataclass(frozen=True, slots=True)
class WakeAt(Instruction):
    """Call ``handle(Tick(now))`` at or after ``at``."""

    at: float


# -- state -----------------------------------------------------------------------------------

QUEUED, PUSHED = "queued", "pushed"
EARLY_REVOKES = 256  # revokes of unknown leases remembered for a grant that comes after


class _Task:
    """What the machine knows of one task: ids, counters and where it is."""

    __slots__ = ("task_id", "key", "q", "name", "data_home", "retries_left", "crashes",
                 "state", "lease", "settled", "runs", "max_crashes", "seq", "retries_initial")

    def __init__(self, ev: TaskQueued, q: "_Queue") -> None:
        self.task_id = ev.task_id
        self.key = ev.key
        self.q = q  # its queue (a key of nested tuples is slow to hash on the hot path)
        self.name = ev.name
        self.data_home = ev.data_home
        self.retries_left = self.retries_initial = ev.retries
        self.crashes = 0
        self.max_crashes = ev.max_crashes
        self.state = QUEUED
        self.lease: _Lease | None = None
        self.settled = False  # settled while pushed (cancelled): waits for its TASK_DONE
        self.runs = 0  # pushes so far


class _Lease:
    """The right to run ``slots`` tasks of one queue at once on ``worker``."""

    __slots__ = ("lease_id", "worker", "key", "q", "slots", "tasks", "idle_since", "revoked",
                 "kept_until")

    def __init__(self, lease_id: str, worker: str, q: "_Queue", slots: int, now: float) -> None:
        self.lease_id = lease_id
        self.worker = worker
        self.key = q.key
        self.q = q
        self.slots = slots
        self.tasks: dict[str, _Task] = {}  # pushed, in push order
        self.idle_since = now
        self.revoked = False
        # revoked while busy: kept (usable) until it runs out of tasks or this time passes,
        # then returned; None: not revoked so
        self.kept_until: float | None = None


class _Queue:
    """The tasks of one key waiting for a lease, its leases and its outstanding requests."""

    __slots__ = ("key", "name", "shape", "timeout_ms", "slots", "affinity", "tasks", "leases",
                 "free", "requests", "avg_s", "backoff")

    def __init__(self, ev: TaskQueued, name: str) -> None:
        self.key = ev.key
        self.name = name
        self.shape = ev.shape
        self.timeout_ms = ev.timeout_ms
        self.slots = max(1, ev.slots)
        self.affinity = ev.affinity
        self.tasks: deque[_Task] = deque()
        self.leases: dict[str, _Lease] = {}  # every lease of the queue, revoked ones too
        self.free: dict[str, _Lease] = {}  # unrevoked leases with a free slot
        self.requests: set[str] = set()  # outstanding RequestLease ids
        self.avg_s: float | None = None  # moving average of its tasks' run time
        self.backoff = False  # refused while others serve it: ask again on new work only


# -- the machine -----------------------------------------------------------------------------


class SubmitQueue:
    """Per-process task submission rules (see module docstring)."""

    #: a finish with a backlog refills its own lease instead of dispatching the whole queue
    #: (the same pushes: tests/unit/test_hot_paths.py checks it against the general path)
    refill_shortcut = True

    def __init__(self, local_worker: str | None, *, max_pending_requests: int = 4,
                 pipeline_depth: int = 4, pipeline_below_s: float = 0.005,
                 pipeline_refill: int = 1, lease_idle_s: float = 1.0,
                 avoid_lost_s: float = 30.0, max_crash_retries: int = 3,
                 keep_revoked_s: float = 0.5, story_len: int = 20_000) -> None:
        self.local_worker = local_worker
        self.max_pending_requests = max(1, max_pending_requests)
        self.pipeline_depth = max(1, pipeline_depth)
        self.pipeline_refill = max(1, pipeline_refill)
        self.pipeline_below_s = pipeline_below_s
        self.lease_idle_s = lease_idle_s
        self.keep_revoked_s = keep_revoked_s
        self.avoid_lost_s = avoid_lost_s
        self.max_crash_retries = max_crash_retries
        self.tasks: dict[str, _Task] = {}  # queued or pushed, not yet forgotten
        self.queues: dict[Any, _Queue] = {}
        self.leases: dict[str, _Lease] = {}
        self.requests: dict[str, _Queue] = {}  # outstanding request id -> its queue
        self.withdrawn: dict[str, _Queue] = {}  # withdrawn, not answered yet -> its queue
        self.lost: dict[str, float] = {}  # worker -> until when requests avoid it
        self.counts = {"local": 0, "forwarded": 0, "lease_requests": 0}
        self.now = 0.0  # the latest time an event carried
        self.next_wake: float | None = None  # earliest WakeAt not yet answered by a Tick
        self.closed = False
        self._ids = 0
        self._seq = 0  # tasks queued so far (their submission order)
        self._dirty: dict[Any, _Queue] = {}  # queues to dispatch before handle returns
        self._idle: list[_Lease] = []  # leases left without tasks: a timer if they stay so
        # revokes of leases not granted yet (the revoke came on the scheduler's stream before
        # the grant's reply), applied when the grant comes; the latest EARLY_REVOKES kept
        self.early_revokes: dict[str, bool] = {}  # lease id -> keep
        self._revoke_granted: list[tuple] = []  # (lease id, keep) granted in this event
        self._out: list = []
        self._sid = ""
        self.log = Story(story_len, keys_of=_event_keys)
        self._entries = self.log.entries  # appended to directly: the hot path

    # -- queries ---------------------------------------------------------------------------

    def story(self, *keys: str) -> list[tuple[str, tuple]]:
        """What happened to these tasks, leases or requests: ``(stimulus_id, what)`` rows."""
        return self.log.about(*keys)

    def figures(self) -> dict:
        """Tasks pushed to this process's own worker vs elsewhere, and what is in flight."""
        queued = sum(len(q.tasks) for q in self.queues.values())
        return {**self.counts, "queued": queued,
                "running": sum(len(l.tasks) for l in self.leases.values()),
                "leases": len(self.leases)}

    # -- events ----------------------------------------------------------------------------

    def handle(self, ev: Event) -> list[Instruction]:
        """Apply one event; returns what the adapter must do, in order."""
        out: list[Instruction] = []
        self._out = out
        self._sid = ev.stimulus_id
        handler = _HANDLERS.get(type(ev))
        if handler is None:
            self.log.log(ev.stimulus_id, ("ignored: unknown event", ev), ())
            return out
        kind = type(ev)
        # The story keeps the events every task has as flat tuples of strings (Story), which
        # the garbage collector stops tracking: kept as objects they stay tracked for the
        # story's whole length and lengthen every full collection.  The rarer events stay
        # bare, their keys worked out when the story is read.
        if kind is TaskQueued:
            self._entries.append((ev.stimulus_id, "TaskQueued", ev.task_id))
        elif kind is TaskFinished and ev.outcome == "ok":
            self._entries.append((ev.stimulus_id, "TaskFinished ok", ev.task_id))
        else:
            self._entries.append(ev)
        if self.closed and kind is not LeaseGranted:
            self._note("ignored: closed")
            return out
        handler(self, ev)
        if self._dirty:
            dirty = self._dirty
            self._dirty = {}
            for q in dirty.values():
                self._dispatch(q)
        if self._revoke_granted:  # after the dispatch: a busy lease may be kept
            early = tuple(self._revoke_granted)
            self._revoke_granted.clear()
            for lease_id, keep in early:
                self._revoke_ids((lease_id,), keep)
            dirty = self._dirty
            self._dirty = {}
            for q in dirty.values():
                self._dispatch(q)
        if self._idle:
            for lease in self._idle:
                if not lease.tasks and lease.lease_id in self.leases:
                    if lease.kept_until is not None:  # kept until it ran out of tasks
                        self._revoke(lease)
                    else:
                        self._arm_at(lease.idle_since + self.lease_idle_s)
            self._idle.clear()
        return out

    def _task_queued(self, ev: TaskQueued) -> None:
        if ev.task_id in self.tasks:
            self._note("ignored: task already queued", ev.task_id)
            return
        q = self.queues.get(ev.key)
        if q is None:
            q = self.queues[ev.key] = _Queue(ev, f"q{len(self.queues)}")
        task = self.tasks[ev.task_id] = _Task(ev, q)
        task.seq = self._seq = self._seq + 1  # submission order, kept by _requeue
        tasks = q.tasks
        q.backoff = False
        if tasks:
            # a backlog already: the last dispatch left no lease with room (it stops only
            # when the tasks run out), and nothing changed since but the backlog's size
            tasks.append(task)
            if len(q.requests) < self.max_pending_requests:  # else _ask wants none
                self._ask(q, tasks)
            return
        tasks.append(task)
        self._dirty[q.name] = q

    def _lease_granted(self, ev: LeaseGranted) -> None:
        self._clock(ev.now)
        q = self.requests.pop(ev.request_id, None)
        if q is not None:
            q.requests.discard(ev.request_id)
        else:
            q = self.withdrawn.pop(ev.request_id, None)
            if q is None:
                if self.closed:
                    self._emit(ReturnLeases(self._sid, (ev.lease_id,)), ev.lease_id)
                else:
                    self._note("ignored: not an outstanding request", ev.request_id,
                               ev.lease_id)
                return
            # the grant crossed the withdraw: kept if the queue has tasks again (below)
            self._note("granted after its withdraw", ev.request_id, ev.lease_id)
        q.backoff = False
        if self.closed:
            self._emit(ReturnLeases(self._sid, (ev.lease_id,)), ev.lease_id)
            return
        if ev.lease_id in self.leases:  # granted twice: the one it has stays
            self._note("ignored: lease already held", ev.request_id, ev.lease_id)
            self._dirty[q.name] = q
            return
        if not q.tasks or self._avoided(ev.worker):
            # the backlog went elsewhere meanwhile (don't sit on resources), or the worker
            # was just lost and the scheduler may not know yet
            self._emit(ReturnLeases(self._sid, (ev.lease_id,)), ev.lease_id, ev.request_id)
            self._dirty[q.name] = q
            return
        lease = _Lease(ev.lease_id, ev.worker, q, q.slots, ev.now)
        self.leases[lease.lease_id] = lease
        q.leases[lease.lease_id] = lease
        q.free[lease.lease_id] = lease
        self._note("lease", ev.request_id, ev.lease_id, ev.worker)
        self._dirty[q.name] = q
        if ev.lease_id in self.early_revokes:
            keep = self.early_revokes.pop(ev.lease_id)
            self._note("revoked before its grant", ev.lease_id)
            self._revoke_granted.append((ev.lease_id, keep))

    def _lease_refused(self, ev: LeaseRefused) -> None:
        q = self.requests.pop(ev.request_id, None)
        if q is None:
            if self.withdrawn.pop(ev.request_id, None) is not None:
                self._note("withdrawn request answered", ev.request_id)
            else:
                self._note("ignored: not an outstanding request", ev.request_id)
            return
        q.requests.discard(ev.request_id)
        if q.requests or q.leases:
            # others still serve the queue.  Its usable leases take the backlog and new
            # requests wait for new work (no loop of refusals); with only busy revoked
            # leases left, the dispatch asks again: they hold what the request needs
            q.backoff = True
            self._dirty[q.name] = q
            return
        error = ScheduleError(ev.reason)
        while q.tasks:
            task = q.tasks.popleft()
            self._fail(task, error)

    def _task_finished(self, ev: TaskFinished) -> None:
        if ev.now > self.now:  # _clock, inline (the hot path)
            self.now = ev.now
        task = self.tasks.get(ev.task_id)
        if task is None:
            self._note("ignored: task not in flight", ev.task_id)
            return
        q = task.q
        lease = task.lease
        if lease is not None and lease.kept_until is not None and (
                ev.now >= lease.kept_until):
            self._note("kept lease revoked", lease.lease_id)
            self._revoke(lease)
        if task.state == QUEUED:
            # requeued after its worker was lost, but its answer came through after all
            if ev.outcome in ("ok", "error"):
                q.tasks.remove(task)
                self._finish(task, ev)
                self._dirty[q.name] = q  # it may have drained (rule 5)
            else:
                self._note("ignored: finish of a queued task", ev.task_id)
            return
        self._unpush(task)
        below = self.pipeline_below_s
        avg = q.avg_s
        pipelined = avg is not None and avg <= below  # as the last dispatch of q saw it
        if ev.outcome == "requeue":
            q.avg_s = max(avg or 0.0, 1.0)  # pipelined behind a long task: stop it
        elif ev.took is not None:
            q.avg_s = avg = ev.took if avg is None else 0.8 * avg + 0.2 * ev.took
        if (ev.outcome == "ok" and not task.settled and q.tasks and not lease.revoked
                and pipelined == (avg is not None and avg <= below) and self.refill_shortcut):
            # The usual end of a task with a backlog: the last dispatch of q left no lease
            # with room (a backlog stops it only once every lease is as deep as it goes, and
            # events since only added tasks), the pipelining rule is unchanged, and only
            # this lease lost a task: what _dispatch would do is refill this lease.
            self._finish(task, ev)
            tasks = q.tasks
            if pipelined:
                cap = lease.slots * self.pipeline_depth
                if len(lease.tasks) >= lease.slots and len(lease.tasks) > cap - self.pipeline_refill:
                    cap = 0  # no room for a whole refill yet (see _pipeline)
            else:
                cap = lease.slots
            while tasks and len(lease.tasks) < cap:
                self._push(lease, tasks.popleft())
            if tasks and len(q.requests) < self.max_pending_requests:
                self._ask(q, tasks)
            if not lease.tasks:
                self._lease_freed(lease, ev.now)
            return
        if task.settled:  # cancelled while pushed: its end only frees the slot
            del self.tasks[task.task_id]
        elif ev.outcome == "requeue":
            self._requeue(q, [task])
        elif ev.outcome == "retryable" and task.retries_left > 0:
            task.retries_left -= 1
            self._requeue(q, [task])
        else:
            self._finish(task, ev)
        if not lease.tasks:  # else _lease_freed has nothing to do (pipelined: the usual)
            self._lease_freed(lease, ev.now)
        self._dirty[q.name] = q

    def _cancel_requested(self, ev: CancelRequested) -> None:
        task = self.tasks.get(ev.task_id)
        if task is None or task.settled:
            self._note("ignored: nothing to cancel", ev.task_id)
            return
        error = CancelledError(f"task {task.task_id} ({task.name}) has been cancelled")
        if task.state == QUEUED:
            q = task.q
            q.tasks.remove(task)
            self._fail(task, error)
            self._dirty[q.name] = q
            return
        self._emit(SendCancel(self._sid, task.task_id, task.lease.worker, ev.force,
                              ev.recursive),
                   task.task_id)
        task.settled = True
        self._emit(TaskFailed(self._sid, task.task_id, error), task.task_id)

    def _leases_revoked(self, ev: LeasesRevoked) -> None:
        self._revoke_ids(ev.lease_ids, ev.keep)

    def _revoke_ids(self, lease_ids: tuple, keep: bool) -> None:
        back = []
        for lease_id in lease_ids:
            lease = self.leases.get(lease_id)
            if lease is None:
                # granted but not heard of yet (or returned already: forgotten in time)
                early = self.early_revokes  # a plain one wins
                remember(early, lease_id, keep and early.get(lease_id, True), EARLY_REVOKES)
                continue
            if lease.revoked:
                continue
            q = lease.q
            if keep and lease.tasks and self.keep_revoked_s > 0:
                # busy: kept until it runs dry or for keep_revoked_s (module docstring, rule
                # 4); other waiters' revokes of it change nothing
                if lease.kept_until is None:
                    lease.kept_until = self.now + self.keep_revoked_s
                    self._note("lease kept", lease_id)
                    self._arm_at(lease.kept_until)  # the bound holds while no task ends
                continue
            self._revoke(lease, back)
            self._dirty[q.name] = q
        if back:
            self._emit(ReturnLeases(self._sid, tuple(back)), *back)

    def _revoke(self, lease: _Lease, back: list | None = None) -> None:
        """Revoke a lease (a kept one for good): it takes no more tasks, and goes back once
        idle: at once if idle now (its id added to ``back``, else returned alone)."""
        lease.revoked = True
        lease.kept_until = None
        q = lease.q
        q.free.pop(lease.lease_id, None)
        if not lease.tasks:
            self._drop(lease)
            if back is not None:
                back.append(lease.lease_id)
            else:
                self._emit(ReturnLeases(self._sid, (lease.lease_id,)), lease.lease_id)
        else:
            self._dirty[q.name] = q

    def _worker_lost(self, ev: WorkerLost) -> None:
        self._clock(ev.now)
        self.lost[ev.worker] = ev.now + self.avoid_lost_s
        self._arm_at(ev.now + self.avoid_lost_s)  # to forget it, with a fresh clock
        gone = [lease for lease in self.leases.values() if lease.worker == ev.worker]
        if gone:
            # the scheduler releases them when it sees the worker go; if only the channel
            # broke, returning them keeps them from leaking
            self._emit(ReturnLeases(self._sid, tuple(l.lease_id for l in gone)),
                       *(l.lease_id for l in gone))
        for lease in gone:
            self._drop(lease)
            back: list[_Task] = []
            for task in list(lease.tasks.values()):
                self._unpush(task)
                if task.settled:
                    del self.tasks[task.task_id]
                    continue
                task.crashes += 1
                bound = self.max_crash_retries if task.max_crashes is None else task.max_crashes
                own = ev.crashed and task.max_crashes is None  # yr: a crash spends a retry
                if own and task.retries_left > 0:
                    task.retries_left -= 1
                    back.append(task)
                elif own or 0 <= bound < task.crashes:
                    del self.tasks[task.task_id]
                    if own:
                        text = (f"task {task.task_id} ({task.name}) was running when its "
                                f"worker process crashed (on {ev.worker}); it ran {task.runs} "
                                f"times, more than retry_times={task.retries_initial} allows "
                                "(InvokeOptions.retry_times reruns a task whose process "
                                "crashed)")
                    else:
                        why = (f"yrdask.scheduling.max-task-crashes={bound}"
                               if task.max_crashes is None else f"its own bound of {bound} reruns")
                        text = (f"task {task.task_id} ({task.name}) was lost with its worker "
                                f"{task.crashes} times (last on {ev.worker}); it ran "
                                f"{task.runs} times, more than {why} allows")
                    self._emit(TaskFailed(self._sid, task.task_id, TaskCrashedError(
                        text, crashes=task.crashes, worker=ev.worker)), task.task_id, ev.worker)
                else:
                    back.append(task)
            if back:
                self._requeue(lease.q, back)
        for q in self.queues.values():  # requests may now avoid the worker; refill leases
            q.backoff = False
            self._dirty[q.name] = q

    def _worker_joined(self, ev: WorkerJoined) -> None:
        """Rule 6's avoidance ends: requests sent while it lasted avoid the worker at the
        scheduler (where it may be the only one that fits), so they are withdrawn and
        asked again (a grant crossing the withdraw is kept while its queue has tasks)."""
        self._clock(ev.now)
        if self.lost.pop(ev.worker, None) is None:
            return
        for q in self.queues.values():
            ids = tuple(r for r, of in self.requests.items() if of is q)
            if ids:
                for request_id in ids:
                    del self.requests[request_id]
                    self.withdrawn[request_id] = q
                q.requests.clear()
                self._emit(WithdrawRequests(self._sid, ids), *ids)
            q.backoff = False
            self._dirty[q.name] = q

    def _tick(self, ev: Tick) -> None:
        self._clock(ev.now)
        self.next_wake = None  # the timer fired (maybe early): ask again for what is left
        for worker in [w for w, until in self.lost.items() if until <= ev.now]:
            del self.lost[worker]
        for lease in [l for l in self.leases.values()
                      if l.kept_until is not None and l.kept_until <= ev.now]:
            self._note("kept lease revoked", lease.lease_id)
            self._revoke(lease)  # its bound passed (its tasks may not end for long)
        idle = [l for l in self.leases.values()
                if not l.tasks and l.idle_since + self.lease_idle_s <= ev.now]
        for lease in idle:
            self._drop(lease)
            self._dirty[lease.q.name] = lease.q
        if idle:
            ids = tuple(l.lease_id for l in idle)
            self._emit(ReturnLeases(self._sid, ids), *ids)
        self._arm()

    def _closing(self, ev: Closing) -> None:
        self.closed = True
        ids = tuple(self.leases)
        # the process ends: what is left is abandoned with it (its refs die with the runtime)
        self.leases.clear()
        self.queues.clear()
        self.tasks.clear()
        self.requests.clear()
        self.withdrawn.clear()
        self.lost.clear()
        self.early_revokes.clear()
        if ids:
            self._emit(ReturnLeases(self._sid, ids), *ids)
        self._dirty.clear()
        self._idle.clear()

    # -- rules -----------------------------------------------------------------------------

    def _dispatch(self, q: _Queue) -> None:
        """Fill the queue's leases, then make sure leases are coming for what is left."""
        if self.closed:
            return
        tasks = q.tasks
        if not tasks:
            if q.requests:
                self._withdraw(q)
            return
        if q.free:
            # the lease freed last first: one task at a time stays on one warm worker (in
            # grant order it would go round every lease, waking each worker in turn), and
            # leases left idle go back
            for lease in list(reversed(q.free.values())):
                while tasks and len(lease.tasks) < lease.slots:
                    self._push(lease, tasks.popleft())
                if not tasks:
                    break
        if tasks and q.avg_s is not None and q.avg_s <= self.pipeline_below_s:
            self._pipeline(q)
        if tasks and len(q.requests) < self.max_pending_requests:  # else _ask wants none
            self._ask(q, tasks)

    def _withdraw(self, q: _Queue) -> None:
        """Rule 5: a drained queue (no task queued, none running) withdraws its requests."""
        for lease in q.leases.values():
            if lease.tasks:
                return  # its tasks still run: it may be refilled
        ids = tuple(r for r, of in self.requests.items() if of is q)  # in asking order
        for request_id in ids:
            del self.requests[request_id]
            self.withdrawn[request_id] = q
        q.requests.clear()
        q.backoff = False
        self._emit(WithdrawRequests(self._sid, ids), *ids)

    def _ask(self, q: _Queue, tasks: deque) -> None:
        """Make sure leases are coming for the queue's backlog ``tasks`` (not empty)."""
        if q.backoff and (q.requests or any(not l.revoked for l in q.leases.values())):
            return  # after a refusal: only what keeps the queue from stalling
        needed = -(-len(tasks) // q.slots)  # leases to run the backlog at once
        want = min(needed, self.max_pending_requests) - len(q.requests)
        if want <= 0:
            return
        avoid = tuple(w for w, until in self.lost.items() if until > self.now)
        near = tasks[0].data_home
        for _ in range(want):
            self._ids += 1
            request_id = f"r{self._ids}"
            self.requests[request_id] = q
            q.requests.add(request_id)
            self.counts["lease_requests"] += 1
            self._emit(RequestLease(self._sid, request_id, q.name, q.shape, q.timeout_ms, near,
                                    avoid, q.affinity), request_id)

    def _pipeline(self, q: _Queue) -> None:
        """Short tasks with a backlog: up to ``pipeline_depth`` per slot, round robin, to
        the leases with room for ``pipeline_refill`` tasks (or a free slot)."""
        depth = self.pipeline_depth
        refill = self.pipeline_refill
        leases = []  # a loop, not a comprehension: this runs once per task with a backlog
        for l in q.leases.values():
            n = len(l.tasks)
            if not l.revoked and (n < l.slots or n <= l.slots * depth - refill):
                leases.append(l)
        if not leases:  # the usual case with a backlog: every lease is as deep as it goes
            return
        tasks = q.tasks
        for depth in range(2, self.pipeline_depth + 1):
            for lease in leases:
                cap = lease.slots * depth
                while tasks and len(lease.tasks) < cap:
                    self._push(lease, tasks.popleft())
                if not tasks:
                    return

    def _push(self, lease: _Lease, task: _Task) -> None:
        task.state = PUSHED
        task.lease = lease
        task.runs += 1
        lease.tasks[task.task_id] = task
        if len(lease.tasks) >= lease.slots:
            lease.q.free.pop(lease.lease_id, None)
        self.counts["local" if lease.worker == self.local_worker else "forwarded"] += 1
        task_id, lease_id = task.task_id, lease.lease_id
        self._out.append(PushTask(self._sid, task_id, lease_id, lease.worker, lease.slots))
        self._entries.append((self._sid, "PushTask", task_id, lease_id))  # flat (see handle)

    def _unpush(self, task: _Task) -> None:
        """Take a pushed task off its lease (it ended, or its worker is gone)."""
        lease = task.lease
        task.lease = None
        task.state = QUEUED
        del lease.tasks[task.task_id]
        if (not lease.revoked and len(lease.tasks) < lease.slots
                and lease.lease_id in self.leases):
            lease.q.free[lease.lease_id] = lease

    def _lease_freed(self, lease: _Lease, now: float) -> None:
        """A task left the lease: a revoked one goes back after its last task (a kept one
        once its queue's dispatch left it idle: ``handle``)."""
        if lease.tasks or lease.lease_id not in self.leases:
            return
        lease.idle_since = now
        if lease.revoked:
            self._drop(lease)
            self._emit(ReturnLeases(self._sid, (lease.lease_id,)), lease.lease_id)
        else:
            self._idle.append(lease)

    def _requeue(self, q: _Queue, tasks: list[_Task]) -> None:
        """Back into the queue in submission order: before every later task.  Bounced tasks
        come back one at a time, and one must not overtake an earlier one (FIFO, as Ray
        dispatches: else an earlier task may wait behind a later one that never ends)."""
        queued = q.tasks
        for task in tasks:
            task.state = QUEUED
            at = 0
            for other in queued:  # requeued tasks are older than nearly all queued ones
                if other.seq > task.seq:
                    break
                at += 1
            queued.insert(at, task)
        self._dirty[q.name] = q

    def _finish(self, task: _Task, ev: TaskFinished) -> None:
        del self.tasks[task.task_id]
        if ev.outcome == "ok":
            task_id = task.task_id
            self._out.append(TaskSucceeded(self._sid, task_id))
            self._entries.append((self._sid, "TaskSucceeded", task_id))
        else:
            self._emit(TaskFailed(self._sid, task.task_id, ev.error), task.task_id)

    def _fail(self, task: _Task, error: BaseException) -> None:
        del self.tasks[task.task_id]
        self._emit(TaskFailed(self._sid, task.task_id, error), task.task_id)

    def _drop(self, lease: _Lease) -> None:
        del self.leases[lease.lease_id]
        q = lease.q
        q.leases.pop(lease.lease_id, None)
        q.free.pop(lease.lease_id, None)

    def _arm(self) -> None:
        """Keep a timer for the first idle lease to go back, kept lease to be revoked, or
        lost worker to forget."""
        due = min(self.lost.values(), default=None)
        for lease in self.leases.values():
            at = lease.kept_until
            if not lease.tasks:
                at = lease.idle_since + self.lease_idle_s
            if at is not None and (due is None or at < due):
                due = at
        if due is not None:
            self._arm_at(due)

    def _arm_at(self, at: float) -> None:
        if self.next_wake is None or at < self.next_wake:
            self.next_wake = at
            self._emit(WakeAt(self._sid, at))

    def _avoided(self, worker: str) -> bool:
        until = self.lost.get(worker)
        return until is not None and until > self.now

    def _clock(self, now: float) -> None:
        if now > self.now:
            self.now = now

    def _emit(self, ins: Instruction, *keys: str) -> None:
        self._out.append(ins)
        self._entries.append((self._sid, ins, keys))

    def _note(self, what: str, *keys: str) -> None:
        self._entries.append((self._sid, (what, *keys), keys))

    # -- invariants ------------------------------------------------------------------------

    def own_crashes_count(self, worker: str) -> bool:
        """Does a task on a lease of ``worker`` spend its ``retries`` if the process crashed
        by its own hand (a task without its own bound, yr's: rule 6)?  Then its loss waits to
        hear how the process ended before it is handled."""
        return any(lease.worker == worker and any(t.max_crashes is None
                                                  for t in lease.tasks.values())
                   for lease in self.leases.values())

    def validate(self) -> None:
        """Check the machine's invariants; raises AssertionError naming the broken one."""
        seen: set[str] = set()
        for key, q in self.queues.items():
            assert q.key == key
            last = 0
            for task in q.tasks:
                assert task.seq > last, f"{task.task_id} queued out of submission order"
                last = task.seq
                assert task.task_id not in seen, f"{task.task_id} queued twice"
                seen.add(task.task_id)
                assert self.tasks.get(task.task_id) is task, f"{task.task_id} queued but unknown"
                assert task.state == QUEUED and task.lease is None and not task.settled
                assert task.key == key
            for lease_id, lease in q.leases.items():
                assert self.leases.get(lease_id) is lease, f"{lease_id} of {q.name} unknown"
                assert lease.key == key
            for lease_id, lease in q.free.items():
                assert q.leases.get(lease_id) is lease and not lease.revoked
                assert len(lease.tasks) < lease.slots, f"{lease_id} full but listed free"
            for lease in q.leases.values():
                if not lease.revoked and len(lease.tasks) < lease.slots:
                    assert lease.lease_id in q.free, f"{lease.lease_id} has room, not free"
            for request_id in q.requests:
                assert self.requests.get(request_id) is q
            assert len(q.requests) <= self.max_pending_requests, f"{q.name}: too many requests"
            if self.closed:
                continue
            if q.tasks:
                assert not q.free, (f"{q.name}: {len(q.tasks)} task(s) wait while lease "
                                    f"{next(iter(q.free))} has a free slot")
                usable = any(not l.revoked for l in q.leases.values())
                assert usable or q.requests, (
                    f"{q.name} stalls: {len(q.tasks)} task(s) queued, no usable lease and no "
                    "outstanding request")
        for request_id, q in self.requests.items():
            assert request_id in q.requests
        for request_id, q in self.withdrawn.items():
            assert request_id not in self.requests, f"{request_id} withdrawn yet outstanding"
            assert request_id not in q.requests, f"{q.name} still waits for {request_id}"
        if not self.closed:
            for q in self.queues.values():  # rule 5: a drained queue asks for nothing
                if q.requests and not q.tasks:
                    assert any(l.tasks for l in q.leases.values()), (
                        f"{q.name} drained with request(s) {sorted(q.requests)} not withdrawn")
        for lease_id, lease in self.leases.items():
            assert lease_id in lease.q.leases
            assert len(lease.tasks) <= lease.slots * self.pipeline_depth
            assert not (lease.revoked and not lease.tasks), f"{lease_id} revoked, idle, kept"
            if lease.kept_until is not None:
                assert not lease.revoked, f"{lease_id} both kept and revoked"
                assert lease.tasks or self.closed, f"{lease_id} kept while idle"
            for task_id, task in lease.tasks.items():
                assert task_id not in seen, f"{task_id} both queued and pushed, or pushed twice"
                seen.add(task_id)
                assert self.tasks.get(task_id) is task and task.lease is lease
                assert task.state == PUSHED
            if not lease.tasks and not self.closed:
                assert self.next_wake is not None and \
                    self.next_wake <= lease.idle_since + self.lease_idle_s, \
                    f"idle {lease_id} has no timer to go back"
        assert seen == set(self.tasks), f"tasks lost track of: {set(self.tasks) ^ seen}"
        assert len(self.early_revokes) <= EARLY_REVOKES
        assert not self.early_revokes.keys() & self.leases.keys(), \
            "a held lease's revoke remembered as early (never applied)"
        assert not self._revoke_granted, "an early revoke left unapplied"
        if self.lost and not self.closed:
            assert self.next_wake is not None and self.next_wake <= min(self.lost.values()), \
                "no timer to forget a lost worker"


def _event_keys(ev: Event | Instruction) -> tuple:
    """The ids the story entry of ``ev`` (an event, or an instruction logged bare) is found
    by, worked out when the story is read."""
    keys = [v for v in (getattr(ev, f) for f in _KEYS[type(ev)]) if v]
    if type(ev) is LeasesRevoked:
        keys.extend(ev.lease_ids)
    return tuple(keys)


#: the fields of each event that its story entry is found by
_KEYS = {
    TaskQueued: ("task_id",),
    LeaseGranted: ("request_id", "lease_id", "worker"),
    LeaseRefused: ("request_id",),
    TaskFinished: ("task_id",),
    CancelRequested: ("task_id",),
    LeasesRevoked: (),
    WorkerLost: ("worker",),
    WorkerJoined: ("worker",),
    Tick: (),
    Closing: (),
    PushTask: ("task_id", "lease_id"),
    TaskSucceeded: ("task_id",),
}

_HANDLERS = {
    TaskQueued: SubmitQueue._task_queued,
    LeaseGranted: SubmitQueue._lease_granted,
    LeaseRefused: SubmitQueue._lease_refused,
    TaskFinished: SubmitQueue._task_finished,
    CancelRequested: SubmitQueue._cancel_requested,
    LeasesRevoked: SubmitQueue._leases_revoked,
    WorkerLost: SubmitQueue._worker_lost,
    WorkerJoined: SubmitQueue._worker_joined,
    Tick: SubmitQueue._tick,
    Closing: SubmitQueue._closing,
}

# built per task on the hot path: slots written directly (statemachine.fast_init)
fast_init(*[c for c in list(globals().values())
            if isinstance(c, type) and issubclass(c, (Event, Instruction))])
