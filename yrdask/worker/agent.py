"""The worker agent: serves call channels, hosts instances, keeps large results, and runs
pushed tasks through its task part (:mod:`yrdask.worker.task_runner`).

One agent per worker process, installed by :class:`yrdask.worker.plugin.YrWorkerPlugin`.
It registers the worker ops of :mod:`yrdask.protocol` (``WORKER_RPC``) on the Dask worker,
tells the scheduler extension what the worker offers (``REGISTER_WORKER``), and creates the
process's yr runtime so code inside tasks can use the whole API (nested calls).

Tasks run on the agent's own thread pool, not Dask's executor: resources are accounted by
the scheduler's leases, so the pool only has to have a thread for every leased task, plus
the ones blocked in ``yr.get`` (which lend their CPU back).  What runs at once on the
worker's threads is shared with Dask's own tasks (:mod:`yrdask.worker.share`).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import dask
import psutil
from distributed.comm.core import CommClosedError
from distributed.worker_state_machine import SecedeEvent
from tornado.ioloop import PeriodicCallback

from yrdask import config as _config  # registers the yrdask.* defaults
from yrdask import protocol as P
from yrdask.runtime.runtime import install_worker_runtime, uninstall_worker_runtime
# A driver imports these when its runtime is built; a worker with its agent, so that the
# embedded cluster's launcher imports them once, before it forks the workers.
from yrdask.runtime import instance_router as _instance_router  # noqa: F401
from yrdask.runtime import submitter as _submitter  # noqa: F401
from yrdask.runtime.store import configure as configure_store
from yrdask.runtime.store import drop_local_copy, node_store
from yrdask.stream import StreamSender
from yrdask.worker.channel_peers import LocalPeer, Peer
from yrdask.worker.dask_panels import FLUSH_MS, Recorder, store_bytes
from yrdask.worker.hosting import RESULT_INLINE_LIMIT, HostedInstance, SideEdge, drain_hosted
from yrdask.worker.isolated.pool import ProcessPool
from yrdask.worker.isolated.supervisor import IsolatedInstance
from yrdask.worker.isolated.zygote import Zygote, child_info
from yrdask.worker.devices import device_isolation, gpu_offer, node_id, npu_offer
from yrdask.worker.execution import Execution, current_execution
from yrdask.worker.threads import instance_cpus, with_cpus
from yrdask.worker.lending import LEND_DELAY_S, LendNotices, parse_delay
from yrdask.worker.task_runner import TaskRunner, _AgentEdge, _Ending
from yrdask.worker.task_side import TaskSide
from yrdask.worker.instance_side import InstanceSide
from yrdask.worker.share import SharedThreadPoolExecutor, WorkerShare
from yrdask.errors import YRRuntimeError
from yrdask.serialization import Frames, wire

logger = logging.getLogger("yrdask.worker")

MAX_THREADS = 4096


def _warmed(fut: asyncio.Future) -> None:
    if not fut.cancelled() and fut.exception() is not None:
        logger.warning("starting this worker's zygote ahead of need failed (its first process "
                       "instance starts it): %r", fut.exception())


class WorkerAgent(TaskRunner):
    """yr's per-worker agent (see module docstring); running pushed tasks is its
    :class:`~yrdask.worker.task_runner.TaskRunner` part."""

    def __init__(self, worker: Any) -> None:
        self.worker = worker
        self.loop = asyncio.get_running_loop()
        self.store: dict[str, bool] = {}  # ids of large values this worker wrote (store.py)
        self._store_figures: tuple[float, tuple[int, int]] | None = None
        self.fn_payloads: dict[str, bytes] = {}
        self.functions: dict[str, Callable] = {}
        self.executor = ThreadPoolExecutor(MAX_THREADS, thread_name_prefix="yr-task")
        self._ending = _Ending()  # per task thread: the task its ending admits (see start)
        # answers held back while their threads run the next task (_hold_reply); the loop
        # sends them at the end of the run, or HOLD_REPLY_S after the first at the latest
        self._held: collections.deque = collections.deque()
        self._held_armed = False
        self._held_timer: asyncio.TimerHandle | None = None
        self.replies_held = 0  # answers held back so far (a figure: threads may race on it)
        # The task side's decisions (worker/task_side.py, which the simulation drives too);
        # _AgentEdge below is its I/O edge.  Its tables and gate, by their short names:
        self.task_side = TaskSide(_AgentEdge(self), Execution, notices=LendNotices(
            parse_delay(dask.config.get("yrdask.worker.lend-delay", LEND_DELAY_S))))
        self.tasks: dict[str, Execution] = self.task_side.tasks  # pushed, not ended/bounced
        self.running: dict[str, Execution] = self.task_side.running  # their function runs now
        self.gate = self.task_side.gate
        self.gate_lock = self.task_side.lock  # task threads end tasks and lend slots
        self._gate = self.task_side.feed  # feed the lease gate (any thread)
        # the worker's threads, shared with Dask's tasks (share.py); never wired when off,
        # so its ``dask`` count stays 0 and yr tasks never wait on it
        self.share = WorkerShare(self.worker.state.nthreads, self._yr_running)
        self.inline_limit = RESULT_INLINE_LIMIT
        # The instance side's decisions (worker/instance_side.py, which the simulation
        # drives too); hosting.SideEdge is its I/O edge.  Its tables by their short names:
        self.instance_side = InstanceSide(SideEdge(self.host))
        self.instances: dict[str, HostedInstance | IsolatedInstance] = \
            self.instance_side.instances
        self.ended: dict[str, str] = self.instance_side.ended  # recently stopped -> reason
        self.pool = ProcessPool(self)  # processes for tasks with env_vars (docs/isolation.md)
        self._warming: asyncio.Future | None = None  # WarmZygote's start of the zygote
        worker.handlers.update(P.handlers(P.WORKER_RPC, self))
        # START_INSTANCE and CALL_METHOD are the instance side's own handlers
        worker.stream_handlers.update(P.handlers(P.WORKER_STREAM, self, self.instance_side))
        # Call channel handlers take (peer, wire dict): the hot path keeps the dict it read.
        self.channel_handlers = P.handlers(P.CHANNEL_TO_WORKER, self, self.instance_side)
        self.node_id = node_id(worker.address)  # the node (host) this process belongs to
        configure_store()  # yrdask.object-store.memory, when this worker's config sets it
        self.runtime = install_worker_runtime(self)
        self.tasks_done = 0
        self._dask_executor: Any = None
        if dask.config.get("yrdask.worker.share-threads", True):
            self._share_with_dask()
        worker.metrics["yr"] = lambda _worker: self.metrics()
        # yr values this worker keeps in the node's store, as columns of Dask's Workers page
        # (docs/monitoring.md, "yr values in Dask's memory figures")
        worker.metrics["yr_store_bytes"] = lambda _worker: self.store_figures()[0]
        worker.metrics["yr_store_spilled_bytes"] = lambda _worker: self.store_figures()[1]
        self.recorder: Recorder | None = None
        if dask.config.get("yrdask.dashboard.dask-panels", True):
            self.recorder = Recorder(self, bool(dask.config.get("yrdask.dashboard.profile",
                                                                True)))
            pc = PeriodicCallback(self.recorder.flush, FLUSH_MS)
            worker.periodic_callbacks["yr-dask-panels"] = pc  # Dask stops it at close
            pc.start()

    def capacity(self) -> dict[str, float]:
        """What this worker offers: CPU millicores, Memory MB and its --resources tags
        (``GPU`` and ``NPU`` entries become device ids: :meth:`offer`)."""
        cpu = dask.config.get("yrdask.worker.cpu", None)
        cpu = float(cpu) if cpu is not None else self.worker.state.nthreads * 1000.0
        limit = self.worker.memory_manager.memory_limit or psutil.virtual_memory().total
        cap = {"CPU": cpu, "Memory": float(limit // 2**20)}
        cap.update({k: float(v) for k, v in self.worker.state.total_resources.items()
                    if k not in ("GPU", "NPU")})
        return cap

    def offer(self) -> P.RegisterWorker:
        """What this process adds to its node (docs/nodes.md): its capacity, the node it
        belongs to, the GPU and NPU ids it can run work on, and node-wide resources (their
        ``accelerator_type:<model>``, resources declared for the whole node) and its labels."""
        declared = self.worker.state.total_resources
        gpus, model = gpu_offer(declared)
        npus, npu_model = npu_offer(declared)
        shared = {str(k): float(v) for k, v in
                  (dask.config.get("yrdask.worker.node-resources", None) or {}).items()}
        for ids, kind in ((gpus, model), (npus, npu_model)):
            if ids and kind:
                shared.setdefault(f"accelerator_type:{kind}", 1.0)
        return P.RegisterWorker(self.worker.address, self.capacity(), P.PROTOCOL_VERSION,
                                self.node_id, (*gpus, *npus), shared, _config.node_labels())

    def _share_with_dask(self) -> None:
        """Dask's tasks take their thread from :attr:`share` too (docs/scheduling.md, "One
        share of each worker"): its default executor runs each under a share, and a task
        that secedes gives its share back when Dask learns of it."""
        worker, share = self.worker, self.share
        share.capacity = max(1, int(self.capacity()["CPU"] // 1000))
        share.wired = True
        self._dask_executor = worker.executors["default"]
        worker.executors["default"] = SharedThreadPoolExecutor(self._dask_executor, share)
        original = worker.handle_stimulus

        def handle_stimulus(*stims: Any) -> None:
            for stim in stims:
                if type(stim) is SecedeEvent:
                    for ident, key in list(worker.active_threads.items()):
                        if key == stim.key:
                            share.dask_give(ident)
            original(*stims)

        worker.handle_stimulus = handle_stimulus

    def _yr_running(self) -> int:
        """yr tasks started and not blocked in ``yr.get`` (what they take of the share)."""
        with self.gate_lock:
            return self.gate.active()

    def lend_slot(self, holding_id: str, blocked: bool) -> None:
        """A task of this lease waits in ``yr.get``: let the gate start the next one, and
        lend its CPU to the cluster if the wait lasts (``worker/lending.py``).

        Runs in the task's thread: shielded, so a cancel cannot tear the gate's update.
        ``holding_id`` ``""``: a thread with no lease (a Dask task) lends its share only.
        """
        share = self.share
        if not holding_id:
            share.dask_lend(blocked)
            return
        ex = current_execution()
        if ex is None:
            self.task_side.lend(holding_id, blocked)
        else:
            ex.shield()
            try:
                self.task_side.lend(holding_id, blocked)
            finally:
                ex.unshield()
        if holding_id in self.gate.leases:  # a lease's task
            if share.dask:
                if blocked:
                    share.yr_freed()
                else:
                    share.yr_start()  # back from yr.get: waits while Dask uses its thread
        elif holding_id in self.instances:  # an instance's method call (share.py)
            share.call_lend(blocked)

    def asking(self, asking: bool) -> None:
        """This worker's runtime sends a lease request (``asking``) or has its answer."""
        self.task_side.asking(asking)

    def prefers_local(self) -> bool:
        """Local first: ask for leases on this worker while its yr queue is short."""
        if not dask.config.get("yrdask.scheduling.local-first"):
            return False
        return self.task_side.load() <= dask.config.get("yrdask.scheduling.local-queue-limit")

    def metrics(self) -> dict[str, Any]:
        """Load report sent with every Dask heartbeat (``ws.metrics["yr"]`` on the scheduler).

        ``instances`` maps each hosted instance id to ``[calls_done, calls_pending]``;
        ``scheduling`` holds this process's submitter counters (local vs forwarded work);
        ``kept`` counts the large values it keeps for their owners (scale-down reads it).
        """
        return {
            "tasks_running": len(self.running),
            "tasks_queued": max(0, len(self.tasks) - len(self.running)),
            "tasks_done": self.tasks_done,
            "instances": {iid: [inst.calls_done, inst.calls_pending]
                          for iid, inst in self.instances.items()},
            "scheduling": self.runtime.submitter.figures(),
            "kept": len(self.store),
        }

    def store_figures(self) -> tuple[int, int]:
        """Bytes of the values this worker keeps in its node's store (results it holds for
        their owners, and values it owns: ``yr.put`` in its tasks): ``(in shared memory,
        spilled)``, computed once per heartbeat (both metrics read it)."""
        now = time.monotonic()
        cached = self._store_figures
        if cached is None or now - cached[0] > 0.1:
            ids = set(self.store)
            ids.update(oid for oid, e in list(self.runtime.objects.entries.items())
                       if e.stored and e.owner is None)
            figures = (0, 0)
            if ids:
                store = node_store()
                figures = store_bytes(ids, store.objects, store.spill)
            cached = self._store_figures = (now, figures)
        return cached[1]

    async def register(self) -> None:
        await P.request(self.worker.scheduler, self.offer())

    async def close(self) -> None:
        for inst in list(self.instances.values()):  # no isolated process outlives its worker
            if type(inst) is IsolatedInstance:
                inst.kill_now()
        self.pool.close()
        if self._warming is not None:  # (Popen: ms) no zygote started after the close below
            await asyncio.wait([self._warming])
        Zygote.close_current()
        await self.runtime.close()
        uninstall_worker_runtime(self.runtime)
        if self._dask_executor is not None:  # Dask's own executor and stimulus handler back
            self.worker.executors["default"] = self._dask_executor
            self.worker.__dict__.pop("handle_stimulus", None)
        self.executor.shutdown(wait=False, cancel_futures=True)

    # -- call channels ---------------------------------------------------------------------

    async def open_channel(self, comm: Any, caller: str, expect: str = "") -> None:
        if expect and expect != self.worker.id:  # meant for a dead process at this address
            comm.abort()
            return
        stream = StreamSender(comm)
        peer = Peer(self.runtime.on_loop_later, stream, caller)
        try:
            while True:
                msgs = await comm.read()
                for msg in msgs if isinstance(msgs, (list, tuple)) else (msgs,):
                    self.dispatch(peer, msg)
        except (CommClosedError, OSError):
            pass
        finally:
            if not comm.closed():
                comm.abort()

    def local_peer(self, on_message: Callable[[dict], None]) -> LocalPeer:
        return LocalPeer(self, on_message)

    def dispatch(self, peer: Any, msg: dict) -> None:
        """A message of :data:`P.CHANNEL_TO_WORKER` from a caller (others are ignored)."""
        handler = self.channel_handlers.get(msg["op"])
        if handler is not None:
            handler(peer, msg)

    # -- objects ---------------------------------------------------------------------------

    def store_get(self, object_id: str) -> Frames:
        payload = node_store().get(object_id)
        if payload is None:
            raise YRRuntimeError(f"object {object_id} is no longer on worker "
                                 f"{self.worker.address} (nor in its node's store)")
        return payload

    async def fetch_object(self, object_id: str, timeout: float | None = None) -> list:
        """``FETCH_OBJECT``: a value in this node's store is served from it (a peer pulls it
        once for its node); else this process owns the object and answers when it exists."""
        payload = node_store().get(object_id)
        if payload is not None:
            return [P.VALUE, wire(payload)]
        return await self.runtime.handle_fetch(object_id, timeout)

    def free_objects(self, object_ids: list[str]) -> None:
        """``FREE_OBJECTS``: their owner freed them (docs/objects.md, when a value is freed)."""
        for oid in object_ids:
            self.drop_local_copy(oid)

    def drop_local_copy(self, object_id: str) -> None:
        """Drop this node's copy of ``object_id`` (shared memory or spilled; idempotent).

        The one place the agent frees a value's bytes: the owner's free (``FREE_OBJECTS``)
        and the reference-counting protocol call it.  Processes still reading it keep their
        mappings; the memory goes back when they drop them.
        """
        self.store.pop(object_id, None)
        drop_local_copy(object_id)

    def wait_refs_removed(self, sender: str, items: list) -> None:
        """:class:`P.WaitRefsRemoved`: an owner polls this process as borrower."""
        self.runtime.wait_refs_removed(sender, items)

    def refs_removed(self, sender: str, items: list) -> None:
        """:class:`P.RefsRemoved`: a borrower of this process's objects answers."""
        self.runtime.refs_removed(sender, items)

    def add_borrower(self, items: list) -> list:
        """:class:`P.AddBorrower`."""
        return self.runtime.handle_add_borrower(items)

    def cancel_owned(self, object_ids: list, force: bool = False,
                     recursive: bool = False) -> None:
        """:class:`P.CancelOwned`: a borrower cancels tasks this process submitted."""
        self.runtime.handle_cancel_owned(object_ids, force, recursive)

    def worker_lost(self, worker: str, server_id: str = "") -> None:
        self.runtime.worker_lost(worker, server_id)

    def worker_exit(self, worker: str, how: str, server_id: str = "") -> None:
        self.runtime.worker_exit(worker, how, server_id)

    def worker_joined(self, worker: str, server_id: str = "") -> None:
        self.runtime.worker_joined(worker, server_id)

    def revoke_leases(self, lease_ids: list[str], keep: bool = False) -> None:
        self.runtime.submitter.revoke_leases(lease_ids, keep)

    def warm_zygote(self) -> None:
        """:class:`P.WarmZygote`: start this worker's zygote now, in a thread (its start
        blocks), as its first process instance would (docs/isolation.md, "Process start").
        Once; a failure is logged, and the first use tries again."""
        if self._warming is not None:
            return
        self._warming = self.loop.run_in_executor(
            None, Zygote.get, child_info(self), self.loop, self.runtime.connection_args)
        self._warming.add_done_callback(_warmed)

    # -- instances -------------------------------------------------------------------------

    def host(self, spec: dict, running: Any) -> HostedInstance | IsolatedInstance:
        """Host the instance of a ``START_INSTANCE`` here, or in a process of its own."""
        if type(running) is IsolatedInstance:  # its process died: the scheduler restarts it
            running.restart(spec)
            return running
        if spec.get("devices"):  # it holds GPUs: its own process that sees exactly them
            spec = {**spec, "isolation": device_isolation(spec.get("isolation"),
                                                          spec["devices"], spec["cpus"])}
        if spec.get("isolation") is not None:  # its own process (docs/isolation.md)
            if not spec.get("devices"):  # its whole CPUs size its process's threads
                spec = {**spec, "isolation": with_cpus(spec["isolation"], instance_cpus(spec))}
            return IsolatedInstance(self, spec)
        return HostedInstance(self, spec, spec["deps"])

    def crash_instance(self, instance_id: str, reason: str, incarnation: int) -> None:
        """``CRASH_INSTANCE``: kill the instance's process as if it crashed.  An isolated
        one's child is killed and its watcher reports the death; a light one (its process is
        this worker's) is stopped here and its death reported at once, as ``incarnation``."""
        inst = self.instances.get(instance_id)
        if type(inst) is IsolatedInstance:
            inst.crash()
        elif inst is not None:
            logger.warning("instance %s: %s", instance_id, reason)
            self.instance_side.crash(instance_id, reason)
            self.report_state(instance_id, P.RESTARTING, None, reason, incarnation)

    async def stop_instance(self, instance_id: str, reason: str, force: bool = False) -> None:
        """:class:`P.StopInstance`; ``force``: at once, without its shutdown hook (a process
        instance's process is killed, its atexit handlers do not run)."""
        inst = self.instances.get(instance_id)
        if force and type(inst) is IsolatedInstance:
            inst.stopped = reason  # the stop below kills it, no StopIsolated first
            self.instance_side.stop(instance_id, reason)
            inst.kill_now()
            return
        obj = getattr(inst, "obj", None)  # pending calls fail first, then the hook runs
        self.instance_side.stop(instance_id, reason)
        hook = getattr(inst, "run_shutdown_hook", None)
        if hook is not None and not force:  # __yr_shutdown__(grace), bounded by the grace
            await hook(obj)

    # -- scale-down (scheduler/drain.py, docs/deploy.md#scaling-down) ---------------------

    async def drain_instance(self, instance_id: str, timeout_s: float = 30.0) -> bytes | None:
        """:class:`P.DrainInstance`: hold the instance's new calls, wait until the calls it
        has are answered, then take its current state (``None``: not within ``timeout_s``,
        not hosted here, or its ``__init__`` failed).  A process instance's calls go to its
        own process, which does this there."""
        inst = self.instance_side.instances.get(instance_id)
        if type(inst) is IsolatedInstance:
            return await inst.drain(timeout_s)
        return await drain_hosted(self.instance_side, instance_id, timeout_s)

    async def instance_moved(self, instance_id: str, to: str = "") -> None:
        """:class:`P.InstanceMoved`: the instance left for ``to`` (it ends here without its
        shutdown hook: it lives on there), or the move was given up (``to`` empty).  A
        process instance's process answers its held calls first, then goes."""
        running = self.instance_side.instances.get(instance_id)
        if type(running) is IsolatedInstance:
            await running.moved(to)
        inst = self.instance_side.release(instance_id, to)
        if inst is None:
            return
        logger.info("instance %s moved to %s", instance_id, to)
        if type(inst) is IsolatedInstance:
            inst.kill_now()
        else:
            inst.stop(f"it moved to {to}")

    async def end_processes(self, instance_ids: list) -> list[str]:
        """:class:`P.EndProcesses`: the worker retires; these instances restart elsewhere
        once it is gone, so their own processes end now (unreported).  Returns the ids whose
        processes ended."""
        ended = []
        for iid in instance_ids:
            inst = self.instance_side.instances.get(iid)
            if type(inst) is IsolatedInstance and await inst.end_for_retirement():
                ended.append(iid)
        if ended:
            logger.info("instances %s: their processes ended, the worker retires", ended)
        return ended

    def kept_objects(self) -> list[str]:
        """:class:`P.KeptObjects`: the large values this worker keeps for their owners."""
        return list(self.store)

    async def adopt_objects(self, source: str, object_ids: list) -> list[str]:
        """:class:`P.AdoptObjects`: keep these values in place of ``source`` (retiring):
        recorded if this node has them already, else pulled from ``source`` once."""
        store = node_store()
        kept = []
        for oid in object_ids:
            try:
                if store.contains(oid):
                    store.ensure_attached()  # the node's store outlives ``source`` with us
                    self.store[oid] = True
                else:
                    payload = await self.loop.run_in_executor(
                        None, self.runtime.fetch_payload, oid, source)
                    if not store.contains(oid):
                        self.keep(oid, payload)
                    self.store[oid] = True
                kept.append(oid)
            except Exception:  # noqa: BLE001 - freed meanwhile, or source gone: not kept
                logger.info("object %s could not be taken over from %s", oid, source,
                            exc_info=True)
        return kept

    def objects_moved(self, worker: str, to: str, object_ids: list) -> None:
        """:class:`P.ObjectsMoved`: values ``worker`` kept are kept by ``to`` now."""
        self.runtime.objects_moved(worker, to, object_ids)

    def report_state(self, instance_id: str, state: str, error: bytes | None,
                     reason: str = "", incarnation: int = -1, address: str = "") -> None:
        self.loop.call_soon_threadsafe(
            self.runtime.connector.stream_send,
            P.InstanceState(instance_id, state, error, reason, incarnation, address))

