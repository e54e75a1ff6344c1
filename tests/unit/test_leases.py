"""The scheduler's lease queue as a pure machine (no cluster, no clock, no sleeps).

docs/state-machines.md "Scheduler lease queue": immediate grants, waiting without
head-of-line blocking, revoking idle leases for a waiter, lending a blocked lease's CPU,
could-free deadline extension, refusal text, owner gone, worker left, cancel; and a seeded
random run checking the invariants after every step and that every request is answered
exactly once.
"""

from __future__ import annotations

import random

import pytest

from yrdask.affinity import AffinityKind, AffinityType, OperatorType
from yrdask.scheduler import leases as LQ
from yrdask.scheduler.leases import (Granted, HoldingsReleased, HoldRequested, LeaseBlocked,
                                     LeaseQueue, LeaseUnblocked, OwnerGone, Refused,
                                     RequestCancelled, RequestWithdrawn, Revoke, Tick, WakeAt,
                                     WorkerDraining, WorkerJoined, WorkerLeft)
from yrdask.statemachine import Event

pytestmark = pytest.mark.timeout(120)

A, B = "tcp://a:1", "tcp://b:1"


def cpu(n: float = 1, **tags: float) -> dict:
    return {"CPU": 1000.0 * n, **tags}


def req(rid: str, owner: str = "tcp://d:1", shape: dict | None = None, timeout_ms: int = 1000,
        kind: str = "lease", local: str | None = None, queue: str = "q", avoid: tuple = (),
        affinity: tuple = (), labels: tuple = (), holding_id: str | None = None,
        now: float = 0.0, own_id: str = "") -> HoldRequested:
    return HoldRequested("t", rid, owner, kind, shape or cpu(1), timeout_ms, local, queue, avoid,
                         affinity, labels, holding_id, now, own_id=own_id)


def required(kind: int, key: str, *values: str, anti: bool = False) -> tuple:
    typ = AffinityType.REQUIRED_ANTI if anti else AffinityType.REQUIRED
    op = OperatorType.LABEL_IN if values else OperatorType.LABEL_EXISTS
    return ((int(kind), int(typ), ((int(op), key, tuple(values)),)),)


class Q:
    """A LeaseQueue that validates after every event and sorts the instructions."""

    def __init__(self, **workers: dict) -> None:
        self.q = LeaseQueue()
        for name, cap in workers.items():
            self(WorkerJoined("t", name, cap))

    def __call__(self, ev: Event) -> list:
        out = self.q.handle(ev)
        self.q.validate()
        return out


def of(out: list, kind: type) -> list:
    return [i for i in out if isinstance(i, kind)]


def grants(out: list) -> dict[str, tuple[str, str]]:
    return {g.request_id: (g.holding_id, g.worker) for g in of(out, Granted)}


def refusals(out: list) -> dict[str, str]:
    return {r.request_id: r.reason for r in of(out, Refused)}


def revokes(out: list) -> dict[str, tuple]:
    return {r.owner: r.lease_ids for r in of(out, Revoke)}


def wakes(out: list) -> list[float]:
    return [w.at for w in of(out, WakeAt)]


# ------------------------------------------------------------------------------- grants


def test_a_request_that_fits_is_granted_at_once_and_counted():
    q = Q(a=cpu(2))
    out = q(req("r1"))
    assert grants(out) == {"r1": ("L1", "a")} and len(out) == 1
    assert q.q.ledger.workers["a"].held == {"CPU": 1000.0}
    assert q.q.counters == {"leases_granted": 1, "leases_local": 0, "leases_forwarded": 1,
                            "lease_timeouts": 0, "requests_withdrawn": 0}
    q(req("r2", local="a"))
    assert q.q.counters["leases_local"] == 1 and q.q.counters["leases_granted"] == 2


def test_an_instance_holds_under_its_own_id_and_is_not_a_lease_count():
    q = Q(a=cpu(2))
    out = q(req("r1", owner="I1", kind="instance", holding_id="I1", labels=("grp:x",)))
    assert grants(out) == {"r1": ("I1", "a")}
    assert q.q.ledger.holdings["I1"].kind == "instance"
    assert q.q.ledger.holdings["I1"].labels == ("grp:x",)
    assert q.q.counters["leases_granted"] == 0


def test_local_first_when_it_fits_and_never_an_avoided_worker():
    q = Q(**{A: cpu(4), B: cpu(1)})
    assert grants(q(req("r1", local=B)))["r1"][1] == B  # local wins over more free CPU
    assert grants(q(req("r2", local=B)))["r2"][1] == A  # local is full now
    q2 = Q(**{A: cpu(4), B: cpu(4)})
    assert grants(q2(req("r1", avoid=(A,))))["r1"][1] == B
    out = q2(req("r2", avoid=(A, B)))
    assert grants(out) == {} and "r2" in q2.q.pending


def test_a_draining_worker_takes_nothing_new_until_it_is_kept():
    q = Q(**{A: cpu(4), B: cpu(1)})
    assert q(WorkerDraining("t", A, True)) == []
    assert grants(q(req("r1", local=A)))["r1"][1] == B  # not there, even when local
    out = q(req("r2", kind="instance", holding_id="I2", owner="I2"))
    assert grants(out) == {} and "r2" in q.q.pending  # B is full: it waits
    assert any("retiring" in line for line in q.q.explain_wait("r2")["reasons"])
    out = q(WorkerDraining("t", A, False))  # kept after all: what waits goes there
    assert grants(out) == {"r2": ("I2", A)}
    assert [e[1][0] for e in q.q.story(A) if e[1][0] in ("draining", "kept")] == \
        ["draining", "kept"]


