"""The isolated process itself (forked by the :mod:`.zygote`): a small Dask ``Server``
(:func:`child_main`) whose handlers (:class:`IsolatedHost`) build one instance with the same
``HostedInstance`` code as a worker, or run stateless tasks; its first nested call (or ref)
starts a runtime of its own (:class:`LazyRuntime`), which lends its holding's CPU while it
waits (:class:`ChildLending`).
"""
from __future__ import annotations

import asyncio
import atexit
import logging
import os
import threading
import time
from typing import Any

import dask

from yrdask import protocol as P
from yrdask.errors import RemoteError, ReturnError, YRRuntimeError, user_traceback
from yrdask.serialization import Frames, dumps, dumps_value, loads, unpack_args
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


class _ChildPeer:
    """The agent's call channel, seen from the child: replies from instance threads.

    A thread's reply is written before the thread goes on to its next call: a method that
    ends the process (``os._exit``) must not take the answers of the calls before it with
    it, or the agent would count those calls as not started and deliver them again."""

    def __init__(self, loop: asyncio.AbstractEventLoop, stream: Any) -> None:
        self.loop = loop
        self.stream = stream
        self.loop_thread = threading.get_ident()

    def reply(self, msg: dict) -> None:
        if threading.get_ident() == self.loop_thread:
            self._send(msg)
            return
        written = threading.Event()
        self.loop.call_soon_threadsafe(self._send, msg, written)
        written.wait(REPLY_WRITE_WAIT_S)

    def _send(self, msg: dict, written: threading.Event | None = None) -> None:
        from distributed.comm.core import CommClosedError

        try:
            self.stream.send(msg)
        except CommClosedError:
            pass
        if written is not None:  # after the stream's own write, which send() scheduled
            self.loop.call_soon(written.set)


