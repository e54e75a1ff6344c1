"""Unit tests of yrdask.scheduler.lifecycle.Lifecycle: the rules of SPEC §4-5, without a cluster.

Events in, instructions out, ``validate()`` after every step: placement and start, the owner
tree and its end order, detached children, the named registry and aliases, handle reference
counting with tokens of pickled handles and the release grace period, lost holders, owners
and workers, restarts with their budget and checkpoints, the graveyard, and a seeded random
run.
"""

from __future__ import annotations

import random

import pytest

from .harness import MachineHarness

from yrdask import protocol as P
from yrdask.scheduler import lifecycle as L

pytestmark = pytest.mark.timeout(30)

JOB = "job-1"
DRIVER = "tcp://driver:1"  # the holder address of the job's driver
W1, W2, W3 = "tcp://w1:1", "tcp://w2:1", "tcp://w3:1"
GRACE = L.RELEASE_GRACE_S


def spec(iid, owner=JOB, name="", namespace="", detached=False, holder=DRIVER, recover=0,
         timeout_ms=30_000):
    return {"instance_id": iid, "owner": owner, "name": name, "namespace": namespace,
            "detached": detached, "holder": holder, "cls_name": "C", "meta": {"m": iid},
            "shape": {"CPU": 500.0, "Memory": 500.0}, "recover_retry_times": recover,
            "timeout_ms": timeout_ms, "affinity": [], "labels": ["l1"]}


class Harness(MachineHarness):
    """A Lifecycle with helpers that validate after each event."""

    def __init__(self) -> None:
        super().__init__(L.Lifecycle())

    def create(self, *args, now=0.0, **kwargs) -> list:
        return self(L.Create, spec(*args, **kwargs), now)

    def running(self, *args, worker=W1, **kwargs) -> L.InstanceRecord:
        """Create, place on ``worker`` and report alive."""
        self.create(*args, **kwargs)
        iid = args[0]
        self(L.Placed, iid, worker)
        self(L.InstanceStarted, iid, worker)
        return self.m.instances[iid]

    def rec(self, iid) -> L.InstanceRecord:
        return self.m.instances[iid]


def of(out, kind):
    return [i for i in out if type(i) is kind]


def ids(records):
    return [r.instance_id for r in records]


@pytest.fixture
def h():
    return Harness()


# --------------------------------------------------------------------------- creation and start


def test_create_acquires_then_placed_starts_and_answers(h):
    out = h.create("a", now=12.5)
    assert out == [L.AcquireResources("s1", "a", {"CPU": 500.0, "Memory": 500.0}, 30_000, (),
                                      ("l1",))]
    rec = h.rec("a")
    assert (rec.state, rec.owner, rec.holders, rec.created_at) == (P.PENDING, JOB, {DRIVER}, 12.5)
    assert h.m.answer("a", L.PLACED) is None  # a create rpc waits
    out = h(L.Placed, "a", W1)
    assert of(out, L.StartInstance) == [L.StartInstance("s2", W1, "a", rec.spec, 0, None)]
    assert of(out, L.AnswerWaiters) == [L.AnswerWaiters("s2", "a", L.PLACED, W1)]
    assert h.m.answer("a", L.PLACED) == (W1, "") and h.m.answer("a", L.ALIVE_STAGE) is None
    out = h(L.InstanceStarted, "a", W1)
    assert out == [L.AnswerWaiters("s3", "a", L.ALIVE_STAGE, W1)]
    assert rec.state == P.ALIVE and rec.reason == ""
    assert h.m.status("a") == {"state": P.ALIVE, "worker": W1, "restarts": 0, "reason": ""}


def test_init_failure_counts_as_running_with_a_reason(h):
    h.create("a")
    h(L.Placed, "a", W1)
    h(L.InstanceStarted, "a", W1, True)
    assert h.rec("a").state == P.ALIVE and h.rec("a").reason == "__init__ raised"


def test_placement_failure_ends_it_and_answers_with_the_ledger_reason(h):
    h.create("a")
    out = h(L.PlacementFailed, "a", "no worker has CPU=500")
    assert of(out, L.AnswerWaiters)[0] == L.AnswerWaiters("s2", "a", L.PLACED, None,
                                                         "no worker has CPU=500")
    assert of(out, L.ReleaseResources) == [] and of(out, L.StopInstance) == []
    assert "a" not in h.m.instances and h.m.graveyard["a"] == "no worker has CPU=500"
    assert h.m.status("a")["state"] == P.DEAD
    assert h.m.answer("a", L.PLACED) == (None, "it has ended: no worker has CPU=500")


def test_kill_while_acquiring_cancels_and_a_late_grant_is_released(h):
    h.create("a")
    out = h(L.Kill, "a")
    assert of(out, L.CancelAcquire) == [L.CancelAcquire("s2", "a")]
    waiters = of(out, L.AnswerWaiters)
    assert waiters[0].worker is None and "ended before it started: terminated" in waiters[0].reason
    assert h(L.Placed, "a", W1) == [L.ReleaseResources("s3", "a")]
    assert h(L.PlacementFailed, "a", "x") == []


