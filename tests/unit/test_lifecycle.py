"""Unit tests of yrdask.scheduler.lifecycle.Lifecycle: the rules of SPEC §4, without a cluster.

The owner tree and its end order, detached children, the named registry, handle reference
counting with tokens of pickled handles (transit / arrived in either order), lost holders,
``releasable``, ``end_owner`` (a job went away) and ``on_worker_lost``.
"""

from __future__ import annotations

import pytest

from yrdask import protocol as P
from yrdask.scheduler.lifecycle import Lifecycle

pytestmark = pytest.mark.timeout(30)

JOB = "job-1"
DRIVER = "tcp://driver:1"  # the holder address of the job's driver
W1, W2 = "tcp://w1:1", "tcp://w2:1"


def spec(iid, owner=JOB, name="", namespace="", detached=False, holder=DRIVER, recover=0):
    return {"instance_id": iid, "owner": owner, "name": name, "namespace": namespace,
            "detached": detached, "holder": holder, "cls_name": "C",
            "shape": {"CPU": 500.0, "Memory": 500.0}, "recover_retry_times": recover}


def ids(records):
    return [r.instance_id for r in records]


@pytest.fixture
def lc():
    return Lifecycle()


# --------------------------------------------------------------------------- creation and owner tree


def test_add_records_owner_holder_and_pending_state(lc):
    rec = lc.add(spec("a"))
    assert rec.state == P.PENDING
    assert rec.owner == JOB
    assert rec.holders == {DRIVER}
    assert rec.refcounted and not rec.detached and rec.name_key is None
    assert lc.children[JOB] == {"a"}
    lc.placed("a", W1)
    assert lc.instances["a"].worker == W1
    assert lc.set_state("a", P.ALIVE) is rec and rec.state == P.ALIVE


def test_add_without_holder_has_no_holders(lc):
    rec = lc.add(spec("a", holder=None))
    assert rec.holders == set()


def test_end_returns_the_tree_deepest_first(lc):
    # job -> a -> (b -> (c, d), e)
    lc.add(spec("a"))
    lc.add(spec("b", owner="a"))
    lc.add(spec("e", owner="a"))
    lc.add(spec("c", owner="b"))
    lc.add(spec("d", owner="b"))
    ended = ids(lc.end("a", "terminated"))
    assert sorted(ended) == ["a", "b", "c", "d", "e"]
    assert ended[-1] == "a"
    # every instance comes after all of its descendants
    assert ended.index("c") < ended.index("b") and ended.index("d") < ended.index("b")
    assert ended.index("b") < ended.index("a") and ended.index("e") < ended.index("a")
    for iid in ended:
        assert lc.instances[iid].state == P.DEAD
    assert lc.instances["a"].reason == "terminated"
    # descendants say why they ended: their owner ended
    assert "a" in lc.instances["b"].reason and "terminated" in lc.instances["b"].reason
    assert "b" in lc.instances["c"].reason
    assert "a" not in lc.children and "b" not in lc.children
    assert "a" not in lc.children.get(JOB, set())


def test_end_of_a_leaf_leaves_its_owner_alone(lc):
    lc.add(spec("a"))
    lc.add(spec("b", owner="a"))
    assert ids(lc.end("b", "terminated")) == ["b"]
    assert lc.instances["a"].state != P.DEAD
    assert lc.children["a"] == set()


def test_end_twice_and_end_unknown_are_noops(lc):
    lc.add(spec("a"))
    assert ids(lc.end("a", "terminated")) == ["a"]
    assert lc.end("a", "again") == []
    assert lc.instances["a"].reason == "terminated"
    assert lc.end("nope", "terminated") == []


def test_detached_child_survives_its_owner(lc):
    lc.add(spec("sup"))
    lc.add(spec("w1", owner="sup"))
    lc.add(spec("det", owner="sup", detached=True))
    lc.add(spec("det-child", owner="det"))  # a child of a detached parent follows its parent
    ended = ids(lc.end("sup", "terminated"))
    assert sorted(ended) == ["sup", "w1"]
    assert lc.instances["det"].state != P.DEAD
    assert lc.instances["det-child"].state != P.DEAD
    # the detached one still ends its own tree when it is terminated
    assert sorted(ids(lc.end("det", "terminated"))) == ["det", "det-child"]


