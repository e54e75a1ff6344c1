"""Task submission: the decisions around the :class:`SubmitQueue` state machine, apart from
their I/O.

The rules (shape queues, leases, pipelining, revokes, lost workers, retries, cancels) live in
:mod:`yrdask.runtime.submit_queue`, a pure machine.  :class:`Submitter`, on the runtime's event
loop thread, keeps what the machine does not see (each task's function, pickled arguments, ref
arguments and result entries, keyed by task id), turns the world into events and decides what
each of the machine's instructions means:

1. ``submit`` waits for the task's owned ref arguments (the owner resolves them, as in Ray),
   then says ``TaskQueued`` (a failed argument fails the task here);
2. ``RequestLease`` becomes a lease request (local first: on this worker while its queue is
   short, unless large arguments live elsewhere) whose answer is ``LeaseGranted`` /
   ``LeaseRefused``; ``PushTask`` a ``RUN_TASK`` to the worker, ``SendCancel`` a
   ``CANCEL_TASK``, ``ReturnLeases`` a ``RETURN_LEASES`` on the scheduler stream;
3. ``TASK_DONE`` becomes ``TaskFinished``; ``TaskSucceeded`` / ``TaskFailed`` settle the
   task's entries (with the results of that ``TASK_DONE``, or the error);
4. ``WakeAt`` arms one timer that answers with ``Tick``; revokes, lost channels and the end
   of the runtime are events too.

It does no I/O itself: a small :class:`SubmitterEdge` carries out the edge (the clock, timers,
sends, lease rpcs, the object table).  The runtime plugs in
:class:`~yrdask.runtime.submitter_edge.RuntimeEdge` (its loop, channels and connector); the simulation (``tests/sim/world.py``) plugs in its virtual clock
and links, so it drives this very code (as ``scheduler/lease_service.py`` is driven).
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

import dask

# the pipelining keys' checked reader (importing yrdask.config registers the yrdask.* defaults)
from yrdask.config import pipeline_settings
from yrdask import protocol as P
from yrdask.errors import (CancelledError, DependencyError, ObjectLostError,
                           ObjectReconstructionFailedError, RemoteError, TaskCrashedError,
                           crashed_by_itself, dependency_error)
from yrdask.runtime import submit_queue as M
from yrdask.runtime.objects import Entry, dep_of, failed_dep, pending_owned, when_ready
from yrdask.runtime.submitter_edge import RuntimeEdge
from yrdask.serialization import loads

logger = logging.getLogger("yrdask.submitter")

#: how long a lost worker's yr tasks wait to hear how its process ended (its nanny's report)
#: before they are rerun as after an eviction; a report that comes decides at once
LOST_VERDICT_WAIT_S = 1.0


@dataclass(eq=False, slots=True)
class Task:
    """One stateless call on its way to a worker: the payloads the machine never sees."""

    task_id: str
    fn_id: str
    fn_payload: bytes
    name: str
    args: bytes
    dep_refs: Sequence  # ObjectRefs of top-level ref arguments (kept alive until queued;
    # those read by reference from the node store until the task is done)
    entries: Sequence[Entry]  # one per return value
    ref_ids: Sequence[str]
    nret: int
    shape: dict[str, float]
    shape_key: tuple  # (resources, schedule timeout, concurrency, affinity)
    timeout_ms: int
    retries: int
    owner: str  # lifetime owner (job or instance id) for work created by the task
    log_to: str | None = None  # the driver that gets the task's prints (log_to_driver)
    events: bool = True  # False: the task leaves no record (P.RunTask)
    deps: Sequence | None = None
    nested: Sequence | None = None  # refs nested in the arguments that gate the start (yr's rule)
    max_crashes: int | None = None  # reruns after a lost worker (None: the queue's bound)
    held: Sequence | None = None  # its ref arguments, alive until it ends (borrowing)
    rebuilt: int = 0  # reruns to recompute results lost with their worker (lineage)
    queued: bool = False  # handed to the machine (its ref arguments were ready)
    cancelled: bool = False


class SubmitterEdge(Protocol):
    """What :class:`Submitter` needs of the world around it (all on the loop thread)."""

    def now(self) -> float:
        """The clock of the machine's times (``time.monotonic`` in production)."""

    def call_soon(self, fn: Callable[[Any], None], arg: Any) -> None:
        """Call ``fn(arg)`` soon, after the current event."""

    def call_at(self, at: float, fn: Callable[[], None]) -> Any:
        """Call ``fn`` at (or after) ``at``; returns a handle with ``cancel()``."""

    def request_lease(self, ins: M.RequestLease, near: str | None,
                      answer: Callable[[str, str | None, str], None]) -> None:
        """Ask the scheduler for ``ins``'s lease (``near``: the worker to place it on when it
        fits there); later ``answer(request_id, lease_id, worker)`` or ``answer(request_id,
        None, reason)``."""

    def push(self, task: Task, lease_id: str, worker: str, slots: int) -> None:
        """Send ``task`` to ``worker`` under ``lease_id`` (``RUN_TASK``)."""

    def send_cancel(self, worker: str, task_id: str, force: bool, recursive: bool) -> None:
        """``CANCEL_TASK`` to the worker running ``task_id``."""

    def return_leases(self, lease_ids: list[str]) -> None:
        """``RETURN_LEASES`` on the scheduler stream."""

    def withdraw_requests(self, request_ids: list[str]) -> None:
        """``WITHDRAW_LEASE_REQUESTS`` on the scheduler stream (the queue drained)."""

    def crashed(self, error: TaskCrashedError, entries: list[Entry]) -> None:
        """Fail ``entries`` with ``error``, once it can say how the worker's process ended."""

    def when_exit_known(self, worker: str, then: Any, wait_s: float) -> None:
        """``then(how)``: how ``worker``'s process ended (``None``: not reported within
        ``wait_s``)."""

    def kept_result(self, oid: str, entry: Entry, worker: str) -> bool:
        """A result ``worker`` keeps: False (and the worker's copy freed) when nothing here
        refers to it any more, else True (its lineage is kept)."""

    def keeps_copy(self, oid: str) -> bool:
        """The value of ``oid`` is still in this node's store (a lost worker did not take
        it)."""

    def entry_of(self, oid: str) -> Entry | None:
        """The object table's entry of ``oid``, if it lives."""

    def ensure_fetch(self, ref: Any) -> None:
        """Ask the owner of a borrowed ``ref`` for its value (answered once it is ready)."""

    def address(self) -> str:
        """This process's address."""

    def local_worker(self) -> str | None:
        """The worker this process lives in, or None (a driver)."""

    def prefers_local(self) -> bool:
        """Local first: this worker's queue is short enough to lease on it."""

    def cannot(self, ins: Any, error: BaseException) -> None:
        """An instruction could not be carried out (production logs it)."""


