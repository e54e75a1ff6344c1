"""The simulated world: nodes, a virtual clock, FIFO links, timers, faults, and the seeded
choice of what happens next.

One scheduler (a ``LeaseQueue``), 1-3 workers (each a ``SubmitQueue`` for the tasks its own
tasks submit and a ``LeaseGate`` for the tasks pushed to it) and 1-2 drivers (a
``SubmitQueue`` each) exchange the messages of :mod:`yrdask.protocol` over *links*: one FIFO
queue per (sender, receiver, channel), like a TCP connection; each lease request and its
answer travel on a link of their own, as Dask's pooled rpc connections do not keep order with
the streams.  Every step, ``random.Random(seed)`` picks the head of a random non-empty link,
a due timer (a machine's ``WakeAt``, a task computing, a planned submission or fault) or a
jump of the clock.  The scheduler runs the production lease adapter
(``scheduler/lease_service.py``, as ``scheduler/extension.py`` does), every driver and
worker the production submitter (``runtime/submitter.py``'s ``Submitter``, as the runtime
does) and every worker the agent's task side (``worker/task_side.py``'s ``TaskSide``, as
``worker/agent.py`` does), each on a simulated edge.  The messages between them are
``protocol.py``'s, dispatched through tables built as production builds them
(``P.handlers``), and a peer's departure runs the production ``Departures``; the copies of
production wiring still here are listed in docs/state-machines.md ("What the task world's
edges still do by hand"); the rest is I/O (links, virtual-time timers) and the user code
(programs that compute, block in ``yr.get`` and submit children).  In the seeds with resource groups (``scenario.GROUP_SEEDS``) the scheduler
also runs the group machine and its adapter's decisions (``group_adapter.GroupService``), and
the first driver creates groups, runs tasks into their bundles and removes them.  In the
generator seeds (``scenario.GEN_SEEDS``) some tasks are generators, read through the
production ``Stream`` (``runtime/generators.py``) by their submitter; in the ref seeds
(``scenario.REF_SEEDS``) tasks hold refs of others in their arguments, and every process
runs the production object table and reference counter (``runtime/objects.py``,
``runtime/refcount.py``) on a simulated runtime (``_SimRuntime``), their rpcs on links.
"""

from __future__ import annotations

import heapq
import random
from collections import deque
from dataclasses import dataclass
from typing import Any

from tests.sim import machines as M
from tests.sim.programs import Program, UserBoom

from yrdask import protocol as P
from yrdask.runtime.answers import CallerAnswers
from yrdask.runtime.peers import PeerLiveness
from yrdask.scheduler.requests import freeze

from yrdask.errors import CancelledError, ScheduleError, TaskCrashedError, YRRuntimeError

SCHED = "sched"
# What the kernel carries besides protocol.py's messages: an rpc's reply on its connection
# (``{"op": REPLY, "to": the rpc's op, ...}``) and Dask's own worker hooks.
REPLY = "rpc-reply"
ADD_WORKER = "add_worker"
REMOVE_WORKER = "remove_worker"
#: the race branches the world counts (``World.races``; a range run prints their sum)
RACES = ("granted to a requester already gone", "granted on a worker already removed")
HANG_S = 300.0  # virtual seconds with nothing settling while the world is idle: a hang
MAX_VIRTUAL_S = 5000.0
PLACE_WITHIN_S = 0.5  # virtual seconds a group that fits the free capacity may stay unplaced
GRANT_WITHIN_S = 0.25  # virtual seconds a task lease request that fits may stay pending
IDLE_SLACK_S = 0.5  # virtual seconds an idle lease may outstay its lease_idle_s
DEADLINE_SLACK_S = 0.25  # virtual seconds a request may outstay the timeout it asked for


class SimFailure(AssertionError):
    """An invariant broke; ``world`` holds the state for the report."""

    def __init__(self, message: str, world: "World", keys: tuple = ()) -> None:
        super().__init__(message)
        self.message = message
        self.world = world
        self.keys = keys


@dataclass(slots=True, eq=False)
class TaskRec:
    """What the world knows of one submitted task."""

    task_id: str
    proc: str  # the process whose SubmitQueue owns it
    prog: Program
    parent: "Run | None" = None  # the running fan-out waiting for it
    settled: int = 0
    outcome: tuple | None = None  # ("ok", value) or ("error", error object)
    abandoned: bool = False  # its submitter died or exited first
    cancelled: bool = False
    crash_hits: int = 0  # times a worker died while the task was pushed to it
    where: str | None = None  # worker of its last push, until its TASK_DONE arrived
    top: bool = False
    ref: Any = None  # ref seeds: the driver's ref to its result (dropped at the driver's end)
    arg: str | None = None  # ref seeds: the task whose ref its argument holds
    back: Any = None  # ref seeds: the ref its result returned (return_ref)


@dataclass(slots=True, eq=False)
class Consumer:
    """Who reads a generator task's items: the process that submitted it (the driver, or the
    worker running its parent), through the production ``Stream`` (``runtime/generators.py``,
    what ``ObjectRefGenerator`` reads), and what it got so far."""

    rec: TaskRec
    node: "ProcNode"
    stream: Any  # dropped once it is done (the stream's end ref with it)
    handed: int = 0  # refs handed out: items 0 .. handed-1
    total: int = 0  # the sum of their values
    outcome: tuple | None = None  # ("ok", total), ("error", error) or ("dropped", handed)
    armed: bool = False  # a "consume" timer is pending


class Run:
    """One attempt of a task on a worker: the record the task side keeps (as
    ``worker/execution.py``'s ``Execution``), and what the simulated task does."""

    __slots__ = ("task_id", "caller", "msg", "lease_id", "prog", "started", "phase",
                 "children", "pending", "cancelled", "emitted", "args", "borrowed")

    def __init__(self, task_id: str, caller: str, msg: dict) -> None:
        self.task_id = task_id
        self.caller = caller
        self.msg = msg
        self.lease_id = msg["lease_id"]
        self.prog: Program | None = None
        self.started = 0.0
        self.phase = "waiting"  # waiting -> compute -> (blocked -> after) -> done
        self.children: list = []
        self.pending = 0
        self.cancelled = False
        self.emitted = 0  # generators: items yielded in this attempt
        self.args: tuple | None = None  # ref seeds: its unpickled arguments (refs borrowed)
        self.borrowed: list = []  # the counted refs among them (TaskDone.refs)

    def cancel(self) -> None:
        """``Execution.cancel``: a waiting task never runs, a running one stops."""
        self.cancelled = True


class Node:
    """A process: the scheduler, a worker or a driver."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.alive = True
        self.wake: set[float] = set()  # WakeAt times already armed (per machine kind)


class SchedNode(Node):
    """The scheduler: the production lease adapter (``LeaseService``, which
    ``scheduler/extension.py`` runs) around the lease queue, on a simulated edge."""

    def __init__(self, world: "World") -> None:
        super().__init__(SCHED)
        from yrdask.scheduler.lease_service import LeaseService

        self.queue = M.new_lease_queue()
        self.jobs: set[str] = set()  # drivers whose job stream is open (extension.jobs)
        self.workers: set[str] = set()  # workers not removed (scheduler.workers)
        self.service = LeaseService(_SchedEdge(world, self), self.queue)
        # resource groups: the production group adapter's decisions (group_adapter.py)
        self.groups = None
        if world.sc.groups:
            from yrdask.scheduler.group_adapter import GroupService

            self.groups = GroupService(_GroupEdge(world, self), self.queue)
        self.rgm = self.groups.machine if self.groups is not None else None
        # the extension's tables, as it builds them: the lease ops are the service's own
        # handlers; the rpcs answer on their connections (World.rpc_*)
        from yrdask.scheduler.lease_service import STREAM_OPS

        self.stream = P.handlers(STREAM_OPS, self.service)
        from yrdask.scheduler.departures import Departures

        self.departures = Departures(self.service.edge, self.service, None, self.groups)
        self.rpc = {P.REQUEST_LEASE: world.rpc_request_lease,
                    P.CREATE_RESOURCE_GROUP: world.rpc_create_resource_group,
                    P.REMOVE_RESOURCE_GROUP: world.rpc_remove_resource_group}


class _SchedEdge:
    """The lease service's I/O edge in the simulation: the virtual clock and timers, the
    links, and the scheduler's view of jobs and workers (as ``extension._LoopEdge``)."""

    def __init__(self, world: "World", sched: SchedNode) -> None:
        self.world = world
        self.sched = sched

    def now(self) -> float:
        return self.world.now

    def call_at(self, at: float, fn: Any) -> None:
        self.world.arm(self.sched, "sched", at)  # the wake calls service.tick, which fn is

    def send_to_owner(self, owner: str, msg: dict) -> None:
        if owner not in self.sched.jobs and owner not in self.sched.workers:
            return  # no stream to it (extension._send_to_owner)
        self.world.send(SCHED, owner, "stream", msg)

    def has_job(self, owner: str) -> bool:
        return owner in self.sched.jobs

    def broadcast(self, msg: Any, but: str) -> None:
        """``extension._broadcast``: to the open job streams and the workers Dask has."""
        sched, wire = self.sched, msg.to_msg()
        for name, node in self.world.nodes.items():
            if name != but and (name in sched.jobs or name in sched.workers) and node.alive:
                self.world.send(SCHED, name, "stream", wire)

    def is_worker(self, owner: str) -> bool:
        return owner in self.sched.workers

    def after_feed(self) -> None:
        self.world.touched.append(self.sched)
        if self.sched.groups is not None:  # as extension._LoopEdge: capacity may have changed
            self.sched.groups.after_feed()


class _GroupEdge:
    """The group service's I/O edge in the simulation (as ``group_adapter._LoopGroupEdge``):
    the lease service, the links; the task world has no instances to kill."""

    def __init__(self, world: "World", sched: SchedNode) -> None:
        self.world = world
        self.sched = sched

    def grant_pending(self) -> None:
        self.sched.service.tick()

    def kill_instance(self, instance_id: str, reason: str) -> None:
        raise AssertionError(f"no instances in the task world, yet {instance_id} ran in a "
                             f"group: {reason}")

    def send_to_owner(self, owner: str, msg: dict) -> None:
        self.world.group_revoked.update(msg.get("lease_ids", ()))
        self.sched.service.edge.send_to_owner(owner, msg)

    def group_settled(self, group: str) -> None:
        self.world.say(SCHED, ("group settled", group), group)

    def requester_gone(self, owner: str) -> str | None:
        return self.sched.service.requester_gone(owner)


class _SimEntry:
    """A task's result entry (``runtime/objects.py``'s ``Entry`` as the submitter sees it):
    settling it settles the task in the world, which checks exactly-once and the outcome.
    A generator's end entry (``real``) is settled too: its stream watches it."""

    __slots__ = ("world", "node", "task_id", "real")

    def __init__(self, world: "World", node: "ProcNode", task_id: str,
                 real: Any = None) -> None:
        self.world = world
        self.node = node
        self.task_id = task_id
        self.real = real

    def set_result(self, kind: str, payload: Any) -> None:
        self.world.settle(self.node, self.task_id, ("ok", payload))
        if self.real is not None:  # (its callbacks may settle tasks that wait for it)
            self.real.set_result(kind, payload)

    def set_error(self, error: BaseException) -> None:
        self.world.settle(self.node, self.task_id, ("error", error))
        if self.real is not None:
            self.real.set_error(error)