def test_hard_affinity_filters_workers():
    q = Q(**{A: cpu(4), B: cpu(4)})
    out = q(req("r1", affinity=required(AffinityKind.RESOURCE, "NODE_ID", B)))
    assert grants(out)["r1"][1] == B
    out = q(req("r2", affinity=required(AffinityKind.RESOURCE, "NODE_ID", "tcp://nowhere:1")))
    assert grants(out) == {} and "r2" in q.q.pending


def test_an_instance_with_labels_admits_a_waiter_that_requires_them():
    q = Q(**{A: cpu(4), B: cpu(4)})
    near = required(AffinityKind.INSTANCE, "grp", "x")
    assert grants(q(req("r1", affinity=near, timeout_ms=-1))) == {}
    out = q(req("r2", owner="I1", kind="instance", holding_id="I1", labels=("grp:x",)))
    got = grants(out)
    assert set(got) == {"r1", "r2"} and got["r1"][1] == got["r2"][1]
    assert not q.q.pending


def test_a_holding_id_already_held_is_refused_not_counted_twice():
    q = Q(a=cpu(4))
    q(req("r1", kind="instance", holding_id="I1"))
    out = q(req("r2", kind="instance", holding_id="I1"))
    assert "I1" in refusals(out)["r2"] and "already holds" in refusals(out)["r2"]
    assert q.q.ledger.workers["a"].held["CPU"] == 1000.0


def test_a_duplicate_request_id_is_ignored_while_it_waits():
    q = Q(a=cpu(1))
    q(req("r1"))
    q(req("r2"))
    assert q(req("r2")) == []
    assert list(q.q.pending) == ["r2"]
    assert any("duplicate-request-ignored" in what for _, what in q.q.story("r2"))


# ------------------------------------------------------------------------------- waiting


def test_a_waiting_request_is_granted_when_a_lease_returns():
    q = Q(a=cpu(1))
    q(req("r1", owner="d1", queue="q1"))
    out = q(req("r2", owner="d2", queue="q2", now=5.0))
    assert grants(out) == {} and wakes(out) == [6.0] and list(q.q.pending) == ["r2"]
    out = q(HoldingsReleased("t", ("L1",)))
    assert grants(out) == {"r2": ("L2", "a")} and not q.q.pending


def test_waiters_are_granted_oldest_first_without_head_of_line_blocking():
    q = Q(a=cpu(2))
    q(req("r1", owner="d1"))
    q(req("r2", owner="d1"))
    q(req("big", owner="d2", shape=cpu(2)))  # needs the whole worker
    q(req("small1", owner="d3"))
    q(req("small2", owner="d3"))
    assert list(q.q.pending) == ["big", "small1", "small2"]
    out = q(HoldingsReleased("t", ("L1",)))
    assert list(grants(out)) == ["small1"]  # big does not fit yet, and blocks nobody
    # A newcomer that fits is granted at once even while others wait for other shapes.
    q(HoldingsReleased("t", ("L3",)))  # small1's lease
    assert list(q.q.pending) == ["big"]
    assert grants(q(req("new", owner="d4", shape={"CPU": 0.0})))["new"][1] == "a"


def test_release_of_unknown_holdings_is_ignored():
    q = Q(a=cpu(1))
    assert q(HoldingsReleased("t", ("nope",))) == []
    assert any("release-ignored" in what for _, what in q.q.story("nope"))


# ------------------------------------------------------------------------------- revoking


def test_a_waiter_revokes_idle_leases_of_other_owners_and_queues_once():
    q = Q(**{A: cpu(3), B: cpu(1), "small": cpu(0.5)})
    q(req("x1", owner="d1", queue="q1", local=A))  # L1 on A
    q(req("x2", owner="d1", queue="q2", local=A))  # L2 on A: same owner, other queue
    q(req("x3", owner="me", queue="mine", local=A))  # L3 on A: the requester's own queue
    q(req("x4", owner="d2", queue="q1", local=B))  # L4 on B
    q(req("x5", owner="d3", queue="q", shape=cpu(0.5)))  # L5 on "small": could never run it
    q(req("x6", owner="I1", kind="instance", holding_id="I1", shape=cpu(0)))  # not a lease
    out = q(req("r", owner="me", queue="mine", shape=cpu(1), timeout_ms=100))
    assert grants(out) == {}
    assert revokes(out) == {"d1": ("L1", "L2"), "d2": ("L4",)}
    # At its deadline the leases still hold: it keeps waiting, and asks nobody twice.
    out = q(Tick("t", 0.1))
    assert refusals(out) == {} and revokes(out) == {}
    out = q(HoldingsReleased("t", ("L4",)))  # d2 gave its lease back: r gets B
    assert grants(out) == {"r": ("L6", B)} and not q.q.pending


def test_a_waiter_does_not_revoke_on_avoided_workers():
    q = Q(**{A: cpu(1), B: cpu(1)})
    q(req("x1", owner="d1", local=A))
    q(req("x2", owner="d2", local=B))
    out = q(req("r", owner="me", avoid=(A,)))
    assert revokes(out) == {"d2": ("L2",)}


