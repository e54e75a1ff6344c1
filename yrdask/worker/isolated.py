"""Isolated work: an instance, or a pooled task process, in a child process of the worker.

Why: native code that crashes (``os._exit``, a segfault) must take only its own process
down, not the worker and every neighbour on it; and work with ``env_vars`` or a
``working_dir`` needs a process whose ``os.environ`` and current directory are its own.

How (``docs/isolation.md``):

* Each worker keeps one :class:`Zygote` (``python -m yrdask.worker.isolated``, started on
  first use): a warm interpreter with Dask and yrdask imported that ``fork()``s every child
  and sets its environment and directory.  A child runs a small Dask ``Server`` on loopback
  (Dask's comms, no networking of its own) and hosts the instance with the same
  :class:`~yrdask.worker.hosting.HostedInstance` code (:class:`~yrdask.protocol.StartIsolated`,
  then ``CALL_METHOD`` / ``TASK_DONE`` on one call channel from the agent), or runs tasks
  (:class:`~yrdask.protocol.RunIsolated`, :class:`ProcessPool`).
* Callers still send their calls to the worker: the agent forwards them on that one comm
  (:class:`IsolatedInstance`), so routing, redelivery and the scheduler are unchanged.
  Results come back as values; the agent keeps large ones in its own store, as for
  in-process work, so they outlive the child.
* Nested calls (``docs/isolation.md#nested-calls``): the child's first nested call (or
  ref) starts a runtime of its own there (:class:`LazyRuntime`), which joins the scheduler
  as a client: the child owns what it creates, borrows the refs it was given, lends what it
  returns, and lends its holding's CPU while it waits (:class:`ChildLending`).  A pooled
  process with a runtime is kept (it may own objects others hold).
* No orphans: the agent kills its children on stop and on close; the zygote exits when its
  stdin closes (the agent closed it, or the worker died) and kills its children first; a
  child dies with the zygote (``PR_SET_PDEATHSIG``).
* When an instance's child dies, the agent tells the scheduler (``InstanceState``
  ``RESTARTING``), whose ``Lifecycle`` owns the instance's one restart budget
  (``recover_retry_times``, shared with worker losses, never reset): with restarts left it
  answers with a ``START_INSTANCE`` to this worker, and a new child is started (a fresh
  ``__init__``); the calls not answered are delivered again in order, except that the
  oldest ``concurrency`` of them (those that may have been running) are charged a crash by
  the one rule of ``runtime/call_order.py`` (``charge_crash``); without, it stops the
  instance, and its calls fail with ``InstanceDiedError`` naming the exit code or the
  signal.  What is decided (pending, waiting, died, restart, charge) is
  :class:`~yrdask.worker.isolated_calls.IsolatedCalls`, which the simulation drives too;
  :class:`IsolatedInstance` does the I/O.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import dask

from yrdask import protocol as P
from yrdask.errors import (CallCrashedError, InstanceDiedError, RemoteError, YRRuntimeError,
                           YRValueError, describe_exit, user_traceback)
from yrdask.worker import isolated_calls as IC
from yrdask.worker.threads import follow_env
from yrdask.serialization import Frames, dumps, dumps_value, loads, unpack_args

logger = logging.getLogger("yrdask.worker")

START_TIMEOUT_S = 60.0
READ_AFTER_EXIT_S = 2.0  # a dead child's answers still in its channel are read this long
POOL_IDLE_S = 10.0  # a pooled task process unused this long is reaped
CANCEL_POLL_S = 0.1  # a cancel of a running isolated task kills its process within this


def describe_exit_of(pid: int, returncode: int) -> str:
    """``"its isolated process (pid 12) exited with code 3"`` (or ``was killed by signal 11
    (SIGSEGV)``): the cause every error about a dead isolated process names."""
    return f"its isolated process (pid {pid}) {describe_exit(returncode)}"


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


# -- agent side ------------------------------------------------------------------------------


def _child_env(extra: dict | None) -> dict:
    env = dict(os.environ)
    env.update(extra or {})
    # The child imports what the worker imports (user modules pickled by reference).
    env["PYTHONPATH"] = os.pathsep.join(os.path.abspath(p or os.getcwd()) for p in sys.path)
    return env


def _node_name(agent: Any) -> str:
    """What the prints of an isolated process name as their node (its worker's node)."""
    return getattr(agent, "node_id", None) or agent.worker.address


def child_info(agent: Any) -> dict:
    """What a child needs to know of its worker: its node (``get_node_id()``, the prints'
    prefix), and where the scheduler is, for the runtime its first nested call starts."""
    from distributed.comm import get_address_host

    worker = agent.worker
    scheduler = getattr(getattr(worker, "scheduler", None), "address", "") or ""
    try:
        host = get_address_host(worker.address)
    except Exception:  # noqa: BLE001 - an address without a host: loopback
        host = "127.0.0.1"
    return {"node": _node_name(agent), "scheduler": scheduler, "host": host}


def spawn(isolation: dict, info: dict | None = None) -> tuple[Any, str]:
    """Start a child with the instance's env and cwd; returns it and its listening address.

    Forked from this worker's zygote (a warm interpreter with Dask and yrdask imported), so
    a start costs a fork, not an interpreter start.  Blocking (run it in a thread).  A
    missing working directory raises ``YRValueError``.
    """
    cwd = isolation.get("cwd") or None
    if cwd is not None and not os.path.isdir(cwd):
        raise YRValueError(f"working_dir {cwd!r} does not exist on this worker host; create it "
                           "there or give runtime_env={'working_dir': <an existing dir>}")
    return Zygote.get().fork(_child_env(isolation.get("env")), cwd, info or {})


class ForkedProcess:
    """A child forked by the zygote, seen from the agent: ``pid``, ``kill()``, ``wait()``
    like ``subprocess.Popen`` (the zygote, its parent, reports its exit status)."""

    stdin = None

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._ended = threading.Event()

    def kill(self) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def wait(self, timeout: float | None = None) -> int:
        if not self._ended.wait(timeout):
            raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0)
        return self.returncode  # type: ignore[return-value]

    def _exited(self, code: int) -> None:
        self.returncode = code
        self._ended.set()


