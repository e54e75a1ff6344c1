"""The instance lifecycle's Dask adapter: the I/O edge of :mod:`instance_service`.

Handles ``CREATE_INSTANCE``, ``LOCATE_INSTANCE``, ``GET_NAMED``, ``LIST_NAMED``,
``KILL_INSTANCE``, ``INSTANCE_STATUS``, ``LOAD_STATE`` (scheduler rpc); ``SAVE_STATE``,
``HANDLE_REFS`` and ``INSTANCE_STATE`` are its service's own handlers
(``instance_service.OPS``); owner and worker losses reach its service through
``scheduler/departures.py``.
What each of them does is decided by :class:`~yrdask.scheduler.instance_service.InstanceService`
(which the simulation drives too) over the :class:`~yrdask.scheduler.lifecycle.Lifecycle`
machine; this module turns the rpcs into its calls (futures wait for its answers) and
carries out its edge (:class:`_DaskEdge`): resources through the extension (an instance
holds its resources for its whole life), ``START_INSTANCE`` on the worker's stream,
``STOP_INSTANCE`` rpcs, the wall clock and timers of the release grace period.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable

import dask

from yrdask import protocol as P
from yrdask.scheduler import lifecycle as L
from yrdask.scheduler.instance_service import InstanceService
from yrdask.scheduler.requests import LeaseRequest

logger = logging.getLogger("yrdask.instances")


class InstanceManager:
    """See module docstring; owned by :class:`~yrdask.scheduler.extension.YrSchedulerExtension`."""

    def __init__(self, ext: Any) -> None:
        self.ext = ext
        self.scheduler = ext.scheduler
        lifecycle = L.Lifecycle(ended_kept=int(
            dask.config.get("yrdask.scheduling.ended-instances-kept", L.ENDED_KEPT)))
        self.service = InstanceService(_DaskEdge(ext), lifecycle, ext.ledger)
        self.lifecycle = lifecycle
        # Its handlers and its service's (instance_service.OPS) are registered by the
        # extension, in the tables built from the protocol
        # (P.handlers(P.SCHEDULER_RPC, ext, ext.instances, ext.instances.service), ...).

    @property
    def requests(self) -> dict[str, LeaseRequest]:
        """Instance id -> its waiting acquire."""
        return self.service.requests

    # -- rpcs ------------------------------------------------------------------------------

    async def create_instance(self, spec: dict) -> list:
        """Reply ``[instance_id, worker, meta, server_id]`` once placed (``server_id``:
        which process at ``worker``, ``runtime/worker_processes.py``), or
        ``[None, reason, None]``."""
        reply = await _answered(self.service.create_instance, spec=spec)
        if reply[0] is not None:
            return [*reply, self.ext.server_id_of(reply[1])]
        return reply

    async def locate_instance(self, instance_id: str, lost: str | None = None,
                              lost_server_id: str = "") -> list:
        """Reply ``[state, worker, reason, instance_id, server_id]`` (the id an alias stands
        for; which process at ``worker``, ``""`` for none).

        ``lost``: the caller lost its channel to that worker (the process ``lost_server_id``,
        if it says); if the instance is still recorded there, wait until Dask confirms that
        process gone (it then restarts or ends).
        """
        reply = await _answered(self.service.locate_instance, instance_id=instance_id, lost=lost,
                                lost_server_id=lost_server_id)
        return [*reply, self.ext.server_id_of(reply[1]) if reply[1] else ""]

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
        req = self.service.requests.get(instance_id)
        if req is None or not req.request_id:
            return ""
        why = self.ext.leases.explain_wait(req.request_id, asyncio.get_running_loop().time())
        return why["text"] if why is not None else ""

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

    async def kill_instance(self, instance_id: str, reason: str = "terminated",
                            restart: bool = False, force: bool = False) -> None:
        """End the instance and its non-detached descendants; reply once they are stopped.
        ``restart``: kill its process as if it crashed instead (reply at once); ``force``:
        without its shutdown hook (:class:`P.KillInstance`)."""
        await _answered(self.service.kill_instance, instance_id=instance_id, reason=reason,
                        restart=restart, force=force)

    async def _wait(self, iid: str, stage: str, timeout: float | None = None) -> tuple:
        """``(worker, "")`` once ``iid`` reached ``stage``, or ``(None, reason)`` if it ended."""
        fut = asyncio.get_running_loop().create_future()
        self.service.wait(iid, stage, lambda worker, reason: _set(fut, (worker, reason)))
        return await asyncio.wait_for(fut, timeout)


async def _answered(handler: Callable[..., None], **fields: Any) -> Any:
    """Await what ``handler(answer, **fields)`` (an rpc of ``instance_service.RPC_OPS``)
    answers."""
    fut = asyncio.get_running_loop().create_future()
    handler(_setter(fut), **fields)
    return await fut


def _set(fut: asyncio.Future, value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


def _setter(fut: asyncio.Future) -> Callable[[Any], None]:
    return lambda value: _set(fut, value)


class _DaskEdge:
    """The instance service's I/O edge in the scheduler: the wall clock (tombstone times)
    and the loop's timers, the extension's lease service, the worker streams and rpcs, Dask's
    view of the workers."""

    def __init__(self, ext: Any) -> None:
        self.ext = ext

    def now(self) -> float:
        return time.time()

    def call_at(self, at: float, fn: Callable[[], None]) -> None:
        asyncio.get_running_loop().call_later(max(0.0, at - time.time()), fn)

    def soon(self, fn: Callable[[], None]) -> None:
        asyncio.get_running_loop().call_soon(fn)

    def is_worker(self, worker: str) -> bool:
        return worker in self.ext.scheduler.workers

    def acquire(self, req: LeaseRequest, timeout_ms: int, answer: Callable[[list], None]) -> None:
        ext, loop = self.ext, asyncio.get_running_loop()
        t0 = time.perf_counter()

        def answered(result: list) -> None:  # the acquiring task resumes on a later turn
            ext.figures.placed(req.kind, time.perf_counter() - t0)
            loop.call_soon(answer, result)
        try:
            ext.lease_service.open(req, timeout_ms, answered)
        except Exception as e:  # a bug in the ledger must not leave the instance pending
            logger.exception("placing instance %s", req.holding_id)
            loop.call_soon(answer, [None, f"placing it failed: {e!r}"])

    def cancel_acquire(self, req: LeaseRequest) -> None:
        self.ext.cancel_request(req)

    def release(self, holding_ids: list[str]) -> None:
        self.ext.release(holding_ids)

    def start_instance(self, worker: str, spec: dict) -> None:
        stream = self.ext.scheduler.stream_comms.get(worker)
        if stream is not None:
            stream.send(P.StartInstance(spec).to_msg())
        self.ext.zygotes.placed(spec)  # the first process instance: every worker warms up

    def crash_instance(self, worker: str, instance_id: str, reason: str,
                       incarnation: int) -> None:
        stream = self.ext.scheduler.stream_comms.get(worker)
        if stream is not None:
            stream.send(P.CrashInstance(instance_id, reason, incarnation).to_msg())

    def stop_instance(self, worker: str, instance_id: str, reason: str,
                      force: bool = False) -> None:
        asyncio.get_running_loop().create_task(self._stop(worker, instance_id, reason, force))

    async def _stop(self, worker: str, instance_id: str, reason: str, force: bool) -> None:
        try:
            await P.request(self.ext.scheduler.rpc(worker),
                            P.StopInstance(instance_id, reason, force))
        except Exception as e:  # the worker died meanwhile
            logger.debug("stopping %s on %s: %r", instance_id, worker, e)
        self.ext.instances.service.stopped(instance_id)

    def worker_gone(self, worker: str, timeout: float, then: Callable[[], None],
                    server_id: str = "") -> None:
        if worker not in self.ext.scheduler.workers or (
                server_id and self.ext.server_id_of(worker) != server_id):
            then()  # removed, or removed and followed by a new process at that address
            return

        async def wait() -> None:
            await self.ext.worker_gone(worker, timeout)
            then()
        asyncio.get_running_loop().create_task(wait())

    def broadcast(self, msg: Any) -> None:
        self.ext.broadcast(msg)

    def after_feed(self) -> None:
        pass
