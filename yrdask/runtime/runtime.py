"""The per-process yr runtime: ``init``/``finalize`` and the object operations behind the API.

There is one :class:`Runtime` per process.  In a driver ``yr.init`` creates it, with its own
event loop thread; in a worker process the worker agent creates it on the worker's event loop,
so code inside tasks and instances uses the same API.  User threads never touch runtime
state directly: they hand work to the loop (``on_loop``) and wait on entries.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import hashlib
import itertools
import logging
import threading
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

from yrdask import protocol as P
from yrdask.runtime import context
from yrdask.runtime.context import current_lease, current_owner
from yrdask.runtime.objects import (REFS_LOCK, Entry, ObjectRef, ObjectTable, pack_counting,
                                    pack_recording_refs, unpickling)
from yrdask.runtime.store import close_node_store, node_store
from yrdask.runtime.store import configure as configure_store
from yrdask.runtime.generators import Stream, on_generator_item
from yrdask.runtime import worker_processes as WP
from yrdask.errors import (OwnerDiedError, RemoteError, YRRuntimeError, YRTimeoutError,
                           YRTypeError, YRValueError)
from yrdask.options import Config, resolve_security
from yrdask.serialization import (Frames, dumps, dumps_value, loads, pack_args, pack_plain_args,
                                  register_with_dask, unpicklable, wire)

if TYPE_CHECKING:
    from yrdask.runtime.node import LocalNode

logger = logging.getLogger("yrdask")

INLINE_LIMIT = 512 * 1024  # results larger than this stay on the worker that made them
OWNER_PROBE_S = 1.0  # one connect try to a borrowed object's owner; then ask the scheduler
OWNER_UNREACHABLE_S = 4.0  # an owner not reached for this long (still listed) is given up


def owner_timeouts() -> tuple[float, float]:
    """``(probe, unreachable)`` seconds: ``yrdask.object-store.owner-probe`` (one connect try
    to an owner) and ``yrdask.object-store.owner-unreachable`` (how long a reader keeps trying
    an owner the scheduler still lists before it fails), docs/faults.md."""
    import dask
    from dask.utils import parse_timedelta

    def get(key: str, default: float) -> float:
        value = dask.config.get(f"yrdask.object-store.{key}", None)
        seconds = default if value is None else parse_timedelta(value, default="s")
        if seconds is None or seconds <= 0:
            raise YRValueError(f"yrdask.object-store.{key} must be a positive duration such "
                               f"as '1s', got {value!r}")
        return float(seconds)

    return get("owner-probe", OWNER_PROBE_S), get("owner-unreachable", OWNER_UNREACHABLE_S)


@dataclass
class ClientInfo:
    """What ``yr.init`` returns: the job id and where to watch it."""

    job_id: str
    dashboard_link: str | None = None
    scheduler_address: str = ""

    def __repr__(self) -> str:
        return (f"ClientInfo(job_id={self.job_id!r}, scheduler={self.scheduler_address!r}, "
                f"dashboard={self.dashboard_link!r})")

    def _repr_html_(self) -> str:
        link = (f'<a href="{self.dashboard_link}" target="_blank">{self.dashboard_link}</a>'
                if self.dashboard_link else "none")
        return (f"<div><strong>yrdask job</strong> <code>{self.job_id}</code><br>"
                f"scheduler: <code>{self.scheduler_address}</code><br>dashboard: {link}</div>")


class Runtime:
    """Object table, submitter and channels of one process (see module docstring)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, job_id: str,
                 defer_machines: bool = False) -> None:
        self.loop = loop
        self.loop_thread: int | None = None
        self.job_id = job_id
        self.address = ""
        self.connector: Any = None
        self.agent: "LocalNode | None" = None  # the worker agent, when this runtime lives in a worker
        register_with_dask()  # large values travel as Dask frames (serialization.Frames)
        self.objects = ObjectTable(self, INLINE_LIMIT)
        if not defer_machines:  # else the caller runs build_machines() before any use
            self.build_machines()
        self.channels: dict[str, Any] = {}
        self.streams: dict[str, Stream] = {}  # generator calls whose end has not come
        # how recently lost worker processes ended (WORKER_EXIT), and who waits to know
        self.exits: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._exit_waiters: dict[str, list[Callable[[], None]]] = {}
        self.lost_workers: dict[str, None] = {}  # workers the scheduler removed (recent)
        # how often the scheduler removed a process at each address (recent), and that count
        # when the last lost channel to it was opened: a new process at the same address is
        # told apart from the one a channel was lost to (confirmed_gone)
        self.removals: dict[str, int] = {}
        self.lost_generation: dict[str, int] = {}
        self._lost_waiters: dict[str, list[Callable[[], None]]] = {}
        # which worker process (Dask server id) this process deals with at each address: a
        # WorkerLost of a dead one does not touch what belongs to its successor there
        self.worker_processes = WP.WorkerProcesses()
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

    def on_channel_message(self, msg: dict) -> None:
        """A message from a worker on a call channel (:data:`P.CHANNEL_TO_CALLER`): the
        :class:`P.TaskDone` of a method call goes to the router, of a task to the submitter."""
        if msg["op"] == P.TASK_DONE:  # the one op of P.CHANNEL_TO_CALLER
            # A plain answer (results and nothing else but ``took``: no error, requeue or
            # refs report) is the hot path, read from the dict: no message object.  A task's
            # needs no router lookup (call and task ids never collide: both come from new_id);
            # a call's is ``TaskDone.wire``'s (op, id, results), with ``took`` or without.
            task_id = msg["task_id"]
            if task_id in self.submitter.tasks:
                if (msg.get("refs") is None and msg.get("error") is None
                        and not msg.get("requeue")):
                    self.submitter.on_task_ok(task_id, msg.get("results") or [],
                                              msg.get("took"))
                    return
            elif ((len(msg) == 3 or len(msg) == 4 and "took" in msg)
                  and self.router.on_result(task_id, msg.get("results"))):
                return
            done = P.TaskDone.from_msg(msg)
            if done.refs is not None:  # before the call lets go of its argument refs
                self.objects.on_done_refs(done.refs)
            if not self.router.on_done(done):
                self.submitter.on_task_done(done)
        elif msg["op"] == P.GENERATOR_ITEM:
            on_generator_item(self, msg)

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

    def worker_exit(self, worker: str, how: str, server_id: str = "") -> None:
        """``WORKER_EXIT``: how the process of ``worker`` ended (its nanny told the scheduler).
        A report about a process that a newer one at that address replaced here already
        settles the errors waiting for it but is not kept (it would describe the new one)."""
        current = self.worker_processes.current.get(worker)
        self.exits[worker] = how
        while len(self.exits) > EXITS_KEPT:
            self.exits.popitem(last=False)
        for wake in self._exit_waiters.pop(worker, ()):
            wake()
        if server_id and current is not None and current != server_id:
            self.exits.pop(worker, None)

    def with_exit_reason(self, error: Any, fail: Callable[[BaseException], None]) -> None:
        """Fail with ``error`` (a crash error naming ``error.worker``) once it can say how that
        worker's process ended (:meth:`when_exit_known`)."""
        self.when_exit_known(error.worker, lambda how: fail(
            error.with_exit(how) if how else error))

    def when_exit_known(self, worker: str, then: Callable[[str | None], None],
                        wait_s: float | None = None) -> None:
        """``then(how)`` once it is known how ``worker``'s process ended: at once if known,
        else when the nanny's report arrives, or with ``None`` after ``wait_s`` without it (a
        lost host has no nanny to tell; a process that exited with code 0 is not reported);
        ``wait_s`` defaults to :data:`EXIT_REASON_WAIT_S`."""
        done = False

        def settle() -> None:
            nonlocal done
            if not done:
                done = True
                then(self.exits.get(worker))

        if not worker or worker in self.exits:
            settle()
            return

        self._exit_waiters.setdefault(worker, []).append(settle)
        self.loop.call_later(EXIT_REASON_WAIT_S if wait_s is None else wait_s, settle)

    def worker_lost(self, address: str, server_id: str = "") -> None:
        """The scheduler removed a worker: treat a channel to it as lost, socket or not; its
        borrowings end and the objects it owned can no longer be read (OwnerDiedError).
        Unless it is a process whose successor at that address this process already deals
        with (a lease reply about the new one overtook this message): then its death was
        carried out when the successor was seen, and nothing here is the dead one's."""
        for ins in self.worker_processes.handle(WP.Lost("worker-lost", address, server_id)):
            if type(ins) is WP.Gone:
                chan = self.channels.get(address)
                if chan is not None and hasattr(chan, "abort"):
                    chan.abort()
                self._process_died(address)
                self.lost_workers[address] = None
                while len(self.lost_workers) > EXITS_KEPT:
                    self.lost_workers.pop(next(iter(self.lost_workers)))
            elif type(ins) is WP.Stranger:
                # a channel opened before the current one was known may be to the dead one
                chan = self.channels.get(address)
                if (chan is not None and hasattr(chan, "abort")
                        and not self.worker_processes.live(address, chan.expect)):
                    chan.abort()

    def objects_moved(self, worker: str, to: str, object_ids: list) -> None:
        """:class:`P.ObjectsMoved`: the values ``worker`` kept are kept by ``to`` now."""
        self.objects.location_moved(worker, to, object_ids)

    def _process_died(self, address: str) -> None:
        """The process this process dealt with at ``address`` is dead: objects it owned or
        kept are lost, its borrowings end, its removal is counted (confirmed_gone)."""
        self.objects.process_died(address)
        self.objects.location_lost(address, self.submitter.reconstruct(address))
        self.removals[address] = self.removals.pop(address, 0) + 1  # (newest last)
        while len(self.removals) > EXITS_KEPT:
            gone = next(iter(self.removals))
            del self.removals[gone]
            self.lost_generation.pop(gone, None)
        for wake in self._lost_waiters.pop(address, ()):
            wake()

    def worker_seen(self, address: str, server_id: str) -> bool:
        """(loop) A lease grant, an instance location or ``WorkerJoined`` says the process
        ``server_id`` runs at ``address``.
        If this process dealt with another one there, that one is dead (Dask lists one worker
        per address): its death is carried out now, before anything of the new one is
        recorded, and the address is usable again (a ``WorkerLost`` of it that comes later
        changes nothing).  If the old one's ``WorkerLost`` was handled already, the address
        is usable again at once too, not only once ``WorkerJoined`` (on the job stream,
        which a lease reply can overtake) comes.  Returns whether it was made usable."""
        processes = self.worker_processes
        before = processes.current.get(address)
        joined = False
        for ins in processes.handle(WP.Seen("seen", address, server_id)):
            if type(ins) is WP.Superseded:
                # the removal is counted first: a locate for an instance whose channel is
                # dropped here must not wait for the new process to go (confirmed_gone)
                self._process_died(address)
                chan = self.channels.get(address)
                if chan is not None and hasattr(chan, "abort") and chan.expect != ins.new:
                    self._drop_channel(address, chan)
                joined = True
        if (before is None and not joined and processes.live(address, server_id)
                and (address in self.lost_workers or address in self.objects.counter.dead)):
            joined = True  # a new process where a lost one's death was carried out here
        if joined:
            self._joined(address)
        return joined

    def _drop_channel(self, address: str, chan: Any) -> None:
        """Drop a channel to a process known dead now, and handle its loss at once (so
        that its late loss report cannot void what is granted on the new process)."""
        chan.closed = True  # its reader reports nothing when it ends
        chan.abort()
        self.on_channel_lost(address, chan)

    def confirmed_gone(self, address: str) -> bool:
        """Has the scheduler removed the process at ``address`` that this runtime's last lost
        channel there was connected to?  (Then the process there now, if any, is another
        one: a worker restarted at the same address.)"""
        generation = self.lost_generation.get(address)
        return generation is not None and self.removals.get(address, 0) > generation

    def worker_joined(self, address: str, server_id: str = "") -> None:
        """``WORKER_JOINED``: a new process registered at the address of a lost worker.  Forget
        the old one's death (how it ended, the unreachable owner, the worker its lease
        requests avoid): objects it owned or kept stay lost, the new one is usable at once."""
        before = self.worker_processes.current.get(address)
        if self.worker_seen(address, server_id):
            return
        if before is None or before == server_id:  # (else it named no new process there)
            self._joined(address)

    def _joined(self, address: str) -> None:
        self.exits.pop(address, None)
        self.lost_workers.pop(address, None)
        self.objects.process_joined(address)
        self.submitter.worker_joined(address)

    def on_channel_lost(self, address: str, lost: Any = None) -> None:
        """A call channel to ``address`` broke (``lost``: that channel; a newer one to the
        same address stays)."""
        if lost is not None and self.channels.get(address) is not lost:
            return
        chan = self.channels.pop(address, None)
        generation = getattr(chan, "generation", None)
        if generation is not None:  # (newest last, bounded on its own: a channel can be lost
            # after its address's removal count was dropped, or to one never removed)
            self.lost_generation.pop(address, None)
            self.lost_generation[address] = generation
            while len(self.lost_generation) > EXITS_KEPT:
                self.lost_generation.pop(next(iter(self.lost_generation)))
        self.submitter.on_channel_lost(address)
        self.router.on_channel_lost(address)


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

    # -- reference counting messages (runtime/refcount.py) ---------------------------------

    def refs_message(self, address: str, cls: type, item: Any) -> None:
        """Queue one item of a :class:`P.WaitRefsRemoved`, :class:`P.RefsRemoved` or pinning
        :class:`P.AddBorrower` for ``address`` (any thread, :data:`REFS_LOCK` held): one
        message per kind and address goes out per loop pass."""
        batch = self._refs_out.get((cls, address))
        if batch is None:
            batch = self._refs_out[(cls, address)] = []
            if len(self._refs_out) == 1:
                self.on_loop_later(self._flush_refs)
        batch.append(item)

    def _flush_refs(self) -> None:
        with REFS_LOCK:
            out, self._refs_out = self._refs_out, {}
        if self.closed:
            return
        for (cls, address), items in out.items():
            if cls is P.AddBorrower:  # answered: the tokens' holds end (AddAcked)
                msg: P.Message = P.AddBorrower([i[:3] for i in items])
            else:
                msg, items = cls(self.address, items), None
            self.loop.create_task(self._send_refs(address, msg, items))

    async def _send_refs(self, address: str, msg: P.Message, acked: list | None = None) -> None:
        try:
            await P.request(self.connector.rpc(address), msg)
        except (OSError, asyncio.TimeoutError):  # gone: its borrowings end with it
            if not self.closed:
                self.objects.process_died(address)
            return
        except Exception:
            logger.debug("cannot send %s to %s", msg.op, address, exc_info=True)
            return
        if acked:
            self.objects.added(acked)

    def add_borrower(self, owner: str, items: list) -> None:
        """Register ``[[object_id, borrower, via], ...]`` with ``owner`` and wait for the
        answer (a user thread); on the loop it is sent without waiting."""
        msg = P.AddBorrower(items)
        if threading.get_ident() == self.loop_thread:
            self.loop.create_task(self._send_refs(owner, msg))
            return
        async def send() -> None:
            if await self.owner_gone(owner) is None:
                await P.request(self.connector.rpc(owner), msg)

        try:
            self.run_sync(send())
        except Exception:  # the owner is gone: reading those refs says so
            pass

    def load_borrowed(self, payload: Any) -> Any:
        """Unpickle the value of an object this process borrows; refs nested in it register
        with their owners before the value is handed on (docs/objects.md)."""
        value, found = unpickling(loads, payload)
        if found:
            self.objects.register_reads(found)
        return value

    def wait_refs_removed(self, sender: str, items: list) -> None:
        """:class:`P.WaitRefsRemoved` (rpc handler of workers and the owner server)."""
        self.objects.on_wait(sender, items)

    def refs_removed(self, sender: str, items: list) -> None:
        """:class:`P.RefsRemoved`."""
        self.objects.on_removed(sender, items)

    def handle_add_borrower(self, items: list) -> list:
        """:class:`P.AddBorrower`."""
        return self.objects.add_borrower(list(items))

    @property
    def connection_args(self) -> dict:
        return self.connector.connection_args

    # -- tasks -----------------------------------------------------------------------------

    def submit_task(self, fn_id: str, fn_payload: bytes, name: str, args: tuple, kwargs: dict,
                    nret: int, shape: dict, shape_key: tuple, timeout_ms: int,
                    retries: int, wait_nested: bool = True,
                    max_crashes: int | None = None) -> list[ObjectRef]:
        """Submit a stateless call.  ``wait_nested``: refs nested in the arguments gate its
        start (yr's dependency resolver); the Ray surface turns it off (Ray's rule).
        ``max_crashes``: reruns after its worker is lost (None: ``max-task-crashes``; -1: no
        bound), which the Ray surface sets from ``max_retries``."""
        blob = pack_plain_args(args, kwargs)
        if blob is not None:  # the hot path: plain values, no ref among them
            dep_refs = nested = ()  # (shared, and not tracked by the garbage collector)
        else:
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
                    current_owner() or self.job_id, log_to=self.output_target())
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
        """``isolation`` (see ``options.isolation_spec``) with the job's ``Config.working_dir``
        as its directory when it names none (docs/isolation.md)."""
        if isolation.get("cwd"):
            return isolation
        conf = getattr(self, "conf", None)
        return {**isolation, "cwd": getattr(conf, "working_dir", "") or ""}

    def create_instance(self, spec: dict, args: tuple, kwargs: dict) -> str:
        """Send an instance creation (asynchronous); returns the new instance id."""
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
                    unordered: bool = False, concurrency: int = 1) -> list[ObjectRef]:
        """Send a method call.  ``max_redeliveries``: how often it is delivered again after
        its instance's process died while it ran (None: ``max-call-redeliveries``; -1: no
        bound), which the Ray surface sets from ``max_task_retries``.  ``unordered``: it may
        leave before earlier calls whose ref arguments are not ready (Ray's async actors).
        ``concurrency``: the instance's (0: unknown), which bounds the calls a lost worker
        charges a crash (``call_order.crash_window``)."""
        blob = pack_plain_args(args, kwargs)
        if blob is not None:  # the hot path: plain values, no ref among them
            dep_refs = nested = ()  # (shared, and not tracked by the garbage collector)
        else:
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
                    concurrency=concurrency, held=dep_refs + nested if nested else dep_refs)
        note = context.child_note
        if note is not None:  # a worker: the running task's child (Ray cancels it recursively)
            note(call_id)
        self.on_loop(self._call_on_loop, call)
        return refs

    def scheduler_call(self, op: str, **kwargs: Any) -> Any:
        """A scheduler RPC from a user thread (its fields are the op's, ``timeout`` included)."""
        return self.run_sync(self.connector.scheduler_rpc(op, **kwargs))

    # -- objects ---------------------------------------------------------------------------

    def put(self, obj: Any) -> ObjectRef:
        """Store ``obj`` (pickled now, a snapshot) under a new ref this process owns.

        The entry is settled, value and pickle, before its ref exists (objects.py's rule).
        """
        if obj is None or (isinstance(obj, (bytes, bytearray, memoryview)) and len(obj) == 0):
            raise YRValueError("yr.put: value is None or has zero length")
        if isinstance(obj, ObjectRef):
            raise YRTypeError(
                "Calling 'put' on an ObjectRef is not allowed; to store a reference, "
                "put it inside a list: yr.put([ref])")
        if isinstance(obj, (bytes, bytearray, memoryview)):
            obj = bytes(obj)
        return self.put_value(obj, "yr.put")

    def put_value(self, obj: Any, what: str = "yr.put") -> ObjectRef:
        """``put`` without the argument checks (``ray.put`` takes None too): pickled now, a
        snapshot; a large value's one copy goes to the node's store."""
        try:
            payload, _refs, counted = pack_counting(dumps_value, obj)
        except Exception as e:
            raise unpicklable(obj, f"{what}: the value", e) from e
        object_id = self.new_id()
        entry = Entry()
        if type(payload) is Frames:  # large: its one copy goes to the node's shared memory
            entry.payload = node_store().put(object_id, payload)
            entry.stored = True
        else:  # small: the pickle is the snapshot; a get unpickles it (once)
            entry.payload = payload
        entry.settle(P.VALUE)
        ref = self.objects.new_ref(object_id, entry)
        if counted:  # refs nested in the value live as long as it does
            self.objects.contains(object_id, list(counted.items()))
        return ref

    def get(self, refs: Sequence[ObjectRef], timeout: float, allow_partial: bool = False) -> list:
        deadline = None if timeout == -1 else time.monotonic() + timeout
        lease_id = current_lease()
        blocked = False
        gather = True  # many refs left from the first pending one: waited for from the back, once
        try:
            for at, ref in enumerate(refs):
                entry = ref._entry
                if entry.ready:
                    continue
                if threading.get_ident() == self.loop_thread:
                    raise YRRuntimeError(
                        "yr.get would block the yr event loop; use 'await ref' in async code")
                self._ensure_fetch(ref)
                if not blocked and (lease_id is not None or self.agent is not None):
                    blocked = self._lend(lease_id, True)
                if gather and at + GATHER_MIN_PENDING <= len(refs):  # few wake-ups for all
                    gather = False
                    self._wait_all(refs[at:], deadline)
                remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
                if not entry.wait(remaining) and not allow_partial:
                    raise YRTimeoutError(
                        f"failed to get object {ref._id} within {timeout} s: it is not ready "
                        "(raise the timeout, or use timeout=-1 to wait forever)")
        finally:
            if blocked:
                self._lend(lease_id, False)
        return [self._value_of(ref) for ref in refs]

    def _wait_all(self, refs: Sequence[ObjectRef], deadline: float | None) -> None:
        """Wait (bounded by ``deadline``) for the pending refs of ``refs`` from the last one
        back; the caller's loop then checks each ref as before.

        Results of a burst arrive about in submission order: waiting front to back, the
        thread caught up with them every few results, made an event, slept and was woken
        (a wake-up and a GIL hand-over per few results, paid by the loop too).  From the
        back it sleeps until the last is ready and then finds nearly all the others ready.
        Borrowed refs are all asked for first, so their owners answer in parallel."""
        pending = [r for r in refs if not r._entry.ready]
        for ref in pending:
            self._ensure_fetch(ref)
        for ref in reversed(pending):
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not ref._entry.wait(remaining):
                return  # timed out: the caller's loop says which ref

    def _lend(self, lease_id: str | None, blocked: bool) -> bool:
        """A thread waits in ``yr.get``/``yr.wait`` (or runs again): a task's lease lends its
        CPU; a thread with no lease in a worker (a Dask task) lends its share of the worker."""
        if lease_id is not None:
            self.connector.notify_blocked(lease_id, blocked)
            return True
        if self.agent is not None:
            self.agent.lend_slot("", blocked)
            return True
        return False

    def _value_of(self, ref: ObjectRef) -> Any:
        entry = ref._entry
        state = entry.state
        if state == P.VALUE:
            value = entry.get_value() if entry.owner is None else entry.get_value(self.load_borrowed)
        elif state == P.LOCATION:
            location = entry.location
            try:
                value = self._fetch_value(ref._id, entry)
            except YRRuntimeError:
                if not self._lost_meanwhile(entry, location):
                    raise
                return self.get([ref], -1)[0]  # computed again, or failed for good
        elif state == P.ERROR:
            raise entry.exception()
        else:  # allow_partial and not ready
            return None
        if isinstance(value, (bytes, bytearray)):
            return memoryview(value)
        return value

    def _lost_meanwhile(self, entry: Entry, location: str | None) -> bool:
        """A fetch from ``location`` failed: wait (bounded) to hear whether that worker is
        gone, and say whether the entry was handled since (reconstruction, docs/objects.md)."""
        if location is None or self.closed:
            return False

        async def heard() -> None:
            if location in self.lost_workers:
                return
            fut = self.loop.create_future()
            self._lost_waiters.setdefault(location, []).append(
                lambda: fut.done() or fut.set_result(None))
            await asyncio.wait_for(fut, LOST_WAIT_S)

        try:
            self.run_sync(heard())
        except Exception:
            return False
        return not (entry.state == P.LOCATION and entry.location == location)

    def _fetch_value(self, object_id: str, entry: Entry) -> Any:
        """The value of an entry a worker keeps: fetched once, cached (any thread)."""
        if entry.has_value:
            return entry.value
        payload = self.fetch_payload(object_id, entry.location)
        value = loads(payload) if entry.owner is None else self.load_borrowed(payload)
        return entry.cache_value(value)

    def fetch_payload(self, object_id: str, address: str) -> bytes:
        """Pickled value of an object, asking ``address`` (its owner, or the worker keeping it)
        and following the owner's answer to the worker that keeps it.  Not on the loop."""
        store = node_store()
        local = store.get(object_id)
        if local is not None:  # on this node already: mapped, not copied
            return local
        return store.pull(object_id, lambda: self._pull(object_id, address))

    def _pull(self, object_id: str, address: str) -> Any:
        """The payload of an object from another process (following the owner's redirect
        to the worker that keeps it); peer to peer, never through the scheduler."""
        while True:
            if self.agent is not None and address == self.address:
                return self.agent.store_get(object_id)
            kind, payload = self.run_sync(self._fetch(address, object_id, None))
            if kind == P.VALUE:
                return payload
            if kind == P.ERROR:
                raise loads(payload).to_exception()
            address = payload  # the owner says: a worker keeps it there

    async def owner_gone(self, address: str) -> str | None:
        """Why the owner at ``address`` is gone, or ``None`` if it is reached (or the
        scheduler cannot say).  Dask retries a refused connect until
        ``distributed.comm.timeouts.connect`` (30 s); instead each connect try lasts
        ``owner-probe`` (1 s), and after a failed one the scheduler is asked
        (:class:`~yrdask.protocol.OwnerAlive`): an owner it no longer lists is gone at once;
        one it still lists (its stream not closed yet, or a hung process) is tried again
        until ``owner-unreachable`` (4 s) has passed, then given up (:func:`owner_timeouts`)."""
        if address in self.lost_workers or address in self.objects.counter.dead:
            return "the scheduler reported it gone"
        probe, unreachable = owner_timeouts()
        rpc = self.connector.rpc(address)
        deadline = time.monotonic() + unreachable
        while True:
            began = time.monotonic()
            try:
                # bounded as a whole: Dask's handshake read after the connect has no
                # timeout, and a hung owner's kernel still accepts the connection
                comm = await asyncio.wait_for(rpc.pool.connect(address, timeout=probe),
                                              probe)
            except OSError as e:
                try:
                    alive = await self.connector.request(P.OwnerAlive(address))
                except Exception:  # the scheduler cannot say: keep trying the owner
                    return None
                if alive is False:  # (None: a scheduler without the rpc)
                    return f"the scheduler no longer knows it ({e})"
                if alive is None:
                    return None
                if time.monotonic() >= deadline:
                    return (f"no connection within {unreachable:g} s, though the scheduler "
                            f"still lists it (a hung process, or one whose death the scheduler "
                            f"has not seen yet; yrdask.object-store.owner-unreachable) ({e})")
                # one try per probe at most: a connect that fails at once does not turn
                # this into a tight loop of OwnerAlive requests
                await asyncio.sleep(max(0.0, began + probe - time.monotonic()))
                continue
            rpc.pool.reuse(address, comm)  # the request that follows takes it
            return None

    async def _fetch(self, address: str, object_id: str, timeout: float | None,
                     owner: bool = False) -> list:
        try:
            gone = await self.owner_gone(address) if owner else None
            if gone is not None:  # its other objects here fail too, at once
                self.objects.process_died(address)
                raise OSError(gone)
            return await P.request(self.connector.rpc(address),
                                   P.FetchObject(object_id, timeout=timeout))
        except Exception as e:
            if owner and isinstance(e, OSError):  # the owner cannot be reached: it died
                error: Exception = OwnerDiedError(
                    f"object {object_id} cannot be read: its owner {address} (the process that "
                    f"created it) is unreachable: {e}")
            else:
                error = YRRuntimeError(f"cannot fetch object {object_id} from {address}: {e}")
            return [P.ERROR, dumps(RemoteError.from_exception(error, ""))]

    def _ensure_fetch(self, ref: ObjectRef) -> None:
        """A borrowed ref nobody asked its owner for yet: ask (the owner answers when ready)."""
        entry = ref._entry
        if entry.owner is None or entry.ready or entry.fetching:
            return
        with REFS_LOCK:  # user threads race here: one fetch only
            if entry.fetching:
                return
            entry.fetching = True

        async def fetch() -> None:
            kind, payload = await self._fetch(entry.owner, ref._id, None, owner=True)
            entry.set_result(kind, payload)

        self.on_loop(lambda: self.loop.create_task(fetch()))

    async def handle_fetch(self, object_id: str, timeout: float | None = None) -> list:
        """``FETCH_OBJECT`` for an object this process owns: wait for it, then send it."""
        entry = self.objects.entries.get(object_id)
        if entry is None:
            raise YRRuntimeError(f"object {object_id} is unknown to its owner {self.address}"
                                 " (it was freed, or its owner restarted)")
        if not entry.ready:
            fut = self.loop.create_future()
            entry.add_callback(lambda: fut.done() or fut.set_result(None))
            await asyncio.wait_for(fut, timeout)
        kind, payload = entry.snapshot(float("inf"))
        return [kind, wire(payload)]

    def wait(self, refs: list[ObjectRef], wait_num: int, timeout: float | None) -> tuple[list, list]:
        deadline = None if timeout is None else time.monotonic() + timeout
        done = threading.Event()
        count = [0]
        lock = threading.Lock()

        def one() -> None:
            with lock:
                count[0] += 1
                if count[0] >= wait_num:
                    done.set()

        for ref in refs:
            self._ensure_fetch(ref)
            self.on_loop(ref._entry.add_callback, one)
        lease_id = current_lease()
        blocked = False
        try:
            if lease_id is not None or self.agent is not None:
                blocked = True  # before the notice: if it raises, the finally still undoes it
                self._lend(lease_id, True)
            done.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        finally:
            if blocked:
                self._lend(lease_id, False)
        ready, not_ready = [], []
        for ref in refs:
            (ready if ref._entry.ready and len(ready) < wait_num else not_ready).append(ref)
        return ready, not_ready

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