class Zygote:
    """One warm interpreter per worker that forks the isolated processes on request.

    Requests and answers are JSON lines on its stdin and stdout: ``{"id", "env", "cwd"}`` in;
    ``{"id", "pid", "address"}`` from the forked child once it listens, and ``{"exit": pid,
    "code": n}`` when the zygote reaps one (``n < 0``: killed by signal ``-n``).  The zygote
    exits when its stdin closes (the agent closed it, or the worker died) and takes its
    children with it; a child also dies with the zygote (``PR_SET_PDEATHSIG``).
    """

    _current: "Zygote | None" = None
    _lock = threading.Lock()

    @classmethod
    def get(cls) -> "Zygote":
        with cls._lock:
            z = cls._current
            if z is None or z.dead:
                z = cls._current = Zygote()
            return z

    @classmethod
    def close_current(cls) -> None:
        with cls._lock:
            z, cls._current = cls._current, None
        if z is not None:
            z.close()

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "yrdask.worker.isolated", "--zygote"], env=_child_env(None),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.lock = threading.Lock()
        self.ids = iter(range(1, 1 << 62))
        self.waiting: dict[int, list] = {}  # request id -> [Event, answer]
        self.children: dict[int, ForkedProcess] = {}
        self.early_exits: dict[int, int] = {}  # exits read before their fork's answer
        self.dead = False
        threading.Thread(target=self._read, daemon=True, name="yr-zygote-reader").start()

    def fork(self, env: dict, cwd: str | None, info: dict) -> tuple[ForkedProcess, str]:
        with self.lock:
            if self.dead:
                raise RuntimeError("the worker's zygote process has exited")
            rid = next(self.ids)
            slot: list = [threading.Event(), None]
            self.waiting[rid] = slot
            line = json.dumps({"id": rid, "env": env, "cwd": cwd, **info}) + "\n"
            try:
                self.proc.stdin.write(line.encode())
                self.proc.stdin.flush()
            except (BrokenPipeError, ValueError, OSError):
                self.dead = True
                raise RuntimeError("the worker's zygote process has exited") from None
        if not slot[0].wait(START_TIMEOUT_S):
            raise RuntimeError(f"the isolated process did not start in {START_TIMEOUT_S:g} s")
        answer = slot[1]
        if answer is None:
            raise RuntimeError("the worker's zygote process exited while it forked")
        if "error" in answer:
            raise RuntimeError(f"the isolated process did not start: {answer['error']}")
        return self.children[answer["pid"]], answer["address"]

    def _read(self) -> None:
        for raw in self.proc.stdout:
            try:
                msg = json.loads(raw)
            except ValueError:
                continue
            with self.lock:
                if "exit" in msg:
                    child = self.children.pop(msg["exit"], None)
                    if child is None:
                        self.early_exits[msg["exit"]] = msg["code"]
                    else:
                        child._exited(msg["code"])
                    continue
                slot = self.waiting.pop(msg.get("id"), None)
                if "pid" in msg:
                    child = self.children[msg["pid"]] = ForkedProcess(msg["pid"])
                    code = self.early_exits.pop(msg["pid"], None)
                    if code is not None:
                        self.children.pop(msg["pid"])
                        child._exited(code)
            if slot is not None:
                slot[1] = msg
                slot[0].set()
        with self.lock:  # the zygote is gone, and its children with it
            self.dead = True
            waiting, self.waiting = self.waiting, {}
            children, self.children = self.children, {}
        for slot in waiting.values():
            slot[0].set()
        for child in children.values():
            child._exited(-signal.SIGKILL)

    def close(self) -> None:
        """Kill every child (the zygote does so when its stdin closes) and reap the zygote."""
        with self.lock:
            children = list(self.children.values())
        for child in children:
            child.kill()
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:  # pragma: no cover - stuck: it goes the hard way
            self.proc.kill()
            self.proc.wait()


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
                _kill(proc)
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
                _kill(self.proc)
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
        decided = self.decide.restart(int(spec.get("incarnation") or 0), bound)
        if decided is None:
            logger.info("instance %s: ignoring a START_INSTANCE (its process is running)",
                        self.instance_id)
            return
        for cid, (peer, msg), n in decided[1]:
            err = CallCrashedError(
                f"method {msg['method']!r}: call {cid} on instance {self.instance_id} "
                f"may have been running when the instance's process died, {n} times (last: "
                f"{cause}); it is not delivered again (yrdask.scheduling."
                f"max-call-redeliveries={bound}): it may be what kills the process")
            peer.reply(P.TaskDone(cid, error=dumps(RemoteError.from_exception(err, ""))).to_msg())
        self.agent.loop.create_task(self._start(report=True))

    def _answer_died(self, peer: Any, call_id: str, reason: str) -> None:
        err = InstanceDiedError(
            f"instance {self.instance_id} ({self.cls_name}) has ended: {reason}")
        peer.reply(P.TaskDone(call_id, error=dumps(RemoteError.from_exception(err, ""))).to_msg())

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
                _kill(proc)

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

    def kill_now(self) -> None:
        """The worker closes: the child goes at once (no shutdown hook), and is reaped."""
        self.decide.stop(self.decide.stopped or "its worker closed")
        if self.proc is not None:
            _kill(self.proc)
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL did not land
                logger.error("isolated process %s did not exit", self.proc.pid)


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