def test_stale_reports_are_ignored(h):
    h.create("a")
    assert h(L.InstanceStarted, "a", W1) == []  # not placed yet
    h(L.Placed, "a", W1)
    assert h(L.Placed, "a", W2) == []  # a duplicate grant for a placed one: ignored
    assert h(L.InstanceStarted, "a", W2) == []  # another worker's report
    assert h(L.InstanceExited, "a", W2) == []
    assert h(L.InstanceStarted, "nope", W1) == [] and h(L.Stopped, "a") == []
    assert h.rec("a").state == P.PENDING


def test_exited_ends_it(h):
    h.running("a")
    out = h(L.InstanceExited, "a", W1)
    assert of(out, L.StopInstance) == [L.StopInstance("s4", W1, "a", "it exited")]
    assert of(out, L.ReleaseResources) == [L.ReleaseResources("s4", "a")]


def test_end_keeps_the_record_until_the_worker_confirms_the_stop(h):
    h.running("a")
    h(L.Kill, "a")
    assert h.rec("a").state == P.DEAD and h.m.status("a")["reason"] == "terminated"
    assert h(L.Kill, "a") == []  # already ending
    h(L.Stopped, "a")
    assert "a" not in h.m.instances and h.m.graveyard["a"] == "terminated"
    assert "terminated" in h.m.status("a")["reason"]


# --------------------------------------------------------------------------- owner tree


def test_end_ends_the_tree_deepest_first(h):
    # job -> a -> (b -> (c, d), e)
    for iid, owner in [("a", JOB), ("b", "a"), ("e", "a"), ("c", "b"), ("d", "b")]:
        h.running(iid, owner=owner)
    out = h(L.Kill, "a")
    ended = ids(h.m.last_ended)
    assert sorted(ended) == ["a", "b", "c", "d", "e"] and ended[-1] == "a"
    assert ended.index("c") < ended.index("b") and ended.index("d") < ended.index("b")
    assert [s.instance_id for s in of(out, L.StopInstance)] == ended
    assert "a" in h.rec("b").reason and "terminated" in h.rec("b").reason
    assert "b" in h.rec("c").reason
    assert "a" not in h.m.children and "b" not in h.m.children


def test_detached_child_survives_its_owner_and_ends_its_own_tree(h):
    h.running("sup")
    h.running("w1", owner="sup")
    h.running("det", owner="sup", detached=True)
    h.running("det-child", owner="det")
    h(L.Kill, "sup")
    assert sorted(ids(h.m.last_ended)) == ["sup", "w1"]
    assert h.rec("det").state == P.ALIVE and h.rec("det-child").state == P.ALIVE
    h(L.Stopped, "sup")
    h(L.Kill, "det")
    assert sorted(ids(h.m.last_ended)) == ["det", "det-child"]


def test_child_created_by_an_ended_owner_ends_at_once(h):
    h.running("p")
    h(L.Kill, "p")
    h(L.Stopped, "p")  # forgotten: only the graveyard knows
    out = h.create("late", owner="p")
    assert of(out, L.AcquireResources) == []
    assert "late" not in h.m.instances and "its owner p has ended" in h.m.graveyard["late"]
    h.create("late-det", owner="p", detached=True)  # a detached one may outlive it
    assert h.rec("late-det").acquiring


def test_owner_gone_ends_its_non_detached_trees(h):
    h.running("a")
    h.running("a1", owner="a", worker=W2)
    h.running("n", name="named")
    h.running("det", detached=True)
    h.running("det-child", owner="det")
    h.running("other", owner="job-2")
    h(L.OwnerGone, JOB, "its job ended")
    assert sorted(ids(h.m.last_ended)) == ["a", "a1", "n"]
    assert h.rec("a").reason == "its job ended"
    assert h.m.named("", "named") is None
    for iid in ("det", "det-child", "other"):
        assert h.rec(iid).state == P.ALIVE
    assert h.m.children[JOB] == {"det"}
    assert h(L.OwnerGone, "job-unknown", "gone") == []


# --------------------------------------------------------------------------- names and aliases


def test_named_registry_binds_aliases_and_frees_the_name(h):
    a = h.running("a", name="actor")
    b = h.running("b", name="actor", namespace="ns1")
    assert h.m.named("", "actor") is a and h.m.named("ns1", "actor") is b
    assert h.m.named("ns2", "actor") is None and not a.refcounted
    out = h.create("a2", name="actor")  # the name is taken: bind the existing one
    assert out == [] and "a2" not in h.m.instances
    assert h.m.resolve("a2") == "a" and h.m.answer("a", L.PLACED) == (W1, "")
    assert h.m.status("a2")["state"] == P.ALIVE
    h(L.Kill, "a2")  # through the alias
    assert a.state == P.DEAD and h.m.named("", "actor") is None
    h(L.Stopped, "a")
    assert "a2" not in h.m.aliases  # forgotten with the instance
    c = h.create("c", name="actor") and h.rec("c")
    assert h.m.named("", "actor") is c


def test_named_instance_being_created_is_bound_too(h):
    h.create("a", name="actor")
    h.create("a2", name="actor")
    assert h.m.resolve("a2") == "a" and h.m.answer("a", L.PLACED) is None


