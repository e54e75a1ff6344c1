"""The isolated process itself (forked by the :mod:`.zygote`): a Dask comm endpoint
(:func:`child_main`) whose handlers (:class:`IsolatedHost`) build one instance with the same
``HostedInstance`` code as a worker, or run stateless tasks; its first nested call (or ref)
starts a runtime of its own (:class:`LazyRuntime`), which lends its holding's CPU while it
waits (:class:`ChildLending`).
"""
from __future__ import annotations

import asyncio
import atexit
import collections
import inspect
import logging
import os
import threading
import time
from _thread import allocate_lock
from typing import Any

import dask
from distributed.comm.core import CommClosedError

from yrdask import protocol as P
from yrdask.errors import RemoteError, ReturnError, YRRuntimeError, user_traceback
from yrdask.serialization import (PLAIN_TYPES, Frames, dumps, dumps_value, loads,
                                  unpack_args)
from yrdask.worker.isolated import START_TIMEOUT_S

logger = logging.getLogger("yrdask.worker")


def split_returns(result: Any, nret: int) -> list:
    """The ``nret`` values a task or method returned, as Python unpacking would check them."""
    try:
        values = list(result)
    except TypeError:
        raise TypeError(f"cannot unpack non-iterable {type(result)} object") from None
    if len(values) < nret:
        raise ValueError(f"not enough values to unpack (expected {nret}, got {len(values)})")
    if len(values) > nret:
        raise ValueError(f"too many values to unpack (expected {nret}, got {len(values)})")
    return values


REPLY_WRITE_WAIT_S = 5.0  # a thread waits this long at most for its reply to be written
#: ``.written``: a lock, held until the last reply this thread handed to the loop is written
#: (see :class:`_Outbox`)
_last_reply = threading.local()


class _Outbox:
    """The replies of the instance's threads, on their way to the loop: one wake-up of the
    loop per batch, and each batch written on the pass that takes it (one write per
    caller's stream), not on the next one.

    A thread's reply is written before the thread starts its next call
    (:func:`replies_written`, as the call's arguments are unpacked): a method that ends the
    process (``os._exit``) must not take the answers of the calls before it with it, or the
    caller would count those calls as unanswered and deliver them again.  The thread does
    not wait for the write right after its reply: by the time the next call comes, the
    write is long done (a sequential caller waits for the answer), so it costs no wake-up.
    What it would wait on is a plain lock per reply, released once the reply is written."""

    __slots__ = ("loop", "loop_thread", "items", "armed")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.loop_thread = threading.get_ident()
        self.items: collections.deque = collections.deque()  # (peer, msg, written)
        self.armed = False  # a drain is scheduled on the loop

    def put(self, peer: "_ChildPeer", msg: dict) -> None:
        """Hand ``msg`` to the loop (any thread but the loop's)."""
        written = _last_reply.written = allocate_lock()
        written.acquire()
        self.items.append((peer, msg, written))
        if not self.armed:  # after the append: a drain that starts now takes it
            self.armed = True
            self.loop.call_soon_threadsafe(self.drain)

    def drain(self) -> None:
        """Write what the threads handed over (loop thread), in order, then tell them."""
        self.armed = False  # before taking them: a later put schedules a drain of its own
        items = self.items
        if not items:
            return
        peer, msg, written = items.popleft()
        if not items:  # the usual case: one reply
            try:
                peer.write(msg)
            finally:
                written.release()
            return
        batches = {peer: [msg]}
        locks = [written]
        try:
            while items:
                peer, msg, written = items.popleft()
                locks.append(written)
                batch = batches.get(peer)
                if batch is None:
                    batches[peer] = [msg]
                else:
                    batch.append(msg)
            for peer, batch in batches.items():
                peer.write(*batch)
        finally:
            for written in locks:
                written.release()


