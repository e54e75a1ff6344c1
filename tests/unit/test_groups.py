"""The resource-group machine (scheduler/groups.py) without I/O: placement by strategy,
re-placement after a lost worker, removal, and fitting requests into bundles through the
lease queue, plus seeded random runs that check its invariants after every step."""

from __future__ import annotations

import random

import pytest

from yrdask import protocol as P
from yrdask.scheduler import groups as G
from yrdask.scheduler import leases as LQ
from yrdask.scheduler.resources import Holding, Ledger

pytestmark = pytest.mark.timeout(120)

OWNER = "tcp://driver:1"


def ledger_of(*cpus: float, memory: float = 4096) -> Ledger:
    ledger = Ledger()
    for i, c in enumerate(cpus):
        ledger.add_worker(f"w{i}", {"CPU": c, "Memory": memory})
    return ledger


def create(m: G.GroupMachine, name: str, bundles: list[dict], strategy: str = "PACK",
           owner: str = OWNER) -> list:
    return m.handle(G.GroupRequested(f"create-{name}", name, owner,
                                     tuple({"Memory": 0.0, **b} for b in bundles), strategy))


def workers_of(m: G.GroupMachine, name: str) -> list[str | None]:
    return [b.worker for b in m.groups[name].bundles]


def of(out: list, kind: type) -> list:
    return [i for i in out if isinstance(i, kind)]


# -- placement by strategy -------------------------------------------------------------------


def test_strict_spread_puts_each_bundle_on_its_own_worker_and_reserves_it():
    ledger = ledger_of(2000, 2000, 2000)
    m = G.GroupMachine(ledger)
    out = create(m, "g", [{"CPU": 1000}] * 3, "STRICT_SPREAD")
    assert len(set(workers_of(m, "g"))) == 3
    assert of(out, G.GroupReady) == [G.GroupReady("create-g", "g")]
    assert len(of(out, G.BundleReserved)) == 3
    assert all(ws.free("CPU") == 1000 for ws in ledger.workers.values())
    m.validate()


def test_impossible_strict_spread_waits_and_says_why_then_places_when_a_worker_joins():
    ledger = ledger_of(4000, 4000)
    m = G.GroupMachine(ledger)
    out = create(m, "g", [{"CPU": 500}] * 3, "STRICT_SPREAD")
    assert not of(out, G.GroupReady) and m.groups["g"].state == P.RG_PENDING
    assert "STRICT_SPREAD needs 3 distinct workers" in m.groups["g"].reason
    assert not ledger.bundle_held and all(ws.free("CPU") == 4000 for ws in ledger.workers.values())
    ledger.add_worker("w9", {"CPU": 1000, "Memory": 1024})
    out = m.handle(G.ClusterChanged("joined"))
    assert of(out, G.GroupReady) and sorted(workers_of(m, "g")) == ["w0", "w1", "w9"]
    m.validate()


def test_no_bundle_goes_to_a_node_whose_processes_all_drain():
    ledger = ledger_of(4000, 1000)
    m = G.GroupMachine(ledger)
    assert ledger.set_draining("w0", True)
    out = create(m, "g", [{"CPU": 2000}])
    assert not of(out, G.GroupReady) and m.groups["g"].state == P.RG_PENDING
    assert ledger.set_draining("w0", False)  # kept after all
    out = m.handle(G.ClusterChanged("kept"))
    assert of(out, G.GroupReady) and workers_of(m, "g") == ["w0"]
    m.validate()


def test_strict_pack_puts_every_bundle_on_one_worker_or_waits():
    ledger = ledger_of(1000, 3000)
    m = G.GroupMachine(ledger)
    create(m, "g", [{"CPU": 1000}, {"CPU": 1500}], "STRICT_PACK")
    assert workers_of(m, "g") == ["w1", "w1"]
    create(m, "h", [{"CPU": 600}, {"CPU": 600}], "STRICT_PACK")
    assert m.groups["h"].state == P.RG_PENDING
    assert "does not fit" in m.groups["h"].reason or "together" in m.groups["h"].reason
    create(m, "never", [{"CPU": 2000}, {"CPU": 2000}], "STRICT_PACK")
    assert "STRICT_PACK needs one worker offering all bundles together" in \
        m.groups["never"].reason
    m.validate()


