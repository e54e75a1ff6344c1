"""A second set of rule-breaking changes, written from the production code alone.

Each one plants a small slip a developer could make (an off-by-one, a forgotten branch, a
check left out, a wrong classification) in a machine or in the wiring around one, in the
:class:`~tests.sim.mutations.Mutation` format of ``mutations.py``.  They were written without
reading that module's list or the worlds' checks, so they test whether the simulation's
independent checks catch bugs its authors did not think of: progress (what fits is never
granted or placed), results (a settlement that does not match what the executing side
answered), capacity per lease, timers (a deadline set late), race branches (a requester or a
worker already gone) and ordinary safety slips.

``python -m tests.sim.mutations_fresh [BUDGET] [NAME ...]`` runs each (or the named ones)
within ``BUDGET`` seeds (default: its own budget, a few times the seed that catches it under
``PYTHONHASHSEED=0``) and prints the first seed that caught it;
``tests/sim/test_mutations.py`` holds each to its budget in CI.
"""

from __future__ import annotations

import time

from tests.sim.mutations import Mutation, Patch, _Patcher, apply, first_catch

LQ_V = ("yrdask.scheduler.leases", "LeaseQueue")
SQ_V = ("yrdask.runtime.submit_queue", "SubmitQueue")
GATE_V = ("yrdask.worker.lease_gate", "LeaseGate")
CO_V = ("yrdask.runtime.call_order", "CallOrder")
LC_V = ("yrdask.scheduler.lifecycle", "Lifecycle")
RG_V = ("yrdask.scheduler.groups", "GroupMachine")


# -- the machines ----------------------------------------------------------------------------


def _lent_release_twice(patch: Patch) -> None:
    """``Ledger.release`` forgets that a lent lease's CPU was given back already
    (``if holding.lent_cpu: shape.pop("CPU")`` left out): its CPU is subtracted twice."""
    from yrdask.scheduler.resources import Ledger

    real = Ledger.release

    def release(self, holding_id):
        h = self.holdings.get(holding_id)
        if h is not None and h.lent_cpu:
            h.lent_cpu = False
        return real(self, holding_id)
    patch(Ledger, "release", release)


def _join_grants_nothing(patch: Patch) -> None:
    """``LeaseQueue._worker_joined`` adds the worker but forgets ``_grant_pending``: what
    waits and fits the new worker is not granted until something else frees."""
    from yrdask.scheduler import leases as LQ

    real = LQ.LeaseQueue._worker_joined

    def _worker_joined(self, ev):
        self._grant_pending = lambda sid, out: None
        try:
            return real(self, ev)
        finally:
            del self._grant_pending
    patch(LQ.LeaseQueue, "_worker_joined", _worker_joined)


def _deadline_in_tenths(patch: Patch) -> None:
    """A waiting request's deadline converts ``timeout_ms`` with ``/ 100`` instead of
    ``/ 1000``: it is refused ten times later than asked."""
    from yrdask.scheduler import leases as LQ

    real = LQ._Waiter.__init__

    def __init__(self, ev):
        real(self, ev)
        if ev.timeout_ms >= 0:
            self.deadline = ev.now + ev.timeout_ms / 100
    patch(LQ._Waiter, "__init__", __init__)


def _group_exact_fit_refused(patch: Patch) -> None:
    """``groups.place``'s quick total check compares with ``>=`` (and no slack): a group
    whose bundles add up to exactly what is free is never placed."""
    from yrdask.scheduler import groups as RG

    real = RG.place

    def place(strategy, todo, fixed, free):
        for r in {r for shape in todo.values() for r in shape}:
            if sum(shape.get(r, 0.0) for shape in todo.values()) >= \
                    sum(max(0.0, f.get(r, 0.0)) for f in free.values()):
                return None
        return real(strategy, todo, fixed, free)
    patch(RG, "place", place)


def _restart_budget_off_by_one(patch: Patch) -> None:
    """``InstanceRecord.can_restart`` compares ``restarts <= limit``: every instance restarts
    once more than its ``recover_retry_times`` (and once with none)."""
    from yrdask.scheduler import lifecycle as L

    def can_restart(self):
        limit = self.spec.get("recover_retry_times") or 0
        return limit == -1 or self.restarts <= limit
    patch(L.InstanceRecord, "can_restart", property(can_restart))