class ProcessDied(Exception):
    """The pooled process running a task died (``args[0]``: :func:`describe_exit_of`'s text)."""


class _PooledProcess:
    __slots__ = ("proc", "address", "comm", "idle_since", "calls", "owner")

    def __init__(self, proc: subprocess.Popen, address: str) -> None:
        self.proc = proc
        self.address = address
        self.comm: Any = None
        self.idle_since = 0.0
        self.calls = 0  # tasks it ran, for ``max_calls``
        # a nested call started a runtime there: it may own objects that others hold
        # (Ray's rule: they live as long as their owner), so it is not reaped when idle
        self.owner = False

    async def request(self, msg: dict) -> dict:
        from distributed.comm import connect
        from distributed.comm.core import CommClosedError

        try:
            if self.comm is None:
                self.comm = await connect(self.address)
            await self.comm.write(msg)
            return await self.comm.read()
        except (CommClosedError, OSError):
            loop = asyncio.get_running_loop()
            code = await loop.run_in_executor(None, self.proc.wait)
            raise ProcessDied(describe_exit_of(self.proc.pid, code)) from None


class ProcessPool:
    """Child processes for stateless tasks with env_vars/working_dir, one task at a time
    each, kept per ``(env, cwd)`` and reused, reaped after ``POOL_IDLE_S`` unused."""

    def __init__(self, agent: Any, idle_s: float = POOL_IDLE_S) -> None:
        self.agent = agent
        self.idle_s = idle_s
        self.lock = threading.Lock()
        self.idle: dict[str, list[_PooledProcess]] = {}
        self.every: set[_PooledProcess] = set()
        self.closed = False
        self._reaping = False

    def __len__(self) -> int:
        return len(self.every)

    def run(self, isolation: dict, request: dict) -> dict:
        """Run one task (blocking, in the task's thread); its ``TASK_DONE`` wire dict.

        Raises :class:`ProcessDied` if the process died under it.  Any other exception
        here (a cancel of the task) kills the process: it may still be running the code.
        """
        key = json.dumps(isolation, sort_keys=True)
        with self.lock:
            free = self.idle.get(key)
            child = free.pop() if free else None
        if child is None:
            proc, address = spawn(isolation, child_info(self.agent))
            child = _PooledProcess(proc, address)
            with self.lock:
                if self.closed:
                    _kill(proc)
                    raise ProcessDied("its worker is closing")
                self.every.add(child)
        loop = self.agent.loop
        fut = asyncio.run_coroutine_threadsafe(child.request(request), loop)
        try:
            while not fut.done():  # short waits: a cancel (an exception raised in this
                concurrent.futures.wait((fut,), CANCEL_POLL_S)  # thread) lands in between
            answer = fut.result()
        except BaseException:
            fut.cancel()
            self._drop(child)
            raise
        # ``[done, owner]``; a dict: the child's Server reports a failure of its own
        reply, owner = (answer, False) if isinstance(answer, dict) else answer
        child.owner = child.owner or bool(owner)
        child.calls += 1
        max_calls = isolation.get("max_calls") or 0
        with self.lock:
            # closing, or it ran its max_calls (Ray's recycling): it ends, outside the lock
            done = self.closed or bool(max_calls and child.calls >= max_calls)
            if not done:
                child.idle_since = time.monotonic()
                self.idle.setdefault(key, []).append(child)
                if not self._reaping:
                    self._reaping = True
                    loop.call_soon_threadsafe(loop.call_later, self.idle_s, self._reap)
        if done:
            self._drop(child)  # takes the lock itself
        return reply

    def _drop(self, child: _PooledProcess) -> None:
        with self.lock:
            self.every.discard(child)
        if child.comm is not None:
            self.agent.loop.call_soon_threadsafe(child.comm.abort)
        _kill(child.proc)
        threading.Thread(target=child.proc.wait, daemon=True).start()  # reap the zombie

    def _reap(self) -> None:
        """Loop thread: processes idle for ``idle_s`` go; check again while any is left."""
        now = time.monotonic()
        doomed = []
        with self.lock:
            for key, free in list(self.idle.items()):
                keep = []
                for c in free:
                    (keep if c.owner or now - c.idle_since < self.idle_s else doomed).append(c)
                if keep:
                    self.idle[key] = keep
                else:
                    del self.idle[key]
            # owners are kept: no tick for them alone (the next release arms it again)
            self._reaping = not self.closed and any(
                not c.owner for free in self.idle.values() for c in free)
        for child in doomed:
            self._drop(child)
        if self._reaping:
            self.agent.loop.call_later(self.idle_s / 2, self._reap)

    def close(self) -> None:
        """The worker closes: every pooled process goes, and is reaped."""
        with self.lock:
            self.closed = True
            every, self.every, self.idle = list(self.every), set(), {}
        for child in every:
            if child.comm is not None:
                child.comm.abort()
            _kill(child.proc)
            try:
                child.proc.wait(5)
            except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL did not land
                logger.error("isolated process %s did not exit", child.proc.pid)


