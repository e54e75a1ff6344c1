"""The instance lifecycle's Dask adapter: carries out what :mod:`lifecycle` decides.

Handles ``CREATE_INSTANCE``, ``LOCATE_INSTANCE``, ``GET_NAMED``, ``LIST_NAMED``,
``KILL_INSTANCE``, ``INSTANCE_STATUS``, ``SAVE_STATE``, ``LOAD_STATE`` (scheduler rpc) and
``HANDLE_REFS``, ``INSTANCE_STATE`` (streams), and the extension's owner and worker losses.
Each becomes an event of the :class:`~yrdask.scheduler.lifecycle.Lifecycle` machine; its
instructions become I/O here: resources through the extension (``acquire``/``release``:
an instance holds its resources for its whole life), ``START_INSTANCE`` on the worker's
stream, ``STOP_INSTANCE`` rpcs, timers for the release grace period, and the answers of the
rpcs that wait for a placement (futures keyed by instance and stage).  Rpc answers read the
machine's queries; nothing here writes the machine's state.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from typing import Any

import dask

from yrdask import protocol as P
from yrdask.scheduler import lifecycle as L
from yrdask.scheduler.requests import LeaseRequest, freeze, shape_of

logger = logging.getLogger("yrdask.instances")

LOST_WORKER_WAIT_S = 30.0  # how long a locate waits for Dask to confirm a lost worker


ENDED_JOBS_KEPT = 10_000


class InstanceManager:
    """See module docstring; owned by :class:`~yrdask.scheduler.extension.YrSchedulerExtension`."""

    def __init__(self, ext: Any) -> None:
        self.ext = ext
        self.scheduler = ext.scheduler
        self.lifecycle = L.Lifecycle(ended_kept=int(
            dask.config.get("yrdask.scheduling.ended-instances-kept", L.ENDED_KEPT)))
        self.waiters: dict[tuple[str, str], list[asyncio.Future]] = {}
        self.requests: dict[str, LeaseRequest] = {}  # instance id -> its waiting acquire
        # Instances whose CancelAcquire came before their acquire task ran (sim finding D).
        self.cancelled_early: set[str] = set()
        # Jobs whose stream closed, newest last (bounded): a creation rpc that arrives after
        # its job ended is refused instead of outliving it (sim finding E).
        self.ended_jobs: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._ids = 0
        # Its handlers are registered by the extension, in the tables built from the protocol
        # (P.handlers(P.SCHEDULER_RPC, ext, ext.instances), ...).

    def _handle(self, event: Any) -> list:
        """Feed ``event`` to the lifecycle, stamped with the wall clock (tombstone times)."""
        self.lifecycle.now = time.time()
        return self.lifecycle.handle(event)

    def _sid(self, what: str) -> str:
        self._ids += 1
        return f"{what}-{self._ids}"

    # -- rpcs ------------------------------------------------------------------------------

    async def create_instance(self, spec: dict) -> list:
        """Reply ``[instance_id, worker, meta]`` once placed, or ``[None, reason, None]``."""
        owner = spec.get("owner")
        if owner in self.ended_jobs:  # the rpc came after its job's stream closed
            return [None, f"instance {spec['instance_id']} was not created: its job {owner} "
                          "has ended", None]
        self._do(self._handle(L.Create(self._sid("create"), spec, time.time())))
        real_id = self.lifecycle.resolve(spec["instance_id"])
        rec = self.lifecycle.instances.get(real_id)
        meta = rec.spec.get("meta") if rec is not None else spec.get("meta")
        worker, reason = await self._wait(real_id, L.PLACED)
        if worker is None:
            return [None, reason, None]
        return [real_id, worker, meta]

    async def locate_instance(self, instance_id: str, lost: str | None = None) -> list:
        """Reply ``[state, worker, reason, instance_id]`` (the id an alias stands for).

        ``lost``: the caller lost its channel to that worker; if the instance is still
        recorded there, wait until Dask confirms the worker gone (it then restarts or ends).
        """
        lc = self.lifecycle
        if lc.unknown(lc.resolve(instance_id)):
            # never seen: its CREATE_INSTANCE (an rpc of its own) may still be on the way,
            # behind the handle that reached this caller; wait for it, within a bound
            fut = asyncio.get_running_loop().create_future()
            self.waiters.setdefault((instance_id, L.CREATED), []).append(fut)
            self._do(self._handle(L.AwaitCreation(self._sid("await"), instance_id,
                                                  time.time())))
            _worker, reason = await fut
            if reason:
                return [P.DEAD, None, reason, instance_id]
        real_id = lc.resolve(instance_id)
        rec = lc.instances.get(real_id)
        if rec is not None and lost is not None and rec.worker == lost:
            await self.ext.worker_gone(lost, LOST_WORKER_WAIT_S)
        worker, reason = await self._wait(real_id, L.PLACED)
        if worker is None:
            return [P.DEAD, None, reason, real_id]
        status = lc.status(real_id)
        return [status["state"], worker, status["reason"], real_id]

    def instance_status(self, instance_id: str) -> dict:
        """``{state, worker, restarts, reason, waiting}`` of an instance, without waiting.

        ``waiting`` is why it is not placed yet (see :meth:`LeaseQueue.explain_wait`: what it
        needs, what each worker that could run it lacks, which instances hold it), or "".
        """
        status = dict(self.lifecycle.status(instance_id))
        status["waiting"] = self.waiting_reason(self.lifecycle.resolve(instance_id))
        return status

    def waiting_reason(self, instance_id: str) -> str:
        """Why the instance waits for a worker (one line), or "" if it does not wait."""
        req = self.requests.get(instance_id)
        if req is None or not req.request_id:
            return ""
        why = self.ext.leases.explain_wait(req.request_id, asyncio.get_running_loop().time())
        return why["text"] if why is not None else ""

    def save_state(self, instance_id: str, state: bytes) -> None:
        """Keep an instance's checkpoint; a restart resumes from it instead of ``__init__``."""
        if not self.lifecycle.is_live(instance_id):
            raise RuntimeError(f"instance {instance_id} has ended; its state was not saved")
        self._do(self._handle(L.SaveState(self._sid("save"), instance_id, state)))

    def load_state(self, instance_id: str) -> bytes | None:
        return self.lifecycle.checkpoint_of(instance_id)

    async def get_named(self, name: str, namespace: str, timeout: float) -> list:
        rec = self.lifecycle.named(namespace, name)
        if rec is None:
            return [None, f"failed to get instance: {namespace}-{name} by name, it does not "
                          "exist", "missing"]
        iid, meta = rec.instance_id, rec.spec.get("meta")
        try:
            await self._wait(iid, L.ALIVE_STAGE, timeout)
        except asyncio.TimeoutError:
            return [None, f"failed to get instance: {namespace}-{name} by name within "
                          f"{timeout} s: it is still being created", "timeout"]
        worker, reason = await self._wait(iid, L.PLACED)
        if worker is None:
            return [None, f"instance {iid} ended: {reason}", None]
        return [iid, worker, meta]

    def list_named(self, all_namespaces: bool = False, namespace: str = "") -> list:
        return [[ns, n] for (ns, n) in self.lifecycle.names
                if all_namespaces or ns == namespace]

    async def kill_instance(self, instance_id: str, reason: str = "terminated") -> None:
        """End the instance and its non-detached descendants; reply once they are stopped."""
        stops = self._do(self._handle(L.Kill(self._sid("kill"), instance_id, reason)))
        if stops:
            await asyncio.gather(*stops)

    # -- streams and the extension's events ------------------------------------------------

    def handle_refs(self, deltas: dict, transit: list = (), arrived: list = (),
                    worker: str | None = None, holder: str | None = None) -> None:
        self._do(self._handle(L.HandleRefs(
            self._sid("refs"), worker or holder, deltas, transit, arrived, time.time())))

    def instance_state(self, instance_id: str, state: str, error: Any = None,
                       worker: str | None = None, reason: str = "") -> None:
        sid = self._sid(f"state-{state}")
        if state == "EXITED":
            event: Any = L.InstanceExited(sid, instance_id, worker, reason)
        elif state == P.RESTARTING:  # its isolated process died; the worker lives
            event = L.ProcessDied(sid, instance_id, worker or "", reason)
        else:
            event = L.InstanceStarted(sid, instance_id, worker, error is not None)
        self._do(self._handle(event))

    def on_owner_gone(self, owner: str, holder: str | None) -> None:
        self.ended_jobs[owner] = None
        while len(self.ended_jobs) > ENDED_JOBS_KEPT:
            self.ended_jobs.popitem(last=False)
        self._do(self._handle(L.OwnerGone(self._sid("owner-gone"), owner,
                                                   f"its job {owner} ended")))
        if holder is not None:
            self._do(self._handle(L.HolderLost(self._sid("holder-lost"), holder,
                                                        time.time())))

    def on_worker_lost(self, worker: str) -> None:
        self._do(self._handle(L.WorkerLost(self._sid("worker-lost"), worker,
                                                    time.time())))

    def _release_check(self) -> None:
        self._do(self._handle(L.ReleaseCheck(self._sid("release-check"),
                                                      time.time())))

    # -- instructions ----------------------------------------------------------------------

    def _do(self, instructions: list) -> list[asyncio.Task]:
        """Carry out ``instructions``; returns the tasks of the stops it started."""
        loop = asyncio.get_running_loop()
        stops: list[asyncio.Task] = []
        stopped: list[str] = []
        released: list[str] = []
        for ins in instructions:
            kind = type(ins)
            if kind is L.AnswerWaiters:
                for fut in self.waiters.pop((ins.instance_id, ins.stage), ()):
                    if not fut.done():
                        fut.set_result((ins.worker, ins.reason))
            elif kind is L.AcquireResources:
                self.cancelled_early.discard(ins.instance_id)  # a new acquire for it
                loop.create_task(self._acquire(ins))
            elif kind is L.StartInstance:
                spec = ins.spec
                if ins.incarnation or ins.checkpoint is not None:
                    spec = {**spec, "checkpoint": ins.checkpoint, "incarnation": ins.incarnation}
                if ins.incarnation:
                    logger.info("restarting instance %s (%s), restart %d", ins.instance_id,
                                spec.get("cls_name"), ins.incarnation)
                held = self.ext.ledger.holdings.get(ins.instance_id)
                if held is not None and held.gpus:  # the devices it holds (docs/nodes.md)
                    spec = {**spec, "devices": ",".join(held.gpu_ids),
                            "cpus": held.shape.get("CPU", 0.0) / 1000}
                self._send_worker(ins.worker, P.StartInstance(spec).to_msg())
            elif kind is L.StopInstance:
                if ins.worker in self.scheduler.workers:
                    stops.append(loop.create_task(self._stop(ins)))
                else:
                    stopped.append(ins.instance_id)
            elif kind is L.ReleaseResources:
                released.append(ins.instance_id)
            elif kind is L.CancelAcquire:
                req = self.requests.pop(ins.instance_id, None)
                if req is not None:
                    self.ext.cancel_request(req)
                else:  # its acquire task has not run yet: it must not ask at all
                    self.cancelled_early.add(ins.instance_id)
            elif kind is L.WakeAt:
                loop.call_later(max(0.0, ins.at - time.time()), self._release_check)
            else:  # pragma: no cover - a new instruction nobody taught the adapter
                raise AssertionError(f"unknown instruction {ins!r}")
        if released:
            self.ext.release(released)
        for iid in stopped:
            self._do(self._handle(L.Stopped(self._sid("stopped"), iid)))
        return stops

    async def _acquire(self, ins: L.AcquireResources) -> None:
        iid = ins.instance_id
        if iid in self.cancelled_early:
            self.cancelled_early.discard(iid)
            return
        rec = self.lifecycle.instances.get(iid)
        label = (rec.spec.get("cls_name") or "") if rec is not None else ""
        req = LeaseRequest(iid, shape_of(ins.shape), kind="instance", holding_id=iid,
                           affinity=freeze(ins.affinity or ()), labels=tuple(ins.labels),
                           label=label)
        self.requests[iid] = req
        try:
            got, where = await self.ext.acquire(req, ins.timeout_ms)
        except Exception as e:  # a bug in the ledger must not leave the instance pending
            logger.exception("placing instance %s", iid)
            got, where = None, f"placing it failed: {e!r}"
        finally:
            if self.requests.get(iid) is req:
                del self.requests[iid]
        sid = self._sid("acquired")
        if got is None:
            event: Any = L.PlacementFailed(sid, iid, where)
        else:
            event = L.Placed(sid, iid, where)
        self._do(self._handle(event))
        if got is not None and where not in self.scheduler.workers:
            # Granted just before Dask removed that worker, whose loss the lifecycle has
            # already handled: the instance is lost with it (restart or end by its budget).
            self._do(self._handle(L.WorkerLost(self._sid("placed-on-lost"), where,
                                                        time.time())))

    async def _stop(self, ins: L.StopInstance) -> None:
        try:
            await P.request(self.scheduler.rpc(ins.worker),
                            P.StopInstance(ins.instance_id, ins.reason))
        except Exception as e:  # the worker died meanwhile
            logger.debug("stopping %s on %s: %r", ins.instance_id, ins.worker, e)
        self._do(self._handle(L.Stopped(self._sid("stopped"), ins.instance_id)))

    async def _wait(self, iid: str, stage: str, timeout: float | None = None) -> tuple:
        """``(worker, "")`` once ``iid`` reached ``stage``, or ``(None, reason)`` if it ended."""
        answer = self.lifecycle.answer(iid, stage)
        if answer is not None:
            return answer
        fut = asyncio.get_running_loop().create_future()
        self.waiters.setdefault((iid, stage), []).append(fut)
        return await asyncio.wait_for(fut, timeout)

    def _send_worker(self, worker: str, msg: dict) -> None:
        stream = self.scheduler.stream_comms.get(worker)
        if stream is not None:
            stream.send(msg)
