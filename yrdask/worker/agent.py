"""The worker agent: runs pushed tasks, serves call channels, keeps large results.

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
import os
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import dask
import psutil
from distributed.comm.core import CommClosedError
from distributed.worker_state_machine import SecedeEvent
from tornado.ioloop import PeriodicCallback

from yrdask import config as _config  # noqa: F401 - registers the yrdask.* defaults
from yrdask import protocol as P
from yrdask.runtime.objects import REF_MARK, pack_counting, unpickling
from yrdask.runtime.generators import drain, item_sender
from yrdask.runtime.runtime import install_worker_runtime, uninstall_worker_runtime
from yrdask.runtime.context import checkpoint
# A driver imports these when its runtime is built; a worker with its agent, so that the
# embedded cluster's launcher imports them once, before it forks the workers.
from yrdask.runtime import instance_router as _instance_router  # noqa: F401
from yrdask.runtime import submitter as _submitter  # noqa: F401
from yrdask.runtime.store import configure as configure_store
from yrdask.runtime.store import drop_local_copy, node_store
from yrdask.stream import StreamSender
from yrdask.worker.dask_panels import FLUSH_MS, Recorder, store_bytes
from yrdask.worker.hosting import HostedInstance
from yrdask.options import IsolatedFunction
from yrdask.worker.isolated.child import split_returns as _split_returns
from yrdask.worker.isolated.pool import ProcessDied, ProcessPool
from yrdask.worker.isolated.supervisor import IsolatedInstance, keep_large
from yrdask.worker.isolated.zygote import Zygote
from yrdask.worker.devices import device_isolation, gpu_offer, node_id, npu_offer
from yrdask.worker.execution import Execution, current_execution
from yrdask.worker.threads import (LIMITS as THREAD_LIMITS, instance_cpus, whole_cpus,
                                   with_cpus)
from yrdask.worker import lease_gate as G
from yrdask.worker.lending import LEND_DELAY_S, LendNotices, parse_delay
from yrdask.worker.task_side import TaskSide
from yrdask.worker.instance_side import InstanceSide, call_children
from yrdask.worker.share import SharedThreadPoolExecutor, WorkerShare
from yrdask.errors import (CancelledError, InstanceDiedError, InstanceMovedError, RemoteError,
                           ReturnError, TaskCrashedError, YRRuntimeError, YRValueError,
                           user_traceback)
from yrdask.serialization import (PLAIN_TYPES, Frames, dumps, dumps_value, loads, unpack_args,
                                  wire)

logger = logging.getLogger("yrdask.worker")

MAX_THREADS = 4096
# A pipelined task's plain answer waits at most this long while its thread runs the next
# task of its lease, so a run of short tasks answers in one write (_execute_gated).
HOLD_REPLY_S = 0.001
DRAIN_POLL_S = 0.005  # how often a draining instance is checked for calls still running


def drained(inst: Any) -> bool:
    """A hosted instance (in this process or its own) is built and has no call left to
    answer: its state can be taken for a move."""
    if inst.init_error is not None:
        return True
    if type(inst) is IsolatedInstance:
        return inst.stream is not None and not inst.pending and not inst.decide.waiting
    # ``running``: a call leaves the queue after its answer was handed to the loop, so the
    # answers of the calls it ran go out before any "moved" answer of the calls held
    return inst.obj is not None and not inst.pending and inst.queue.running == 0


def _loop_closed(on_loop: Callable) -> bool:
    """Whether the loop behind a runtime's bound ``on_loop`` is closed (the worker closed)."""
    rt = getattr(on_loop, "__self__", None)
    return rt is not None and rt.loop.is_closed()


class Peer:
    """A caller connected by a call channel; replies go back on the same comm.

    Replies come from task and instance threads; they reach the loop through the runtime's
    inbox, so a burst of results costs one loop wake-up and goes out in one write.
    """

    def __init__(self, on_loop: Callable[..., None], stream: StreamSender,
                 caller: str = "") -> None:
        self.on_loop = on_loop
        self.stream = stream
        self.caller = caller  # the caller's owner address: refs nested in results are lent to it

    def reply(self, msg: dict) -> None:
        try:
            self.on_loop(self._send, msg)
        except RuntimeError:
            if not _loop_closed(self.on_loop):
                raise
            # The worker is closing: its loop and the caller's comm are gone, and the caller
            # learns the worker's end from Dask; a task that ends now has no one to answer.

    def _send(self, msg: dict) -> None:
        try:
            self.stream.send(msg)
        except CommClosedError:
            pass


