"""Instances in a seeded world: the real machines and the production instance adapters.

Every driver and worker process runs a ``CallOrder`` through its ``CallRouter``
(``runtime/call_router.py``: the decisions of ``runtime/instance_router.py``); the
scheduler runs the ``Lifecycle`` through the ``InstanceService``
(``scheduler/instance_service.py``: the decisions of ``scheduler/instance_manager.py``)
over the ``LeaseQueue`` through the ``LeaseService`` (``scheduler/lease_service.py``),
whose ledger also serves the drivers' task leases, so instances and leases compete for the
same resources.  Each adapter runs on a simulated edge (``_RouterEdge``, ``_InstanceEdge``,
``_CallEdge``).  Every worker runs the agent's instance side (``InstanceSide``,
``worker/instance_side.py``) on a simulated edge (``_HostEdge``): a ``START_INSTANCE`` that
its stop overtook is ignored, calls that beat their start wait, a stopped instance answers
"died".  Each hosted instance is a ``HostedCalls`` (the decisions of ``worker/hosting.py``)
on simulated executors (``SimHosted``), over its ``CallQueue`` (none before ``__init__``,
at most ``concurrency`` at once, in arrival order); a started call returns later, so calls
run side by side; calls of an async instance's off-loop method (Ray's concurrency groups)
start outside the queue; a driver may cancel a call (Ray's cancel of an actor task).
Process instances: the worker's instance side hosts a ``SimSupervisor`` (as
``IsolatedInstance``) that gives each incarnation a process of its own (a ``Proc`` of kind
"process", its endpoint, with its own ``InstanceSide``); callers reach it there, its death
(seeded, in ``__init__``, or by a call that ends it) is reported as ``STATE`` RESTARTING and
reaches callers as a lost channel to that endpoint.

What crosses a process is a ``protocol.py`` message (``CreateInstance``, ``LocateInstance``,
``KillInstance``, ``SaveState``, ``HandleRefs``, ``InstanceState``, ``CloseStream``,
``StartInstance``, ``StopInstance``, ``CallMethod``, ``CancelTask``, ``TaskDone``, the lease
ops), dispatched through tables built as production builds them (``P.handlers``): the
scheduler's take the lease service's and the instance service's own handlers, a worker's its
instance side's; an rpc's answer comes back as ``world.REPLY`` on its connection.  The
tuples left are each process's own steps and a broken channel (the wiring test's
``KERNEL_STEPS``).
Links are FIFO per (sender, receiver, channel): the job and worker streams keep order, each
rpc (create, locate, kill, stop, lease request) travels on a connection of its own, so rpcs
overtake stream messages as they do in Dask.  Asynchronous steps of the adapters (the
acquire task of ``InstanceService._acquire``, ``loop.call_soon`` flushes, an executor
picking up a call and returning it) are messages to self.  ``random.Random(seed)`` picks
the next message or timer.

Scenarios: drivers create instances (named ones, binds, detached ones, recover_retry_times
0/1/2/-1, shapes that do not fit), call them, have them create children (owner tree; the
child's handle comes back in the call's result: transit/arrived tokens), pass handles to
the other driver, drop handles (release after the grace period), terminate them, ask for
task leases, cancel calls (Ray's cancel of an actor task), exit (gracefully or abruptly);
workers die and new ones join.

Checks (``SimFailure``): each machine's ``validate()`` after every step; every call settles
exactly once (calls of an abruptly ended driver excepted) with a value or an allowed error
(its argument's error; ``InstanceDiedError``/``ScheduleError`` only once the instance has
ended; ``CancelledError`` only if cancelled); an instance is hosted at most 1 + its
``recover_retry_times`` times, and one that lost its process with lives left is started
again within ``RESTART_WITHIN_S`` (unless it ended otherwise or waits for room); a call
running at more deaths of its process than ``max_redeliveries`` never begins again; no call (off-loop ones included) begins before
``__init__`` finished, nor after its ``__init__`` raised (its calls answer that error: 4 % of
instances), nor after its cancel reached its worker, no more queued calls run at
once than the concurrency; within one incarnation the calls of one route start in
submission order (unordered and off-loop ones excepted); a
call whose answer arrived is never sent again.  At quiescence: no live instance whose job
ended (unless detached), none unheld, none held by a process that is gone or does not count it, no
instance hosted on a worker that the lifecycle does not place there.  At the end, after the
detached instances are terminated: no instance, no holding, no pending request, nothing
waiting in the adapters, every kill answered.  At both points the scheduler restarts (on
paper): the durable store (``scheduler/durable.py``, which the instance adapter writes as in
production) holds exactly the live detached instances with their latest checkpoints, and
reading it back gives a lifecycle that validates, with their names.
"""

from __future__ import annotations

import heapq
import random
import re
import sys
from collections import deque
from typing import Any

from yrdask import protocol as P
from yrdask.errors import (CallCrashedError, CancelledError, InstanceDiedError,
                           InstanceMovedError, ScheduleError)
from yrdask.runtime import call_order as C
from yrdask.runtime import call_router as CR
from yrdask.runtime.call_router import CallRouter
from yrdask.scheduler import durable as D
from yrdask.scheduler import leases as LQ
from yrdask.scheduler import lifecycle as L

from yrdask.scheduler import instance_service as IS
from yrdask.scheduler.instance_service import InstanceService
from yrdask.scheduler.departures import Departures
from yrdask.scheduler.lease_service import LeaseService
from yrdask.scheduler.requests import LeaseRequest
from yrdask.worker.agent import WorkerAgent
from yrdask.worker.instance_side import HostedCalls, InstanceSide

from tests.sim import machines as M
from tests.sim.world import REPLY, SimFailure

SCHED = "sched"
MAX_STEPS = 60_000
MAX_VIRTUAL_S = 20_000.0
GRANT_WITHIN_S = 0.25  # virtual seconds a request that fits the free capacity may stay pending
#: virtual seconds within which an instance with restarts left that lost its process is
#: hosted again (its worker's removal: at most 3 s, then heard at most 1 s later; the grant
#: of what fits: GRANT_WITHIN_S), unless it ended for another reason or waits for room
RESTART_WITHIN_S = 8.0
#: how often a call may be running when its process dies and still be delivered again
#: (``CallOrder``'s default ``max_redeliveries``)
MAX_REDELIVERIES = 1
UNFIT = {"CPU": 64000.0, "Memory": 100.0}
#: the race branches the world counts (``CallWorld.races``; a range run prints their sum)
RACES = ("a stop for a worker already removed",)


# Failures the simulation found that are still open, by their exact seeds: seed -> (the
# start of the failure message, the FINDINGS.md section).  A failure is known only if both
# its seed and its message match; any other failure (a new seed, or a known seed failing
# differently) fails the run.  All findings of FINDINGS.md are fixed: none is listed.
KNOWN_FINDINGS: dict[int, tuple[str, str]] = {}


def known_finding(seed: int, message: str) -> str | None:
    """The FINDINGS.md section of a failure, if this exact seed is a known finding."""
    entry = KNOWN_FINDINGS.get(seed)
    if entry is not None and message.startswith(entry[0]):
        return entry[1]
    return None


class ArgBoom(Exception):
    """A call's (or a creation's) ref argument failed."""


class InitBoom(Exception):
    """The instance's ``__init__`` raised: every call answers this."""


#: what the executing side answered, by the type of its ``TASK_DONE``'s error
ANSWERS = {InstanceDiedError: "died", InitBoom: "init-error", CancelledError: "cancelled",
           InstanceMovedError: "moved"}


class Proc:
    """A driver or worker process: its CallOrder, the handles it holds, its hosting."""

    def __init__(self, name: str, kind: str) -> None:
        self.name = name
        self.kind = kind
        self.alive = True
        self.order = C.CallOrder()
        self.router: Any = None  # its CallRouter (runtime/call_router.py), set by the world
        self.handles: dict[str, int] = {}  # route id -> handle objects alive here
        self.leases: set[str] = set()  # task leases held (drivers)
        self.job = f"job-{name}"
        self.exiting = False
        self.exit_at = 0.0
        self.abrupt = False
        # workers: the agent's instance side (worker/instance_side.py), set by the world
        self.side: InstanceSide | None = None
        self.incs: dict[tuple, "SimHosted"] = {}  # (iid, incarnation) -> hosted here ever
        self.ran: set[str] = set()  # calls whose method began here
        self.unrun_cancels: set[str] = set()  # calls cancelled here before they began
        self.parent: str | None = None  # a process instance's own process: its worker
        # the agent's tables (P.handlers), its instance side's own handlers: the worker
        # stream's (P.WORKER_STREAM) and the call channel's (P.CHANNEL_TO_WORKER)
        self.stream: dict[str, Any] = {}
        self.channel: dict[str, Any] = {}
        self.agent: dict[str, Any] = {}  # the agent's own: STOP_INSTANCE, CANCEL_TASK

    def hosting(self, side: InstanceSide) -> None:
        """Host instances (a worker, or a process instance's own process): ``side``."""
        self.side = side
        self.stream = P.handlers((P.START_INSTANCE,), side)
        self.channel = P.handlers((P.CALL_METHOD,), side)
        self.agent = P.handlers((P.STOP_INSTANCE, P.CANCEL_TASK), _AgentHandlers(side))

    @property
    def hosted(self) -> dict[str, "SimHosted"]:
        """The instances this worker hosts now (its instance side's)."""
        return self.side.instances if self.side is not None else {}