class _CallerPeer:
    """One call's peer in the child: replies go on the agent's channel, and ``caller`` says
    who made the call (``CallMethod.caller``), to whom refs in its results are lent."""

    __slots__ = ("peer", "caller")

    def __init__(self, peer: _ChildPeer, caller: str) -> None:
        self.peer = peer
        self.caller = caller

    def reply(self, msg: dict) -> None:
        self.peer.reply(msg)


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

    def __init__(self, runtime: "LazyRuntime | None" = None) -> None:
        self.loop = asyncio.get_running_loop()
        self.runtime = runtime
        self.instance: Any = None
        self.inline_limit = 0  # every value goes back; the agent decides what it keeps
        self.functions: dict[str, Any] = {}
        self._built: asyncio.Future | None = None

    def payloads(self, deps: list) -> list:
        """Small values came in the message; large ones are mapped from the node's store
        (a method call's large arguments come as locations: on this node, they are there)."""
        return [payload if kind == P.VALUE else _stored(oid) for oid, kind, payload in deps]

    def pack_results(self, task_id: str, result: Any, nret: int,
                     caller: str | None = None) -> tuple[list, list | None]:
        """``([kind, payload] per value, nested)``.  Small values go back in the reply;
        large ones are written to the node's store here (the agent records them:
        :func:`keep_large`), not sent through the socket.  Refs nested in a value are lent
        to ``caller`` via that result (``nested``, as a worker's ``TaskDone.refs``), or
        pinned when the caller is not known (an instance's calls come through the agent)."""
        from yrdask.runtime.objects import pack_counting
        from yrdask.runtime.store import node_store

        values = [result] if nret <= 1 else split_returns(result, nret)
        ids = [task_id] if len(values) <= 1 else [f"{task_id}.{i}" for i in range(len(values))]
        out = []
        nested = None
        for oid, v in zip(ids, values):
            if type(v) is ReturnError:  # this return failed, the earlier ones did not
                out.append([P.ERROR, dumps(RemoteError.from_exception(v.error, v.traceback_str))])
                continue
            payload, _refs, counted = pack_counting(dumps_value, v)
            if counted:  # refs exist here only once this process's runtime has started
                objects = self.runtime.started_runtime().objects
                lent = objects.lend_result(counted, caller or None, oid)
                if lent is not None:
                    nested = nested or []
                    nested.append(lent)
            if type(payload) is Frames:
                node_store().put(oid, payload)
                out.append([P.STORED, None])
            else:
                out.append([P.VALUE, payload])
        return out, nested

    def unpack_call(self, msg: dict) -> tuple[tuple, list]:
        """``((args, kwargs), borrowed)`` of a method call: ``borrowed`` the ids of the refs
        nested in its arguments, which this process may keep (reported in ``TaskDone``)."""
        return self.unpack(msg["args"], msg["deps"])

    def unpack(self, args: bytes, deps: list) -> tuple[tuple, list]:
        from yrdask.runtime.objects import REF_MARK, unpickling

        values = [self.load_value(p) for p in self.payloads(deps)]
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
        from yrdask.worker.hosting import HostedInstance

        # the zygote's exit handlers are its own: this process runs those its instance
        # registers, when the instance ends by intent (stop_isolated), as a Ray actor does
        atexit._clear()
        self._built = self.loop.create_future()
        self.instance = HostedInstance(self, spec, spec.get("deps") or [])
        return await self._built

    async def stop_isolated(self, reason: str) -> None:
        """``STOP_ISOLATED``: the instance ends; ``__yr_shutdown__`` runs before the reply."""
        inst = self.instance
        if inst is None:
            return
        obj = inst.obj
        inst.stop(reason)
        hook = getattr(inst, "run_shutdown_hook", None)
        if hook is not None:
            await hook(obj)
        # then the instance's atexit handlers, as the process of a Ray actor that exits runs
        # them (a crash or a kill of the process skips them, as there)
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

    async def open_channel(self, comm: Any, caller: str, expect: str = "") -> None:
        from distributed.comm.core import CommClosedError

        from yrdask.stream import StreamSender

        if expect:  # a caller meaning a worker process (its server id): this is not one
            comm.abort()
            return

        peer = _ChildPeer(self.loop, StreamSender(comm))
        try:
            while True:
                msgs = await comm.read()
                for msg in msgs if isinstance(msgs, (list, tuple)) else (msgs,):
                    op = msg.get("op")
                    if op == P.CALL_METHOD and self.instance is not None:
                        caller = msg.get("caller")
                        self.instance.call(_CallerPeer(peer, caller) if caller else peer, msg)
                    elif op == P.CANCEL_TASK and self.instance is not None:
                        self.instance.cancel_call(msg["task_id"])
        except (CommClosedError, OSError):
            pass
        finally:
            os._exit(0)  # the agent let go of this process


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
        self._info = info
        # its worker's host: the node's IP (get_node_ip_address) before any runtime runs
        self.node_ip: str = info.get("host") or "127.0.0.1"
        self._real: Any = None
        self._lock = threading.Lock()
        self.output_target: Any = None  # set by worker.output; handed to the real runtime
        self.start_s: float | None = None  # how long the start took (docs/isolation.md)

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
            join_as_client(scheduler, job, self._info.get("host") or "127.0.0.1"), self._loop)
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


async def child_main(announce: Any, info: dict) -> None:
    """Serve the agent until it lets go (the channel closes) or the process is killed."""
    from distributed.core import Server

    from yrdask.runtime.context import install
    from yrdask.serialization import register_with_dask
    from yrdask.worker import output

    register_with_dask()
    node = info.get("node") or ""
    runtime = LazyRuntime(asyncio.get_running_loop(), info)
    install(runtime)
    host = IsolatedHost(runtime)
    runtime.agent.host = host
    # no scratch directory: nothing here writes one, and a killed child would leave it behind
    # for the next one to purge (a lock and a directory per process: ~10 ms of a creation)
    server = Server(P.handlers(P.ISOLATED_RPC, host), needs_workdir=False)
    await server.listen("tcp://127.0.0.1:0")
    out = _OutputAgent(host, server, node)
    output.install(out)
    runtime.output_target = out.runtime.output_target
    announce(server.address)
    await asyncio.Event().wait()  # forever: killed by the agent, or with the zygote