def test_pack_prefers_one_worker_and_spread_prefers_many_but_both_bend():
    m = G.GroupMachine(ledger_of(4000, 4000))
    create(m, "p", [{"CPU": 1000}] * 3, "PACK")
    assert len(set(workers_of(m, "p"))) == 1
    create(m, "s", [{"CPU": 500}] * 2, "SPREAD")
    assert len(set(workers_of(m, "s"))) == 2
    m2 = G.GroupMachine(ledger_of(1000, 1000))
    create(m2, "p", [{"CPU": 1000}] * 2, "PACK")  # cannot pack: spreads instead
    assert sorted(workers_of(m2, "p")) == ["w0", "w1"]
    m3 = G.GroupMachine(ledger_of(3000))
    create(m3, "s", [{"CPU": 1000}] * 3, "SPREAD")  # one worker: shares it
    assert workers_of(m3, "s") == ["w0"] * 3
    for machine in (m, m2, m3):
        machine.validate()


def test_a_bundle_larger_than_any_worker_is_named_in_the_reason():
    m = G.GroupMachine(ledger_of(1000, 1000))
    create(m, "g", [{"CPU": 500}, {"CPU": 8000}], "PACK")
    assert m.groups["g"].reason.startswith("bundle 1 {CPU: 8000, Memory: 0} can never be placed")


def test_custom_resources_are_reserved_like_worker_resources():
    ledger = ledger_of(2000, 2000)
    ledger.workers["w1"].capacity["GPU"] = 2.0
    m = G.GroupMachine(ledger)
    create(m, "g", [{"CPU": 500, "GPU": 1}, {"CPU": 500, "GPU": 1}], "PACK")
    assert workers_of(m, "g") == ["w1", "w1"]
    assert ledger.workers["w1"].free("GPU") == 0


# -- removal, owners, lost workers -----------------------------------------------------------


def test_removal_frees_the_reservations_and_ends_what_ran_inside():
    ledger = ledger_of(2000)
    m = G.GroupMachine(ledger)
    create(m, "g", [{"CPU": 1000}], "PACK")
    hid = m.groups["g"].bundles[0].holding_id
    ledger.hold(Holding("i-1", "instance", "w0", {"CPU": 400}, "job", bundle=hid))
    ledger.hold(Holding("L1", "lease", "w0", {"CPU": 400}, OWNER, bundle=hid))
    assert ledger.workers["w0"].free("CPU") == 1000  # inside the bundle: not counted twice
    out = m.handle(G.GroupRemoved("rm", "g", "asked"))
    ends = {(e.holding_id, e.kind) for e in of(out, G.EndHolding)}
    assert ends == {("i-1", "instance"), ("L1", "lease")}
    assert of(out, G.BundlesReleased) == [G.BundlesReleased("rm", (hid,))]
    assert of(out, G.GroupEnded)[0].reason.startswith("removed: asked")
    assert "L1" not in ledger.holdings and hid not in ledger.holdings
    ledger.release("i-1")  # the killed instance gives its holding back later
    assert ledger.workers["w0"].free("CPU") == 2000 and not ledger.bundle_held
    assert m.live("g") is None and m.groups["g"].state == P.RG_REMOVED
    m.validate()


def test_a_job_that_ends_removes_its_groups_only():
    m = G.GroupMachine(ledger_of(4000))
    create(m, "mine", [{"CPU": 1000}], owner="tcp://a:1")
    create(m, "theirs", [{"CPU": 1000}], owner="tcp://b:1")
    out = m.handle(G.OwnerEnded("end", "tcp://a:1"))
    assert [e.group for e in of(out, G.GroupEnded)] == ["mine"]
    assert m.live("theirs") is not None and m.live("mine") is None
    assert m.ledger.workers["w0"].free("CPU") == 3000