# --------------------------------------------------------------------------- handle refs


def refs(h, holder, deltas=None, transit=(), arrived=(), now=0.0):
    return h(L.HandleRefs, holder, deltas or {}, list(transit), list(arrived), now)


def test_reports_that_overtake_the_creation_are_applied_when_it_comes(h):
    # Another process got the handle (+1, and the token it arrived with) before the creator's
    # CREATE_INSTANCE reached the scheduler; the creator has even let go of it already.
    refs(h, W2, {"a": +1}, arrived=[("a", "t1")])
    refs(h, DRIVER, {"a": -1}, transit=[("a", "t1")])
    h.create("a", holder=DRIVER)
    rec = h.rec("a")
    assert rec.holders == {W2} and not rec.transit  # the creator's -1 cancelled its holder
    assert "a" not in h.m.release_due and "a" not in h.m.early
    refs(h, W2, {"a": -1}, now=1.0)
    assert h.m.release_due["a"] == 1.0 + GRACE  # now nobody holds it


def test_early_reports_of_a_holder_that_died_are_dropped(h):
    refs(h, W3, {"b": +1})
    h(L.HolderLost, W3, 0.5)
    h.create("b", holder=DRIVER)
    assert h.rec("b").holders == {DRIVER}


def test_last_holder_dropping_ends_it_after_the_grace_period(h):
    h.running("a")
    refs(h, W1, {"a": +1})
    assert refs(h, DRIVER, {"a": -1}, now=1.0) == []
    out = refs(h, W1, {"a": -1}, now=2.0)
    assert out == [L.WakeAt(f"s{h.n}", 2.0 + GRACE)]
    assert h(L.ReleaseCheck, 2.0 + GRACE / 2) == [L.WakeAt(f"s{h.n}", 2.0 + GRACE)]
    out = h(L.ReleaseCheck, 2.0 + GRACE)
    assert of(out, L.StopInstance) == [L.StopInstance(f"s{h.n}", W1, "a",
                                                      "no handle to it is left")]


def test_a_handle_regained_within_the_grace_period_keeps_it(h):
    h.running("a")
    refs(h, DRIVER, {"a": -1}, now=1.0)
    refs(h, W2, {"a": +1}, now=1.1)  # reordered streams: the new holder reports late
    assert of(h(L.ReleaseCheck, 1.0 + GRACE), L.StopInstance) == []
    assert h.rec("a").state == P.ALIVE and not h.m.release_due


def test_named_detached_and_unknown_are_not_refcounted(h):
    h.running("n", name="n", holder=None)
    h.running("det", detached=True, holder=None)
    refs(h, DRIVER, {"n": -1, "det": -1, "ghost": -1})
    assert not h.m.release_due
    out = h.create("free", holder=None, now=5.0)  # created with no holder at all
    assert of(out, L.WakeAt) == [L.WakeAt(f"s{h.n}", 5.0 + GRACE)]


def test_handle_in_transit_keeps_it_either_order(h):
    h.running("a")
    refs(h, DRIVER, {"a": -1}, transit=[("a", "t1")])
    assert h.rec("a").transit == {"t1"} and not h.m.release_due
    refs(h, W1, {"a": +1}, arrived=[("a", "t1")])
    assert h.rec("a").transit == set() and not h.m.releasable("a")
    h.running("b")
    refs(h, W1, {"b": +1}, arrived=[("b", "t2")])  # the receiver's report overtakes
    assert h.m.released_tokens == {"t2"}
    refs(h, DRIVER, {"b": -1}, transit=[("b", "t2")])
    assert h.rec("b").transit == set() and h.m.released_tokens == set()
    assert not h.m.releasable("b")  # W1 holds it


def test_receiver_dropping_at_once_after_arrival_still_releases(h):
    h.running("a")
    refs(h, DRIVER, {"a": -1}, transit=[("a", "t1"), ("a", "t2")])
    refs(h, W1, {}, arrived=[("a", "t1")])
    assert not h.m.releasable("a")  # t2 still travels
    out = refs(h, W2, {}, arrived=[("a", "t2")], now=3.0)
    assert of(out, L.WakeAt) == [L.WakeAt(f"s{h.n}", 3.0 + GRACE)]


def test_holder_lost_drops_it_everywhere(h):
    h.running("a", holder=W3)
    h.running("b", holder=W3)
    h.running("c")
    refs(h, W2, {"a": +1})
    out = h(L.HolderLost, W3, 1.0)
    assert of(out, L.WakeAt) == [L.WakeAt(f"s{h.n}", 1.0 + GRACE)]
    assert h.rec("a").holders == {W2} and set(h.m.release_due) == {"b"}
    assert h(L.HolderLost, "tcp://nobody:1", 1.0) == []


# --------------------------------------------------------------------------- workers and restarts


