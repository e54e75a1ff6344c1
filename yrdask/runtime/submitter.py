"""Task submission: the asyncio adapter around the :class:`SubmitQueue` state machine.

The rules (shape queues, leases, pipelining, revokes, lost workers, retries, cancels) live in
:mod:`yrdask.runtime.submit_queue`, a pure machine.  This adapter, on the runtime's event loop
thread, keeps what the machine does not see (each task's function, pickled arguments, ref
arguments and result entries, keyed by task id), turns the world into events and carries
out the machine's instructions:

1. ``submit`` waits for the task's owned ref arguments (the owner resolves them, as in Ray),
   then says ``TaskQueued`` (a failed argument fails the task here);
2. ``RequestLease`` becomes a ``REQUEST_LEASE`` rpc whose answer is ``LeaseGranted`` /
   ``LeaseRefused``; ``PushTask`` a ``RUN_TASK`` on the call channel to the worker (the
   function's pickle only the first time on that channel), ``SendCancel`` a ``CANCEL_TASK``,
   ``ReturnLeases`` a ``RETURN_LEASES`` on the scheduler stream;
3. ``TASK_DONE`` becomes ``TaskFinished``; ``TaskSucceeded`` / ``TaskFailed`` settle the
   task's entries (with the results of that ``TASK_DONE``, or the error);
4. ``WakeAt`` arms one loop timer that answers with ``Tick``; revokes, lost channels and the
   end of the runtime are events too.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import dask

from yrdask import config as _config  # noqa: F401 - registers the yrdask.* defaults
from yrdask import protocol as P
from yrdask.errors import (CancelledError, DependencyError, ObjectLostError, TaskCrashedError,
                           dependency_error)
from yrdask.runtime import submit_queue as M
from yrdask.runtime.store import node_store
from yrdask.runtime.objects import (Entry, dep_of, failed_dep, failing_entries, pending_owned,
                                    when_ready)
from yrdask.serialization import loads

logger = logging.getLogger("yrdask.submitter")


@dataclass(eq=False, slots=True)
class Task:
    """One stateless call on its way to a worker: the payloads the machine never sees."""

    task_id: str
    fn_id: str
    fn_payload: bytes
    name: str
    args: bytes
    dep_refs: list  # ObjectRefs of top-level ref arguments (kept alive until queued; those
    # read by reference from the node store until the task is done)
    entries: list[Entry]  # one per return value
    ref_ids: list[str]
    nret: int
    shape: dict[str, float]
    shape_key: tuple  # (resources, schedule timeout, concurrency, affinity)
    timeout_ms: int
    retries: int
    owner: str  # lifetime owner (job or instance id) for work created by the task
    log_to: str | None = None  # the driver that gets the task's prints (log_to_driver)
    deps: list | None = None
    nested: list | None = None  # refs nested in the arguments that gate the start (yr's rule)
    max_crashes: int | None = None  # reruns after a lost worker (None: the queue's bound)
    held: list | None = None  # its ref arguments, alive until it ends (borrowing)
    rebuilt: int = 0  # reruns to recompute results lost with their worker (lineage)
    queued: bool = False  # handed to the machine (its ref arguments were ready)
    cancelled: bool = False


class Submitter:
    """Per-process task submission: feeds the :class:`SubmitQueue`, does what it says."""

    def __init__(self, runtime: Any, lease_idle_s: float = 1.0,
                 max_crash_retries: int | None = None) -> None:
        self.rt = runtime
        if max_crash_retries is None:
            max_crash_retries = int(dask.config.get("yrdask.scheduling.max-task-crashes", 3))
        self.machine = M.SubmitQueue(None, lease_idle_s=lease_idle_s,
                                     max_crash_retries=max_crash_retries)
        self.tasks: dict[str, Task] = {}  # submitted and not settled yet
        self.waiting = 0  # tasks whose ref arguments are not ready yet
        self.closed = False
        self._results: dict[str, list] = {}  # task id -> results of the TASK_DONE being handled
        self._events: deque = deque()
        self._busy = False
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0
        self._local_set = False
        # lineage: result id -> its Task, for results a worker keeps (LOCATION), while the
        # result lives: a result lost with its worker is computed again (reconstruct)
        self.lineage: dict[str, Task] = {}

    # -- entry points (loop thread) --------------------------------------------------------

    def submit(self, task: Task) -> None:
        if not self._local_set:  # a worker's runtime learns its address after it is built
            self._local_set = True
            self.machine.local_worker = self.rt.local_worker
        self.tasks[task.task_id] = task
        self.waiting += 1
        if not task.nested:
            if task.dep_refs:
                when_ready(task.dep_refs, lambda: self._deps_ready(task))
            else:  # no ref arguments: queued at once (the common case, kept cheap)
                self._deps_ready(task)
            return
        for ref in task.nested:  # a borrowed one: ask its owner, who answers once it is ready
            if ref._entry.owner is not None:
                self.rt._ensure_fetch(ref)
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
            for _oid, kind, payload in deps:
                # leasing where large arguments live saves moving them (our own puts are in
                # this node's store: local first already prefers it)
                if kind == P.LOCATION and payload != self.rt.address:
                    data_home = payload
                    break
        else:
            task.deps = []
        task.queued = True
        _resources, _timeout, slots, affinity = task.shape_key
        self._handle(M.TaskQueued("submit", task.task_id, task.shape_key, task.shape,
                                  task.timeout_ms, slots, affinity, task.retries, data_home,
                                  task.name, task.max_crashes))

    def on_task_done(self, msg: P.TaskDone) -> None:
        """``TASK_DONE`` of a pushed task (instance calls were routed elsewhere first)."""
        if self._busy:  # never inside another event's instructions: its results must wait
            self.rt.loop.call_soon(self.on_task_done, msg)
            return
        task_id = msg.task_id
        error = msg.error
        if msg.requeue:
            outcome = "requeue"
        elif error is not None:
            outcome = "retryable" if msg.retryable else "error"
        else:
            outcome = "ok"
            self._results[task_id] = msg.results or []
        self._handle(M.TaskFinished("task-done", task_id, outcome, msg.took, error,
                                    time.monotonic()))
        if outcome == "ok":
            self._results.pop(task_id, None)

    def cancel(self, object_id: str, force: bool = False) -> None:
        """``yr.cancel``: a task still waiting for its arguments is failed here.  ``force``:
        the worker running it ends its process (the task is settled here, so its loss with
        that worker is not counted as a crash of it)."""
        task_id = object_id.split(".", 1)[0]
        task = self.tasks.get(task_id)
        if task is None or task.cancelled:
            return
        task.cancelled = True
        if task.queued:
            self._handle(M.CancelRequested("cancel", task_id, force))
            return
        self.tasks.pop(task_id, None)
        self.waiting -= 1
        error = CancelledError(f"task {task_id} ({task.name}) has been cancelled")
        for entry in task.entries:
            entry.set_error(error)

    def revoke(self, lease_ids: list[str]) -> None:
        """The scheduler wants these leases back."""
        self._handle(M.LeasesRevoked("revoke", tuple(lease_ids)))

    def on_channel_lost(self, worker: str) -> None:
        """The channel to ``worker`` broke (or the scheduler said it is gone)."""
        self._handle(M.WorkerLost("channel-lost", worker, time.monotonic()))

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
        self._events.append(event)
        if self._busy:
            return
        self._busy = True
        try:
            while self._events:
                for ins in self.machine.handle(self._events.popleft()):
                    try:
                        self._do(ins)
                    except Exception:
                        logger.exception("submitter: cannot carry out %r", ins)
        finally:
            self._busy = False

    def _do(self, ins: Any) -> None:
        kind = type(ins)
        if kind is M.PushTask:
            self._push(ins)
        elif kind is M.TaskSucceeded:
            task = self.tasks.pop(ins.task_id, None)
            results = self._results.pop(ins.task_id, ())
            if task is None:
                return
            for oid, entry, (rkind, payload) in zip(task.ref_ids, task.entries, results):
                entry.set_result(rkind, payload)
                if rkind != P.LOCATION or task.nret < 0:
                    continue
                if entry.refs <= 0 and self.rt.objects.entries.get(oid) is not entry:
                    self.rt.free_remote(payload, [oid])  # dropped while it ran, and not lent
                else:
                    self.lineage[oid] = task
        elif kind is M.TaskFailed:
            task = self.tasks.pop(ins.task_id, None)
            if task is None:
                return
            error = ins.error
            if isinstance(error, (bytes, bytearray, memoryview)):
                error = loads(error)
            if type(error) is TaskCrashedError:  # say how the process ended, when known
                self.rt.with_exit_reason(error, failing_entries(task.entries))
                return
            for entry in task.entries:
                entry.set_error(error)
        elif kind is M.RequestLease:
            self.rt.loop.create_task(self._request_lease(ins))
        elif kind is M.ReturnLeases:
            self.rt.connector.return_leases(list(ins.lease_ids))
        elif kind is M.SendCancel:
            self.rt.channel(ins.worker).send(P.CancelTask(ins.task_id, ins.force))
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
            entry = self.rt.objects.entries.get(oid)
            if entry is None:
                del self.lineage[oid]
                continue
            if entry.state != P.LOCATION or entry.location != worker or entry.has_value:
                continue
            if node_store().contains(oid):  # still in this node's store: readers map it
                continue
            del self.lineage[oid]
            handled.append(oid)
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
        for task in again.values():
            task.rebuilt += 1
            self.tasks[task.task_id] = task
            _resources, _timeout, slots, affinity = task.shape_key
            self._handle(M.TaskQueued("reconstruct", task.task_id, task.shape_key, task.shape,
                                      task.timeout_ms, slots, affinity, task.retries, None,
                                      task.name, task.max_crashes))
        return handled

    def _push(self, ins: M.PushTask) -> None:
        task = self.tasks[ins.task_id]
        chan = self.rt.channel(ins.worker)
        fn = None if task.fn_id in chan.sent_functions else task.fn_payload
        chan.sent_functions.add(task.fn_id)
        chan.send(P.RunTask(task.task_id, ins.lease_id, task.fn_id, fn, task.args, task.deps,
                            task.nret, task.owner, task.name, ins.slots, task.log_to))

    async def _request_lease(self, ins: M.RequestLease) -> None:
        try:
            lease_id, where = await self.rt.connector.request_lease(
                ins.shape, ins.timeout_ms, ins.queue, list(ins.avoid), ins.affinity, ins.near)
        except Exception as e:  # scheduler unreachable
            lease_id, where = None, f"lease request failed: {e!r}"
        if lease_id is None:
            self._handle(M.LeaseRefused("lease-refused", ins.request_id, str(where)))
        else:
            self._handle(M.LeaseGranted("lease-granted", ins.request_id, lease_id, where,
                                        time.monotonic()))

    def _wake_at(self, at: float) -> None:
        """One loop timer, for the earliest time the machine asked for."""
        if self.closed:
            return
        if self._timer is not None:
            if self._timer_at <= at:
                return
            self._timer.cancel()
        self._timer_at = at
        self._timer = self.rt.loop.call_later(max(0.0, at - time.monotonic()), self._tick)

    def _tick(self) -> None:
        self._timer = None
        self._handle(M.Tick("tick", time.monotonic()))


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