def test_a_detached_group_outlives_the_job_that_made_it():
    m = G.GroupMachine(ledger_of(4000))
    m.handle(G.GroupRequested("c", "kept", "tcp://a:1", ({"CPU": 1000},), "PACK",
                              detached=True))
    create(m, "mine", [{"CPU": 1000}], owner="tcp://a:1")
    out = m.handle(G.OwnerEnded("end", "tcp://a:1"))
    assert [e.group for e in of(out, G.GroupEnded)] == ["mine"]
    assert m.live("kept") is not None
    m.handle(G.GroupRemoved("rm", "kept", "asked"))  # until it is removed
    assert m.live("kept") is None
    m.validate()


def test_bundles_of_a_lost_worker_are_placed_again_next_to_the_others():
    ledger = ledger_of(1000, 1000, 1000)
    m = G.GroupMachine(ledger)
    create(m, "g", [{"CPU": 1000}, {"CPU": 1000}], "STRICT_SPREAD")
    lost = workers_of(m, "g")[0]
    kept = workers_of(m, "g")[1]
    ledger.remove_worker(lost)
    out = m.handle(G.ClusterChanged("lost"))
    assert of(out, G.GroupReady)
    assert workers_of(m, "g")[1] == kept and workers_of(m, "g")[0] not in (lost, kept)
    ledger.remove_worker(workers_of(m, "g")[0])
    m.handle(G.ClusterChanged("lost-again"))
    g = m.groups["g"]
    assert g.state == P.RG_PENDING and workers_of(m, "g")[0] is None
    assert "a worker holding its bundles was lost" not in g.reason  # now says why it waits
    assert "STRICT_SPREAD needs 2 distinct workers" in g.reason
    m.validate()


# -- fitting requests into bundles (the lease queue's hook) ----------------------------------


def hold(q: LQ.LeaseQueue, rid: str, shape: dict, wire: tuple, timeout_ms: int = 1000,
         now: float = 0.0, kind: str = "lease") -> list:
    return q.handle(LQ.HoldRequested(f"req-{rid}", rid, OWNER, kind, shape, timeout_ms,
                                     None, "q", (), wire, (), rid if kind == "instance" else None,
                                     now))


def test_a_request_for_a_bundle_is_fitted_against_its_reservation():
    q = LQ.LeaseQueue()
    q.handle(LQ.WorkerJoined("j0", "w0", {"CPU": 2000, "Memory": 1024}))
    q.handle(LQ.WorkerJoined("j1", "w1", {"CPU": 2000, "Memory": 1024}))
    m = q.bundles = G.GroupMachine(q.ledger)
    create(m, "g", [{"CPU": 1000}, {"CPU": 1000}], "STRICT_SPREAD")
    w1 = workers_of(m, "g")[1]
    out = hold(q, "r1", {"CPU": 600, "Memory": 0}, P.bundle_wire("g", 1))
    granted = of(out, LQ.Granted)
    assert granted and granted[0].worker == w1
    # The bundle has 400 left: a second 600 waits though the worker itself has 1000 free.
    assert q.ledger.workers[w1].free("CPU") == 1000
    out = hold(q, "r2", {"CPU": 600, "Memory": 0}, P.bundle_wire("g", 1), kind="instance")
    assert not of(out, LQ.Granted) and "r2" in q.pending
    q.validate()
    m.validate()
    out = q.handle(LQ.HoldingsReleased("done", (granted[0].holding_id,)))
    assert [g.request_id for g in of(out, LQ.Granted)] == ["r2"]
    # At its deadline a waiter says which bundle and what holds it (an instance: it will
    # not end by itself, so the request is refused rather than extended).
    hold(q, "r3", {"CPU": 600, "Memory": 0}, P.bundle_wire("g", 1), timeout_ms=10)
    out = q.handle(LQ.Tick("tick", 5.0))
    refused = of(out, LQ.Refused)
    assert refused and "does not fit into resource group 'g'" in refused[0].reason
    assert "bundle 1" in refused[0].reason and "instance r2" in refused[0].reason
    assert q.explain_wait("r2") is None  # granted by now; r4 waits and is explained
    hold(q, "r4", {"CPU": 600, "Memory": 0}, P.bundle_wire("g", 1), timeout_ms=-1)
    assert "does not fit into resource group 'g'" in q.explain_wait("r4", 6.0)["text"]


