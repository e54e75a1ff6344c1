"""The per-process yr runtime: its loop, inbox and call channels, and the entry points that
submit tasks and method calls.

There is one :class:`Runtime` per process.  In a driver ``yr.init`` creates it
(:class:`~yrdask.runtime.driver.DriverRuntime`, with its own event loop thread); in a worker
process the worker agent creates it on the worker's event loop (:func:`install_worker_runtime`),
so code inside tasks and instances uses the same API.  User threads never touch runtime
state directly: they hand work to the loop (``on_loop``) and wait on entries.  Object access
(:mod:`yrdask.runtime.object_access`), peer liveness (:mod:`yrdask.runtime.peers`) and the
call channels' answers (:mod:`yrdask.runtime.answers`) are the runtime's other parts, each in
a module of its own.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import hashlib
import itertools
import logging
import threading
import traceback
import uuid
from typing import TYPE_CHECKING, Any, Callable

from yrdask import protocol as P
from yrdask.runtime import context
from yrdask.runtime.context import current_owner
from yrdask.runtime.object_table import ObjectTable
from yrdask.runtime.objects import ObjectRef, pack_counting, pack_recording_refs
from yrdask.runtime.object_access import ObjectAccess
from yrdask.runtime.answers import CallerAnswers
from yrdask.runtime.peers import PeerLiveness
from yrdask.runtime.store import close_node_store
from yrdask.runtime.generators import Stream
from yrdask.runtime import dask_objects
from yrdask.errors import YRRuntimeError
from yrdask.serialization import pack_args, pack_plain_args, register_with_dask

if TYPE_CHECKING:
    from yrdask.runtime.node import LocalNode

logger = logging.getLogger("yrdask")

INLINE_LIMIT = 512 * 1024  # results larger than this stay on the worker that made them
class Runtime(ObjectAccess, PeerLiveness, CallerAnswers):
    """The runtime of one process (see module docstring): its loop and channels here,
    object access (:class:`ObjectAccess`), peer liveness (:class:`PeerLiveness`) and the
    call channels' answers (:class:`CallerAnswers`) mixed in."""

    def __init__(self, loop: asyncio.AbstractEventLoop, job_id: str,
                 defer_machines: bool = False) -> None:
        self.loop = loop
        self.loop_thread: int | None = None
        self.job_id = job_id
        self.address = ""
        self.connector: Any = None
        self.agent: "LocalNode | None" = None  # the worker agent, when this runtime lives in a worker
        register_with_dask()  # large values travel as Dask frames (serialization.Frames)
        dask_objects.register()  # Dask Futures and delayed values in calls become refs
        self.objects = ObjectTable(self, INLINE_LIMIT)
        if not defer_machines:  # else the caller runs build_machines() before any use
            self.build_machines()
        self.channels: dict[str, Any] = {}
        self.streams: dict[str, Stream] = {}  # generator calls whose end has not come
        self.init_peers()
        self._prefix = uuid.uuid4().hex[:10]
        self._counter = itertools.count()
        self._inbox: collections.deque = collections.deque()  # (fn, args) from user threads
        self._inbox_armed = False
        # reference counting messages waiting for this loop pass: {(cls, address): [item]}
        self._refs_out: dict[tuple, list] = {}
        self.closed = False
        # Where prints of work submitted by the calling thread go: a driver's owner address
        # (Config.log_to_driver), or None.  The worker's output module replaces it.
        self.output_target: Callable[[], str | None] = _no_target

    def build_machines(self) -> None:
        """The submitter and the instance router (their imports take ~20 ms)."""
        _load_machines()
        self.submitter = Submitter.for_runtime(self)
        self.router = InstanceRouter(self)
        # bound once: on_loop's inbox holds one per submission until the loop drains it
        self._submit_on_loop = self.submitter.submit
        self._call_on_loop = self.router.call

    # -- plumbing --------------------------------------------------------------------------

    @property
    def local_worker(self) -> str | None:
        """The address of the worker this runtime lives in (None in a driver)."""
        return self.address if self.agent is not None else None

    def new_id(self) -> str:
        return f"{self._prefix}{next(self._counter):x}"

    def on_loop(self, fn: Callable, *args: Any) -> None:
        """Run ``fn(*args)`` on the loop thread, in order.

        Calls from user threads go through one inbox and one wake-up per batch: a burst of
        submissions is handled in one loop pass, so the streams send it in one write.  On the
        loop thread ``fn`` runs at once unless the inbox still holds earlier calls: then it
        queues behind them.  (A handle's ``__del__`` may run on the loop thread, e.g. when
        Dask's profiler drops a sampled frame: its decref must not overtake the incref
        and transit its own thread queued first.)
        """
        if threading.get_ident() == self.loop_thread and not self._inbox:
            fn(*args)
            return
        self._inbox.append((fn, args))
        if not self._inbox_armed:
            self._inbox_armed = True
            self.loop.call_soon_threadsafe(self._drain_inbox)

    def on_loop_later(self, fn: Callable, *args: Any) -> None:
        """Like :meth:`on_loop`, but never runs ``fn`` on the caller's stack (no re-entry)."""
        if threading.get_ident() == self.loop_thread:
            self.loop.call_soon(fn, *args)
        else:
            self.on_loop(fn, *args)

    def _drain_inbox(self) -> None:
        self._inbox_armed = False  # before draining: a later append arms a new pass
        inbox = self._inbox
        while inbox:
            fn, args = inbox.popleft()
            try:
                fn(*args)
            except Exception:
                logger.exception("yr loop callback %r failed", fn)

    def run_sync(self, coro: Any, timeout: float | None = None) -> Any:
        """Run a coroutine on the loop from a user thread and wait for it."""
        if threading.get_ident() == self.loop_thread:
            raise YRRuntimeError("blocking yr call made on the yr event loop; use 'await ref'")
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def call_user_callback(self, callback: Callable, ref: ObjectRef) -> None:
        """User callbacks may block: run them off the loop thread."""
        self.loop.run_in_executor(None, _safe_call, callback, ref)

    def channel(self, address: str) -> Any:
        chan = self.channels.get(address)
        if chan is None:
            from yrdask.runtime.transport import Channel, LocalChannel

            if self.agent is not None and address == self.address:
                chan = LocalChannel(self.agent, address, self.on_channel_message)
            else:
                chan = Channel(address, self.address, self.connection_args,
                               self.on_channel_message, self.on_channel_lost,
                               self.worker_processes.current.get(address, ""))
                chan.generation = self.removals.get(address, 0)
            self.channels[address] = chan
        return chan

    def scheduler_lost(self, error: BaseException) -> None:
        """(loop) This driver's job stream closed while the driver was open: its scheduler
        stopped, crashed or was restarted, and this job ended with it (docs/faults.md,
        "Scheduler restart").  Results still pending fail with ``error``, the submitter
        stops, and later submissions raise it: the entry points are replaced here, so the
        per-call path checks nothing."""
        if self.closed:
            return
        for entry in list(self.objects.entries.values()):
            if entry.owner is None:  # owned here (a settled one keeps its value)
                entry.set_error(error)
        self.submitter.close()

        def refuse(*_args: Any, **_kwargs: Any) -> Any:
            raise type(error)(str(error))
        self.submit_task = self.call_method = self.create_instance = refuse  # type: ignore


    def free_remote(self, worker: str, object_ids: list[str]) -> None:
        """Our objects ``object_ids`` are freed: the worker keeping them drops its copies,
        and their lineage goes (any thread)."""
        for oid in object_ids:
            self.submitter.forget(oid)

        async def free() -> None:
            try:
                await P.request(self.connector.rpc(worker), P.FreeObjects(object_ids))
            except Exception:
                pass

        def start() -> None:
            coro = free()
            try:
                self.loop.create_task(coro)
            except RuntimeError:  # a ref dropped as the runtime's loop closes: nothing to free
                coro.close()

        self.on_loop(start)

    @property
    def connection_args(self) -> dict:
        return self.connector.connection_args

    # -- tasks -----------------------------------------------------------------------------

    def submit_task(self, fn_id: str, fn_payload: bytes, name: str, args: tuple, kwargs: dict,
                    nret: int, shape: dict, shape_key: tuple, timeout_ms: int,
                    retries: int, wait_nested: bool = True,
                    max_crashes: int | None = None, events: bool = True) -> list[ObjectRef]:
        """Submit a stateless call.  ``wait_nested``: refs nested in the arguments gate its
        start (yr's dependency resolver); the Ray surface turns it off (Ray's rule).
        ``max_crashes``: reruns after its worker is lost (None: ``max-task-crashes``; -1: no
        bound), which the Ray surface sets from ``max_retries``.  ``events`` False: it leaves
        no record (Ray's ``enable_task_events=False``, :class:`P.RunTask`)."""
        blob = pack_plain_args(args, kwargs)
        if blob is not None:  # the hot path: plain values, no ref among them
            dep_refs = nested = ()  # (shared, and not tracked by the garbage collector)
        else:
            args, kwargs = dask_objects.convert_args(self, args, kwargs)
            (blob, dep_refs), nested = pack_recording_refs(pack_args, args, kwargs, _is_ref)
        task_id = self.new_id()
        if nret <= 1:
            ids = (task_id,)  # tuples: a task's few fields live while it runs
            ref = self.objects.new_ref(task_id)
            refs, entries = [ref], (ref._entry,)
        else:
            ids = [f"{task_id}.{i}" for i in range(nret)]
            refs = [self.objects.new_ref(i) for i in ids]
            entries = [r._entry for r in refs]
        stream = None if nret >= 0 else Stream(self, task_id, refs[0], f"function {name}")
        task = Task(task_id, fn_id, fn_payload, name, blob, dep_refs, entries,
                    ids, nret, shape, shape_key, timeout_ms, retries,
                    current_owner() or self.job_id, log_to=self.output_target(), events=events)
        # The task holds its ref arguments until it ends: the worker's TaskDone says which
        # it kept (borrowing, docs/objects.md) before they are let go.
        task.held = dep_refs + nested if nested else dep_refs
        task.nested = nested if wait_nested else None  # yr's rule: nested refs gate the start
        task.max_crashes = max_crashes
        note = context.child_note
        if note is not None:  # a worker: the running task's child (recursive cancel)
            note(task_id)
        self.on_loop(self._submit_on_loop, task)
        return refs if stream is None else [stream]  # nret P.STREAMING: the item stream

    # -- instances -------------------------------------------------------------------------

    def with_working_dir(self, isolation: dict) -> dict:
        """``isolation`` (see ``runtime.isolation.isolation_spec``) with the job's ``Config.working_dir``
        as its directory when it names none (docs/isolation.md)."""
        if isolation.get("cwd"):
            return isolation
        conf = getattr(self, "conf", None)
        return {**isolation, "cwd": getattr(conf, "working_dir", "") or ""}

    def create_instance(self, spec: dict, args: tuple, kwargs: dict) -> str:
        """Send an instance creation (asynchronous); returns the new instance id."""
        args, kwargs = dask_objects.convert_args(self, args, kwargs)
        (blob, dep_refs), _refs, counted = pack_counting(pack_args, args, kwargs, _is_ref)
        if counted:  # an instance may keep them for its whole life: their owners keep them
            self.objects.pin(counted)
        if spec.get("isolation") is not None:
            spec["isolation"] = self.with_working_dir(spec["isolation"])
        spec.update(instance_id=spec.get("instance_id") or f"i-{self.new_id()}", args=blob,
                    owner=current_owner() or self.job_id, holder=self.address,
                    log_to=self.output_target())
        self.on_loop(self.router.create, spec, dep_refs)
        return spec["instance_id"]

    def call_method(self, instance_id: str, method: str, args: tuple, kwargs: dict,
                    nret: int, max_redeliveries: int | None = None,
                    unordered: bool = False, concurrency: int = 1,
                    events: bool = True) -> list[ObjectRef]:
        """Send a method call.  ``max_redeliveries``: how often it is delivered again after
        its instance's process died while it ran (None: ``max-call-redeliveries``; -1: no
        bound), which the Ray surface sets from ``max_task_retries``.  ``unordered``: it may
        leave before earlier calls whose ref arguments are not ready (Ray's async actors).
        ``concurrency``: the instance's (0: unknown), which bounds the calls a lost worker
        charges a crash (``call_order.crash_window``).  ``events`` False: the call leaves no
        record (Ray's ``enable_task_events=False``, :class:`P.CallMethod`)."""
        blob = pack_plain_args(args, kwargs)
        if blob is not None:  # the hot path: plain values, no ref among them
            dep_refs = nested = ()  # (shared, and not tracked by the garbage collector)
        else:
            args, kwargs = dask_objects.convert_args(self, args, kwargs)
            (blob, dep_refs), nested = pack_recording_refs(pack_args, args, kwargs, _is_ref)
        call_id = self.new_id()
        if nret == 1 or nret == 0:  # the hot path: one ref
            ref = self.objects.new_ref(call_id)
            refs, entries = [ref], (ref._entry,)
        else:
            ids = [call_id] if nret <= 1 else [f"{call_id}.{i}" for i in range(nret)]
            refs = [self.objects.new_ref(i) for i in ids]
            if nret < 0:  # P.STREAMING: a generator method, whose items stream back
                refs = [Stream(self, call_id, refs[0], f"method {method}")]
                entries = [refs[0].end_ref._entry]
            else:
                entries = [r._entry for r in refs]
        call = Call(call_id, instance_id, method, blob, dep_refs, entries, nret,
                    max_redeliveries=max_redeliveries, unordered=unordered,
                    concurrency=concurrency, held=dep_refs + nested if nested else dep_refs,
                    events=events)
        note = context.child_note
        if note is not None:  # a worker: the running task's child (Ray cancels it recursively)
            note(call_id)
        self.on_loop(self._call_on_loop, call)
        return refs

    def scheduler_call(self, op: str, **kwargs: Any) -> Any:
        """A scheduler RPC from a user thread (its fields are the op's, ``timeout`` included)."""
        return self.run_sync(self.connector.scheduler_rpc(op, **kwargs))

    # -- cancels ---------------------------------------------------------------------------

    def cancel(self, refs: list[ObjectRef], force: bool = False,
               recursive: bool = False) -> None:
        """Cancel the tasks of ``refs``; ``force``: a running one ends with its worker
        process; ``recursive``: the tasks it submitted are cancelled too, and theirs (see
        :class:`~yrdask.protocol.CancelTask`)."""
        for ref in refs:
            owner = ref._entry.owner
            if owner is not None and owner != self.address:  # borrowed: its owner cancels
                self.on_loop(self._cancel_at_owner, owner, ref._id, force, recursive)
            else:
                self.on_loop(self.submitter.cancel, ref._id, force, recursive)

    def _cancel_at_owner(self, owner: str, object_id: str, force: bool,
                         recursive: bool) -> None:
        async def send() -> None:
            try:
                await P.request(self.connector.rpc(owner),
                                P.CancelOwned([object_id], force, recursive))
            except Exception:  # the owner is gone, and its tasks with it
                logger.debug("cannot cancel %s at its owner %s", object_id, owner,
                             exc_info=True)

        self.loop.create_task(send())

    def handle_cancel_owned(self, object_ids: list, force: bool = False,
                            recursive: bool = False) -> None:
        """:class:`P.CancelOwned`: a borrower cancels tasks this process submitted."""
        for object_id in object_ids:
            self.on_loop(self.submitter.cancel, object_id, force, recursive)

    def cancel_call(self, ref: ObjectRef, force: bool = False,
                    recursive: bool = False) -> str | None:
        """Ray's ``cancel`` of an actor task (yr does not cancel method calls): ``None`` if
        ``ref`` is no method call waiting for its answer; ``"force"`` (nothing done) if it is
        one and ``force`` is set; else ``"cancelled"`` (see :meth:`InstanceRouter.cancel`).
        Waits for the loop, where the call was registered (in order) when it was made."""
        answer: concurrent.futures.Future = concurrent.futures.Future()
        cid = ref._id.split(".", 1)[0]

        def run() -> None:
            try:
                if cid not in self.router.calls:
                    answer.set_result(None)
                elif force:
                    answer.set_result("force")
                else:
                    self.router.cancel(cid, recursive)
                    answer.set_result("cancelled")
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                answer.set_exception(e)

        if threading.get_ident() == self.loop_thread:  # (not from user code) at once
            run()
        else:
            self.on_loop(run)
        return answer.result(60)

    # -- shutdown --------------------------------------------------------------------------

    async def close(self) -> None:
        self.closed = True
        if hasattr(self, "submitter"):  # not built if an embedded cluster failed to start
            self.submitter.close()
        for chan in list(self.channels.values()):
            await chan.close()
        self.channels.clear()
        await self.connector.close()
        close_node_store()  # the last process of the node removes its store


