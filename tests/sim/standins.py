"""Minimal stand-ins for SubmitQueue and LeaseQueue, written to the contract of
``docs/state-machines.md``, so the world itself can be tested before (or without) the real
machines.  ``python -m tests.sim --standins`` uses them; CI uses the real ones.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from yrdask.errors import CancelledError, ScheduleError, TaskCrashedError
from yrdask.scheduler.resources import Holding, Ledger
from yrdask.statemachine import Story


# The submit queue's events and instructions are the real ones too: every process runs the
# production submitter (runtime/submitter.py), which knows only those.
from yrdask.runtime import submit_queue as SQ  # noqa: E402

# The lease queue's events and instructions are the real ones: the simulation's scheduler
# runs the production adapter (scheduler/lease_service.py), which knows only those.
from yrdask.scheduler import leases as LQ  # noqa: E402


@dataclass(eq=False)
class _Lease:
    lease_id: str
    worker: str
    key: Any
    slots: int
    tasks: set = field(default_factory=set)
    idle_since: float = 0.0
    revoked: bool = False


class StandinSubmitQueue:
    def __init__(self, local_worker: str | None, *, max_pending_requests: int = 4,
                 lease_idle_s: float = 1.0, avoid_lost_s: float = 30.0,
                 max_crash_retries: int = 3, **_: Any) -> None:
        self.local = self.local_worker = local_worker
        self.max_pending = max_pending_requests
        self.idle_s = lease_idle_s
        self.avoid_s = avoid_lost_s
        self.max_crash = max_crash_retries
        self.tasks: dict[str, Any] = {}  # task id -> [event, retries left, crashes, lease]
        self.queues: dict[Any, deque] = {}
        self.requesting: dict[Any, int] = {}
        self.requests: dict[str, Any] = {}
        self.leases: dict[str, _Lease] = {}
        self.lost: dict[str, float] = {}
        self.cancelled: dict[str, _Lease] = {}  # settled, still running: its slot waits
        self.early: set[str] = set()  # revoked before their grant: revoked after it
        self.closed = False
        self.now = 0.0
        self.ids = 0
        self.story = Story()

    def handle(self, ev: Any) -> list:
        out: list = []
        self.story.log(ev.stimulus_id, ev, [getattr(ev, "task_id", "")])
        getattr(self, "_" + type(ev).__name__)(ev, out)
        return out

    def _TaskQueued(self, ev, out):
        self.tasks[ev.task_id] = [ev, ev.retries, 0, None]
        self.queues.setdefault(ev.key, deque()).append(ev.task_id)
        self._dispatch(ev.key, out)

    def _dispatch(self, key, out):
        q = self.queues.get(key)
        if not q or self.closed:
            return
        for lease in list(self.leases.values()):
            if lease.key != key or lease.revoked:
                continue
            while q and len(lease.tasks) < lease.slots:
                self._push(lease, q.popleft(), out)
        if not q:
            return
        slots = self.tasks[q[0]][0].slots
        want = min(-(-len(q) // slots), self.max_pending) - self.requesting.get(key, 0)
        first = self.tasks[q[0]][0]
        for _ in range(max(0, want)):
            self.ids += 1
            rid = f"r{self.ids}"
            self.requests[rid] = key
            self.requesting[key] = self.requesting.get(key, 0) + 1
            avoid = tuple(w for w, t in self.lost.items() if t > self.now)
            out.append(SQ.RequestLease("d", rid, str(key), first.shape, first.timeout_ms, None,
                                       avoid, ()))

    def _push(self, lease, task_id, out):
        lease.tasks.add(task_id)
        self.tasks[task_id][3] = lease
        out.append(SQ.PushTask("d", task_id, lease.lease_id, lease.worker, lease.slots))

    def _LeaseGranted(self, ev, out):
        key = self.requests.pop(ev.request_id, None)
        if key is None:
            return
        self.requesting[key] -= 1
        if self.closed or not self.queues.get(key):
            out.append(SQ.ReturnLeases("d", (ev.lease_id,)))
            return
        slots = self.tasks[self.queues[key][0]][0].slots
        lease = self.leases[ev.lease_id] = _Lease(ev.lease_id, ev.worker, key, slots,
                                                  idle_since=ev.now)
        self._dispatch(key, out)
        out.append(SQ.WakeAt("d", ev.now + self.idle_s))
        if ev.lease_id in self.early:
            self.early.discard(ev.lease_id)
            self._LeasesRevoked(SQ.LeasesRevoked("d", (ev.lease_id,)), out)

    def _LeaseRefused(self, ev, out):
        key = self.requests.pop(ev.request_id, None)
        if key is None:
            return
        self.requesting[key] -= 1
        if self.requesting[key] == 0 and not any(l.key == key for l in self.leases.values()):
            q = self.queues.get(key, deque())
            while q:
                t = q.popleft()
                del self.tasks[t]
                out.append(SQ.TaskFailed("d", t, ScheduleError(ev.reason)))

    def _free(self, lease, task_id, out):
        lease.tasks.discard(task_id)
        lease.idle_since = self.now
        if lease.lease_id not in self.leases:
            return
        if lease.revoked and not lease.tasks:
            del self.leases[lease.lease_id]
            out.append(SQ.ReturnLeases("d", (lease.lease_id,)))
        else:
            self._dispatch(lease.key, out)
            if not lease.tasks:
                out.append(SQ.WakeAt("d", self.now + self.idle_s))

    def _TaskFinished(self, ev, out):
        self.now = ev.now
        rec = self.tasks.get(ev.task_id)
        if ev.task_id in self.cancelled:  # its cancel settled it: now its slot is free
            self._free(self.cancelled.pop(ev.task_id), ev.task_id, out)
            return
        if rec is None or rec[3] is None:
            return
        lease = rec[3]
        rec[3] = None
        tev = rec[0]
        if ev.outcome == "requeue" or (ev.outcome == "retryable" and rec[1] > 0):
            if ev.outcome == "retryable":
                rec[1] -= 1
            self.queues[tev.key].appendleft(ev.task_id)
        elif ev.outcome == "ok":
            del self.tasks[ev.task_id]
            out.append(SQ.TaskSucceeded("d", ev.task_id))
        else:
            del self.tasks[ev.task_id]
            out.append(SQ.TaskFailed("d", ev.task_id, ev.error))
        self._free(lease, ev.task_id, out)
        self._dispatch(tev.key, out)

    def _CancelRequested(self, ev, out):
        rec = self.tasks.pop(ev.task_id, None)
        if rec is None:
            return
        if rec[3] is None:
            self.queues[rec[0].key].remove(ev.task_id)
        else:
            out.append(SQ.SendCancel("d", ev.task_id, rec[3].worker))
            self.cancelled[ev.task_id] = rec[3]  # the lease runs it until its TASK_DONE
        out.append(SQ.TaskFailed("d", ev.task_id, CancelledError(ev.task_id)))

    def _LeasesRevoked(self, ev, out):
        for lid in ev.lease_ids:
            lease = self.leases.get(lid)
            if lease is None:
                self.early.add(lid)
            else:
                lease.revoked = True
                if not lease.tasks:
                    del self.leases[lid]
                    out.append(SQ.ReturnLeases("d", (lid,)))

    def own_crashes_count(self, worker):
        return False  # every loss is counted alike (the real queue's yr crash rule aside)

    def _WorkerLost(self, ev, out):
        self.now = ev.now
        self.lost[ev.worker] = ev.now + self.avoid_s
        for lease in [l for l in self.leases.values() if l.worker == ev.worker]:
            del self.leases[lease.lease_id]
            for t in list(lease.tasks):
                if self.cancelled.pop(t, None) is not None:
                    continue
                rec = self.tasks[t]
                rec[3] = None
                rec[2] += 1
                if rec[2] > self.max_crash:
                    del self.tasks[t]
                    out.append(SQ.TaskFailed("d", t, TaskCrashedError(f"{t} lost {rec[2]} times")))
                else:
                    self.queues[rec[0].key].appendleft(t)
        for key in list(self.queues):
            self._dispatch(key, out)

    def _Tick(self, ev, out):
        self.now = ev.now
        idle = [l for l in self.leases.values()
                if not l.tasks and l.idle_since + self.idle_s <= ev.now]
        for l in idle:
            del self.leases[l.lease_id]
        if idle:
            out.append(SQ.ReturnLeases("d", tuple(l.lease_id for l in idle)))
        due = min((l.idle_since + self.idle_s for l in self.leases.values() if not l.tasks),
                  default=None)
        if due is not None:  # the earliest idle lease's time (the world's timer check)
            out.append(SQ.WakeAt("d", max(due, ev.now)))

    def _Closing(self, ev, out):
        self.closed = True
        if self.leases:
            out.append(SQ.ReturnLeases("d", tuple(self.leases)))
            self.leases.clear()

    def validate(self) -> None:
        pass


class StandinLeaseQueue:
    def __init__(self) -> None:
        self.ledger = Ledger()
        self.pending: list = []
        self.deadline: dict = {}
        self.ids = 0
        self.story = Story()
        self.unseen: set = set()  # (owner, own id) withdrawn before the request came

    def handle(self, ev: Any) -> list:
        out: list = []
        self.story.log(ev.stimulus_id, ev, [getattr(ev, "request_id", "")])
        getattr(self, "_" + type(ev).__name__)(ev, out)
        return out

    def _grant_pending(self, out):
        for req in list(self.pending):
            w = self.ledger.choose(req.shape, req.local, req.avoid)
            if w is not None:
                self.pending.remove(req)
                self._hold(req, w, out)

    def _hold(self, req, w, out):
        self.ids += 1
        hid = f"L{self.ids}"
        self.ledger.hold(Holding(hid, "lease", w, dict(req.shape), req.owner, queue=req.queue))
        out.append(LQ.Granted("s", req.request_id, hid, w))

    def _WorkerJoined(self, ev, out):
        self.ledger.add_worker(ev.worker, ev.capacity, ev.node or None)
        self._grant_pending(out)

    def _WorkerLeft(self, ev, out):
        self.ledger.remove_worker(ev.worker)
        self._OwnerGone(LQ.OwnerGone(ev.stimulus_id, ev.worker), out)  # its submitter too

    def _HoldRequested(self, ev, out):
        if (ev.owner, ev.own_id) in self.unseen:
            self.unseen.discard((ev.owner, ev.own_id))
            return out.append(LQ.Refused("s", ev.request_id, "withdrawn"))
        shape = {r: float(a) for r, a in ev.shape.items()}
        w = self.ledger.choose(shape, ev.local, ev.avoid)
        if w is not None:
            return self._hold(ev, w, out)
        if self.ledger.workers and not self.ledger.could_ever_fit(shape):
            return out.append(LQ.Refused("s", ev.request_id, self.ledger.explain_unfit(shape)))
        self.pending.append(ev)
        if ev.timeout_ms >= 0:
            self.deadline[ev.request_id] = ev.now + ev.timeout_ms / 1000
            out.append(LQ.WakeAt("s", ev.now + ev.timeout_ms / 1000))
        by_owner: dict = {}
        for h in self.ledger.lease_holders_on_fitting_workers(shape):
            if not (h.owner == ev.owner and h.queue == ev.queue):
                by_owner.setdefault(h.owner, []).append(h.holding_id)
        for owner, ids in by_owner.items():
            out.append(LQ.Revoke("s", owner, tuple(ids)))

    def _HoldingsReleased(self, ev, out):
        for h in ev.holding_ids:
            self.ledger.release(h)
        self._grant_pending(out)

    def _LeaseBlocked(self, ev, out):
        if self.ledger.lend_cpu(ev.lease_id, True):
            self._grant_pending(out)

    def _LeaseUnblocked(self, ev, out):
        self.ledger.lend_cpu(ev.lease_id, False)

    def _OwnerGone(self, ev, out):
        for h in [h for h in self.ledger.holdings.values() if h.owner == ev.owner]:
            self.ledger.release(h.holding_id)
        for req in [r for r in self.pending if r.owner == ev.owner]:
            self.pending.remove(req)
            out.append(LQ.Refused("s", req.request_id, "owner gone"))
        self._grant_pending(out)

    def _RequestWithdrawn(self, ev, out):
        if not ev.request_id:
            self.unseen.add((ev.owner, ev.own_id))
        for req in [r for r in self.pending if r.request_id == ev.request_id]:
            if req.owner == ev.owner:
                self.pending.remove(req)
                out.append(LQ.Refused("s", req.request_id, "withdrawn"))

    def _Tick(self, ev, out):
        for req in list(self.pending):
            at = self.deadline.get(req.request_id)
            if at is None or at > ev.now:
                continue
            if self.ledger.lease_holders_on_fitting_workers(req.shape):
                self.deadline[req.request_id] = ev.now + max(req.timeout_ms, 1000) / 1000
                out.append(LQ.WakeAt("s", self.deadline[req.request_id]))
                continue
            self.pending.remove(req)
            out.append(LQ.Refused("s", req.request_id, self.ledger.explain_unfit(req.shape)))

    def validate(self) -> None:
        pass
