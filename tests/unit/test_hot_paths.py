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


def _queue_with_leases(n_leases: int, **kw):
    from yrdask.runtime import submit_queue as M

    m = M.SubmitQueue(None, **kw)
    for i in range(n_leases * 4 + 1):
        m.handle(M.TaskQueued("s", f"t{i}", "k", {"CPU": 1}, 1000, 1, (), 0, None, "f"))
    for i in range(n_leases):
        m.handle(M.LeaseGranted("g", f"r{i + 1}", f"L{i + 1}", f"w{i % 2}", 0.0))
    return m


def _pushes(out: list) -> list:
    from yrdask.runtime import submit_queue as M

    return [(i.task_id, i.lease_id) for i in out if type(i) is M.PushTask]


def test_one_task_at_a_time_stays_on_the_lease_that_freed_last():
    from yrdask.runtime import submit_queue as M

    m = _queue_with_leases(2)  # t0 on L1, t1 on L2, the rest wait (no pipelining yet)
    for i in range(2, 9):
        m.handle(M.CancelRequested("c", f"t{i}"))
    m.handle(M.TaskFinished("d", "t1", "ok", 1.0, None, 1.0))  # L2 frees
    m.handle(M.TaskFinished("d", "t0", "ok", 1.0, None, 1.0))  # then L1
    for n in range(3):  # sequential tasks: each goes to L1, the lease freed last
        out = m.handle(M.TaskQueued("s", f"u{n}", "k", {"CPU": 1}, 1000, 1, (), 0, None, "f"))
        assert _pushes(out) == [(f"u{n}", "L1")]
        m.validate()
        m.handle(M.TaskFinished("d", f"u{n}", "ok", 1.0, None, 2.0))
        m.validate()


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("depth,refill", [(4, 1), (4, 2), (8, 4)])
def test_the_refill_shortcut_does_what_the_general_dispatch_does(seed, depth, refill):
    """The same random events into a queue with the refill shortcut and one without: the
    same instructions, and both valid after every event (pipeline_depth, pipeline_refill;
    (8, 4) the runtime's)."""
    import random

    from yrdask.runtime import submit_queue as M

    rnd = random.Random(seed)
    fast = M.SubmitQueue(None, pipeline_depth=depth, pipeline_refill=refill)
    general = M.SubmitQueue(None, pipeline_depth=depth, pipeline_refill=refill)
    general.refill_shortcut = False
    n = leases = 0
    for step in range(300):
        pushed = [t for t in fast.tasks.values() if t.state == M.PUSHED]
        roll = rnd.random()
        if roll < 0.45:
            n += 1
            ev = M.TaskQueued("s", f"t{n}", "k", {"CPU": 1}, 1000, rnd.choice([1, 1, 2]) if
                              n == 1 else fast.queues["k"].slots, (), 0, None, "f")
        elif roll < 0.85 and pushed:
            task = rnd.choice(pushed)
            ev = M.TaskFinished("d", task.task_id, rnd.choice(["ok"] * 8 + ["error"]),
                                rnd.choice([0.0001, 0.001, 0.5]), None, step)
        elif fast.requests and leases < 4:
            leases += 1
            ev = M.LeaseGranted("g", next(iter(fast.requests)), f"L{leases}", f"w{leases % 2}",
                                step)
        elif fast.leases and roll > 0.97:
            ev = M.LeasesRevoked("r", (rnd.choice(list(fast.leases)),))
        else:
            ev = M.Tick("t", step)
        assert fast.handle(ev) == general.handle(ev), (seed, step, ev)
        fast.validate()
        general.validate()

def _gate_state(gate) -> tuple:
    return ({lid: (lease.slots, sorted(lease.running), lease.blocked, list(lease.waiting))
             for lid, lease in gate.leases.items()}, dict(gate.lease_of), gate.next_wake,
            list(gate.story.entries))