def test_a_lease_granted_while_it_waits_is_revoked_at_the_extension():
    q = Q(a=cpu(2))
    q(req("x1", owner="d1"))
    out = q(req("r", owner="me", shape=cpu(2), timeout_ms=100))
    assert revokes(out) == {"d1": ("L1",)}
    q(req("x2", owner="d2"))  # fits beside L1: granted, now also in r's way
    out = q(Tick("t", 0.1))
    assert revokes(out) == {"d2": ("L2",)} and refusals(out) == {}


def test_a_lease_granted_from_freed_resources_while_others_wait_is_revoked_at_once():
    # Nested fan-out: two owners' children queue for one node; freed CPU goes to the older
    # request of d1, and d2's waiting request must ask for that new lease back at once,
    # not wait out d1's idle time (it had revoked only what stood in its way on arrival).
    q = Q(a=cpu(1))
    q(req("x1", owner="d1", queue="q1"))  # L1
    q(req("x2", owner="d1", queue="q1"))  # waits: d1's own queue, nothing to revoke
    out = q(req("r", owner="d2", queue="q2"))
    assert revokes(out) == {"d1": ("L1",)}
    out = q(HoldingsReleased("t", ("L1",)))  # x2, the older request, gets the CPU
    assert grants(out) == {"x2": ("L2", "a")}
    assert revokes(out) == {"d1": ("L2",)}
    out = q(HoldingsReleased("t", ("L2",)))
    assert grants(out) == {"r": ("L3", "a")} and revokes(out) == {}


def test_freed_room_goes_to_the_queue_with_the_fewest_leases_not_the_oldest_request():
    # Nested fan-out on a full cluster: d1's children queue runs on L1 and asked for more
    # first; d2's runs nowhere.  The freed CPU goes to d2 (in arrival order it went to d1,
    # whose extra lease d2's waiters then revoked after one task, and round again).
    q = Q(a=cpu(2))
    q(req("x1", owner="d1", queue="q1"))  # L1
    q(req("p", owner="drv", queue="parents"))  # L2: fills the node
    q(req("x2", owner="d1", queue="q1"))  # waits, older
    q(req("y1", owner="d2", queue="q2"))  # waits, its queue holds nothing
    out = q(HoldingsReleased("t", ("L2",)))
    assert grants(out) == {"y1": ("L3", "a")} and list(q.q.pending) == ["x2"]
    # Equal shares: arrival order again.
    q(req("y2", owner="d2", queue="q2"))
    out = q(HoldingsReleased("t", ("L1",)))  # d1 holds 0 now, d2 holds 1: x2 first
    assert grants(out) == {"x2": ("L4", "a")} and list(q.q.pending) == ["y2"]


def test_a_pass_counts_its_own_grants_when_it_orders_the_queues():
    q = Q(a=cpu(3))
    q(req("f1", owner="d0", queue="q0"))
    q(req("f2", owner="d0", queue="q0"))
    q(req("f3", owner="d0", queue="q0"))  # the node is full
    for rid, owner in (("x1", "d1"), ("x2", "d1"), ("y1", "d2")):
        q(req(rid, owner=owner, queue="q"))
    out = q(HoldingsReleased("t", ("L1", "L2")))
    # x1 first (arrival order, both hold none), then y1: d1 now holds one, d2 none
    assert list(grants(out)) == ["x1", "y1"] and list(q.q.pending) == ["x2"]


def test_a_lease_whose_cpu_is_lent_does_not_count_against_its_queue():
    # The driver's parents block in yr.get (their CPU lent to their children): its queue of
    # parents still to start is not "rich", and keeps its place in arrival order.
    q = Q(a=cpu(1))
    q(req("p1", owner="drv", queue="parents"))  # L1
    q(LeaseBlocked("t", "L1"))
    q(req("k1", owner="w1", queue="kids"))  # L2, on the lent CPU
    q(req("p2", owner="drv", queue="parents"))  # waits
    q(req("k2", owner="w2", queue="kids"))  # waits, later
    out = q(HoldingsReleased("t", ("L2",)))
    assert grants(out) == {"p2": ("L3", "a")} and list(q.q.pending) == ["k2"]


def test_a_waiter_whose_queue_runs_revokes_with_keep_others_firmly():
    q = Q(a=cpu(2))
    q(req("x1", owner="d1", queue="q1"))  # L1
    q(req("y1", owner="d2", queue="q2"))  # L2: the node is full
    out = q(req("y2", owner="d2", queue="q2"))  # d2's queue runs (L2): keep
    assert [(r.owner, r.lease_ids, r.keep) for r in of(out, Revoke)] == [("d1", ("L1",), True)]
    out = q(req("z", owner="d3", queue="q3"))  # runs nothing: firm
    assert sorted((r.owner, r.lease_ids, r.keep) for r in of(out, Revoke)) == [
        ("d1", ("L1",), False), ("d2", ("L2",), False)]
    out = q(req("i", owner="I", kind="instance", holding_id="I", shape=cpu(1)))
    assert of(out, Revoke) and all(not r.keep for r in of(out, Revoke))  # never with keep


def test_a_waiter_asks_again_firmly_once_its_queue_runs_nothing():
    q = Q(a=cpu(2))
    q(req("x1", owner="d1", queue="q1"))  # L1
    q(req("y1", owner="d2", queue="q2"))  # L2
    out = q(req("y2", owner="d2", queue="q2", shape=cpu(2), timeout_ms=100))
    assert [(r.lease_ids, r.keep) for r in of(out, Revoke)] == [(("L1",), True)]
    q(LeaseBlocked("t", "L2"))  # y1 waits in yr.get: d2's queue runs nothing
    out = q(Tick("t", 0.1))  # the deadline extension asks again, firmly now
    assert [(r.owner, r.lease_ids, r.keep) for r in of(out, Revoke)] == [("d1", ("L1",), False)]
    assert of(q(Tick("t", 1.2)), Revoke) == []  # and only once