# a get with at least this many refs from its first pending one on (counted whether ready or
# not: _wait_all skips the ready ones) waits for them from the last one back
GATHER_MIN_PENDING = 4
EXITS_KEPT = 1000  # worker processes whose end this runtime remembers
EXIT_REASON_WAIT_S = 0.5  # how long a crash error waits to learn how the process ended
LOST_WAIT_S = 30.0  # how long a failed fetch waits to hear that its worker is gone



def _safe_call(callback: Callable, ref: ObjectRef) -> None:
    try:
        callback(ref)
    except Exception:
        logger.exception("on_complete callback %r failed", callback)


def _is_ref(value: Any) -> bool:
    return type(value) is ObjectRef


def function_id(payload: bytes, name: str) -> str:
    return f"{name}-{hashlib.blake2b(payload, digest_size=8).hexdigest()}"


# --- driver lifecycle -----------------------------------------------------------------------


class _LoopThread:
    """An asyncio loop in a daemon thread: the driver's yr event loop."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._run, name="yrdask-loop", daemon=True)
        self.thread.start()
        self.ready.wait()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.call_soon(self.ready.set)
        self.loop.run_forever()
        self.loop.close()

    def run(self, coro: Any, timeout: float | None = None) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


class DriverRuntime(Runtime):
    """A driver's runtime: owns the loop thread, and the embedded cluster if it started one."""

    def __init__(self, conf: Config, cluster: "LocalCluster | None" = None) -> None:
        if cluster is not None:
            cluster.launch()  # first: its launcher imports while this process builds the rest
        try:
            self.loop_runner = _LoopThread()
            # An embedded cluster's driver builds its submitter and router once the workers'
            # start order is sent (EmbeddedCluster.start): they import while the launcher forks.
            super().__init__(self.loop_runner.loop, conf.job_id,
                             defer_machines=cluster is not None)
        except BaseException:
            proc = getattr(cluster, "proc", None)
            if proc is not None:  # it only waits for an address: nothing else to stop
                proc.kill()
                proc.wait()
            raise
        self.loop_thread = self.loop_runner.thread.ident
        self.conf = conf
        self.cluster = cluster  # the embedded cluster to start (no server_address), if any
        self.heap_frozen = False  # yr.init froze the GC's heap; yr.finalize gives it back
        self.info: ClientInfo | None = None
        # Config.log_to_driver: TaskOutput from workers goes to output_sink(records).
        self.output_sink: Callable[[list], None] | None = None
        if conf.log_to_driver:
            self.output_target = lambda: self.address

    async def start(self) -> ClientInfo:
        conf = self.conf
        configure_store(conf.object_store_memory, "Config.object_store_memory")
        if self.cluster is not None:
            self.cluster.launch()  # its launcher imports distributed while this process does
        from distributed.utils import get_ip

        security = resolve_security(conf)  # Config.security, yr's TLS fields or Dask's config
        connection_args = security.get_connection_args("client")
        tls = connection_args["ssl_context"] is not None
        address = conf.server_address
        if address:
            if "://" not in address:
                address = f"{'tls' if tls or security.require_encryption else 'tcp'}://{address}"
            _check_scheme(address, tls, security.require_encryption)
            host = address.split("://", 1)[1].rsplit(":", 1)[0].strip("[]")
            listen_host = "127.0.0.1" if host in ("127.0.0.1", "localhost") else get_ip(host)
        else:
            self.cluster.security = security if tls else None
            address = await self.cluster.start(after_order=self.build_machines)
            listen_host = "127.0.0.1"
        from yrdask.runtime.transport import DriverConnector

        self.connector = DriverConnector(
            self, address, connection_args, security.get_listen_args("client"))
        try:
            self.address = await self.connector.start(self.job_id, listen_host)
        except OSError as e:  # unreachable, or refused by TLS (CommClosedError is an OSError)
            raise YRRuntimeError(f"cannot join the cluster at {address}: {e}") from e
        return ClientInfo(self.job_id, self.connector.dashboard, address)

    async def close(self) -> None:
        try:
            await super().close()
        finally:
            if self.cluster is not None:
                await self.cluster.close()