class _AgentShim:
    """What ``WorkerAgent.pack_results`` reads of its agent: the runtime, the inline limit,
    the worker's address and its ``_place`` (the sim's results are small: inline)."""

    __slots__ = ("runtime", "inline_limit", "worker")

    def __init__(self, node: "ProcNode") -> None:
        from types import SimpleNamespace

        self.runtime = node.rt
        assert node.rt is not None
        self.inline_limit = 1 << 16
        self.worker = SimpleNamespace(address=node.name)

    def _place(self, object_id: str, payload: Any) -> list:
        from yrdask.worker.agent import WorkerAgent

        return WorkerAgent._place(self, object_id, payload)  # type: ignore[arg-type]


class _SimRuntime(PeerLiveness, CallerAnswers):
    """What a process's runtime (``runtime.Runtime``) is in the task world: its own parts
    that route the call channels' answers (``CallerAnswers``: a ``TASK_DONE`` to the
    submitter, or the instance router, a ``GENERATOR_ITEM`` to its stream) and carry out a
    lost worker or channel (``PeerLiveness``: the submitter's and router's channel loss, the
    object table's ``process_died``), the real object table (``ObjectTable``), the registry
    of open streams and the loop (here: at once)."""

    def __init__(self, world: "World", node: "ProcNode") -> None:
        from yrdask.runtime.call_order import CallOrder
        from yrdask.runtime.instance_router import InstanceRouter
        from yrdask.runtime.object_table import ObjectTable

        self.world = world
        self.node = node
        self.address = node.name
        self.streams: dict[str, Any] = {}
        self.closed = False
        self.loop_thread = None  # consumers never block here: they take with timeout 0
        self.objects = ObjectTable(self, 1 << 16)
        self.submitter = node.submitter
        self.router = InstanceRouter(self, CallOrder())  # (no instance calls here)
        self.channels: dict[str, _SimChannel] = {}
        self.init_peers()

    def channel(self, address: str) -> "_SimChannel":
        """The call channel to ``address`` (``Runtime.channel``: opened on first use)."""
        chan = self.channels.get(address)
        if chan is None:
            chan = self.channels[address] = _SimChannel(self, address)
        return chan

    def on_loop(self, fn: Any, *args: Any) -> None:
        fn(*args)

    on_loop_later = on_loop

    def free_remote(self, worker: str, object_ids: list) -> None:
        self.world.say(self.address, ("free on", worker, object_ids), *object_ids)

    def refs_message(self, address: str, cls: Any, item: Any) -> None:
        """One item of a ``WaitRefsRemoved`` / ``RefsRemoved`` / ``AddBorrower`` (the
        runtime batches them per loop pass; here each goes at once, on a link of its own
        kind, so they overtake the call channels as rpcs do)."""
        if not self.node.alive or self.node.closed:  # its runtime is gone
            return
        self.world.send(self.address, address, "refs", {"op": "REFS", "kind": cls.__name__,
                                                        "items": [list(item)]})

    def cancel(self, refs: list) -> None:
        for ref in refs:
            self.world.cancel(self.node, ref._id)


class _SimChannel:
    """A call channel (``transport.Channel``) as the runtime keeps it: dropped when its
    worker is removed (``abort``: its reader reports the loss, here at once)."""

    __slots__ = ("rt", "address")

    def __init__(self, rt: Any, address: str) -> None:
        self.rt = rt
        self.address = address

    def abort(self) -> None:
        self.rt.on_channel_lost(self.address, self)


class _SimTimer:
    """A timer armed through an edge (``loop.call_later``'s handle): ``cancel()``."""

    __slots__ = ("fn", "args", "cancelled")

    def __init__(self, fn: Any, args: tuple) -> None:
        self.fn = fn
        self.args = args
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class _NodeEdge:
    """What a process's simulated edges share: the virtual clock and its timers."""

    __slots__ = ("world", "node")

    def __init__(self, world: "World", node: "ProcNode") -> None:
        self.world = world
        self.node = node

    def now(self) -> float:
        return self.world.now

    def call_at(self, at: float, fn: Any) -> _SimTimer:
        handle = _SimTimer(fn, ())
        self.world.timer(max(at, self.world.now), self.node.name, "call", handle)
        return handle


class _ProcEdge(_NodeEdge):
    """The submitter's I/O edge in the simulation (as ``submitter.RuntimeEdge``): the virtual
    clock and timers, the links to the scheduler and the workers."""

    __slots__ = ()

    def call_soon(self, fn: Any, arg: Any) -> None:
        self.world.timer(self.world.now, self.node.name, "call", _SimTimer(fn, (arg,)))

    def request_lease(self, ins: Any, near: str | None, answer: Any) -> None:
        name = self.node.name  # the answer comes back as the rpc's reply (proc_message)
        if self.node.task_side is not None:  # as the WorkerConnector's request_lease
            self.node.task_side.asking(True)
        self.world.send(name, SCHED, f"rpc:{name}/{ins.request_id}", P.RequestLease(
            name, dict(ins.shape), ins.timeout_ms, near, ins.queue, tuple(ins.avoid),
            ins.affinity, ins.request_id).to_msg())

    def push(self, task: Any, lease_id: str, worker: str, slots: int) -> None:
        self.world.check_revoked_push(self.node, task.task_id, lease_id)
        self.world.check_push_target(self.node, task.task_id, worker)
        self.world.tasks[task.task_id].where = worker
        self.world.lease_busy(self.node, task.task_id, lease_id, worker)
        self.node.runtime(self.world).channel(worker)  # (RuntimeEdge.push opens it)
        self.world.send(self.node.name, worker, "call", P.RunTask.wire(  # as RuntimeEdge.push
            task.task_id, lease_id, task.fn_id, None, task.args, task.deps, task.nret,
            task.owner, task.name, slots, task.log_to))

    def send_cancel(self, worker: str, task_id: str, force: bool,
                    recursive: bool = False) -> None:
        self.node.runtime(self.world).channel(worker)
        self.world.send(self.node.name, worker, "call",
                        P.CancelTask(task_id, force, recursive).to_msg())

    def return_leases(self, lease_ids: list) -> None:
        self.world.send(self.node.name, SCHED, "stream",
                        P.ReturnLeases(list(lease_ids)).to_msg())

    def withdraw_requests(self, request_ids: list) -> None:
        self.world.send(self.node.name, SCHED, "stream",
                        P.WithdrawLeaseRequests(self.node.name, list(request_ids)).to_msg())

    def crashed(self, error: Any, entries: list) -> None:
        for entry in entries:  # how the process ended is not modelled: fail at once
            entry.set_error(error)

    def when_exit_known(self, worker: str, then: Any, wait_s: float) -> None:
        then(None)  # not modelled: every loss is an eviction (never the task's own crash)

    def kept_result(self, oid: str, entry: Any, worker: str) -> bool:
        raise AssertionError("results kept on workers (the object plane) are not simulated")

    keeps_copy = entry_of = ensure_fetch = kept_result

    def address(self) -> str:
        return self.node.name

    def local_worker(self) -> str | None:
        return self.node.name if self.node.worker else None

    def prefers_local(self) -> bool:
        # the agent's load rule (worker/agent.py: yr tasks of the worker within
        # local-queue-limit), with a small limit so that forwarding happens too
        return self.node.task_side.load() <= 2

    def cannot(self, ins: Any, error: BaseException) -> None:
        if isinstance(error, SimFailure):
            raise error
        raise SimFailure(f"{self.node.name}'s submitter cannot carry out {ins}: {error!r}",
                         self.world, (getattr(ins, "task_id", ""),)) from error


class _TaskEdge(_NodeEdge):
    """The worker task side's I/O edge in the simulation (as ``agent._AgentEdge``): tasks
    compute in virtual time, answers travel on the call links."""

    __slots__ = ()

    def start(self, run: Run) -> None:
        self.world.start(self.node, run)

    def reply(self, run: Run, msg: dict) -> None:
        self.world.send(self.node.name, run.caller, "call", msg)

    def exit_process(self, run: Run) -> None:
        raise AssertionError("cancel(force=True) is not simulated")

    def notify(self, holding_id: str, blocked: bool) -> None:
        msg = P.LeaseBlocked(holding_id) if blocked else P.LeaseUnblocked(holding_id)
        self.world.send(self.node.name, SCHED, "stream", msg.to_msg())


class ProcNode(Node):
    """A driver or worker process: its Submitter (and SubmitQueue), and for workers the gate
    and tasks."""

    def __init__(self, world: "World", name: str, worker: bool, capacity: dict | None,
                 sq_kwargs: dict) -> None:
        super().__init__(name)
        from yrdask.runtime.submitter import Submitter
        from yrdask.worker.task_side import TaskSide

        self.worker = worker
        self.capacity = capacity
        self.submitter = Submitter(_ProcEdge(world, self),
                                   M.new_submit_queue(name if worker else None, **sq_kwargs,
                                                      keep_revoked_s=world.keep_revoked_s))
        self.submit = self.submitter.machine
        # (as the runtime's: the submitter's and the runtime's own handlers)
        self.stream = P.handlers((P.REVOKE_LEASES,), self.submitter)
        # a worker's task side (worker/task_side.py, as the agent runs it)
        self.task_side = TaskSide(_TaskEdge(world, self), Run, M.new_gate(),
                                  M.new_notices(world.lend_delay)) if worker else None
        self.gate = self.task_side.gate if worker else None
        self.runs: dict[str, Run] = self.task_side.running if worker else {}  # computing
        self.closed = False
        self.rt: Any = None  # its _SimRuntime, made for its first answer, generator or ref
        self.kept: list = []  # ref seeds: argument refs kept after their tasks ended
        # lease id -> (when, keep): the first revoke of a lease it held, a firm one over it
        self.revoked_at: dict[str, tuple[float, bool]] = {}
        self.early_revoked: dict[str, bool] = {}  # lease id -> keep: revoked before its grant
        self.exited = False  # a driver that exited before its work was done
        # drivers
        self.tops: list[str] = []
        self.planned = 0  # submissions still to come

    def runtime(self, world: "World") -> Any:
        if self.rt is None:
            self.rt = _SimRuntime(world, self)
        return self.rt


