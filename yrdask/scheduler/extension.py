"""The scheduler extension: yr's global scheduler, the Dask-facing adapter of the ledger.

Installed by ``dask scheduler --preload yrdask`` (or by the embedded cluster).  It owns the
resource :class:`~yrdask.scheduler.resources.Ledger`, grants *leases* (a submitter may push
tasks of one resource shape straight to one worker while it holds the lease), and keeps the
job streams of connected drivers.  Its ops are listed in :mod:`yrdask.protocol`
(``SCHEDULER_RPC``, ``SCHEDULER_STREAM``); the worker agent is installed on every worker
from :meth:`YrSchedulerExtension.start`, so one scheduler preload sets up both sides.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import time
from dataclasses import dataclass
from typing import Any

from distributed.comm.core import CommClosedError
from distributed.diagnostics.plugin import SchedulerPlugin
from distributed.protocol.pickle import dumps as pickle_dumps

from yrdask import config as _config  # noqa: F401 - registers the yrdask.* defaults
from yrdask import protocol as P
from yrdask.stream import StreamSender
from yrdask.scheduler.instance_manager import InstanceManager
from yrdask.scheduler.figures import SchedulingFigures
from yrdask.scheduler.requests import LeaseRequest, freeze, shape_of
from yrdask.scheduler.resources import Holding, Ledger, Shape, format_shape

logger = logging.getLogger("yrdask.scheduler")

EXTENSION_NAME = "yr"
LOAD_REFRESH_MS = 1000  # how often worker load reports (heartbeats) reach the ledger


@dataclass
class Job:
    """A connected driver: its job stream and owner address."""

    job_id: str
    owner: str
    stream: StreamSender


class YrSchedulerExtension:
    """Global scheduler + registries of yr on the Dask scheduler (see module docstring)."""

    def __init__(self, scheduler: Any, worker_plugin: Any = None) -> None:
        self.scheduler = scheduler
        self.worker_plugin = worker_plugin  # handed in by yrdask.deploy; installed on workers
        self.ledger = Ledger()
        self.jobs: dict[str, Job] = {}  # owner address -> job
        self.pending: list[LeaseRequest] = []
        self.pending_workers: dict[str, Shape] = {}  # registered with yr before Dask knew them
        self.worker_added = asyncio.Event()  # set on each yr worker registration
        self._gone: dict[str, asyncio.Event] = {}  # worker address -> set once removed
        self._ids = itertools.count(1)
        self.counters = {"leases_granted": 0, "leases_local": 0, "leases_forwarded": 0,
                         "lease_timeouts": 0}
        self.figures = SchedulingFigures()
        scheduler.extensions[EXTENSION_NAME] = self
        scheduler.handlers.update(
            {
                P.CONNECT_JOB: self.connect_job,
                P.REGISTER_WORKER: self.register_worker,
                P.REQUEST_LEASE: self.request_lease,
                P.CLUSTER_INFO: self.cluster_info,
            }
        )
        scheduler.stream_handlers.update(
            {
                P.RETURN_LEASES: self.return_leases,
                P.LEASE_BLOCKED: self.lease_blocked,
                P.LEASE_UNBLOCKED: self.lease_unblocked,
            }
        )
        self.instances = InstanceManager(self)
        scheduler.add_plugin(_Hooks(self), name="yrdask-hooks")

    async def start(self) -> None:
        """Install the worker agent on every current and future worker, and the dashboard."""
        if self.worker_plugin is not None:
            await self.scheduler.register_worker_plugin(
                None, pickle_dumps(self.worker_plugin), name=self.worker_plugin.name,
                idempotent=True)
        from tornado.ioloop import PeriodicCallback

        pc = PeriodicCallback(self.refresh_loads, LOAD_REFRESH_MS)
        self.scheduler.periodic_callbacks["yr-loads"] = pc
        pc.start()
        try:  # monitoring (docs/monitoring.md) must never keep the scheduler from serving yr
            from yrdask.dashboard import install as install_dashboard

            install_dashboard(self.scheduler)
        except Exception:
            logger.warning("yr dashboard pages, JSON API and metrics not installed",
                           exc_info=True)

    # -- workers ---------------------------------------------------------------------------

    def register_worker(self, address: str, capacity: Shape, protocol_version: int) -> None:
        if protocol_version != P.PROTOCOL_VERSION:
            raise RuntimeError(
                f"yrdask protocol mismatch: worker {address} speaks {protocol_version}, "
                f"scheduler speaks {P.PROTOCOL_VERSION}; install the same yrdask everywhere"
            )
        if address in self.scheduler.workers:
            self._add_worker(address, capacity)
        else:
            self.pending_workers[address] = capacity

    def _add_worker(self, address: str, capacity: Shape) -> None:
        logger.info("yr worker %s offers %s", address, format_shape(capacity))
        self.ledger.add_worker(address, capacity)
        self.worker_added.set()
        self._grant_pending()

    def on_add_worker(self, address: str) -> None:
        capacity = self.pending_workers.pop(address, None)
        if capacity is not None:
            self._add_worker(address, capacity)

    def on_remove_worker(self, address: str) -> None:
        self.pending_workers.pop(address, None)
        self.ledger.remove_worker(address)
        # Leases a submitter on that worker held elsewhere die with it.
        self._release_owned_by(address)
        self.instances.on_worker_lost(address)
        gone = self._gone.pop(address, None)
        if gone is not None:
            gone.set()
        msg = {"op": P.WORKER_LOST, "worker": address}
        for job in list(self.jobs.values()):
            self._send_to_owner(job.owner, msg)
        for worker in self.scheduler.workers:
            if worker != address:
                self._send_to_owner(worker, dict(msg))

    async def worker_gone(self, address: str, timeout: float) -> bool:
        """Wait until Dask has removed ``address`` (a caller lost its channel to it).

        True once it is gone; False after ``timeout`` s (the worker may be alive after all).
        """
        if address not in self.scheduler.workers:
            return True
        gone = self._gone.setdefault(address, asyncio.Event())
        try:
            await asyncio.wait_for(gone.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    # -- jobs ------------------------------------------------------------------------------

    async def connect_job(self, comm: Any, job_id: str, owner_address: str, protocol_version: int) -> None:
        """Serve one driver's job stream until it closes; then end the job."""
        stream = StreamSender(comm)
        if protocol_version != P.PROTOCOL_VERSION:
            stream.send({"op": P.JOB_WELCOME, "error": (
                f"yrdask protocol mismatch: driver speaks {protocol_version}, scheduler "
                f"speaks {P.PROTOCOL_VERSION}; install the same yrdask version everywhere")})
            await stream.close()
            return
        self.jobs[owner_address] = Job(job_id, owner_address, stream)
        stream.send({"op": P.JOB_WELCOME, "protocol_version": P.PROTOCOL_VERSION,
                     "dashboard": self.dashboard_link()})
        handlers = {P.RETURN_LEASES: self.return_leases,
                    P.HANDLE_REFS: functools.partial(self.instances.handle_refs, holder=owner_address)}
        try:
            while True:
                try:
                    msgs = await comm.read()
                except (CommClosedError, OSError):
                    break
                for msg in msgs if isinstance(msgs, (list, tuple)) else (msgs,):
                    op = msg.pop("op")
                    if op == "close-stream":
                        return
                    handlers[op](**msg)
        finally:
            self.jobs.pop(owner_address, None)
            self._release_owned_by(owner_address)
            self.instances.on_owner_gone(job_id, owner_address)
            if not comm.closed():
                await comm.close()

    def dashboard_link(self) -> str | None:
        try:
            from distributed.utils import format_dashboard_link

            port = self.scheduler.http_server.port
            host = self.scheduler.address.split("://")[-1].rsplit(":", 1)[0]
            return format_dashboard_link(host, port)
        except Exception:
            return None

    def cluster_info(self, instances: bool = True) -> dict:
        """The cluster at a glance; ``instances=False`` leaves out the (long) instance list."""
        return {"workers": self.ledger.snapshot(), "dashboard": self.dashboard_link(),
                "counters": dict(self.counters),
                "instances": self.instances.lifecycle.snapshot() if instances else [],
                "placement": self.figures.snapshot(), "scheduling": self.worker_scheduling()}

    def worker_scheduling(self) -> dict[str, dict]:
        """Each worker's last heartbeat report of its yr load and local/forwarded counts."""
        out = {}
        for address, ws in self.scheduler.workers.items():
            report = (ws.metrics or {}).get("yr")
            if report:
                out[address] = {k: v for k, v in report.items() if k != "instances"}
        return out

    def refresh_loads(self) -> None:
        """Copy the queue lengths workers report with their heartbeats into the ledger."""
        for address, wr in self.ledger.workers.items():
            ws = self.scheduler.workers.get(address)
            report = (ws.metrics or {}).get("yr") if ws is not None else None
            if report:
                wr.load = float(report.get("tasks_queued", 0))

    # -- leases ----------------------------------------------------------------------------

    async def request_lease(self, owner: str, shape: Shape, timeout_ms: int,
                            local: str | None = None, queue: str = "",
                            avoid: list[str] | None = None, affinity: list | None = None) -> list:
        """Grant a lease now, or queue the request until resources free up or time runs out.

        Reply: ``[lease_id, worker]``, or ``[None, reason]`` when it cannot be met in time.
        """
        return await self.acquire(LeaseRequest(
            owner, shape_of(shape), local=local, queue=queue, avoid=tuple(avoid or ()),
            affinity=freeze(affinity)), timeout_ms)

    async def acquire(self, req: LeaseRequest, timeout_ms: int) -> list:
        """Hold ``req``'s resources on a worker: ``[holding_id, worker]`` or ``[None, why]``."""
        t0 = time.perf_counter()
        try:
            granted = self._grant(req)
            if granted is not None:
                return granted
            return await self._wait(req, timeout_ms)
        finally:
            self.figures.placed(req.kind, time.perf_counter() - t0)

    async def _wait(self, req: LeaseRequest, timeout_ms: int) -> list:
        loop = asyncio.get_running_loop()
        req.future = loop.create_future()
        req.deadline = None if timeout_ms < 0 else loop.time() + timeout_ms / 1000
        self.pending.append(req)
        self._revoke_for(req)
        try:
            while True:
                wait = None if req.deadline is None else max(0.0, req.deadline - loop.time())
                try:
                    return await asyncio.wait_for(asyncio.shield(req.future), wait)
                except asyncio.TimeoutError:
                    if self._could_free(req):
                        # Running tasks hold what it needs: they will end, keep waiting.
                        req.deadline = loop.time() + max(timeout_ms, 1000) / 1000
                        self._revoke_for(req)
                        continue
                    self.counters["lease_timeouts"] += 1
                    return [None, self.ledger.explain_unfit(req.shape, req.affinity)]
        finally:
            if req in self.pending:
                self.pending.remove(req)

    def _grant(self, req: LeaseRequest) -> list | None:
        worker = self.ledger.choose(req.shape, prefer=req.local, avoid=req.avoid,
                                    affinity=req.affinity)
        if worker is None:
            return None
        holding_id = req.holding_id or f"L{next(self._ids)}"
        self.ledger.hold(Holding(holding_id, req.kind, worker, req.shape, req.owner,
                                 queue=req.queue, labels=req.labels))
        if req.kind == "lease":
            self.counters["leases_granted"] += 1
            self.counters["leases_local" if worker == req.local else "leases_forwarded"] += 1
        return [holding_id, worker]

    def _grant_pending(self) -> None:
        for req in list(self.pending):
            if req.future.done():
                continue
            granted = self._grant(req)
            if granted is not None:
                req.future.set_result(granted)
                self.pending.remove(req)

    def _could_free(self, req: LeaseRequest) -> bool:
        """True if leases (tasks) hold resources on a worker that could run the request."""
        return bool(self.ledger.lease_holders_on_fitting_workers(req.shape, req.affinity))

    def _revoke_for(self, req: LeaseRequest) -> None:
        """Ask the owners of leases that stand in the way to return the idle ones."""
        by_owner: dict[str, list[str]] = {}
        for h in self.ledger.lease_holders_on_fitting_workers(req.shape, req.affinity):
            mine = h.owner == req.owner and h.queue == req.queue  # it serves this very queue
            if not mine and h.holding_id not in req.revoked:
                req.revoked.add(h.holding_id)
                by_owner.setdefault(h.owner, []).append(h.holding_id)
        for owner, lease_ids in by_owner.items():
            self._send_to_owner(owner, {"op": P.REVOKE_LEASES, "lease_ids": lease_ids})

    def _send_to_owner(self, owner: str, msg: dict) -> None:
        job = self.jobs.get(owner)
        stream = job.stream if job is not None else self.scheduler.stream_comms.get(owner)
        if stream is None:
            return
        try:
            stream.send(msg)
        except CommClosedError:
            pass

    def return_leases(self, lease_ids: list[str], worker: str | None = None) -> None:
        for lease_id in lease_ids:
            self.ledger.release(lease_id)
        self._grant_pending()

    def _release_owned_by(self, owner: str) -> None:
        for h in [h for h in self.ledger.holdings.values() if h.owner == owner and h.kind == "lease"]:
            self.ledger.release(h.holding_id)
        self._grant_pending()

    def lease_blocked(self, lease_id: str, worker: str | None = None) -> None:
        if self.ledger.lend_cpu(lease_id, True):
            self._grant_pending()

    def lease_unblocked(self, lease_id: str, worker: str | None = None) -> None:
        self.ledger.lend_cpu(lease_id, False)


class _Hooks(SchedulerPlugin):
    """Forwards the Dask scheduler events yr cares about to the extension."""

    def __init__(self, ext: YrSchedulerExtension) -> None:
        self.ext = ext

    async def start(self, scheduler: Any) -> None:
        await self.ext.start()

    def add_worker(self, scheduler: Any, worker: str) -> None:
        self.ext.on_add_worker(worker)

    def remove_worker(self, scheduler: Any, worker: str, **kwargs: Any) -> None:
        self.ext.on_remove_worker(worker)