@pytest.mark.parametrize("seed", range(20))
def test_the_task_sides_direct_gate_calls_do_what_handle_does(seed):
    """``arrived``/``ended``/``lent`` (what TaskSide calls, no event object) against
    ``handle(TaskArrived/TaskEnded/SlotLent)``: the same instructions and the same state."""
    import random

    from yrdask.worker import lease_gate as G

    rng = random.Random(seed)
    by_event, direct = G.LeaseGate(0.05), G.LeaseGate(0.05)
    now, started = 0.0, []
    for step in range(200):
        now += rng.choice([0.0, 0.01, 0.06])
        lease = rng.choice(["L1", "L2"])
        r = rng.random()
        if r < 0.4:
            tid = f"t{step}" if rng.random() < 0.9 else rng.choice(started or ["t0"])
            slots = rng.choice([1, 2])
            a = by_event.handle(G.TaskArrived("s", tid, lease, slots, now))
            b = direct.arrived("s", tid, lease, slots, now)
        elif r < 0.7:
            tid = rng.choice(started) if started and rng.random() < 0.9 else "nope"
            a = by_event.handle(G.TaskEnded("s", tid))
            b = direct.ended("s", tid)
        elif r < 0.9:
            blocked = rng.random() < 0.5
            a = by_event.handle(G.SlotLent("s", lease, blocked))
            b = direct.lent("s", lease, blocked)
        else:
            a = by_event.handle(G.Tick("s", now))
            b = direct.handle(G.Tick("s", now))
        assert a == b, (seed, step)
        started += [i.task_id for i in a if type(i) is G.StartTask]
        assert _gate_state(by_event) == _gate_state(direct), (seed, step)
        direct.validate()


@pytest.mark.parametrize("seed", range(20))
def test_the_task_sides_direct_lending_calls_do_what_handle_does(seed):
    """``LendNotices.blocked`` (the hot path) against ``handle(Blocked(...))``."""
    import random

    from yrdask.worker import lending as L

    def state(m):
        return ({h: (x.threads, x.since, x.told) for h, x in m.holds.items()}, m.asking,
                m.next_wake, list(m.story.entries))

    rng = random.Random(seed)
    by_event, direct = L.LendNotices(0.002), L.LendNotices(0.002)
    now = 0.0
    for step in range(200):
        now += rng.choice([0.0, 0.001, 0.003])
        hid, blocked = rng.choice(["L1", "I1"]), rng.random() < 0.5
        r = rng.random()
        if r < 0.8:
            a = by_event.handle(L.Blocked("s", hid, blocked, now))
            b = direct.blocked("s", hid, blocked, now)
        elif r < 0.9:
            a = by_event.handle(L.Asking("s", blocked))
            b = direct.handle(L.Asking("s", blocked))
        else:
            a = by_event.handle(L.Tick("s", now))
            b = direct.handle(L.Tick("s", now))
        assert a == b, (seed, step)
        assert state(by_event) == state(direct), (seed, step)


class _PackingAgent:
    """What ``WorkerAgent.pack_results`` and ``_place`` read of an agent; keeps are recorded."""

    def __init__(self) -> None:
        from types import SimpleNamespace

        self.runtime = SimpleNamespace(objects=None)
        self.inline_limit = 100
        self.worker = SimpleNamespace(address="tcp://w:1")
        self.kept: dict = {}

    def keep(self, object_id: str, payload: object) -> None:
        self.kept[object_id] = payload


@pytest.mark.parametrize("value", [None, 3, "short", b"x" * 50, b"x" * 500, "y" * 500])
def test_a_plain_result_places_as_pack_results_does(value):
    """The task path's plain result (``_execute``: pickled once, then ``_place``) gives what
    ``pack_results`` gives: inline when small, else kept here under the task id."""
    from yrdask.serialization import dumps
    from yrdask.worker.agent import WorkerAgent

    fast, general = _PackingAgent(), _PackingAgent()
    fast._place = WorkerAgent._place.__get__(fast)
    general._place = WorkerAgent._place.__get__(general)
    from yrdask import protocol as P

    payload = dumps(value)
    large = len(payload) > 100
    placed = fast._place("t1", payload)
    assert [placed] == WorkerAgent.pack_results(general, "t1", value, 1, "caller")[0]
    assert placed == ([P.LOCATION, "tcp://w:1"] if large else [P.VALUE, payload])
    assert fast.kept == general.kept == ({"t1": payload} if large else {})