def _kill(proc: subprocess.Popen) -> None:
    try:
        proc.kill()
    except ProcessLookupError:  # pragma: no cover - already gone
        pass
    if proc.stdin is not None:
        try:
            proc.stdin.close()
        except OSError:
            pass


# -- the child -------------------------------------------------------------------------------


class _ChildPeer:
    """The agent's call channel, seen from the child: replies from instance threads."""

    def __init__(self, loop: asyncio.AbstractEventLoop, stream: Any) -> None:
        self.loop = loop
        self.stream = stream

    def reply(self, msg: dict) -> None:
        self.loop.call_soon_threadsafe(self._send, msg)

    def _send(self, msg: dict) -> None:
        from distributed.comm.core import CommClosedError

        try:
            self.stream.send(msg)
        except CommClosedError:
            pass


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
                    if msg.get("op") == P.CALL_METHOD and self.instance is not None:
                        caller = msg.get("caller")
                        self.instance.call(_CallerPeer(peer, caller) if caller else peer, msg)
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


async def _child_main(announce: Any, info: dict) -> None:
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
    server = Server(P.handlers(P.ISOLATED_RPC, host))
    await server.listen("tcp://127.0.0.1:0")
    out = _OutputAgent(host, server, node)
    output.install(out)
    runtime.output_target = out.runtime.output_target
    announce(server.address)
    await asyncio.Event().wait()  # forever: killed by the agent, or with the zygote


