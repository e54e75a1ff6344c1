"""The object world: borrowers counted across processes (``yrdask/runtime/refcount.py``).

Several processes, each with a real :class:`RefCounter`, put objects, call each other (and
themselves: a task calling an instance on its own worker) with refs in the arguments,
return refs nested in results, keep refs (instance state), read results and drop refs,
while the wire delays, reorders and duplicates the protocol messages and processes die.
The world keeps the *truth* (which process really holds which ref, which refs travel
inside undelivered messages) and checks after every step:

* **safe**: no object is freed while a live process holds it, a live value holds it, or a
  message to a live process carries it;
* **complete**: at quiescence (everyone dropped everything, the wire is empty) every record
  is gone and every object of a live owner was freed, exactly once;
* each machine's ``validate()``.

A borrower that dies after lending a ref on takes that lending with it (as in Ray): the
objects it lent on are exempt from the safety check (``tainted``), nothing else is.

``python -m tests.sim --objects --seeds 0:2000`` runs seeds; ``--seed N`` prints a story.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field

from yrdask.runtime import refcount as R
from tests.sim.world import SimFailure


@dataclass
class Proc:
    name: str
    machine: R.RefCounter
    alive: bool = True
    local: Counter = field(default_factory=Counter)  # object -> live refs here
    user: Counter = field(default_factory=Counter)  # those the program may drop at will
    values: dict = field(default_factory=dict)  # owned object -> refs its value holds
    table: set = field(default_factory=set)  # ids in the object table (entries alive)
    lent_on: set = field(default_factory=set)  # objects this process passed to others


@dataclass
class Msg:
    kind: str  # "run", "done", "wait", "removed"
    src: str
    dst: str
    body: tuple


class ObjectWorld:
    """One seeded scenario (see module docstring)."""

    def __init__(self, seed: int, procs: int | None = None, steps: int | None = None) -> None:
        self.seed = seed
        self.rng = random.Random(seed)
        n = procs or self.rng.randint(2, 4)
        self.procs = {f"P{i}": Proc(f"P{i}", R.RefCounter(f"P{i}")) for i in range(n)}
        self.steps = steps or self.rng.randint(20, 160)
        self.p_dup = self.rng.choice([0.0, 0.1, 0.3])
        self.p_die = self.rng.choice([0.0, 0.0, 0.01, 0.03])
        self.wire: list[Msg] = []
        self.owner: dict[str, str] = {}
        self.freed: Counter = Counter()
        self.tainted: set[str] = set()
        self.tasks: dict[str, tuple] = {}  # task id -> (caller, callee, args)
        self.contents: dict[str, list] = {}  # object -> refs its value holds (truth)
        self.n = 0
        self.step = 0
        self.log: list[str] = []

    # -- plumbing ----------------------------------------------------------------------------

    def new_id(self, kind: str) -> str:
        self.n += 1
        return f"{kind}{self.n}"

    def say(self, text: str) -> None:
        self.log.append(f"{self.step:4d} {text}")

    def fail(self, text: str) -> None:
        raise SimFailure(f"object seed {self.seed}: {text}", self, ())

    def feed(self, p: Proc, event: R.Event) -> None:
        """``event`` to ``p``'s machine; carry out its instructions as the adapter does."""
        self.say(f"{p.name} <- {event}")
        for ins in p.machine.handle(event):
            self.say(f"{p.name} -> {ins}")
            kind = type(ins)
            if kind is R.FreeObject:
                oid = ins.object_id
                if self.owner.get(oid) != p.name:
                    self.fail(f"{p.name} freed {oid}, which it does not own")
                self.freed[oid] += 1
                if self.freed[oid] > 1:
                    self.fail(f"{oid} freed twice")
                p.table.discard(oid)
                p.values.pop(oid, None)
            elif kind is R.SendWait:
                self.send("wait", p.name, ins.borrower, (ins.object_id, ins.seq, ins.via))
            elif kind is R.SendRemoved:
                self.send("removed", p.name, ins.owner, (ins.object_id, ins.seq))
            elif kind is R.SendAddBorrower:
                self.send("addb", p.name, ins.owner,
                          (ins.object_id, ins.borrower, ins.via, ins.token))
            elif kind is R.OwnersDied:
                for oid in ins.object_ids:
                    p.local.pop(oid, None)
                    p.user.pop(oid, None)
                    p.table.discard(oid)

    def send(self, kind: str, src: str, dst: str, body: tuple) -> None:
        self.wire.append(Msg(kind, src, dst, body))

    def add_ref(self, p: Proc, oid: str) -> None:
        """A ref of ``oid`` appears in ``p`` (made, unpickled or read)."""
        owner = self.owner[oid]
        if owner != p.name and not self.procs[owner].alive:
            return  # its owner is dead: the adapter fails the read (OwnerDiedError)
        if owner == p.name and self.freed[oid]:
            if oid not in self.tainted:
                self.fail(f"{oid} came back to its owner {owner} after it was freed")
            return  # the adapter makes it an ObjectLostError
        p.local[oid] += 1
        if p.local[oid] == 1:
            counted = owner != p.name or p.machine.knows(oid)
            p.table.add(oid)
            if counted:
                self.feed(p, R.LocalRefs(f"ref-{oid}", oid, True, owner))

    def drop_ref(self, p: Proc, oid: str) -> None:
        if p.local[oid] <= 0:
            return
        p.local[oid] -= 1
        if p.local[oid]:
            return
        del p.local[oid]
        if p.machine.knows(oid):
            self.feed(p, R.LocalRefs(f"drop-{oid}", oid, False))
            if self.owner[oid] == p.name:
                return  # freed by the machine, or kept for borrowers
        p.table.discard(oid)
        if self.owner[oid] == p.name and not p.machine.knows(oid):
            self.freed[oid] += 1  # never counted: freed with its last ref (the fast path)
            p.values.pop(oid, None)

    # -- actions -----------------------------------------------------------------------------

    def live(self) -> list[Proc]:
        return [p for p in self.procs.values() if p.alive]

    def held(self, p: Proc) -> list[str]:
        return sorted(o for o, n in p.local.items() if n > 0)

    def mine(self, p: Proc) -> list[str]:
        """Refs the program holds (not those a call in flight holds)."""
        return sorted(o for o, n in p.user.items() if n > 0 and p.local[o] > 0)

    def user_drop(self, p: Proc, oid: str) -> None:
        p.user[oid] -= 1
        self.drop_ref(p, oid)

    def act(self) -> None:
        rng = self.rng
        procs = self.live()
        p = rng.choice(procs)
        roll = rng.random()
        if roll < 0.12 or not self.mine(p):
            self.put(p)
        elif roll < 0.30:
            # a call to this very process too: a task submitting to its own worker, or an
            # instance hosted there (the LocalChannel); refs nested in its result are lent
            # to the process that lends them
            self.call(p, rng.choice(procs))
        elif roll < 0.42:
            self.user_drop(p, rng.choice(self.mine(p)))
        elif roll < 0.48:
            self.read(p)
        elif roll < 0.48 + self.p_die and len(procs) > 1:
            self.die(rng.choice(procs))
        else:
            self.deliver()

    def put(self, p: Proc) -> None:
        oid = self.new_id("put")
        self.owner[oid] = p.name
        inner = [o for o in self.mine(p) if self.rng.random() < 0.3]
        p.table.add(oid)
        p.local[oid] += 1
        p.user[oid] += 1
        if inner:
            p.values[oid] = inner
            self.contents[oid] = inner
            self.feed(p, R.Contains(f"put-{oid}", oid,
                                    tuple((o, self.owner[o], True) for o in inner)))

    def call(self, p: Proc, q: Proc) -> None:
        args = [o for o in self.mine(p) if self.rng.random() < 0.5]
        tid = self.new_id("task")
        p.local[tid] += 1  # its result's ref (pending entry)
        p.user[tid] += 1
        p.table.add(tid)
        self.owner[tid] = p.name
        for o in args:
            p.local[o] += 1  # the task holds its arguments until it ends
            p.lent_on.add(o)  # should p die, the call it sent may still arrive
        self.tasks[tid] = (p.name, q.name, args)
        self.send("run", p.name, q.name, (tid, tuple(args)))

    def read(self, p: Proc) -> None:
        """Read an owned value here: its nested refs become local refs."""
        owned = [o for o in self.mine(p) if o in p.values]
        if owned:
            for inner in p.values[self.rng.choice(owned)]:
                if self.owner[inner] == p.name or p.machine.knows(inner):
                    before = p.local[inner]
                    self.add_ref(p, inner)
                    if p.local[inner] > before:
                        p.user[inner] += 1

    def reaches(self, start: str, target: str) -> bool:
        """Whether ``target`` is ``start`` or nested (transitively) in its value."""
        seen, todo = set(), [start]
        while todo:
            oid = todo.pop()
            if oid == target:
                return True
            if oid not in seen:
                seen.add(oid)
                todo.extend(self.contents.get(oid, ()))
        return False

    def die(self, p: Proc) -> None:
        self.say(f"{p.name} DIES")
        p.alive = False
        self.tainted |= p.lent_on
        for q in self.live():
            self.feed(q, R.ProcessDied(f"lost-{p.name}", p.name))
        for tid, (caller, callee, args) in list(self.tasks.items()):
            if callee == p.name and self.procs[caller].alive:  # the task fails: args let go
                del self.tasks[tid]
                c = self.procs[caller]
                for o in args:
                    self.drop_ref(c, o)

    # -- the wire ----------------------------------------------------------------------------

    def deliver(self) -> None:
        if not self.wire:
            return
        msg = self.wire.pop(self.rng.randrange(len(self.wire)))
        if self.rng.random() < self.p_dup and msg.kind in ("wait", "removed", "addb", "ack"):
            self.wire.insert(self.rng.randrange(len(self.wire) + 1), msg)  # duplicated
        dst = self.procs[msg.dst]
        if not dst.alive:  # an rpc to a dead process fails: its sender learns of the death
            if msg.kind in ("wait", "addb") and self.procs[msg.src].alive:
                self.feed(self.procs[msg.src], R.ProcessDied(f"unsent-{msg.dst}", msg.dst))
            return
        getattr(self, f"on_{msg.kind}")(dst, msg)

    def on_run(self, q: Proc, msg: Msg) -> None:
        """A call runs in ``q``: it unpickles its arguments, may put new objects, keeps
        some refs (instance state), returns some nested in its result, and ends."""
        tid, args = msg.body
        if tid not in self.tasks:
            return
        rng = self.rng
        frame = []
        for o in args:
            before = q.local[o]
            self.add_ref(q, o)  # unpickled
            if q.local[o] > before:
                frame.append(o)
        borrowed = [o for o in args if self.owner[o] != q.name]
        while rng.random() < 0.4:  # yr.put inside the task
            oid = self.new_id("put")
            self.owner[oid] = q.name
            q.table.add(oid)
            q.local[oid] += 1
            frame.append(oid)
        for o in frame:
            if rng.random() < 0.25:
                q.user[o] += 1  # kept (instance state, a global): a ref of the program's
                q.local[o] += 1
        # a value holding a ref to itself (through others) is never freed, in Ray as here:
        # programs avoid such cycles, and so does this world
        nested = sorted({o for o in frame if rng.random() < 0.5 and not self.reaches(o, tid)})
        if nested:
            self.contents[tid] = nested
        for o in nested:
            if self.owner[o] != msg.src:
                q.lent_on.add(o)
            self.feed(q, R.Lent(f"pack-{tid}", o, msg.src, tid, self.owner[o], True,
                                tid in q.table))
        for o in frame:
            self.drop_ref(q, o)  # the call's frame ends
        self.send("done", q.name, msg.src, (tid, tuple(borrowed), tuple(nested)))

    def on_done(self, p: Proc, msg: Msg) -> None:
        tid, borrowed, nested = msg.body
        task = self.tasks.pop(tid, None)
        if task is None:
            return
        for o in borrowed:
            if o in p.table:
                self.feed(p, R.Lent(f"done-{tid}", o, msg.src, None, self.owner[o],
                                    p.local[o] > 0))
        if nested and tid in p.table:
            p.values[tid] = list(nested)
            self.feed(p, R.Contains(f"done-{tid}", tid, tuple(
                (o, self.owner[o], p.local[o] > 0) for o in nested)))
        for o in task[2]:
            self.drop_ref(p, o)

    def on_wait(self, b: Proc, msg: Msg) -> None:
        oid, seq, via = msg.body
        self.feed(b, R.WaitReceived(f"wait-{oid}", oid, msg.src, seq, via,
                                    via is not None and via in b.table))

    def on_removed(self, o: Proc, msg: Msg) -> None:
        oid, seq = msg.body
        self.feed(o, R.RemovedReceived(f"removed-{oid}", oid, msg.src, seq))

    def on_addb(self, o: Proc, msg: Msg) -> None:
        oid, borrower, via, token = msg.body
        if self.owner[oid] == o.name and oid in o.table:
            self.feed(o, R.BorrowerAdded(f"addb-{oid}", oid, borrower, via, o.local[oid] > 0))
        self.send("ack", o.name, msg.src, (oid, token))  # the rpc's answer

    def on_ack(self, b: Proc, msg: Msg) -> None:
        oid, token = msg.body
        self.feed(b, R.AddAcked(f"ack-{oid}", oid, token))

    # -- checks ------------------------------------------------------------------------------

    def check_safe(self) -> None:
        def need(oid: str, why: str) -> None:
            owner = self.procs[self.owner[oid]]
            if self.freed[oid] and owner.alive and oid not in self.tainted:
                self.fail(f"{oid} was freed while {why}")

        for p in self.live():
            for oid, n in p.local.items():
                if n > 0:
                    need(oid, f"{p.name} holds it")
            for outer, inner in p.values.items():
                if outer in p.table:
                    for oid in inner:
                        need(oid, f"{p.name}'s value {outer} holds it")
        for m in self.wire:
            if self.procs[m.dst].alive and m.kind == "run":
                for oid in m.body[1]:
                    need(oid, f"a call to {m.dst} carries it")
            elif self.procs[m.dst].alive and m.kind == "done" and m.body[0] in self.tasks \
                    and m.body[0] in self.procs[m.dst].table:  # its caller may read it
                for oid in m.body[2]:
                    need(oid, f"the result {m.body[0]} to {m.dst} carries it")
        for p in self.live():
            try:
                p.machine.validate()
            except AssertionError as e:
                self.fail(f"{p.name}.validate(): {e}")

    def run(self) -> "ObjectWorld":
        for self.step in range(self.steps):
            self.act()
            self.check_safe()
        # quiescence: everyone drops everything, and the wire drains
        for guard in range(100_000):
            held = [(p, oid) for p in self.live() for oid in self.mine(p)]
            if not held and not self.wire:
                break
            if held and (not self.wire or self.rng.random() < 0.3):
                p, oid = self.rng.choice(held)
                self.user_drop(p, oid)
            else:
                self.deliver()
            self.check_safe()
            self.step += 1
        else:
            self.fail("no quiescence")
        for p in self.live():
            if p.machine.refs:
                self.fail(f"{p.name} keeps records at quiescence: {sorted(p.machine.refs)}")
        for oid, owner in self.owner.items():
            if self.procs[owner].alive and self.freed[oid] != 1:
                self.fail(f"{oid} (owner {owner}) freed {self.freed[oid]} times at quiescence")
        return self

    def story(self, tail: int | None = None) -> str:
        rows = self.log if tail is None else self.log[-tail:]
        return "\n".join(rows)


def run_object_seed(seed: int) -> ObjectWorld:
    return ObjectWorld(seed).run()


def main_objects(args) -> int:
    """``python -m tests.sim --objects``: one seed with its story, or a range of seeds."""
    import time

    seeds = [args.seed] if args.seed is not None else range(
        *(int(x) for x in (args.seeds or "0:1000").split(":")))
    t0 = time.perf_counter()
    failed = []
    for seed in seeds:
        try:
            world = run_object_seed(seed)
        except SimFailure as e:
            failed.append(seed)
            print(e.message)
            print(f"replay: python -m tests.sim --objects --seed {seed}")
            print(e.world.story(args.tail or (60 if args.seed is None else None)))
            if not args.keep_going:
                break
            continue
        if args.seed is not None:
            print(world.story(args.tail))
            print(f"seed {seed}: ok ({world.step} steps, {len(world.owner)} objects, "
                  f"{sum(world.freed.values())} freed)")
    print(f"{len(seeds)} object seeds in {time.perf_counter() - t0:.1f} s, {len(failed)} failed"
          + (f": {failed}" if failed else ""))
    return 1 if failed else 0
