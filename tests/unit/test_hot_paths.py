"""The hot paths' shortcuts give what the general paths give (no cluster)."""

from __future__ import annotations

import pytest

from yrdask.runtime import context
from yrdask.serialization import pack_args, pack_plain_args, unpack_args
from yrdask.worker.execution import Execution


def _no_ref(value: object) -> bool:
    return False


@pytest.mark.parametrize("args,kwargs", [
    ((), {}), ((1, "a", b"b", 2.5, None, True), {}), ((1,), {"k": "v", "n": 3}), ((), {"k": 1}),
])
def test_plain_arguments_pack_as_pack_args_does(args, kwargs):
    blob = pack_plain_args(args, kwargs)
    assert blob is not None
    general, refs = pack_args(args, kwargs, _no_ref)
    assert refs == []
    assert unpack_args(blob, []) == unpack_args(general, []) if general else blob == general


@pytest.mark.parametrize("args,kwargs", [(([1],), {}), ((1,), {"k": {"a": 1}}), ((object(),), {})])
def test_arguments_that_may_hold_a_ref_take_the_general_path(args, kwargs):
    assert pack_plain_args(args, kwargs) is None


def test_an_armed_execution_runs_in_its_task_context_until_disarmed():
    with context.task_context("outer-lease", "outer-owner"):
        ex = Execution("t1", None, {})
        assert ex.arm("lease-1", "job-1")
        assert (context.current_lease(), context.current_owner()) == ("lease-1", "job-1")
        ex.disarm()
        assert (context.current_lease(), context.current_owner()) == ("outer-lease",
                                                                      "outer-owner")
        ex.disarm()  # idempotent: the context stays the outer one
        assert context.current_lease() == "outer-lease"
    bare = Execution("t2", None, {})
    assert bare.arm()  # no lease: the context is left alone
    assert context.current_lease() is None
    bare.disarm()


def test_a_cancelled_execution_never_arms_nor_sets_its_context():
    ex = Execution("t3", None, {})
    ex.cancel()
    assert not ex.arm("lease-3", "job-3")
    assert context.current_lease() is None


def test_a_flat_story_entry_reads_like_a_logged_one_and_is_not_tracked():
    import gc

    from yrdask.statemachine import Story

    flat, logged = Story(10), Story(10)
    flat.entries.append(("s1", "PushTask", "t1", "L1"))
    logged.log("s1", ("PushTask", "t1", "L1"), ("t1", "L1"))
    for key in ("t1", "L1"):
        assert flat.about(key) == logged.about(key) == [("s1", ("PushTask", "t1", "L1"))]
    assert flat.about("PushTask") == [] and flat.dump() == logged.dump()
    gc.collect()
    assert not gc.is_tracked(flat.entries[0])  # kept by the story, never walked by the GC


def test_the_submit_queue_story_keeps_no_event_of_a_plain_task():
    import gc

    from yrdask.runtime import submit_queue as M

    m = M.SubmitQueue(None)
    m.handle(M.TaskQueued("submit", "t1", "k", {"CPU": 1}, 1000, 1, (), 0, None, "f"))
    m.handle(M.LeaseGranted("grant", "r1", "L1", "w1", 0.0))
    m.handle(M.TaskFinished("done", "t1", "ok", 0.001, None, 1.0))
    gc.collect()
    hot = [e for e in m.log.entries if type(e) is tuple and type(e[1]) is str]
    assert [e[1] for e in hot] == ["TaskQueued", "PushTask", "TaskFinished ok", "TaskSucceeded"]
    assert not any(gc.is_tracked(e) for e in hot)
    assert [w[0] for _s, w in m.story("t1")] == [
        "TaskQueued", "PushTask", "TaskFinished ok", "TaskSucceeded"]