def test_set_state_on_dead_or_unknown_is_ignored(lc):
    lc.add(spec("a"))
    lc.end("a", "terminated")
    assert lc.set_state("a", P.ALIVE) is None
    assert lc.instances["a"].state == P.DEAD
    assert lc.set_state("unknown", P.ALIVE) is None


def test_forget_drops_only_dead_records(lc):
    lc.add(spec("a"))
    lc.add(spec("b"))
    lc.forget("a")  # alive: kept
    assert "a" in lc.instances
    lc.end("b", "terminated")
    lc.forget("b")
    assert "b" not in lc.instances
    lc.forget("never-existed")  # no error


# --------------------------------------------------------------------------- named registry


def test_named_registry_and_namespaces(lc):
    a = lc.add(spec("a", name="actor"))
    b = lc.add(spec("b", name="actor", namespace="ns1"))
    assert a.name_key == ("", "actor") and b.name_key == ("ns1", "actor")
    assert lc.named("", "actor") is a
    assert lc.named("ns1", "actor") is b
    assert lc.named("ns2", "actor") is None
    assert lc.named("", "other") is None
    assert not a.refcounted and not b.refcounted


def test_name_is_free_again_after_the_instance_ends(lc):
    lc.add(spec("a", name="actor"))
    lc.end("a", "terminated")
    assert lc.named("", "actor") is None
    assert ("", "actor") not in lc.names
    c = lc.add(spec("c", name="actor"))
    assert lc.named("", "actor") is c


def test_ending_an_old_record_does_not_drop_a_newer_name_owner(lc):
    lc.add(spec("a", name="actor"))
    lc.instances["a"].state = P.DEAD  # dead but not yet through end()
    c = lc.add(spec("c", name="actor"))
    lc.instances["a"].state = P.ALIVE
    lc.end("a", "terminated")
    assert lc.named("", "actor") is c


def test_snapshot_lists_names_and_fields(lc):
    lc.add(spec("a", name="actor", namespace="ns"))
    lc.add(spec("b", detached=True))
    lc.placed("b", W2)
    snap = {s["instance_id"]: s for s in lc.snapshot()}
    assert snap["a"]["name"] == "actor" and snap["a"]["namespace"] == "ns"
    assert snap["b"]["name"] == "" and snap["b"]["detached"] is True
    assert snap["b"]["worker"] == W2 and snap["b"]["owner"] == JOB
    assert snap["a"]["state"] == P.PENDING
    for key in ("class", "restarts", "resources", "reason", "created_at"):
        assert key in snap["a"]


# --------------------------------------------------------------------------- handle reference counting


def test_releasable_rules(lc):
    lc.add(spec("held"))
    lc.add(spec("free", holder=None))
    lc.add(spec("named", name="n", holder=None))
    lc.add(spec("det", detached=True, holder=None))
    lc.add(spec("dead", holder=None))
    lc.end("dead", "terminated")
    assert not lc.releasable("held")
    assert lc.releasable("free")
    assert not lc.releasable("named")  # named instances are not refcounted
    assert not lc.releasable("det")  # nor detached ones
    assert not lc.releasable("dead")
    assert not lc.releasable("unknown")


def test_last_holder_dropping_makes_it_releasable(lc):
    lc.add(spec("a"))
    assert lc.handle_refs(W1, {"a": +1}, [], []) == []
    assert lc.instances["a"].holders == {DRIVER, W1}
    touched = lc.handle_refs(DRIVER, {"a": -1}, [], [])
    assert touched == ["a"]
    assert not lc.releasable("a")  # W1 still holds it
    assert lc.handle_refs(W1, {"a": -1}, [], []) == ["a"]
    assert lc.releasable("a")