def test_lost_worker_ends_its_instances_and_their_descendants(h):
    h.running("a")
    h.running("b", worker=W2)
    h.running("a-child", owner="a", worker=W2)  # a descendant elsewhere ends too
    h.running("a-det", owner="a", detached=True, worker=W2)
    out = h(L.WorkerLost, W1, 0.0)
    assert sorted(ids(h.m.last_ended)) == ["a", "a-child"]
    # the lost worker's holding went with it: nothing to release or stop there
    assert [s.instance_id for s in of(out, L.StopInstance)] == ["a-child"]
    assert [r.instance_id for r in of(out, L.ReleaseResources)] == ["a-child"]
    assert "a" not in h.m.instances and W1 in h.m.graveyard["a"]
    assert h.rec("b").state == P.ALIVE and h.rec("a-det").state == P.ALIVE


def test_pending_instance_is_not_lost_with_a_worker(h):
    h.create("a")
    assert h(L.WorkerLost, W1, 0.0) == []
    assert h.rec("a").acquiring


def test_restart_budget_children_and_checkpoint(h):
    h.running("a", recover=2)
    h.running("a-child", owner="a", recover=5, worker=W2)  # ends, never restarts
    h.running("a-det", owner="a", detached=True, worker=W2)
    h(L.SaveState, "a", b"state-1")
    out = h(L.WorkerLost, W1, 0.0)
    rec = h.rec("a")
    assert (rec.state, rec.worker, rec.restarts) == (P.RESTARTING, None, 1)
    assert W1 in rec.reason
    assert of(out, L.AcquireResources)[0].timeout_ms == L.RESTART_TIMEOUT_MS
    assert ids(h.m.last_ended) == ["a-child"] and "restarted" in h.m.instances["a-child"].reason
    assert h.rec("a-det").state == P.ALIVE
    assert h.m.answer("a", L.PLACED) is None  # a locate waits for the new place
    assert h.m.answer("a", L.ALIVE_STAGE) == (None, "")  # it has run: get_named waits "placed"
    out = h(L.Placed, "a", W2)
    assert of(out, L.StartInstance) == [L.StartInstance(f"s{h.n}", W2, "a", rec.spec, 1,
                                                        b"state-1")]
    h(L.InstanceStarted, "a", W2)
    h(L.InstanceStarted, "a", W1)  # the old home's late report: ignored
    assert rec.worker == W2 and rec.state == P.ALIVE
    h(L.WorkerLost, W2, 0.0)
    assert rec.restarts == 2
    h(L.Placed, "a", W3)
    h(L.WorkerLost, W3, 0.0)
    assert "a" not in h.m.instances
    assert "all its 2 restarts" in h.m.graveyard["a"]


def test_isolated_process_deaths_and_worker_losses_share_one_budget(h):
    """An isolated instance's child dies on a live worker (``ProcessDied``): restarted in
    place (same worker, resources kept) by the budget a worker loss also draws on; the
    count is the instance's, so a move to another worker does not reset it."""
    h.running("a", recover=2)
    out = h(L.ProcessDied, "a", W1, "its isolated process (pid 7) was killed by signal 9")
    rec = h.rec("a")
    assert (rec.state, rec.worker, rec.restarts, rec.held) == (P.RESTARTING, W1, 1, True)
    assert "signal 9" in rec.reason
    assert of(out, L.StartInstance) == [L.StartInstance(f"s{h.n}", W1, "a", rec.spec, 1, None)]
    assert not of(out, L.AcquireResources) and not of(out, L.ReleaseResources)
    assert h(L.ProcessDied, "a", W1, "again") == []  # twice before it restarted: ignored
    h(L.InstanceStarted, "a", W1)
    assert rec.state == P.ALIVE
    h(L.WorkerLost, W1, 0.0)  # restart 2 of 2, on another worker
    assert rec.restarts == 2
    h(L.Placed, "a", W2)
    h(L.InstanceStarted, "a", W2)
    assert h(L.ProcessDied, "a", W1, "late") == []  # the old home's: ignored
    out = h(L.ProcessDied, "a", W2, "its isolated process (pid 9) exited with code 3")
    assert rec.state == P.DEAD and rec.restarts == 2
    assert rec.reason == ("its isolated process (pid 9) exited with code 3 and it had used "
                          "all its 2 restarts")
    assert of(out, L.StopInstance) == [L.StopInstance(f"s{h.n}", W2, "a", rec.reason)]
    assert of(out, L.ReleaseResources)