# ------------------------------------------------------------------------------- lending


def test_a_blocked_lease_lends_its_cpu_so_nested_work_runs_on_one_cpu():
    q = Q(a=cpu(1))
    q(req("parent", owner="d"))  # L1 runs the parent task
    out = q(req("child", owner="a", timeout_ms=-1))  # submitted from the parent's worker
    assert grants(out) == {} and wakes(out) == []
    out = q(LeaseBlocked("t", "L1"))  # the parent waits in yr.get
    assert grants(out) == {"child": ("L2", "a")}
    assert q.q.ledger.workers["a"].held["CPU"] == 1000.0
    assert q(LeaseBlocked("t", "L1")) == []  # lent already
    q(HoldingsReleased("t", ("L2",)))  # the child is done
    q(LeaseUnblocked("t", "L1"))  # the parent runs again
    assert q.q.ledger.workers["a"].held["CPU"] == 1000.0
    q(HoldingsReleased("t", ("L1",)))
    assert q.q.ledger.workers["a"].held["CPU"] == 0.0


def test_unblocking_may_overcommit_and_release_of_a_lent_lease_counts_once():
    q = Q(a=cpu(1))
    q(req("p"))
    q(req("c", timeout_ms=-1))
    q(LeaseBlocked("t", "L1"))
    q(LeaseUnblocked("t", "L1"))
    assert q.q.ledger.workers["a"].held["CPU"] == 2000.0  # both run; L1 ran first
    q(LeaseBlocked("t", "L1"))
    q(HoldingsReleased("t", ("L1", "L2")))
    assert q.q.ledger.workers["a"].held["CPU"] == 0.0
    assert q(LeaseUnblocked("t", "L1")) == []


# ------------------------------------------------------------------------------- deadlines


def test_past_its_deadline_a_request_waits_while_leases_could_free_room():
    q = Q(a=cpu(1))
    q(req("x", owner="d1"))
    out = q(req("r", owner="d2", timeout_ms=300, now=10.0))
    assert wakes(out) == [pytest.approx(10.3)]
    out = q(Tick("t", 10.3))
    assert refusals(out) == {} and wakes(out) == [pytest.approx(11.3)]  # at least 1 s more
    out = q(Tick("t", 11.0))  # an early tick changes nothing but asks again
    assert refusals(out) == {} and wakes(out) == [pytest.approx(11.3)]
    assert q.q.counters["lease_timeouts"] == 0
    out = q(HoldingsReleased("t", ("L1",)))
    assert grants(out) == {"r": ("L2", "a")}


def test_past_its_deadline_a_request_held_off_by_instances_is_refused_with_the_reason():
    q = Q(a=cpu(1))
    q(req("i", owner="I1", kind="instance", holding_id="I1"))
    out = q(req("r", owner="d", timeout_ms=300))
    out = q(Tick("t", 0.3))
    reason = refusals(out)["r"]
    assert "did not fit in time" in reason and "instance I1" in reason
    assert q.q.counters["lease_timeouts"] == 1 and not q.q.pending
    assert q(Tick("t", 5.0)) == []  # nothing left to do


def test_refusal_text_for_a_request_no_worker_can_ever_run():
    q = Q(a=cpu(1))
    q(req("r", shape=cpu(4), timeout_ms=0))
    reason = refusals(q(Tick("t", 0.0)))["r"]
    assert "can never be scheduled" in reason and "CPU=4000" in reason
    q2 = Q()
    q2(req("r", timeout_ms=50))
    assert "no yr workers" in refusals(q2(Tick("t", 0.05)))["r"]


def test_refusal_text_names_the_avoided_workers():
    q = Q(**{A: cpu(1)})
    q(req("r", timeout_ms=10, avoid=(A,)))
    reason = refusals(q(Tick("t", 0.01)))["r"]
    assert A in reason and "avoids" in reason


def test_a_negative_timeout_waits_forever_and_a_joining_worker_serves_it():
    q = Q(a=cpu(1))
    out = q(req("r", shape=cpu(4), timeout_ms=-1))
    assert wakes(out) == [] and q.q.next_wake is None
    assert q(Tick("t", 1e9)) == [] and "r" in q.q.pending
    # a lease of 2 whole CPUs or more says so in its id (protocol.lease_cpus)
    assert grants(q(WorkerJoined("t", "big", cpu(8)))) == {"r": ("L1#CPU=4", "big")}


def test_one_timer_for_the_earliest_deadline():
    q = Q(a=cpu(0))
    assert wakes(q(req("r1", timeout_ms=1000))) == [1.0]
    assert wakes(q(req("r2", timeout_ms=2000))) == []  # the 1.0 timer comes first
    assert wakes(q(req("r3", timeout_ms=500))) == [0.5]
    out = q(Tick("t", 0.5))
    assert list(refusals(out)) == ["r3"] and wakes(out) == [1.0]
    out = q(Tick("t", 1.0))
    assert list(refusals(out)) == ["r1"] and wakes(out) == [2.0]


# ------------------------------------------------------------------------------- owners, workers