class _ChildPeer:
    """A caller's call channel, seen from the child: replies from instance threads go
    through the process's :class:`_Outbox`.  ``caller`` is who opened it
    (``OpenChannel.caller``), to whom refs in results are lent."""

    __slots__ = ("outbox", "stream", "caller")

    def __init__(self, outbox: _Outbox, stream: Any, caller: str) -> None:
        self.outbox = outbox
        self.stream = stream
        self.caller = caller

    def reply(self, msg: dict) -> None:
        outbox = self.outbox
        if threading.get_ident() != outbox.loop_thread:
            outbox.put(self, msg)
            return
        if outbox.items:  # what the threads handed over first goes first
            outbox.drain()
        try:
            self.stream.send(msg)  # with what else this loop pass sends
        except CommClosedError:
            pass  # the caller went: its calls are its own to deliver again

    def write(self, *msgs: dict) -> None:
        """Write ``msgs`` on this caller's stream now (loop thread)."""
        try:
            self.stream.send_now(*msgs)
        except CommClosedError:
            pass  # the caller went: its calls are its own to deliver again


def replies_written() -> None:
    """Wait until the last reply this thread handed to the loop is written (see
    :class:`_Outbox`)."""
    written = getattr(_last_reply, "written", None)
    if written is not None:
        _last_reply.written = None
        written.acquire(True, REPLY_WRITE_WAIT_S)


def _stored(object_id: str) -> Any:
    from yrdask.runtime.store import node_store

    payload = node_store().get(object_id)
    if payload is None:
        raise YRRuntimeError(
            f"object {object_id} is not in this node's store: an isolated process reads large "
            "arguments from its node only (pass values made on another node to a task first, "
            "or give the instance its data at creation)")
    return payload


