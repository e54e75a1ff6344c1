"""Isolated instances in the instance world (``calls.py``): one fault policy, checked.

A hosted instance may be isolated (``spec["isolated"]``): the worker's agent keeps its calls
with the production decisions of ``worker/isolated/supervisor.py``
(:class:`~yrdask.worker.isolated_calls.IsolatedCalls`: pending, waiting, died, restart and
the crash charge of ``runtime/call_order.py``) and runs them in a virtual child process,
which hosts the instance with hosting's ``CallQueue`` (production code: none before
``__init__``, in arrival order, at most ``concurrency`` at once).  What production does
with I/O is done here with the world's links and timers:

* the child's start (spawn, ``__init__``, the channel) is a message to the agent
  (``ISO_UP``); the calls that waited are forwarded then, on one FIFO link to the child;
* the child starts and runs calls (``ISO_RUN``, ``ISO_FINISH``: side by side up to the
  concurrency) and answers them on one FIFO link back (``ISO_DONE``);
* the child dies (a fault timer, a start whose ``__init__`` kills its process, or a
  *poison* call that kills its process whenever it runs): its exit reaches the agent on that same link after the answers it had sent
  (``ISO_EXIT``: the agent reads a dead child's answers before it handles the death, as
  ``IsolatedInstance._exited`` does); the agent reports ``RESTARTING`` to the scheduler,
  whose ``Lifecycle`` (through the production ``InstanceService``) decides: a
  ``START_INSTANCE`` back restarts it (the decisions charge and redeliver or fail the
  pending calls), or a stop ends it.  A worker's death takes its children with it.

Checks (``SimFailure``), besides the world's own (every call settles once, with a value or
an allowed error; per-caller order within an incarnation, here a child process; no
orphans): ``IsolatedCalls.validate()`` and the child's ``CallQueue.validate()`` after every
step; a call never starts again on one worker after it was *running* (as the world knows
exactly) at more deaths of its process than the bound allows (so the charge covered it);
a ``CallCrashedError`` only for a call delivered at least twice; an instance never has
more processes started than its ``recover_retry_times`` allows (one plus its restarts,
worker losses included); no isolated instance lives on where the lifecycle does not place
it, and no call waits in an agent for a child that never comes.
"""

from __future__ import annotations

import random
from typing import Any

from yrdask.worker import isolated_calls as IC
from yrdask.worker.call_queue import CallQueue

BOUND = 1  # yrdask.scheduling.max-call-redeliveries (the default), the agent's bound


class _Child:
    """A virtual isolated process: hosting's CallQueue in it, the calls it runs."""

    __slots__ = ("gen", "q", "alive", "running")

    def __init__(self, gen: int, concurrency: int) -> None:
        self.gen = gen
        self.q = CallQueue(concurrency)
        self.alive = True
        self.running: set[str] = set()


class _Host:
    """One isolated instance on one worker, as the worker's instance side hosts it (as
    ``IsolatedInstance``: ``call``, ``stop``, and a restart when its ``START_INSTANCE``
    comes again): the agent's decisions and its current child."""

    __slots__ = ("hosting", "serial", "iid", "wname", "decide", "gen", "child", "conc")

    def __init__(self, hosting: "IsolatedHosting", serial: int, iid: str, wname: str,
                 conc: int, inc: int) -> None:
        self.hosting = hosting
        self.serial = serial
        self.iid = iid
        self.wname = wname
        self.conc = conc
        self.decide = IC.IsolatedCalls(iid, conc, inc)
        self.gen = 0
        self.child: _Child | None = None

    @property
    def inc(self) -> int:
        return self.decide.incarnation

    def call(self, peer: str, msg: dict) -> None:
        """``CALL_METHOD`` (``IsolatedInstance.call``)."""
        self.hosting._arrived(self, msg["task_id"], peer)

    def stop(self, reason: str) -> None:
        """``STOP_INSTANCE`` (``IsolatedInstance.stop``): every call not answered dies, the
        process is killed (no ``RESTARTING`` once stopped)."""
        self.hosting._stop(self, reason)

    def __repr__(self) -> str:
        return f"<isolated {self.iid}.{self.inc} on {self.wname}>"


