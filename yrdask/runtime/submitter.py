"""Task submission: queues by resource shape, worker leases, pushes, retries and cancels.

How a task travels (all on the runtime's event loop thread):

1. ``submit`` waits for the task's top-level ref arguments (the owner resolves them, as in
   Ray), then queues the task under its *shape key* (resources + schedule timeout).
2. A queue with work and no idle lease asks the scheduler for a lease (``REQUEST_LEASE``),
   at most ``max_pending_requests`` at a time per shape.  A lease is the right to run tasks
   of that shape on one worker (up to the shape's ``concurrency`` at once, default 1),
   with the resources already accounted.
3. An idle lease takes the next task and pushes it (``RUN_TASK``) over the call channel to
   its worker; ``TASK_DONE`` comes back on the same channel, and the lease takes the next.
   Short tasks (their queue's average run time on the worker under ``pipeline_below_s``) are
   *pipelined* when there is a backlog: a lease gets up to ``pipeline_depth`` tasks per
   slot pushed at once, and the worker's lease gate starts each as the previous ends, so
   the round trip is hidden.  Long tasks are not: they would wait behind each other on one
   lease while another worker could run them.
4. Leases idle for ``lease_idle_s`` go back to the scheduler, and at once when the scheduler
   revokes them because someone else waits.
5. A lost channel (worker died) puts its in-flight tasks back in their queues, not counted
   against ``retry_times``, and lease requests avoid that worker for ``avoid_lost_s`` (the
   scheduler may not have noticed its death yet); a user exception reruns the task while
   ``retry_times`` lasts.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from yrdask import protocol as P
from yrdask.runtime.objects import Entry, dep_of, failed_dep, when_ready
from yrdask.errors import CancelledError, ScheduleError
from yrdask.serialization import loads

logger = logging.getLogger("yrdask.submitter")


@dataclass(eq=False)
class Task:
    """One stateless call on its way to a worker."""

    task_id: str
    fn_id: str
    fn_payload: bytes
    name: str
    args: bytes
    dep_refs: list  # ObjectRefs of top-level ref arguments (kept alive until pushed)
    entries: list[Entry]  # one per return value
    ref_ids: list[str]
    nret: int
    shape: dict[str, float]
    shape_key: tuple
    timeout_ms: int
    retries_left: int
    owner: str  # lifetime owner (job or instance id) for work created by the task
    deps: list | None = None
    lease: "Lease | None" = None
    cancelled: bool = False


@dataclass(eq=False)
class Lease:
    """The right to run tasks of one shape on one worker, granted by the scheduler."""

    lease_id: str
    worker: str
    shape_key: tuple
    slots: int = 1  # the shape's concurrency: tasks this lease runs at once
    tasks: set = field(default_factory=set)
    idle_since: float = field(default_factory=time.monotonic)
    revoked: bool = False


@dataclass(eq=False)
class ShapeQueue:
    shape: dict[str, float]
    timeout_ms: int
    slots: int = 1
    name: str = ""
    affinity: tuple = ()
    queue: deque = field(default_factory=deque)
    leases: list[Lease] = field(default_factory=list)
    requesting: int = 0
    avg_s: float | None = None  # moving average of its tasks' run time on the worker


def _data_home(sq: ShapeQueue) -> str | None:
    """The worker keeping the large arguments of the queue's next task, if any: leasing
    there saves moving them."""
    if sq.queue:
        for _oid, kind, payload in sq.queue[0].deps or ():
            if kind == P.LOCATION:
                return payload
    return None


class Submitter:
    """Per-process task submission engine (see module docstring)."""

    max_pending_requests = 4
    pipeline_depth = 4
    pipeline_below_s = 0.005
    avoid_lost_s = 30.0

    def __init__(self, runtime: Any, lease_idle_s: float = 1.0) -> None:
        self.rt = runtime
        self.lease_idle_s = lease_idle_s
        self.shapes: dict[tuple, ShapeQueue] = {}
        self.leases: dict[str, Lease] = {}
        self.running: dict[str, Task] = {}
        self.queued: dict[str, Task] = {}
        self._reaper: asyncio.TimerHandle | None = None
        self.closed = False
        self.counts = {"local": 0, "forwarded": 0, "lease_requests": 0}
        self.lost: dict[str, float] = {}  # worker -> until when lease requests avoid it

    # -- entry points (loop thread) --------------------------------------------------------

    def submit(self, task: Task) -> None:
        self.queued[task.task_id] = task
        when_ready(task.dep_refs, lambda: self._deps_ready(task))

    def _deps_ready(self, task: Task) -> None:
        if task.cancelled:
            return
        error = failed_dep(task.dep_refs)
        if error is not None:
            self._fail(task, error)
            return
        task.deps = [dep_of(ref) for ref in task.dep_refs]
        task.dep_refs = []
        sq = self.shapes.get(task.shape_key)
        if sq is None:
            _resources, _timeout, slots, affinity = task.shape_key
            sq = self.shapes[task.shape_key] = ShapeQueue(
                task.shape, task.timeout_ms, slots, f"q{len(self.shapes)}", affinity)
        sq.queue.append(task)
        self._dispatch(sq)

    def on_task_done(self, msg: dict) -> None:
        task = self.running.pop(msg["task_id"], None)
        if task is None:
            return
        lease = task.lease
        task.lease = None
        sq = self.shapes.get(task.shape_key)
        if msg.get("requeue"):  # pipelined behind a long task: run it elsewhere, unpipelined
            if sq is not None:
                sq.avg_s = max(sq.avg_s or 0.0, 1.0)
            if not task.cancelled:
                self._requeue(task)
            if lease is not None:
                self._lease_free(lease, task)
            return
        took = msg.get("took")
        if sq is not None and took is not None:
            sq.avg_s = took if sq.avg_s is None else 0.8 * sq.avg_s + 0.2 * took
        error = msg.get("error")
        if error is not None and msg.get("retryable") and task.retries_left > 0 and not task.cancelled:
            task.retries_left -= 1
            self._requeue(task)
        elif error is not None:
            self._fail(task, loads(error))
        else:
            for oid, entry, (kind, payload) in zip(task.ref_ids, task.entries, msg["results"]):
                entry.set_result(kind, payload)
                if kind == P.LOCATION and entry.refs <= 0:
                    self.rt.free_remote(payload, [oid])
        if lease is not None:
            self._lease_free(lease, task)

    def cancel(self, object_id: str) -> None:
        task_id = object_id.split(".", 1)[0]
        task = self.queued.pop(task_id, None) or self.running.get(task_id)
        if task is None or task.cancelled:
            return
        task.cancelled = True
        if task.lease is not None:
            self.rt.channel(task.lease.worker).send({"op": P.CANCEL_TASK, "task_id": task_id})
        else:
            sq = self.shapes.get(task.shape_key)
            if sq is not None and task in sq.queue:
                sq.queue.remove(task)
        for entry in task.entries:
            entry.set_error(CancelledError(f"task {task_id} ({task.name}) has been cancelled"))

    def revoke(self, lease_ids: list[str]) -> None:
        """The scheduler wants these leases back: return the idle ones now."""
        for lease_id in lease_ids:
            lease = self.leases.get(lease_id)
            if lease is None:
                continue
            lease.revoked = True
            if not lease.tasks:
                self._return([lease])

    def on_channel_lost(self, worker: str) -> None:
        """The worker is gone: its leases are void and their tasks run again elsewhere."""
        self.lost[worker] = time.monotonic() + self.avoid_lost_s
        lost = [l for l in self.leases.values() if l.worker == worker]
        for lease in lost:
            self._drop(lease)
            for task in list(lease.tasks):
                self.running.pop(task.task_id, None)
                task.lease = None
                if not task.cancelled:
                    self._requeue(task)
        for sq in self.shapes.values():
            self._dispatch(sq)

    def close(self) -> None:
        self.closed = True
        if self._reaper is not None:
            self._reaper.cancel()
        leases = list(self.leases.values())
        for lease in leases:
            self._drop(lease)
        if leases:
            self.rt.connector.return_leases([l.lease_id for l in leases])

    def figures(self) -> dict:
        """Scheduling figures of this process: tasks run on its own worker vs elsewhere."""
        return {**self.counts, "queued": len(self.queued), "running": len(self.running),
                "leases": len(self.leases)}

    # -- internals -------------------------------------------------------------------------

    def _requeue(self, task: Task) -> None:
        self.queued[task.task_id] = task
        sq = self.shapes[task.shape_key]
        sq.queue.appendleft(task)
        self._dispatch(sq)

    def _fail(self, task: Task, error: Any) -> None:
        self.queued.pop(task.task_id, None)
        for entry in task.entries:
            entry.set_error(error)

    def _dispatch(self, sq: ShapeQueue) -> None:
        self._fill(sq, sq.leases)
        needed = -(-len(sq.queue) // sq.slots)  # leases to run the backlog at once
        want = min(needed, self.max_pending_requests) - sq.requesting
        for _ in range(max(0, want)):
            sq.requesting += 1
            self.rt.loop.create_task(self._request_lease(sq))

    def _fill(self, sq: ShapeQueue, leases: list[Lease]) -> None:
        """Give leases tasks to run, then, for short tasks with a backlog, to pipeline."""
        leases = [lease for lease in leases if not lease.revoked]
        for lease in leases:
            while sq.queue and len(lease.tasks) < lease.slots:
                self._push(lease, sq.queue.popleft())
        if not sq.queue or sq.avg_s is None or sq.avg_s > self.pipeline_below_s:
            return
        for depth in range(2, self.pipeline_depth + 1):  # round robin over the leases
            for lease in leases:
                if not sq.queue:
                    return
                while sq.queue and len(lease.tasks) < lease.slots * depth:
                    self._push(lease, sq.queue.popleft())

    def _push(self, lease: Lease, task: Task) -> None:
        self.queued.pop(task.task_id, None)
        lease.tasks.add(task)
        task.lease = lease
        self.running[task.task_id] = task
        self.counts["local" if lease.worker == self.rt.local_worker else "forwarded"] += 1
        chan = self.rt.channel(lease.worker)
        fn = None if task.fn_id in chan.sent_functions else task.fn_payload
        chan.sent_functions.add(task.fn_id)
        chan.send({
            "op": P.RUN_TASK, "task_id": task.task_id, "lease_id": lease.lease_id,
            "fn_id": task.fn_id, "fn": fn, "args": task.args, "deps": task.deps,
            "nret": task.nret, "owner": task.owner, "name": task.name, "slots": lease.slots,
        })

    async def _request_lease(self, sq: ShapeQueue) -> None:
        self.counts["lease_requests"] += 1
        now = time.monotonic()
        self.lost = {w: t for w, t in self.lost.items() if t > now}
        try:
            lease_id, where = await self.rt.connector.request_lease(
                sq.shape, sq.timeout_ms, sq.name, list(self.lost), sq.affinity,
                _data_home(sq))
        except Exception as e:  # scheduler unreachable
            lease_id, where = None, f"lease request failed: {e!r}"
        finally:
            sq.requesting -= 1
        if self.closed:
            if lease_id is not None:
                self.rt.connector.return_leases([lease_id])
            return
        if lease_id is None:
            if not sq.leases and sq.requesting == 0:
                err = ScheduleError(where)
                while sq.queue:
                    self._fail(sq.queue.popleft(), err)
            return
        if not sq.queue:  # the backlog went elsewhere meanwhile: don't sit on resources
            self.rt.connector.return_leases([lease_id])
            return
        key = next(k for k, v in self.shapes.items() if v is sq)
        lease = Lease(lease_id, where, key, sq.slots)
        self.leases[lease_id] = lease
        sq.leases.append(lease)
        self.rt.channel(where)  # open the channel early
        self._lease_free(lease)
        self._arm_reaper()

    def _lease_free(self, lease: Lease, task: Task | None = None) -> None:
        lease.tasks.discard(task)
        lease.idle_since = time.monotonic()
        sq = self.shapes.get(lease.shape_key)
        if sq is None or (lease.revoked and not lease.tasks):
            self._return([lease])
        elif not lease.revoked:
            self._fill(sq, [lease])

    def _return(self, leases: list[Lease]) -> None:
        for lease in leases:
            self._drop(lease)
        self.rt.connector.return_leases([l.lease_id for l in leases])

    def _drop(self, lease: Lease) -> None:
        self.leases.pop(lease.lease_id, None)
        sq = self.shapes.get(lease.shape_key)
        if sq is not None and lease in sq.leases:
            sq.leases.remove(lease)

    def _arm_reaper(self) -> None:
        if self._reaper is None and not self.closed:
            self._reaper = self.rt.loop.call_later(self.lease_idle_s / 2, self._reap)

    def _reap(self) -> None:
        self._reaper = None
        cutoff = time.monotonic() - self.lease_idle_s
        idle = [l for l in self.leases.values() if not l.tasks and l.idle_since < cutoff]
        if idle:
            self._return(idle)
        if self.leases:
            self._arm_reaper()
