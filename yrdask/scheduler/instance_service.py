"""The instance adapter's decisions, apart from its I/O: what the scheduler does with the
lifecycle's instructions and how it answers the instance rpcs.

``scheduler/lifecycle.py`` (:class:`~yrdask.scheduler.lifecycle.Lifecycle`) decides what
happens to instances; this class decides what the adapter around it does: which creations it
refuses before asking (their job has ended), when a locate waits (for a creation it overtook,
for Dask to confirm a lost worker), when an acquire is skipped (cancelled before it started)
or its grant turned into a loss (the worker went meanwhile), which stops are sent and which
are settled at once, what a started instance is told (restart count, checkpoint, devices).
Answers go to callbacks, called exactly once.  It does no I/O itself: a small
:class:`InstanceServiceEdge` carries it out (the clock, timers, ``START_INSTANCE``, ``STOP_INSTANCE``,
resources through the lease service, Dask's view of the workers).  The Dask adapter
(``scheduler/instance_manager.py``) plugs in its loop, streams and rpcs; the simulation
(``tests/sim/calls.py``) plugs in its virtual clock and links, so it drives this very code.
"""

from __future__ import annotations

import collections
import itertools
import logging
from typing import Any, Callable, Protocol

from yrdask import protocol as P
from yrdask.scheduler import lifecycle as L
from yrdask.scheduler.requests import LeaseRequest, freeze, shape_of

logger = logging.getLogger("yrdask.instances")

LOST_WORKER_WAIT_S = 30.0  # how long a locate waits for Dask to confirm a lost worker
ENDED_JOBS_KEPT = 10_000

Reply = Callable[[list], None]
StageAnswer = Callable[[Any, str], None]  # (worker or None, reason)

#: the scheduler rpcs :class:`InstanceService` answers through a callback given first
#: (``handler(answer, **fields)``): the Dask adapter awaits it, the simulation sends it back
RPC_OPS = (P.CREATE_INSTANCE, P.LOCATE_INSTANCE, P.KILL_INSTANCE)
#: the ops :class:`InstanceService` handles as they come (``handler(**fields)``; a stream's
#: sender as ``worker=`` or ``holder=``): the extension's tables and the simulation's take
#: them from it
OPS = (P.SAVE_STATE, P.HANDLE_REFS, P.INSTANCE_STATE)


class InstanceServiceEdge(Protocol):
    """What :class:`InstanceService` needs of the world around it."""

    def now(self) -> float:
        """The clock of the lifecycle's times (wall clock in production)."""

    def call_at(self, at: float, fn: Callable[[], None]) -> None:
        """Call ``fn`` at (or after) ``at`` on that clock."""

    def soon(self, fn: Callable[[], None]) -> None:
        """Call ``fn`` on a later turn (an acquire runs as a task of its own)."""

    def is_worker(self, worker: str) -> bool:
        """``worker`` is one the cluster has not removed."""

    def acquire(self, req: LeaseRequest, timeout_ms: int, answer: Reply) -> None:
        """Ask the lease service for ``req`` (sets ``req.request_id`` before it returns);
        ``answer([holding_id, worker] | [None, reason])`` comes on a later turn."""

    def cancel_acquire(self, req: LeaseRequest) -> None:
        """Withdraw ``req``: its answer becomes ``[None, reason]`` unless already given."""

    def release(self, holding_ids: list[str]) -> None:
        """Give the holdings of ended instances back."""

    def start_instance(self, worker: str, spec: dict) -> None:
        """``START_INSTANCE`` on ``worker``'s stream (dropped if it has none)."""

    def crash_instance(self, worker: str, instance_id: str, reason: str,
                       incarnation: int) -> None:
        """``CRASH_INSTANCE`` on ``worker``'s stream (dropped if it has none: its loss is
        the crash)."""

    def stop_instance(self, worker: str, instance_id: str, reason: str,
                      force: bool = False) -> None:
        """``STOP_INSTANCE`` rpc to ``worker`` (``force``: without its shutdown hook); once
        it returned or failed, the edge calls :meth:`InstanceService.stopped`."""

    def worker_gone(self, worker: str, timeout: float, then: Callable[[], None],
                    server_id: str = "") -> None:
        """Call ``then`` once the cluster removed ``worker`` or ``timeout`` s passed; at once
        if the process registered at ``worker`` now is not ``server_id`` (when given): that
        one was removed already, and a new one took its address."""

    def broadcast(self, msg: Any) -> None:
        """Send ``msg`` (a :class:`~yrdask.protocol.Message`) to every driver and worker."""

    def after_feed(self) -> None:
        """Called after every lifecycle event (the simulation checks what it ended)."""