def test_callers_reach_a_process_instance_where_its_process_serves(h):
    """An instance in a process of its own is reached at that process's endpoint: placing
    it answers nobody yet, its start (with the endpoint) answers the waiting creations and
    locates; while it restarts or moves there is no address, and each new process's own
    endpoint is answered once it serves.  A light instance is reached at its worker from
    its placement on."""
    h.create("p", recover=2)
    h.rec("p").spec["isolation"] = {"env": {}, "cwd": ""}
    assert L.runs_alone(h.rec("p").spec)
    out = h(L.Placed, "p", W1)
    assert not of(out, L.AnswerWaiters) and h.m.answer("p", L.PLACED) is None
    out = h(L.InstanceStarted, "p", W1, False, "tcp://w1:7001")
    assert L.AnswerWaiters(f"s{h.n}", "p", L.PLACED, "tcp://w1:7001") in out
    assert h.m.answer("p", L.PLACED) == ("tcp://w1:7001", "")
    assert h.m.status("p")["worker"] == W1  # where it is hosted, as for any instance
    h(L.ProcessDied, "p", W1, "killed", 0)
    assert h.m.answer("p", L.PLACED) is None
    out = h(L.InstanceStarted, "p", W1, False, "tcp://w1:7002")
    assert of(out, L.AnswerWaiters)[-1].worker == "tcp://w1:7002"
    h(L.Move, "p", W1, b"state", (W1,))
    assert h.m.answer("p", L.PLACED) is None
    h(L.Placed, "p", W2)
    assert h.m.answer("p", L.PLACED) is None
    h(L.InstanceStarted, "p", W2, True, "")  # no process could start: its worker answers
    assert h.m.answer("p", L.PLACED) == (W2, "")
    h.create("light")
    assert not L.runs_alone(h.rec("light").spec)
    out = h(L.Placed, "light", W1)
    assert L.AnswerWaiters(f"s{h.n}", "light", L.PLACED, W1) in out


def test_a_restarted_process_that_dies_before_it_comes_up_is_a_new_death(h):
    """Found by the simulation (its former model of isolated instances): the restarted
    child died in ``__init__``, before ALIVE; its RESTARTING, said with its incarnation, is a second death
    (not the first one twice), so the instance restarts again or ends: it never stays
    RESTARTING with its calls waiting."""
    h.running("a", recover=1)
    h(L.ProcessDied, "a", W1, "killed", 0)
    rec = h.rec("a")
    assert (rec.state, rec.restarts) == (P.RESTARTING, 1)
    assert h(L.ProcessDied, "a", W1, "the same death, told again", 0) == []
    out = h(L.ProcessDied, "a", W1, "restart 1 died in __init__", 1)
    assert rec.state == P.DEAD and "used all its 1 restarts" in rec.reason
    assert of(out, L.StopInstance)
    h.running("b", recover=2)
    h(L.ProcessDied, "b", W1, "killed", 0)
    out = h(L.ProcessDied, "b", W1, "died again before ALIVE", 1)
    rb = h.rec("b")
    assert (rb.state, rb.restarts) == (P.RESTARTING, 2)
    assert of(out, L.StartInstance)[0].incarnation == 2
    h(L.InstanceStarted, "b", W1)
    assert h(L.ProcessDied, "b", W1, "an old process's, late", 1) == []  # stale
    assert rb.state == P.ALIVE


def test_isolated_process_death_without_restarts_ends_it(h):
    h.running("a")
    h(L.ProcessDied, "a", W1, "its isolated process (pid 7) exited with code 7")
    rec = h.rec("a")
    assert rec.state == P.DEAD and rec.reason == "its isolated process (pid 7) exited with code 7"


def test_unlimited_restarts_never_run_out(h):
    h.running("a", recover=-1, timeout_ms=-1)
    for i in range(1, 30):
        out = h(L.WorkerLost, W1, 0.0)
        assert of(out, L.AcquireResources)[0].timeout_ms == -1
        h(L.Placed, "a", W1)
        assert h.rec("a").restarts == i


def test_no_restarts_configured_means_it_ends(h):
    h.running("a")
    h(L.WorkerLost, W1, 0.0)
    assert "restarts" not in h.m.graveyard["a"]


def test_child_on_the_same_worker_ends_when_its_owner_restarts(h):
    h.running("c-first", owner="a-later", recover=1)  # owner unknown yet: a job id for now
    h.running("a", recover=1)
    h.running("c", owner="a", recover=1)
    h(L.WorkerLost, W1, 0.0)
    assert h.rec("a").state == P.RESTARTING
    assert "c" not in h.m.instances  # ended (and forgotten: its worker is gone)
    assert h.rec("c-first").state == P.RESTARTING


def test_restart_that_finds_no_room_ends_with_both_causes(h):
    h.running("a", recover=1)
    h(L.WorkerLost, W1, 0.0)
    h(L.PlacementFailed, "a", "no worker has CPU=500")
    reason = h.m.graveyard["a"]
    assert W1 in reason and "no worker could take it back: no worker has CPU=500" in reason


def test_terminate_of_a_restarting_instance_ends_it(h):
    h.running("a", recover=-1)
    h(L.WorkerLost, W1, 0.0)
    out = h(L.Kill, "a")
    assert of(out, L.CancelAcquire) == [L.CancelAcquire(f"s{h.n}", "a")]
    assert "a" not in h.m.instances


def test_save_state_of_an_ended_instance_is_ignored(h):
    h.running("a")
    h(L.Kill, "a")
    h(L.SaveState, "a", b"late")
    assert h.m.checkpoint_of("a") is None
    assert not h.m.is_live("a")


def test_graveyard_is_bounded(h):
    for k in range(L.GRAVEYARD_MAX + 5):
        h.m.handle(L.Create("c", spec(f"i{k}"), 0.0))
        h.m.handle(L.PlacementFailed("f", f"i{k}", "no"))
    assert len(h.m.graveyard) <= L.GRAVEYARD_MAX
    assert f"i{L.GRAVEYARD_MAX + 4}" in h.m.graveyard