class Submitter:
    """Per-process task submission: feeds the :class:`SubmitQueue` and decides what its
    instructions mean; the :class:`SubmitterEdge` does the I/O."""

    def __init__(self, edge: SubmitterEdge, machine: M.SubmitQueue) -> None:
        self.edge = edge
        self.machine = machine
        self.tasks: dict[str, Task] = {}  # submitted and not settled yet
        self.waiting = 0  # tasks whose ref arguments are not ready yet
        self.closed = False
        self._results: dict[str, list] = {}  # task id -> results of the TASK_DONE being handled
        self._events: deque = deque()
        self._busy = False
        self._timer: Any = None
        self._timer_at = 0.0
        self._local_set = False
        # lineage: result id -> its Task, for results a worker keeps (LOCATION), while the
        # result lives: a result lost with its worker is computed again (reconstruct)
        self.lineage: dict[str, Task] = {}
        # generator call id -> {item id: entry} of its items lost with their worker, pending
        # until a run of the call sends them again (rebuilt_item) or it ends without them
        self.rebuilding: dict[str, dict[str, Entry]] = {}
        # a cancelled task settles at once, but its worker may still run it and keep its ref
        # arguments: they stay held until its TASK_DONE reports what it kept (or the worker
        # is lost).  pushed: task id -> the worker running it now (tasks with ref arguments)
        self.pushed: dict[str, str] = {}
        self.cancelled_args: dict[str, tuple[str, list]] = {}  # task id -> (worker, refs)
        self._lost_pending: set[str] = set()  # lost workers waiting to hear how they ended

    @classmethod
    def for_runtime(cls, runtime: Any, lease_idle_s: float = 1.0,
                    max_crash_retries: int | None = None) -> "Submitter":
        """The submitter of a process's runtime: its machine, on the runtime's edge."""
        if max_crash_retries is None:
            max_crash_retries = int(dask.config.get("yrdask.scheduling.max-task-crashes", 3))
        depth, refill = pipeline_settings()
        return cls(RuntimeEdge(runtime), M.SubmitQueue(
            None, lease_idle_s=lease_idle_s, max_crash_retries=max_crash_retries,
            pipeline_depth=depth, pipeline_refill=refill))

    # -- entry points (loop thread) --------------------------------------------------------

    def submit(self, task: Task) -> None:
        if not self._local_set:  # a worker's runtime learns its address after it is built
            self._local_set = True
            self.machine.local_worker = self.edge.local_worker()
        self.tasks[task.task_id] = task
        if not task.nested:
            if not task.dep_refs and not self.closed:
                task.deps = ()  # no ref arguments: queued at once (the common case)
                self._queue(task, None)
                return
            self.waiting += 1
            when_ready(task.dep_refs, lambda: self._deps_ready(task))
            return
        self.waiting += 1
        for ref in task.nested:  # a borrowed one: ask its owner, who answers once it is ready
            if ref._entry.owner is not None:
                self.edge.ensure_fetch(ref)
        pending = pending_owned(task.dep_refs) + [r._entry for r in task.nested
                                                   if not r._entry.ready]
        when_entries_ready(pending, lambda: self._deps_ready(task))

    def _deps_ready(self, task: Task) -> None:
        if task.cancelled or self.closed:
            return
        self.waiting -= 1
        data_home = None
        if task.dep_refs or task.nested:
            error = failed_dep(task.dep_refs)
            if error is None and task.nested:
                error = _nested_failure(task)
            task.nested = None  # their values exist now; the task reads them through its refs
            if error is not None:
                self.tasks.pop(task.task_id, None)
                for entry in task.entries:
                    entry.set_error(error)
                return
            deps = task.deps = [dep_of(ref) for ref in task.dep_refs]
            # refs to values in the store stay held until the task is done (read by reference)
            task.dep_refs = [r for r in task.dep_refs if r._entry.stored]
            here = self.edge.address()
            for _oid, kind, payload in deps:
                # leasing where large arguments live saves moving them (our own puts are in
                # this node's store: local first already prefers it)
                if kind == P.LOCATION and payload != here:
                    data_home = payload
                    break
        else:
            task.deps = ()
        self._queue(task, data_home)

    def _queue(self, task: Task, data_home: str | None) -> None:
        """Hand a task whose ref arguments are ready to the machine."""
        task.queued = True
        _resources, _timeout, slots, affinity = task.shape_key
        self._handle(M.TaskQueued("submit", task.task_id, task.shape_key, task.shape,
                                  task.timeout_ms, slots, affinity, task.retries, data_home,
                                  task.name, task.max_crashes))

    def on_task_done(self, msg: P.TaskDone) -> None:
        """``TASK_DONE`` of a pushed task (instance calls were routed elsewhere first)."""
        if self._busy:  # never inside another event's instructions: its results must wait
            self.edge.call_soon(self.on_task_done, msg)
            return
        error = msg.error
        if msg.requeue:
            outcome = "requeue"
        elif error is not None:
            outcome = "retryable" if msg.retryable else "error"
        else:
            self._task_ok(msg.task_id, msg.results or [], msg.took)
            return
        task_id = msg.task_id
        if self.pushed:  # its worker runs it no more
            self.pushed.pop(task_id, None)
            if self.cancelled_args:  # its refs were counted (Runtime: objects.on_done_refs)
                self.cancelled_args.pop(task_id, None)
        self._handle(M.TaskFinished("task-done", task_id, outcome, msg.took, error,
                                    self.edge.now()))

    def on_task_ok(self, task_id: str, results: list, took: float | None) -> None:
        """A plain successful ``TASK_DONE`` (no error, requeue or refs report), read straight
        from its wire dict: the driver's hot path, without the message object."""
        if self._busy:  # as on_task_done: after the current event's instructions
            self.edge.call_soon(self._task_ok_later, (task_id, results, took))
            return
        self._task_ok(task_id, results, took)

    def _task_ok_later(self, answer: tuple) -> None:
        self.on_task_ok(*answer)

    def _task_ok(self, task_id: str, results: list, took: float | None) -> None:
        if self.pushed:  # its worker runs it no more
            self.pushed.pop(task_id, None)
            if self.cancelled_args:  # its refs were counted (Runtime: objects.on_done_refs)
                self.cancelled_args.pop(task_id, None)
        self._results[task_id] = results
        self._handle(M.TaskFinished("task-done", task_id, "ok", took, None, self.edge.now()))
        self._results.pop(task_id, None)

    def cancel(self, object_id: str, force: bool = False, recursive: bool = False) -> None:
        """``yr.cancel``: a task still waiting for its arguments is failed here.  ``force``:
        the worker running it ends its process (the task is settled here, so its loss with
        that worker is not counted as a crash of it).  A finished task whose result a worker
        keeps is marked: it never runs again to rebuild that result (Ray's rule)."""
        task_id = object_id.split(".", 1)[0]
        task = self.tasks.get(task_id)
        if task is None:
            done = self.lineage.get(object_id)
            if done is not None:
                done.cancelled = True
            return
        if task.cancelled:
            return
        task.cancelled = True
        if task.queued:
            self._handle(M.CancelRequested("cancel", task_id, force, recursive))
            return
        self.tasks.pop(task_id, None)
        self.waiting -= 1
        error = CancelledError(f"task {task_id} ({task.name}) has been cancelled")
        for entry in task.entries:
            entry.set_error(error)

    def revoke_leases(self, lease_ids: list[str], keep: bool = False) -> None:
        """The scheduler wants these leases back (``keep``: a busy one may run its queue's
        backlog a while first)."""
        self._handle(M.LeasesRevoked("revoke", tuple(lease_ids), keep))

    def on_channel_lost(self, worker: str) -> None:
        """The channel to ``worker`` broke (or the scheduler said it is gone)."""
        for task_id, where in list(self.pushed.items()):
            if where == worker:  # no TASK_DONE will come: the worker's borrowings ended
                del self.pushed[task_id]
                self.cancelled_args.pop(task_id, None)
        if worker in self._lost_pending:
            return
        if not self.machine.own_crashes_count(worker):
            self._handle(M.WorkerLost("channel-lost", worker, self.edge.now()))
            return
        # yr tasks ran there: whether the loss spends their retry_times depends on how the
        # process ended (its own crash, or an eviction / lost host), which the nanny reports
        self._lost_pending.add(worker)
        self.edge.when_exit_known(worker, lambda how: self._lost(worker, how),
                                  LOST_VERDICT_WAIT_S)

    def _lost(self, worker: str, how: str | None) -> None:
        if worker in self._lost_pending:
            self._lost_pending.discard(worker)
            self._handle(M.WorkerLost("channel-lost", worker, self.edge.now(),
                                      crashed_by_itself(how)))

    def worker_joined(self, worker: str) -> None:
        """A new process registered at the address of the lost ``worker``."""
        self._lost(worker, None)  # a loss still waiting for its verdict goes first
        self._handle(M.WorkerJoined("worker-joined", worker, self.edge.now()))

    def lease_answer(self, request_id: str, lease_id: str | None, where: str) -> None:
        """The scheduler's answer to a lease request: granted on worker ``where``, or
        refused (``lease_id`` None, ``where`` the reason)."""
        if lease_id is None:
            self._handle(M.LeaseRefused("lease-refused", request_id, str(where)))
        else:
            self._handle(M.LeaseGranted("lease-granted", request_id, lease_id, where,
                                        self.edge.now()))

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._handle(M.Closing("close"))
        self.closed = True

    def figures(self) -> dict:
        """Scheduling figures of this process: tasks run on its own worker vs elsewhere."""
        figures = self.machine.figures()
        figures["queued"] += self.waiting
        return figures

    def story(self, *keys: str) -> str:
        """What the machine did about these tasks, leases or requests, as text."""
        return self.machine.log.dump(*keys)

    # -- the machine -----------------------------------------------------------------------

    def _handle(self, event: M.Event) -> None:
        """Feed one event and carry out its instructions.  Settling an entry may submit or
        cancel (callbacks): those events wait until this one's instructions are done."""
        if self._busy:
            self._events.append(event)
            return
        self._busy = True
        events = self._events
        handle = self.machine.handle
        try:
            while True:
                for ins in handle(event):
                    try:
                        if type(ins) is M.PushTask:  # the hot instruction, inline
                            task = self.tasks[ins.task_id]
                            if task.held:  # (ref arguments: see cancelled_args)
                                self.pushed[ins.task_id] = ins.worker
                            self.edge.push(task, ins.lease_id, ins.worker, ins.slots)
                        else:
                            self._do(ins)
                    except Exception as e:
                        self.edge.cannot(ins, e)
                if not events:
                    break
                event = events.popleft()
        finally:
            self._busy = False

    def _do(self, ins: Any) -> None:
        kind = type(ins)  # (PushTask, the hot one, is carried out in _handle)
        if kind is M.TaskSucceeded:
            task = self.tasks.pop(ins.task_id, None)
            results = self._results.pop(ins.task_id, None)
            if task is None or results is None:  # a machine bug: say so, settle nothing twice
                raise AssertionError(
                    f"TaskSucceeded for {ins.task_id}, " + (
                        "which is not pending (settled twice, or never queued)"
                        if task is None else "without a successful TASK_DONE for it"))
            for oid, entry, (rkind, payload) in zip(task.ref_ids, task.entries, results):
                entry.set_result(rkind, payload)
                if rkind != P.LOCATION or task.nret < 0:
                    continue
                if self.edge.kept_result(oid, entry, payload):
                    self.lineage[oid] = task
            if self.rebuilding:
                self._rebuild_ended(task, None)
        elif kind is M.TaskFailed:
            task = self.tasks.pop(ins.task_id, None)
            if task is None:  # a machine bug: say so, settle nothing twice
                raise AssertionError(f"TaskFailed for {ins.task_id}, which is not pending "
                                     "(settled twice, or never queued)")
            if task.held:
                worker = self.pushed.get(ins.task_id)
                if task.cancelled and worker is not None:  # it may still run there
                    self.cancelled_args[ins.task_id] = (worker, task.held)
                else:
                    self.pushed.pop(ins.task_id, None)
            error = ins.error
            if isinstance(error, (bytes, bytearray, memoryview)):
                error = loads(error)
            entries = task.entries
            if self.rebuilding:  # generator items it was rebuilding fail with it
                entries = [*entries, *self._rebuild_ended(task, error)]
            if type(error) is TaskCrashedError:  # say how the process ended, when known
                self.edge.crashed(error, entries)
                return
            for entry in entries:
                entry.set_error(error)
        elif kind is M.RequestLease:
            near = ins.near
            if near is None and self.machine.local_worker and self.edge.prefers_local():
                near = self.machine.local_worker  # local first while its queue is short
            self.edge.request_lease(ins, near, self.lease_answer)
        elif kind is M.ReturnLeases:
            self.edge.return_leases(list(ins.lease_ids))
        elif kind is M.WithdrawRequests:
            self.edge.withdraw_requests(list(ins.request_ids))
        elif kind is M.SendCancel:
            self.edge.send_cancel(ins.worker, ins.task_id, ins.force, ins.recursive)
        elif kind is M.WakeAt:
            self._wake_at(ins.at)
        else:
            raise AssertionError(f"unknown submitter instruction {ins!r}")

    # -- reconstruction ----------------------------------------------------------------------

    def forget(self, object_id: str) -> None:
        """A result was freed: its lineage goes (and with it the task's argument refs)."""
        self.lineage.pop(object_id, None)

    def reconstruct(self, worker: str) -> list[str]:
        """``worker`` is gone: run again the tasks whose results only it kept (Ray's lineage
        reconstruction), within the task's bound of reruns after lost workers; a result over
        the bound fails with ``ObjectLostError``.  Returns the ids handled here."""
        handled = []
        again: dict[str, Task] = {}
        for oid, task in list(self.lineage.items()):
            entry = self.edge.entry_of(oid)
            if entry is None:
                del self.lineage[oid]
                continue
            if entry.state != P.LOCATION or entry.location != worker or entry.has_value:
                continue
            if self.edge.keeps_copy(oid):  # still in this node's store: readers map it
                continue
            del self.lineage[oid]
            handled.append(oid)
            if task.nret < 0 and task.task_id in self.tasks:
                # a generator item of a call still running: the run that follows its
                # worker's loss (or the one under way) sends it again
                entry.lose(None)
                self.rebuilding.setdefault(task.task_id, {})[oid] = entry
                continue
            if task.cancelled:
                entry.lose(ObjectReconstructionFailedError(
                    f"object {oid} was lost with worker {worker}, which kept its value, and "
                    f"its task {task.name} ({task.task_id}) was cancelled, so it does not "
                    "run again to rebuild it"))
                continue
            bound = self.machine.max_crash_retries if task.max_crashes is None else task.max_crashes
            if bound != -1 and task.rebuilt >= bound and task.task_id not in again:
                why = ("yrdask.scheduling.max-task-crashes" if task.max_crashes is None
                       else "the task's max_retries")
                entry.lose(ObjectLostError(
                    f"object {oid} was lost with worker {worker}, which kept its value, and "
                    f"its task {task.name} ({task.task_id}) may not run again to rebuild it: "
                    f"it was rerun {task.rebuilt} times after lost workers, and {why}={bound} "
                    "allows no more; raise it to have lost results computed again"))
                continue
            entry.lose(None)  # pending again: readers wait for the rerun
            again[task.task_id] = task
            if task.nret < 0:  # a generator item: the rerun sends it again by index
                self.rebuilding.setdefault(task.task_id, {})[oid] = entry
        for task in again.values():
            task.rebuilt += 1
            self.tasks[task.task_id] = task
            _resources, _timeout, slots, affinity = task.shape_key
            self._handle(M.TaskQueued("reconstruct", task.task_id, task.shape_key, task.shape,
                                      task.timeout_ms, slots, affinity, task.retries, None,
                                      task.name, task.max_crashes))
        return handled

    def item_kept(self, call_id: str, oid: str) -> None:
        """A generator call's item ``oid`` is kept by its worker: while it lives, the call
        is its lineage (run again if that worker is lost, as for a task's result).  Only
        task calls pending here have one (a method's items are not computed again)."""
        task = self.tasks.get(call_id)
        if task is not None:
            self.lineage[oid] = task

    def rebuilt_item(self, call_id: str, oid: str, result: list) -> bool:
        """An item a run of ``call_id`` sent again: if it was lost with its worker, it is
        settled with ``result`` and True returned; else False (a duplicate)."""
        items = self.rebuilding.get(call_id)
        entry = items.pop(oid, None) if items else None
        if entry is None:
            return False
        if not items:
            del self.rebuilding[call_id]
        kind, payload = result
        entry.set_result(kind, payload)
        if kind == P.LOCATION:
            self.item_kept(call_id, oid)
        return True

    def _rebuild_ended(self, task: Task, error: Any) -> list[Entry]:
        """A run of a generator call ended: its items still being rebuilt were not sent
        again.  After a success they fail here with a ``ValueError`` (the generator yielded
        fewer items than the first time; Ray's rule for a re-executed generator); after a
        failure the caller fails them with the call's error (returned)."""
        items = self.rebuilding.pop(task.task_id, None)
        if not items:
            return []
        if error is not None:
            return list(items.values())
        cause = ValueError(
            f"the generator {task.name} ({task.task_id}) was run again to rebuild items lost "
            f"with their worker, and yielded fewer items than the first time: items "
            f"{', '.join(sorted(items, key=_item_index))} were not yielded again (a generator "
            "must yield the same items when run again)")
        for entry in items.values():
            entry.set_error(RemoteError.from_exception(cause, str(cause)))
        return []

    def _wake_at(self, at: float) -> None:
        """One timer, for the earliest time the machine asked for."""
        if self.closed:
            return
        if self._timer is not None:
            if self._timer_at <= at:
                return
            self._timer.cancel()
        self._timer_at = at
        self._timer = self.edge.call_at(at, self._tick)

    def _tick(self) -> None:
        self._timer = None
        self._handle(M.Tick("tick", self.edge.now()))


def _item_index(oid: str) -> int:
    """The index of a generator item's id ``<call id>.<index>``."""
    return int(oid.rpartition(".")[2])


def when_entries_ready(entries: list[Entry], then: Any) -> None:
    """Call ``then`` (on the loop) once every entry in ``entries`` is ready."""
    if not entries:
        then()
        return
    left = [len(entries)]

    def one() -> None:
        left[0] -= 1
        if left[0] == 0:
            then()

    for entry in entries:
        entry.add_callback(one)


def _nested_failure(task: Task) -> DependencyError | None:
    """A :class:`DependencyError` naming the first failed nested ref, if one failed."""
    for ref in task.nested or ():
        if ref._entry.state == P.ERROR:
            cause = ref._entry.exception()
            return dependency_error(
                f"{task.name} (task {task.task_id}) did not run: the ref {ref._id} nested in "
                f"its arguments failed (code {DependencyError.code}, DEPENDENCY_FAILED): "
                f"{type(cause).__name__}: {cause}", ref._id, cause)
    return None
