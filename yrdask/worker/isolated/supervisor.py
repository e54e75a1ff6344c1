"""The agent's side of one process instance (:class:`IsolatedInstance`, in the agent's
table of instances next to ``HostedInstance``): it starts the instance's process (forked by
the :mod:`.zygote`), tells the scheduler where that process serves, watches it and, when it
dies, lets the scheduler's ``Lifecycle`` decide on a restart.  It carries no calls: callers
reach the process at its own endpoint (docs/isolation.md), and a caller that loses it
locates the instance again and delivers its calls again by its own ``CallOrder``.
"""
from __future__ import annotations

import asyncio
import functools
import logging
import subprocess
from typing import Any

from yrdask import protocol as P
from yrdask.errors import InstanceMovedError, RemoteError
from yrdask.serialization import Frames, dumps, loads
from yrdask.worker.isolated import START_TIMEOUT_S
from yrdask.worker.isolated.zygote import (ForkedProcess, child_info, describe_exit_of,
                                            kill_child, start_child)

logger = logging.getLogger("yrdask.worker")


class IsolatedInstance:
    """The agent's side of one process instance (see module docstring)."""


    def __init__(self, agent: Any, spec: dict) -> None:
        self.agent = agent
        self.spec = spec
        self.instance_id: str = spec["instance_id"]
        self.cls_name: str = spec["cls_name"]
        self.incarnation = int(spec.get("incarnation") or 0)  # the restart it runs
        self.proc: ForkedProcess | None = None
        self.address: str | None = None  # where its current process serves
        self.init_error: bytes | None = None
        self.stopped: str | None = None
        self.dead = False  # its process died; waiting for the scheduler's decision
        self.supervision: Any = None  # the comm its process lives by
        self._stopping: asyncio.Task | None = None
        self._kept = P.handlers(P.ISOLATED_TO_AGENT, self)
        # its requests on the supervision channel waiting for their answers (P.AgentRequest):
        # request id -> (the channel, the waiter)
        self._asked: dict[int, tuple[Any, asyncio.Future]] = {}
        self._last_request = 0
        self.generation = 0
        # the agent's load figures, as its process's CallRecords tell them
        self.calls_done = 0
        self.calls_pending = 0
        agent.loop.create_task(self._start())

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    async def _start(self) -> None:
        """Take a process (a spare the agent is connected to already) and build the instance
        in it (``StartIsolated``, sent behind its request); that comm then becomes the
        supervision channel, and the scheduler hears where the process serves
        (``INSTANCE_STATE`` ALIVE with its address)."""
        self.generation += 1
        gen = self.generation
        loop = self.agent.loop
        comm = proc = None
        try:
            spec = dict(self.spec)
            if spec.get("deps"):
                spec["deps"] = await loop.run_in_executor(None, self.agent.deps_by_value,
                                                          spec["deps"])
            proc, address, comm = await start_child(
                spec["isolation"], child_info(self.agent), self.agent.runtime.connection_args,
                then=P.StartIsolated(spec).to_msg())
            if self.stopped is not None:
                comm.abort()
                kill_child(proc)
                return
            self.proc, self.address, self.dead = proc, address, False
            proc.when_exited(functools.partial(self._exit_seen, proc, gen))
            reply = await asyncio.wait_for(comm.read(), START_TIMEOUT_S)
            if isinstance(reply, dict):  # the child's endpoint reports its own failure
                raise RuntimeError(f"the isolated process could not build the instance: "
                                   f"{reply.get('exception_text') or reply!r}")
            self.init_error = reply
            await comm.write(P.OpenChannel(self.agent.worker.address).to_msg())
        except BaseException as e:  # noqa: BLE001 - every call reports it
            if comm is not None:
                comm.abort()
            if self.stopped is not None or gen != self.generation:
                return
            if proc is not None:
                # The child died in __init__ (or cannot be reached): make sure it is gone;
                # the watcher then applies the restart rules with its exit status (it may
                # have done so already, and cleared self.proc, before this read failed).
                kill_child(proc)
                return
            # No process could start: the worker answers the calls with that error (the
            # scheduler sends them here, to the worker's own address).
            self.init_error = dumps(RemoteError.from_exception(e, ""))
            self.address = None
            self.agent.report_state(self.instance_id, "ALIVE", self.init_error,
                                    incarnation=self.incarnation)
            return
        if (gen != self.generation or self.proc is not proc  # it died meanwhile: told
                or (self.stopped is not None and not self._stop_under_way())):
            comm.abort()
            return
        self.supervision = comm
        loop.create_task(self._read(comm))
        if self.stopped is not None:
            # stopped while __init__ ran: that stop (on a connection of its own) closes the
            # channel once answered, not now, or the process would exit (open_channel) before
            # its shutdown hook and atexit handlers ran
            return
        self.agent.report_state(self.instance_id, "ALIVE", self.init_error,
                                incarnation=self.incarnation, address=address)

    async def _read(self, comm: Any) -> None:
        """What the process tells its agent (:data:`P.ISOLATED_TO_AGENT`); once the channel
        closes, the requests waiting on it fail."""
        from distributed.comm.core import CommClosedError

        try:
            while True:
                msgs = await comm.read()
                for msg in msgs if isinstance(msgs, (list, tuple)) else (msgs,):
                    P.dispatch(self._kept, msg)
        except (CommClosedError, OSError):
            pass  # the watcher reports the exit
        finally:
            for channel, waiter in list(self._asked.values()):
                if channel is comm and not waiter.done():
                    waiter.set_exception(CommClosedError(
                        f"the supervision channel of instance {self.instance_id} closed"))

    def agent_reply(self, request_id: int, result: Any = None,
                    error: bytes | None = None) -> None:
        """:class:`P.AgentReply`: the answer to one of :meth:`_ask`'s requests (one whose
        waiter gave up meanwhile is dropped)."""
        asked = self._asked.get(request_id)
        if asked is None or asked[1].done():
            return
        if error is None:
            asked[1].set_result(result)
        else:
            asked[1].set_exception(loads(error).to_exception())

    def call_records(self, records: list, running: dict, pending: int = 0,
                     done: int = 0) -> None:
        """:class:`P.CallRecords`: the process's calls, for Dask's panels and the agent's
        load report."""
        self.calls_done, self.calls_pending = done, pending
        rec = self.agent.recorder
        if rec is not None:
            rec.from_child(self.instance_id, records, running)

    def results_kept(self, object_ids: list) -> None:
        """:class:`P.ResultsKept`: large results the process wrote to the node's store are
        this worker's to keep for their owners (unless freed already)."""
        from yrdask.runtime.store import node_store

        store = node_store()
        for oid in object_ids:
            if store.contains(oid):
                self.agent.store[oid] = True

    def call(self, peer: Any, msg: dict) -> None:
        """``CALL_METHOD`` sent to the worker: only while no process could start (the
        scheduler then names the worker), answered with that error; else the caller had an
        old address and is sent to locate the instance again (unrun)."""
        if self.init_error is not None and self.address is None:
            peer.reply(P.TaskDone(msg["task_id"], error=self.init_error).to_msg())
            return
        err = InstanceMovedError(f"instance {self.instance_id} is served by its own process",
                                 self.address or "")
        peer.reply(P.TaskDone(msg["task_id"], error=dumps(err)).to_msg())

    def cancel_call(self, call_id: str) -> bool:
        """Its calls are never here (their callers cancel them at its process)."""
        return False

    def _exit_seen(self, proc: ForkedProcess, gen: int, code: int) -> None:
        """Its process exited (told in the zygote reader's thread): to the loop."""
        try:
            self.agent.loop.call_soon_threadsafe(self._died, proc, code, gen)
        except RuntimeError:  # the loop is closed: the worker is gone
            pass

    def _died(self, proc: ForkedProcess, code: int, gen: int) -> None:
        """The process died (loop thread): the scheduler decides whether it restarts (one
        budget per instance: a ``START_INSTANCE`` back here, :meth:`restart`, or a stop).
        Its callers lost their channels and locate it again."""
        if self.stopped is not None or gen != self.generation or self.dead:
            return
        if self.agent.recorder is not None:  # nothing of it runs any more
            self.agent.recorder.from_child(self.instance_id, [], None)
        cause = describe_exit_of(proc.pid, code)
        logger.warning("instance %s (%s): %s", self.instance_id, self.cls_name, cause)
        if self.supervision is not None:
            self.supervision.abort()
        address = self.address or ""
        self.supervision = self.proc = self.init_error = None
        self.dead = True
        self.agent.report_state(self.instance_id, P.RESTARTING, None, cause, self.incarnation,
                                address=address)

    def restart(self, spec: dict) -> None:
        """``START_INSTANCE`` again for this instance after its process died: the scheduler
        granted restart ``spec["incarnation"]``; a new process starts, from the checkpoint
        the scheduler sent with it (Ray's ``was_current_actor_reconstructed``)."""
        if self.stopped is not None or not self.dead:
            logger.info("instance %s: ignoring a START_INSTANCE (its process is running)",
                        self.instance_id)
            return
        self.dead = False  # restarting: a START_INSTANCE told twice starts no second one
        self.incarnation = max(int(spec.get("incarnation") or 0), self.incarnation + 1)
        self.spec = {**self.spec, "incarnation": spec.get("incarnation"),
                     "checkpoint": spec.get("checkpoint")}
        self.agent.loop.create_task(self._start())

    def stop(self, reason: str) -> None:
        """The instance ends (no restart): its process answers the calls it has, runs
        ``__yr_shutdown__`` and is killed.  :meth:`run_shutdown_hook` waits for that."""
        if self.stopped is not None:
            return
        self.stopped = reason
        self._stopping = self.agent.loop.create_task(self._shutdown(reason))

    def _stop_under_way(self) -> bool:
        return self._stopping is not None and not self._stopping.done()

    async def _shutdown(self, reason: str) -> None:
        proc = self.proc
        try:
            # also while its __init__ runs: an exit by intent there (exit_actor(),
            # sys.exit(0)) ends it, and its atexit handlers run.  Its supervision channel
            # does not exist yet then, and the stop cannot wait for it (that exit waits for
            # this stop), so it goes on a connection of its own (the process's StopIsolated
            # handler); else on the channel.
            if proc is not None and self.address is not None and not self.dead:
                grace = int(self.spec.get("grace_s", 30))
                ask = self._ask if self.supervision is not None else self._rpc
                await asyncio.wait_for(ask(P.StopIsolated(reason)), grace + 5)
        except Exception:  # noqa: BLE001 - the process goes anyway
            logger.info("instance %s: no graceful stop of its isolated process",
                        self.instance_id, exc_info=True)
        finally:
            if self.supervision is not None:
                self.supervision.abort()
            self.supervision = None
            if proc is not None:
                kill_child(proc)

    async def _ask(self, msg: P.Message) -> Any:
        """One request to the process on its supervision channel (:class:`P.AgentRequest`),
        settled by its :class:`P.AgentReply`: its reply, or it raises what the request
        raised there, or ``CommClosedError`` if the channel closes first."""
        from distributed.comm.core import CommClosedError

        comm = self.supervision
        if comm is None:
            raise CommClosedError(f"instance {self.instance_id} has no supervision channel")
        self._last_request += 1
        request_id = self._last_request
        waiter = self.agent.loop.create_future()
        self._asked[request_id] = (comm, waiter)
        try:
            await comm.write(P.AgentRequest(request_id, msg.to_msg()).to_msg())
            return await waiter
        finally:
            del self._asked[request_id]

    async def _rpc(self, msg: P.Message) -> Any:
        """One request to the process on a comm of its own (a stop while its ``__init__``
        runs: there is no supervision channel yet)."""
        from distributed.comm import connect

        comm = await connect(self.address, **self.agent.runtime.connection_args)
        try:
            await comm.write(msg.to_msg())
            return await comm.read()
        finally:
            comm.abort()

    async def drain(self, timeout_s: float) -> bytes | None:
        """:class:`P.DrainInstance` (scale-down), done by the process, which holds its
        callers' new calls and pickles the instance once no call runs."""
        if self.supervision is None or self.init_error is not None:
            return None
        try:
            return await asyncio.wait_for(
                self._ask(P.DrainInstance(self.instance_id, timeout_s)), timeout_s + 5)
        except Exception:  # noqa: BLE001 - it died meanwhile: it is not moved
            logger.info("instance %s: no drain of its process", self.instance_id,
                        exc_info=True)
            return None

    async def moved(self, to: str) -> None:
        """:class:`P.InstanceMoved`: the process answers its held calls (moved to ``to``:
        their callers locate the instance again) or lets them run (``to`` empty)."""
        if self.supervision is None:
            return
        try:
            await self._ask(P.InstanceMoved(self.instance_id, to))
        except Exception:  # noqa: BLE001 - it died meanwhile: its callers locate it again
            logger.info("instance %s: its process did not hear of the move",
                        self.instance_id, exc_info=True)

    async def run_shutdown_hook(self, obj: Any) -> None:
        """Wait until the child ran ``__yr_shutdown__`` (bounded by its grace) and is gone."""
        if self._stopping is not None:
            await asyncio.shield(self._stopping)

    def crash(self) -> None:
        """``CRASH_INSTANCE`` (Ray's ``ray.kill(no_restart=False)``): SIGKILL the child; its
        watcher reports the death as any crash, and the scheduler restarts or ends it."""
        if self.stopped is None and self.proc is not None:
            kill_child(self.proc)

    async def end_for_retirement(self) -> bool:
        """:class:`P.EndProcesses`: the worker retires and the instance restarts elsewhere
        once it is gone, so its process ends now, before the scheduler removes the worker
        (no call is answered from its old state meanwhile).  Its death is not reported (the
        worker's removal is the loss); it stays dead here, so a ``START_INSTANCE`` (the
        worker kept after all) starts it again.  True once a process of it has exited."""
        proc = self.proc
        if self.stopped is not None or proc is None or self.dead:
            return False
        self.generation += 1  # its watcher and a start under way report nothing
        self.dead = True
        if self.agent.recorder is not None:  # nothing of it runs any more
            self.agent.recorder.from_child(self.instance_id, [], None)
        if self.supervision is not None:
            self.supervision.abort()
        self.supervision = self.proc = self.init_error = None
        kill_child(proc)
        try:
            await self.agent.loop.run_in_executor(None, proc.wait, 5)
        except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL did not land
            logger.error("isolated process %s did not exit", proc.pid)
            return False
        return True

    def kill_now(self) -> None:
        """The worker closes (or the instance moved away): the child goes at once (no
        shutdown hook), and is reaped."""
        self.stopped = self.stopped or "its worker closed"
        if self.supervision is not None:
            self.supervision.abort()
            self.supervision = None
        if self.proc is not None:
            kill_child(self.proc)
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL did not land
                logger.error("isolated process %s did not exit", self.proc.pid)


def keep_large(agent: Any, call_id: str, results: list) -> list:
    """Large values a pooled task process wrote to the node's store (they outlive the
    process) are kept for their owner by this worker, as the values of in-process work are;
    small ones travel inline."""
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