class IsolatedHost:
    """What ``HostedInstance`` needs of an agent, in the child: values in, values out.

    Refs in the arguments and results are counted as a worker counts them (borrowing,
    docs/objects.md), by this process's own runtime, which the first ref or nested call
    starts (:class:`LazyRuntime`): the child is then the borrower of the refs it unpickled
    and the owner of what it created."""

    own_process = True  # the instance's process is its own: sys.exit(n) may end it

    def __init__(self, runtime: "LazyRuntime | None" = None, worker: str = "") -> None:
        from yrdask.worker.hosting import SideEdge
        from yrdask.worker.instance_side import InstanceSide

        self.loop = asyncio.get_running_loop()
        self.runtime = runtime
        self.worker = worker  # its worker agent's address: the supervision channel's caller
        self.instance: Any = None
        # a process instance's callers' calls, as a worker's instance side takes them
        # (``START``, calls, cancels, a scale-down's hold and release)
        self.side = InstanceSide(SideEdge(self._host))
        self.supervision: Any = None  # the agent's channel (a StreamSender)
        self.supervised = P.handlers(P.SUPERVISION, self)  # what the agent asks on it
        # its calls for Dask's panels, through the agent (dask_panels.ChildRecorder; None:
        # yrdask.dashboard.dask-panels is off); HostedInstance reads it as a worker's
        self.recorder: Any = None
        self.functions: dict[str, Any] = {}
        self._built: asyncio.Future | None = None
        self.server: Any = None  # its endpoint (child_main; endpoint.Endpoint)
        self.outbox = _Outbox(self.loop)  # its threads' replies to its callers
        self.assigned = False  # a request was handed to it: no longer a spare

    async def assign_isolated(self, comm: Any, request: dict, then: dict | None = None) -> Any:
        """:class:`P.AssignIsolated`: this spare becomes the process of ``request`` (see
        :meth:`assign`); its pid goes back at once, then ``then`` runs here and its reply is
        this message's (``None`` without ``then``: the pid was the reply)."""
        pid = self.assign(request)
        if then is None:
            return pid
        await comm.write(pid)
        result = P.dispatch(self.server.handlers, then)
        return await result if inspect.iscoroutine(result) else result

    def assign(self, request: dict) -> int:
        """Become the process of ``request``: its environment and directory are applied
        before any user code runs, and its worker's ``info`` is filled in; its pid."""
        if self.assigned:
            raise YRRuntimeError(f"isolated process {os.getpid()} was handed a second request")
        self.assigned = True
        apply_request(request)
        info = self.runtime.learn(request)
        self.worker = info.get("worker") or ""
        if info.get("panels"):  # its worker records its work for Dask's panels: so does this
            from yrdask.worker.dask_panels import FLUSH_MS, ChildRecorder

            loop = self.loop
            self.recorder = ChildRecorder(
                self.to_agent,
                lambda: (0, 0) if self.instance is None else (self.instance.calls_pending,
                                                              self.instance.calls_done),
                lambda: loop.call_soon_threadsafe(loop.call_later, FLUSH_MS / 1000,
                                                  self.recorder.flush))
        from yrdask.worker import output

        node = self.runtime.agent.node_id = info.get("node") or ""
        out = _OutputAgent(self, self.server, node)
        output.install(out)
        self.runtime.output_target = out.runtime.output_target
        return os.getpid()

    def to_agent(self, msg: dict) -> bool:
        """A message to the agent on the supervision channel (:data:`P.ISOLATED_TO_AGENT`);
        False while there is no channel (or the agent let go: this process ends)."""
        if self.supervision is None:
            return False
        try:
            self.supervision.send(msg)
        except CommClosedError:
            return False
        return True

    def payloads(self, deps: list) -> list:
        """Small values came in the message; large ones are mapped from the node's store
        (a method call's large arguments come as locations: on this node, they are there)."""
        return [payload if kind == P.VALUE else _stored(oid) for oid, kind, payload in deps]

    def pack_results(self, task_id: str, result: Any, nret: int,
                     caller: str | None = None) -> tuple[list, list | None]:
        """``([kind, payload] per value, nested)``.  Small values go back in the reply;
        large ones are written to the node's store here, not sent through a socket: a
        task's are recorded by the agent (:func:`keep_large`); an instance's answer goes
        to its caller with the worker's address, and the agent keeps them
        (:class:`P.ResultsKept`), so they outlive this process.  Refs nested in a value are
        lent to ``caller`` via that result (``nested``, as a worker's ``TaskDone.refs``), or
        pinned when the caller is not known."""
        from yrdask.runtime.objects import pack_counting
        from yrdask.runtime.store import node_store
        from yrdask.worker.hosting import RESULT_INLINE_LIMIT

        values = [result] if nret <= 1 else split_returns(result, nret)
        ids = [task_id] if len(values) <= 1 else [f"{task_id}.{i}" for i in range(len(values))]
        out = []
        nested = None
        for oid, v in zip(ids, values):
            if type(v) is ReturnError:  # this return failed, the earlier ones did not
                out.append([P.ERROR, dumps(RemoteError.from_exception(v.error, v.traceback_str))])
                continue
            if type(v) in PLAIN_TYPES:  # the hot path: no ref in it, nothing to count
                payload, counted = dumps(v), None
            else:
                payload, _refs, counted = pack_counting(dumps_value, v)
            if counted:  # refs exist here only once this process's runtime has started
                objects = self.runtime.started_runtime().objects
                lent = objects.lend_result(counted, caller or None, oid)
                if lent is not None:
                    nested = nested or []
                    nested.append(lent)
            if self.instance is None:  # a task's: the agent decides what it keeps
                if type(payload) is Frames:
                    node_store().put(oid, payload)
                    out.append([P.STORED, None])
                else:
                    out.append([P.VALUE, payload])
            elif type(payload) is Frames or len(payload) > RESULT_INLINE_LIMIT:
                node_store().put(oid, payload if type(payload) is Frames else Frames([payload]))
                self.loop.call_soon_threadsafe(self._kept, oid)
                out.append([P.LOCATION, self.worker])
            else:
                out.append([P.VALUE, payload])
        return out, nested

    def _kept(self, object_id: str) -> None:
        self.to_agent(P.ResultsKept([object_id]).to_msg())

    def unpack_call(self, msg: dict) -> tuple[tuple, list]:
        """``((args, kwargs), borrowed)`` of a method call: ``borrowed`` the ids of the refs
        nested in its arguments, which this process may keep (reported in ``TaskDone``).
        Unpacked in the thread that runs the call, before it runs: the replies this thread
        gave before are written first (:class:`_ChildPeer`)."""
        replies_written()
        return self.unpack(msg["args"], msg["deps"])

    def unpack(self, args: bytes, deps: list) -> tuple[tuple, list]:
        from yrdask.runtime.objects import REF_MARK, unpickling

        values = [self.load_value(p) for p in self.payloads(deps)] if deps else []
        if REF_MARK not in args:  # the hot path: no ref in the arguments
            return unpack_args(args, values), []
        unpacked, found = unpickling(unpack_args, args, values)
        return unpacked, list(found)

    def refs_report(self, borrowed: Any, nested: Any) -> list | None:
        """``TaskDone.refs``: this process (its runtime's owner server) holds them."""
        if not borrowed and not nested:
            return None
        return [self.runtime.started_runtime().address, borrowed or [], nested]

    @property
    def instances(self) -> dict:
        """The instance this process hosts, as an agent's ``instances`` (none: ``{}``)."""
        inst = self.instance
        return {} if inst is None else {inst.instance_id: inst}

    def load_value(self, payload: Any) -> Any:
        """Unpickle a ref argument's value; refs nested in it register with their owners."""
        from yrdask.runtime.objects import unpickling

        value, found = unpickling(loads, payload)
        if found:
            self.runtime.started_runtime().objects.register_reads(found)
        return value

    def report_state(self, instance_id: str, state: str, error: bytes | None) -> None:
        self.loop.call_soon_threadsafe(self._built.set_result, error)

    def item_sender(self, peer: Any, task_id: str) -> Any:
        """``emit(index, value)`` for a generator method: each value goes to the agent, its
        nested refs lent to the caller via the item as a worker's are, a call this process
        made to itself included (:func:`~yrdask.runtime.generators.item_sender`)."""
        from yrdask.runtime.generators import item_sender

        return item_sender(self.pack_results, self.runtime, peer, task_id)

    async def start_isolated(self, spec: dict) -> bytes | None:
        self._built = self.loop.create_future()
        self.side.start(spec)
        return await self._built

    def _host(self, spec: dict, running: Any) -> Any:
        from yrdask.worker.hosting import HostedInstance

        # the zygote's exit handlers are its own: this process runs those its instance
        # registers, when the instance ends by intent (stop_isolated), as a Ray actor does
        atexit._clear()
        self.instance = HostedInstance(self, spec, spec.get("deps") or [])
        return self.instance

    async def drain_instance(self, instance_id: str, timeout_s: float = 30.0) -> bytes | None:
        """:class:`P.DrainInstance` from the agent: as a worker drains its own instances."""
        from yrdask.worker.hosting import drain_hosted

        return await drain_hosted(self.side, instance_id, timeout_s)

    def instance_moved(self, instance_id: str, to: str = "") -> None:
        """:class:`P.InstanceMoved` from the agent: the held calls answer "moved" (or run,
        ``to`` empty); the agent then ends this process."""
        inst = self.side.release(instance_id, to)
        if inst is not None:
            inst.stop(f"it moved to {to}")

    def agent_request(self, request_id: int, request: dict) -> None:
        """:class:`P.AgentRequest` on the supervision channel: ``request`` runs (a stop, a
        drain or a move, :data:`P.SUPERVISION`) and is answered there."""
        self.loop.create_task(self._answer_agent(request_id, request))

    async def _answer_agent(self, request_id: int, request: dict) -> None:
        try:
            result = P.dispatch(self.supervised, request)
            if inspect.iscoroutine(result):
                result = await result
            answer = P.AgentReply.wire(request_id, result=result)
        except Exception as e:  # noqa: BLE001 - the agent's waiter raises it
            answer = P.AgentReply.wire(
                request_id, error=dumps(RemoteError.from_exception(e, user_traceback())))
        self.to_agent(answer)

    async def stop_isolated(self, reason: str) -> None:
        """``STOP_ISOLATED``: the instance ends; ``__yr_shutdown__`` and then the atexit
        handlers run before the reply."""
        inst = self.instance
        if inst is None:
            return
        obj = inst.obj
        inst.stop(reason)
        if self.recorder is not None:  # its last calls reach the panels before it goes
            self.recorder.flush()
        hook = getattr(inst, "run_shutdown_hook", None)
        if hook is not None:
            await hook(obj)
        # then the instance's atexit handlers, as the process of a Ray actor that exits runs
        # them (a crash or a kill of the process skips them, as there); in a thread, since a
        # handler may block or use the yr API, which needs this loop; none (_host cleared the
        # zygote's): no thread to start
        if atexit._ncallbacks():
            await self.loop.run_in_executor(None, atexit._run_exitfuncs)

    async def checkpoint_isolated(self) -> bytes:
        """``CHECKPOINT_ISOLATED``: the hosted instance's current state, pickled."""
        from yrdask.runtime.context import checkpoint

        return await self.loop.run_in_executor(None, checkpoint, self.instance.obj)

    async def run_isolated(self, task_id: str, lease_id: str, fn_id: str, fn: bytes,
                           args: bytes, deps: list, nret: int, owner: str,
                           log_to: str | None = None, name: str = "",
                           caller: str = "") -> tuple[dict, bool]:
        """One stateless task (``RUN_ISOLATED``), in a thread: its ``TASK_DONE`` dict, and
        whether this process has a runtime now (it may own objects: the agent keeps it)."""
        done = await self.loop.run_in_executor(
            None, self._run_task, task_id, lease_id, fn_id, fn, args, deps, nret, owner,
            log_to, name, caller)
        return done, self.runtime is not None and self.runtime.started

    def _run_task(self, task_id: str, lease_id: str, fn_id: str, fn: bytes, args: bytes,
                  deps: list, nret: int, owner: str, log_to: str | None = None,
                  name: str = "", caller: str = "") -> dict:
        from yrdask.runtime.context import task_context
        from yrdask.worker.output import task_prints_to

        borrowed: list = []
        try:
            func = self.functions.get(fn_id)
            if func is None:
                func = self.functions[fn_id] = loads(fn)
            (a, kw), borrowed = self.unpack(args, deps)
            with task_context(lease_id, owner), task_prints_to(log_to, name):
                result = func(*a, **kw)
            results, nested = self.pack_results(task_id, result, nret, caller)
        except BaseException as e:  # noqa: BLE001 - reported to the caller
            err = dumps(RemoteError.from_exception(e, user_traceback()))
            return P.TaskDone(task_id, error=err, retryable=True,
                              refs=self.refs_report(borrowed, None)).to_msg()
        return P.TaskDone(task_id, results=results,
                          refs=self.refs_report(borrowed, nested)).to_msg()

    def cancel(self, msg: dict) -> None:
        """Ray's cancel of one of the instance's calls; a recursive one also cancels the
        tasks the call submitted (this process's runtime owns them), as a worker does."""
        from yrdask.worker.instance_side import call_children

        task_id = msg["task_id"]
        if self.side.cancel(task_id) and msg.get("recursive"):
            children = call_children.pop(task_id, None)
            if children and self.runtime is not None and self.runtime.started:
                for child in children:
                    self.runtime.started_runtime().submitter.cancel(child, False, True)

    async def open_channel(self, comm: Any, caller: str, expect: str = "") -> None:
        """A call channel from a caller (``CALL_METHOD``, ``CANCEL_TASK``), or the agent's
        supervision channel (``caller`` is the worker), which also carries the agent's
        requests (:data:`P.SUPERVISION`): this process ends when that one closes (the agent
        let go of it, or died; a stop's reply is written before the agent closes it)."""
        from distributed.comm.core import CommClosedError

        from yrdask.stream import StreamSender

        if expect:  # a caller meaning a worker process (its server id): this is not one
            comm.abort()
            return
        stream = StreamSender(comm)
        supervision = caller == self.worker
        if supervision:
            self.supervision = stream
        peer = _ChildPeer(self.outbox, stream, caller)
        side = self.side
        try:
            while True:
                msgs = await comm.read()
                for msg in msgs if isinstance(msgs, (list, tuple)) else (msgs,):
                    op = msg.get("op")
                    if op == P.CALL_METHOD:
                        side.call_method(peer, msg)
                        rec = self.recorder  # a call waits: the panels' count of them
                        if rec is not None and not rec.armed:
                            rec.changed()
                    elif op == P.CANCEL_TASK:
                        self.cancel(msg)
                    elif supervision:
                        P.dispatch(self.supervised, msg)
        except (CommClosedError, OSError):
            pass
        finally:
            if supervision:
                os._exit(0)  # the agent let go of this process
            comm.abort()