def _grant_on_lost_worker_used(patch: Patch) -> None:
    """``SubmitQueue._lease_granted`` forgets the just-lost worker check (``_avoided``): a
    grant on a worker the submitter just lost its channel to is used, tasks pushed there."""
    from yrdask.runtime import submit_queue as SQ

    patch(SQ.SubmitQueue, "_avoided", lambda self, worker: False)


def _gate_spare_keeps_slots(patch: Patch) -> None:
    """``LeaseGate.arrived`` reuses the spare lease record but forgets ``lease.slots =
    slots``: a lease runs as many tasks at once as the last idle lease could."""
    from yrdask.worker import lease_gate as G

    real = G.LeaseGate.arrived

    def arrived(self, sid, task_id, lease_id, slots, now):
        if lease_id not in self.leases and self._spare is not None:
            slots = self._spare.slots
        return real(self, sid, task_id, lease_id, slots, now)
    patch(G.LeaseGate, "arrived", arrived)


def _node_keeps_dead_share(patch: Patch) -> None:
    """``Ledger._drop_process`` forgets to sum the node's capacity again (``self._sum(ns)``)
    when one of its processes goes: the node keeps offering the dead process's share."""
    from yrdask.scheduler.resources import Ledger

    real = Ledger._drop_process

    def _drop_process(self, address):
        self._sum = lambda ns: None
        try:
            return real(self, address)
        finally:
            del self._sum
    patch(Ledger, "_drop_process", _drop_process)


def _placed_for_ended_kept(patch: Patch) -> None:
    """``Lifecycle._placed`` ignores a placement for an instance that ended while it waited
    (the ``ReleaseResources`` branch left out): the resources granted to it are never given
    back."""
    from yrdask import protocol as P
    from yrdask.scheduler import lifecycle as L

    real = L.Lifecycle._placed

    def _placed(self, ev, out):
        rec = self.instances.get(ev.instance_id)
        if rec is None or rec.state == P.DEAD:
            self._log(ev.stimulus_id, "placed-ignored", ev.instance_id, ev.worker)
            return
        real(self, ev, out)
    patch(L.Lifecycle, "_placed", _placed)


def _done_count_off_by_one(patch: Patch) -> None:
    """``CallOrder._done`` lowers the instance's count while ``n >= 1`` (not ``n > 1``): the
    last settled call leaves a count of 0 behind instead of dropping the holder, so the
    scheduler never hears this process let go (an unnamed instance is never released)."""
    from yrdask.runtime import call_order as C

    def _done(self, ev, out):
        cid = ev.call_id
        call = self.calls.get(cid)
        route = self.routes.get(call.instance_id) if call is not None else None
        if route is None or route.inflight.pop(cid, None) is None:
            self.story.log(ev.stimulus_id, ("done-ignored", cid), (cid,))
            return
        del self.calls[cid]
        iid = call.instance_id
        if ev.error is None:
            out.append(C.CallSucceeded(ev.stimulus_id, cid))
        else:
            out.append(C.CallFailed(ev.stimulus_id, cid, ev.error))
        n = self.counts.get(iid)
        if n is not None and n >= 1:
            self.counts[iid] = n - 1
        else:
            self._decref(iid, ev.stimulus_id, out)
    patch(C.CallOrder, "_done", _done)


# -- the wiring ------------------------------------------------------------------------------


def _lone_failure_succeeds(patch: Patch) -> None:
    """``CallRouter.done``'s shortcut tests ``len(out) == 1`` without the instruction's
    type: a failed call whose answer is the only instruction settles as a success."""
    from yrdask.errors import InstanceMovedError
    from yrdask.runtime import call_order as C
    from yrdask.runtime.call_router import CallRouter

    def done(self, call_id, error=None):
        if error is None and self.order.succeeded_at_once(call_id):
            self.edge.call_succeeded(call_id)
            return
        if type(error) is InstanceMovedError:
            self._do(self.order.handle(C.CallMoved(f"moved-{call_id}", call_id)))
            return
        out = self.order.handle(C.CallDone(call_id, call_id, error))
        if len(out) == 1:
            self.edge.call_succeeded(call_id)
        else:
            self._do(out)
    patch(CallRouter, "done", done)