def test_snapshot_keeps_the_dashboard_keys(h):
    h.running("a", name="actor", namespace="ns")
    h.create("b", detached=True)
    snap = {s["instance_id"]: s for s in h.m.snapshot()}
    assert set(snap["a"]) == {"instance_id", "class", "state", "worker", "owner", "name",
                              "namespace", "detached", "restarts", "resources", "reason",
                              "created_at"}
    assert snap["a"]["name"] == "actor" and snap["a"]["namespace"] == "ns"
    assert snap["b"]["detached"] is True and snap["b"]["state"] == P.PENDING
    assert snap["a"]["worker"] == W1 and snap["a"]["owner"] == JOB


def test_story_tells_what_happened_to_an_instance(h):
    h.running("a", recover=1)
    h(L.WorkerLost, W1, 0.0)
    kinds = [what[0] for _, what in h.m.story_of("a")]
    assert kinds[:4] == ["created", "acquire", "placed", P.ALIVE]
    assert P.RESTARTING in kinds and kinds[-1] == "acquire"


def test_shorthands_used_by_the_dashboard_tests(h):
    rec = h.m.add(spec("a"))
    h.m.placed("a", W1)
    assert h.m.set_state("a", P.ALIVE) is rec and rec.state == P.ALIVE
    assert ids(h.m.end("a", "terminated")) == ["a"]
    h.m.forget("a")
    assert "a" not in h.m.instances


# --------------------------------------------------------------------------- random


@pytest.mark.parametrize("seed", range(40))
def test_random_events_keep_the_invariants(seed):
    """Random creations, placements, reports, kills, losses and reference traffic."""
    rng = random.Random(seed)
    h = Harness()
    workers = [W1, W2, W3]
    holders = [DRIVER, W1, W2, "tcp://driver2:1"]
    owners = [JOB, "job-2"]
    now = 0.0
    n = 0
    acquiring: set[str] = set()
    stopping: set[str] = set()
    started_once: dict[str, int] = {}
    for _ in range(500):
        now += rng.random() * 0.2
        r = rng.random()
        known = sorted(h.m.instances)
        if r < 0.18:
            n += 1
            iid = f"i{n}"
            owner = rng.choice(owners + known) if known else JOB
            out = h(L.Create, spec(iid, owner=owner, name=rng.choice(["", "", "x", "y"]),
                                   detached=rng.random() < 0.15,
                                   holder=rng.choice(holders), recover=rng.choice([0, 1, 2, -1])),
                    now)
        elif r < 0.33 and acquiring:
            iid = rng.choice(sorted(acquiring))
            if rng.random() < 0.85:
                out = h(L.Placed, iid, rng.choice(workers))
            else:
                out = h(L.PlacementFailed, iid, "no room")
        elif r < 0.43 and known:
            iid = rng.choice(known)
            rec = h.m.instances[iid]
            out = h(L.InstanceStarted, iid, rec.worker if rng.random() < 0.9 else W3)
        elif r < 0.48 and known:
            out = h(L.Kill, rng.choice(known))
        elif r < 0.52:
            out = h(L.WorkerLost, rng.choice(workers), now)
        elif r < 0.55:
            out = h(L.OwnerGone, rng.choice(owners), "gone")
        elif r < 0.75 and known:
            iid = rng.choice(known)
            holder = rng.choice(holders)
            token = f"t{rng.randrange(6)}"
            kind = rng.random()
            if kind < 0.4:
                out = h(L.HandleRefs, holder, {iid: rng.choice([1, -1])}, [], [], now)
            elif kind < 0.7:
                out = h(L.HandleRefs, holder, {}, [(iid, token)], [], now)
            else:
                out = h(L.HandleRefs, holder, {}, [], [(iid, token)], now)
        elif r < 0.8:
            out = h(L.HolderLost, rng.choice(holders), now)
        elif r < 0.9:
            out = h(L.ReleaseCheck, now)
        elif r < 0.95 and stopping:
            out = h(L.Stopped, stopping.pop())
        elif known:
            out = h(L.SaveState, rng.choice(known), b"s")
        else:
            continue
        for ins in out:
            t = type(ins)
            if t is L.AcquireResources:
                assert ins.instance_id not in acquiring, "two acquires at once"
                acquiring.add(ins.instance_id)
            elif t in (L.CancelAcquire,):
                acquiring.discard(ins.instance_id)
            elif t is L.StopInstance:
                stopping.add(ins.instance_id)
            elif t is L.StartInstance:
                started_once[ins.instance_id] = started_once.get(ins.instance_id, -1) + 1
                assert ins.incarnation == h.m.instances[ins.instance_id].restarts
        for iid in list(acquiring):  # answered (placed or failed) or ended
            rec = h.m.instances.get(iid)
            if rec is None or not rec.acquiring:
                acquiring.discard(iid)
    for iid, rec in h.m.instances.items():  # no instance silently stuck
        assert rec.acquiring or rec.worker is not None or rec.state == P.DEAD, iid


# --------------------------------------------------------------------------- tombstones