class World:
    """One seeded scenario (see module docstring)."""

    def __init__(self, seed: int, scenario: Any) -> None:
        self.seed = seed
        self.sc = scenario
        self.rng = random.Random(seed * 7919 + 17)
        # when workers tell the scheduler of blocks (worker/lending.py): a generator of its
        # own, so that the other draws of a seed stay put
        self.lend_delay = random.Random(f"lend-{seed}").choice(M.LEND_DELAYS)
        # how long a revoked queue's only lease is kept (runtime/submit_queue.py rule 4; 0:
        # never), drawn the same way
        self.keep_revoked_s = random.Random(f"keep-{seed}").choice(M.KEEP_REVOKED)
        # how often a lease request's rpc is passed over (M.RPC_LAG): its own generator too
        self.lag_rng = random.Random(f"lag-{seed}")
        # how long the machines hear of a peer after the adapter knows it is gone
        self.gone_rng = random.Random(f"gone-{seed}")
        # race branches taken (a peer gone for the adapter, not yet for the machines)
        self.races: dict[str, int] = dict.fromkeys(RACES, 0)
        self.rpc_lag = self.lag_rng.choice(M.RPC_LAG)
        self.now = 0.0
        self.step = 0
        self.links: dict[tuple, deque] = {}
        self.busy: dict[tuple, None] = {}  # non-empty links, in a deterministic order
        self.timers: list = []
        self._seq = 0
        self.log: list[tuple] = []  # (now, node, text, keys)
        self.nodes: dict[str, Node] = {}
        self.tasks: dict[str, TaskRec] = {}
        self.consumers: dict[str, Consumer] = {}  # generator task id -> its consumer
        self._ids = 0
        self.last_settle = 0.0
        self.errors_raised: dict[str, int] = {}  # task id -> UserBoom raised so far
        self.kills = 0
        self.replacements = 0
        self.touched: list = []
        self.reclaimed: set[str] = set()  # leases ever unblocked (check_capacity)
        self.shrunk: set[str] = set()  # holdings on a node when it lost a process
        self.group_revoked: set[str] = set()  # leases revoked by a group's removal
        self.removed_groups: set[str] = set()  # groups whose removal the scheduler handled
        # (owner, own request id) -> when the scheduler got the owner's withdraw of it
        self.withdraws_seen: dict[tuple, float] = {}
        # timers: (owner, lease id) -> tasks pushed under it whose TASK_DONE has not come
        # back, the worker, and since when it has none (idle in the world's own view)
        self.lease_pushed: dict[tuple, set] = {}
        self.lease_worker: dict[tuple, str] = {}
        self.lease_idle_at: dict[tuple, float] = {}
        self.pushed_under: dict[str, tuple] = {}  # task id -> (owner, lease id)
        self.idle_bound = scenario.sq_kwargs.get("lease_idle_s", 1.0) + IDLE_SLACK_S
        # progress: group name -> since when it has been pending while it fit what was free
        self.placeable_since: dict[str, float] = {}
        self.grantable_since: dict[str, float] = {}  # lease request id -> since it fit
        # timers: lease request id -> the last time a task lease stood in its way
        self.freeable_at: dict[str, float] = {}
        # race branches: (owner, worker) -> when the owner heard the worker was lost
        self.lost_heard: dict[tuple, float] = {}
        # (worker, lease id) -> the runs that started there and have not finished
        self.active: dict[tuple, set] = {}
        self.sched = SchedNode(self)
        self.nodes[SCHED] = self.sched
        for name, cap in scenario.workers:
            self._add_worker(name, cap, at_start=True)
        for d in scenario.drivers:
            node = ProcNode(self, d.name, False, None, scenario.sq_kwargs)
            self.nodes[d.name] = node
            self.sched.jobs.add(d.name)  # its job stream is open
            for t, progs in d.batches:
                node.planned += 1
                self.timer(t, d.name, "submit", progs)
            if d.exit_at is not None:
                self.timer(d.exit_at, d.name, "exit", None)
            for t, index in d.cancels:
                self.timer(t, d.name, "cancel", index)
        self.groups = scenario.groups if self.sched.groups is not None else []
        for g in self.groups:  # the first driver creates them, then runs tasks in them
            d0 = self.nodes[scenario.drivers[0].name]
            d0.planned += 1
            self.timer(g.at, d0.name, "rg-create", g)
        for t, what in scenario.faults:
            self.timer(t, SCHED, what, None)

    # -- plumbing --------------------------------------------------------------------------

    def say(self, node: str, text: Any, *keys: str) -> None:
        self.log.append((self.now, node, text, keys))

    def timer(self, at: float, node: str, kind: str, data: Any) -> None:
        self._seq += 1
        heapq.heappush(self.timers, (at, self._seq, node, kind, data))

    def send(self, src: str, dst: str, chan: str, msg: dict) -> None:
        dnode = self.nodes.get(dst)
        if dnode is None or not dnode.alive:
            self.say(src, ("dropped (dead)", dst, msg), msg.get("task_id", ""))
            if msg.get("op") == P.RUN_TASK and msg["task_id"] in self.tasks:
                rec = self.tasks[msg["task_id"]]  # pushed to a dead worker: lost with it
                rec.crash_hits += 1
                rec.where = None
            if chan == "refs":  # the rpc fails: the sender learns the process died
                self.timer(self.now, src, "refs-failed", dst)
            if chan == "call":  # connecting to a dead worker fails: the channel is lost
                self.send("net", src, "lost", {"op": "CHANNEL_LOST", "worker": dst})
            return
        key = (src, dst, chan)
        q = self.links.get(key)
        if q is None:
            q = self.links[key] = deque()
        q.append(msg)
        self.busy[key] = None

    def new_id(self, prefix: str) -> str:
        self._ids += 1
        return f"{prefix}{self._ids}"

    # -- the run loop ----------------------------------------------------------------------

    def run(self) -> None:
        """Run until quiescent, then check the end state; raises SimFailure."""
        try:
            self._run()
        except SimFailure:
            raise
        except Exception as e:  # a machine or adapter crashed: report it with the story
            import traceback

            keys = tuple(k for k in (getattr(e, "args", None) or ())[:1] if isinstance(k, str))
            raise SimFailure(f"exception at step {self.step}: {e!r}\n"
                             + "".join(traceback.format_exc(limit=-6)), self, keys) from e

    def _run(self) -> None:
        rng = self.rng
        refs = self.sc.refs
        max_steps = 40_000 + 2_000 * len(self.tasks_planned())
        checked_at = -1.0
        while True:
            self.step += 1
            # time moved: the checks of time, before the step (in which a timer that fires
            # late would return the lease it held too long)
            if self.now != checked_at:
                checked_at = self.now
                if self.lease_idle_at:
                    self.check_idle_leases()
                if self.groups:
                    self.check_groups_placed()
                if self.sched.queue.pending:
                    self.check_leases_granted()
                    self.check_deadlines()
                self.check_offered()
            if self.step > max_steps or self.now > MAX_VIRTUAL_S:
                raise SimFailure(f"livelock: {self.step} steps, virtual time {self.now:.1f} s, "
                                 "tasks unsettled", self, self.unsettled())
            busy = self.busy
            due = bool(self.timers) and self.timers[0][0] <= self.now
            if not busy and not due:
                if not self.timers:
                    break
                if self._idle() and self.now - self.last_settle > HANG_S:
                    break
                self.now = self.timers[0][0]
                continue
            if busy and rng.random() < 0.05:  # time passes while messages are in flight
                self.now += rng.uniform(0.0, 0.02)
                due = bool(self.timers) and self.timers[0][0] <= self.now
            key = None  # None: the next timer fires
            if busy and (not due or rng.random() < 0.75):
                keys = list(busy)
                key = keys[rng.randrange(len(keys))] if len(keys) > 1 else keys[0]
                if self.rpc_lag and key[1] == SCHED and key[2].startswith("rpc:") \
                        and self.lag_rng.random() < self.rpc_lag:
                    key = self._lagged(key, keys)
            if key is not None:
                q = self.links[key]
                msg = q.popleft()
                if not q:
                    del busy[key]
                self.deliver(key, msg)
            else:
                self.fire(*heapq.heappop(self.timers)[2:])  # (no local keeps its data alive)
            self.validate_touched()
            self.check_conservation()
            if refs:
                self.check_borrowers()
        self.check_quiescent()

    def _lagged(self, key: tuple, keys: list) -> tuple | None:
        """A slow rpc (``rpc_lag``): another link's message goes first, or, with none, time
        passes to the next timer if it is due within 20 ms (None: that timer fires this step,
        nothing is delivered)."""
        others = [k for k in keys if k != key]
        if others:
            return others[self.lag_rng.randrange(len(others))]
        if not self.timers or self.timers[0][0] > self.now + 0.02:
            return key
        self.now = max(self.now, self.timers[0][0])
        return None

    def _idle(self) -> bool:
        """Nothing but machine timers left: no message, no computing task, no plan."""
        return not self.busy and all(kind == "wake" or kind == "call"
                                     for _, _, _, kind, _ in self.timers)

    def tasks_planned(self) -> list:
        return [p for d in self.sc.drivers for _, progs in d.batches for p in progs]

    # -- timers ----------------------------------------------------------------------------

    def fire(self, name: str, kind: str, data: Any) -> None:
        node = self.nodes.get(name)
        if node is None or not node.alive:
            return
        if kind == "wake":
            what, at = data
            node.wake.discard((what, at))
            if what == "sched":
                self.sched.service.tick()
        elif kind == "call":  # a submitter's timer (its Tick) or deferred TASK_DONE
            if not data.cancelled:
                self.touched.append(node)
                data.fn(*data.args)
        elif kind == "refs-failed":  # Runtime._send_refs: OSError -> process_died
            if node.rt is not None and not node.closed:
                self.touched.append(node)
                node.rt.objects.process_died(data)
                if not node.worker:
                    self.maybe_close(node)
        elif kind == "reread":  # yr.get of a result again, while the driver holds it
            rec, payload = data
            if rec.ref is not None and not node.closed:
                self.read_result(node, rec, payload, again=False)
        elif kind == "unkeep":  # the task's kept argument refs go
            node.kept.remove(data)
            self.touched.append(node)
        elif kind == "consume":
            data.armed = False
            self.consume(node, data)
        elif kind == "run":
            run = data
            if node.runs.get(run.task_id) is run:
                self.advance(node, run)
        elif kind == "submit":
            node.planned -= 1
            if not node.closed:
                for prog in data:
                    node.tops.append(self.submit(node, prog, None, top=True))
                self.maybe_close(node)  # (a task whose ref argument failed settles at once)
        elif kind == "exit":
            if not node.closed:
                node.exited = True
                self.say(name, "driver exits early")
                self.close_driver(node)
        elif kind == "close":
            if not node.closed and not (self.sc.refs and node.rt is not None
                                        and node.rt.objects.entries):
                self.close_driver(node)  # (in ref seeds: again at each borrower's answer)
        elif kind == "cancel":
            if not node.closed and data < len(node.tops):
                rec = self.tasks[node.tops[data]]
                if not rec.settled:
                    self.say(name, ("cancel", rec.task_id), rec.task_id)
                    self.cancel(node, rec.task_id)
        elif kind == "rg-create":  # yr.create_resource_group: an rpc, answered at once
            if not node.closed:
                self.send(name, SCHED, f"rpc:{name}/rg-{data.name}", P.CreateResourceGroup(
                    name, data.name, data.bundles, data.strategy).to_msg())
        elif kind == "rg-remove":  # yr.remove_resource_group
            if not node.closed:
                self.send(name, SCHED, f"rpc:{name}/rg-rm-{data.name}",
                          P.RemoveResourceGroup(data.name).to_msg())
        elif kind == "heard":  # the machines hear of a peer the adapter knows is gone
            data[0](data[1])
        elif kind == "kill":
            self.kill_random_worker()
        elif kind == "join":
            self._add_worker(data[0], data[1], at_start=False)

    def arm(self, node: Node, what: str, at: float) -> None:
        key = (what, at)
        if key in node.wake:
            return
        node.wake.add(key)
        self.timer(max(at, self.now), node.name, "wake", key)

    # -- delivery --------------------------------------------------------------------------

    def deliver(self, key: tuple, msg: dict) -> None:
        src, dst, chan = key
        node = self.nodes.get(dst)
        op = msg["op"]
        if node is None or not node.alive or getattr(node, "closed", False) and dst != SCHED:
            self.say(dst, ("lost on arrival", src, op), msg.get("task_id", ""),
                     msg.get("lease_id", ""))
            if op == "REFS" and msg["kind"] != "Added":  # the rpc fails at its sender
                self.timer(self.now, src, "refs-failed", dst)
            return
        self.say(dst, ("<-", src, msg), msg.get("task_id", ""), msg.get("lease_id", ""))
        if dst == SCHED:
            self.sched_message(src, msg)
        elif op == P.RUN_TASK:
            self.pushed(node, src, msg)
        elif op == P.TASK_DONE:
            self.task_done(node, src, msg)
        elif op == P.GENERATOR_ITEM:
            self.generator_item(node, msg)
        elif op == "REFS":
            self.refs_delivery(node, src, msg)
        elif op == P.CANCEL_TASK:  # (agent.cancel_task: the task side decides)
            self.touched.append(node)
            node.task_side.cancel(msg["task_id"], bool(msg.get("force")))
        else:
            self.proc_message(node, src, msg)

    # -- scheduler adapter (scheduler/extension.py) -----------------------------------------

    def sched_message(self, src: str, msg: dict) -> None:
        """A message at the scheduler, dispatched as the extension dispatches it: the lease
        ops through the production table (``P.handlers(lease_service.STREAM_OPS, ...)``:
        the ``LeaseService``'s own handlers), the rpcs through theirs, the end of a job
        stream as ``connect_job``'s end, Dask's worker hooks as ``on_add_worker`` /
        ``on_remove_worker``.  What the world checks on the way is all it adds."""
        op = msg["op"]
        sched = self.sched
        if op in sched.stream:
            if op == P.WITHDRAW_LEASE_REQUESTS:
                for own_id in msg["request_ids"]:
                    self.withdraws_seen.setdefault((src, own_id), self.now)
            elif op == P.LEASE_UNBLOCKED:
                self.reclaimed.add(msg["lease_id"])  # may take its CPU back over capacity
            P.dispatch(sched.stream, msg)
        elif op in sched.rpc:
            P.dispatch(sched.rpc, msg, src)
        elif op == P.CLOSE_STREAM:  # connect_job's end: the job is gone for the adapter
            sched.jobs.discard(src)
            self.later_heard(("owner gone", src), self.owner_gone, src)
        elif op == ADD_WORKER:
            sched.workers.add(msg["worker"])
            sched.service.worker_joined(msg["worker"], dict(msg["capacity"]),
                                        node=self.host_of(msg["worker"]))
        elif op == REMOVE_WORKER:  # Dask removed it (scheduler.workers), then our hook runs
            w = msg["worker"]
            sched.workers.discard(w)
            self.later_heard(("worker left", w), self.worker_left, w)
        else:
            raise AssertionError(f"unknown message to the scheduler: {msg}")

    def later_heard(self, what: tuple, fn: Any, who: str) -> None:
        """The adapter knows ``who`` is gone (its stream closed, Dask removed it); the
        machines hear it now or after a seeded delay (``M.GONE_DELAYS``: Dask runs other
        plugins' hooks, which may await, before ours), so that grants and answers for a
        peer already gone to the adapter, but not yet to the machines, happen."""
        delay = self.gone_rng.choice(M.GONE_DELAYS)
        if not delay:
            fn(who)
            return
        self.say(SCHED, (what[0], "heard in", delay), who)
        self.timer(self.now + delay, SCHED, "heard", (fn, who))

    def owner_gone(self, owner: str) -> None:
        """``connect_job``'s clean-up (the production ``Departures``)."""
        self.sched.departures.job_ended(owner, owner)

    def worker_left(self, w: str) -> None:
        """``extension.on_remove_worker`` (the production ``Departures``)."""
        self.shrunk |= M.shrinking(self.sched.queue, w)  # its node's pool shrinks
        self.sched.departures.worker_removed(w)

    def rpc_request_lease(self, src: str, timeout_ms: int, **fields: Any) -> None:
        """``extension.request_lease``: the lease service decides (``request_lease``: refused
        at once, or opened); its answer goes back on the rpc's own connection."""
        own_id = fields.get("request_id", "")
        service = self.sched.service
        affinity = freeze(fields.get("affinity"))
        opened: list[bool] = []  # (an answer before request_lease returned: no race)

        def answer(result: list) -> None:
            if result[0] is None and opened and result[1] == service.requester_gone(src):
                self.races["granted to a requester already gone"] += 1
            elif result[0] is not None and result[1] not in self.sched.workers:
                self.races["granted on a worker already removed"] += 1
            if result[0] is not None:
                at = self.withdraws_seen.get((src, own_id))
                if at is not None:  # scheduler/leases.py: a withdraw that overtook it
                    raise SimFailure(
                        f"withdraw: the scheduler granted {src}'s lease request {own_id} "
                        f"({result[0]}) at {self.now:.3f} s, withdrawn by its owner at "
                        f"{at:.3f} s", self, (own_id, result[0]))
                try:
                    M.check_grant(self.sched.queue, result[0])
                    M.check_bundle_grant(self.sched, result[0], affinity)
                except AssertionError as e:
                    raise SimFailure(str(e), self, (result[0],)) from e
            self.send(SCHED, src, f"rpc:{src}/{own_id}", {
                "op": REPLY, "to": P.REQUEST_LEASE, "request_id": own_id, "result": result})
        service.request_lease(answer, timeout_ms=timeout_ms, **fields)
        opened.append(True)

    def rpc_create_resource_group(self, src: str, owner: str, name: str, bundles: Any,
                                  strategy: str = "PACK", **more: Any) -> None:
        """``ResourceGroupService.create_resource_group``: the group service decides."""
        why = self.sched.groups.create(owner, name, bundles, strategy, **more)
        if why and src in self.sched.jobs:  # only an owner gone already may be refused
            raise SimFailure(f"group {name} refused: {why}", self, (name,))
        self.send(SCHED, src, f"rpc:{src}/rg-{name}", {
            "op": REPLY, "to": P.CREATE_RESOURCE_GROUP, "name": name, "result": why})

    def rpc_remove_resource_group(self, src: str, name: str) -> None:
        """``ResourceGroupService.remove_resource_group`` (its reply is not waited for)."""
        self.removed_groups.add(name)
        self.sched.groups.remove(name)

    # -- the submitter's world (runtime/submitter.py runs on _ProcEdge) ---------------------

    def submit(self, node: ProcNode, prog: Program, parent: Run | None, top: bool = False) -> str:
        """A task submitted by ``node`` (as ``Runtime.submit_task`` builds it)."""
        from yrdask.runtime.submitter import Task

        task_id = self.new_id(f"{node.name}-t")
        self.tasks[task_id] = TaskRec(task_id, node.name, prog, parent, top=top)
        self.say(node.name, ("submit", prog.path), task_id)
        name = f"f{prog.path}"
        affinity = P.bundle_wire(prog.group, prog.bundle) if prog.group is not None else ()
        entry, nret = _SimEntry(self, node, task_id), 1
        if prog.generator:  # as Runtime.submit_task: its stream watches its end entry
            from yrdask.runtime.generators import Stream

            rt = node.runtime(self)
            end_ref = rt.objects.new_ref(task_id)
            stream = Stream(rt, task_id, end_ref, f"function {name}")
            entry.real, nret = end_ref._entry, P.STREAMING
            self.consumers[task_id] = Consumer(self.tasks[task_id], node, stream)
        blob, nested = b"", None
        if self.sc.refs:  # as Runtime.submit_task: a real entry, refs in the args
            blob, nested = self.ref_task(node, self.tasks[task_id], entry, parent)
        task = Task(task_id, name, b"", name, blob, [], [entry],
                    [f"{task_id}.0"], nret, dict(prog.shape),
                    (prog.shape, prog.timeout_ms, prog.slots, affinity), prog.timeout_ms,
                    prog.retries, node.name, max_crashes=prog.max_crashes)
        if nested:  # yr's rule: refs nested in the arguments gate the start
            task.nested, task.held = nested, list(nested)
        self.touched.append(node)
        node.submitter.submit(task)
        return task_id

    def proc_message(self, node: ProcNode, src: str, msg: dict) -> None:
        """A message to a driver's or worker's runtime: to its submitter."""
        op = msg["op"]
        submitter = node.submitter
        self.touched.append(node)
        if op == REPLY and msg["to"] == P.REQUEST_LEASE:  # the request's rpc returned
            if node.task_side is not None:
                node.task_side.asking(False)
            lease_id, where = msg["result"][:2]
            submitter.lease_answer(msg["request_id"], lease_id, where)
            if lease_id is not None:
                self.lease_granted(node, lease_id, where)
                keep = node.early_revoked.pop(lease_id, None)
                if keep is not None and lease_id in getattr(node.submit, "leases", {}):
                    node.revoked_at[lease_id] = (self.now, keep)  # revoked from now on
        elif op == P.REVOKE_LEASES:
            keep = msg.get("keep", False)
            held = getattr(node.submit, "leases", {})
            for lid in msg["lease_ids"]:
                if lid in held:
                    if not keep or lid not in node.revoked_at:
                        node.revoked_at[lid] = (self.now, keep)
                else:  # before its grant (or after its return): applied with the grant
                    node.early_revoked[lid] = keep and node.early_revoked.get(lid, True)
            P.dispatch(node.stream, msg)
        elif op in (P.WORKER_LOST, "CHANNEL_LOST"):
            self.lost_heard.setdefault((node.name, msg["worker"]), self.now)
            rt = node.runtime(self)
            if op == P.WORKER_LOST:  # (the connector's worker_lost: the runtime's, peers.py)
                rt.worker_lost(msg["worker"], msg.get("server_id", ""))
            else:  # the channel's reader ended (transport.Channel: on_lost)
                rt.on_channel_lost(msg["worker"])
            self.leases_lost(node, msg["worker"])
            if op == P.WORKER_LOST and not node.worker and node.planned == 0:
                self.maybe_close(node)  # (its process_died may free what it borrowed)
        elif op == REPLY and msg["to"] == P.CREATE_RESOURCE_GROUP:
            if msg["result"]:  # only ever refused to an owner that is gone
                raise SimFailure(f"{node.name} is running, yet its group {msg['name']} was "
                                 f"refused as if it were gone: {msg['result']}", self,
                                 (msg["name"],))
            node.planned -= 1  # create_resource_group returned: run tasks in the group
            g = next(g for g in self.groups if g.name == msg["name"])
            for prog in g.progs:
                node.tops.append(self.submit(node, prog, None, top=True))
            self.timer(max(self.now, g.remove_at), node.name, "rg-remove", g)
        else:
            raise AssertionError(f"unknown message to {node.name}: {msg}")

    def task_done(self, node: ProcNode, src: str, msg: dict) -> None:
        """A ``TASK_DONE`` wire message from worker ``src``: the runtime's own routing
        (``CallerAnswers.on_channel_message``, as ``Runtime``'s)."""
        task_id = msg["task_id"]
        rec = self.tasks.get(task_id)
        if rec is not None and rec.where == src:
            rec.where = None
        self.lease_task_back(task_id)
        self.touched.append(node)
        node.runtime(self).on_channel_message(msg)
        if self.sc.refs and not node.worker:  # a cancelled task's refs may go only now
            self.maybe_close(node)

    def settle(self, node: ProcNode, task_id: str, outcome: tuple) -> None:
        rec = self.tasks.get(task_id)
        if rec is None or rec.proc != node.name:
            raise SimFailure(f"{node.name} settled {task_id}, a task it never queued", self,
                             (task_id,))
        rec.settled += 1
        self.say(node.name, ("settled", outcome), task_id)
        if rec.settled > 1:
            raise SimFailure(f"task {task_id} settled twice: {rec.outcome} then {outcome}",
                             self, (task_id,))
        if rec.prog.generator and outcome[0] == "ok":
            from yrdask.serialization import loads

            outcome = ("ok", loads(outcome[1]))  # the end: the item count
        elif self.sc.refs and outcome[0] == "ok":
            outcome = ("ok", self.read_result(node, rec, outcome[1]))
        rec.outcome = outcome
        self.last_settle = self.now
        self.check_outcome(rec)
        c = self.consumers.get(task_id)
        if c is not None and c.outcome is None:  # its consumer goes on to the stream's end
            self.wake_consumer(c)
            return
        self.child_done(node, rec)  # (a dropped generator's consumer is done already)

    def child_done(self, node: ProcNode, rec: TaskRec) -> None:
        """``rec`` is over for whoever waits for it (settled; a generator: consumed)."""
        run = rec.parent
        if run is not None:
            run.pending -= 1
            wnode = self.nodes[node.name]
            if run.pending == 0 and wnode.runs.get(run.task_id) is run:
                self.unblock(wnode, run)
        elif rec.top:
            self.maybe_close(node)

    def maybe_close(self, node: ProcNode) -> None:
        """A driver ends once its work is done: every top-level task settled (and consumed);
        in ref seeds it then drops its refs, and ends once its object table is empty (every
        borrower answered: the objects are freed)."""
        if node.closed or node.planned or not all(
                self.tasks[t].settled and (t not in self.consumers
                                           or self.consumers[t].outcome is not None)
                for t in node.tops):
            return
        if self.sc.refs and node.rt is not None:
            for t in node.tops:
                rec = self.tasks[t]
                rec.ref = rec.back = None
        self.timer(self.now, node.name, "close", None)  # after this event (its refs go)

    def check_outcome(self, rec: TaskRec) -> None:
        kind, got = rec.outcome
        want_kind, want = rec.prog.expected()
        if rec.arg is not None:  # its argument's task settled first (nested refs gate it)
            from yrdask.errors import DependencyError

            arg = self.tasks[rec.arg]
            failed = arg.outcome is not None and arg.outcome[0] == "error"
            if isinstance(got, DependencyError) or (failed and not isinstance(
                    got, CancelledError)):
                if not failed or not isinstance(got, DependencyError) \
                        or got.dependency != rec.arg:
                    raise SimFailure(f"task {rec.task_id} ({rec.prog.path}) whose argument "
                                     f"holds the ref of {rec.arg} ({arg.outcome}) ended with "
                                     f"{got!r}", self, (rec.task_id, rec.arg))
                return
        if kind == "ok" and rec.prog.generator:  # the end's count: every item yielded
            if want_kind != "ok" or got != rec.prog.items:
                raise SimFailure(f"generator {rec.task_id} ({rec.prog.path}) ended with "
                                 f"{got!r} items, expected {want_kind} "
                                 f"({rec.prog.items} items)", self, (rec.task_id,))
            return
        if kind == "ok":
            if (want_kind, want) != ("ok", got):
                raise SimFailure(f"task {rec.task_id} ({rec.prog.path}) gave {got!r}, "
                                 f"expected {want_kind} {want!r}", self, (rec.task_id,))
            return
        if isinstance(got, CancelledError):
            if not rec.cancelled and not _cancel_below(self, rec):
                raise SimFailure(f"task {rec.task_id} failed with {got!r} but was never "
                                 "cancelled", self, (rec.task_id,))
        elif isinstance(got, ScheduleError) and rec.prog.group is not None:
            # refused in its group: removed (the right error names it), or never placed
            g = rec.prog.group
            removed = f"resource group {g!r} does not exist (removed: " in str(got)
            late = (f"waits for resource group {g!r}" in str(got)  # at its deadline
                    or f"does not fit into resource group {g!r}" in str(got))
            if not (removed and g in self.removed_groups or late and not removed):
                raise SimFailure(f"task {rec.task_id} ({rec.prog.path}) in group {g} refused "
                                 f"with the wrong error: {got}", self, (rec.task_id, g))
        elif isinstance(got, ScheduleError):
            if want != "schedule":
                raise SimFailure(f"task {rec.task_id} ({rec.prog.path}) refused: {got}", self,
                                 (rec.task_id,))
        elif type(got) in (YRRuntimeError, TaskCrashedError):
            if not self.kills:
                raise SimFailure(f"task {rec.task_id} failed with {got!r} though no worker "
                                 "died", self, (rec.task_id,))
            if type(got) is TaskCrashedError and str(got).startswith(f"task {rec.task_id} "):
                # its own crash bound: the task's max_crashes, else the queue's
                bound = rec.prog.max_crashes
                if bound is None:
                    bound = self.sc.sq_kwargs["max_crash_retries"]
                if bound == -1 or got.crashes != bound + 1 or got.crashes > rec.crash_hits:
                    raise SimFailure(
                        f"crash bound: task {rec.task_id} (max_crashes "
                        f"{rec.prog.max_crashes}, queue bound "
                        f"{self.sc.sq_kwargs['max_crash_retries']}) failed after "
                        f"{got.crashes} crashes ({rec.crash_hits} workers died while it was "
                        f"pushed there): {got}", self, (rec.task_id,))
        elif isinstance(got, UserBoom):
            if want != "user":
                raise SimFailure(f"task {rec.task_id} ({rec.prog.path}) failed with {got!r}, "
                                 f"expected {want_kind} {want!r}", self, (rec.task_id,))
        else:
            raise SimFailure(f"task {rec.task_id} failed with an unexpected {got!r}", self,
                             (rec.task_id,))

    # -- the worker's task side (worker/task_side.py runs on _TaskEdge) ---------------------

    def gate_handle(self, node: ProcNode, event: Any) -> None:
        self.touched.append(node)
        node.task_side.feed(event)

    def pushed(self, node: ProcNode, caller: str, msg: dict) -> None:
        """``agent.run_task``: the task side takes the ``RunTask`` (never twice)."""
        self.touched.append(node)
        if not node.task_side.run_task(caller, msg):
            raise SimFailure(f"task {msg['task_id']} pushed to {node.name} while still there",
                             self, (msg["task_id"],))

    def start(self, node: ProcNode, run: Run) -> None:
        """The task side starts ``run`` (``agent._execute_gated`` on a task thread)."""
        task_id = run.task_id
        run.started = self.now
        if run.cancelled:  # cancelled while it waited: it never runs
            return self.finish(node, run, "error", CancelledError(f"task {task_id} cancelled"))
        run.prog = self.tasks[task_id].prog
        if run.msg.get("args"):
            self.borrow_args(node, run)
        run.phase = "compute"
        self.check_slots(node, run)
        node.runs[task_id] = run
        self.say(node.name, ("start", run.prog.path, "lease", run.lease_id), task_id,
                 run.lease_id)
        self.timer(self.now + self._pace(run.prog), node.name, "run", run)

    # -- progress: a group that fits is placed within a bounded time ------------------------

    def check_groups_placed(self) -> None:
        """A pending group whose unplaced bundles fit the capacity free now (by the world's
        own search, its strategy kept) is placed within ``PLACE_WITHIN_S`` of virtual time:
        else its tasks would end in a ScheduleError for a group that fit."""
        from yrdask.protocol import RG_PENDING

        rgm = self.sched.rgm
        ledger = rgm.ledger
        for g in rgm.groups.values():
            if g.state != RG_PENDING:
                self.placeable_since.pop(g.name, None)
                continue
            free = {a: {r: ws.free(r) for r in ws.capacity} for a, ws in ledger.workers.items()}
            fixed = [b.worker for b in g.bundles if b.worker is not None]
            todo = [b.shape for b in g.bundles if b.worker is None]
            if not _placeable(g.strategy, todo, fixed, free):
                self.placeable_since.pop(g.name, None)
                continue
            since = self.placeable_since.setdefault(g.name, self.now)
            if self.now - since > PLACE_WITHIN_S:
                raise SimFailure(f"progress: group {g.name} ({g.strategy}, bundles "
                                 f"{[b.shape for b in g.bundles]}) has fit the free capacity "
                                 f"since {since:.3f} s, yet is still pending at "
                                 f"{self.now:.3f} s: {free}", self, (g.name,))

    def check_leases_granted(self) -> None:
        """A task lease request (no affinity) that fits the free capacity of a node with a
        process it does not avoid is granted within ``GRANT_WITHIN_S`` of virtual time."""
        try:
            M.check_granted_in_time(self.sched.queue, self.grantable_since, self.now,
                                    GRANT_WITHIN_S)
        except AssertionError as e:
            raise SimFailure(str(e), self) from e

    def check_deadlines(self) -> None:
        """A lease request is answered by the timeout it asked for, or waits on only while
        task leases hold what it needs (``DEADLINE_SLACK_S`` of virtual time allowed)."""
        self._machine_check(M.check_answered_by_deadline, self.sched.queue, self.freeable_at,
                            self.now, DEADLINE_SLACK_S)

    def check_offered(self) -> None:
        """The ledger's node capacity is what the worker processes it lists there offered
        when they joined (the world's own record of each process's capacity)."""
        self._machine_check(M.check_offers, self.sched.queue,
                            lambda name: self.nodes[name].capacity)

    def _machine_check(self, check: Any, *args: Any) -> None:
        """Run a check of ``machines.py``; its AssertionError fails the seed."""
        try:
            check(*args)
        except AssertionError as e:
            raise SimFailure(str(e), self) from e

    def check_push_target(self, node: ProcNode, task_id: str, worker: str) -> None:
        """Race branch: an owner never pushes a task to a worker whose loss it has heard of
        (dead workers stay dead here; replacements get new names).  A grant there that
        crossed the loss goes back unused: a push would charge the task a crash it never
        had."""
        at = self.lost_heard.get((node.name, worker))
        if at is not None:
            raise SimFailure(f"race: {node.name} pushed task {task_id} to {worker} at "
                             f"{self.now:.3f} s, though it heard at {at:.3f} s that {worker} "
                             "was lost", self, (task_id, worker))

    # -- timers: an idle lease goes back about lease_idle_s after it went idle -------------

    def lease_busy(self, node: ProcNode, task_id: str, lease_id: str, worker: str) -> None:
        key = (node.name, lease_id)
        self.lease_pushed.setdefault(key, set()).add(task_id)
        self.lease_worker[key] = worker
        self.pushed_under[task_id] = key
        self.lease_idle_at.pop(key, None)

    def lease_granted(self, node: ProcNode, lease_id: str, worker: str) -> None:
        key = (node.name, lease_id)
        self.lease_worker[key] = worker
        if not self.lease_pushed.get(key):
            self.lease_idle_at[key] = self.now

    def lease_task_back(self, task_id: str) -> None:
        key = self.pushed_under.pop(task_id, None)
        pushed = self.lease_pushed.get(key) if key is not None else None
        if pushed is not None:
            pushed.discard(task_id)
            if not pushed:
                self.lease_idle_at[key] = self.now

    def leases_lost(self, node: ProcNode, worker: str) -> None:
        """The owner's channel to ``worker`` broke: what it pushed there comes back."""
        for key, w in self.lease_worker.items():
            if key[0] == node.name and w == worker and self.lease_pushed.get(key):
                for task_id in self.lease_pushed.pop(key):
                    self.pushed_under.pop(task_id, None)
                self.lease_idle_at[key] = self.now

    def check_idle_leases(self) -> None:
        """Timers fire close to the earliest time asked for: a lease its owner still holds
        with no task pushed under it (the world's own count) for longer than
        ``lease_idle_s`` + ``IDLE_SLACK_S`` of virtual time was held too long."""
        bound = self.idle_bound
        for key, since in list(self.lease_idle_at.items()):
            if self.now - since <= bound:
                continue
            node = self.nodes.get(key[0])
            held = getattr(node.submit, "leases", None) if node is not None else None
            if held is None or not node.alive or node.closed or key[1] not in held:
                del self.lease_idle_at[key]  # returned (or its owner is gone)
                continue
            raise SimFailure(f"timer: {key[0]} holds lease {key[1]} idle since "
                             f"{since:.3f} s, {self.now - since:.3f} s by now (lease_idle_s "
                             f"{self.idle_bound - IDLE_SLACK_S} + {IDLE_SLACK_S} s)", self,
                             (key[1],))

    def check_slots(self, node: ProcNode, run: Run) -> None:
        """Concurrency per lease, from the world's own record of what computes: a task starts
        on a lease only while fewer than its slots of the lease's other tasks compute (those
        blocked in ``yr.get`` lent theirs; only such a task, back, may take its slot over)."""
        active = self.active.setdefault((node.name, run.lease_id), set())
        slots = run.msg.get("slots", 1)
        computing = sorted(r.task_id for r in active if r.phase != "blocked")
        if len(computing) >= slots:
            raise SimFailure(f"concurrency: {run.task_id} started on {node.name} under lease "
                             f"{run.lease_id} ({slots} slot(s)) while {computing} compute "
                             "there", self, (run.task_id, run.lease_id))
        active.add(run)

    @staticmethod
    def _pace(prog: Program) -> float:
        """Virtual seconds to the next step (a generator yields ``items`` times on the way)."""
        return prog.compute / (prog.items + 1) if prog.generator else prog.compute

    def advance(self, node: ProcNode, run: Run) -> None:
        prog = run.prog
        if run.cancelled:
            return self.finish(node, run, "error", CancelledError(f"task {run.task_id} cancelled"))
        if run.phase == "compute" and not prog.leaf:
            run.phase = "blocked"
            run.pending = len(prog.children)
            self.block(node, run, True)
            for child in prog.children:
                run.children.append(self.submit(node, child, run))
            if run.pending == 0 and node.runs.get(run.task_id) is run and run.phase == "blocked":
                self.unblock(node, run)
            return
        if prog.generator:
            return self.yield_item(node, run)
        if prog.leaf:
            n = self.errors_raised.get(run.task_id, 0)
            if n < prog.fail_first:
                self.errors_raised[run.task_id] = n + 1
                return self.finish(node, run, "retryable", UserBoom(f"{prog.path} attempt {n}"))
            return self.finish(node, run, "ok", prog.value)
        total = prog.value
        for cid in run.children:
            c = self.consumers.get(cid)
            kind, got = c.outcome if c is not None else self.tasks[cid].outcome
            if kind == "error":
                return self.finish(node, run, "error", got)
            total += got
        self.finish(node, run, "ok", total)

    def yield_item(self, node: ProcNode, run: Run) -> None:
        """A generator's next step: yield its next item (sent at once, as the agent's
        ``item_sender``), or end (an attempt that fails raises halfway), answering the count."""
        prog = run.prog
        n = self.errors_raised.get(run.task_id, 0)
        failing = n < prog.fail_first
        upto = prog.items // 2 if failing else prog.items
        if run.emitted < upto:
            from yrdask.serialization import dumps

            i = run.emitted
            run.emitted += 1
            self.say(node.name, ("yields", i), run.task_id)
            self.send(node.name, run.caller, "call", P.GeneratorItem(
                run.task_id, i, [P.VALUE, dumps(prog.item_value(i))]).to_msg())
            self.timer(self.now + self._pace(prog), node.name, "run", run)
            return
        if failing:
            self.errors_raised[run.task_id] = n + 1
            return self.finish(node, run, "retryable", UserBoom(f"{prog.path} attempt {n}"))
        from yrdask.serialization import dumps

        self.finish(node, run, "ok", dumps(upto))

    # -- ref arguments and the borrower protocol (runtime/objects.py's ObjectTable, real) ----

    def ref_task(self, node: ProcNode, rec: TaskRec, entry: _SimEntry,
                 parent: Run | None) -> tuple:
        """A task of a ref seed, as ``Runtime.submit_task`` builds it: its result is an entry
        of its submitter's object table (the driver, or the parent task until it ends, holds
        its ref), and its argument may hold an earlier task's ref (a driver's earlier
        top-level task, or an earlier sibling), pickled by the production packer (which records the
        refs it met and marks those the owner must count).  Returns ``(blob, nested refs)``."""
        from yrdask.runtime.objects import ObjectRef, pack_recording_refs
        from yrdask.serialization import pack_args

        rt = node.runtime(self)
        rec.ref = rt.objects.new_ref(rec.task_id)
        entry.real = rec.ref._entry
        prog = rec.prog
        earlier = parent.children if parent is not None else node.tops
        if prog.ref_arg is None or not earlier:
            return b"", None
        target = self.tasks[earlier[int(prog.ref_arg * len(earlier))]]
        if target.ref is None:
            return b"", None
        rec.arg = target.task_id
        self.say(node.name, ("passes the ref of", target.task_id), rec.task_id, target.task_id)
        (blob, _deps), nested = pack_recording_refs(
            pack_args, ([target.ref],), {}, lambda v: type(v) is ObjectRef)
        if prog.drop_passed:  # the argument (the task's held refs) is its only holder now
            target.ref = None
        return blob, nested

    def _installed(self, node: ProcNode, fn: Any, *args: Any) -> Any:
        """``fn(*args)`` with ``node``'s runtime as the process's (unpickled refs join its
        object table, as in that process)."""
        from yrdask.runtime import context

        saved = context.installed_runtime()
        context.install(node.runtime(self))
        try:
            return fn(*args)
        finally:
            context.install(saved)

    def borrow_args(self, node: ProcNode, run: Run) -> None:
        """The worker unpickles the task's arguments (``agent.unpack_call``): the refs in them
        are borrowed (counted refs reported in its ``TaskDone``).  The owner must not have
        freed them: the task's argument still needs them."""
        from yrdask.runtime.objects import unpickling
        from yrdask.serialization import unpack_args

        (args, _kwargs), found = self._installed(node, unpickling, unpack_args,
                                                 run.msg["args"], [])
        run.args, run.borrowed = args, list(found)
        rec = self.tasks[run.task_id]
        if rec.cancelled or rec.settled:
            return  # its argument no longer holds the ref: the owner may have freed it
        for ref in args[0]:
            self.check_held(node, ref, f"the argument of task {run.task_id}")

    def check_held(self, node: ProcNode, ref: Any, what: str) -> None:
        """Safety: ``node`` holds ``ref``, so its owner (alive, running) still has it, unless
        the ref carries its value (small values travel inside the ref, never counted)."""
        if ref._entry.state in (P.VALUE, P.ERROR):
            return
        owner = ref._entry.owner
        if owner and owner in node.rt.objects.counter.dead:
            raise SimFailure(f"owner died: {node.name} knows {owner} died, yet its ref "
                             f"{ref._id} ({what}) is still pending: a read would hang instead "
                             "of raising OwnerDiedError", self, (ref._id,))
        onode = self.nodes.get(owner) if owner else None
        if onode is None or not onode.alive or onode.closed or onode.rt is None:
            return
        if ref._id not in onode.rt.objects.entries:
            raise SimFailure(f"borrowing: {owner} freed {ref._id} while {what} on {node.name} "
                             "still holds it", self, (ref._id, ref._id.split(".")[0]))

    def check_borrowers(self) -> None:
        """After every step of a ref seed: no object is freed while a borrower holds it
        (a running task's argument, or a ref a task kept)."""
        for node in self.live_workers():
            for run in node.runs.values():
                if run.args is not None:
                    rec = self.tasks[run.task_id]
                    if not (rec.cancelled or rec.settled):
                        for ref in run.args[0]:
                            self.check_held(node, ref, f"the argument of task {run.task_id}")
            for args in node.kept:
                for ref in args[0]:
                    self.check_held(node, ref, "a ref a task kept")

    def ref_reply(self, node: ProcNode, run: Run, outcome: str, value: Any,
                  took: float) -> P.TaskDone:
        """The ``TASK_DONE`` of a ref seed's task, as ``agent._execute`` builds it: results
        packed by the agent's own ``pack_results`` (a returned ref is lent to the caller via
        the result), the counted refs its arguments held reported (``refs``); then its
        arguments go, unless the task keeps them."""
        from yrdask.worker.agent import WorkerAgent

        prog = run.prog
        borrowed = run.borrowed
        if outcome == "ok":
            if prog.return_ref and run.args:
                value = (value, run.args[0][0])
            node.runtime(self)
            results, nested = self._installed(node, WorkerAgent.pack_results,
                                              _AgentShim(node), run.task_id, value, 1,
                                              run.caller)
            done = P.TaskDone(run.task_id, results=results, took=took,
                              refs=[node.name, borrowed, nested] if borrowed or nested
                              else None)
        else:
            done = P.TaskDone(run.task_id, error=value, took=took,
                              retryable=outcome == "retryable",
                              refs=[node.name, borrowed, None] if borrowed else None)
        args, run.args = run.args, None
        if args is not None and prog.keep_ref and outcome == "ok":
            node.kept.append(args)
            self.timer(self.now + prog.keep_ref, node.name, "unkeep", args)
        return done

    def read_result(self, node: ProcNode, rec: TaskRec, payload: Any,
                    again: bool = True) -> Any:
        """The owner reads a result (``yr.get``): a ref the task returned is one of its own,
        kept for the result that holds it (``Contains``), never freed meanwhile; the driver
        reads it again a little later (while it holds the result) and keeps that ref."""
        from yrdask.serialization import loads

        value = self._installed(node, loads, payload)
        if not isinstance(value, tuple):
            return value
        value, back = value
        if back._entry.state == P.ERROR:
            raise SimFailure(f"borrowing: task {rec.task_id} returned the ref {back._id}, but "
                             f"its owner {node.name} had freed it: {back._entry.error}", self,
                             (rec.task_id, back._id))
        if again:
            self.timer(self.now + self.rng.uniform(0.0, 0.3), node.name, "reread",
                       (rec, payload))
        else:
            rec.back = back  # held until the driver's end
        return value

    def refs_delivery(self, node: ProcNode, src: str, msg: dict) -> None:
        """A reference counting rpc (``Runtime.wait_refs_removed`` / ``refs_removed`` /
        ``handle_add_borrower``), or the reply to an ``AddBorrower`` (``objects.added``)."""
        rt = node.runtime(self)
        kind, items = msg["kind"], msg["items"]
        self.touched.append(node)
        if kind == "WaitRefsRemoved":
            rt.objects.on_wait(src, items)
        elif kind == "RefsRemoved":
            rt.objects.on_removed(src, items)
        elif kind == "AddBorrower":
            rt.objects.add_borrower([i[:3] for i in items])
            self.send(node.name, src, "refs", {"op": "REFS", "kind": "Added", "items": items})
        elif kind == "Added":
            rt.objects.added(items)
        else:
            raise AssertionError(f"unknown refs message {msg}")
        if not node.worker:
            self.maybe_close(node)

    def ref_leftovers(self) -> list[str]:
        """At the end of a ref seed: every live worker let go of every ref (its table empty,
        no record of a live owner's object left)."""
        out = []
        for node in self.live_workers():
            if node.rt is None:
                continue
            if node.rt.objects.entries:
                out.append(f"{node.name}'s object table still has "
                           f"{sorted(node.rt.objects.entries)}")
            live = [oid for oid, r in node.rt.objects.counter.refs.items()
                    if r.owner is None or (r.owner in self.nodes
                                           and self.nodes[r.owner].alive
                                           and not self.nodes[r.owner].closed)]
            if live:
                out.append(f"{node.name}'s reference counter still has records {live}")
        return out

    # -- generator consumers (runtime/generators.py's Stream, as ObjectRefGenerator reads it) --

    def generator_item(self, node: ProcNode, msg: dict) -> None:
        """A ``GENERATOR_ITEM`` from a worker (``Runtime.on_channel_message``)."""
        self.touched.append(node)
        node.runtime(self).on_channel_message(msg)
        c = self.consumers.get(msg["task_id"])
        if c is not None and c.node is node:
            self.wake_consumer(c)

    def wake_consumer(self, c: Consumer) -> None:
        """The consumer reads soon (its thread wakes), unless it is done or already woken."""
        if c.outcome is None and not c.armed:
            c.armed = True
            self.timer(self.now + self.rng.uniform(0.0, 0.01), c.node.name, "consume", c)

    def consume(self, node: ProcNode, c: Consumer) -> None:
        """The consumer takes every ref there is (``next`` with timeout 0) and checks each:
        items in order, each once, with its value; the error ref only for a failed stream and
        last; the end only after the stream's end, with every item handed out."""
        from yrdask.errors import YRTimeoutError

        if c.outcome is not None or node.closed:
            return
        rec, prog, stream = c.rec, c.rec.prog, c.stream
        tid = rec.task_id
        self.touched.append(node)
        while True:
            if prog.drop_after is not None and c.handed >= prog.drop_after:
                self.say(node.name, ("drops its generator after", c.handed), tid)
                stream.abandon()
                if stream.next(0) is not None:
                    raise SimFailure(f"generator {tid}: a ref handed out after its consumer "
                                     "dropped it", self, (tid,))
                return self.consumed(node, c, ("dropped", c.handed))
            try:
                ref = stream.next(0)
            except YRTimeoutError:
                return
            state = stream.state
            if ref is None:
                why = None
                if not state.ended:
                    why = "the consumer was told the end before the stream ended"
                elif state.failed:
                    why = "the stream failed, yet its consumer got no error"
                elif c.handed != prog.items:
                    why = f"the consumer got {c.handed} of {prog.items} items, then the end"
                elif stream.refs or state.held:
                    why = f"items {sorted(state.held)} held after the end was handed out"
                if why is not None:
                    raise SimFailure(f"generator {tid} ({prog.path}): {why}", self, (tid,))
                return self.consumed(node, c, ("ok", c.total))
            index = int(ref._id.rsplit(".", 1)[1])
            if index != c.handed:
                raise SimFailure(f"generator {tid} ({prog.path}): item {index} handed out "
                                 f"after {c.handed} items (each once, in order)", self, (tid,))
            entry = ref._entry
            if entry.state == P.ERROR:
                if not (state.ended and state.failed):
                    raise SimFailure(f"generator {tid}: an error ref though the stream did not "
                                     "fail", self, (tid,))
                error = entry.error
                del ref
                if stream.next(0) is not None:
                    raise SimFailure(f"generator {tid}: a ref handed out after its error",
                                     self, (tid,))
                return self.consumed(node, c, ("error", error))
            value = entry.get_value()
            if index >= prog.items or value != prog.item_value(index):
                raise SimFailure(f"generator {tid} ({prog.path}): item {index} is {value!r}, "
                                 f"expected {prog.item_value(index) if index < prog.items else 'none'}",
                                 self, (tid,))
            del ref
            c.handed += 1
            c.total += value
            self.say(node.name, ("takes item", index), tid)

    def consumed(self, node: ProcNode, c: Consumer, outcome: tuple) -> None:
        c.outcome = outcome
        c.stream = None  # the generator goes (and its end ref with it)
        self.say(node.name, ("consumed", outcome), c.rec.task_id)
        self.last_settle = self.now
        self.child_done(node, c.rec)

    def unblock(self, node: ProcNode, run: Run) -> None:
        if run.phase != "blocked":
            return
        run.phase = "after"
        self.block(node, run, False)
        self.timer(self.now + run.prog.compute_after, node.name, "run", run)

    def block(self, node: ProcNode, run: Run, blocked: bool) -> None:
        """``yr.get`` in a task: the gate slot now, the CPU via the scheduler if the wait
        lasts (the task side's ``lend``, as ``agent.lend_slot`` calls it)."""
        self.touched.append(node)
        node.task_side.lend(run.lease_id, blocked)

    def finish(self, node: ProcNode, run: Run, outcome: str, value: Any) -> None:
        """The task's function returned or raised: the task side forgets it, then its
        ``TASK_DONE`` goes to the caller (as ``agent._execute_gated``)."""
        took = self.now - run.started
        run.phase = "done"
        self.active.get((node.name, run.lease_id), set()).discard(run)
        if self.sc.refs:
            for cid in run.children:  # the task's refs to its children's results go
                child = self.tasks[cid]
                child.ref = child.back = None
            done = self.ref_reply(node, run, outcome, value, took)
        elif outcome == "ok":  # (the agent's plain answer: TaskDone.wire)
            done = None
            msg = P.TaskDone.wire(run.task_id, results=[[P.VALUE, value]], took=took)
        else:
            done = P.TaskDone(run.task_id, error=value, took=took,
                              retryable=outcome == "retryable")
        self.say(node.name, ("done", outcome, value if outcome != "ok" else ""), run.task_id)
        self.touched.append(node)
        node.task_side.finished(run)
        self.send(node.name, run.caller, "call", msg if done is None else done.to_msg())

    def cancel(self, node: ProcNode, task_id: str) -> None:
        """``yr.cancel`` in a driver."""
        rec = self.tasks[task_id]
        rec.cancelled = True
        self.touched.append(node)
        node.submitter.cancel(task_id)

    # -- faults and membership ---------------------------------------------------------------

    def host_of(self, name: str) -> str:
        """The node (host) a worker process belongs to (docs/nodes.md): in odd seeds the
        workers pair up, w0 and w1 on host h0, w2 and w3 on h1, so leases take from a pool
        of several processes; in even seeds each process is a host of its own."""
        if self.sc.seed % 2 and name[1:].isdigit():
            return f"h{int(name[1:]) // 2}"
        return name

    def _add_worker(self, name: str, cap: dict, at_start: bool) -> None:
        node = ProcNode(self, name, True, cap, self.sc.sq_kwargs)
        self.nodes[name] = node
        if at_start:
            self.sched.workers.add(name)
            self.sched.service.worker_joined(name, dict(cap), node=self.host_of(name))
        else:
            self.say(name, ("joins", cap, self.host_of(name)))
            self.send("cluster", SCHED, "ctl", {"op": ADD_WORKER, "worker": name,
                                                "capacity": cap})

    def live_workers(self) -> list[ProcNode]:
        return [n for n in self.nodes.values() if isinstance(n, ProcNode) and n.worker and n.alive]

    def kill_random_worker(self) -> None:
        live = self.live_workers()
        if not live or (len(live) <= 1 and not self.sc.replace):
            return
        node = live[self.rng.randrange(len(live))]
        self.kill(node)
        if len(live) <= 1 or self.rng.random() < 0.5:
            self.replacements += 1
            name = f"w{len(self.sc.workers) + self.replacements - 1}"
            self.timer(self.now + self.rng.uniform(0.05, 5.0), SCHED, "join",
                       (name, dict(node.capacity)))

    def kill(self, node: ProcNode) -> None:
        """The worker process dies: its links break, its tasks and submissions vanish."""
        w = node.name
        self.kills += 1
        node.alive = False
        self.say(w, "KILLED")
        for key in list(self.links):
            src, dst, _chan = key
            if dst == w or (src == w and self.rng.random() < 0.5):
                if _chan == "refs" and self.links[key]:  # rpcs to it, or their replies, fail
                    if dst == w:
                        self.timer(self.now, src, "refs-failed", w)
                    elif any(m["kind"] == "Added" for m in self.links[key]):
                        self.timer(self.now, dst, "refs-failed", w)
                for msg in self.links[key]:
                    if msg.get("op") == P.TASK_DONE and msg.get("retryable"):
                        # an error lost with its worker: the next attempt raises instead
                        self.errors_raised[msg["task_id"]] -= 1
                self.links[key].clear()
                self.busy.pop(key, None)
        for rec in self.tasks.values():
            if rec.settled:
                continue
            if rec.proc == w:
                rec.abandoned = True
            elif rec.where == w:
                rec.crash_hits += 1
                rec.where = None
        node.runs.clear()
        node.kept.clear()
        self.send("cluster", SCHED, "ctl", {"op": REMOVE_WORKER, "worker": w})
        for name, other in self.nodes.items():
            if name != SCHED and other.alive and not getattr(other, "closed", False):
                self.send(f"net:{w}", name, "lost", {"op": "CHANNEL_LOST", "worker": w})

    def close_driver(self, node: ProcNode) -> None:
        """The driver ends: its queue closes, then its job stream (OwnerGone)."""
        self.touched.append(node)
        node.submitter.close()
        node.closed = True
        for t in node.tops:
            rec = self.tasks[t]
            if not rec.settled:
                rec.abandoned = True
        self.send(node.name, SCHED, "stream", P.CloseStream().to_msg())

    # -- checks ------------------------------------------------------------------------------

    def validate_touched(self) -> None:
        touched = self.touched
        if not touched:
            return
        seen = set()
        for node in touched:
            if id(node) in seen:
                continue
            seen.add(id(node))
            try:
                if node is self.sched:
                    node.queue.validate()
                    M.check_ledger(node.queue)
                    M.check_capacity(node.queue, self.reclaimed, self.shrunk)
                    if node.rgm is not None:
                        node.rgm.validate()
                        M.check_groups(node.rgm, self.removed_groups)
                else:
                    if not node.closed:
                        node.submit.validate()
                    if node.gate is not None:
                        node.gate.validate()
                        node.task_side.notices.validate()
                    if node.rt is not None:
                        self.check_streams(node)
            except AssertionError as e:
                raise SimFailure(f"{node.name}: validate() failed after step {self.step}: {e}",
                                 self) from e
            if node is not self.sched and not node.closed:
                self.check_revoked_idle(node)
        touched.clear()

    def check_streams(self, node: ProcNode) -> None:
        """Each open stream's machine is valid and the adapter holds a ref for exactly the
        items the machine holds."""
        for c in self.consumers.values():
            if c.node is node and c.stream is not None:
                st = c.stream.state
                st.validate()
                assert set(c.stream.refs) == st.held, \
                    f"stream {st.stream_id} holds refs {sorted(c.stream.refs)}, its machine " \
                    f"items {sorted(st.held)}"

    def check_revoked_idle(self, node: ProcNode) -> None:
        """A lease its owner was asked to revoke goes back as soon as it runs no task (a kept
        one once its queue runs dry): none sits idle in the owner's submit queue."""
        held = getattr(node.submit, "leases", None)
        if held is None or not node.revoked_at:
            return
        for lid in [lid for lid in node.revoked_at if lid not in held]:
            del node.revoked_at[lid]  # given back (lease ids are never reused)
        for lid, (at, keep) in node.revoked_at.items():
            if not held[lid].tasks:
                raise SimFailure(
                    f"revoke: {node.name}'s lease {lid}, revoked "
                    f"{'with keep' if keep else 'firmly'} at {at:.3f} s, runs no task at "
                    f"{self.now:.3f} s but was not given back", self, (lid,))

    def check_revoked_push(self, node: ProcNode, task_id: str, lease_id: str) -> None:
        """A revoked lease takes no new task (runtime/submit_queue.py rule 4): none after a
        firm revoke of it, and none once ``keep_revoked_s`` has passed since a revoke with
        ``keep`` (a kept lease runs its queue's backlog only that long)."""
        rv = node.revoked_at.get(lease_id)
        if rv is None:
            return
        at, keep = rv
        if not keep or self.now > at + self.keep_revoked_s:
            raise SimFailure(
                f"revoke: {node.name} pushed {task_id} under lease {lease_id} at "
                f"{self.now:.3f} s, revoked {'with keep' if keep else 'firmly'} at {at:.3f} s "
                f"(keep_revoked_s={self.keep_revoked_s})", self, (task_id, lease_id))

    def in_flight_lease_ids(self) -> set[str]:
        """Lease ids named by a message still on a link (a grant on its way to its owner,
        a return, a revoke)."""
        out: set[str] = set()
        for key in self.busy:
            for msg in self.links[key]:
                if "lease_id" in msg:
                    out.add(msg["lease_id"])
                elif msg["op"] == REPLY and msg["to"] == P.REQUEST_LEASE and msg["result"][0]:
                    out.add(msg["result"][0])  # a grant on its way
                out.update(msg.get("lease_ids", ()))
        return out

    def _live_procs(self) -> set[str]:
        """Drivers and workers that are alive and not closed."""
        return {name for name, node in self.nodes.items()
                if isinstance(node, ProcNode) and node.alive and not node.closed}

    def check_conservation(self) -> None:
        """Ledger, submitters and gates agree, up to the messages in flight:

        * every task lease the ledger holds is known to its owner's SubmitQueue, or on its way
          (a grant or return in flight), or its owner or worker is gone (its OwnerGone or
          WorkerLeft releases it); once the scheduler has processed a worker's WorkerLeft, no
          lease of that worker's submitter is left anywhere;
        * every lease a live submitter holds is in the ledger, or on the way back, or on a
          worker that is gone (the scheduler dropped it with the worker);
        * every task a worker runs under a lease runs under a lease the ledger holds, or one
          whose owner is gone, or one being returned;
        * a lease's CPU is lent in the ledger iff one of its tasks is blocked in ``yr.get``.
        """
        ledger = M._ledger(self.sched.queue)
        holdings = ledger.holdings
        workers = getattr(ledger, "processes", ledger.workers)  # worker processes it knows
        nodes = self.nodes
        live = self._live_procs()
        suspects = []
        for hid, h in holdings.items():
            if h.kind != "lease":
                continue
            if h.owner not in live:
                onode = nodes.get(h.owner)
                if isinstance(onode, ProcNode) and onode.worker and h.owner not in workers:
                    # the scheduler has processed its WorkerLeft: that released it
                    raise SimFailure(f"conservation: lease {hid} of {h.owner} outlives its "
                                     f"owner's WorkerLeft; ledger "
                                     f"{M.ledger_summary(self.sched.queue)}", self, (hid,))
                continue  # its OwnerGone / WorkerLeft (in flight or due) releases it
            if h.worker not in live:
                continue  # its WorkerLeft (in flight or due) drops it
            leases = getattr(nodes[h.owner].submit, "leases", None)
            if leases is not None and hid not in leases:
                suspects.append(("ledger holds, owner does not know", hid, h.owner))
            # lending while blocked, accounted: the CPU is lent iff its worker told the
            # scheduler a task of the lease blocks in yr.get (up to a LEASE_(UN)BLOCKED in
            # flight); the notices machine's validate() checks each block is told in time
            told = hid in nodes[h.worker].task_side.notices.holds \
                and nodes[h.worker].task_side.notices.holds[hid].told
            if h.lent_cpu != told:
                suspects.append((f"lent_cpu={h.lent_cpu} but its worker "
                                 f"{'told' if told else 'did not tell'} a block", hid,
                                 h.worker))
        for name in live:
            node = nodes[name]
            for lid, lease in getattr(node.submit, "leases", {}).items():
                if lid not in holdings and lease.worker in live and lease.worker in workers \
                        and lid not in self.group_revoked:
                    suspects.append(("submitter holds, ledger does not", lid, name))
            if node.worker:
                for tid, run in node.runs.items():
                    if run.lease_id not in holdings and run.phase != "done" \
                            and run.caller in live and run.lease_id not in self.group_revoked:
                        suspects.append(("runs under a lease the ledger lost", run.lease_id,
                                         f"{name}:{tid}"))
        if not suspects:
            return
        flying = self.in_flight_lease_ids()
        bad = [s for s in suspects if s[1] not in flying]
        if bad:
            what, lid, where = bad[0]
            raise SimFailure(f"conservation: {what}: {lid} ({where}) at step {self.step}; "
                             f"ledger {M.ledger_summary(self.sched.queue)}", self, (lid,))

    def unsettled(self) -> tuple:
        return tuple(t for t, r in self.tasks.items() if not r.settled and not r.abandoned) \
            + tuple(f"{t} (consumer)" for t, c in self.consumers.items()
                    if c.outcome is None and c.node.alive and not c.node.closed
                    and not c.rec.abandoned)

    def check_quiescent(self) -> None:
        """Nothing moves any more: every task must be settled, nothing held or pending."""
        stuck = self.unsettled()
        if stuck:
            raise SimFailure(f"hang: {len(stuck)} task(s) never settled though the world is "
                             f"quiescent at {self.now:.2f} s: {', '.join(stuck[:8])}; ledger "
                             f"{M.ledger_summary(self.sched.queue)}", self, stuck)
        for node in self.nodes.values():
            if isinstance(node, ProcNode) and not node.worker and not node.closed:
                table = sorted(node.rt.objects.entries) if node.rt is not None else []
                raise SimFailure(f"driver {node.name} never finished" + (
                    f": its object table still has {table} (never freed)" if table else ""),
                    self, tuple(table))
        problems = M.leftovers(self) + self.stream_leftovers()
        if self.sc.refs:
            problems += [p for p in self.ref_leftovers() if p not in problems]
        if problems:
            raise SimFailure("left over at the end: " + "; ".join(problems), self)


    def stream_leftovers(self) -> list[str]:
        """Once every task of a process settled and every consumer of it is done, no stream
        of it is open and its object table is empty (no item kept for nobody, no ref
        leaked).  A driver that exited early is exempt: its runtime goes with it."""
        out = []
        for node in self.nodes.values():
            if not isinstance(node, ProcNode) or node.rt is None or not node.alive \
                    or node.exited:
                continue
            if any(c.node is node and c.outcome is None for c in self.consumers.values()) \
                    or any(r.proc == node.name and not r.settled for r in self.tasks.values()):
                continue
            if node.rt.streams:
                out.append(f"{node.name} still has open streams {sorted(node.rt.streams)}")
            if node.rt.objects.entries:
                out.append(f"{node.name}'s object table still has "
                           f"{sorted(node.rt.objects.entries)}")
        return out


