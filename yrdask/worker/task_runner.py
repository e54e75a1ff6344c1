"""Task execution on a worker: pushed tasks run, answer and end, and their results are placed.

:class:`TaskRunner` is the task part of :class:`~yrdask.worker.agent.WorkerAgent` (which
mixes it in): ``RUN_TASK`` and ``CANCEL_TASK`` from the call channels, the task threads that
run a lease's tasks one after another (:meth:`TaskRunner._execute_gated`), the answers held
back while a thread runs the next task of its lease, the unpacking of arguments and the
packing of results (inline, or kept in the node's store).  What starts, waits or bounces is
decided by :class:`~yrdask.worker.task_side.TaskSide` and its lease gate; :class:`_AgentEdge`
is their I/O edge here.
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
from typing import TYPE_CHECKING, Any, Callable

from yrdask import protocol as P
from yrdask.errors import (CancelledError, RemoteError, ReturnError, TaskCrashedError,
                           YRValueError, user_traceback)
from yrdask.runtime.isolation import IsolatedFunction
from yrdask.runtime.generators import drain, item_sender
from yrdask.runtime.objects import REF_MARK, pack_counting, unpickling
from yrdask.runtime.store import node_store
from yrdask.serialization import (PLAIN_TYPES, Frames, dumps, dumps_value, loads, unpack_args,
                                  wire)
from yrdask.worker.channel_peers import Peer
from yrdask.worker.devices import device_isolation
from yrdask.worker.execution import Execution
from yrdask.worker.instance_side import call_children
from yrdask.worker.isolated.child import split_returns as _split_returns
from yrdask.worker.isolated.pool import ProcessDied
from yrdask.worker.isolated.supervisor import keep_large
from yrdask.worker.threads import LIMITS as THREAD_LIMITS, whole_cpus, with_cpus

if TYPE_CHECKING:
    from yrdask.worker.dask_panels import Recorder
    from yrdask.worker.instance_side import InstanceSide
    from yrdask.worker.isolated.pool import ProcessPool
    from yrdask.worker.task_side import TaskSide

logger = logging.getLogger("yrdask.worker")

# A pipelined task's plain answer waits at most this long while its thread runs the next
# task of its lease, so a run of short tasks answers in one write (_execute_gated).
HOLD_REPLY_S = 0.001


class TaskRunner:
    """Pushed tasks on a worker (part of :class:`~yrdask.worker.agent.WorkerAgent`; the
    attributes below are its)."""

    worker: Any  # the Dask worker
    loop: asyncio.AbstractEventLoop
    runtime: Any  # this process's Runtime
    executor: ThreadPoolExecutor  # the task threads
    share: Any  # WorkerShare: the worker's threads, shared with Dask's tasks
    recorder: "Recorder | None"
    pool: "ProcessPool"  # processes for isolated tasks
    task_side: "TaskSide"
    instance_side: "InstanceSide"
    running: dict[str, Execution]  # the task side's: their function runs now
    functions: dict[str, Callable]
    fn_payloads: dict[str, bytes]
    store: dict[str, bool]  # ids of large values this worker wrote
    inline_limit: int
    tasks_done: int
    replies_held: int
    _ending: "_Ending"
    # answers held back while their threads run the next task (_hold_reply); the loop
    # sends them at the end of the run, or HOLD_REPLY_S after the first at the latest
    _held: collections.deque
    _held_armed: bool
    _held_timer: asyncio.TimerHandle | None

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
        # Dask's Task Stream, Progress and Profile (dask_panels.py); none without task events
        rec = self.recorder if msg.get("events", True) else None
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
        rec = self.recorder if msg.get("events", True) else None
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


class _Ending(threading.local):
    """A task thread's hand-over slot: ``free`` while it ends a task, ``next`` the first
    task that end admitted (the thread runs it instead of waking another)."""

    free = False
    next: Execution | None = None


class _AgentEdge:
    """The task side's I/O edge in a worker: the agent's task threads, its peers and its
    event loop."""

    __slots__ = ("agent", "now", "_submit", "_run", "_ending")

    def __init__(self, agent: TaskRunner) -> None:
        self.agent = agent
        self.now = agent.loop.time  # the loop's clock, with no frame of ours per task
        self._submit = agent.executor.submit
        self._run = agent._execute_gated
        self._ending = agent._ending  # per task thread (see TaskRunner._execute_gated)

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