class LazyRuntime:
    """This process's runtime: none until the first nested call (or ref) needs one, then
    a runtime of its own that joins the scheduler as a client (``join_as_client``, about
    what ``yr.init(address)`` costs), so work that never nests pays nothing.

    It stays installed as the process's runtime and hands every attribute to the real one
    (starting it on first use); ``agent`` stands for the worker agent, which is not in this
    process: it knows the node id (``get_node_id()``) and nothing else."""

    def __init__(self, loop: asyncio.AbstractEventLoop, info: dict) -> None:
        self.agent = _NoAgent(info.get("node") or "")
        self._loop = loop
        self._loop_thread = threading.get_ident()
        self._info = info  # (a spare's is filled in when it is handed its request)
        self._real: Any = None
        self._lock = threading.Lock()
        self.output_target: Any = None  # set by worker.output; handed to the real runtime
        self.start_s: float | None = None  # how long the start took (docs/isolation.md)

    def learn(self, request: dict) -> dict:
        """Its worker's ``info`` (:func:`~.zygote.child_info`), from the request handed to
        this spare."""
        self._info.update((key, request.get(key)) for key in
                          ("node", "scheduler", "host", "worker", "tls", "panels"))
        return self._info

    @property
    def node_ip(self) -> str:
        """Its worker's host: the node's IP (``get_node_ip_address``), before any runtime."""
        return self._info.get("host") or "127.0.0.1"

    @property
    def started(self) -> bool:
        return self._real is not None

    @property
    def address(self) -> str:
        rt = self._real
        return rt.address if rt is not None else self.agent.node_id

    def started_runtime(self) -> Any:
        """The real runtime, started now if it was not (blocking; not on the loop thread)."""
        rt = self._real
        if rt is not None:
            return rt
        with self._lock:
            if self._real is None:
                self._real = self._start()
        return self._real

    def _start(self) -> Any:
        from yrdask.runtime.runtime import join_as_client

        scheduler = self._info.get("scheduler") or ""
        if not scheduler:
            raise YRRuntimeError(
                "nested calls in this isolated process need the scheduler's address, and its "
                "worker did not know it (the worker is not connected to a scheduler)")
        if threading.get_ident() == self._loop_thread:
            raise YRRuntimeError(
                "the first nested call of an isolated process was made on its event loop "
                "thread; make it from the task's or method's thread")
        t0 = time.perf_counter()
        job = f"isolated-{os.getpid()}-{os.urandom(4).hex()}"
        fut = asyncio.run_coroutine_threadsafe(
            join_as_client(scheduler, job, self._info.get("host") or "127.0.0.1",
                           self._info.get("tls") or None), self._loop)
        try:
            rt = fut.result(START_TIMEOUT_S)
        except YRRuntimeError:
            raise
        except Exception as e:
            raise YRRuntimeError(
                f"this isolated process could not start its runtime for a nested call: "
                f"cannot join the scheduler at {scheduler}: {type(e).__name__}: {e}") from e
        if self.output_target is not None:  # prints of nested work go where this work's do
            rt.output_target = self.output_target
        rt.connector.notify_blocked = ChildLending(rt).notify_blocked  # (a driver lends none)
        self.start_s = time.perf_counter() - t0
        logger.debug("isolated process %s: runtime started in %.3f s", os.getpid(),
                     self.start_s)
        return rt

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.started_runtime(), name)