def test_ended_instances_leave_tombstones_with_class_owner_job_worker_why_and_when(h):
    h.running("p", worker=W1, name="parent", now=1.0)
    h(L.Create, spec("c", owner="p"), 2.0)  # a child: its job is the parent's
    h(L.Placed, "c", W2)
    h.m.now = 7.0  # the adapter stamps its clock before each event
    out = h(L.Kill, "p", "terminated")
    assert {i.instance_id for i in of(out, L.StopInstance)} == {"p", "c"}
    assert h.m.ended_rows() == []  # DEAD until the stops are confirmed
    h.m.now = 8.0
    h(L.Stopped, "c")
    h(L.Stopped, "p")
    rows = h.m.ended_rows()
    assert [r["instance_id"] for r in rows] == ["p", "c"]  # newest first
    parent, child = rows
    assert parent == {"instance_id": "p", "class": "C", "name": "parent", "namespace": "",
                      "owner": JOB, "job": JOB, "worker": W1, "reason": "terminated",
                      "created_at": 1.0, "ended_at": 7.0, "restarts": 0, "detached": False}
    assert (child["owner"], child["job"], child["worker"]) == ("p", JOB, W2)
    assert "its owner p ended (terminated)" in child["reason"] and child["ended_at"] == 7.0
    assert h.m.ended_rows(limit=1) == [parent]


def test_tombstones_are_bounded_newest_kept():
    h = Harness()
    h.m = L.Lifecycle(ended_kept=3)
    for i in range(5):
        h.create(f"i{i}")
        h(L.PlacementFailed, f"i{i}", "no room")  # never placed: forgotten at once
    assert [r["instance_id"] for r in h.m.ended_rows()] == ["i4", "i3", "i2"]
    assert all(r["reason"] == "no room" and r["worker"] == "" for r in h.m.ended_rows())
    none = L.Lifecycle(ended_kept=0)
    none.add(spec("x"))
    none.handle(L.PlacementFailed("s", "x", "no room"))
    assert none.ended_rows() == [] and none.graveyard["x"] == "no room"


# --------------------------------------------------------------------------- a locate before the creation


def test_a_locate_that_overtakes_the_creation_waits_for_it(h):
    """LOCATE_INSTANCE (its own rpc) can reach the scheduler before the creator's
    CREATE_INSTANCE: the id is unknown, not ended; the locate waits for the creation."""
    assert h.m.unknown("a")
    out = h(L.AwaitCreation, "a", 1.0)
    assert [w.at for w in of(out, L.WakeAt)] == [1.0 + L.CREATION_WAIT_S]
    assert not of(out, L.AnswerWaiters)
    out = h.create("a", now=2.0)
    assert [(a.instance_id, a.stage, a.reason) for a in of(out, L.AnswerWaiters)] == [
        ("a", L.CREATED, "")]
    assert not h.m.awaited and not h.m.unknown("a")
    assert h.m.answer("a", L.PLACED) is None  # then it waits for the placement as usual


def test_a_locate_for_an_id_never_created_gives_up_after_the_bound(h):
    h(L.AwaitCreation, "ghost", 1.0)
    h(L.AwaitCreation, "ghost", 5.0)  # a second locate: same deadline
    assert not of(h(L.ReleaseCheck, 1.0 + L.CREATION_WAIT_S - 0.1), L.AnswerWaiters)
    out = h(L.ReleaseCheck, 1.0 + L.CREATION_WAIT_S)
    [ans] = of(out, L.AnswerWaiters)
    assert (ans.instance_id, ans.stage, ans.worker) == ("ghost", L.CREATED, None)
    assert "does not exist" in ans.reason and not h.m.awaited


def test_a_locate_for_a_known_or_ended_id_does_not_wait(h):
    h.running("a")
    out = h(L.AwaitCreation, "a", 1.0)
    assert [(a.stage, a.reason) for a in of(out, L.AnswerWaiters)] == [(L.CREATED, "")]
    h(L.Kill, "a", "terminated")
    h(L.Stopped, "a")
    assert not h.m.unknown("a")  # the graveyard knows why it ended
    out = h(L.AwaitCreation, "a", 2.0)
    assert of(out, L.AnswerWaiters) and not h.m.awaited


# --------------------------------------------------------------------------- scale-down moves


def test_a_move_places_it_anew_from_its_current_state_without_a_restart(h):
    """Scale-down drained ``a`` on W1 (retiring with W2): it stays ALIVE, its resources
    there go back before it asks for new ones (never on a retiring worker), it starts on
    the new home from the state taken at the move, and its restart budget is untouched."""
    rec = h.running("a", recover=0)
    h(L.SaveState, "a", b"old")
    out = h(L.Move, "a", W1, b"now", (W1, W2))
    assert (rec.state, rec.worker, rec.moving_from, rec.checkpoint) == (P.ALIVE, None, W1,
                                                                         b"now")
    assert of(out, L.ReleaseResources) == [L.ReleaseResources(f"s{h.n}", "a")]
    assert of(out, L.AcquireResources)[0].avoid == (W1, W2)
    assert out.index(of(out, L.ReleaseResources)[0]) < out.index(of(out, L.AcquireResources)[0])
    assert h.m.answer("a", L.PLACED) is None  # a locate meanwhile waits for the new home
    out = h(L.Placed, "a", W3)
    assert of(out, L.StartInstance) == [L.StartInstance(f"s{h.n}", W3, "a", rec.spec, 0,
                                                        b"now")]
    assert of(out, L.AnswerWaiters)[0].worker == W3
    assert (rec.worker, rec.moving_from, rec.restarts) == (W3, None, 0)
    h(L.WorkerLost, W1, 0.0)  # the old worker retires: nothing of "a" is there any more
    assert rec.state == P.ALIVE and rec.worker == W3