def test_a_bundle_waiter_revokes_leases_in_its_bundle_and_waits_while_they_run():
    q = LQ.LeaseQueue()
    q.handle(LQ.WorkerJoined("j0", "w0", {"CPU": 4000, "Memory": 1024}))
    m = q.bundles = G.GroupMachine(q.ledger)
    create(m, "g", [{"CPU": 1000}], "PACK")
    outside = of(hold(q, "free", {"CPU": 1000, "Memory": 0}, ()), LQ.Granted)[0]
    other = q.handle(LQ.HoldRequested("o", "in", "tcp://other:1", "lease",
                                      {"CPU": 1000, "Memory": 0}, 1000, None, "q2", (),
                                      P.bundle_wire("g", 0), (), None, 0.0))
    inside = of(other, LQ.Granted)[0]
    out = hold(q, "wait", {"CPU": 500, "Memory": 0}, P.bundle_wire("g", 0), timeout_ms=10)
    # Only the lease inside the bundle is asked back, not the one outside it.
    assert of(out, LQ.Revoke) == [LQ.Revoke("req-wait", "tcp://other:1", (inside.holding_id,))]
    out = q.handle(LQ.Tick("t", 5.0))
    assert not of(out, LQ.Refused) and "wait" in q.pending  # a task lease will end
    out = q.handle(LQ.HoldingsReleased("ret", (inside.holding_id,)))
    assert [g.request_id for g in of(out, LQ.Granted)] == ["wait"]
    assert outside.holding_id in q.ledger.holdings


def test_requests_that_can_never_fit_a_bundle_are_refused_at_once():
    q = LQ.LeaseQueue()
    q.handle(LQ.WorkerJoined("j0", "w0", {"CPU": 4000, "Memory": 1024}))
    m = q.bundles = G.GroupMachine(q.ledger)
    create(m, "g", [{"CPU": 1000}], "PACK")
    cases = {
        "nogroup": (P.bundle_wire("nope", -1), "resource group 'nope' does not exist"),
        "range": (P.bundle_wire("g", 3), "bundle_index 3 is out of range"),
        "big": (P.bundle_wire("g", 0), "can never fit bundle 0"),
    }
    for rid, (wire, text) in cases.items():
        shape = {"CPU": 2000 if rid == "big" else 100, "Memory": 0}
        refused = of(hold(q, rid, shape, wire), LQ.Refused)
        assert refused and text in refused[0].reason, (rid, refused)