class LocalPeer:
    """A caller in this very process (a task submitting work to its own worker)."""

    def __init__(self, agent: "WorkerAgent", on_message: Callable[[dict], None]) -> None:
        self.agent = agent
        self.on_message = on_message
        self.caller = agent.worker.address

    def deliver(self, msg: dict) -> None:
        self.agent.dispatch(self, msg)

    def reply(self, msg: dict) -> None:
        try:
            self.agent.runtime.on_loop_later(self.on_message, msg)
        except RuntimeError:
            if not self.agent.runtime.loop.is_closed():
                raise  # else the worker is closing, and so is the caller in it (see Peer)


class WorkerAgent:
    """yr's per-worker agent (see module docstring)."""

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
        self.inline_limit = 512 * 1024
        # The instance side's decisions (worker/instance_side.py, which the simulation
        # drives too); _InstanceEdge below is its I/O edge.  Its tables by their short names:
        self.instance_side = InstanceSide(_InstanceEdge(self))
        self.instances: dict[str, HostedInstance | IsolatedInstance] = \
            self.instance_side.instances
        self.ended: dict[str, str] = self.instance_side.ended  # recently stopped -> reason
        self.pool = ProcessPool(self)  # processes for tasks with env_vars (docs/isolation.md)
        worker.handlers.update(P.handlers(P.WORKER_RPC, self))
        worker.stream_handlers.update(P.handlers(P.WORKER_STREAM, self))
        # Call channel handlers take (peer, wire dict): the hot path keeps the dict it read.
        self.channel_handlers = P.handlers(P.CHANNEL_TO_WORKER, self)
        self.channel_handlers[P.CALL_METHOD] = self.instance_side.call_method  # one hop less
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
        ``accelerator_type:<model>``, resources declared for the whole node)."""
        declared = self.worker.state.total_resources
        gpus, model = gpu_offer(declared)
        npus, npu_model = npu_offer(declared)
        shared = {str(k): float(v) for k, v in
                  (dask.config.get("yrdask.worker.node-resources", None) or {}).items()}
        for ids, kind in ((gpus, model), (npus, npu_model)):
            if ids and kind:
                shared.setdefault(f"accelerator_type:{kind}", 1.0)
        return P.RegisterWorker(self.worker.address, self.capacity(), P.PROTOCOL_VERSION,
                                self.node_id, (*gpus, *npus), shared)

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
            "instances": {iid: [inst.calls_done, len(inst.pending)]
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

    # -- tasks -----------------------------------------------------------------------------

    def run_task(self, peer: Any, msg: dict) -> None:
        """A task pushed on a lease (loop thread): the gate starts it, holds it or bounces it."""
        if msg["fn"] is not None:
            self.fn_payloads[msg["fn_id"]] = msg["fn"]
        if not self.task_side.run_task(peer, msg):  # pushed twice: the first one answers
            logger.warning("task %s pushed again while it is here; ignored", msg["task_id"])

    def _execute_gated(self, ex: Execution | None) -> None:
        """Run admitted tasks (task thread); whatever happens, answer each and end it.

        A task whose end admits the next one of its lease (pipelined tasks waiting in the
        gate) hands it to this very thread (:meth:`_AgentEdge.start`): it runs once the
        answer is on its way, with no other thread to wake, and a run of short tasks keeps
        the thread busy, so their answers share the loop's wake-ups and writes.

        A cancel raised in this thread may arrive late, after the user code (see
        :mod:`yrdask.worker.execution`): it is caught here, the task answers as cancelled,
        and the loop below makes sure the record is disarmed before the bookkeeping runs.
        """
        ending = self._ending
        while ex is not None:
            if self.share.dask:  # Dask tasks run here: wait for a thread (share.py)
                self.share.yr_start()
            try:
                reply = self._execute(ex)
            except CancelledError:
                reply = None
            # in this frame: a CancelledError raised on entering disarm lands here.
            # _execute's own disarm leaves it neither armed nor shielded unless a cancel cut
            # it short
            while ex.armed or ex.shielded:
                try:
                    ex.disarm()
                    break
                except CancelledError:
                    reply = None
            # A plain answer goes first when it would not be held (no task of its lease waits
            # here, none held before it): the caller's next step starts while the gate's
            # bookkeeping runs.  A plain answer is never retried, so no retry of it needs
            # the slot free.  Any other answer (an error, a cancel: maybe retried) is sent
            # only once the task is forgotten: a retry of it (same id, same lease) may come
            # back before this thread runs again, and must find the slot free.
            early = reply is not None and "error" not in reply and (
                type(ex.peer) is not Peer
                or not (self._held or self.task_side.next_waits(ex.task_id)))
            if early:
                try:
                    ex.peer.reply(reply)
                except Exception:
                    logger.exception("cannot answer task %s", ex.task_id)
            # A task its end admits comes back in ending.next (the first one; any other
            # goes to the executor).
            ending.free = True
            try:
                self.task_side.finished(ex)
            except BaseException:
                ending.free = False
                after, ending.next = ending.next, None
                if after is not None:  # admitted all the same: another thread runs it
                    self.executor.submit(self._execute_gated, after)
                raise
            ending.free = False
            after, ending.next = ending.next, None
            if self.share.dask:
                self.share.yr_freed()
            if early:
                ex = after
                continue
            try:
                if reply is None:
                    reply = self._error_reply(ex.task_id, CancelledError(
                        f"task {ex.task_id} cancelled"), "", False)
                if type(ex.peer) is Peer and (after is not None or self._held):
                    self._hold_reply(ex.peer, reply, after is not None
                                     and "refs" not in reply and "error" not in reply)
                else:
                    ex.peer.reply(reply)
            except Exception:
                logger.exception("cannot answer task %s", ex.task_id)
            ex = after

    def _hold_reply(self, peer: "Peer", reply: dict, hold: bool) -> None:
        """Answer ``reply`` through the held answers (task thread): ``hold`` it while this
        thread runs the next task, else send it with those held so far (in order).

        Only a plain result is held (op, task id, results, took: no refs report, whose order
        against the worker's other reference messages matters, no error).  With a worker per
        core each answer otherwise goes in a write of its own, and the caller's loop pays a
        read per task; held, the answers of a run of short tasks share one write, and an
        answer waits at most HOLD_REPLY_S: the first one held arms a loop timer, which then
        covers every run of the next HOLD_REPLY_S (one wake-up to arm it per period, not per
        run); the last answer of each run sends the held ones at once.
        """
        if hold:
            self._held.append((peer, reply))
            self.replies_held += 1
            if not self._held_armed:
                self._held_armed = True
                self._on_loop(self._arm_held)
        else:  # at its own place in the inbox: never ahead of what this thread queued before
            self._on_loop(self._send_after_held, peer, reply)

    def _on_loop(self, fn: Callable[..., None], *args: Any) -> None:
        try:
            self.runtime.on_loop(fn, *args)
        except RuntimeError:
            if not self.runtime.loop.is_closed():
                raise  # else the worker is closing: nobody is left to answer (see Peer)

    def _arm_held(self) -> None:
        if self._held_timer is None:
            self._held_timer = self.loop.call_later(HOLD_REPLY_S, self._held_expired)

    def _held_expired(self) -> None:
        self._held_timer = None
        self._held_armed = False  # before draining: an answer held later arms again
        self._send_held()

    def _send_after_held(self, peer: "Peer", reply: dict) -> None:
        """Send the answers held so far, then ``reply`` (loop thread)."""
        self._send_held()
        peer._send(reply)

    def _send_held(self) -> None:
        """Send the answers held so far (loop thread), each on its caller's stream."""
        held = self._held
        while held:
            peer, reply = held.popleft()
            peer._send(reply)

    def payloads(self, deps: list) -> list[bytes]:
        """Pickled values of a call's ref arguments; fetches remote ones (not on the loop)."""
        return [payload if kind == P.VALUE else self.runtime.fetch_payload(oid, payload)
                for oid, kind, payload in deps]

    def deps_by_value(self, deps: list) -> list:
        """``deps`` for an isolated process, which cannot fetch from owners: small values in
        the message, large ones as ``[id, STORED, None]`` (now in this node's store, which
        the child maps itself); fetches remote ones (not on the loop)."""
        return [[oid, P.STORED, None] if type(p) is Frames else [oid, P.VALUE, wire(p)]
                for (oid, _k, _p), p in zip(deps, self.payloads(deps))]

    def _cancelled(self, task_id: str) -> dict:
        return self._error_reply(task_id, CancelledError(f"task {task_id} cancelled"), "",
                                 False)

    def _function(self, fn_id: str) -> Callable:
        fn = self.functions.get(fn_id)
        if fn is None:
            fn = self.functions[fn_id] = loads(self.fn_payloads[fn_id])
        return fn

    def _execute(self, ex: Execution) -> dict:
        """The ``TASK_DONE`` reply of one task; the user function runs armed for cancels."""
        msg = ex.msg
        task_id = ex.task_id
        if ex.cancelled:  # cancelled while it waited: it never runs
            return self._cancelled(task_id)
        lease_id = msg["lease_id"]
        try:
            fn = self.functions.get(msg["fn_id"])
            if fn is None:
                fn = self._function(msg["fn_id"])
            isolated = type(fn) is IsolatedFunction
            if isolated or P.DEVICES_MARK in lease_id:
                # isolated, or it holds GPUs: a process of its own (that sees them)
                isolation = fn.isolation if isolated else None
                if P.DEVICES_MARK in lease_id:
                    isolation = device_isolation(isolation, *P.lease_devices(lease_id))
                else:  # its whole CPUs size its process's threads
                    isolation = with_cpus(isolation, P.lease_cpus(lease_id))
                return self._execute_isolated(ex, isolation)
            if not msg["deps"] and REF_MARK not in msg["args"]:  # unpack_call's hot path
                args, kwargs = unpack_args(msg["args"], [])
                borrowed: list = []
            else:
                (args, kwargs), borrowed = self.unpack_call(msg)
        except BaseException as e:  # noqa: BLE001
            return self._error_reply(task_id, e, traceback.format_exc(), False)
        rec = self.recorder  # Dask's Task Stream, Progress and Profile (dask_panels.py)
        start = rec.begin(msg["name"], task_id) if rec is not None else 0.0
        # 2 whole CPUs or more: its threads follow them (worker/threads.py); else nothing
        cpus = whole_cpus(P.lease_cpus(lease_id)) if P.CPUS_MARK in lease_id else 0
        if cpus:
            in_thread = THREAD_LIMITS.enter(cpus)
        # armed, the thread also runs in the task's context (lease, owner) until disarmed
        if not ex.arm(lease_id, msg["owner"]):
            if cpus:
                THREAD_LIMITS.leave(cpus, in_thread)
            if rec is not None:
                rec.drop()
            return self._cancelled(task_id)
        self.running[task_id] = ex
        t0 = time.perf_counter()
        ok = False
        try:
            try:
                result = fn(*args, **kwargs)
                if msg["nret"] < 0:  # P.STREAMING: send each item now, answer the count
                    result = drain(result, self.item_sender(ex.peer, task_id), ex)
            finally:
                try:
                    ex.disarm()  # if a late cancel interrupts this, the caller disarms again
                finally:
                    if cpus:  # after disarm: no cancel lands in the bookkeeping
                        THREAD_LIMITS.leave(cpus, in_thread)
            if type(result) in PLAIN_TYPES and msg["nret"] <= 1:  # pack_results' hot path
                # pickled once: a large plain value is kept as it is, not pickled again
                results, nested = [self._place(task_id, dumps(result))], None
            else:
                results, nested = self.pack_results(task_id, result, msg["nret"],
                                                    ex.peer.caller)
            ok = True
        except BaseException as e:  # noqa: BLE001 - reported to the caller
            reply = self._error_reply(task_id, e, user_traceback(), not ex.cancelled)
            if borrowed:  # the failed function may have kept them all the same
                reply["refs"] = [self.worker.address, borrowed, None]
            return reply
        finally:
            if rec is not None:
                rec.end(msg["name"], task_id, start, ok)
        self.tasks_done += 1
        return P.TaskDone.wire(task_id, results=results, took=time.perf_counter() - t0,
                               refs=[self.worker.address, borrowed, nested]
                               if borrowed or nested else None)  # refs_report, inline

    def unpack_call(self, msg: dict) -> tuple[tuple, list]:
        """``((args, kwargs), borrowed)`` of a pushed call (not on the loop): ``borrowed`` the
        ids of the counted refs its arguments held, reported to the caller in ``TaskDone``;
        refs nested in the values of its ref arguments register with their owners."""
        deps = msg["deps"]
        values = [self.load_value(p) for p in self.payloads(deps)] if deps else []
        args = msg["args"]
        if REF_MARK not in args:  # the hot path: no ref in the arguments
            return unpack_args(args, values), []
        unpacked, found = unpickling(unpack_args, args, values)
        return unpacked, list(found)

    def load_value(self, payload: Any) -> Any:
        """Unpickle a ref argument's value (refs nested in it register with their owners)."""
        return self.runtime.load_borrowed(payload)

    def refs_report(self, borrowed: list, nested: list | None) -> list | None:
        """``TaskDone.refs`` (``None`` on the hot path: no counted refs met)."""
        if not borrowed and not nested:
            return None
        return [self.worker.address, borrowed, nested]

    def _execute_isolated(self, ex: Execution, isolation: dict) -> dict:
        """A task with env_vars/working_dir: it runs in a pooled child process.

        A crash there takes that process only: the task fails with ``TaskCrashedError``
        naming the exit code or signal, and the worker goes on.
        """
        msg, task_id = ex.msg, ex.task_id
        if msg["nret"] < 0:  # refused at .invoke() already; a reply, should one come anyway
            return self._error_reply(task_id, YRValueError(
                "a generator function cannot run in an isolated process (env_vars/runtime_env/"
                "isolated): drop those options or return a list"), "", False)
        try:
            deps = self.deps_by_value(msg["deps"])
        except BaseException as e:  # noqa: BLE001 - a ref argument could not be fetched
            return self._error_reply(task_id, e, traceback.format_exc(), False)
        request = P.RunIsolated(task_id, msg["lease_id"], msg["fn_id"],
                                self.fn_payloads[msg["fn_id"]], msg["args"], deps,
                                msg["nret"], msg["owner"], msg.get("log_to"),
                                msg["name"], ex.peer.caller or "").to_msg()
        rec = self.recorder
        start = rec.begin(msg["name"], task_id) if rec is not None else 0.0
        if not ex.arm():
            if rec is not None:
                rec.drop()
            return self._cancelled(task_id)
        self.running[task_id] = ex
        t0 = time.perf_counter()
        try:
            try:
                reply = self.pool.run(isolation, request)
            finally:
                ex.disarm()
                if rec is not None:
                    rec.end(msg["name"], task_id, start, True)
        except ProcessDied as e:
            return self._error_reply(task_id, TaskCrashedError(
                f"task {msg['name']} ({task_id}): {e.args[0]} while it ran; the worker and "
                "its other work go on, and the task is not run again"), "", False)
        except BaseException as e:  # noqa: BLE001 - a cancel
            return self._error_reply(task_id, e, "", False)
        if reply.get("results") is not None:
            reply["results"] = keep_large(self, task_id, reply["results"])
            self.tasks_done += 1
        reply["took"] = time.perf_counter() - t0
        return reply

    def _error_reply(self, task_id: str, exc: BaseException, tb: str, retryable: bool) -> dict:
        err = RemoteError.from_exception(exc, tb)
        return P.TaskDone(task_id, error=dumps(err), retryable=retryable).to_msg()

    def _reply_error(self, peer: Any, task_id: str, exc: BaseException, tb: str, retryable: bool) -> None:
        peer.reply(self._error_reply(task_id, exc, tb, retryable))

    def item_sender(self, peer: Any, task_id: str) -> Callable[[int, Any], None]:
        """``emit(index, value)`` for a generator call: stored like a result, sent at once,
        its nested refs lent to the caller via the item (:func:`generators.item_sender`)."""
        return item_sender(self.pack_results, self.runtime, peer, task_id)

    def pack_results(self, task_id: str, result: Any, nret: int,
                     caller: str | None) -> tuple[list, list | None]:
        """``([kind, payload] per return value, nested)``; large values stay in this worker's
        store.  Counted refs nested in a value are lent to ``caller`` via that result
        (``nested``: ``TaskDone.refs``'s), or pinned when ``caller`` is ``None``."""
        if nret <= 1:
            values, ids = [result], [task_id]
        else:
            values = _split_returns(result, nret)
            ids = [f"{task_id}.{i}" for i in range(nret)]
        out = []
        nested = None
        objects = self.runtime.objects
        for oid, value in zip(ids, values):
            if type(value) is ReturnError:  # this return failed, the earlier ones did not
                err = RemoteError.from_exception(value.error, value.traceback_str)
                out.append([P.ERROR, dumps(err)])
                continue
            if type(value) in PLAIN_TYPES:  # the hot path: no ref in it, nothing to count
                payload, counted = dumps(value), None
            else:
                payload, _refs, counted = pack_counting(dumps_value, value)
            if counted:
                lent = objects.lend_result(counted, caller, oid)
                if lent is not None:
                    nested = nested or []
                    nested.append(lent)
            out.append(self._place(oid, payload))
        return out, nested

    def _place(self, object_id: str, payload: Any) -> list:
        """A pickled return value's ``[kind, payload]``: inline if small, else kept here."""
        if type(payload) is not Frames and len(payload) <= self.inline_limit:
            return [P.VALUE, payload]
        self.keep(object_id, payload)
        return [P.LOCATION, self.worker.address]

    def keep(self, object_id: str, payload: Any) -> None:
        """Keep a large value here for its owner: written once to the node's shared store."""
        if type(payload) is not Frames:
            payload = Frames([payload])
        node_store().put(object_id, payload)
        self.store[object_id] = True

    def cancel_task(self, peer: Any, msg: dict) -> None:
        """``CANCEL_TASK`` (loop thread): a task not started yet never runs; a running one is
        interrupted in its user code (``force``: this process ends).  An id that is no task
        here may be a method call (Ray's cancel of an actor task); other unknown ids (ended,
        bounced) are dropped: a cancel always follows its task's ``RUN_TASK`` on the same
        channel (the decisions: :class:`TaskSide`)."""
        task_id = msg["task_id"]
        if task_id not in self.task_side.tasks:
            # (the decisions: :class:`InstanceSide`)
            if self.instance_side.cancel(task_id) and msg.get("recursive"):
                self._cancel_children(call_children.pop(task_id, None), False)
            return
        children = self.task_side.cancel(task_id, bool(msg.get("force")))
        if msg.get("recursive"):
            self._cancel_children(children, bool(msg.get("force")))

    def _cancel_children(self, children: list | None, force: bool) -> None:
        """A recursive cancel: the tasks and actor calls the cancelled task or call submitted
        (this process owns them) are cancelled too, recursively; an actor call never by
        force, as Ray's ``CancelChildren``."""
        router = self.runtime.router
        for child in children or ():
            if child in router.calls:
                router.cancel(child, True)
            else:
                self.runtime.submitter.cancel(child, force, True)

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
        self.runtime.submitter.revoke(lease_ids, keep)

    # -- instances -------------------------------------------------------------------------

    def start_instance(self, spec: dict) -> None:
        """``START_INSTANCE`` (the decisions: :class:`InstanceSide`; hosting: :meth:`host`)."""
        self.instance_side.start(spec)

    def call_method(self, peer: Any, msg: dict) -> None:
        """``CALL_METHOD`` (the channel's handler is the instance side's own method)."""
        self.instance_side.call_method(peer, msg)

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

    async def stop_instance(self, instance_id: str, reason: str) -> None:
        inst = self.instances.get(instance_id)
        obj = getattr(inst, "obj", None)  # pending calls fail first, then the hook runs
        self.instance_side.stop(instance_id, reason)
        hook = getattr(inst, "run_shutdown_hook", None)
        if hook is not None:  # __yr_shutdown__(grace), bounded by the grace period
            await hook(obj)

    # -- scale-down (scheduler/drain.py, docs/deploy.md#scaling-down) ---------------------

    async def drain_instance(self, instance_id: str, timeout_s: float = 30.0) -> bytes | None:
        """:class:`P.DrainInstance`: hold the instance's new calls, wait until the calls it
        has are answered, then take its current state (``None``: not within ``timeout_s``,
        not hosted here, or its ``__init__`` failed)."""
        inst = self.instance_side.hold(instance_id)
        if inst is None:
            return None
        deadline = self.loop.time() + timeout_s
        while not drained(inst):
            if self.loop.time() > deadline or inst.stopped is not None:
                return None
            await asyncio.sleep(DRAIN_POLL_S)
        if inst.init_error is not None:
            return None
        try:
            if type(inst) is IsolatedInstance:
                return await asyncio.wait_for(inst.checkpoint(),
                                              max(0.1, deadline - self.loop.time()))
            return await self.loop.run_in_executor(None, checkpoint, inst.obj)
        except Exception:  # noqa: BLE001 - the state does not pickle: it stays here
            logger.warning("instance %s: its state could not be taken for a move",
                           instance_id, exc_info=True)
            return None

    def instance_moved(self, instance_id: str, to: str = "") -> None:
        """:class:`P.InstanceMoved`: the instance left for ``to`` (it ends here without its
        shutdown hook: it lives on there), or the move was given up (``to`` empty)."""
        inst = self.instance_side.release(instance_id, to)
        if inst is None:
            return
        logger.info("instance %s moved to %s", instance_id, to)
        if type(inst) is IsolatedInstance:
            inst.kill_now()
        else:
            inst.stop(f"it moved to {to}")

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
                     reason: str = "", incarnation: int = -1) -> None:
        self.loop.call_soon_threadsafe(
            self.runtime.connector.stream_send,
            P.InstanceState(instance_id, state, error, reason, incarnation))