def test_a_move_nobody_can_take_ends_it_and_stops_its_held_copy(h):
    h.running("a")
    h(L.Move, "a", W1, b"now", (W1,))
    out = h(L.PlacementFailed, "a", "no worker has 0.5 CPU free")
    assert of(out, L.StopInstance) == [L.StopInstance(f"s{h.n}", W1, "a", h.rec("a").reason)]
    assert f"its worker {W1} retired" in h.rec("a").reason
    assert "no other worker could take it" in h.rec("a").reason


def test_a_kill_during_a_move_cancels_it_and_stops_the_held_copy(h):
    h.running("a")
    h(L.Move, "a", W1, b"now", (W1,))
    out = h(L.Kill, "a", "terminated")
    assert of(out, L.CancelAcquire) and of(out, L.StopInstance)[0].worker == W1


def test_a_move_of_what_is_not_alive_there_is_ignored(h):
    h.create("p")  # still pending
    assert h(L.Move, "p", W1, b"s") == []
    rec = h.running("a")
    assert h(L.Move, "a", W2, b"s") == []  # not on W2
    h(L.Move, "a", W1, b"s")
    assert h(L.Move, "a", W1, b"s") == []  # moving already
    assert rec.moving_from == W1


# --------------------------------------------------------------------------- crash on request


def test_a_crash_on_request_kills_its_process_and_the_death_restarts_it(h):
    """Ray's ``ray.kill(actor, no_restart=False)``: the lifecycle only has the process killed
    (``CrashInstance``, with the incarnation it runs); the death the worker then reports is
    an ordinary ``ProcessDied``: charged to the budget, restarted in place, its children end."""
    rec = h.running("a", recover=1)
    h.running("kid", owner="a")
    out = h(L.Crash, "a", "killed with ray.kill(no_restart=False)")
    assert out == [L.CrashInstance(f"s{h.n}", W1, "a",
                                   "killed with ray.kill(no_restart=False)", 0)]
    assert (rec.state, rec.restarts) == (P.ALIVE, 0)  # nothing charged before the death
    out = h(L.ProcessDied, "a", W1, "killed with ray.kill(no_restart=False)", 0)
    assert (rec.state, rec.worker, rec.restarts) == (P.RESTARTING, W1, 1)
    assert of(out, L.StartInstance)[0].incarnation == 1
    assert h.rec("kid").state == P.DEAD
    assert h(L.Crash, "a") == []  # restarting: nothing runs to kill
    h(L.InstanceStarted, "a", W1)
    out = h(L.Crash, "a")
    assert of(out, L.CrashInstance)[0].incarnation == 1
    out = h(L.ProcessDied, "a", W1, "killed with ray.kill(no_restart=False)", 1)
    assert rec.state == P.DEAD and "used all its 1 restarts" in rec.reason
    assert of(out, L.StopInstance)
    kinds = [what[0] for _, what in h.m.story_of("a")]
    assert kinds.count("crash") == 2 and "crash-ignored" in kinds


def test_a_crash_on_request_of_an_instance_not_running_is_ignored(h):
    h.create("p")  # pending: no process yet
    assert h(L.Crash, "p") == [] and h.rec("p").state == P.PENDING
    assert h(L.Crash, "never-seen") == []
    h.running("n", name="named")
    h.create("alias", name="named")  # binds "n"
    out = h(L.Crash, "alias")  # an alias reaches the instance it names
    assert of(out, L.CrashInstance)[0].instance_id == "n"
    h(L.ProcessDied, "n", W1, "killed", 0)  # no restarts configured: it ends
    assert h.rec("n").state == P.DEAD


def test_an_alive_from_a_process_restarted_since_is_ignored(h):
    """The agent may hear of its process's exit before its read of the ``__init__`` reply
    fails; that failed read's report (ALIVE, ``__init__`` failed) comes after the death and
    must not mark the restarting instance as running with the read's error."""
    h.running("a", recover=1)
    h(L.ProcessDied, "a", W1, "its isolated process (pid 7) exited with code 5", 0)
    rec = h.rec("a")
    assert (rec.state, rec.restarts) == (P.RESTARTING, 1)
    assert h(L.InstanceStarted, "a", W1, True, "", 0) == []  # restart 0's: stale
    assert rec.state == P.RESTARTING
    out = h(L.InstanceStarted, "a", W1, False, "tcp://proc:2", 1)  # restart 1's: it serves
    assert rec.state == P.ALIVE and rec.endpoint == "tcp://proc:2" and out