def _no_target() -> None:
    return None


# The submitter and the instance router (with their machines, and Dask's config) are
# imported when the first runtime is built, not by ``import yrdask``: in a driver that is
# after the embedded cluster's launcher started, so these imports overlap its own.
Submitter: Any = None
Task: Any = None
InstanceRouter: Any = None
Call: Any = None


def _load_machines() -> None:
    global Submitter, Task, InstanceRouter, Call
    if Submitter is None:
        from yrdask.runtime.instance_router import Call, InstanceRouter
        from yrdask.runtime.submitter import Submitter, Task


def _safe_call(callback: Callable, ref: ObjectRef) -> None:
    try:
        callback(ref)
    except Exception:
        # logged as text: a record holding the callback or the traceback (its frames) would
        # keep the callback, and all it holds, alive as long as a handler keeps records
        logger.error("on_complete callback %s failed\n%s", repr(callback),
                     traceback.format_exc().rstrip())


def _is_ref(value: Any) -> bool:
    return type(value) is ObjectRef


def function_id(payload: bytes, name: str) -> str:
    return f"{name}-{hashlib.blake2b(payload, digest_size=8).hexdigest()}"


def install_worker_runtime(agent: "LocalNode") -> Runtime:
    """Create the runtime of a worker process (called by the worker agent on its loop)."""
    rt = Runtime(asyncio.get_running_loop(), job_id="worker")
    rt.loop_thread = threading.get_ident()
    rt.agent = agent
    rt.address = agent.worker.address
    from yrdask.runtime.transport import WorkerConnector

    rt.connector = WorkerConnector(rt, agent.worker)
    context.install(rt)
    return rt


