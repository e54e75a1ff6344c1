"""One live instance on a worker: the object, its call queue and what runs its calls.

Which calls run now is decided by :class:`~yrdask.worker.call_queue.CallQueue`, and where
they run, how they are answered, cancelled and stopped by
:class:`~yrdask.worker.instance_side.HostedCalls` (both driven by the simulation too; this
class is their edge): none before ``__init__`` has finished, then in arrival order, at
most ``concurrency`` at a time (calls from one caller arrive in the order it sent them on
the call channel, so they start in that order).  What runs them:

* Sync class, concurrency 1: one thread (a FIFO mailbox), one call after the other.
* Sync class, concurrency n > 1: a pool of n threads, up to n calls side by side.
* Async class (any ``async def`` method): an event loop in its own thread runs up to
  ``concurrency`` (default 1000) calls at once (a call counts until its coroutine ends).
  Methods the class names in ``__yr_off_loop__`` run their body on an executor of their own
  (Ray's concurrency groups): their calls are started from a second loop, outside the
  queue's concurrency, so a call blocking the instance's loop does not hold them up.

``__init__`` runs first in the same executor; calls that arrive before it has finished wait
in the queue.  If it raises, every call answers with that error.
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import logging
import os
import queue
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from yrdask import protocol as P
from yrdask.runtime import context as _rtctx
from yrdask.runtime.context import task_context
from yrdask.runtime.generators import drain, drain_async
from yrdask.worker import execution as _execution
from yrdask.worker.instance_side import HostedCalls, call_children
from yrdask.worker.threads import LIMITS as THREAD_LIMITS, instance_cpus
from yrdask.errors import (InstanceDiedError, InstanceMovedError, RemoteError,
                           call_cancelled, user_traceback)
from yrdask.serialization import dumps, loads, unpack_args

logger = logging.getLogger("yrdask.worker")

#: results larger than this are kept in the node's store and fetched by their owner; smaller
#: ones travel inline in their answer (a worker's, or a process instance's process's)
RESULT_INLINE_LIMIT = 512 * 1024

_STOP = object()
_running = threading.local()  # .call: the id of the call this thread runs (sync methods)
#: the id of the ``async def`` call the current asyncio task runs
_async_call: contextvars.ContextVar = contextvars.ContextVar("yr_async_call", default=None)


def _running_call_id() -> str | None:
    """The id of the method call this thread (or asyncio task) runs, or None."""
    return _async_call.get() or getattr(_running, "call", None)


_rtctx.call_id_probe = _running_call_id


def _note_call_child(task_id: str) -> None:
    """The method call this thread (or asyncio task) runs submitted task ``task_id``."""
    call_id = _running_call_id()
    if call_id is not None:
        call_children.setdefault(call_id, []).append(task_id)


_execution.call_child_note = _note_call_child


class _RunningCall:
    """A method call as its method sees it (``runtime.context.running_method_call``): the
    tries its caller charged it before this delivery, and the notice that it runs again
    after an exception (Ray's ``retry_exceptions``, one budget with its crashes)."""

    __slots__ = ("inst", "call_id", "tries")

    def __init__(self, inst: HostedCalls, call_id: str) -> None:
        self.inst, self.call_id = inst, call_id
        self.tries = inst.tries.get(call_id, 0)

    def retried(self) -> None:
        """Tell the caller (:class:`P.CallRetried`), before the rerun starts."""
        peer = self.inst.pending.get(self.call_id)
        if peer is not None:
            peer.reply(P.CallRetried.wire(self.call_id))


def _running_call() -> _RunningCall | None:
    call_id = _running_call_id()
    rt = _rtctx.installed_runtime()
    agent = getattr(rt, "agent", None) if call_id is not None else None
    inst = agent.instances.get(_rtctx.current_owner()) if agent is not None else None
    if inst is None or call_id not in inst.pending:
        return None
    return _RunningCall(inst, call_id)


_rtctx.method_call_probe = _running_call


class HostedInstance(HostedCalls):
    """See module docstring.  The decisions (``call``, ``cancel_call``, ``stop``, which call
    runs and how it is answered) are :class:`HostedCalls`'s; this class is its edge."""

    def __init__(self, agent: Any, spec: dict, deps: list) -> None:
        is_async = bool(spec.get("is_async"))
        self.concurrency = spec.get("concurrency") or (1000 if is_async else 1)
        HostedCalls.__init__(self, self.concurrency)
        self.agent = agent
        self.spec = spec
        self.instance_id: str = spec["instance_id"]
        self.cls_name: str = spec["cls_name"]
        self.obj: Any = None
        self.borrowed: dict[str, list] = {}  # call id -> refs its arguments lent (TaskDone.refs)
        self.running_async: dict[str, tuple] = {}  # call id -> (loop, task) of async calls
        self._names: dict[str, str] = {}  # method -> its name in Dask's panels
        # Dask's Task Stream, Progress and Profile (worker/dask_panels.py); none in a child
        self.recorder = getattr(agent, "recorder", None)
        # a sync instance's calls take a share of the worker's threads (worker/share.py)
        share = getattr(agent, "share", None)
        self.share = share if share is not None and share.wired and not spec.get(
            "is_async") else None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.mailbox: queue.SimpleQueue | None = None
        self.pool: ThreadPoolExecutor | None = None
        self.side_loop: asyncio.AbstractEventLoop | None = None
        # 2 whole CPUs or more: the process's threads follow them for the instance's life,
        # and each of its threads takes them for OpenMP (worker/threads.py)
        self.cpus = instance_cpus(spec)
        if self.cpus:
            THREAD_LIMITS.hold(self.cpus)
        if is_async:
            self._start_loop()
        elif self.concurrency == 1:
            self.mailbox = queue.SimpleQueue()
            threading.Thread(target=self._serve_mailbox, daemon=True,
                             name=f"yr-instance-{self.instance_id}").start()
        else:
            self.pool = ThreadPoolExecutor(self.concurrency,
                                           thread_name_prefix=f"yr-instance-{self.instance_id}")
        self._submit(self._construct, deps)

    # -- executors -------------------------------------------------------------------------

    def _start_loop(self, side: bool = False) -> None:
        ready = threading.Event()

        def run() -> None:
            loop = asyncio.new_event_loop()
            asyncio.set_event_loop(loop)
            if side:
                self.side_loop = loop
            else:
                self.loop = loop
            loop.call_soon(ready.set)
            # what runs on this loop is the instance's, the asyncio tasks its methods start
            # in the background too (their nested calls, exit_actor())
            with self._context():
                loop.run_forever()
            loop.close()

        threading.Thread(target=run, daemon=True, name=f"yr-instance-{self.instance_id}"
                         + ("-side" if side else "")).start()
        ready.wait()

    def _start_side(self, item: tuple) -> None:
        """Start a call of an ``off_loop`` method from the side loop (its own executor bounds
        how many run at once)."""
        async def run() -> None:
            result = self._run_call(*item)
            if inspect.iscoroutine(result):
                await result

        loop = self.side_loop
        try:
            loop.call_soon_threadsafe(lambda: loop.create_task(run()))
        except RuntimeError:  # the side loop closed meanwhile: stop() answers
            pass

    def _serve_mailbox(self) -> None:
        # this thread runs this instance's code only: its task context is set once here
        # (_run_call skips the per-call ``with``)
        _rtctx._ctx.lease_id = _rtctx._ctx.owner = self.instance_id
        get = self.mailbox.get
        construct = get()  # the first job is __init__; every later one a call to chain
        if construct is _STOP:
            return
        self._run_job(*construct)
        while True:
            item = get()
            if item is _STOP:
                return
            self._chain(item)

    def _run_job(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run a call (or ``__init__``) in this thread under a share of the worker."""
        share = self.share
        if share is None:
            return fn(*args)
        share.call_start()
        try:
            return fn(*args)
        finally:
            share.call_end()

    def _submit(self, fn: Callable[..., Any], *args: Any) -> None:
        """Hand ``fn(*args)`` to the executor (on an event loop: run it there, not awaited)."""
        if self.mailbox is not None:
            self.mailbox.put((fn, *args))
        elif self.pool is not None:
            self.pool.submit(self._run_job, fn, *args)
        else:
            self.loop.call_soon_threadsafe(fn, *args)

    def _start(self, item: tuple) -> None:
        """Run call ``item`` (``(peer, msg)``) that the queue started, then the ones it
        starts in its place, unless the instance has stopped (its pool or loop is gone;
        stop() has answered the calls)."""
        try:
            if self.mailbox is not None:
                self.mailbox.put(item)  # _serve_mailbox chains it
            elif self.pool is not None:
                self.pool.submit(self._chain, item)
            else:
                self.loop.call_soon_threadsafe(self._chain_async, item)
        except RuntimeError:  # the pool shut down or the loop closed meanwhile: stop() answers
            pass

    def _chain(self, item: tuple | None) -> None:
        """Run ``item`` and the calls the queue starts in its place, under one share of the
        worker while no Dask task waits for a thread (a run of calls then takes and frees
        it once, not per call); with Dask tasks about, each call takes its turn again."""
        share = self.share
        if share is None:
            while item is not None:
                try:
                    self._run_call(*item)
                finally:
                    item = self.finished()
            return
        turn = False  # whether this thread holds its share now
        try:
            while item is not None:
                try:
                    if turn and share.dask:  # a Dask task may wait: it gets its turn
                        turn = False
                        share.call_end()
                    if not turn:
                        share.call_start()
                        turn = True
                    self._run_call(*item)
                finally:
                    item = self.finished()
        finally:
            if turn:
                share.call_end()

    def _chain_async(self, item: tuple) -> None:
        async def chain(item: tuple | None) -> None:
            while item is not None:
                try:
                    result = self._run_call(*item)
                    if inspect.iscoroutine(result):
                        await result
                finally:
                    item = self.finished()
                if item is not None:
                    # the loop first runs what the call just woke (a coroutine it set an
                    # Event for), as Ray's, where each call starts as a task of its own:
                    # Ray's batching example (max_concurrency=2, a shared Event) deadlocks
                    # if the next call runs before the woken one resumes
                    await asyncio.sleep(0)

        self.loop.create_task(chain(item))

    # -- construction and calls ------------------------------------------------------------

    def _context(self) -> task_context:
        return task_context(self.instance_id, self.instance_id)

    def _construct(self, deps: list) -> Any:
        """``__init__`` with the creation arguments, or the last checkpoint on a restart."""
        off_loop: frozenset = frozenset()  # methods started from side_loop (see above)
        rec = self.recorder if self.spec.get("events", True) else None
        name = f"{self.cls_name}.__init__"
        key_id = self.instance_id.replace("-", "_")  # Dask's key_split stops at "i-"
        start = rec.begin(name, key_id) if rec is not None else 0.0
        try:
            cls = loads(self.spec["cls"])
            names = getattr(cls, "__yr_off_loop__", None)
            if names and self.loop is not None:
                self._start_loop(side=True)
                off_loop = frozenset(names)
            checkpoint = self.spec.get("checkpoint")
            if self.cpus:
                THREAD_LIMITS.in_thread(self.cpus)
            with self._context():
                if checkpoint is not None:
                    self.obj = loads(checkpoint)
                else:
                    args, kwargs = unpack_args(
                        self.spec["args"],
                        [self.agent.load_value(p) for p in self.agent.payloads(deps)])
                    if self.loop is not None and inspect.iscoroutinefunction(cls.__init__):
                        # ``async def __init__``: awaited on the instance's loop (this
                        # thread runs it) before any call starts
                        self.obj = cls.__new__(cls)
                        self.loop.create_task(self._await_init(
                            cls.__init__(self.obj, *args, **kwargs),
                            lambda: self._constructed(rec, name, key_id, start, off_loop)))
                        return
                    self.obj = cls(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001 - every call will report it
            if type(e) is SystemExit:  # the exit rules of a method apply to __init__ too
                self.system_exit(e)
            self.init_error = dumps(RemoteError.from_exception(e, user_traceback()))
        self._constructed(rec, name, key_id, start, off_loop)

    async def _await_init(self, init: Any, then: Callable[[], None]) -> None:
        try:
            with self._context():
                await init
        except BaseException as e:  # noqa: BLE001 - every call will report it
            if type(e) is SystemExit:  # off the instance's loop: the stop needs it
                await asyncio.get_running_loop().run_in_executor(None, self.system_exit, e)
            self.init_error = dumps(RemoteError.from_exception(e, user_traceback()))
        then()

    def _constructed(self, rec: Any, name: str, key_id: str, start: float,
                     off_loop: frozenset) -> None:
        if rec is not None:
            rec.end(name, key_id, start, self.init_error is None)
        self.constructed(off_loop)  # the early off-loop calls leave the queue, the others start
        self.agent.report_state(self.instance_id, "ALIVE", self.init_error)

    def _run_call(self, peer: Any, msg: dict) -> Any:
        call_id = msg["task_id"]
        if not self.runs(call_id):  # stopped, __init__ failed or cancelled: answered
            return None
        # Dask's Task Stream, Progress and Profile; none without task events (P.CallMethod)
        rec = self.recorder if msg.get("events", True) else None
        if rec is not None:
            name = self._names.get(msg["method"])
            if name is None:
                name = self._names[msg["method"]] = f"{self.cls_name}.{msg['method']}"
            start = rec.begin(name, call_id)
        try:
            (args, kwargs), borrowed = self.agent.unpack_call(msg)
            if borrowed:  # reported with the answer (TaskDone.refs)
                self.borrowed[call_id] = borrowed
            fn = getattr(self.obj, msg["method"])
            if not callable(fn):  # a value the object holds under a method's name: the
                fn = getattr(type(self.obj), msg["method"]).__get__(self.obj)  # class's (Ray)
            _running.call = call_id
            if self.cpus:
                THREAD_LIMITS.in_thread(self.cpus)
            try:
                if self.mailbox is not None:  # its own thread: in the instance's context
                    result = fn(*args, **kwargs)
                else:
                    with self._context():
                        result = fn(*args, **kwargs)
            finally:
                _running.call = None
        except BaseException as e:  # noqa: BLE001 - reported to the caller
            if rec is not None:
                rec.end(name, call_id, start, False)
            if type(e) is SystemExit:
                self.system_exit(e)
            return self._answer_error(call_id, e)
        if msg["nret"] < 0:  # P.STREAMING: a generator method sends each item as it comes
            out = self._stream(peer, call_id, result)
            if rec is not None:
                rec.end(name, call_id, start, True)
            return out
        if self.loop is not None and inspect.iscoroutine(result):
            # an ``async def`` method: finish it on the instance's loop.  Only coroutines:
            # other awaitables a method returns (an ObjectRef, a future) are its value.
            if rec is not None:  # recorded up to its first await (the loop runs many)
                rec.end(name, call_id, start, True)
            return self._finish_async(call_id, result, msg["nret"])
        if self.cancelled and call_id in self.cancelled:
            self._answer_cancelled(call_id)  # Ray: a cancelled sync call's value is dropped
        else:
            self._answer_result(call_id, result, msg["nret"])
        if rec is not None:
            rec.end(name, call_id, start, True)
        return None

    def system_exit(self, e: SystemExit) -> None:
        """``sys.exit()`` in a method (the exit rules, docs/isolation.md#exit-rules): code 0
        or none is an intended exit, which ends the instance without a restart, as
        ``yr.exit()`` does (its calls then fail with ``InstanceDiedError``); another code
        ends a process instance's process, a crash that the restart rules handle.  A light
        instance shares its process, so there the exit is only the call's error."""
        code = e.code
        if code is None or code == 0:
            try:
                self.agent.runtime.scheduler_call(P.KILL_INSTANCE, instance_id=self.instance_id,
                                                  reason="exited by sys.exit()")
            except Exception:  # noqa: BLE001 - no scheduler: the call reports the exit
                pass
        elif getattr(self.agent, "own_process", False):
            if not isinstance(code, int):  # sys.exit("message"): Python prints it, code 1
                print(code, file=sys.stderr, flush=True)
                code = 1
            os._exit(code)

    def _stream(self, peer: Any, call_id: str, gen: Any) -> Any:
        """Run a generator method to its end (an async one on the loop), then answer the count."""
        send = self.agent.item_sender(peer, call_id)

        def emit(index: int, value: Any) -> None:
            if self.stopped is not None:  # the call was answered already: stop producing
                raise InstanceDiedError(f"instance {self.instance_id} has ended: {self.stopped}")
            send(index, value)

        if inspect.isasyncgen(gen):
            return self._stream_async(call_id, gen, emit)
        try:
            with self._context():
                count = drain(gen, emit)
        except BaseException as e:  # noqa: BLE001 - reported to the caller
            return self._answer_error(call_id, e)
        self._answer_result(call_id, count, 1)
        return None

    async def _stream_async(self, call_id: str, agen: Any, emit: Callable) -> None:
        try:
            with self._context():
                count = await drain_async(agen, emit)
        except BaseException as e:  # noqa: BLE001 - reported to the caller
            return self._answer_error(call_id, e)
        self._answer_result(call_id, count, 1)

    async def _finish_async(self, call_id: str, awaitable: Any, nret: int) -> None:
        self.running_async[call_id] = (asyncio.get_running_loop(), asyncio.current_task())
        token = _async_call.set(call_id)
        try:
            with self._context():
                result = await awaitable
        except asyncio.CancelledError as e:  # cancel_call's, unless the method ignored it
            if call_id in self.cancelled:
                return self._answer_cancelled(call_id)
            return self._answer_error(call_id, e)
        except BaseException as e:  # noqa: BLE001 - reported to the caller
            if type(e) is SystemExit:  # off the instance's loop: the stop needs it
                await asyncio.get_running_loop().run_in_executor(None, self.system_exit, e)
            return self._answer_error(call_id, e)
        finally:
            _async_call.reset(token)
            self.running_async.pop(call_id, None)
        self._answer_result(call_id, result, nret)

    def _interrupt(self, call_id: str) -> None:
        """A cancel (:meth:`HostedCalls.cancel_call`): a running ``async def`` call gets
        ``asyncio.CancelledError`` at its ``await``, a running sync one goes on
        (``is_canceled()`` says so)."""
        running = self.running_async.get(call_id)
        if running is not None:
            loop, task = running
            try:
                loop.call_soon_threadsafe(task.cancel)
            except RuntimeError:  # its loop has closed: the instance stopped
                pass

    def _answer_init_error(self, call_id: str) -> None:
        self._answer(P.TaskDone(call_id, error=self.init_error))

    def _answer_cancelled(self, call_id: str) -> None:
        self._answer_error(call_id, call_cancelled(call_id))

    def running_call_cancelled(self) -> bool:
        """Whether the sync method call the current thread runs has been cancelled."""
        call_id = getattr(_running, "call", None)
        return call_id is not None and call_id in self.cancelled

    def _answer_result(self, call_id: str, result: Any, nret: int) -> None:
        peer = self.pending.get(call_id)
        try:
            results, nested = self.agent.pack_results(
                call_id, result, nret, getattr(peer, "caller", None))
        except BaseException as e:  # noqa: BLE001
            return self._answer_error(call_id, e)
        borrowed = self.borrowed.pop(call_id, None) if self.borrowed else None
        refs = self.agent.refs_report(borrowed, nested) if borrowed or nested else None
        peer = self.answered(call_id)  # _answer, without the message object
        if peer is not None:
            peer.reply(P.TaskDone.wire(call_id, results=results, refs=refs))

    def _answer_error(self, call_id: str, exc: BaseException) -> None:
        self._answer(P.TaskDone(
            call_id, error=dumps(RemoteError.from_exception(exc, user_traceback())),
            refs=self.agent.refs_report(self.borrowed.pop(call_id, None), None)))

    def _answer(self, done: P.TaskDone) -> None:
        peer = self.answered(done.task_id)
        if peer is not None:
            peer.reply(done.to_msg())

    def _answer_died(self, peer: Any, call_id: str) -> None:
        err = InstanceDiedError(
            f"instance {self.instance_id} ({self.cls_name}) has ended: {self.stopped}")
        peer.reply(P.TaskDone(call_id, error=dumps(RemoteError.from_exception(err, ""))).to_msg())

    # -- stopping --------------------------------------------------------------------------

    def stop(self, reason: str) -> None:
        """Fail the calls not answered yet and let the executor go."""
        if not HostedCalls.stop(self, reason):  # answers the calls; nothing starts any more
            return
        if self.mailbox is not None:
            self.mailbox.put(_STOP)
        elif self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)
        elif self.loop is not None:
            self.loop.call_soon_threadsafe(self.loop.stop)
        if self.side_loop is not None:
            self.side_loop.call_soon_threadsafe(self.side_loop.stop)
        self.obj = None
        if self.cpus:
            THREAD_LIMITS.release(self.cpus)

    async def run_shutdown_hook(self, obj: Any) -> None:
        """``obj.__yr_shutdown__(grace)`` if its class defines one (yr's graceful shutdown).

        It runs in its own thread (it may use the yr API, e.g. ``yr.kv_write``) and is waited
        for at most ``grace`` s (``spec["grace_s"]``, default 30); then the stop goes on.
        """
        import logging

        hook = getattr(type(obj), "__yr_shutdown__", None) if obj is not None else None
        if hook is None or self.init_error is not None:
            return
        grace = int(self.spec.get("grace_s", 30))
        log = logging.getLogger("yrdask.worker")
        loop = asyncio.get_running_loop()
        done = loop.create_future()

        def finished() -> None:
            if not done.done():
                done.set_result(None)

        def run() -> None:
            try:
                with task_context(None, self.instance_id):  # holds no slot: nothing to lend
                    result = obj.__yr_shutdown__(grace)
                    if inspect.iscoroutine(result):
                        asyncio.run(result)
            except BaseException:  # noqa: BLE001 - the stop goes on regardless
                log.warning("__yr_shutdown__ of instance %s (%s) raised", self.instance_id,
                            self.cls_name, exc_info=True)
            finally:
                try:
                    loop.call_soon_threadsafe(finished)
                except RuntimeError:  # the worker's loop is gone
                    pass

        threading.Thread(target=run, daemon=True,
                         name=f"yr-shutdown-{self.instance_id}").start()
        try:
            await asyncio.wait_for(done, grace)
        except asyncio.TimeoutError:
            log.warning("__yr_shutdown__ of instance %s (%s) did not return within its grace "
                        "period of %d s; the instance is stopped anyway", self.instance_id,
                        self.cls_name, grace)


DRAIN_POLL_S = 0.005  # how often a draining instance is checked for calls still running


def drained(inst: HostedInstance) -> bool:
    """A hosted instance is built and has no call left to answer: its state can be taken
    for a move.  (``running``: a call leaves the queue after its answer was handed to the
    loop, so the answers of the calls it ran go out before any "moved" answer of the calls
    held.)"""
    if inst.init_error is not None:
        return True
    return inst.obj is not None and not inst.pending and inst.queue.running == 0


async def drain_hosted(side: Any, instance_id: str, timeout_s: float) -> bytes | None:
    """:class:`P.DrainInstance` for an instance hosted in this process (a worker's, or a
    process instance's own process): hold its new calls (``side``, the
    :class:`~yrdask.worker.instance_side.InstanceSide`), wait until the calls it has are
    answered, then pickle its current state (``None``: not within ``timeout_s``, not hosted
    here, or its ``__init__`` failed)."""
    from yrdask.runtime.context import checkpoint

    inst = side.hold(instance_id)
    if inst is None:
        return None
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not drained(inst):
        if loop.time() > deadline or inst.stopped is not None:
            return None
        await asyncio.sleep(DRAIN_POLL_S)
    if inst.init_error is not None:
        return None
    try:
        return await loop.run_in_executor(None, checkpoint, inst.obj)
    except Exception:  # noqa: BLE001 - the state does not pickle: it stays here
        logger.warning(
            "instance %s: its state could not be taken for a move", instance_id,
            exc_info=True)
        return None


class SideEdge:
    """The answers :class:`~yrdask.worker.instance_side.InstanceSide` gives callers where
    instances are hosted (a worker, or a process instance's own process); ``host`` builds
    the instance of a ``START`` (``host(spec, running)``)."""

    __slots__ = ("host",)

    def __init__(self, host: Callable[[dict, Any], Any]) -> None:
        self.host = host

    def died(self, peer: Any, msg: dict, why: str) -> None:
        err = InstanceDiedError(f"instance {msg['instance_id']} has ended: {why}")
        peer.reply(P.TaskDone(msg["task_id"], error=dumps(RemoteError.from_exception(err, "")),
                              retryable=False).to_msg())

    def ignored_start(self, instance_id: str) -> None:
        logger.info(
            "not starting instance %s: it was stopped before it started", instance_id)

    def moved_away(self, peer: Any, msg: dict, to: str) -> None:
        err = InstanceMovedError(f"instance {msg['instance_id']} moved to {to}", to)
        peer.reply(P.TaskDone(msg["task_id"], error=dumps(err)).to_msg())
