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
import os
import time
from dataclasses import dataclass
from typing import Any, Callable

from distributed.comm.core import CommClosedError
from distributed.diagnostics.plugin import SchedulerPlugin
from distributed.protocol.pickle import dumps as pickle_dumps

from yrdask import config as _config  # registers the yrdask.* defaults
from yrdask import protocol as P
from yrdask.errors import describe_exit
from yrdask.stream import StreamSender
from yrdask.scheduler.instance_manager import InstanceManager
from yrdask.scheduler.group_adapter import ResourceGroupService
from yrdask.scheduler.kv import KVServer
from yrdask.scheduler.drain import Drainer
from yrdask.scheduler.figures import SchedulingFigures
from yrdask.scheduler.departures import Departures
from yrdask.scheduler.lease_service import LeaseService
from yrdask.scheduler.requests import LeaseRequest, shape_of
from yrdask.scheduler.resources import Ledger, Shape, format_shape
from yrdask.scheduler.panels import DaskPanels
from yrdask.scheduler.scale_up import ScaleUp
from yrdask.scheduler import state_view
from yrdask.scheduler.waits import WaitWatch
from yrdask.scheduler.zygotes import ZygoteWarming

logger = logging.getLogger("yrdask.scheduler")

EXTENSION_NAME = "yr"
LOAD_REFRESH_MS = 1000  # how often worker load reports (heartbeats) reach the ledger
REMOVED_KEPT = 10_000  # removed worker addresses remembered (to announce a comeback)


@dataclass
class Job:
    """A connected driver: its job stream and owner address."""

    job_id: str
    owner: str
    stream: StreamSender
    api: str = "yr"  # "ray": the driver speaks Ray (waits are explained in Ray's words)


def session_name(started: float, pid: int) -> str:
    """The cluster's session name, Ray's form (``session_2025-01-01_00-00-00_000000_1234``):
    when this scheduler's extension started and its process id, so a scheduler restarted at
    the same address starts another session.  Drivers get it in :class:`P.JobWelcome`."""
    stamp = time.strftime("%Y-%m-%d_%H-%M-%S", time.localtime(started))
    return f"session_{stamp}_{int(started % 1 * 1_000_000):06d}_{pid}"


