"""The agent's side of one isolated instance (:class:`IsolatedInstance`, the same surface
as ``HostedInstance``): it starts the instance's process (forked by the :mod:`.zygote`),
forwards the calls to it on one call channel, keeps large results in the worker's store
(:func:`keep_large`), watches the process and, when it dies, lets the scheduler's
``Lifecycle`` decide on a restart.  What is decided (pending, waiting, died, restart, crash
charge) is :class:`~yrdask.worker.isolated_calls.IsolatedCalls`; this module does the I/O.
"""
from __future__ import annotations

import asyncio
import logging
import subprocess
import threading
from typing import Any

import dask

from yrdask import protocol as P
from yrdask.errors import CallCrashedError, CancelledError, InstanceDiedError, RemoteError
from yrdask.serialization import Frames, dumps, loads
from yrdask.worker import isolated_calls as IC
from yrdask.worker.isolated import START_TIMEOUT_S
from yrdask.worker.isolated.zygote import child_info, describe_exit_of, kill_child, spawn

logger = logging.getLogger("yrdask.worker")

READ_AFTER_EXIT_S = 2.0  # a dead child's answers still in its channel are read this long


class IsolatedInstance:
    """The agent's side of one isolated instance (same surface as ``HostedInstance``)."""

    def __init__(self, agent: Any, spec: dict) -> None:
        self.agent = agent
        self.spec = spec
        self.instance_id: str = spec["instance_id"]
        self.cls_name: str = spec["cls_name"]
        # what is decided (pending, waiting, died, restart, crash charge): items (peer, msg)
        self.decide = IC.IsolatedCalls(
            self.instance_id, spec.get("concurrency") or (1000 if spec.get("is_async") else 1),
            int(spec.get("incarnation") or 0))
        self.calls_done = 0
        # the methods' own bounds of redelivery after a crash, where the class sets them
        # (the Ray surface's max_task_retries; a call's .options() override is its caller's)
        self.redeliveries: dict[str, int] = (loads(spec["meta"]).get("redeliveries") or {}
                                             if spec.get("meta") else {})
        self.proc: subprocess.Popen | None = None
        self.comm: Any = None
        self.stream: Any = None
        self.init_error: bytes | None = None
        self.address: str | None = None
        self._stopping: asyncio.Task | None = None
        self._reader: asyncio.Task | None = None  # reads the current child's answers
        self.cause: str | None = None  # how the last child died
        self.generation = 0
        agent.loop.create_task(self._start(report=True))

    @property
    def stopped(self) -> str | None:
        return self.decide.stopped

    @property
    def restarts(self) -> int:
        """The restarts the scheduler granted (its incarnation)."""
        return self.decide.incarnation

    @property
    def pending(self) -> dict:
        return self.decide.pending

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    async def _start(self, report: bool) -> None:
        """Start a child, build the instance in it, then forward the calls that waited."""
        from distributed.comm import connect

        from yrdask.stream import StreamSender

        self.generation += 1
        gen = self.generation
        loop = self.agent.loop
        try:
            spec = dict(self.spec)
            if spec.get("deps"):
                spec["deps"] = await loop.run_in_executor(None, self.agent.deps_by_value,
                                                          spec["deps"])
            proc, address = await loop.run_in_executor(None, spawn, spec["isolation"],
                                                       child_info(self.agent))
            if self.stopped is not None:
                kill_child(proc)
                return
            self.proc, self.address = proc, address
            threading.Thread(target=self._watch, args=(proc, gen), daemon=True,
                             name=f"yr-isolated-watch-{self.instance_id}").start()
            comm = await connect(address)
            await comm.write(P.StartIsolated(spec).to_msg())
            reply = await asyncio.wait_for(comm.read(), START_TIMEOUT_S)
            if isinstance(reply, dict):  # the child's Server reports its own failure
                raise RuntimeError(f"the isolated process could not build the instance: "
                                   f"{reply.get('text') or reply!r}")
            self.init_error = reply
            await comm.close()
            comm = await connect(address)
            await comm.write(P.OpenChannel(self.agent.worker.address).to_msg())
        except BaseException as e:  # noqa: BLE001 - every call reports it
            if self.stopped is not None or gen != self.generation:
                return
            if self.proc is not None:
                # The child died in __init__ (or cannot be reached): make sure it is gone;
                # the watcher then applies the restart rules with its exit status.
                kill_child(self.proc)
                return
            self.init_error = dumps(RemoteError.from_exception(e, ""))
            if report:
                self.agent.report_state(self.instance_id, "ALIVE", self.init_error)
            for _cid, (peer, msg) in self.decide.start_failed_now():
                self._fail_init(peer, msg)
            return
        if self.stopped is not None or gen != self.generation:
            comm.abort()
            return
        self.comm, self.stream = comm, StreamSender(comm)
        if report:
            self.agent.report_state(self.instance_id, "ALIVE", self.init_error)
        self._reader = loop.create_task(self._read(comm, gen))
        for _cid, (peer, msg) in self.decide.connect():
            self._forward(peer, msg)

    def _fail_init(self, peer: Any, msg: dict) -> None:
        peer.reply(P.TaskDone(msg["task_id"], error=self.init_error).to_msg())

    def call(self, peer: Any, msg: dict) -> None:
        """``CALL_METHOD`` for this instance (loop thread): forward it, or queue it."""
        what = self.decide.arrived(msg["task_id"], (peer, msg))
        if what is IC.FORWARD:
            self._forward(peer, msg)
        elif what is IC.ENDED:
            self._answer_died(peer, msg["task_id"], self.decide.stopped or "")
        elif what is IC.START_FAILED:
            self._fail_init(peer, msg)

    def cancel_call(self, call_id: str) -> bool:
        """Ray's cancel of an actor task: a call the child has goes on to it (it answers
        as an in-process instance does), one that waits for the child is answered unrun;
        False if ``call_id`` is no call of this instance waiting for its answer."""
        from distributed.comm.core import CommClosedError

        if call_id in self.decide.pending:
            if self.stream is not None:
                try:
                    self.stream.send(P.CancelTask(call_id).to_msg())
                except CommClosedError:
                    pass  # the child died: its restart runs the call, cancelled or not
            return True
        item = self.decide.cancel_waiting(call_id)
        if item is None:
            return False
        _answer_error(item[0], call_id, CancelledError(f"Task: {call_id} was cancelled."))
        return True

    def _forward(self, peer: Any, msg: dict) -> None:
        from distributed.comm.core import CommClosedError

        caller = getattr(peer, "caller", None)
        if caller:  # refs nested in the results are lent to the caller (CallMethod.caller)
            msg["caller"] = caller
        try:
            self.stream.send(msg)
        except CommClosedError:
            pass  # the child died: the call stays pending, its restart gets it again

    async def _read(self, comm: Any, gen: int) -> None:
        from distributed.comm.core import CommClosedError

        try:
            while True:
                msgs = await comm.read()
                for msg in msgs if isinstance(msgs, (list, tuple)) else (msgs,):
                    op = msg.get("op")
                    if op == P.TASK_DONE:
                        self._done(msg)
                    elif op == P.GENERATOR_ITEM:
                        self._item(msg)
        except (CommClosedError, OSError):
            pass  # the watcher reports the exit

    def _done(self, msg: dict) -> None:
        entry = self.decide.answered(msg["task_id"])
        if entry is None:
            return
        peer, _call = entry
        results = msg.get("results")
        if results is not None:
            msg["results"] = self._keep_large(msg["task_id"], results)
        self.calls_done += 1
        peer.reply(msg)

    def _item(self, msg: dict) -> None:
        """One value of a generator method: kept like a result, passed on at once."""
        entry = self.decide.pending.get(msg["task_id"])
        if entry is not None:
            oid = f"{msg['task_id']}.{msg['index']}"
            msg["result"] = keep_large(self.agent, oid, [msg["result"]])[0]
            entry[0].reply(msg)

    def _keep_large(self, call_id: str, results: list) -> list:
        return keep_large(self.agent, call_id, results)

    def _watch(self, proc: subprocess.Popen, gen: int) -> None:
        code = proc.wait()
        try:
            self.agent.loop.call_soon_threadsafe(self._exited, proc, code, gen)
        except RuntimeError:  # the loop is closed: the worker is gone
            pass

    def _exited(self, proc: subprocess.Popen, code: int, gen: int) -> None:
        """The child died (loop thread): once the answers it sent before it died are read
        (so the calls still pending are the ones it had not answered), the scheduler
        decides whether it restarts."""
        if self.stopped is not None or gen != self.generation:
            return
        reader = self._reader
        if reader is not None and not reader.done():
            self.agent.loop.create_task(self._exited_after(reader, proc, code, gen))
            return
        self._died(proc, code, gen)

    async def _exited_after(self, reader: asyncio.Task, proc: subprocess.Popen, code: int,
                            gen: int) -> None:
        await asyncio.wait({reader}, timeout=READ_AFTER_EXIT_S)
        self._died(proc, code, gen)

    def _died(self, proc: subprocess.Popen, code: int, gen: int) -> None:
        if self.stopped is not None or gen != self.generation:
            return
        cause = describe_exit_of(proc.pid, code)
        logger.warning("instance %s (%s): %s", self.instance_id, self.cls_name, cause)
        if self.comm is not None:
            self.comm.abort()
        self.comm = self.stream = None
        self._reader = None
        self.proc = None
        self.init_error = None
        self.cause = cause
        # The scheduler's Lifecycle decides (one budget per instance): a START_INSTANCE
        # back here restarts it (:meth:`restart`), a stop ends it.  Calls wait meanwhile.
        if self.decide.child_died(cause):
            self.agent.report_state(self.instance_id, P.RESTARTING, None, cause,
                                    self.decide.incarnation)

    def restart(self, spec: dict) -> None:
        """``START_INSTANCE`` again for this instance after its child died: the scheduler
        granted restart ``spec["incarnation"]``.  The unanswered calls go again in order,
        but those that may have been running are charged a crash
        (:meth:`IsolatedCalls.restart <yrdask.worker.isolated_calls.IsolatedCalls.restart>`)."""
        cause = self.decide.died
        bound = int(dask.config.get("yrdask.scheduling.max-call-redeliveries", 1))
        own = self.redeliveries  # a method's own bound (Ray's max_task_retries)

        def own_bound(msg: dict) -> int | None:  # the call's, else its method's
            n = msg.get("redeliveries")
            return own.get(msg["method"]) if n is None else n

        decided = self.decide.restart(
            int(spec.get("incarnation") or 0),
            lambda item: bound if (n := own_bound(item[1])) is None else n)
        if decided is None:
            logger.info("instance %s: ignoring a START_INSTANCE (its process is running)",
                        self.instance_id)
            return
        for cid, (peer, msg), n in decided[1]:
            method = msg["method"]
            mine = own_bound(msg)
            why = (f"its own bound: {mine}" if mine is not None
                   else f"yrdask.scheduling.max-call-redeliveries={bound}")
            err = CallCrashedError(
                f"method {method!r}: call {cid} on instance {self.instance_id} "
                f"may have been running when the instance's process died, {n} times (last: "
                f"{cause}); it is not delivered again ({why}): it may be what kills the "
                "process")
            _answer_error(peer, cid, err)
        # the new child is this restart (Ray's was_current_actor_reconstructed), from the
        # checkpoint the scheduler sent with it
        self.spec = {**self.spec, "incarnation": spec.get("incarnation"),
                     "checkpoint": spec.get("checkpoint")}
        self.agent.loop.create_task(self._start(report=True))

    def _answer_died(self, peer: Any, call_id: str, reason: str) -> None:
        _answer_error(peer, call_id, InstanceDiedError(
            f"instance {self.instance_id} ({self.cls_name}) has ended: {reason}"))

    def stop(self, reason: str) -> None:
        """Fail the calls not answered yet; the child runs ``__yr_shutdown__`` and is killed
        (no restart).  :meth:`run_shutdown_hook` waits for that."""
        if self.stopped is not None:
            return
        for _cid, (peer, msg) in self.decide.stop(reason):
            self._answer_died(peer, msg["task_id"], reason)
        self._stopping = self.agent.loop.create_task(self._shutdown(reason))

    async def _shutdown(self, reason: str) -> None:
        from distributed.comm import connect

        proc, address = self.proc, self.address
        try:
            if proc is not None and address is not None and self.stream is not None:
                grace = int(self.spec.get("grace_s", 30))
                comm = await connect(address)
                try:
                    await comm.write(P.StopIsolated(reason).to_msg())
                    await asyncio.wait_for(comm.read(), grace + 5)
                finally:
                    comm.abort()
        except Exception:  # noqa: BLE001 - the process goes anyway
            logger.info("instance %s: no graceful stop of its isolated process",
                        self.instance_id, exc_info=True)
        finally:
            if self.comm is not None:
                self.comm.abort()
            self.comm = self.stream = None
            if proc is not None:
                kill_child(proc)

    async def checkpoint(self) -> bytes:
        """The instance's current state, pickled in its process (:class:`P.CheckpointIsolated`;
        a scale-down move takes it once no call runs)."""
        from distributed.comm import connect

        comm = await connect(self.address)
        try:
            await comm.write(P.CheckpointIsolated().to_msg())
            return await comm.read()
        finally:
            comm.abort()

    async def run_shutdown_hook(self, obj: Any) -> None:
        """Wait until the child ran ``__yr_shutdown__`` (bounded by its grace) and is gone."""
        if self._stopping is not None:
            await asyncio.shield(self._stopping)

    def crash(self) -> None:
        """``CRASH_INSTANCE`` (Ray's ``ray.kill(no_restart=False)``): SIGKILL the child; its
        watcher reports the death as any crash, and the scheduler restarts or ends it."""
        if self.stopped is None and self.proc is not None:
            kill_child(self.proc)

    def kill_now(self) -> None:
        """The worker closes: the child goes at once (no shutdown hook), and is reaped."""
        self.decide.stop(self.decide.stopped or "its worker closed")
        if self.proc is not None:
            kill_child(self.proc)
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL did not land
                logger.error("isolated process %s did not exit", self.proc.pid)


def _answer_error(peer: Any, call_id: str, err: BaseException) -> None:
    peer.reply(P.TaskDone(call_id, error=dumps(RemoteError.from_exception(err, ""))).to_msg())


def keep_large(agent: Any, call_id: str, results: list) -> list:
    """Large values a child wrote to the node's store (they outlive the child) are kept for
    their owner by this worker, as the values of in-process work are; small ones travel
    inline."""
    out = []
    ids = [call_id] if len(results) <= 1 else [f"{call_id}.{i}" for i in range(len(results))]
    for oid, (kind, payload) in zip(ids, results):
        if kind == P.STORED:  # the child wrote it to the node's store already
            agent.store[oid] = True
            out.append([P.LOCATION, agent.worker.address])
        elif kind == P.VALUE and (type(payload) is Frames or len(payload) > agent.inline_limit):
            agent.keep(oid, payload)
            out.append([P.LOCATION, agent.worker.address])
        else:
            out.append([kind, payload])
    return out