def test_handle_refs_for_unknown_instances_are_ignored(lc):
    assert lc.handle_refs(W1, {"ghost": +1, "ghost2": -1}, [], []) == []


def test_handle_in_transit_keeps_it_alive_transit_first(lc):
    lc.add(spec("a"))
    # the driver pickles the handle (token t1) and then drops its own
    lc.handle_refs(DRIVER, {}, [["a", "t1"]], [])
    assert lc.handle_refs(DRIVER, {"a": -1}, [], []) == ["a"]
    assert lc.instances["a"].transit == {"t1"}
    assert not lc.releasable("a")  # the pickled handle is on its way
    # the receiver unpickles it: it holds it now, the token is settled
    touched = lc.handle_refs(W1, {"a": +1}, [], [["a", "t1"]])
    assert "a" in touched
    assert lc.instances["a"].transit == set()
    assert not lc.releasable("a")
    lc.handle_refs(W1, {"a": -1}, [], [])
    assert lc.releasable("a")
    assert lc.released_tokens == set()


def test_handle_in_transit_arrived_reported_before_transit(lc):
    lc.add(spec("a"))
    # the receiver's report overtakes the sender's
    lc.handle_refs(W1, {"a": +1}, [], [["a", "t1"]])
    assert lc.released_tokens == {"t1"}
    assert lc.instances["a"].transit == set()
    lc.handle_refs(DRIVER, {"a": -1}, [["a", "t1"]], [])
    # the late transit report must not leave a stale token that would keep it alive forever
    assert lc.instances["a"].transit == set()
    assert lc.released_tokens == set()
    assert not lc.releasable("a")  # W1 holds it
    lc.handle_refs(W1, {"a": -1}, [], [])
    assert lc.releasable("a")


def test_receiver_dropping_at_once_after_arrival_still_releases(lc):
    lc.add(spec("a"))
    lc.handle_refs(DRIVER, {"a": -1}, [["a", "t1"]], [])
    assert not lc.releasable("a")
    # W1 unpickled and dropped the handle within one report batch (+1 and -1 cancel out)
    touched = lc.handle_refs(W1, {}, [], [["a", "t1"]])
    assert touched == ["a"]
    assert lc.releasable("a")


def test_several_tokens_in_transit(lc):
    lc.add(spec("a"))
    lc.handle_refs(DRIVER, {"a": -1}, [["a", "t1"], ["a", "t2"]], [])
    lc.handle_refs(W1, {}, [], [["a", "t1"]])
    assert not lc.releasable("a")  # t2 is still travelling
    lc.handle_refs(W2, {}, [], [["a", "t2"]])
    assert lc.releasable("a")


def test_holder_lost_drops_it_everywhere(lc):
    lc.add(spec("a", holder=W1))
    lc.add(spec("b", holder=W1))
    lc.add(spec("c", holder=W2))
    lc.handle_refs(W2, {"a": +1}, [], [])
    touched = lc.holder_lost(W1)
    assert sorted(touched) == ["a", "b"]
    assert lc.instances["a"].holders == {W2}
    assert not lc.releasable("a")
    assert lc.releasable("b")
    assert not lc.releasable("c")
    assert lc.holder_lost("tcp://nobody:1") == []


# --------------------------------------------------------------------------- owners and workers going away


def test_end_owner_ends_the_jobs_non_detached_trees(lc):
    lc.add(spec("a"))
    lc.add(spec("a1", owner="a"))
    lc.add(spec("n", name="named"))
    lc.add(spec("det", detached=True))
    lc.add(spec("det-child", owner="det"))
    lc.add(spec("other", owner="job-2"))
    ended = ids(lc.end_owner(JOB, "its job ended"))
    assert sorted(ended) == ["a", "a1", "n"]
    assert ended.index("a1") < ended.index("a")
    assert lc.instances["det"].state != P.DEAD
    assert lc.instances["det-child"].state != P.DEAD
    assert lc.instances["other"].state != P.DEAD
    assert lc.instances["a"].reason == "its job ended"
    assert lc.named("", "named") is None
    # the detached one is still listed under the job (it keeps its owner), the rest is gone
    assert lc.children[JOB] == {"det"}