def test_a_request_for_a_pending_bundle_waits_and_is_granted_once_placed():
    q = LQ.LeaseQueue()
    q.handle(LQ.WorkerJoined("j0", "w0", {"CPU": 1000, "Memory": 1024}))
    m = q.bundles = G.GroupMachine(q.ledger)
    create(m, "g", [{"CPU": 1000}, {"CPU": 1000}], "STRICT_SPREAD")
    out = hold(q, "r1", {"CPU": 500, "Memory": 0}, P.bundle_wire("g", -1), timeout_ms=-1)
    assert "r1" in q.pending and not of(out, LQ.Granted)
    q.handle(LQ.WorkerJoined("j1", "w1", {"CPU": 1000, "Memory": 1024}))
    m.handle(G.ClusterChanged("joined"))
    out = q.handle(LQ.Tick("tick", 1.0))  # what the adapter does after BundleReserved
    assert [g.request_id for g in of(out, LQ.Granted)] == ["r1"]
    # Removing the group refuses what still waits for it.
    assert of(hold(q, "r2", {"CPU": 1000, "Memory": 0}, P.bundle_wire("g", -1)), LQ.Granted)
    hold(q, "r3", {"CPU": 1000, "Memory": 0}, P.bundle_wire("g", -1), timeout_ms=-1)
    assert "r3" in q.pending
    m.handle(G.GroupRemoved("rm", "g", "asked"))
    refused = of(q.handle(LQ.Tick("tick2", 2.0)), LQ.Refused)
    assert refused and "does not exist" in refused[0].reason


# -- seeded random runs ----------------------------------------------------------------------


def _check(m: G.GroupMachine) -> None:
    m.validate()
    ledger = m.ledger
    for ws in ledger.workers.values():
        for r, held in ws.held.items():
            assert held <= ws.capacity.get(r, 0.0) + 1e-6, f"{ws.address} over-committed {r}"
    # Nothing pending could be placed now (every change was followed by ClusterChanged).
    for g in m.groups.values():
        if g.state != P.RG_PENDING:
            continue
        fixed = {b.index: b.worker for b in g.bundles if b.worker is not None}
        free = {a: {r: ws.free(r) for r in ws.capacity} for a, ws in ledger.workers.items()}
        todo = {b.index: b.shape for b in g.bundles if b.worker is None}
        assert G.place(g.strategy, todo, fixed, free) is None, f"{g.name} could be placed"


@pytest.mark.parametrize("seed", range(60))
def test_random_runs_keep_the_invariants(seed: int):
    rng = random.Random(seed)
    ledger = Ledger()
    m = G.GroupMachine(ledger)
    n_workers = 0
    held: list[str] = []
    for step in range(120):
        action = rng.random()
        sid = f"s{step}"
        if action < 0.15 or not ledger.workers:
            n_workers += 1
            ledger.add_worker(f"w{n_workers}", {"CPU": rng.choice([1000, 2000, 4000]),
                                                 "Memory": 2048})
            m.handle(G.ClusterChanged(sid))
        elif action < 0.22:
            worker = rng.choice(sorted(ledger.workers))
            lost = ledger.remove_worker(worker)
            held = [h for h in held if h not in {x.holding_id for x in lost}]
            m.handle(G.ClusterChanged(sid))
        elif action < 0.5:
            bundles = [{"CPU": rng.choice([250, 500, 1000, 1500]), "Memory": 100}
                       for _ in range(rng.randint(1, 4))]
            name = f"g{rng.randint(0, 12)}"
            if m.live(name) is None:
                m.handle(G.GroupRequested(sid, name, rng.choice(["a", "b"]), tuple(bundles),
                                          rng.choice(G.STRATEGIES)))
        elif action < 0.62:
            names = [n for n in m.groups if m.live(n)]
            if names:
                out = m.handle(G.GroupRemoved(sid, rng.choice(names), "random"))
                for e in of(out, G.EndHolding):
                    if e.kind == "instance":
                        ledger.release(e.holding_id)
                        held.remove(e.holding_id)
                    else:
                        held.remove(e.holding_id)
                m.handle(G.ClusterChanged(sid + "-after"))
        elif action < 0.66:
            m.handle(G.OwnerEnded(sid, rng.choice(["a", "b"])))
            held = [h for h in held if h in ledger.holdings]
            # what was killed gives its holding back
            for hid in [h for h in held if ledger.holdings[h].bundle not in ledger.bundle_held]:
                ledger.release(hid)
                held.remove(hid)
            m.handle(G.ClusterChanged(sid + "-after"))
        elif action < 0.88:
            names = [n for n in m.groups if m.live(n)]
            if names:
                name = rng.choice(names)
                index = rng.randint(-1, len(m.groups[name].bundles) - 1)
                shape = {"CPU": rng.choice([100, 250, 500]), "Memory": 10}
                found = m.fit(P.bundle_wire(name, index), shape)
                if isinstance(found, tuple):
                    worker, bundle = found
                    hid = f"i{step}"
                    ledger.hold(Holding(hid, rng.choice(["instance", "lease"]), worker, shape,
                                        "a", bundle=bundle))
                    held.append(hid)
        elif held:
            hid = held.pop(rng.randrange(len(held)))
            ledger.release(hid)
            m.handle(G.ClusterChanged(sid))
        _check(m)
    # Removing everything frees everything.
    for name in list(m.groups):
        for e in of(m.handle(G.GroupRemoved("end", name, "done")), G.EndHolding):
            if e.kind == "instance":
                ledger.release(e.holding_id)
    assert not m.by_holding and not ledger.bundle_held
    assert not [h for h in ledger.holdings.values() if h.kind == "bundle" or h.bundle]
    for ws in ledger.workers.values():
        assert all(abs(v) < 1e-6 for v in ws.held.values()), ws.held