def test_an_owner_gone_releases_its_leases_and_refuses_its_waiters():
    q = Q(a=cpu(2))
    q(req("x1", owner="d1"))
    q(req("x2", owner="d1"))
    q(req("i", owner="d1", kind="instance", holding_id="I1", shape=cpu(0)))
    q(req("w1", owner="d1"))
    q(req("w2", owner="d2"))
    out = q(OwnerGone("t", "d1"))
    assert "is gone" in refusals(out)["w1"] and "d1" in refusals(out)["w1"]
    assert grants(out) == {"w2": ("L3", "a")}
    assert set(q.q.ledger.holdings) == {"I1", "L3"}  # instances are the lifecycle's business
    assert q(OwnerGone("t", "d1")) == []


def test_a_worker_that_left_loses_its_holdings_and_its_own_leases_elsewhere():
    q = Q(**{A: cpu(1), B: cpu(2)})
    q(req("x1", owner="d", local=A))  # L1 on A
    q(req("i", owner="I1", kind="instance", holding_id="I1", local=A, shape=cpu(0)))
    q(req("x2", owner=A, local=B))  # L2 on B, owned by A's submitter
    q(req("x3", owner="d", local=B))  # L3 on B
    q(req("w", owner=A, shape=cpu(2)))  # A's submitter waits
    q(req("w2", owner="d2", shape=cpu(2), timeout_ms=-1))
    lost = {h.holding_id for h in q.q.holdings_on(A)}
    assert lost == {"L1", "I1"}
    out = q(WorkerLeft("t", A))
    assert A not in q.q.ledger.workers
    assert set(q.q.ledger.holdings) == {"L3"}
    assert "is gone" in refusals(out)["w"]
    assert grants(out) == {}  # w2 needs all of B, L3 holds half
    assert any("lost" in what for _, what in q.q.story("I1"))
    assert grants(q(HoldingsReleased("t", ("L3",)))) == {"w2": ("L4#CPU=2", B)}


def test_a_worker_registering_again_keeps_its_holdings():
    q = Q(a=cpu(1))
    q(req("x"))
    out = q(WorkerJoined("t", "a", cpu(2)))
    assert q.q.ledger.workers["a"].held["CPU"] == 1000.0 and out == []
    assert grants(q(req("y")))["y"][1] == "a"


def test_a_cancelled_request_is_refused_once():
    q = Q(a=cpu(1))
    q(req("x"))
    q(req("r", kind="instance", holding_id="I1", owner="I1"))
    out = q(RequestCancelled("t", "r"))
    assert "cancelled" in refusals(out)["r"] and not q.q.pending
    assert q(RequestCancelled("t", "r")) == []
    assert q(RequestCancelled("t", "x")) == []  # already granted: nothing to cancel
    assert q(HoldingsReleased("t", ("L1",))) == []  # nobody waits any more


def test_a_withdrawn_lease_request_leaves_the_queue_refused_once_with_its_revokes():
    q = Q(a=cpu(1))
    q(req("x", owner="d1", queue="p"))  # L1
    out = q(req("r", owner="d2", queue="c"))
    assert revokes(out) == {"d1": ("L1",)} and "r" in q.q.pending
    assert q(RequestWithdrawn("t", "r", "d1")) == []  # only its owner withdraws it
    out = q(RequestWithdrawn("t", "r", "d2"))
    assert "withdrawn by its owner d2" in refusals(out)["r"] and len(out) == 1
    assert not q.q.pending and q.q.counters["requests_withdrawn"] == 1
    assert q(RequestWithdrawn("t", "r", "d2")) == []  # answered already
    assert q(RequestWithdrawn("t", "x", "d1")) == []  # granted: the holding stays
    assert "L1" in q.q.ledger.holdings
    assert q(HoldingsReleased("t", ("L1",))) == []  # the revoked lease back: nobody waits
    assert ("withdrawn", "r", "d2", ("L1",)) in [e for _, e in q.q.story("r")]
    q(req("i", kind="instance", holding_id="I1", owner="I1"))
    q(req("j", kind="instance", holding_id="I2", owner="I2"))
    assert q(RequestWithdrawn("t", "j", "I2")) == []  # instances are cancelled, not withdrawn


def test_a_withdraw_that_overtakes_its_request_refuses_it_on_arrival():
    q = Q(a=cpu(1))
    assert q(RequestWithdrawn("t", "", "d2", "r5")) == []  # not heard of yet: remembered
    assert q(RequestWithdrawn("t", "", "d2", "r6")) == []
    out = q(req("R1", owner="d2", own_id="r5"))  # it arrives: refused, never granted
    assert "withdrawn by its owner d2 before it arrived" in refusals(out)["R1"] and len(out) == 1
    assert not q.q.ledger.holdings and q.q.counters["requests_withdrawn"] == 1
    assert grants(q(req("R2", owner="d1", own_id="r5")))["R2"][1] == "a"  # another owner's id
    assert grants(q(req("R3", owner="d2", own_id="r7", timeout_ms=-1))) == {}  # waits
    assert ("withdrawn-before-arrival", "R1", "d2", "r5") in [e for _, e in q.q.story("R1")]
    assert q.q.withdrawn_unseen == {("d2", "r6"): None}
    q(OwnerGone("t", "d2"))  # a process later at its address counts its ids from 1 again
    assert q.q.withdrawn_unseen == {}
    assert grants(q(req("R4", owner="d2", own_id="r6", timeout_ms=-1))) == {}  # waits: not refused
    assert "R4" in q.q.pending