class _AgentHandlers:
    """The worker agent's own handlers of the instance ops that reach a worker past its
    instance side's tables, production's methods over the world's instance side:
    ``STOP_INSTANCE`` (``WorkerAgent.stop_instance``: the instance side's stop, then the
    hosted object's shutdown hook, which none of the world's instances has) and
    ``CANCEL_TASK`` (``TaskRunner.cancel_task``: an id that is no task goes to the instance
    side; the world's workers run no tasks)."""

    stop_instance = WorkerAgent.stop_instance
    cancel_task = WorkerAgent.cancel_task

    def __init__(self, side: InstanceSide) -> None:
        self.instance_side = side
        self.instances = side.instances
        self.task_side = _NoTasks()


class _NoTasks:
    """The task side of a worker of the instance world: it runs no tasks."""

    tasks: dict = {}


class SimHosted(HostedCalls):
    """One hosted instance: ``HostedCalls`` (production code, ``worker/instance_side.py``)
    on simulated executors, as ``worker/hosting.py``'s ``HostedInstance`` is on threads and
    event loops: a started call is a message to self (``RUN``: the method begins), and it
    returns later (``FINISH``)."""

    def __init__(self, world: "CallWorld", w: Proc, iid: str, inc: int, conc: int) -> None:
        super().__init__(conc)
        self.world, self.w, self.iid, self.inc, self.conc = world, w, iid, inc, conc
        self.ready = False  # the world's own record: __init__ finished
        self.init_raised = False  # ... and raised
        self.running: set[str] = set()  # calls the queue started, now running
        self.side_running: set[str] = set()  # off-loop calls running
        self.results: dict[str, Any] = {}

    def __repr__(self) -> str:
        return f"<hosted {self.iid}.{self.inc} on {self.w.name}>"

    def _start(self, item: tuple) -> None:
        self.world.admit(self, item[1]["task_id"], False)

    def _start_side(self, item: tuple) -> None:
        self.world.admit(self, item[1]["task_id"], True)

    def _answer_died(self, peer: Any, call_id: str) -> None:
        self.world.send(self.w.name, peer, "call", P.TaskDone(call_id, error=InstanceDiedError(
            f"{self.iid} has ended: {self.stopped}")).to_msg())

    def _answer_init_error(self, call_id: str) -> None:
        peer = self.answered(call_id)
        if peer is not None:
            self.world.send(self.w.name, peer, "call",
                            P.TaskDone(call_id, error=InitBoom(self.iid)).to_msg())

    def _answer_cancelled(self, call_id: str) -> None:
        peer = self.answered(call_id)
        if peer is not None:
            self.world.send(self.w.name, peer, "call", P.TaskDone(call_id, error=CancelledError(
                f"Task: {call_id} was cancelled.")).to_msg())

    def _interrupt(self, call_id: str) -> None:
        pass  # a running call runs on to its answer (a sync method; Ray's cancel)


class _HostEdge:
    """A worker agent's instance side edge (as ``agent._InstanceEdge``): hosting is a
    ``SimHosted``, answers are links."""

    def __init__(self, world: "CallWorld", w: Proc) -> None:
        self.world, self.w = world, w

    def host(self, spec: dict, running: Any) -> Any:
        w, world = self.w, self.world
        iid, inc = spec["instance_id"], spec.get("incarnation", 0)
        conc = spec.get("concurrency") or (1000 if spec.get("is_async") else 1)
        if w.parent is None and world.specs[iid].get("isolation"):  # (as agent.host)
            if type(running) is SimSupervisor:  # its process died: the scheduler restarts it
                running.restart(spec)
                return running
            return SimSupervisor(world, w, spec)
        h = w.incs[(iid, inc)] = SimHosted(world, w, iid, inc, conc)
        world.say(w.name, "hosts", iid, inc, f"concurrency {conc}")
        world.started(iid)
        world.send(w.name, w.name, f"init-{iid}", ("INIT", iid, inc))
        return h

    def died(self, peer: Any, msg: dict, why: str) -> None:
        self.world.send(self.w.name, peer, "call", P.TaskDone(msg["task_id"], error=(
            InstanceDiedError(f"{msg['instance_id']} has ended: {why}"))).to_msg())

    def ignored_start(self, instance_id: str) -> None:
        self.world.say(self.w.name, "start ignored, stopped before", instance_id)


class SimSupervisor:
    """The agent's side of a process instance (as ``worker/isolated/supervisor.py``'s
    ``IsolatedInstance``): each incarnation is a process of its own (a ``Proc`` of kind
    "process", hosting with its own ``InstanceSide``, as ``isolated/child.py``), reached by
    its callers at its own endpoint; this side never runs a call, reports where the process
    serves (its ``STATE`` ALIVE carries the endpoint) and its death (``STATE``
    RESTARTING with the incarnation and the dead endpoint), and stops it."""

    def __init__(self, world: "CallWorld", w: Proc, spec: dict) -> None:
        self.world, self.w, self.iid = world, w, spec["instance_id"]
        self.stopped: str | None = None
        self.dead = False  # its process died; waiting for the scheduler's decision
        self.child: Proc | None = None
        self.inc = -1
        self._start(spec)

    def __repr__(self) -> str:
        return f"<supervisor of {self.iid}.{self.inc} on {self.w.name}>"

    def _start(self, spec: dict) -> None:
        self.inc = spec.get("incarnation", 0)
        self.child = self.world.spawn(self.w, spec)

    def restart(self, spec: dict) -> None:
        """``START_INSTANCE`` again after its process died: a new process."""
        if self.stopped is not None or not self.dead:
            self.world.say(self.w.name, "start ignored, its process runs", self.iid)
            return
        self.dead = False
        self._start(spec)

    def died(self, cause: str, in_init: bool = False) -> None:
        """Its process died (the watcher): the scheduler decides restart or end.  One that
        died in ``__init__`` may also fail the agent's read of its ``__init__`` reply after
        the exit was heard: that read reports ALIVE with its error, of the dead incarnation
        (the scheduler must ignore it)."""
        if self.stopped is not None or self.dead:
            return
        self.dead = True
        self.world.send(self.w.name, SCHED, "stream", P.InstanceState(
            self.iid, P.RESTARTING, None, cause, self.inc, self.child.name).to_msg())
        if in_init and self.world.proc_rng.random() < 0.5:
            self.world.send(self.w.name, SCHED, "stream", P.InstanceState(
                self.iid, P.ALIVE, b"CommClosedError", incarnation=self.inc).to_msg())

    def stop(self, reason: str) -> bool:
        """The instance ends: its process answers the calls it has, then goes."""
        if self.stopped is not None:
            return False
        self.stopped = reason
        child = self.child
        if child is not None and child.alive:
            child.side.stop(self.iid, reason)
            self.world.end_process(child, crashed=False)
        return True

    def call(self, peer: Any, msg: dict) -> None:
        """A call sent to the worker (the caller had its address from a creation that
        ended before it served): unrun, its caller locates the instance again."""
        self.world.send(self.w.name, peer, "call", P.TaskDone(msg["task_id"], error=(
            InstanceMovedError(f"{self.iid} is served by its own process"))).to_msg())

    def cancel_call(self, call_id: str) -> bool:
        return False


class _RouterEdge:
    """A process's instance router edge (as ``InstanceRouter``): call channels, rpcs and
    the handle report as links, a flush as a message to self."""

    def __init__(self, world: "CallWorld", pname: str) -> None:
        self.world = world
        self.pname = pname

    def send_call(self, ins: C.SendCall) -> None:
        w, pname = self.world, self.pname
        rec = w.calls[ins.call_id]
        if rec["answered"]:
            w.fail(f"call {ins.call_id} sent again after its answer arrived")
        rec["sent"] += 1
        w.say(pname, "send", ins.call_id, ins.instance_id, ins.worker)
        w.send(pname, ins.worker, "call", P.CallMethod.wire(
            ins.call_id, ins.instance_id, rec["method"], b"", [], 1))

    def send_cancel(self, worker: str, msg: P.CancelTask) -> None:
        self.world.say(self.pname, "send cancel", msg.task_id, worker)
        self.world.send(self.pname, worker, "call", msg.to_msg())

    def call_succeeded(self, call_id: str) -> None:
        self.world.settled(self.pname, call_id, None)

    def call_failed(self, call_id: str, error: Any) -> None:
        self.world.settled(self.pname, call_id, error)

    def flush_soon(self) -> None:
        self.world.send(self.pname, self.pname, "flush", ("FLUSH",))

    def report_handles(self, ins: C.ReportHandles) -> None:
        w, pname = self.world, self.pname
        w.say(pname, "report", ins.deltas, list(ins.transit), list(ins.arrived))
        w.send(pname, SCHED, "stream", P.HandleRefs(  # as InstanceRouter.report_handles
            dict(ins.deltas), transit=[list(t) for t in ins.transit],
            arrived=[list(t) for t in ins.arrived]).to_msg())

    def send_create(self, instance_id: str) -> None:
        w = self.world
        spec = {k: v for k, v in w.specs[instance_id].items() if v is not None}
        w.send(self.pname, SCHED, w.new_id("rpc-create-"), P.CreateInstance(spec).to_msg())

    def send_locate(self, instance_id: str, lost: str | None) -> None:
        # A simulated worker's server id is its name: no process is ever restarted under
        # the same name here (FINDINGS.md), so the lost process is the one of that name.
        w = self.world
        w.send(self.pname, SCHED, w.new_id("rpc-locate-"),
               P.LocateInstance(instance_id, lost, lost or "").to_msg())