def _late_call_parked(patch: Patch) -> None:
    """``InstanceSide.call_method`` forgets the ``ended`` branch: a call that reaches a
    worker after its instance was stopped there waits for a ``START`` that never comes."""
    from yrdask.worker.instance_side import InstanceSide

    def call_method(self, peer, msg):
        iid = msg["instance_id"]
        inst = self.instances.get(iid)
        if inst is not None:
            if self.held and iid in self.held:
                self.held[iid].append((peer, msg))
                return
            inst.call(peer, msg)
            return
        if iid in self.moved:
            self.edge.moved_away(peer, msg, self.moved[iid])
        else:
            self.early.setdefault(iid, []).append((peer, msg))
    patch(InstanceSide, "call_method", call_method)


FRESH: list[Mutation] = [
    Mutation("ledger-lent-release-twice", "tasks",
             "resources.Ledger.release subtracts a lent lease's CPU a second time (safety: "
             "the node looks freer than it is)", _lent_release_twice, 100, (LQ_V,)),
    Mutation("join-grants-nothing", "tasks",
             "leases.LeaseQueue._worker_joined never grants what waits (progress: a request "
             "that fits a new worker waits on)", _join_grants_nothing, 100, (LQ_V,)),
    Mutation("deadline-in-tenths", "tasks",
             "leases._Waiter's deadline is timeout_ms / 100 (timer: refused 10x late)",
             _deadline_in_tenths, 50, (LQ_V,)),
    Mutation("group-exact-fit-refused", "tasks",
             "groups.place refuses a group that exactly fills what is free (progress: a "
             "group that fits is never placed)", _group_exact_fit_refused, 1500, (RG_V,)),
    Mutation("restart-budget-off-by-one", "calls",
             "lifecycle.InstanceRecord.can_restart is restarts <= limit (safety: one restart "
             "more than recover_retry_times)", _restart_budget_off_by_one, 50, (LC_V,)),
    Mutation("grant-on-lost-worker-used", "tasks",
             "submit_queue.SubmitQueue._lease_granted uses a grant on a worker just lost "
             "(race: the worker is already gone)", _grant_on_lost_worker_used, 600,
             (SQ_V,)),
    Mutation("gate-spare-keeps-slots", "tasks",
             "lease_gate.LeaseGate.arrived reuses a spare lease record with its old slots "
             "(capacity: a lease runs more tasks at once than its slots)",
             _gate_spare_keeps_slots, 1000, (GATE_V,)),
    Mutation("call-done-count-off-by-one", "calls",
             "call_order.CallOrder._done counts down while n >= 1 (safety: the last call "
             "leaves a count of 0, the holder never dropped)", _done_count_off_by_one, 100,
             (CO_V,)),
    Mutation("router-lone-failure-succeeds", "calls",
             "call_router.CallRouter.done settles a lone CallFailed as a success (results: "
             "the host answered an error)", _lone_failure_succeeds, 50, (CO_V,)),
    Mutation("instance-side-late-call-parked", "calls",
             "instance_side.InstanceSide.call_method parks a call for an instance stopped "
             "here (race: the instance is already gone)", _late_call_parked, 50),
    Mutation("node-keeps-dead-share", "tasks",
             "resources.Ledger._drop_process keeps a node's capacity when one of its "
             "processes goes (safety: the node is over-committed)", _node_keeps_dead_share,
             50, (LQ_V,)),
    Mutation("placed-for-ended-kept", "calls",
             "lifecycle.Lifecycle._placed keeps the resources granted to an instance that "
             "ended while it waited (race: the requester is already gone)",
             _placed_for_ended_kept, 50, (LC_V,)),
]


def main() -> int:
    import os
    import sys

    if os.environ.get("PYTHONHASHSEED") != "0":
        os.environ["PYTHONHASHSEED"] = "0"
        os.execv(sys.executable, [sys.executable, "-m", "tests.sim.mutations_fresh",
                                  *sys.argv[1:]])
    args = sys.argv[1:]
    budget = int(args[0]) if args and args[0].isdigit() else None
    names = [a for a in args if not a.isdigit()]
    missed = 0
    for m in FRESH:
        if names and m.name not in names:
            continue
        p = _Patcher()
        apply(m, p)
        t0 = time.perf_counter()
        try:
            seed, line = first_catch(m, range(budget or m.budget))
        finally:
            p.undo()
        took = time.perf_counter() - t0
        if seed is None:
            missed += 1
        print(f"{m.name:32s} {m.world:5s} caught at seed {seed} ({took:.1f} s, budget "
              f"{budget or m.budget}): {line[:110]}", flush=True)
    return 1 if missed else 0


if __name__ == "__main__":
    raise SystemExit(main())