def test_end_owner_with_nothing_left_drops_the_owner(lc):
    lc.add(spec("a"))
    lc.end_owner(JOB, "gone")
    assert JOB not in lc.children
    assert lc.end_owner("job-unknown", "gone") == []


def test_on_worker_lost_ends_its_instances_and_their_descendants(lc):
    lc.add(spec("a"))
    lc.add(spec("b"))
    lc.add(spec("a-child", owner="a"))
    lc.add(spec("a-det", owner="a", detached=True))
    lc.placed("a", W1)
    lc.placed("b", W2)
    lc.placed("a-child", W2)  # a descendant elsewhere ends too
    lc.placed("a-det", W2)
    restarting, ended = lc.on_worker_lost(W1)
    assert restarting == []
    assert sorted(ids(ended)) == ["a", "a-child"]
    assert W1 in lc.instances["a"].reason
    assert lc.instances["b"].state != P.DEAD
    assert lc.instances["a-det"].state != P.DEAD
    assert lc.on_worker_lost(W1) == ([], [])  # already dead


def test_pending_instance_without_worker_is_not_lost_with_a_worker(lc):
    lc.add(spec("a"))  # not placed yet
    assert lc.on_worker_lost(W1) == ([], [])
    assert lc.instances["a"].state == P.PENDING


# --------------------------------------------------------------------------- restarts


def test_lost_instance_with_restarts_left_restarts_and_its_children_end(lc):
    lc.add(spec("a", recover=2))
    lc.add(spec("a-child", owner="a", recover=5))  # elsewhere: ends, never restarts
    lc.add(spec("a-det", owner="a", detached=True))
    lc.placed("a", W1)
    lc.placed("a-child", W2)
    lc.placed("a-det", W2)
    restarting, ended = lc.on_worker_lost(W1)
    assert ids(restarting) == ["a"]
    rec = lc.instances["a"]
    assert (rec.state, rec.worker, rec.restarts) == (P.RESTARTING, None, 1)
    assert W1 in rec.reason
    assert ids(ended) == ["a-child"]
    assert "restarted" in lc.instances["a-child"].reason
    assert lc.instances["a-det"].state != P.DEAD
    # placed again and lost again: the second restart is the last one
    lc.placed("a", W2)
    assert ids(lc.on_worker_lost(W2)[0]) == ["a"] and rec.restarts == 2
    lc.placed("a", W1)
    restarting, ended = lc.on_worker_lost(W1)
    assert restarting == [] and ids(ended) == ["a"]
    assert rec.state == P.DEAD and "all its 2 restarts" in rec.reason


def test_unlimited_restarts_never_run_out(lc):
    rec = lc.add(spec("a", recover=-1))
    for i in range(1, 50):
        lc.placed("a", W1)
        assert ids(lc.on_worker_lost(W1)[0]) == ["a"]
        assert rec.restarts == i


def test_no_restarts_configured_means_the_instance_ends(lc):
    lc.add(spec("a", recover=0))
    lc.placed("a", W1)
    restarting, ended = lc.on_worker_lost(W1)
    assert restarting == [] and ids(ended) == ["a"]
    assert "restarts" not in lc.instances["a"].reason


def test_child_on_the_same_worker_is_not_restarted_when_its_owner_restarts(lc):
    lc.add(spec("a", recover=1))
    lc.add(spec("c", owner="a", recover=1))
    lc.placed("c", W1)  # processed first or second, it must end either way
    lc.placed("a", W1)
    restarting, ended = lc.on_worker_lost(W1)
    assert ids(restarting) == ["a"]
    assert lc.instances["c"].state == P.DEAD


def test_terminate_of_a_restarting_instance_ends_it(lc):
    lc.add(spec("a", recover=-1))
    lc.placed("a", W1)
    lc.on_worker_lost(W1)
    assert ids(lc.end("a", "terminated")) == ["a"]
    assert lc.instances["a"].state == P.DEAD
