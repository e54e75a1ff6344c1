"""Instance calls through the real ``CallOrder`` (one per driver) in a seeded world.

Drivers create instances and call them (and each other's); workers host instances and run
their calls one at a time in arrival order; a small scheduler stub places instances, answers
``LOCATE_INSTANCE`` and restarts the instances of a dead worker (up to a bound).  Links are
FIFO per (sender, receiver, channel); ``random.Random(seed)`` picks what happens next.

Checks: every call settles exactly once; within one incarnation of an instance the calls of
one caller run in submission order; a call whose answer arrived is never sent again; a call
fails only with its argument's error or because its instance ran out of restarts; each
``CallOrder.validate()`` holds after every step; at the end no route keeps calls.
"""

from __future__ import annotations

import random
from collections import deque
from typing import Any

from yrdask.errors import InstanceDiedError, ScheduleError
from yrdask.runtime import call_order as C

from tests.sim.world import SimFailure


class ArgBoom(Exception):
    """A call's ref argument failed."""


class CallWorld:
    def __init__(self, seed: int) -> None:
        self.seed = seed
        rng = self.rng = random.Random(seed * 31 + 5)
        self.now = 0.0
        self.step = 0
        self.links: dict[tuple, deque] = {}
        self.busy: dict[tuple, None] = {}
        self.log: list[tuple] = []
        self.workers = {f"w{i}": True for i in range(rng.randint(1, 3))}
        self.nworkers = len(self.workers)
        self.drivers = {f"d{i}": C.CallOrder() for i in range(rng.randint(1, 2))}
        self.max_restarts = rng.choice([0, 1, 3])
        self.instances: dict[str, dict] = {}  # id -> {worker, inc, dead, restarts}
        self.hosted: dict[str, dict] = {w: {} for w in self.workers}  # worker -> iid -> queue
        self.calls: dict[str, dict] = {}  # call id -> record
        self.execs: dict[tuple, list] = {}  # (iid, incarnation) -> [(caller, seq, call id)]
        self.plan: list = []  # (order key, action)
        self.describe = (f"seed {seed}: workers {list(self.workers)}, drivers "
                         f"{list(self.drivers)}, max restarts {self.max_restarts}")
        n = 0
        for d in self.drivers:
            for _ in range(rng.randint(1, 2)):
                iid = f"i{len(self.instances)}"
                self.instances[iid] = {"worker": None, "inc": 0, "dead": None, "restarts": 0,
                                       "creator": d}
                self.do(d, C.CreateRequested(f"create-{iid}", iid))
                self.do(d, C.CreateDepsReady(f"deps-{iid}", iid))
        iids = list(self.instances)
        for d in self.drivers:
            for _ in range(rng.randint(2, 12)):
                n += 1
                self.plan.append(("call", d, f"c{n}", rng.choice(iids), rng.random()))
        if rng.random() < 0.4:
            self.plan.insert(rng.randrange(len(self.plan) + 1), ("kill",))
        self.seqs: dict[str, int] = {}
        self.waiters: dict[str, list] = {}

    # -- plumbing --------------------------------------------------------------------------

    def say(self, *what: Any) -> None:
        self.log.append((self.step, what))

    def send(self, src: str, dst: str, chan: str, msg: tuple) -> None:
        if dst in self.workers and not self.workers[dst]:
            if chan == "call":
                self.send("net", src, "lost", ("LOST", dst))
            return
        key = (src, dst, chan)
        self.links.setdefault(key, deque()).append(msg)
        self.busy[key] = None

    def fail(self, message: str) -> None:
        raise SimFailure(message, self)  # type: ignore[arg-type]

    # -- the caller adapter (runtime/instance_router.py) --------------------------------------

    def do(self, d: str, event: Any) -> None:
        co = self.drivers[d]
        for ins in co.handle(event):
            name = type(ins).__name__
            if name == "SendCreate":
                self.send(d, "sched", f"rpc-create-{ins.instance_id}", ("CREATE", ins.instance_id))
            elif name == "SendLocate":
                self.send(d, "sched", f"rpc-locate-{ins.instance_id}-{self.step}",
                          ("LOCATE", ins.instance_id, ins.lost))
            elif name == "SendCall":
                rec = self.calls[ins.call_id]
                if rec["answered"]:
                    self.fail(f"call {ins.call_id} sent again after its answer arrived")
                rec["sent"] += 1
                self.say(d, "send", ins.call_id, ins.worker)
                self.send(d, ins.worker, "call", ("CALL", ins.call_id, ins.instance_id, d))
            elif name in ("CallSucceeded", "CallFailed"):
                rec = self.calls[ins.call_id]
                rec["settled"] += 1
                if rec["settled"] > 1:
                    self.fail(f"call {ins.call_id} settled twice")
                err = getattr(ins, "error", None)
                self.say(d, "settled", ins.call_id, repr(err) if err else "ok")
                if err is not None and not (
                        (isinstance(err, ArgBoom) and rec["bad_arg"])
                        or (isinstance(err, (InstanceDiedError, ScheduleError))
                            and self.instances[rec["iid"]]["dead"])):
                    self.fail(f"call {ins.call_id} failed with {err!r}")
                if err is None and rec["bad_arg"]:
                    self.fail(f"call {ins.call_id} succeeded though its argument failed")
            elif name == "FlushSoon":
                self.send(d, d, "flush", ("FLUSH",))
            elif name == "ReportHandles":
                pass
            else:
                self.fail(f"unknown instruction {ins}")
        co.validate()

    # -- scheduler stub and workers -----------------------------------------------------------

    def place(self, iid: str) -> str | None:
        live = [w for w, up in self.workers.items() if up]
        if not live:
            return None
        inst = self.instances[iid]
        inst["worker"] = self.rng.choice(live)
        inst["inc"] += 1
        self.send("sched", inst["worker"], "stream", ("START", iid, inst["inc"]))
        return inst["worker"]

    def at_sched(self, src: str, msg: tuple) -> None:
        op = msg[0]
        if op == "CREATE":
            w = self.place(msg[1])
            if w is None:
                self.instances[msg[1]]["dead"] = "no workers"
                self.send("sched", src, "rpc", ("CREATE_FAILED", msg[1], "no workers"))
            else:
                self.send("sched", src, "rpc", ("CREATED", msg[1], w))
            for waiter in self.waiters.pop(msg[1], ()):
                self.at_sched(waiter, ("LOCATE", msg[1], None))
        elif op == "LOCATE":
            inst = self.instances[msg[1]]
            if inst["dead"]:
                self.send("sched", src, "rpc", ("LOCATED", msg[1], None, inst["dead"]))
            elif inst["worker"] is None:  # not placed yet: answer once it is
                self.waiters.setdefault(msg[1], []).append(src)
            else:
                self.send("sched", src, "rpc", ("LOCATED", msg[1], inst["worker"], ""))
        elif op == "LEFT":
            for iid, inst in self.instances.items():
                if inst["worker"] == msg[1] and not inst["dead"]:
                    if inst["restarts"] >= self.max_restarts:
                        inst["dead"], inst["worker"] = "out of restarts", None
                    else:
                        inst["restarts"] += 1
                        if self.place(iid) is None:
                            inst["dead"], inst["worker"] = "no workers", None

    def at_worker(self, w: str, src: str, msg: tuple) -> None:
        hosted = self.hosted[w]
        if msg[0] == "START":
            _, iid, inc = msg
            early = hosted.get(iid, {}).get("queue", deque())
            hosted[iid] = {"inc": inc, "queue": early}
            if early:
                self.send(w, w, f"run-{iid}", ("RUN", iid))
        elif msg[0] == "CALL":
            _, cid, iid, caller = msg
            h = hosted.setdefault(iid, {"inc": None, "queue": deque()})
            h["queue"].append((cid, caller))
            if h["inc"] is not None and len(h["queue"]) == 1:
                self.send(w, w, f"run-{iid}", ("RUN", iid))
        elif msg[0] == "RUN":  # run the head call of the instance (one at a time)
            h = hosted.get(msg[1])
            if not h or not h["queue"] or h["inc"] is None:
                return
            cid, caller = h["queue"].popleft()
            rec = self.calls[cid]
            self.execs.setdefault((msg[1], h["inc"]), []).append((caller, rec["seq"], cid))
            self.say(w, "run", cid, msg[1], h["inc"])
            self.send(w, caller, "call", ("DONE", cid))
            if h["queue"]:
                self.send(w, w, f"run-{msg[1]}", ("RUN", msg[1]))

    def kill(self) -> None:
        live = [w for w, up in self.workers.items() if up]
        if not live:
            return
        w = self.rng.choice(live)
        self.workers[w] = False
        self.say(w, "KILLED")
        for key in list(self.links):
            if w in key[:2]:
                self.links[key].clear()
                self.busy.pop(key, None)
        if self.rng.random() < 0.7:
            nw = f"w{self.nworkers}"
            self.nworkers += 1
            self.workers[nw] = True
            self.hosted[nw] = {}
        self.send("cluster", "sched", "ctl", ("LEFT", w))
        for d in self.drivers:
            self.send("net", d, "lost", ("LOST", w))

    # -- run -------------------------------------------------------------------------------

    def run(self) -> None:
        rng = self.rng
        while True:
            self.step += 1
            if self.step > 20_000:
                self.fail("livelock")
            if self.plan and (not self.busy or rng.random() < 0.3):
                action = self.plan.pop(0)
                if action[0] == "kill":
                    self.kill()
                    continue
                _, d, cid, iid, r = action
                seq = self.seqs[d] = self.seqs.get(d, 0) + 1
                ready = r > 0.2
                bad = r < 0.05
                self.calls[cid] = {"iid": iid, "seq": seq, "settled": 0, "answered": False,
                                   "sent": 0, "bad_arg": bad, "caller": d}
                self.say(d, "call", cid, iid, "ready" if ready else "waits for its argument")
                self.do(d, C.CallSubmitted(f"call-{cid}", cid, iid, ready=ready))
                if not ready:
                    self.send(d, d, f"deps-{cid}", ("DEPS", cid, ArgBoom(cid) if bad else None))
                continue
            if not self.busy:
                break
            keys = list(self.busy)
            key = keys[rng.randrange(len(keys))]
            q = self.links[key]
            msg = q.popleft()
            if not q:
                del self.busy[key]
            src, dst, _ = key
            self.say(dst, "<-", src, msg)
            if dst == "sched":
                self.at_sched(src, msg)
            elif dst in self.workers:
                if self.workers[dst]:
                    self.at_worker(dst, src, msg)
            else:
                self.at_driver(dst, src, msg)
        self.check_end()

    def at_driver(self, d: str, src: str, msg: tuple) -> None:
        op, sid = msg[0], f"{msg[0].lower()}-{self.step}"
        if op == "CREATED":
            self.do(d, C.Created(sid, msg[1], msg[2], msg[1]))
        elif op == "CREATE_FAILED":
            self.do(d, C.CreateFailed(sid, msg[1], msg[2]))
        elif op == "LOCATED":
            self.do(d, C.Located(sid, msg[1], msg[2], msg[3] or "", msg[1]))
        elif op == "DONE":
            rec = self.calls[msg[1]]
            if src in self.workers and not self.workers[src]:
                return
            self.do(d, C.CallDone(sid, msg[1]))
            rec["answered"] = rec["settled"] == 1
        elif op == "LOST":
            self.do(d, C.ChannelLost(sid, msg[1]))
        elif op == "DEPS":
            self.do(d, C.CallDepsReady(sid, msg[1], msg[2]))
        elif op == "FLUSH":
            self.do(d, C.Flush(sid))

    def check_end(self) -> None:
        for cid, rec in self.calls.items():
            if rec["settled"] != 1:
                self.fail(f"hang: call {cid} on {rec['iid']} never settled "
                          f"(sent {rec['sent']} times)")
        for (iid, inc), runs in self.execs.items():
            last: dict[str, int] = {}
            for caller, seq, cid in runs:
                if seq <= last.get(caller, 0):
                    self.fail(f"order: {cid} of {caller} (#{seq}) ran after #{last[caller]} "
                              f"in incarnation {inc} of {iid}: {runs}")
                last[caller] = seq
        for d, co in self.drivers.items():
            for iid, route in co.routes.items():
                if route.queue or route.inflight:
                    self.fail(f"{d}'s route to {iid} keeps calls at the end")

    def story(self, tail: int = 60) -> str:
        rows = [f"{step:6d}  {' '.join(map(str, what))}" for step, what in self.log[-tail:]]
        return self.describe + "\n" + "\n".join(rows)


def run_call_seed(seed: int) -> CallWorld:
    world = CallWorld(seed)
    world.run()
    return world