def _forked_child(zygote_pid: int, req: dict) -> None:
    """In the child just forked by the zygote: become the isolated process of ``req``."""
    import ctypes

    code = 0
    try:
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: die with the zygote
        if os.getppid() != zygote_pid:  # it died before the prctl
            os._exit(1)
        global _PROTO_FD
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)  # the zygote's requests are not this process's input
        _PROTO_FD = os.dup(1)
        os.dup2(2, 1)  # the user's prints go where the worker's stderr goes, not into the pipe
        before = dict(os.environ)
        os.environ.clear()
        os.environ.update(req["env"])
        follow_env(before)  # numpy, loaded by the zygote, takes the new thread limits
        if req.get("cwd"):
            os.chdir(req["cwd"])

        def announce(address: str) -> None:
            _write_line({"id": req["id"], "pid": os.getpid(), "address": address})

        asyncio.run(_child_main(announce, req))
    except BaseException as e:  # noqa: BLE001 - told to the agent, then this process ends
        _write_line({"id": req["id"], "error": f"{type(e).__name__}: {e}"})
        code = 1
    os._exit(code)


_PROTO_FD = 1  # where the zygote protocol's lines go (a forked child moves it off stdout)


def _write_line(msg: dict) -> None:
    os.write(_PROTO_FD, (json.dumps(msg) + "\n").encode())  # one write: lines never interleave


def _zygote_main() -> None:
    """Import what a child needs once, then fork one child per request line (see Zygote)."""
    import select

    import distributed.comm.tcp  # noqa: F401 - what every child uses, imported once here
    import distributed.core  # noqa: F401
    import yrdask.runtime.context  # noqa: F401
    import yrdask.stream  # noqa: F401
    import yrdask.worker.hosting  # noqa: F401
    from yrdask.runtime import runtime, transport  # noqa: F401 - a nested call's runtime

    runtime._load_machines()  # (its submitter and router): ~40 ms less at a first nested call

    import gc

    gc.collect()
    gc.freeze()  # the children's collections then leave the shared pages alone (less copying)
    me = os.getpid()
    children: set[int] = set()
    fd = sys.stdin.fileno()
    buf = b""
    open_ = True
    while open_:
        ready, _, _ = select.select([fd], [], [], 0.02)
        while children:  # reap, and tell the agent how each child ended
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            children.discard(pid)
            _write_line({"exit": pid, "code": os.waitstatus_to_exitcode(status)})
        if not ready:
            continue
        data = os.read(fd, 1 << 16)
        if not data:
            open_ = False
        buf += data
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            req = json.loads(line)
            pid = os.fork()
            if pid == 0:
                _forked_child(me, req)
            children.add(pid)
    for pid in children:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for pid in children:
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass
    os._exit(0)


if __name__ == "__main__":
    _zygote_main()