def test_the_memory_of_overtaking_withdraws_is_bounded():
    q = LeaseQueue()
    for i in range(LQ.WITHDRAWN_UNSEEN + 5):
        q.handle(RequestWithdrawn("t", "", "d", f"r{i}"))  # answered already, say: never come
    q.validate()
    assert len(q.withdrawn_unseen) == LQ.WITHDRAWN_UNSEEN
    assert ("d", "r0") not in q.withdrawn_unseen and ("d", "r5") in q.withdrawn_unseen


def test_story_by_request_holding_and_owner():
    q = Q(a=cpu(1))
    q(req("r1", owner="d1"))
    q(req("r2", owner="d2", queue="other"))
    q(HoldingsReleased("t", ("L1",)))
    r2 = [what[0] for _, what in q.q.story("r2")]
    assert r2[:3] == ["requested", "wait", "revoke"] and "granted" in r2
    assert [what[0] for _, what in q.q.story("L1")][-1] == "released"
    assert any(what[0] == "revoke" for _, what in q.q.story("d1"))
    assert "granted" in q.q.story_text("L2")


def test_unknown_events_are_ignored():
    q = Q(a=cpu(1))
    assert q(Event("t")) == []


# ------------------------------------------------------------------------------- random runs

WORKERS = ["w0", "w1", "w2"]
OWNERS = ["d0", "d1", "w0", "w1"]


def _random_run(seed: int, steps: int = 40) -> None:
    rng = random.Random(seed)
    q = LeaseQueue()
    now = 0.0
    timers: list[float] = []
    answered: dict[str, int] = {}
    asked: dict[str, HoldRequested] = {}
    n_req = n_inst = 0

    def feed(ev: Event) -> None:
        for ins in q.handle(ev):
            if isinstance(ins, (Granted, Refused)):
                assert ins.request_id in asked, ins
                answered[ins.request_id] = answered.get(ins.request_id, 0) + 1
                assert answered[ins.request_id] == 1, f"seed {seed}: {ins.request_id} answered twice"
            if isinstance(ins, Granted):
                r = asked[ins.request_id]
                assert ins.worker not in r.avoid, f"seed {seed}: granted on an avoided worker"
                assert not q.ledger.processes[ins.worker].draining, \
                    f"seed {seed}: granted on a draining worker"
                assert ins.holding_id in q.ledger.holdings
                if r.holding_id is not None:
                    assert ins.holding_id == r.holding_id
            elif isinstance(ins, WakeAt):
                timers.append(ins.at)
            elif isinstance(ins, Revoke):
                assert ins.lease_ids and all(
                    q.ledger.holdings[h].owner == ins.owner for h in ins.lease_ids)
        q.validate()

    for step in range(steps):
        roll = rng.random()
        sid = f"s{seed}-{step}"
        if roll < 0.12:
            w = rng.choice(WORKERS)
            cap = {"CPU": rng.choice([0.0, 1000.0, 2000.0, 4000.0])}
            if rng.random() < 0.3:
                cap["gpu"] = 1.0
            feed(WorkerJoined(sid, w, cap))
        elif roll < 0.15:
            feed(WorkerLeft(sid, rng.choice(WORKERS)))
        elif roll < 0.17:
            feed(WorkerDraining(sid, rng.choice(WORKERS), rng.random() < 0.6))
        elif roll < 0.50:
            n_req += 1
            rid = f"r{n_req}"
            kind = "instance" if rng.random() < 0.3 else "lease"
            shape = {"CPU": rng.choice([0.0, 500.0, 1000.0, 2000.0, 3000.0])}
            if rng.random() < 0.1:
                shape["gpu"] = 1.0
            affinity: tuple = ()
            a = rng.random()
            if a < 0.1:
                affinity = required(AffinityKind.RESOURCE, "NODE_ID", rng.choice(WORKERS))
            elif a < 0.2:
                affinity = required(AffinityKind.INSTANCE, "grp", rng.choice("xy"),
                                    anti=rng.random() < 0.5)
            holding_id = labels = None
            if kind == "instance":
                n_inst += 1
                holding_id = f"I{n_inst}" if rng.random() < 0.95 else f"I{max(1, n_inst - 1)}"
                labels = (f"grp:{rng.choice('xy')}",) if rng.random() < 0.5 else ()
            r = HoldRequested(
                sid, rid, rng.choice(OWNERS) if kind == "lease" else f"inst-{n_inst}", kind,
                shape, rng.choice([-1, 0, 100, 1000, 5000]), rng.choice([None, *WORKERS]),
                rng.choice(["qa", "qb"]), tuple(rng.sample(WORKERS, rng.choice([0, 0, 0, 1, 2]))),
                affinity, labels or (), holding_id, now)
            asked[rid] = r
            feed(r)
        elif roll < 0.68:
            held = sorted(q.ledger.holdings)
            ids = rng.sample(held, min(len(held), rng.choice([1, 1, 2]))) if held else []
            if rng.random() < 0.1:
                ids.append("unknown")
            feed(HoldingsReleased(sid, tuple(ids)))
        elif roll < 0.78:
            leases = sorted(h for h, x in q.ledger.holdings.items() if x.kind == "lease")
            lid = rng.choice(leases) if leases and rng.random() < 0.9 else "L-unknown"
            feed((LeaseBlocked if rng.random() < 0.6 else LeaseUnblocked)(sid, lid))
        elif roll < 0.82:
            feed(OwnerGone(sid, rng.choice(OWNERS)))
        elif roll < 0.86 and asked:
            rid = rng.choice(sorted(asked))
            if rng.random() < 0.5:
                feed(RequestCancelled(sid, rid))
            else:  # its owner's withdraw, now and then another's (ignored)
                owner = asked[rid].owner if rng.random() < 0.9 else rng.choice(OWNERS)
                feed(RequestWithdrawn(sid, rid, owner))
        else:
            if timers and rng.random() < 0.7:
                now = max(now, min(timers))
                timers = [t for t in timers if t > now]
            else:
                now += rng.choice([0.0, 0.05, 0.5, 2.0])
            feed(Tick(sid, now))

    # The end: no worker drains, everything is given back, time runs out, the owners leave.
    for w in WORKERS:
        feed(WorkerDraining("end", w, False))
    feed(HoldingsReleased("end", tuple(sorted(q.ledger.holdings))))
    for lease in [h for h in q.ledger.holdings.values() if h.lent_cpu]:
        feed(LeaseUnblocked("end", lease.holding_id))
    for _ in range(3):
        now += 1000.0
        feed(Tick("end", now))
    for owner in {r.owner for r in asked.values()}:
        feed(OwnerGone("end", owner))
    feed(HoldingsReleased("end", tuple(sorted(q.ledger.holdings))))
    assert not q.pending, f"seed {seed}: still waiting {q.pending}"
    assert not q.ledger.holdings, f"seed {seed}: still held {sorted(q.ledger.holdings)}"
    assert set(answered) == set(asked), f"seed {seed}: unanswered {set(asked) - set(answered)}"
    for ws in q.ledger.workers.values():
        assert all(abs(a) < 1e-6 for a in ws.held.values()), (seed, ws.address, ws.held)