class InstanceService:
    """Feeds the :class:`~yrdask.scheduler.lifecycle.Lifecycle` and carries out its
    instructions through an :class:`InstanceServiceEdge`; see module docstring.

    ``ledger``: the lease queue's ledger, read for the devices an instance holds.
    """

    def __init__(self, edge: InstanceServiceEdge, lifecycle: L.Lifecycle | None = None,
                 ledger: Any = None) -> None:
        self.edge = edge
        self.lifecycle = lifecycle if lifecycle is not None else L.Lifecycle()
        self.ledger = ledger
        # (instance id, stage) -> callbacks (worker, reason) waiting for it
        self.waiters: dict[tuple[str, str], list[StageAnswer]] = {}
        self.requests: dict[str, LeaseRequest] = {}  # instance id -> its waiting acquire
        # Instances whose CancelAcquire came before their acquire task ran (sim finding D).
        self.cancelled_early: set[str] = set()
        # Jobs whose stream closed, newest last (bounded): a creation rpc that arrives after
        # its job ended is refused instead of outliving it (sim finding E).
        self.ended_jobs: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._stop_waiters: dict[str, list[Callable[[], None]]] = {}  # iid -> after Stopped
        self._ids = itertools.count(1)
        # Told of creations, checkpoints and ends, to keep what outlives the scheduler
        # (scheduler/durable.py: DurableControl, or None).
        self.durable: Any = None

    def _sid(self, what: str) -> str:
        return f"{what}-{next(self._ids)}"

    # -- rpcs ------------------------------------------------------------------------------

    def create(self, spec: dict, reply: Reply) -> None:
        """``CREATE_INSTANCE``: ``reply([instance_id, worker, meta])`` once placed (the id
        an alias stands for), or ``reply([None, reason, None])``."""
        owner = spec.get("owner")
        if owner in self.ended_jobs:  # the rpc came after its job's stream closed
            reply([None, f"instance {spec['instance_id']} was not created: its job {owner} "
                         "has ended", None])
            return
        lc = self.lifecycle
        self.feed(L.Create(self._sid("create"), spec, self.edge.now()))
        real_id = lc.resolve(spec["instance_id"])
        rec = lc.instances.get(real_id)
        if (self.durable is not None and real_id == spec["instance_id"] and rec is not None
                and rec.state != P.DEAD):
            self.durable.instance_created(rec)
        meta = rec.spec.get("meta") if rec is not None else spec.get("meta")

        def placed(worker: Any, reason: str) -> None:
            if worker is None:
                ended = lc.instances.get(real_id)
                if ended is not None and ended.worker is not None:
                    # placed, and it ended before it served (a process instance whose
                    # process died in __init__): its worker answers its calls with the end
                    worker = ended.worker
            reply([real_id, worker, meta] if worker is not None else [None, reason, None])
        self.wait(real_id, L.PLACED, placed)

    def locate(self, instance_id: str, lost: str | None, reply: Reply,
               lost_server_id: str = "") -> None:
        """``LOCATE_INSTANCE``: ``reply([state, worker, reason, instance_id])`` (the id an
        alias stands for).  ``lost``: the caller lost its channel to that worker (the process
        ``lost_server_id``, if it says); if the instance is still recorded there, wait until
        the cluster removed that process (the instance then restarts or ends), within
        :data:`LOST_WORKER_WAIT_S`: not at all if a new process took its address already."""
        lc = self.lifecycle
        if lc.unknown(lc.resolve(instance_id)):
            # never seen: its CREATE_INSTANCE (an rpc of its own) may still be on the way,
            # behind the handle that reached this caller; wait for it, within a bound
            def created(_worker: Any, reason: str) -> None:
                if reason:
                    reply([P.DEAD, None, reason, instance_id])
                else:
                    self._locate_known(instance_id, lost, reply, lost_server_id)
            self.waiters.setdefault((instance_id, L.CREATED), []).append(created)
            self.feed(L.AwaitCreation(self._sid("await"), instance_id, self.edge.now()))
            return
        self._locate_known(instance_id, lost, reply, lost_server_id)

    def _locate_known(self, instance_id: str, lost: str | None, reply: Reply,
                      lost_server_id: str = "") -> None:
        lc = self.lifecycle
        real_id = lc.resolve(instance_id)

        def placed(worker: Any, reason: str) -> None:
            if worker is None:
                reply([P.DEAD, None, reason, real_id])
            else:
                status = lc.status(real_id)
                reply([status["state"], worker, status["reason"], real_id])

        def go() -> None:
            self.wait(real_id, L.PLACED, placed)
        rec = lc.instances.get(real_id)
        if rec is None or lost is None:
            go()
        elif L.runs_alone(rec.spec) and lost != rec.worker:
            self._wait_new_endpoint(real_id, lost, placed)
        elif rec.worker == lost:
            self.edge.worker_gone(lost, LOST_WORKER_WAIT_S, go, lost_server_id)
        else:
            go()

    def _wait_new_endpoint(self, iid: str, lost: str, answer: StageAnswer) -> None:
        """A caller lost its channel to the process of ``iid`` (at ``lost``): answer where
        the next one serves (its worker restarts it, or it was placed anew), or its end.
        A caller can hear of the death before the worker reports it: while the instance is
        still recorded at ``lost`` it waits, within :data:`LOST_WORKER_WAIT_S`."""
        done = False

        def once(where: Any, reason: str) -> None:
            nonlocal done
            if done:
                return
            if where == lost and reason == "":  # still that process: wait on
                self.waiters.setdefault((iid, L.PLACED), []).append(once)
                return
            done = True
            answer(where, reason)

        def bound() -> None:
            nonlocal done
            if not done:
                done = True
                self.wait(iid, L.PLACED, answer)

        self.wait(iid, L.PLACED, once)
        if not done:
            self.edge.call_at(self.edge.now() + LOST_WORKER_WAIT_S, bound)

    def create_instance(self, answer: Reply, spec: dict) -> None:
        """:class:`~yrdask.protocol.CreateInstance`: :meth:`create`."""
        self.create(spec, answer)

    def locate_instance(self, answer: Reply, instance_id: str, lost: str | None = None,
                        lost_server_id: str = "") -> None:
        """:class:`~yrdask.protocol.LocateInstance`: :meth:`locate`."""
        self.locate(instance_id, lost, answer, lost_server_id)

    def kill_instance(self, answer: Callable[[None], None], instance_id: str,
                      reason: str = "terminated", restart: bool = False,
                      force: bool = False) -> None:
        """:class:`~yrdask.protocol.KillInstance`: :meth:`kill`, answered once the stops
        returned; ``restart``: :meth:`crash` instead, answered at once."""
        if restart:
            self.crash(instance_id, reason)
            answer(None)
            return
        self.kill(instance_id, reason, lambda: answer(None), force)

    def kill(self, instance_id: str, reason: str, done: Callable[[], None],
             force: bool = False) -> None:
        """``KILL_INSTANCE``: end it and its non-detached descendants; ``done()`` once the
        stops sent for them returned (``force``: it goes without its shutdown hook)."""
        stops = self.feed(L.Kill(self._sid("kill"), instance_id, reason, force))
        if not stops:
            done()
            return
        left = set(stops)

        def one_stopped(iid: str) -> None:
            left.discard(iid)
            if not left:
                done()
        for iid in stops:
            self._stop_waiters.setdefault(iid, []).append(lambda iid=iid: one_stopped(iid))

    def crash(self, instance_id: str, reason: str) -> None:
        """``KILL_INSTANCE`` with ``restart``: its process is killed as if it crashed (the
        restart, or its end, follows the death the worker reports)."""
        self.feed(L.Crash(self._sid("crash"), instance_id, reason))

    def save_state(self, instance_id: str, state: bytes) -> None:
        """Keep an instance's checkpoint; a restart resumes from it instead of ``__init__``."""
        if not self.lifecycle.is_live(instance_id):
            raise RuntimeError(f"instance {instance_id} has ended; its state was not saved")
        self.feed(L.SaveState(self._sid("save"), instance_id, state))
        if self.durable is not None:
            self.durable.instance_saved(self.lifecycle.instances[instance_id])

    def move(self, instance_id: str, worker: str, state: bytes, avoid: tuple,
             placed: StageAnswer) -> None:
        """Scale-down: the instance drained on ``worker`` moves with ``state``, never to
        ``avoid``; ``placed(new_worker, "")`` once it has a new home, or ``placed(None,
        reason)`` if the move did not happen (it ended, or was not movable)."""
        self.feed(L.Move(self._sid("move"), instance_id, worker, state, tuple(avoid)))
        rec = self.lifecycle.instances.get(instance_id)
        if rec is not None and rec.state != P.DEAD and rec.moving_from is None:
            placed(None, "it was not moved: it is not alive on that worker any more")
            return
        self.wait(instance_id, L.PLACED, placed)

    def wait(self, iid: str, stage: str, answer: StageAnswer) -> None:
        """``answer(worker, "")`` once ``iid`` reached ``stage`` (now, if it has), or
        ``answer(None, reason)`` if it ended."""
        now = self.lifecycle.answer(iid, stage)
        if now is not None:
            answer(*now)
        else:
            self.waiters.setdefault((iid, stage), []).append(answer)

    # -- streams and the cluster's events --------------------------------------------------

    def handle_refs(self, deltas: dict, transit: Any = (), arrived: Any = (),
                    worker: str | None = None, holder: str | None = None) -> None:
        """:class:`~yrdask.protocol.HandleRefs` from a worker's stream (``worker``) or a
        job's (``holder``)."""
        self.feed(L.HandleRefs(self._sid("refs"), worker or holder, deltas, transit, arrived,
                               self.edge.now()))

    def instance_state(self, instance_id: str, state: str, error: Any = None,
                       worker: str | None = None, reason: str = "", incarnation: int = -1,
                       address: str = "") -> None:
        """:class:`~yrdask.protocol.InstanceState` from ``worker``: ALIVE (``error``:
        ``__init__`` raised; ``address``: where its own process serves), EXITED, or
        RESTARTING (its isolated process of restart ``incarnation`` died; the worker lives).
        A process instance's process that ended: its callers lost their channels to it, and
        their errors say how it ended (as for a worker process, :class:`P.WorkerExit`)."""
        if address and state != P.ALIVE and reason:
            self.edge.broadcast(P.WorkerExit(address, reason))
        failed = error is not None
        sid = self._sid(f"state-{state}")
        if state == "EXITED":
            event: Any = L.InstanceExited(sid, instance_id, worker, reason)
        elif state == P.RESTARTING:
            event = L.ProcessDied(sid, instance_id, worker or "", reason, incarnation)
        else:
            event = L.InstanceStarted(sid, instance_id, worker, failed, address, incarnation)
        self.feed(event)

    def owner_gone(self, owner: str, holder: str | None) -> None:
        """A job's stream closed: its instances end, its process holds no handle."""
        self.ended_jobs[owner] = None
        while len(self.ended_jobs) > ENDED_JOBS_KEPT:
            self.ended_jobs.popitem(last=False)
        self.feed(L.OwnerGone(self._sid("owner-gone"), owner, f"its job {owner} ended"))
        if holder is not None:
            self.feed(L.HolderLost(self._sid("holder-lost"), holder, self.edge.now()))

    def worker_lost(self, worker: str) -> None:
        """The cluster removed ``worker`` (its ledger holdings are gone already)."""
        self.feed(L.WorkerLost(self._sid("worker-lost"), worker, self.edge.now()))

    def release_check(self) -> None:
        self.feed(L.ReleaseCheck(self._sid("release-check"), self.edge.now()))

    def stopped(self, instance_id: str) -> None:
        """The ``STOP_INSTANCE`` rpc returned or failed."""
        self.feed(L.Stopped(self._sid("stopped"), instance_id))
        for then in self._stop_waiters.pop(instance_id, ()):
            then()

    # -- instructions ----------------------------------------------------------------------

    def feed(self, event: Any) -> list[str]:
        """Hand ``event`` to the lifecycle and carry out its instructions; returns the ids
        of the instances whose ``STOP_INSTANCE`` it sent."""
        edge = self.edge
        lc = self.lifecycle
        lc.now = edge.now()
        stops: list[str] = []
        stopped: list[str] = []
        released: list[str] = []
        instructions = lc.handle(event)
        if self.durable is not None and lc.last_ended:
            self.durable.instances_ended(lc.last_ended)
        for ins in instructions:
            kind = type(ins)
            if kind is L.AnswerWaiters:
                for answer in self.waiters.pop((ins.instance_id, ins.stage), ()):
                    answer(ins.worker, ins.reason)
            elif kind is L.AcquireResources:
                self.cancelled_early.discard(ins.instance_id)  # a new acquire for it
                edge.soon(lambda ins=ins: self._acquire(ins))
            elif kind is L.StartInstance:
                edge.start_instance(ins.worker, self.start_spec(ins))
            elif kind is L.StopInstance:
                if edge.is_worker(ins.worker):
                    stops.append(ins.instance_id)
                    if ins.force:
                        edge.stop_instance(ins.worker, ins.instance_id, ins.reason, True)
                    else:
                        edge.stop_instance(ins.worker, ins.instance_id, ins.reason)
                else:
                    stopped.append(ins.instance_id)
            elif kind is L.ReleaseResources:
                released.append(ins.instance_id)
            elif kind is L.CrashInstance:
                edge.crash_instance(ins.worker, ins.instance_id, ins.reason, ins.incarnation)
            elif kind is L.CancelAcquire:
                req = self.requests.pop(ins.instance_id, None)
                if req is not None:
                    edge.cancel_acquire(req)
                else:  # its acquire task has not run yet: it must not ask at all
                    self.cancelled_early.add(ins.instance_id)
            elif kind is L.WakeAt:
                edge.call_at(ins.at, self.release_check)
            else:  # pragma: no cover - a new instruction nobody taught the adapter
                raise AssertionError(f"unknown lifecycle instruction {ins!r}")
        edge.after_feed()
        if released:
            edge.release(released)
        for iid in stopped:
            self.stopped(iid)
        return stops

    def start_spec(self, ins: L.StartInstance) -> dict:
        """The spec ``START_INSTANCE`` carries: a restart's count and checkpoint, and the
        devices the instance holds (docs/nodes.md)."""
        spec = ins.spec
        if ins.incarnation or ins.checkpoint is not None:
            spec = {**spec, "checkpoint": ins.checkpoint, "incarnation": ins.incarnation}
        if ins.incarnation:
            logger.info("restarting instance %s (%s), restart %d", ins.instance_id,
                        spec.get("cls_name"), ins.incarnation)
        held = self.ledger.holdings.get(ins.instance_id) if self.ledger is not None else None
        if held is not None and held.gpus:
            spec = {**spec, "devices": ",".join(held.gpu_ids),
                    "cpus": held.shape.get("CPU", 0.0) / 1000}
        return spec

    def _acquire(self, ins: L.AcquireResources) -> None:
        """The acquire task starts: ask for the instance's resources, unless it was
        cancelled before it ran."""
        iid = ins.instance_id
        if iid in self.cancelled_early:
            self.cancelled_early.discard(iid)
            return
        rec = self.lifecycle.instances.get(iid)
        label = (rec.spec.get("cls_name") or "") if rec is not None else ""
        req = LeaseRequest(iid, shape_of(ins.shape), kind="instance", holding_id=iid,
                           affinity=freeze(ins.affinity or ()), labels=tuple(ins.labels),
                           avoid=tuple(ins.avoid),
                           label=label)
        self.requests[iid] = req
        self.edge.acquire(req, ins.timeout_ms, lambda result: self._acquired(iid, req, result))

    def _acquired(self, iid: str, req: LeaseRequest, result: list) -> None:
        if self.requests.get(iid) is req:
            del self.requests[iid]
        got, where = result[0], result[1]
        sid = self._sid("acquired")
        if got is None:
            self.feed(L.PlacementFailed(sid, iid, where))
            return
        self.feed(L.Placed(sid, iid, where))
        if not self.edge.is_worker(where):
            # Granted just before the cluster removed that worker, whose loss the lifecycle
            # has already handled: the instance is lost with it (restart or end by budget).
            self.feed(L.WorkerLost(self._sid("placed-on-lost"), where, self.edge.now()))