def _check_scheme(address: str, tls: bool, required: bool) -> None:
    """A ``tls://`` address needs certificates; required encryption needs a ``tls://`` address."""
    if address.startswith("tls://") and not tls:
        raise YRValueError(
            f"server_address {address!r} is a TLS address but no TLS certificates are set: give "
            "Config(security=distributed.security.Security(tls_ca_file=..., tls_client_cert=..., "
            "tls_client_key=...)) or set distributed.comm.tls.* in the Dask config")
    if required and address.startswith("tcp://"):
        raise YRValueError(f"server_address {address!r} is a tcp:// address, but the TLS "
                           "settings require encryption: use tls://")


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


async def join_as_client(scheduler: str, job_id: str, listen_host: str) -> Runtime:
    """A runtime of its own for a process that has none: an isolated process of a worker
    (docs/isolation.md), started at its first nested call, on the running loop.

    It joins the scheduler the way a driver joining an address does (``DriverConnector``:
    a job stream and an owner server), under a job id of its own, so it owns what it
    creates and its job stream's end (the process died) releases its leases and handles.
    TLS comes from Dask's config (``distributed.comm.tls.*``), as for any client.
    """
    from distributed.security import Security

    from yrdask.runtime.transport import DriverConnector

    security = Security()
    connection_args = security.get_connection_args("client")
    if scheduler.startswith("tls://") and connection_args.get("ssl_context") is None:
        raise YRRuntimeError(
            f"nested calls in an isolated process need TLS to reach the scheduler at "
            f"{scheduler}, and this process has no certificates: set distributed.comm.tls.* "
            "in the Dask config (or the DASK_DISTRIBUTED__COMM__TLS__* variables) on the "
            "worker host")
    rt = Runtime(asyncio.get_running_loop(), job_id)
    rt.loop_thread = threading.get_ident()
    rt.connector = DriverConnector(rt, scheduler, connection_args,
                                   security.get_listen_args("client"))
    try:
        rt.address = await rt.connector.start(job_id, listen_host)
    except BaseException:
        rt.closed = True
        await rt.connector.close()
        raise
    return rt