def test_random_event_sequences_keep_the_invariants_and_answer_every_request_once():
    for seed in range(3000):
        _random_run(seed)


# ------------------------------------------------------------------------------- the adapter


def test_the_extension_adapter_answers_cancels_times_out_and_releases():
    """acquire/cancel_request/release of the scheduler extension over a real Dask scheduler
    (no workers: the yr worker is registered straight with the extension)."""
    import asyncio

    from distributed import Scheduler

    from yrdask.scheduler.extension import YrSchedulerExtension
    from yrdask.scheduler.requests import LeaseRequest

    def inst(i: str) -> LeaseRequest:
        return LeaseRequest(i, {"CPU": 1000.0}, kind="instance", holding_id=i)

    async def main() -> None:
        async with Scheduler(dashboard_address=":0", port=0) as s:
            ext = YrSchedulerExtension(s)
            ext._add_worker("tcp://x:1", {"CPU": 1000.0})
            assert await ext.acquire(inst("I1"), 1000) == ["I1", "tcp://x:1"]
            r2 = inst("I2")
            t2 = asyncio.ensure_future(ext.acquire(r2, -1))
            await asyncio.sleep(0.01)
            assert [w.request_id for w in ext.pending] == [r2.request_id]
            ext.cancel_request(r2)
            got, why = await t2
            assert got is None and "cancelled" in why
            got, why = await ext.acquire(inst("I3"), 100)  # WakeAt -> call_at -> Tick
            assert got is None and "did not fit in time" in why and "instance I1" in why
            t4 = asyncio.ensure_future(ext.acquire(inst("I4"), -1))
            await asyncio.sleep(0.01)
            t4.cancel()  # the caller went away: its request is withdrawn
            await asyncio.sleep(0.01)
            assert ext.pending == []
            t5 = asyncio.ensure_future(ext.acquire(inst("I5"), -1))
            await asyncio.sleep(0.01)
            ext.ledger.release("I1")  # the old way: change the ledger, then grant pending
            ext._grant_pending()
            assert await t5 == ["I5", "tcp://x:1"]
            t6 = asyncio.ensure_future(ext.acquire(inst("I6"), 5000))
            await asyncio.sleep(0.01)
            ext.release(["I5"])
            assert await t6 == ["I6", "tcp://x:1"]
            got, why = await ext.request_lease("tcp://nobody:1", {"CPU": 0}, 100)
            assert got is None and "gone" in why
            assert ext.cluster_info(instances=False)["counters"]["lease_timeouts"] == 1
            ext.leases.validate()

    asyncio.run(main())


class _Stream:
    """A job stream as the extension sends on it (the messages it was given, in order)."""

    def __init__(self) -> None:
        self.sent: list = []

    def send(self, *msgs: dict) -> None:
        self.sent += msgs


def test_the_extension_announces_a_new_process_at_a_removed_workers_address():
    """A worker back at a removed one's address (``--worker-port``): every job hears
    ``WorkerJoined`` after that address's ``WorkerLost``, on the same stream; a first join,
    or a join at an address never removed, is not announced."""
    import asyncio

    from distributed import Scheduler

    from yrdask import protocol as P
    from yrdask.scheduler.extension import Job, YrSchedulerExtension

    async def main() -> None:
        async with Scheduler(dashboard_address=":0", port=0) as s:
            ext = YrSchedulerExtension(s)
            stream = _Stream()
            ext.jobs["tcp://d:1"] = Job("j", "tcp://d:1", stream)
            ext._add_worker("tcp://x:1", {"CPU": 1000.0})
            ext.on_remove_worker("tcp://x:1")
            assert stream.sent == [P.WorkerLost("tcp://x:1").to_msg()]
            ext._add_worker("tcp://y:1", {"CPU": 1000.0})  # a new address: nothing to say
            ext._add_worker("tcp://x:1", {"CPU": 1000.0})  # back at the removed address
            assert stream.sent[1:] == [P.WorkerJoined("tcp://x:1").to_msg()]
            assert set(ext.ledger.processes) == {"tcp://x:1", "tcp://y:1"}
            assert ext.removed == {}
            ext.leases.validate()

    asyncio.run(main())