class IsolatedHosting:
    """The isolated hosting of one world (see module docstring); ``calls.CallWorld`` calls
    its hooks (``create_params``; ``host`` from the worker's instance side, production
    ``InstanceSide``, as ``agent.host``; ``at_worker`` for the processes' messages;
    ``fire``, ``validate``, ``check_quiescent``)."""

    def __init__(self, world: Any) -> None:
        self.world = world
        self.hosts: dict[tuple[str, str], _Host] = {}  # (worker, iid) -> its host there
        self.serials = 0
        self.spawns: dict[str, int] = {}  # iid -> processes started for it (all workers)
        self.deaths_running: dict[tuple[int, str], int] = {}  # (host, call) -> deaths it ran at
        # its own random stream: the world's stream (and so every seed without isolated
        # instances) stays as it was, with the seeds that the other checks were tuned on
        rng = self.rng = random.Random(world.seed * 7919 + 17)
        self.share = rng.choice([0.0, 0.3, 0.6])  # of the created instances, isolated
        self.poison = rng.choice([0.0, 0.05, 0.15])  # of the calls on them, kill their process
        self.init_death = rng.choice([0.0, 0.1, 0.25])  # of the starts, die in __init__
        for _ in range(rng.choice([0, 1, 2, 4]) if self.share else 0):
            world.timer(rng.uniform(0, 8), "iso-fault", None)

    # -- hooks -------------------------------------------------------------------------------

    def create_params(self, params: dict) -> dict:
        """A creation is isolated with this world's share."""
        if self.share and self.rng.random() < self.share:
            # its process runs every call in its queue and builds it (no concurrency
            # groups, no __init__ error modelled there)
            params = {**params, "isolated": True, "off_loop": False, "init_fails": False}
        return params

    def at_worker(self, w: Any, msg: tuple) -> None:
        """An isolated process's message at worker ``w`` (``ISO_*``)."""
        getattr(self, "_" + msg[0][4:].lower())(w, *msg[1:])

    def host(self, w: Any, spec: dict, running: Any) -> _Host | None:
        """The instance side's ``host`` (``agent.host``): an isolated instance whose process
        died restarts (``running``), a new isolated one is hosted; ``None``: not isolated."""
        if isinstance(running, _Host):
            self._restart(running, spec["incarnation"])
            return running
        iid = spec["instance_id"]
        if not self.world.specs.get(iid, {}).get("isolated"):
            return None
        self.serials += 1
        host = self.hosts[(w.name, iid)] = _Host(self, self.serials, iid, w.name,
                                                 spec["concurrency"], spec["incarnation"])
        self.world.say(w.name, "iso hosts", iid, host.inc, f"concurrency {host.conc}")
        self._spawn(host)
        return host

    def fire(self, kind: str, data: Any) -> None:
        if kind == "iso-fault":  # a random isolated process dies
            live = sorted((h.serial, h) for h in self.hosts.values()
                          if h.child is not None and h.child.alive
                          and self.world.alive(h.wname))
            if live:
                self._kill_child(self.rng.choice(live)[1], "killed by signal 9")

    def validate(self) -> None:
        for host in self.hosts.values():
            if not self.world.alive(host.wname):
                continue
            host.decide.validate()
            if host.child is not None and host.child.alive:
                host.child.q.validate()

    def check_quiescent(self) -> None:
        """(Orphans: the world checks every instance its workers host, these included.)"""
        w = self.world
        for (wname, iid), host in sorted(self.hosts.items()):
            if not w.alive(wname):
                continue
            d = host.decide
            if d.waiting or d.pending:
                w.fail(f"{wname} keeps calls of isolated {iid} that never run: "
                       f"pending {list(d.pending)}, waiting {[c for c, _ in d.waiting]}, "
                       f"died {d.died!r}")

    # -- the agent (worker/isolated/supervisor.py's IsolatedInstance, its decisions production code) ----

    def _restart(self, host: _Host, inc: int) -> None:
        """``START_INSTANCE`` again for an isolated instance hosted here
        (``IsolatedInstance.restart``)."""
        world = self.world
        cause = host.decide.died
        decided = host.decide.restart(inc, BOUND)
        if decided is None:
            world.say(host.wname, "iso start ignored (its process runs)", host.iid, inc)
            return
        resend, failed = decided
        world.say(host.wname, "iso restart", host.iid, inc, "again:", [c for c, _ in resend],
                  "failed:", [c for c, _, _ in failed])
        for cid, caller, n in failed:
            self._answer(host, caller, cid, (
                "crashed", f"call {cid} on {host.iid} may have been running when its process "
                           f"died, {n} times (last: {cause})"))
        self._spawn(host)

    def _stop(self, host: _Host, reason: str) -> None:
        self.hosts.pop((host.wname, host.iid), None)
        for cid, caller in host.decide.stop(reason):
            self._answer(host, caller, cid, ("died", f"{host.iid} has ended: {reason}"))
        if host.child is not None:
            host.child.alive = False  # killed: no RESTARTING once stopped

    def _spawn(self, host: _Host) -> None:
        world = self.world
        n = self.spawns[host.iid] = self.spawns.get(host.iid, 0) + 1
        limit = world.specs[host.iid].get("recover_retry_times") or 0
        if limit >= 0 and n > 1 + limit:
            world.fail(f"budget: {n} processes started for {host.iid}, whose "
                       f"recover_retry_times is {limit} (at most {1 + limit})")
        host.gen += 1
        host.child = _Child(host.gen, host.conc)
        world.send(host.wname, host.wname, f"iso-up-{host.iid}", ("ISO_UP", host.iid, host.gen))
        if self.init_death and self.rng.random() < self.init_death:
            self._kill_child(host, "its __init__ killed it")  # before it comes up

    def _arrived(self, host: _Host, cid: str, caller: str) -> None:
        what = host.decide.arrived(cid, caller)
        if what is IC.FORWARD:
            self._forward(host, cid)
        elif what is IC.ENDED:
            self._answer(host, caller, cid, ("died", f"{host.iid} has ended"))
        elif what is IC.START_FAILED:  # never here: every spawn in this world succeeds
            self.world.fail(f"{cid}: a start failure nobody simulated")

    def _forward(self, host: _Host, cid: str) -> None:
        self.world.calls[cid]["forwards"] = self.world.calls[cid].get("forwards", 0) + 1
        self.world.send(host.wname, host.wname, f"iso-in-{host.iid}-{host.gen}",
                        ("ISO_CALL", host.iid, host.gen, cid))

    def _answer(self, host: _Host, caller: str, cid: str, result: Any) -> None:
        self.world.send(host.wname, caller, "call", ("DONE", cid, result))

    def _host(self, w: Any, iid: str, gen: int) -> _Host | None:
        host = self.hosts.get((w.name, iid))
        return host if host is not None and host.gen == gen else None

    def _up(self, w: Any, iid: str, gen: int) -> None:
        """The child is up, ``__init__`` ran, the channel is open: report ALIVE, forward."""
        host = self._host(w, iid, gen)
        if host is None or host.child is None or not host.child.alive:
            return
        host.child.q.constructed()
        self.world.send(w.name, "sched", "stream", ("STATE", iid, "ALIVE"))
        for cid, _caller in host.decide.connect():
            self._forward(host, cid)

    def _done(self, w: Any, iid: str, gen: int, cid: str) -> None:
        """The child's answer, read by the agent."""
        host = self._host(w, iid, gen)
        if host is None:
            return
        caller = host.decide.answered(cid)
        if caller is not None:
            self._answer(host, caller, cid, None)

    def _exit(self, w: Any, iid: str, gen: int, cause: str) -> None:
        """The child's exit, after its answers: the scheduler decides."""
        host = self._host(w, iid, gen)
        if host is None:
            return
        if host.decide.child_died(cause):
            self.world.say(w.name, "iso died", iid, cause, "pending", list(host.decide.pending))
            self.world.send(w.name, "sched", "stream", ("STATE", iid, "RESTARTING", False,
                                                        cause, host.decide.incarnation))

    # -- the child (hosting's CallQueue in a process of its own) ------------------------------

    def _call(self, w: Any, iid: str, gen: int, cid: str) -> None:
        host = self._host(w, iid, gen)
        child = host.child if host is not None else None
        if child is None or not child.alive or child.gen != gen:
            return  # it died: the call never arrived
        if child.q.arrived(cid):
            self._admit(host, cid)

    def _admit(self, host: _Host, cid: str) -> None:
        """The child's queue started ``cid`` (in arrival order): it runs from now on, with
        the others side by side, and an executor picks it up (``ISO_RUN``)."""
        world, child = self.world, host.child
        n = self.deaths_running.get((host.serial, cid), 0)
        if n > BOUND:
            world.fail(f"charge: call {cid} starts again on {host.wname} after it was running "
                       f"at {n} deaths of {host.iid}'s process (bound {BOUND}): its crashes "
                       "were not charged to it")
        child.running.add(cid)
        if len(child.running) > host.conc:
            world.fail(f"hosting: {len(child.running)} calls of isolated {host.iid} run at once")
        rec = world.calls[cid]
        world.execs.setdefault((host.iid, host.wname, (host.decide.incarnation, host.gen)),
                               []).append((rec["caller"], rec["iid"], rec["seq"], cid))
        world.send(host.wname, host.wname, f"iso-run-{cid}",
                   ("ISO_RUN", host.iid, host.gen, cid))

    def _run(self, w: Any, iid: str, gen: int, cid: str) -> None:
        world = self.world
        host = self._host(w, iid, gen)
        child = host.child if host is not None else None
        if child is None or not child.alive:
            return
        world.say(w.name, "iso run", cid, iid, gen)
        rec = world.calls[cid]
        if "poison" not in rec:
            rec["poison"] = self.rng.random() < self.poison
        if rec["poison"]:
            self._kill_child(host, f"call {cid} killed it")
            return
        world.send(w.name, w.name, f"iso-finish-{cid}", ("ISO_FINISH", iid, gen, cid))

    def _finish(self, w: Any, iid: str, gen: int, cid: str) -> None:
        host = self._host(w, iid, gen)
        child = host.child if host is not None else None
        if child is None or not child.alive:
            return
        child.running.discard(cid)
        self.world.send(w.name, w.name, f"iso-out-{iid}-{gen}", ("ISO_DONE", iid, gen, cid))
        nxt = child.q.finished()
        if nxt is not None:
            self._admit(host, nxt)

    def _kill_child(self, host: _Host, cause: str) -> None:
        child = host.child
        assert child is not None
        child.alive = False
        self.world.say(host.wname, "iso process dies", host.iid, host.gen, cause,
                       "running", sorted(child.running))
        for cid in child.running:
            key = (host.serial, cid)
            self.deaths_running[key] = self.deaths_running.get(key, 0) + 1
        # its exit reaches the agent after the answers it sent (read before the death)
        self.world.send(host.wname, host.wname, f"iso-out-{host.iid}-{host.gen}",
                        ("ISO_EXIT", host.iid, host.gen, cause))