class _CallEdge:
    """The lease service's I/O edge in the instance world (as ``extension._LoopEdge``)."""

    def __init__(self, world: "CallWorld") -> None:
        self.world = world

    def now(self) -> float:
        return self.world.now

    def call_at(self, at: float, fn: Any) -> None:
        self.world.timer(max(at, self.world.now), "lq-tick", None)  # fn is service.tick

    def send_to_owner(self, owner: str, msg: dict) -> None:
        if owner in self.world.jobs:
            self.world.send(SCHED, owner, "stream", msg)

    def has_job(self, owner: str) -> bool:
        return owner in self.world.jobs

    def broadcast(self, msg: Any, but: str) -> None:
        """``extension._broadcast``, to the drivers (workers here react to no loss)."""
        for d in sorted(self.world.jobs):
            self.world.send(SCHED, d, "stream", msg.to_msg())

    def is_worker(self, owner: str) -> bool:
        return owner in self.world.registered

    def after_feed(self) -> None:
        pass


class _Later:
    """A callback the scheduler's loop runs on a later turn, named in the story (a function's
    repr would name its address: stories must replay identically)."""

    __slots__ = ("label", "fn")

    def __init__(self, label: str, fn: Any) -> None:
        self.label, self.fn = label, fn

    def __call__(self) -> None:
        self.fn()

    def __repr__(self) -> str:
        return self.label


class _InstanceEdge:
    """The instance service's I/O edge in the instance world (as
    ``instance_manager._DaskEdge``): virtual clock and timers, loop turns as messages to
    self, the lease service, the worker streams and rpcs."""

    def __init__(self, world: "CallWorld") -> None:
        self.world = world

    def now(self) -> float:
        return self.world.now

    def call_at(self, at: float, fn: Any) -> None:
        self.world.timer(max(at, self.world.now), "call", fn)

    def soon(self, fn: Any) -> None:
        w = self.world
        chan = w.new_id("soon-")
        w.send(SCHED, SCHED, chan, ("SOON", _Later(chan, fn)))

    def is_worker(self, worker: str) -> bool:
        w = self.world
        if worker in w.unheard and sys._getframe(1).f_code.co_name == "feed":
            w.races["a stop for a worker already removed"] += 1  # (the service's branch)
        return worker in w.registered

    def acquire(self, req: LeaseRequest, timeout_ms: int, answer: Any) -> None:
        w = self.world

        def answered(result: list) -> None:  # ext.acquire's future: the task resumes later
            if result[0] is not None:
                w.granted(result[0])
            chan = f"acquired-{req.request_id}"
            w.send(SCHED, SCHED, chan, ("SOON", _Later(f"{chan} {result}",
                                                       lambda: answer(result))))
        w.leases.open(req, timeout_ms, answered)

    def cancel_acquire(self, req: LeaseRequest) -> None:
        if req.request_id:
            self.world.leases.cancel(req.request_id)

    def release(self, holding_ids: list) -> None:
        self.world.leases.release(holding_ids)

    def start_instance(self, worker: str, spec: dict) -> None:
        w = self.world
        iid, inc = spec["instance_id"], spec.get("incarnation", 0)
        w.say(SCHED, "start", iid, worker, inc)
        w.placed[iid] = (worker, w.placed.get(iid, ("", 0))[1] + 1)
        w.send(SCHED, worker, "stream", P.StartInstance(spec).to_msg())

    def stop_instance(self, worker: str, instance_id: str, reason: str,
                      force: bool = False) -> None:
        w = self.world
        w.stops.setdefault(worker, set()).add(instance_id)
        w.send(SCHED, worker, w.new_id("rpc-stop-"), P.StopInstance(instance_id, reason).to_msg())

    def worker_gone(self, worker: str, timeout: float, then: Any, server_id: str = "") -> None:
        w = self.world
        if worker not in w.registered or (server_id and server_id != worker):
            then()
            return
        once = [then]

        def resume() -> None:
            if once:
                once.pop()()
        w.gone_waiters.setdefault(worker, []).append(resume)
        w.timer(w.now + timeout, "gone-timeout", resume)

    def broadcast(self, msg: Any) -> None:
        """``extension.broadcast``: here only a process instance's end (``WorkerExit``),
        which the callers' errors would name; how a process ended is not simulated."""
        assert type(msg) is P.WorkerExit, msg
        self.world.say(SCHED, "broadcast", msg.op, msg.worker)

    def after_feed(self) -> None:
        w = self.world
        for rec in w.lc.last_ended:
            if rec.reason == "no handle to it is left":
                holders = [p.name for p in w.procs.values()
                           if p.alive and rec.instance_id in p.order.registered]
                if holders:
                    w.fail(f"released too early: {rec.instance_id} ended for lack of handles "
                           f"though {holders} hold(s) it")