# ------------------------------------------------------------------------- wait explanations


def test_a_waiting_request_is_explained_by_worker_with_the_classes_that_hold_it():
    """Default cpu=500 on a 2-core machine fits 4 instances; the 5th waits, and says why."""
    q = Q(**{A: {"CPU": 2000.0, "Memory": 4000.0}})
    shape = {"CPU": 500.0, "Memory": 0.0}
    for i in range(1, 5):
        q(HoldRequested("t", f"r{i}", f"I{i}", "instance", shape, -1, None, "", (), (), (),
                        f"I{i}", float(i), "Counter"))
    assert len(q.q.ledger.holdings) == 4 and not q.q.pending
    q(HoldRequested("t", "r5", "I5", "instance", shape, 2000, None, "", (), (), (), "I5", 10.0,
                    "Counter"))
    assert list(q.q.pending) == ["r5"] and q.q.explain_wait("r1") is None
    assert q.q.waiting_longer_than(5, 14.0) == [] and q.q.waiting_longer_than(5, 15.0) == ["r5"]
    why = q.q.explain_wait("r5", now=16.0)
    assert (why["what"], why["kind"], why["label"], why["waited_s"]) == (
        "Counter instance I5", "instance", "Counter", 6.0)
    assert why["reasons"] == [f"worker {A}: needs CPU 500, free 0 of 2000 millicores; held by "
                              "4 Counter instances (I1, I2, I3, I4)"]
    assert why["text"].startswith("Counter instance I5 waits for {CPU: 500, Memory: 0} (6 s "
                                  "so far): worker ")
    assert "InvokeOptions(cpu=" in why["text"] and "Config(num_cpus=" in why["text"]
    # At its deadline it is refused, naming the classes that hold the worker and the fix.
    reason = refusals(q(Tick("t", 12.0)))["r5"]
    assert reason.startswith("Counter instance I5: request {CPU: 500, Memory: 0} did not fit "
                             "in time")
    assert "Counter instance I1 {CPU: 500, Memory: 0}" in reason
    assert "InvokeOptions(cpu=" in reason and "Config(num_cpus=" in reason


def test_wait_explanations_name_leases_and_workers_that_can_never_run_it():
    q = Q(**{A: cpu(1), B: cpu(0.5)})
    q(req("l", owner="tcp://d:1", timeout_ms=-1))  # a task lease takes A
    q(req("r", owner="tcp://e:1", timeout_ms=-1, now=1.0))
    why = q.q.explain_wait("r", now=3.0)
    assert why["what"] == "task lease request r of tcp://e:1"
    assert why["reasons"] == [
        f"worker {A}: needs CPU 1000, free 0 of 1000 millicores; held by task lease L1 of "
        "tcp://d:1",
        f"can never run it: {B} (offers {{CPU: 500}})"]


def test_the_extension_names_the_worker_process_in_grants_losses_joins_and_exits():
    """Worker processes (runtime/worker_processes.py): a grant says which process it is on (Dask's
    ``server_id``), ``WorkerLost`` names the removed one, and a nanny's exit report is tied to
    the process that exited by its pid, even when it comes after the next one registered."""
    import asyncio

    from distributed import Scheduler, Worker

    from yrdask import protocol as P
    from yrdask.scheduler.extension import Job, YrSchedulerExtension

    async def main() -> None:
        async with Scheduler(dashboard_address=":0", port=0) as s:
            ext = YrSchedulerExtension(s)
            stream = _Stream()
            ext.jobs["tcp://d:1"] = Job("j", "tcp://d:1", stream)
            async with Worker(s.address, nthreads=1, dashboard=False) as w:
                ext.on_add_worker(w.address)
                ext._add_worker(w.address, {"CPU": 1000.0})
                lease_id, where, server_id = await ext.request_lease(
                    "tcp://d:1", {"CPU": 1000.0}, 1000)
                assert (where, server_id) == (w.address, w.id)
                ext.release([lease_id])
                ext.on_remove_worker(w.address)  # (Dask's plugin hook, called by hand)
                assert stream.sent == [P.WorkerLost(w.address, w.id).to_msg()]
                assert ext.removed == {w.address: w.id}
            # a nanny's report about a process it ran, after that one was replaced
            ext.process_of_pid[("tcp://n:1", 41)] = ("tcp://x:1", "Worker-old")
            ext.worker_of_nanny["tcp://n:1"] = "tcp://x:1"
            ext.worker_exited("tcp://n:1", -9, 41)
            assert stream.sent[-1] == P.WorkerExit(
                "tcp://x:1", "was killed by signal 9 (SIGKILL)", "Worker-old").to_msg()
            ext.worker_exited("tcp://n:1", 3)  # no pid: the nanny's latest worker, unnamed
            assert stream.sent[-1] == P.WorkerExit("tcp://x:1", "exited with code 3").to_msg()

    asyncio.run(main())