def uninstall_worker_runtime(rt: Runtime) -> None:
    if context.installed_runtime() is rt:
        context.install(None)


async def join_as_client(scheduler: str, job_id: str, listen_host: str,
                         tls: dict | None = None) -> Runtime:
    """A runtime of its own for a process that has none: an isolated process of a worker
    (docs/isolation.md), started at its first nested call, on the running loop.

    It joins the scheduler the way a driver joining an address does (``DriverConnector``:
    a job stream and an owner server), under a job id of its own, so it owns what it
    creates and its job stream's end (the process died) releases its leases and handles.
    TLS comes from Dask's config (``distributed.comm.tls.*``), as for any client, else from
    ``tls``: its worker's own certificates (``Security`` keywords), which the worker was
    given on its command line or by its deployer (dask-gateway, the Kubernetes operator).
    """
    from distributed.security import Security

    from yrdask.runtime.transport import DriverConnector

    security, role = Security(), "client"
    connection_args = security.get_connection_args(role)
    if connection_args.get("ssl_context") is None and tls:
        security, role = Security(**tls), "worker"
        connection_args = security.get_connection_args(role)
    if scheduler.startswith("tls://") and connection_args.get("ssl_context") is None:
        raise YRRuntimeError(
            f"nested calls in an isolated process need TLS to reach the scheduler at "
            f"{scheduler}, and this process has no certificates: set distributed.comm.tls.* "
            "in the Dask config (or the DASK_DISTRIBUTED__COMM__TLS__* variables) on the "
            "worker host")
    rt = Runtime(asyncio.get_running_loop(), job_id)
    rt.loop_thread = threading.get_ident()
    rt.connector = DriverConnector(rt, scheduler, connection_args,
                                   security.get_listen_args(role))
    try:
        rt.address = await rt.connector.start(job_id, listen_host)
    except BaseException:
        rt.closed = True
        await rt.connector.close()
        raise
    return rt