class CallWorld:
    """One seeded scenario of instances (see module docstring)."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        rng = self.rng = random.Random(seed * 31 + 5)
        self.init_rng = random.Random(seed * 17 + 3)  # whose __init__ raises (its own draws)
        # how long the machines hear of a peer after the adapter knows it is gone
        self.gone_rng = random.Random(seed * 13 + 7)
        # which instances run in a process of their own, when such a process dies (own draws)
        self.proc_rng = random.Random(seed * 7 + 11)
        self.unheard: set[str] = set()  # gone for the adapter, not yet for the machines
        self.races: dict[str, int] = dict.fromkeys(RACES, 0)
        self.unanswered: str | None = None  # the process doing a do_unanswered
        self.now = 0.0
        self.step = 0
        self._seq = 0
        self._ids = 0
        self.links: dict[tuple, deque] = {}
        self.busy: dict[tuple, None] = {}
        self.timers: list = []
        self.log: list[tuple] = []
        self.lc = L.Lifecycle(release_grace_s=rng.choice([0.2, 0.5]))
        self.lq = LQ.LeaseQueue()
        # the production lease adapter (scheduler/lease_service.py) on a simulated edge
        self.leases = LeaseService(_CallEdge(self), self.lq)
        # the production instance adapter (scheduler/instance_service.py) on a simulated edge
        self.instances = InstanceService(_InstanceEdge(self), self.lc, self.lq.ledger)
        # the extension's tables (P.handlers over the protocol's ops), the same services' own
        # handlers: the scheduler rpc (instance_service.RPC_OPS answer through a callback),
        # a worker's stream (Dask adds ``worker``) and a job's stream
        self.sched_rpc = P.handlers(IS.RPC_OPS, self.instances)
        self.sched_ops = P.handlers((P.SAVE_STATE,), self.instances)
        self.sched_stream = P.handlers(
            [op for op in P.SCHEDULER_STREAM if op != P.TASK_RECORDS],
            self.leases, self.instances)
        self.job_stream = P.handlers(P.JOB_STREAM, self.leases, self.instances)
        # what outlives the scheduler (scheduler/durable.py), as the extension keeps it
        self.durable = self.instances.durable = D.DurableControl(D.MemoryStore())
        # a job's end, a worker's removal: the production order (scheduler/departures.py)
        self.departures = Departures(_CallEdge(self), self.leases, self.instances)
        self.shrunk: set[str] = set()  # holdings on a node when it lost a process
        self.procs: dict[str, Proc] = {}
        self.specs: dict[str, dict] = {}  # route id -> creation spec (creator side)
        self.create_boom: set[str] = set()  # creations whose argument failed
        self.calls: dict[str, dict] = {}
        self.execs: dict[tuple, list] = {}  # (iid, worker, incarnation) -> [(caller, route, seq, cid)]
        self.tokens: dict[str, tuple] = {}  # token -> (iid, receiver)
        self.incarnations: dict[str, int] = {}  # iid -> incarnations started (hosted) ever
        self.placed: dict[str, tuple] = {}  # iid -> (worker of its last START, STARTs sent)
        self.arrived_tokens: set[str] = set()
        # scheduler adapter state
        self.registered: set[str] = set()  # workers the scheduler knows (Dask's view)
        self.jobs: set[str] = set()  # drivers whose job stream is open
        self.gone_waiters: dict[str, list] = {}  # worker -> locate continuations
        self.kills: set[str] = set()  # KILL rpcs not answered yet
        self.stops: dict[str, set] = {}  # worker -> iids with a STOP rpc out
        self.latency = rng.choice([0.0, 0.02, 0.1])
        self.grantable_since: dict[str, float] = {}  # progress: request id -> since it fit
        self.checked_at = -1.0
        self.release_checked_at = -1.0
        # the scenario
        nworkers = rng.randint(1, 3)
        self.nworkers = 0
        for _ in range(nworkers):
            self._add_worker()
        ndrivers = rng.randint(1, 2)
        self.describe = f"seed {seed}: {nworkers} workers, {ndrivers} drivers, grace " \
                        f"{self.lc.release_grace_s}"
        for i in range(ndrivers):
            d = Proc(f"d{i}", "driver")
            self.procs[d.name] = d
            d.router = CallRouter(_RouterEdge(self, d.name), d.order)
            self.jobs.add(d.name)
            t = 0.0
            plan = ["create"] + rng.choices(
                ["create", "call", "spawn", "pass", "drop", "kill", "lease", "save", "cancel",
                 "abrupt"],
                [14, 40, 8, 6, 6, 4, 10, 3, 4, 1], k=rng.randint(4, 24))
            for action in plan:
                t += rng.expovariate(1 / 0.3)
                self.timer(t, "plan", (d.name, action))
                if action == "abrupt":
                    break
            else:
                self.timer(t + rng.expovariate(1 / 0.5), "plan", (d.name, "exit"))
        for _ in range(rng.choice([0, 0, 1, 1, 2])):
            self.timer(rng.uniform(0, 6), "kill-worker", None)
        for _ in range(self.proc_rng.choice([0, 1, 2, 3])):
            self.timer(self.proc_rng.uniform(0, 6), "process-dies", None)

    # -- plumbing --------------------------------------------------------------------------

    def new_id(self, prefix: str) -> str:
        self._ids += 1
        return f"{prefix}{self._ids}"

    def say(self, node: str, *what: Any) -> None:
        self.log.append((self.step, self.now, node, what))

    def timer(self, at: float, kind: str, data: Any) -> None:
        self._seq += 1
        heapq.heappush(self.timers, (at, self._seq, kind, data))

    def alive(self, name: str) -> bool:
        p = self.procs.get(name)
        return name == SCHED or (p is not None and p.alive)

    def send(self, src: str, dst: str, chan: str, msg: tuple) -> None:
        if not self.alive(dst):
            if chan == "call":  # connecting to a dead worker fails: the channel is lost
                self.send("net", src, "lost", ("LOST", dst))
            elif type(msg) is dict and msg["op"] == P.STOP_INSTANCE:  # the rpc fails: _stop
                self.stop_failed(dst, msg["instance_id"])  # answers Stopped all the same
            return
        key = (src, dst, chan)
        q = self.links.get(key)
        if q is None:
            q = self.links[key] = deque()
        q.append(msg)
        self.busy[key] = None

    def fail(self, message: str) -> None:
        self.failure = message
        raise SimFailure(message, self)  # type: ignore[arg-type]

    def _add_worker(self) -> str:
        w = Proc(f"w{self.nworkers}", "worker")
        self.nworkers += 1
        self.procs[w.name] = w
        w.router = CallRouter(_RouterEdge(self, w.name), w.order)
        w.hosting(InstanceSide(_HostEdge(self, w)))  # the agent's instance side
        cap = {"CPU": float(self.rng.choice([1000, 2000, 4000])), "Memory": 4000.0}
        self.registered.add(w.name)
        # Nodes are hosts (docs/nodes.md): in odd seeds the workers pair up on hosts.
        host = f"h{(self.nworkers - 1) // 2}" if self.seed % 2 else w.name
        self.leases.worker_joined(w.name, cap, host)
        return w.name

    # -- the process adapter (runtime/instance_router.py) -----------------------------------

    def do(self, pname: str, method: str, *args: Any) -> None:
        """A happening in process ``pname``: its router (``CallRouter``, production code)
        turns it into a ``CallOrder`` event and carries out the instructions on its edge."""
        p = self.procs[pname]
        if p.alive:
            getattr(p.router, method)(*args)

    def do_unanswered(self, pname: str, method: str, *args: Any) -> None:
        """:meth:`do` of a happening that may settle calls its hosts never answered (a
        cancel, a lost channel)."""
        self.unanswered = pname
        try:
            self.do(pname, method, *args)
        finally:
            self.unanswered = None

    def settled(self, pname: str, cid: str, err: Any) -> None:
        rec = self.calls[cid]
        rec["settled"] += 1
        if rec["settled"] > 1:
            self.fail(f"call {cid} settled twice")
        self.say(pname, "settled", cid, repr(err) if err is not None else "ok")
        iid = rec["iid"]
        answers = rec.get("answers", [])
        if err is None:
            if rec["bad_arg"] or iid in self.create_boom:
                self.fail(f"call {cid} succeeded though its argument failed")
            if "ok" not in answers:  # a success the executing side never answered
                self.fail(f"result: call {cid} settled as a success, yet its instance "
                          f"answered {answers or 'nothing'}")
            child = rec.get("result")
            if child is not None:  # unpickle the handle in the result
                child_iid, token = child
                self.do(pname, "arrived", child_iid, token)
                self.arrived_tokens.add(token)
                self.add_handle(pname, child_iid)
            return
        if isinstance(err, CancelledError):  # InstanceRouter.on_done after Ray's cancel
            if not rec["cancelled"]:
                self.fail(f"call {cid} answered as cancelled though nobody cancelled it")
            # unrun: answered so, or not in flight at its cancel (it never leaves), or back
            # from a lost or moved host (it does not go again)
            if not ({"cancelled", "died", "moved"} & set(answers) or self.unanswered == pname):
                self.fail(f"cancel: call {cid} settled as cancelled, yet it was in flight at "
                          f"its cancel and its instance answered {answers or 'nothing'}")
        elif isinstance(err, InitBoom):  # (only an instance whose __init__ raised sends it)
            if "init-error" not in answers:
                self.fail(f"result: call {cid} failed with {err!r}, yet its instance "
                          f"answered {answers or 'nothing'}")
        elif isinstance(err, ArgBoom):
            if not (rec["bad_arg"] or iid in self.create_boom):
                self.fail(f"call {cid} failed with an argument error it did not have: {err!r}")
        elif isinstance(err, CallCrashedError):  # running at more deaths than the bound
            if max(rec["sent"], rec.get("forwards", 0)) < 2:  # to a worker, to its process
                self.fail(f"call {cid} failed with {err!r} though it was sent {rec['sent']} time(s)")
        elif isinstance(err, (InstanceDiedError, ScheduleError)):
            if self.lc.is_live(self.lc.resolve(iid)):
                self.fail(f"call {cid} failed with {err!r} though {iid} "
                          f"({self.lc.resolve(iid)}) is live: {self.lc.status(iid)}")
        else:
            self.fail(f"call {cid} failed with {err!r}")

    def budget(self, iid: str) -> int:
        """The instance's restart budget as its creator asked (the world's own record of the
        create params): ``recover_retry_times``, -1 for no limit."""
        return self.specs[iid].get("recover_retry_times") or 0

    def started(self, iid: str) -> None:
        """A worker hosts a new incarnation of ``iid``: never more than 1 + its budget."""
        n = self.incarnations[iid] = self.incarnations.get(iid, 0) + 1
        budget = self.budget(iid)
        if budget != -1 and n > 1 + budget:
            self.fail(f"restart: {iid} started {n} times, though created with "
                      f"recover_retry_times={budget}: {self.lc.story.dump(iid)}")

    def lost_process(self, iid: str, cause: str) -> None:
        """The process meant to host ``iid`` died (its worker, or its own process), hosting
        it or not yet: each START it was sent is one of its 1 + budget lives, so with lives
        left it must be started again within ``RESTART_WITHIN_S`` (checked by a timer)."""
        budget = self.budget(iid)
        n = self.placed[iid][1]
        if budget == -1 or n < 1 + budget:
            self.timer(self.now + RESTART_WITHIN_S, "restart-due", (iid, n, cause))

    def check_restarted(self, iid: str, n: int, cause: str) -> None:
        """Progress of restarts: hosted again since it lost its process, or it ended for a
        reason of its own (terminated, released, its owner ended, no worker had room), or it
        still waits for room; never ended for that loss while it had restarts left."""
        if self.placed[iid][1] > n:
            return
        lc = self.lc
        rec = lc.instances.get(iid)
        reason = lc.graveyard.get(iid) if rec is None else rec.reason
        if rec is not None and rec.state != P.DEAD:
            if rec.acquiring:  # waits for room (the lease queue's progress check holds)
                return
            if rec.state == P.RESTARTING or rec.worker is not None and not self.alive(rec.worker):
                self.fail(f"restart: {iid} lost its process ({cause}) {RESTART_WITHIN_S} s ago, "
                          f"has restarts left, and was not started again: {rec.state} on "
                          f"{rec.worker}: {lc.story.dump(iid)}")
            return
        if reason is not None and reason.startswith(cause) and "take it back" not in reason:
            self.fail(f"restart: {iid} ended for the loss of its process ({reason}) though "
                      f"it had restarts left (created with recover_retry_times="
                      f"{self.budget(iid)}, started {n} times): {lc.story.dump(iid)}")

    def add_handle(self, pname: str, iid: str) -> None:
        p = self.procs[pname]
        p.handles[iid] = p.handles.get(iid, 0) + 1
        self.do(pname, "incref", iid)

    def drop_handle(self, pname: str, iid: str) -> None:
        p = self.procs[pname]
        n = p.handles.get(iid, 0)
        if n <= 0:
            return
        if n == 1:
            del p.handles[iid]
        else:
            p.handles[iid] = n - 1
        self.say(pname, "drop-handle", iid)
        self.do(pname, "decref", iid)

    def create(self, pname: str, owner: str, params: dict) -> str:
        """``yr.instance(...)``: the creator holds a handle; the creation may wait for an
        argument (which may fail)."""
        iid = self.new_id("i")
        spec = {"instance_id": iid, "owner": owner, "holder": pname, **params}
        self.specs[iid] = spec
        self.say(pname, "create", iid, {k: v for k, v in params.items() if v})
        self.do(pname, "create_requested", iid)
        self.add_handle(pname, iid)
        r = self.rng.random()
        if r < 0.75:
            self.do(pname, "create_deps_ready", iid)
        else:
            boom = ArgBoom(iid) if r > 0.95 else None
            if boom is not None:
                self.create_boom.add(iid)
            self.send(pname, pname, f"cdeps-{iid}", ("CDEPS", iid, boom))
        return iid

    def submit_call(self, pname: str, iid: str, kind: str) -> str:
        cid = self.new_id("c")
        r = self.rng.random()
        ready, bad = r > 0.2, r < 0.04
        # the Ray surface's async and threaded actors send calls that may pass earlier ones
        # still waiting for their arguments (all calls of such a class: spec "unordered")
        spec = self.specs.get(iid, {})
        unordered = bool(spec.get("unordered"))
        # an async class's __yr_off_loop__ method (Ray's concurrency groups): its calls
        # start outside the queue, so they may pass the queued ones
        method = "side" if spec.get("off_loop") and kind == "call" and \
            self.rng.random() < 0.4 else kind
        # its handle knows the instance's concurrency: a lost worker charges that many
        conc = spec.get("concurrency") or (1000 if spec.get("is_async") else 1)
        self.calls[cid] = {"iid": iid, "caller": pname, "seq": self._seq_of(pname),
                           "settled": 0, "answered": False, "sent": 0, "bad_arg": bad,
                           "kind": kind, "result": None, "unordered": unordered,
                           "method": method, "cancelled": False,
                           # in a process instance, the method crashes its process
                           # (``os._exit``) each time it runs
                           "poison": self.proc_rng.random() < 0.08}
        self.say(pname, "call", cid, iid, kind, "ready" if ready else "waits for its argument",
                 "unordered" if unordered else "")
        self.do(pname, "submit", cid, iid, ready, None, None, unordered, conc)
        if not ready:
            self.send(pname, pname, f"deps-{cid}", ("DEPS", cid, ArgBoom(cid) if bad else None))
        return cid

    def _seq_of(self, pname: str) -> int:
        self._ids += 1
        return self._ids

    # -- drivers -----------------------------------------------------------------------------

    def plan(self, dname: str, action: str) -> None:
        d = self.procs[dname]
        if not d.alive or d.exiting:
            return
        rng = self.rng
        held = sorted(i for i, n in d.handles.items() if n > 0)
        if action == "create":
            r = rng.random()
            params = {
                "name": rng.choice(["a", "b"]) if r < 0.25 else None, "namespace": "",
                "detached": rng.random() < 0.15,
                "recover_retry_times": rng.choice([0, 0, 1, 1, 2, -1]),
                "shape": UNFIT if rng.random() < 0.04 else
                {"CPU": float(rng.choice([0, 500, 1000, 2000])), "Memory": 100.0},
                "timeout_ms": rng.choice([-1, 2000, 10_000]),
                # hosting: calls side by side (a thread pool), or an async instance
                "concurrency": rng.choice([1, 1, 1, 2, 3]),
                "is_async": rng.random() < 0.15,
            }
            if params["is_async"]:
                params["concurrency"] = rng.choice([None, 2])  # None: the default, 1000
            params["unordered"] = (params["is_async"] or params["concurrency"] != 1) \
                and rng.random() < 0.5
            params["off_loop"] = params["is_async"] and rng.random() < 0.5
            params["init_fails"] = self.init_rng.random() < 0.04
            # a process instance: its own process, reached at its own endpoint
            params["isolation"] = "process" if self.proc_rng.random() < 0.3 else None
            # ... whose __init__ may crash its process (each incarnation's by a coin)
            params["init_crashes"] = params["isolation"] and self.proc_rng.random() < 0.2
            if params["shape"] is UNFIT and params["timeout_ms"] < 0:
                params["timeout_ms"] = 2000
            self.create(dname, d.job, params)
        elif action in ("call", "spawn", "save") and held:
            for _ in range(rng.randint(1, 3) if action == "call" else 1):
                self.submit_call(dname, rng.choice(held), action)
        elif action == "pass" and held:
            others = [p for p in self.procs.values() if p.kind == "driver" and p.alive
                      and p.name != dname and not p.exiting]
            if others:
                iid, to = rng.choice(held), rng.choice(others).name
                token = self.new_id("t")
                self.tokens[token] = (iid, to)
                self.say(dname, "pass", iid, to, token)
                self.do(dname, "transit", iid, token)
                self.send(dname, to, "p2p", ("HANDLE", iid, token))
                if rng.random() < 0.5:  # the sender lets its own handle go
                    self.drop_handle(dname, iid)
        elif action == "cancel":  # Ray's cancel of an actor task (InstanceRouter.cancel)
            mine = [c for c, r in self.calls.items() if r["caller"] == dname and
                    not r["settled"] and not r["cancelled"] and r["kind"] == "call"]
            if mine:
                cid = rng.choice(mine)
                rec = self.calls[cid]
                rec["cancelled"] = True
                # a call cancelled before it left this caller must never begin anywhere
                rec["cancelled_unsent"] = rec["sent"] == 0
                self.say(dname, "cancel", cid)
                self.do_unanswered(dname, "cancel", cid)  # InstanceRouter.cancel
        elif action == "drop" and held:
            self.drop_handle(dname, rng.choice(held))
        elif action == "kill" and held:
            iid = rng.choice(held)
            self.say(dname, "terminate", iid)
            self.send(dname, SCHED, self.new_id("rpc-kill-"), P.KillInstance(iid).to_msg())
        elif action == "lease":
            rid = self.new_id("q")
            shape = {"CPU": float(rng.choice([500, 1000, 2000])), "Memory": 100.0}
            self.send(dname, SCHED, f"rpc-lease-{rid}", P.RequestLease(
                dname, shape, rng.choice([-1, 500, 3000]), queue="q").to_msg())
        elif action == "abrupt":
            self.exit_driver(d, abrupt=True)
        elif action == "exit":
            if rng.random() < 0.5:
                for iid in sorted(d.handles):
                    while d.handles.get(iid):
                        self.drop_handle(dname, iid)
            d.exiting, d.exit_at = True, self.now
            self.timer(self.now, "exit", dname)

    def try_exit(self, dname: str) -> None:
        """A graceful exit waits for the driver's calls (``yr.finalize`` after its gets)."""
        d = self.procs[dname]
        if not d.alive:
            return
        waiting = [r for r in self.calls.values() if r["caller"] == dname and not r["settled"]]
        if waiting:
            if self.now > d.exit_at + 300 and all(self.waits_forever(r["iid"]) for r in waiting):
                # timeout_ms=-1 and the room is held by detached instances: a legitimate wait
                self.say(dname, "gives up waiting for", *(r["iid"] for r in waiting))
                self.exit_driver(d, abrupt=True)
                return
            if self.now > d.exit_at + 1000:
                self.fail(f"hang: {dname}'s calls never settle: " + ", ".join(
                    f"{c} on {r['iid']} (sent {r['sent']})" for c, r in self.calls.items()
                    if r["caller"] == dname and not r["settled"]))
            self.timer(self.now + 1.0, "exit", dname)
            return
        self.exit_driver(d, abrupt=False)

    def waits_forever(self, iid: str) -> bool:
        """The instance waits for room with no deadline (``timeout_ms=-1``)."""
        rec = self.lc.instances.get(self.lc.resolve(iid))
        req = self.instances.requests.get(rec.instance_id) if rec is not None else None
        rid = req.request_id if req is not None else None
        w = self.lq.pending.get(rid) if rid is not None else None
        return w is not None and w.deadline is None

    def exit_driver(self, d: Proc, abrupt: bool) -> None:
        if not abrupt:
            self.do(d.name, "flush")  # the last handle report goes out first
        self.say(d.name, "EXIT" + (" (abrupt)" if abrupt else ""))
        d.alive, d.abrupt = False, abrupt
        self.send(d.name, SCHED, "stream", P.CloseStream().to_msg())

    def at_driver(self, dname: str, src: str, msg: tuple | dict) -> None:
        d = self.procs[dname]
        if type(msg) is dict:  # protocol.py messages, and rpc replies on their connection
            op = msg["op"]
            if op == P.TASK_DONE:
                return self.call_answered(dname, msg)
            if op == REPLY:
                return self.rpc_answered(d, msg)
            if op == P.WORKER_LOST:  # the scheduler says the worker is gone
                self.do_unanswered(dname, "channel_lost", msg["worker"])
            elif op == P.REVOKE_LEASES:
                for hid in msg["lease_ids"]:
                    if hid in d.leases:
                        self.timer(self.now + self.rng.uniform(0, 0.1), "return-lease",
                                   (dname, hid))
            elif op != P.WORKER_EXIT:  # (how a process ended: for errors, not simulated)
                self.fail(f"driver got {msg}")
            return
        op = msg[0]
        if op == "LOST":  # its call channel to a worker or process broke
            self.do_unanswered(dname, "channel_lost", msg[1])
        elif op == "DEPS":
            self.do(dname, "deps_ready", msg[1], msg[2])
        elif op == "CDEPS":
            self.do(dname, "create_deps_ready", msg[1], msg[2])
        elif op == "FLUSH":
            self.do(dname, "flush")
        elif op == "HANDLE":
            _, iid, token = msg
            self.do(dname, "arrived", iid, token)
            self.arrived_tokens.add(token)
            self.add_handle(dname, iid)
        else:
            self.fail(f"driver got {msg}")

    def run_now(self, step: Any, what: str) -> None:
        """Run the coroutine of an async handler that awaits nothing here to its end."""
        try:
            step.send(None)
        except StopIteration:
            return
        step.close()
        self.fail(f"{what} waited for something the world does not simulate")

    def rpc_answered(self, p: Proc, msg: dict) -> None:
        """An rpc's reply (``InstanceRouter._create_rpc`` / ``_locate_rpc``, the lease rpc)."""
        to, result = msg["to"], msg["result"]
        if to == P.CREATE_INSTANCE:
            self.do(p.name, "create_answered", msg["request"]["spec"]["instance_id"], result)
        elif to == P.LOCATE_INSTANCE:
            self.do(p.name, "locate_answered", msg["request"]["instance_id"], result)
        elif to == P.REQUEST_LEASE and result[0] is not None:
            p.leases.add(result[0])
            self.timer(self.now + self.rng.expovariate(1 / 0.5), "return-lease",
                       (p.name, result[0]))

    def call_answered(self, dname: str, msg: dict) -> None:
        """A method call's ``TASK_DONE`` (as ``InstanceRouter.on_done``)."""
        cid, error = msg["task_id"], msg.get("error")
        rec = self.calls[cid]
        # what the executing side answered (the settlement must match one of them)
        rec.setdefault("answers", []).append(ANSWERS.get(type(error), "ok"))
        if rec["cancelled"]:  # InstanceRouter.on_done's rule for a cancelled call's answer
            error = CR.cancelled_answer(cid, error)
        elif type(error) is CancelledError:
            self.fail(f"call {cid} answered {error!r} though it was not cancelled")
        if type(error) is InstanceMovedError:  # it and the calls sent after it come back
            self.do_unanswered(dname, "done", cid, error)
        elif error is not None:
            self.do(dname, "done", cid, error)
        else:
            rec["result"] = msg["results"][0][1]
            self.do(dname, "done", cid)
        rec["answered"] = rec["settled"] == 1

    # -- workers (worker/agent.py, worker/hosting.py) ----------------------------------------

    def at_worker(self, wname: str, src: str, chan: str, msg: tuple | dict) -> None:
        w = self.procs[wname]
        if type(msg) is dict:  # protocol.py messages, and rpc replies on their connection
            op = msg["op"]
            if op in w.channel:  # the agent's call channel table (P.CHANNEL_TO_WORKER)
                return w.channel[op](src, msg)
            if op in w.stream:  # its worker stream table (P.WORKER_STREAM)
                return P.dispatch(w.stream, msg)
            if op == P.STOP_INSTANCE:  # the agent's rpc (WorkerAgent.stop_instance)
                self.say(wname, "stop", msg["instance_id"], msg["reason"])
                self.run_now(P.dispatch(w.agent, msg), f"{wname}'s stop of {msg}")
                return self.send(wname, SCHED, chan, {"op": REPLY, "to": op, "request": msg,
                                                      "result": None})
            if op == P.CANCEL_TASK:  # the agent's (TaskRunner.cancel_task): a call here
                cid = msg["task_id"]
                if cid not in w.ran:  # it has not begun here: it must never begin
                    w.unrun_cancels.add(cid)
                return w.agent[op](src, msg)
            if op == REPLY:
                return self.rpc_answered(w, msg)
            if op in (P.TASK_DONE, P.WORKER_LOST, P.WORKER_EXIT):  # (workers call nothing)
                return None
            return self.fail(f"worker got {msg}")
        op = msg[0]
        if op == "INIT":  # __init__ finished (HostedInstance._construct)        elif op == "INIT":  # __init__ finished (HostedInstance._construct)
            h = w.incs.get((msg[1], msg[2]))
            if h is None or h.stopped is not None:
                return
            if w.parent is not None and self.specs[msg[1]].get("init_crashes") and \
                    self.proc_rng.random() < 0.5:  # its process died in __init__
                return self.process_died(w, msg[1], "it died in __init__", in_init=True)
            h.ready = True
            spec = self.specs[msg[1]]
            if spec.get("init_fails"):
                h.init_raised = True  # the world's own record
                h.init_error = "InitBoom"
            h.constructed(frozenset({"side"}) if spec.get("off_loop") else frozenset())
            error = b"InitBoom" if h.init_error is not None else None  # (a pickled error)
            if w.parent is not None:  # its agent reports where its own process serves
                self.send(w.parent, SCHED, "stream", P.InstanceState(
                    msg[1], P.ALIVE, error, incarnation=msg[2], address=wname).to_msg())
                return
            self.send(wname, SCHED, "stream", P.InstanceState(msg[1], P.ALIVE, error).to_msg())
        elif op == "EXIT":  # the running method ended its process (os._exit)
            self.process_died(w, msg[1], f"{msg[2]} called os._exit")
        elif op == "RUN":  # an executor picks up a call hosting started
            self.run_call(w, *msg[1:])
        elif op == "FINISH":  # ... and it returns
            self.finish_call(w, *msg[1:])
        elif op == "FLUSH":
            self.do(wname, "flush")
        elif op == "CDEPS":
            self.do(wname, "create_deps_ready", msg[1], msg[2])
        elif op != "LOST":  # (workers call nothing: a lost channel changes nothing)
            self.fail(f"worker got {msg}")

    def admit(self, h: SimHosted, cid: str, side: bool) -> None:
        """Hosting started ``cid`` (``side``: on the off-loop executor): an executor thread
        (or the instance's loop) picks it up.  Calls start in the queue's order; with
        concurrency > 1 they may then run (and finish) in any order, as in a thread pool."""
        rec = self.calls[cid]
        if not side:
            self.execs.setdefault((h.iid, h.w.name, h.inc), []).append(
                (rec["caller"], rec["iid"], rec["seq"], cid))
        self.send(h.w.name, h.w.name, f"run-{cid}", ("RUN", h.iid, cid, h.inc, side))

    def run_call(self, w: Proc, iid: str, cid: str, inc: int, side: bool) -> None:
        """The executor runs the call (``HostedInstance._run_call``): unless hosting says
        not (stopped, cancelled), the method begins (its side effects happen now) and it
        returns later (FINISH), so with concurrency > 1 calls run side by side."""
        h = w.incs[(iid, inc)]
        if not h.runs(cid):  # answered (cancelled) or by the stop: the next one starts
            return self.finish_call(w, iid, cid, inc, side, ran=False)
        if not h.ready:
            self.fail(f"hosting: call {cid} on {iid} ran before __init__ finished")
        if h.init_raised:
            self.fail(f"hosting: call {cid} on {iid} ran though its __init__ raised")
        if cid in w.unrun_cancels:
            self.fail(f"hosting: call {cid} on {iid} began after its cancel had arrived")
        rec = self.calls[cid]
        if rec.get("cancelled_unsent"):  # Ray: an actor call cancelled before it is sent
            self.fail(f"cancel: call {cid} on {iid} began on {w.name} though its caller "
                      f"cancelled it before it was sent")
        if rec.get("crashes", 0) > MAX_REDELIVERIES and not rec.get("crash_unknown"):
            self.fail(f"crash: call {cid} on {iid} began again though it was running when its "
                      f"process died {rec['crashes']} times (max_redeliveries "
                      f"{MAX_REDELIVERIES})")
        w.ran.add(cid)
        (h.side_running if side else h.running).add(cid)
        if len(h.running) > h.conc:
            self.fail(f"hosting: {len(h.running)} calls of {iid} run at once on {w.name}, "
                      f"over its concurrency {h.conc}: {sorted(h.running)}")
        self.say(w.name, "run", cid, iid, h.inc, "off the loop" if side else "")
        caller = rec["caller"]
        result = None
        if rec["kind"] == "spawn" and w.parent is None:  # creates a child, returns its handle
            # (a process instance's children are its own runtime's: not simulated)
            rng = self.rng
            child = self.create(w.name, iid, {
                "name": None, "namespace": "", "detached": rng.random() < 0.1,
                "recover_retry_times": rng.choice([0, 1, -1]),
                "shape": {"CPU": float(rng.choice([0, 500])), "Memory": 100.0},
                "timeout_ms": rng.choice([-1, 5000])})
            token = self.new_id("t")
            self.tokens[token] = (child, caller)
            self.do(w.name, "transit", child, token)
            result = (child, token)
            self.timer(self.now + rng.uniform(0, 0.5), "drop", (w.name, child))
        elif rec["kind"] == "save":
            self.send(w.name, SCHED, self.new_id("rpc-save-"), P.SaveState(iid, b"state").to_msg())
        h.results[cid] = result
        if rec["poison"] and w.parent is not None:
            return self.send(w.name, w.name, f"finish-{cid}", ("EXIT", iid, cid))
        self.send(w.name, w.name, f"finish-{cid}", ("FINISH", iid, cid, inc, side))
        return None

    def finish_call(self, w: Proc, iid: str, cid: str, inc: int, side: bool,
                    ran: bool = True) -> None:
        """The call returned (``HostedInstance._answer_result``, then ``_chain``): it answers
        unless the stop answered it, and the queue starts the next one in its place."""
        h = w.incs[(iid, inc)]
        (h.side_running if side else h.running).discard(cid)
        result = h.results.pop(cid, None)
        if ran:
            caller = h.answered(cid)
            if caller is not None:
                self.send(w.name, caller, "call",
                          P.TaskDone.wire(cid, results=[[P.VALUE, result]]))
        if not side:
            nxt = h.finished()
            if nxt is not None:
                h._start(nxt)

    def spawn(self, w: Proc, spec: dict) -> Proc:
        """A process instance's incarnation gets a process of its own (its endpoint), which
        hosts it with its own instance side (``isolated/child.py``)."""
        c = Proc(f"{w.name}.p{self.new_id('')}", "process")
        c.parent = w.name
        self.procs[c.name] = c
        c.hosting(InstanceSide(_HostEdge(self, c)))
        self.say(w.name, "spawns", c.name, spec["instance_id"], spec.get("incarnation", 0))
        c.side.start(dict(spec))
        return c

    def note_crash(self, p: Proc) -> None:
        """Process ``p`` dies: the world's own record of the calls that were running in it
        (each caller must charge them: ``charge_crash``).  Not for a caller whose answer
        from ``p`` is lost with it (the rule's known gap: that finished call is charged in
        place of a running one), nor for off-loop methods (outside the queue's window)."""
        lost = {dst for src, dst, chan in self.busy if src == p.name and chan == "call"}
        for h in p.hosted.values():
            if type(h) is not SimHosted or self.specs[h.iid].get("off_loop"):
                continue
            for cid in sorted(h.running):
                rec = self.calls[cid]
                rec["crashes"] = rec.get("crashes", 0) + 1
                if rec["caller"] in lost:
                    rec["crash_unknown"] = True

    def end_process(self, c: Proc, crashed: bool) -> None:
        """A process instance's process ends: nothing reaches it any more (a crash loses
        what it had not sent yet), and its callers' channels to it break."""
        if crashed:
            self.note_crash(c)
        c.alive = False
        self.say(c.name, "CRASHED" if crashed else "ENDED")
        for key in list(self.busy):
            if c.name == key[1] or (crashed and c.name == key[0]):
                self.links[key].clear()
                del self.busy[key]
        for p in self.procs.values():
            if p.alive and p.kind == "driver":
                self.send("net", p.name, "lost", ("LOST", c.name))

    def process_dies(self) -> None:
        """A seeded crash of a process instance's process (``os._exit``, a segfault) while
        its worker lives: its supervisor reports it, its callers lose their channel."""
        live = sorted((p.name, iid) for p in self.procs.values()
                      if p.alive and p.parent is not None for iid in p.hosted)
        if not live:
            return
        cname, iid = self.proc_rng.choice(live)
        self.process_died(self.procs[cname], iid, "it was killed")

    def process_died(self, c: Proc, iid: str, why: str, in_init: bool = False) -> None:
        """Process ``c`` of ``iid`` died (``in_init``: in ``__init__``): its watcher tells
        the supervisor."""
        sup = self.procs[c.parent].hosted.get(iid)
        self.end_process(c, crashed=True)
        cause = f"its process {c.name} died: {why}"
        if type(sup) is SimSupervisor and sup.child is c:
            sup.died(cause, in_init)
            self.lost_process(iid, cause)

    def kill_worker(self) -> None:
        live = sorted(p.name for p in self.procs.values() if p.kind == "worker" and p.alive)
        if not live:
            return
        wname = self.rng.choice(live)
        self.note_crash(self.procs[wname])
        self.procs[wname].alive = False
        self.say(wname, "KILLED")
        for iid in sorted(i for i, (on, _n) in self.placed.items() if on == wname):
            self.lost_process(iid, f"its worker {wname} was lost")
        for key in list(self.busy):
            if wname in key[:2]:
                self.links[key].clear()
                del self.busy[key]
        for iid in sorted(self.stops.get(wname, ())):  # its STOP rpcs fail
            self.stop_failed(wname, iid)
        for p in self.procs.values():  # the call channels to it break
            if p.alive and p.kind == "driver":
                self.send("net", p.name, "lost", ("LOST", wname))
        for p in list(self.procs.values()):  # its instances' own processes die with it
            if p.alive and p.parent == wname:
                self.end_process(p, crashed=True)
        self.timer(self.now + self.rng.uniform(0.05, 3.0), "left", wname)
        if self.rng.random() < 0.7:
            self.timer(self.now + self.rng.uniform(0, 2.0), "join", None)

    # -- the scheduler: the production adapters' decisions on simulated edges ------------

    def granted(self, holding_id: str) -> None:
        """Every grant only takes what is free (checked right after it)."""
        try:
            M.check_grant(self.lq, holding_id)
        except AssertionError as e:
            self.fail(str(e))

    def at_sched(self, src: str, chan: str, msg: tuple | dict) -> None:
        """An rpc or stream message at the scheduler, dispatched through the tables the
        extension builds (``P.handlers``): the lease service's and the instance service's
        own handlers (an rpc's answer goes back on its connection)."""
        if type(msg) is not dict:  # a task or callback the scheduler's loop runs later
            assert msg[0] == "SOON", msg
            return msg[1]()
        op = msg["op"]
        lc = self.lc
        if op in (P.HANDLE_REFS, P.LOCATE_INSTANCE):
            ids = [msg["instance_id"]] if op == P.LOCATE_INSTANCE else [
                *msg["deltas"], *(i for i, _ in msg.get("transit", ())),
                *(i for i, _ in msg.get("arrived", ()))]
            for i in ids:
                if i not in lc.instances and i not in lc.aliases and i not in lc.graveyard:
                    self.say(SCHED, "creation overtaken by", op, i)
        if op in self.sched_rpc:  # instance_service.RPC_OPS: answered through a callback
            if op == P.CREATE_INSTANCE:
                owner = msg["spec"]["owner"]
                if owner.startswith("job-") and src not in self.jobs:
                    self.say(SCHED, "creation after the job ended", msg["spec"]["instance_id"])
            elif op == P.KILL_INSTANCE:
                self.kills.add(chan)

            def answer(result: Any) -> None:
                if op == P.KILL_INSTANCE:  # counted (every kill answered); the terminating
                    self.kills.discard(chan)  # driver here waits for nothing: not sent
                    return
                self.send(SCHED, src, chan, {"op": REPLY, "to": op, "request": msg,
                                             "result": result})
            return P.dispatch(self.sched_rpc, msg, answer)
        if op == P.REQUEST_LEASE:
            return P.dispatch({P.REQUEST_LEASE: self.rpc_request_lease}, msg, src, chan)
        if op == P.SAVE_STATE:
            try:
                return P.dispatch(self.sched_ops, msg)
            except RuntimeError:  # it ended meanwhile: the rpc raises to the caller
                return None
        if op == REPLY:  # the STOP_INSTANCE rpc returned (or failed): _DaskEdge._stop
            iid = msg["request"]["instance_id"]
            for ws in self.stops.values():
                ws.discard(iid)
            return self.instances.stopped(iid)
        if op == P.CLOSE_STREAM:  # connect_job's end: the job is gone for the adapter at once
            self.jobs.discard(src)
            return self.later_heard(src, self.owner_gone)
        if src in self.jobs:  # its job stream (connect_job's table: HANDLE_REFS's holder)
            return P.dispatch(self.job_stream, {**msg, "holder": src}
                              if op == P.HANDLE_REFS else msg)
        if op in self.sched_stream:  # a worker's stream (Dask adds ``worker``)
            return P.dispatch(self.sched_stream, {**msg, "worker": src})
        return self.fail(f"scheduler got {msg}")

    def stop_failed(self, worker: str, iid: str) -> None:
        """A ``STOP_INSTANCE`` rpc to a dead worker fails (``_DaskEdge._stop`` answers
        ``stopped`` all the same)."""
        self.send("net", SCHED, f"stopfail-{iid}", {
            "op": REPLY, "to": P.STOP_INSTANCE, "request": P.StopInstance(iid, "").to_msg(),
            "result": OSError(f"{worker} is gone")})

    def rpc_request_lease(self, src: str, chan: str, timeout_ms: int, **fields: Any) -> None:
        """``extension.request_lease``: the lease service decides (``request_lease``: refused
        at once, or opened); the answer goes back on the rpc's connection."""
        def answer(result: list) -> None:
            if result[0] is not None:
                self.granted(result[0])
            self.send(SCHED, src, chan, {"op": REPLY, "to": P.REQUEST_LEASE,
                                         "result": result})
        self.leases.request_lease(answer, timeout_ms=timeout_ms, **fields)

    def later_heard(self, who: str, fn: Any) -> None:
        """The adapter knows ``who`` is gone; the machines hear it now or after a seeded
        delay (``M.GONE_DELAYS``, as the task world), so that the race branches run."""
        delay = self.gone_rng.choice(M.GONE_DELAYS)
        if not delay:
            fn(who)
            return
        self.unheard.add(who)
        self.say(SCHED, "gone, heard in", delay, who)
        self.timer(self.now + delay, "heard", (fn, who))

    def owner_gone(self, owner: str) -> None:
        """``connect_job``'s clean-up: the job's leases and instances go."""
        self.unheard.discard(owner)
        self.departures.job_ended(self.procs[owner].job, owner)

    def worker_left(self, wname: str) -> None:
        """Dask removed the worker (``scheduler.workers``); the machines hear it (maybe
        later): extension.on_remove_worker."""
        self.registered.discard(wname)
        self.later_heard(wname, self.worker_heard_left)

    def worker_heard_left(self, wname: str) -> None:
        self.unheard.discard(wname)
        self.shrunk |= M.shrinking(self.lq, wname)  # its node's pool shrinks
        self.departures.worker_removed(wname)  # (the production order; WorkerLost to all)
        for resume in self.gone_waiters.pop(wname, ()):  # extension.worker_gone's event
            resume()

    # -- run ---------------------------------------------------------------------------------

    def run(self) -> None:
        try:
            self._run()
            self.check_quiescent()
            self.check_restart()
            for iid in sorted(self.lc.instances):  # the detached ones: terminate them
                self.send("admin", SCHED, self.new_id("rpc-kill-"), P.KillInstance(iid).to_msg())
            self._run()
            self.check_end()
            self.check_restart()
        except SimFailure:
            raise
        except Exception as e:  # a machine or adapter crashed
            import traceback

            raise SimFailure(f"exception at step {self.step}: {e!r}\n"
                             + traceback.format_exc(limit=-6), self) from e  # type: ignore[arg-type]

    def _run(self) -> None:
        rng = self.rng
        timers, busy = self.timers, self.busy
        while True:
            self.step += 1
            if self.step > MAX_STEPS or self.now > MAX_VIRTUAL_S:
                self.fail(f"livelock: {self.step} steps, virtual {self.now:.1f} s")
            # a timer fires when due (30 %), or early with messages still in flight (slow
            # links: 5 %), otherwise the head of a random link is delivered
            if busy and not (timers and rng.random() < (
                    0.3 if timers[0][0] <= self.now else self.latency)):
                keys = list(busy)
                key = keys[rng.randrange(len(keys))]
                q = self.links[key]
                msg = q.popleft()
                if not q:
                    del busy[key]
                src, dst, chan = key
                self.now += 1e-4
                self.say(dst, "<-", src, *(msg.values() if type(msg) is dict else msg))
                if dst == SCHED:
                    self.at_sched(src, chan, msg)
                elif self.procs[dst].alive:
                    if self.procs[dst].kind != "driver":
                        self.at_worker(dst, src, chan, msg)
                    else:
                        self.at_driver(dst, src, msg)
            elif timers:
                at, _, kind, data = heapq.heappop(timers)
                self.now = max(self.now, at)
                self.fire(kind, data)
            else:
                return
            self.validate()
            if self.now - self.release_checked_at >= 0.1:  # release, as time moves
                self.release_checked_at = self.now
                self.check_holders()
            if self.now != self.checked_at and self.lq.pending:  # progress, as time moves
                self.checked_at = self.now
                try:
                    M.check_granted_in_time(self.lq, self.grantable_since, self.now,
                                            GRANT_WITHIN_S)
                except AssertionError as e:
                    self.fail(str(e))

    def fire(self, kind: str, data: Any) -> None:
        if kind == "plan":
            self.plan(*data)
        elif kind == "exit":
            self.try_exit(data)
        elif kind == "call":
            data()
        elif kind == "lq-tick":
            self.leases.tick()
        elif kind == "gone-timeout":
            data()
        elif kind == "return-lease":
            d, hid = data
            if self.procs[d].alive and hid in self.procs[d].leases:
                self.procs[d].leases.discard(hid)
                self.send(d, SCHED, "stream", P.ReturnLeases([hid]).to_msg())
        elif kind == "drop":
            w, iid = data
            if self.procs[w].alive:
                self.drop_handle(w, iid)
        elif kind == "kill-worker":
            self.kill_worker()
        elif kind == "left":
            self.worker_left(data)
        elif kind == "heard":  # the machines hear of a peer the adapter knows is gone
            data[0](data[1])
        elif kind == "join":
            self.say(self._add_worker(), "JOINED")
        elif kind == "process-dies":
            self.process_dies()
        elif kind == "restart-due":
            self.check_restarted(*data)

    def validate(self) -> None:
        try:
            self.lc.validate()
            self.lq.validate()
            M.check_ledger(self.lq)
            M.check_capacity(self.lq, (), self.shrunk)
            for p in self.procs.values():
                if p.alive:
                    p.order.validate()
                    for h in p.hosted.values():
                        if type(h) is SimHosted:
                            h.queue.validate()
        except AssertionError as e:
            self.fail(f"validate() failed at step {self.step}: {e}")

    def check_holders(self) -> None:
        """Release, from the world's own records: a live process the scheduler counts as a
        holder of an unnamed instance holds it (a handle, an unsettled call), unless a
        message of it is still on its way (to itself: a handle report it batches; to the
        scheduler: the report).  Else the instance would outlive its last handle."""
        lc = self.lc
        candidates = [(iid, rec) for iid, rec in lc.instances.items()
                      if rec.holders and rec.refcounted and rec.state != P.DEAD]
        if not candidates:
            return
        telling = {src for src, dst, _chan in self.busy if dst == SCHED or dst == src}
        held: set | None = None
        for iid, rec in candidates:
            for h in sorted(rec.holders):
                p = self.procs.get(h)
                if p is None or not p.alive or h in telling:
                    continue
                if held is None:
                    held = {(q.name, lc.resolve(i)) for q in self.procs.values() if q.alive
                            for i, n in q.handles.items() if n > 0}
                    held.update((c["caller"], lc.resolve(c["iid"]))
                                for c in self.calls.values() if not c["settled"])
                if (h, iid) not in held:
                    self.fail(f"release: the scheduler counts {h} as a holder of {iid} "
                              f"({rec.state}), yet {h} holds no handle to it and no call on "
                              "it, and has nothing on its way to tell")

    # -- end checks --------------------------------------------------------------------------

    def check_quiescent(self) -> None:
        for cid, rec in self.calls.items():
            caller = self.procs[rec["caller"]]
            if caller.abrupt or (caller.kind == "worker" and not caller.alive):
                continue
            if rec["settled"] != 1:
                self.fail(f"hang: call {cid} on {rec['iid']} never settled (sent {rec['sent']})")
        for (iid, w, inc), runs in self.execs.items():
            last: dict[tuple, int] = {}
            for caller, route, seq, cid in runs:
                if self.calls[cid]["unordered"]:
                    continue  # may pass earlier calls (CallOrder's unordered rule)
                k = (caller, route)
                if seq <= last.get(k, 0):
                    self.fail(f"order: {cid} of {caller} started after a later call in incarnation "
                              f"{inc} of {iid} on {w}: {runs}")
                last[k] = seq
        lc = self.lc
        # a handle pickled to a process that died before it reported the arrival keeps its
        # instance (a known limitation: FINDINGS.md "handles in transit to a dead process")
        lost_tokens = {t for t, (_iid, to) in self.tokens.items() if not self.alive(to)}
        for iid, rec in sorted(lc.instances.items()):
            if rec.state == P.DEAD:
                self.fail(f"{iid} stays DEAD, waiting for a stop that never comes")
            owner = self.procs.get(rec.owner.removeprefix("job-")) if rec.owner.startswith("job-") else None
            if owner is not None and not owner.alive and not rec.detached:
                self.fail(f"{iid} ({rec.state}) outlives its job {rec.owner}: "
                          f"{lc.story.dump(iid)}")
            if lc.releasable(iid):
                self.fail(f"{iid} ({rec.state}) is unheld but was not released")
            for h in sorted(rec.holders):
                p = self.procs.get(h)
                if p is None or not p.alive or iid not in p.order.registered:
                    if rec.refcounted:
                        self.fail(f"{iid} is held by {h}, which is gone or does not hold it")
            stuck = rec.transit - lost_tokens
            if stuck and rec.refcounted and not rec.holders:
                self.fail(f"{iid} is kept by handles in transit that arrived: {sorted(stuck)}")
        for w in self.procs.values():
            if w.kind == "driver" or not w.alive:
                continue
            for iid, h in w.hosted.items():
                rec = lc.instances.get(iid)
                if rec is None or rec.state == P.DEAD or rec.worker != (w.parent or w.name):
                    self.fail(f"orphan: {w.name} hosts {iid} (incarnation {h.inc}) which the "
                              f"lifecycle has {'ended' if rec is None else rec.state + ' on ' + str(rec.worker)}")
            for iid, calls in w.side.early.items():
                if calls and lc.is_live(iid) and lc.instances[iid].worker == w.name:
                    self.fail(f"{w.name} keeps calls for {iid} that never start")

    def check_restart(self) -> None:
        """The scheduler restarts now: it reads back exactly the live detached instances, with
        their names and latest checkpoints, into a fresh lifecycle that validates after each
        event (``durable.restore_events``)."""
        snap = self.durable.store.load()
        live = {iid: rec for iid, rec in self.lc.instances.items()
                if rec.detached and rec.state != P.DEAD}
        if set(snap.instances) != set(live):
            self.fail(f"restart: the store keeps {sorted(snap.instances)}, the live detached "
                      f"instances are {sorted(live)}")
        fresh = L.Lifecycle()
        try:
            for event in D.restore_events(snap):
                fresh.handle(event)
                fresh.validate()
        except AssertionError as e:
            self.fail(f"restart: the read-back lifecycle fails validate(): {e}")
        for iid, rec in live.items():
            back = fresh.instances.get(iid)
            if back is None or back.checkpoint != rec.checkpoint or back.name_key != rec.name_key:
                self.fail(f"restart: {iid} came back as {back} (was {rec})")

    def check_end(self) -> None:
        out = []
        for iid, rec in self.lc.instances.items():
            out.append(f"instance {iid} still {rec.state} on {rec.worker}")
        for hid, h in self.lq.ledger.holdings.items():
            out.append(f"holding {hid} ({h.kind} of {h.owner} on {h.worker}) never released")
        if self.lq.pending:
            out.append(f"requests still pending: {list(self.lq.pending)}")
        if self.leases._answers:
            out.append(f"lease requests never answered: {sorted(self.leases._answers)}")
        for what, left in (("waiters", self.instances.waiters),
                           ("gone_waiters", self.gone_waiters),
                           ("acquires", self.instances.requests)):
            left = {k: v for k, v in left.items() if v}
            if left:
                out.append(f"adapter {what} left: {sorted(map(str, left))}")
        if self.kills:
            out.append(f"kill rpcs never answered: {sorted(self.kills)}")
        if out:
            self.fail("at the end: " + "; ".join(out))

    # -- story -------------------------------------------------------------------------------

    def story(self, tail: int = 60) -> str:
        rows = [f"{step:6d} {now:9.4f} {node:>6}  {' '.join(map(str, what))}"
                for step, now, node, what in self.log[-tail:]]
        out = [self.describe, *rows]
        text = getattr(self, "failure", "") or "\n".join(rows[-10:])
        keys = sorted(set(re.findall(r"\bi\d+\b", text)), key=lambda k: int(k[1:]))
        if keys:
            out.append(f"--- lifecycle story of {', '.join(keys[:6])} ---")
            out.append(self.lc.story.dump(*keys[:6]))
        return "\n".join(out)


def run_call_seed(seed: int) -> CallWorld:
    world = CallWorld(seed)
    world.run()
    return world