class ChildLending:
    """A blocked ``yr.get`` in an isolated process lends its holding's CPU, as in a worker
    (``worker/lending.py``'s :class:`~yrdask.worker.lending.LendNotices` decides: a block
    that lasts ``lend-delay`` is told, ``LeaseBlocked`` / ``LeaseUnblocked``), here on the
    child's own job stream: a GPU task that waits for the CPU tasks it submitted does not
    hold the CPU they need (Ray's rule).  Fed on the child's loop, so no lock."""

    def __init__(self, rt: Any) -> None:
        import dask

        from yrdask.worker.lending import LEND_DELAY_S, LendNotices, parse_delay

        self.rt = rt
        self.notices = LendNotices(
            parse_delay(dask.config.get("yrdask.worker.lend-delay", LEND_DELAY_S)))

    def notify_blocked(self, holding_id: str, blocked: bool) -> None:
        """The connector's ``notify_blocked`` (any thread): in order, through the inbox."""
        self.rt.on_loop(self._blocked, holding_id, blocked)

    def _blocked(self, holding_id: str, blocked: bool) -> None:
        self._do(self.notices.blocked("lend", holding_id, blocked, self.rt.loop.time()))

    def _tick(self) -> None:
        from yrdask.worker.lending import Tick

        self._do(self.notices.handle(Tick("lend-tick", self.rt.loop.time())))

    def _do(self, instructions: list) -> None:
        from yrdask.worker.lending import Notify, WakeAt

        for ins in instructions:
            if type(ins) is Notify:
                self.rt.connector.stream_send(P.LeaseBlocked(ins.holding_id) if ins.blocked
                                              else P.LeaseUnblocked(ins.holding_id))
            elif type(ins) is WakeAt:
                self.rt.loop.call_at(ins.at, self._tick)
            else:  # pragma: no cover - a new instruction nobody taught the adapter
                raise AssertionError(f"unknown lending instruction {ins!r}")