class _InstanceEdge:
    """The instance side's I/O edge in a worker: hosting (in this process or another) and
    the callers' peers."""

    __slots__ = ("agent",)

    def __init__(self, agent: WorkerAgent) -> None:
        self.agent = agent

    def host(self, spec: dict, running: Any) -> Any:
        return self.agent.host(spec, running)

    def died(self, peer: Any, msg: dict, why: str) -> None:
        err = InstanceDiedError(f"instance {msg['instance_id']} has ended: {why}")
        self.agent._reply_error(peer, msg["task_id"], err, "", False)

    def ignored_start(self, instance_id: str) -> None:
        logger.info("not starting instance %s: it was stopped before it started",
                    instance_id)

    def moved_away(self, peer: Any, msg: dict, to: str) -> None:
        err = InstanceMovedError(f"instance {msg['instance_id']} moved to {to}", to)
        peer.reply(P.TaskDone(msg["task_id"], error=dumps(err)).to_msg())


class _Ending(threading.local):
    """A task thread's hand-over slot: ``free`` while it ends a task, ``next`` the first
    task that end admitted (the thread runs it instead of waking another)."""

    free = False
    next: Execution | None = None


class _AgentEdge:
    """The task side's I/O edge in a worker: the agent's task threads, its peers and its
    event loop."""

    __slots__ = ("agent", "now", "_submit", "_run", "_ending")

    def __init__(self, agent: WorkerAgent) -> None:
        self.agent = agent
        self.now = agent.loop.time  # the loop's clock, with no frame of ours per task
        self._submit = agent.executor.submit
        self._run = agent._execute_gated
        self._ending = agent._ending  # per task thread (see WorkerAgent._execute_gated)

    def start(self, ex: Execution) -> None:
        ending = self._ending
        if ending.free:  # a task thread ending a task: it runs this one next (_execute_gated)
            ending.free = False
            ending.next = ex
            return
        self._submit(self._run, ex)

    def reply(self, ex: Execution, msg: dict) -> None:
        ex.peer.reply(msg)

    def call_at(self, at: float, fn: Callable[[], None]) -> None:
        agent = self.agent
        if threading.get_ident() == agent.runtime.loop_thread:
            agent.loop.call_at(at, fn)
        else:
            agent.loop.call_soon_threadsafe(agent.loop.call_at, at, fn)

    def notify(self, holding_id: str, blocked: bool) -> None:
        rt = self.agent.runtime  # through its inbox: in order behind what it queued before
        try:
            rt.on_loop(rt.connector.stream_send, P.LeaseBlocked(holding_id) if blocked
                       else P.LeaseUnblocked(holding_id))
        except RuntimeError:
            if not rt.loop.is_closed():
                raise  # else the worker is closing: the scheduler learns that from Dask

    def exit_process(self, ex: Execution) -> None:
        # Ray's cancel(force=True): the task may be blocked in C (time.sleep, a socket
        # read), where no exception reaches it.  End this process; the nanny starts a
        # fresh one, the caller settled the task already (no crash is counted for it).
        logger.info("cancel(force=True) of task %s: ending worker process %d",
                    ex.task_id, os.getpid())
        os._exit(P.FORCED_CANCEL_EXIT)