def _feasible(strategy: str, todo: dict, free: dict) -> bool:
    """Brute force: does any assignment of ``todo`` to workers fit under ``strategy``?"""
    import itertools as it

    workers, idx = sorted(free), sorted(todo)
    for choice in it.product(workers, repeat=len(idx)):
        if strategy == "STRICT_SPREAD" and len(set(choice)) < len(choice):
            continue
        if strategy == "STRICT_PACK" and len(set(choice)) > 1:
            continue
        left = {w: dict(f) for w, f in free.items()}
        ok = True
        for i, w in zip(idx, choice):
            for r, a in todo[i].items():
                left[w][r] = left[w].get(r, 0.0) - a
                ok = ok and left[w][r] >= -1e-9
        if ok:
            return True
    return False


@pytest.mark.parametrize("seed", range(200))
def test_placement_finds_a_place_exactly_when_one_exists(seed: int):
    rng = random.Random(1000 + seed)
    free = {f"w{i}": {"CPU": float(rng.choice([500, 1000, 1500, 2000])),
                      "GPU": float(rng.choice([0, 1, 2]))}
            for i in range(rng.randint(1, 4))}
    todo = {i: {"CPU": float(rng.choice([250, 500, 750, 1000])),
                **({"GPU": 1.0} if rng.random() < 0.3 else {})}
            for i in range(rng.randint(1, 4))}
    strategy = rng.choice(G.STRATEGIES)
    found = G.place(strategy, todo, {}, free)
    assert (found is not None) == _feasible(strategy, todo, free), (strategy, todo, free)
    if found is not None:
        left = {w: dict(f) for w, f in free.items()}
        for i, w in found.items():
            for r, a in todo[i].items():
                left[w][r] -= a
        assert all(a >= -1e-9 for f in left.values() for a in f.values())
        if strategy == "STRICT_SPREAD":
            assert len(set(found.values())) == len(found)
        if strategy == "STRICT_PACK":
            assert len(set(found.values())) == 1


def test_a_hopeless_group_is_searched_again_only_when_something_frees_up():
    ledger = ledger_of(1000)
    m = G.GroupMachine(ledger)
    ledger.hold(Holding("i-big", "instance", "w0", {"CPU": 800}, "x"))
    create(m, "g", [{"CPU": 500}], "PACK")
    for i in range(3):
        m.handle(G.ClusterChanged(f"nothing-{i}"))
    assert len([w for _, w in m.story("g") if w[0] == "wait"]) == 1  # tried once only
    ledger.release("i-big")
    out = m.handle(G.ClusterChanged("freed"))
    assert of(out, G.GroupReady) and workers_of(m, "g") == ["w0"]