class _NoAgent:
    """The worker agent as an isolated process sees it: its node id, and the instance this
    process hosts (``instances``), as the Ray surface's ``hosted_instance()`` asks."""

    def __init__(self, node: str) -> None:
        self.node_id = node
        self.host: "IsolatedHost | None" = None

    @property
    def instances(self) -> dict:
        return {} if self.host is None else self.host.instances

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        raise YRRuntimeError(
            "not available in work that runs in a process of its own (tasks and actors that "
            "hold GPUs or NPUs, and work with isolated=True, env_vars or runtime_env): it "
            f"needs the worker agent ({name!r}), which runs in the worker's process; use an "
            "in-process instance or task for it")


class _OutputAgent:
    """What :mod:`yrdask.worker.output` needs of an agent, in an isolated process: prints of
    its instance's methods and of its tasks go to their driver, prefixed with the worker."""

    def __init__(self, host: "IsolatedHost", server: Any, node: str) -> None:
        import types

        self.loop = host.loop
        self.host = host
        self.worker = types.SimpleNamespace(address=node, rpc=server.rpc)
        self.runtime = types.SimpleNamespace(closed=False, output_target=None)

    @property
    def instances(self) -> dict:
        return self.host.instances


def endpoint(info: dict) -> tuple[str, dict]:
    """Where this process listens, and how: its callers reach it directly, from any host,
    so on its worker's host, with its worker's TLS certificates where it has them, else
    those of Dask's config (docs/isolation.md#tls)."""
    from distributed.security import Security

    tls = info.get("tls")
    listen_args = (Security(**tls).get_listen_args("worker") if tls
                   else Security().get_listen_args("client"))
    scheme = "tls" if listen_args.get("ssl_context") is not None else "tcp"
    return f"{scheme}://{info.get('host') or '127.0.0.1'}:0", listen_args



