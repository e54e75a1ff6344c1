"""The instance lifecycle manager's Dask adapter: carries out what :mod:`lifecycle` decides.

Handles ``CREATE_INSTANCE``, ``LOCATE_INSTANCE``, ``GET_NAMED``, ``LIST_NAMED``,
``KILL_INSTANCE``, ``INSTANCE_STATUS``, ``SAVE_STATE``, ``LOAD_STATE`` (scheduler rpc) and
``HANDLE_REFS``, ``INSTANCE_STATE`` (streams), places instances through the extension's
resource ledger (an instance holds its resources for its whole life), starts them on workers
(``START_INSTANCE``), restarts them when their worker dies, and stops them
(``STOP_INSTANCE``).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from yrdask import protocol as P
from yrdask.scheduler.lifecycle import InstanceRecord, Lifecycle
from yrdask.scheduler.requests import LeaseRequest, freeze, shape_of

logger = logging.getLogger("yrdask.instances")

RELEASE_GRACE_S = 0.5  # absorbs reordering between the holders' separate streams
RESTART_TIMEOUT_MS = 60_000  # at least this long to find room for a restarting instance
LOST_WORKER_WAIT_S = 30.0  # how long a locate waits for Dask to confirm a lost worker


class InstanceManager:
    """See module docstring; owned by :class:`~yrdask.scheduler.extension.YrSchedulerExtension`."""

    def __init__(self, ext: Any) -> None:
        self.ext = ext
        self.scheduler = ext.scheduler
        self.lifecycle = Lifecycle()
        self.placed: dict[str, asyncio.Event] = {}
        self.alive: dict[str, asyncio.Event] = {}
        self.scheduler.handlers.update({
            P.CREATE_INSTANCE: self.create_instance,
            P.LOCATE_INSTANCE: self.locate_instance,
            P.GET_NAMED: self.get_named,
            P.LIST_NAMED: self.list_named,
            P.KILL_INSTANCE: self.kill_instance,
            P.INSTANCE_STATUS: self.instance_status,
            P.SAVE_STATE: self.save_state,
            P.LOAD_STATE: self.load_state,
        })
        self.scheduler.stream_handlers.update({
            P.HANDLE_REFS: self.handle_refs,
            P.INSTANCE_STATE: self.instance_state,
        })

    # -- creation and lookup ---------------------------------------------------------------

    async def create_instance(self, spec: dict) -> list:
        name = spec.get("name")
        if name:
            existing = self.lifecycle.named(spec.get("namespace") or "", name)
            if existing is not None:
                self.lifecycle.aliases[spec["instance_id"]] = existing.instance_id
                return await self._where(existing)
        rec = self.lifecycle.add(spec)
        iid = rec.instance_id
        self.placed[iid] = asyncio.Event()
        self.alive[iid] = asyncio.Event()
        got, where = await self.ext.acquire(self._request(spec), spec["timeout_ms"])
        if rec.state == P.DEAD:  # ended while it waited (owner gone, terminated)
            if got is not None:
                self.ext.ledger.release(iid)
                self.ext._grant_pending()
            self.lifecycle.forget(iid)
            self._settle(iid)
            return [None, f"instance {iid} ended before it started: {rec.reason}", None]
        if got is None:
            self.lifecycle.end(iid, where)
            self.lifecycle.forget(iid)
            self._settle(iid)
            return [None, where, None]
        self.lifecycle.placed(iid, where)
        self.placed[iid].set()
        self._send_worker(where, {"op": P.START_INSTANCE, "spec": spec})
        return [iid, where, spec["meta"]]

    @staticmethod
    def _request(spec: dict) -> LeaseRequest:
        iid = spec["instance_id"]
        return LeaseRequest(iid, shape_of(spec["shape"]), kind="instance", holding_id=iid,
                            affinity=freeze(spec.get("affinity") or ()),
                            labels=tuple(spec.get("labels") or ()))

    async def _where(self, rec: InstanceRecord) -> list:
        ev = self.placed.get(rec.instance_id)
        if ev is not None:
            await ev.wait()
        if rec.state == P.DEAD:
            return [None, f"instance {rec.instance_id} ended: {rec.reason}", None]
        return [rec.instance_id, rec.worker, rec.spec["meta"]]

    async def locate_instance(self, instance_id: str, lost: str | None = None) -> list:
        """Reply ``[state, worker, reason, instance_id]`` (the id an alias stands for).

        ``lost``: the caller lost its channel to that worker; if the instance is still
        recorded there, wait until Dask confirms the worker gone (it then restarts or ends).
        """
        instance_id = self.lifecycle.aliases.get(instance_id, instance_id)
        rec = self.lifecycle.instances.get(instance_id)
        if rec is not None and lost is not None and rec.worker == lost:
            await self.ext.worker_gone(lost, LOST_WORKER_WAIT_S)
        if rec is None:
            return [P.DEAD, None, self._why_gone(instance_id), instance_id]
        await self._where(rec)
        return [rec.state, rec.worker, rec.reason, instance_id]

    def instance_status(self, instance_id: str) -> dict:
        """``{state, worker, restarts, reason}`` of an instance, without waiting."""
        instance_id = self.lifecycle.aliases.get(instance_id, instance_id)
        rec = self.lifecycle.instances.get(instance_id)
        if rec is None:
            return {"state": P.DEAD, "worker": None, "restarts": None,
                    "reason": self._why_gone(instance_id)}
        return {"state": rec.state, "worker": rec.worker, "restarts": rec.restarts,
                "reason": rec.reason}

    def _why_gone(self, instance_id: str) -> str:
        reason = self.lifecycle.graveyard.get(instance_id)
        if reason is None:
            return f"instance {instance_id} does not exist (it has ended)"
        return f"it has ended: {reason}"

    def save_state(self, instance_id: str, state: bytes) -> None:
        """Keep an instance's checkpoint; a restart resumes from it instead of ``__init__``."""
        rec = self.lifecycle.instances.get(instance_id)
        if rec is None or rec.state == P.DEAD:
            raise RuntimeError(f"instance {instance_id} has ended; its state was not saved")
        rec.checkpoint = state

    def load_state(self, instance_id: str) -> bytes | None:
        rec = self.lifecycle.instances.get(instance_id)
        return None if rec is None else rec.checkpoint

    async def get_named(self, name: str, namespace: str, timeout: float) -> list:
        rec = self.lifecycle.named(namespace, name)
        if rec is None:
            return [None, f"failed to get instance: {namespace}-{name} by name, it does not "
                          "exist", "missing"]
        ev = self.alive.get(rec.instance_id)  # gone once the instance is running
        try:
            if ev is not None:
                await asyncio.wait_for(ev.wait(), timeout)
        except asyncio.TimeoutError:
            return [None, f"failed to get instance: {namespace}-{name} by name within "
                          f"{timeout} s: it is still being created", "timeout"]
        return await self._where(rec)

    def list_named(self, all_namespaces: bool = False, namespace: str = "") -> list:
        return [[ns, n] for (ns, n) in self.lifecycle.names
                if all_namespaces or ns == namespace]

    # -- ending ----------------------------------------------------------------------------

    async def kill_instance(self, instance_id: str, reason: str = "terminated") -> None:
        instance_id = self.lifecycle.aliases.get(instance_id, instance_id)
        await self.end(self.lifecycle.end(instance_id, reason))

    async def end(self, ended: list[InstanceRecord]) -> None:
        """Release and stop instances the lifecycle has just ended."""
        stops = []
        for rec in ended:
            self.ext.ledger.release(rec.instance_id)
            self._settle(rec.instance_id)
            if rec.worker is not None and rec.worker in self.scheduler.workers:
                stops.append(self._stop(rec))
            else:
                self.lifecycle.forget(rec.instance_id)
        self.ext._grant_pending()
        if stops:
            await asyncio.gather(*stops)

    async def _stop(self, rec: InstanceRecord) -> None:
        try:
            await self.scheduler.rpc(rec.worker).yr_stop_instance(
                instance_id=rec.instance_id, reason=rec.reason)
        except Exception as e:  # the worker died meanwhile
            logger.debug("stopping %s on %s: %r", rec.instance_id, rec.worker, e)
        self.lifecycle.forget(rec.instance_id)

    def end_soon(self, ended: list[InstanceRecord]) -> None:
        if ended:
            self.scheduler.loop.add_callback(self.end, ended)

    def _settle(self, iid: str) -> None:
        for events in (self.placed, self.alive):
            ev = events.pop(iid, None)
            if ev is not None:
                ev.set()

    # -- events from owners, holders and workers ------------------------------------------

    def on_owner_gone(self, owner: str, holder: str | None) -> None:
        self.end_soon(self.lifecycle.end_owner(owner, f"its job {owner} ended"))
        if holder is not None:
            self._check(self.lifecycle.holder_lost(holder))

    def on_worker_lost(self, worker: str) -> None:
        restarting, ended = self.lifecycle.on_worker_lost(worker)
        self.end_soon(ended)
        for rec in restarting:
            self.placed[rec.instance_id] = asyncio.Event()  # locates wait for the new place
            self.scheduler.loop.add_callback(self._restart, rec)
        self._check(self.lifecycle.holder_lost(worker))

    async def _restart(self, rec: InstanceRecord) -> None:
        """Place a restarting instance again and start it from its checkpoint or ``__init__``."""
        iid, spec = rec.instance_id, rec.spec
        timeout = spec["timeout_ms"]
        timeout = -1 if timeout < 0 else max(timeout, RESTART_TIMEOUT_MS)
        logger.info("restarting instance %s (%s), restart %d: %s", iid, spec.get("cls_name"),
                    rec.restarts, rec.reason)
        got, where = await self.ext.acquire(self._request(spec), timeout)
        if rec.state != P.RESTARTING:  # ended meanwhile, or lost again and re-queued
            if got is not None and rec.state == P.DEAD:
                self.ext.ledger.release(iid)
                self.ext._grant_pending()
            return
        if got is None:
            await self.end(self.lifecycle.end(iid, f"{rec.reason}; no worker could take it "
                                                   f"back: {where}"))
            return
        self.lifecycle.placed(iid, where)
        ev = self.placed.pop(iid, None)
        if ev is not None:
            ev.set()
        self._send_worker(where, {"op": P.START_INSTANCE, "spec": {
            **spec, "checkpoint": rec.checkpoint, "incarnation": rec.restarts}})

    def handle_refs(self, deltas: dict, transit: list = (), arrived: list = (),
                    worker: str | None = None, holder: str | None = None) -> None:
        self._check(self.lifecycle.handle_refs(worker or holder, deltas, transit, arrived))

    def instance_state(self, instance_id: str, state: str, error: Any = None,
                       worker: str | None = None) -> None:
        if state == "EXITED":
            self.end_soon(self.lifecycle.end(instance_id, "it exited"))
            return
        current = self.lifecycle.instances.get(instance_id)
        if current is not None and worker is not None and current.worker != worker:
            return  # a report from an earlier home of a restarted instance
        rec = self.lifecycle.set_state(instance_id, P.ALIVE,
                                       "" if error is None else "__init__ raised")
        if rec is not None:
            ev = self.alive.pop(instance_id, None)
            if ev is not None:
                ev.set()

    def _check(self, iids: list[str]) -> None:
        for iid in iids:
            if self.lifecycle.releasable(iid):
                self.scheduler.loop.call_later(RELEASE_GRACE_S, self._release_if_unheld, iid)

    def _release_if_unheld(self, iid: str) -> None:
        if self.lifecycle.releasable(iid):
            self.end_soon(self.lifecycle.end(iid, "no handle to it is left"))

    def _send_worker(self, worker: str, msg: dict) -> None:
        stream = self.scheduler.stream_comms.get(worker)
        if stream is not None:
            stream.send(msg)