class YrSchedulerExtension:
    """Global scheduler + registries of yr on the Dask scheduler (see module docstring)."""

    def __init__(self, scheduler: Any, worker_plugin: Any = None,
                 monitoring: Callable[[Any], Any] | None = None,
                 nanny_plugin: Any = None, durable: Any = None) -> None:
        self.scheduler = scheduler
        self.session_name = session_name(time.time(), os.getpid())
        # scheduler/durable.py's DurableControl, or None: what a restarted scheduler reads back
        self.durable = durable
        # Handed in by the composition root (yrdask.deploy): the scheduler never imports
        # the worker agent or the dashboard.
        self.worker_plugin = worker_plugin  # installed on every worker at start
        self.nanny_plugin = nanny_plugin  # on every nanny: reports how worker processes end
        self.worker_of_nanny: dict[str, str] = {}  # nanny address -> its latest worker
        # each worker process's Dask server_id (runtime/worker_processes.py), and which
        # one a nanny's (nanny, pid) was, so a late exit report names the right one
        self.server_ids: dict[str, str] = {}  # address -> its registered process's
        self.process_of_pid: dict[tuple[str, int], tuple[str, str]] = {}
        self.monitoring = monitoring  # called with the scheduler at start (dashboard pages)
        self.defer_monitoring = False  # True: start() leaves it to start_monitoring()
        # Every lease and instance holding is decided by this pure machine (leases.py); what
        # the adapter does with its answers is decided by LeaseService (lease_service.py,
        # which the simulation drives too); _LoopEdge below is its I/O edge.
        self.lease_service = LeaseService(_LoopEdge(self))
        self.leases = self.lease_service.leases
        self._stimuli = itertools.count(1)
        self.jobs: dict[str, Job] = {}  # owner address -> job
        # registered with yr before Dask knew them: (capacity, node, gpus, shared)
        self.pending_workers: dict[str, tuple] = {}
        self.worker_added = asyncio.Event()  # set on each yr worker registration
        self._gone: dict[str, asyncio.Event] = {}  # worker address -> set once removed
        # addresses Dask removed (oldest first, bounded): a new process registering at one
        # of them is announced (WorkerJoined), so no process keeps treating it as dead
        self.removed: dict[str, str] = {}  # address -> the server_id removed there
        self.figures = SchedulingFigures()
        self.waits = WaitWatch(self)  # explains waiting requests, warns about long waits
        self.panels = DaskPanels(scheduler)  # yr work in Dask's Task Stream and Progress
        scheduler.extensions[EXTENSION_NAME] = self
        # the workers start their zygotes from the first process instance on (zygotes.py)
        self.zygotes = ZygoteWarming(
            lambda worker: self._send_to_owner(worker, P.WarmZygote.wire()),
            _config.warm_zygotes())
        self.instances = InstanceManager(self)
        self.kv = KVServer()  # the cluster's KV store (P.KV_RPC)
        self.rgroups = ResourceGroupService(self)  # resource groups (scheduler/groups.py)
        self.scale_up = ScaleUp(self)  # yr demand in Dask's adaptive target (scale_up.py)
        # One table each, from the protocol: the extension's ops, then the instance manager's.
        scheduler.handlers.update(P.handlers(P.SCHEDULER_RPC, self, self.instances, self.kv,
                                             self.rgroups, self.instances.service))
        scheduler.stream_handlers.update(P.handlers(P.SCHEDULER_STREAM, self.lease_service, self,
                                                    self.instances.service))
        # who hears of a job's end or a worker's removal, in which order (departures.py)
        self.departures = Departures(_LoopEdge(self), self.lease_service,
                                     self.instances.service, self.rgroups.service)
        self.drainer = Drainer(self)  # scale-down drains workers first (scheduler/drain.py)
        self.drainer.install()
        scheduler.add_plugin(_Hooks(self), name="yrdask-hooks")

    async def start(self) -> None:
        """Install the worker agent on every current and future worker, and the dashboard."""
        if self.worker_plugin is not None:
            await self.scheduler.register_worker_plugin(
                None, pickle_dumps(self.worker_plugin), name=self.worker_plugin.name,
                idempotent=True)
        if self.nanny_plugin is not None:
            await self.scheduler.register_nanny_plugin(
                None, pickle_dumps(self.nanny_plugin), name=self.nanny_plugin.name,
                idempotent=True)
        from tornado.ioloop import PeriodicCallback

        pc = PeriodicCallback(self.refresh_loads, LOAD_REFRESH_MS)
        self.scheduler.periodic_callbacks["yr-loads"] = pc
        pc.start()
        waits = PeriodicCallback(self.waits.check, LOAD_REFRESH_MS)
        self.scheduler.periodic_callbacks["yr-waits"] = waits
        waits.start()
        panels = PeriodicCallback(lambda: self.panels.tick(self.instances.lifecycle),
                                  LOAD_REFRESH_MS)
        self.scheduler.periodic_callbacks["yr-dask-panels"] = panels
        panels.start()
        self.kv.start(self.scheduler)
        if self.durable is not None:
            self.durable.attach(self)
        if not self.defer_monitoring:
            self.start_monitoring()

    def start_monitoring(self) -> None:
        """Install the dashboard's pages, JSON API and metrics (the ``monitoring`` hook).

        Run by :meth:`start`, or later by a composition root that set ``defer_monitoring``
        (the embedded cluster: after its workers' start order, off yr.init's critical path).
        """
        try:  # monitoring (docs/monitoring.md) must never keep the scheduler from serving yr
            if self.monitoring is not None:
                self.monitoring(self.scheduler)
        except Exception:
            logger.warning("yr dashboard pages, JSON API and metrics not installed",
                           exc_info=True)

    # -- workers ---------------------------------------------------------------------------

    def register_worker(self, address: str, capacity: Shape, protocol_version: int,
                        node: str = "", gpus: Any = (), shared: Any = None,
                        labels: Any = None) -> None:
        if protocol_version != P.PROTOCOL_VERSION:
            raise RuntimeError(
                f"yrdask protocol mismatch: worker {address} speaks {protocol_version}, "
                f"scheduler speaks {P.PROTOCOL_VERSION}; install the same yrdask everywhere"
            )
        offer = (capacity, node, tuple(gpus or ()), dict(shared or {}), dict(labels or {}))
        if address in self.scheduler.workers:
            self._add_worker(address, *offer)
        else:
            self.pending_workers[address] = offer

    def _add_worker(self, address: str, capacity: Shape, node: str = "", gpus: tuple = (),
                    shared: Shape | None = None, labels: dict | None = None) -> None:
        gpus, shared = tuple(gpus or ()), shared or {}
        logger.info("yr worker %s offers %s to node %s%s", address, format_shape(capacity),
                    node or address, f" (devices {','.join(gpus)})" if gpus else "")
        self.lease_service.worker_joined(address, shape_of(capacity), node, gpus,
                                         shape_of(shared), labels)
        self.worker_added.set()
        self.zygotes.registered(address)
        if address in self.removed:  # a new process at a dead one's address
            del self.removed[address]
            logger.info("yr worker %s joined again at the address of a lost worker", address)
            self._broadcast(P.WorkerJoined(address, self.server_id_of(address)), but=address)

    def server_id_of(self, address: str) -> str:
        """The Dask ``server_id`` of the worker process registered at ``address``, or
        ``""`` if none is."""
        ws = self.scheduler.workers.get(address)
        return ws.server_id if ws is not None else ""

    def on_add_worker(self, address: str) -> None:
        ws = self.scheduler.workers.get(address)
        if ws is not None:
            self.server_ids[address] = ws.server_id
            if ws.nanny:  # a nanny's exit report may only name itself (and the pid)
                self.worker_of_nanny[ws.nanny] = address
                if ws.pid:
                    self.process_of_pid[(ws.nanny, ws.pid)] = (address, ws.server_id)
                    while len(self.process_of_pid) > REMOVED_KEPT:
                        self.process_of_pid.pop(next(iter(self.process_of_pid)))
        offer = self.pending_workers.pop(address, None)
        if offer is not None:
            self._add_worker(address, *offer)

    def on_remove_worker(self, address: str) -> None:
        self.pending_workers.pop(address, None)
        self.zygotes.removed(address)
        server_id = self.server_ids.pop(address, "")
        # What it held is lost, its submitter's leases and requests go, its instances
        # restart or end, its code's groups go, everyone is told (the decisions: Departures)
        self.departures.worker_removed(address, server_id)
        self.panels.worker_gone(address)
        gone = self._gone.pop(address, None)
        if gone is not None:
            gone.set()
        self.removed.pop(address, None)
        self.removed[address] = server_id  # (newest last)
        while len(self.removed) > REMOVED_KEPT:
            self.removed.pop(next(iter(self.removed)))

    def broadcast(self, msg: Any) -> None:
        """Send ``msg`` to every driver and every worker."""
        self._broadcast(msg, "")

    def _broadcast(self, msg: Any, but: str) -> None:
        """Send ``msg`` to every driver, and to every worker but ``but`` (each stream in
        order: a ``WorkerJoined`` never overtakes the ``WorkerLost`` of its address)."""
        for job in list(self.jobs.values()):
            self._send_to_owner(job.owner, msg.to_msg())
        for worker in list(self.scheduler.workers):
            if worker != but:
                self._send_to_owner(worker, msg.to_msg())

    def worker_exited(self, nanny: str, exitcode: int, pid: int = 0) -> None:
        """:class:`yrdask.protocol.WorkerExited` from a nanny: tell every driver and worker
        how that process ended, for the errors of the work lost with it.  The pid names the
        process that ended even when the report comes after the next one registered."""
        worker, server_id = self.process_of_pid.get((nanny, pid), ("", ""))
        if not worker:  # (a process that died before it registered, or no pid)
            worker = self.worker_of_nanny.get(nanny, "")
        if not worker:
            return
        how = describe_exit(exitcode)
        logger.info("yrdask: worker process %s %s", worker, how)
        msg = P.WorkerExit(worker, how, server_id)
        for job in list(self.jobs.values()):
            self._send_to_owner(job.owner, msg.to_msg())
        for address in self.scheduler.workers:
            if address != worker:
                self._send_to_owner(address, msg.to_msg())

    def owner_alive(self, address: str) -> bool:
        """:class:`yrdask.protocol.OwnerAlive`: is ``address`` a worker or a job's owner
        server still registered here?  (A process that died is neither once its stream
        closed.)"""
        return address in self.jobs or address in self.scheduler.workers

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

    async def connect_job(self, comm: Any, job_id: str, owner_address: str,
                          protocol_version: int, api: str = "yr") -> None:
        """Serve one driver's job stream until it closes; then end the job."""
        stream = StreamSender(comm)
        if protocol_version != P.PROTOCOL_VERSION:
            stream.send(P.JobWelcome(error=(
                f"yrdask protocol mismatch: driver speaks {protocol_version}, scheduler "
                f"speaks {P.PROTOCOL_VERSION}; install the same yrdask version everywhere"
            )).to_msg())
            await stream.close()
            return
        self.jobs[owner_address] = Job(job_id, owner_address, stream, api)
        stream.send(P.JobWelcome(protocol_version=P.PROTOCOL_VERSION,
                                 dashboard=self.dashboard_link(),
                                 session=self.session_name).to_msg())
        handlers = P.handlers(P.JOB_STREAM, self.lease_service, self, self.instances.service)
        handlers[P.HANDLE_REFS] = functools.partial(handlers[P.HANDLE_REFS],
                                                    holder=owner_address)
        # An isolated process's runtime lends the CPU of the work it runs (LeaseBlocked on
        # its job stream); should it die while lent, the holding takes its CPU back here.
        lent: set[str] = set()
        handlers[P.LEASE_BLOCKED] = functools.partial(self._job_lent, lent, True)
        handlers[P.LEASE_UNBLOCKED] = functools.partial(self._job_lent, lent, False)
        try:
            while True:
                try:
                    msgs = await comm.read()
                except (CommClosedError, OSError):
                    break
                for msg in msgs if isinstance(msgs, (list, tuple)) else (msgs,):
                    if msg["op"] == P.CLOSE_STREAM:
                        return
                    P.dispatch(handlers, msg)
        finally:
            for lease_id in lent:
                self.lease_service.lease_unblocked(lease_id)
            self.jobs.pop(owner_address, None)
            self.departures.job_ended(job_id, owner_address)
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
                "placement": self.figures.snapshot(), "scheduling": self.worker_scheduling(),
                "waiting": self.waits.rows() if instances else [],
                "ended": self.instances.lifecycle.ended_rows() if instances else [],
                "resource_groups": self.rgroups.machine.snapshot()}

    def state_records(self, kind: str, limit: int = -1) -> dict:
        """:class:`yrdask.protocol.StateRecords`: records for Ray's state API and timeline
        (scheduler/state_view.py)."""
        return state_view.state_records(self, kind, limit)

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
        for address, wr in self.ledger.processes.items():
            ws = self.scheduler.workers.get(address)
            report = (ws.metrics or {}).get("yr") if ws is not None else None
            if report:
                wr.load = float(report.get("tasks_queued", 0))

    # -- leases ----------------------------------------------------------------------------
    # The adapter of the lease queue (scheduler/leases.py): wire messages and acquire() become
    # events stamped with the loop's clock; Granted/Refused answer the waiting request's
    # future, Revoke goes on the owner's stream, WakeAt becomes loop.call_at feeding a Tick.

    @property
    def ledger(self) -> Ledger:
        """The resource ledger (owned by the lease queue; read by the dashboard)."""
        return self.leases.ledger

    @property
    def counters(self) -> dict[str, int]:
        """Lease counters: leases granted, local, forwarded, lease timeouts."""
        return self.leases.counters

    @property
    def pending(self) -> list:
        """The requests waiting for room, oldest first."""
        return list(self.leases.pending.values())

    async def request_lease(self, owner: str, shape: Shape, timeout_ms: int,
                            local: str | None = None, queue: str = "",
                            avoid: list[str] | None = None, affinity: list | None = None,
                            request_id: str = "") -> list:
        """Grant a lease now, or queue the request until resources free up or time runs out.

        Reply: ``[lease_id, worker, server_id]`` (which process at that address: the
        owner tells it apart from a dead one there, ``runtime/worker_processes.py``), or
        ``[None, reason]`` when it cannot be met in time (or is withdrawn: ``request_id`` is
        the owner's own id of it).
        """
        reply = await self._answer_of("lease", lambda answer: self.lease_service.request_lease(
            answer, owner, shape, timeout_ms, local, queue, avoid, affinity, request_id))
        if reply[0] is not None:
            return [reply[0], reply[1], self.server_id_of(reply[1])]
        return reply

    async def acquire(self, req: LeaseRequest, timeout_ms: int) -> list:
        """Hold ``req``'s resources on a worker: ``[holding_id, worker]`` or ``[None, why]``.

        Sets ``req.request_id`` (for :meth:`cancel_request`).  ``timeout_ms < 0`` waits
        forever.
        """
        return await self._answer_of(req.kind, lambda answer: self.lease_service.open(
            req, timeout_ms, answer))

    async def _answer_of(self, kind: str, ask: Callable[[Callable[[list], None]], str]) -> list:
        """Wait for the answer of the request ``ask(answer)`` opened on the lease service
        (it returns the request id; "" when nothing was asked).  If the caller is cancelled,
        the service abandons the request (withdrawn; a grant that came meanwhile is
        released)."""
        t0 = time.perf_counter()
        future = asyncio.get_running_loop().create_future()

        def answer(result: list) -> None:
            if not future.done():
                future.set_result(result)

        rid = ""
        try:
            rid = ask(answer)
            return await future
        except asyncio.CancelledError:
            got = future.result() if future.done() and not future.cancelled() else None
            self.lease_service.abandon(rid, got)
            raise
        finally:
            if rid:
                self.lease_service.close(rid)  # (answered or abandoned: nothing to do)
                self.figures.placed(kind, time.perf_counter() - t0)

    def release(self, holding_ids: list[str]) -> None:
        """Give holdings back (ended instances, returned leases) and grant what now fits."""
        self.lease_service.release(holding_ids)

    def cancel_request(self, req: LeaseRequest) -> None:
        """Withdraw a waiting request (its instance ended): its acquire() answers
        ``[None, reason]``.  A request already answered is left alone."""
        if req.request_id:
            self.lease_service.cancel(req.request_id)

    def _grant_pending(self) -> None:
        """Grant what fits now (after a direct ``ledger.release``; prefer :meth:`release`)."""
        self.lease_service.tick()

    @staticmethod
    def _loop() -> asyncio.AbstractEventLoop:
        try:
            return asyncio.get_running_loop()
        except RuntimeError:
            return asyncio.get_event_loop()

    def _feed(self, event: Any) -> None:
        """Hand ``event`` to the lease queue and carry out its instructions."""
        self.lease_service.feed(event)

    def _send_to_owner(self, owner: str, msg: dict) -> None:
        job = self.jobs.get(owner)
        stream = job.stream if job is not None else self.scheduler.stream_comms.get(owner)
        if stream is None:
            return
        try:
            stream.send(msg)
        except CommClosedError:
            pass

    def task_records(self, records: list, running: dict, queued: dict, tasks: Any = (),
                     worker: str | None = None) -> None:
        """A worker's yr calls for Dask's Task Stream and Progress (scheduler/panels.py)."""
        if worker is not None:
            self.panels.add(worker, records, running, queued, tasks=tasks)

    def _job_lent(self, lent: set, blocked: bool, lease_id: str) -> None:
        """``LeaseBlocked`` / ``LeaseUnblocked`` on a job stream: remembered per stream."""
        if blocked:
            lent.add(lease_id)
            self.lease_service.lease_blocked(lease_id)
        else:
            lent.discard(lease_id)
            self.lease_service.lease_unblocked(lease_id)


class _LoopEdge:
    """The lease service's I/O edge in the scheduler: the event loop's clock and timers, the
    job and worker streams, Dask's view of the workers, resource groups after each event."""

    def __init__(self, ext: YrSchedulerExtension) -> None:
        self.ext = ext

    def now(self) -> float:
        return self.ext._loop().time()

    def call_at(self, at: float, fn: Callable[[], None]) -> None:
        self.ext._loop().call_at(at, fn)

    def send_to_owner(self, owner: str, msg: dict) -> None:
        self.ext._send_to_owner(owner, msg)

    def broadcast(self, msg: Any, but: str) -> None:
        self.ext._broadcast(msg, but)

    def has_job(self, owner: str) -> bool:
        return owner in self.ext.jobs

    def is_worker(self, owner: str) -> bool:
        return owner in self.ext.scheduler.workers

    def after_feed(self) -> None:
        rgroups = getattr(self.ext, "rgroups", None)
        if rgroups is not None:  # capacity may have changed: lost bundles, pending groups
            rgroups.after_feed()


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

    def valid_workers_downscaling(self, scheduler: Any, workers: list) -> list:
        return self.ext.drainer.valid_workers_downscaling(workers)