async def child_main(announce: Any, listen: dict) -> None:
    """Listen where ``listen`` says (its worker's host and TLS: see :func:`endpoint`),
    ``announce`` the address, and serve: as a spare until the agent hands this process its
    request (:meth:`IsolatedHost.assign_isolated`), then its instance or tasks, until the
    agent lets go (the supervision channel closes) or the process is killed."""
    from yrdask.runtime.context import install
    from yrdask.serialization import register_with_dask
    from yrdask.worker.isolated.endpoint import Endpoint

    register_with_dask()
    runtime = LazyRuntime(asyncio.get_running_loop(), {})
    install(runtime)
    host = IsolatedHost(runtime)  # its worker is known once a request is handed to it
    runtime.agent.host = host
    # Dask's comms without a Server: no system monitor, no counters (endpoint.py)
    server = host.server = Endpoint(P.handlers(P.ISOLATED_RPC, host))
    address, listen_args = endpoint(listen)
    await server.listen(address, **listen_args)
    announce(server.address)
    await asyncio.Event().wait()  # forever: killed by the agent, or with the zygote


#: the environment the zygote started with, which a request's ``env`` and ``unset`` change
START_ENV: dict = {}


def apply_request(req: dict) -> None:
    """What a request makes of a spare, before any user code runs: its environment (the
    zygote's first one, :data:`START_ENV`, changed as the request says; the thread limits of
    the libraries loaded already follow it) and its directory."""
    import tempfile

    from yrdask.worker.threads import follow_env

    before = dict(os.environ)
    env = {**START_ENV, **req["env"]}
    for key in req.get("unset") or ():
        env.pop(key, None)
    for key in [key for key in before if key not in env]:
        del os.environ[key]
    for key, value in env.items():  # mostly the zygote's own (the worker's): set what differs
        if before.get(key) != value:
            os.environ[key] = value
    follow_env(before)  # numpy, loaded by the zygote, takes the new thread limits
    tempfile.tempdir = None  # the zygote's choice; this process's TMPDIR decides
    if req.get("cwd"):
        os.chdir(req["cwd"])