def _cancel_below(world: World, rec: TaskRec) -> bool:
    """A cancelled descendant's error may reach its ancestors."""
    run_children = [t for t, r in world.tasks.items() if r.parent is not None
                    and r.parent.task_id == rec.task_id]
    return any(world.tasks[c].cancelled or _cancel_below(world, world.tasks[c])
               for c in run_children)


def _placeable(strategy: str, todo: list, fixed: list, free: dict) -> bool:
    """Whether bundles of shapes ``todo`` fit ``free`` (node -> resources) beside the group's
    bundles already on the nodes ``fixed``, as the strategy says: STRICT_PACK all on one node,
    STRICT_SPREAD each on a node of its own, PACK and SPREAD anywhere (a plain search, not
    the machine's)."""
    left = {w: dict(f) for w, f in free.items()}
    used = list(fixed)

    def fits(w: str, shape: dict) -> bool:
        return all(left[w].get(r, 0.0) + 1e-9 >= a for r, a in shape.items() if a > 0)

    def search(k: int) -> bool:
        if k == len(todo):
            return True
        for w in sorted(left):
            if strategy == "STRICT_SPREAD" and w in used:
                continue
            if strategy == "STRICT_PACK" and used and w != used[0]:
                continue
            if not fits(w, todo[k]):
                continue
            for r, a in todo[k].items():
                left[w][r] = left[w].get(r, 0.0) - a
            used.append(w)
            if search(k + 1):
                return True
            used.pop()
            for r, a in todo[k].items():
                left[w][r] += a
        return False

    return search(0)
