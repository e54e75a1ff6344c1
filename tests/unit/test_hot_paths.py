"""The hot paths' shortcuts give what the general paths give, and fire (no cluster).

The one rule: a shortcut either *is* the implementation of its case, which ``handle()``
delegates to (``LeaseGate.arrived``/``ended``/``lent``, ``CallOrder.send_at_once``/
``succeeded_at_once``: the adapters call them directly, without an event object), or it goes.
Each shortcut that remains is checked here against the general way, and asserted to have
fired: the refill of a lease in ``SubmitQueue``'s task end, the plain answers a caller reads
off their wire dicts (``protocol.PLAIN_TASK_DONE``), plain arguments and results.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from yrdask import protocol as P
from yrdask.runtime import call_order as C
from yrdask.runtime import context
from yrdask.runtime.driver import DriverRuntime
from yrdask.runtime.instance_router import Call, InstanceRouter
from yrdask.serialization import pack_args, pack_plain_args, unpack_args
from yrdask.worker.execution import Execution


from .test_call_order import Harness as _CallOrderHarness
from .test_call_order import _state as _call_order_state
from .test_call_order import W1, drive_random_calls

W = W1  # the worker the plain-answer tests' instance lives on


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


@pytest.mark.parametrize("depth,refill", [(4, 1), (4, 2), (8, 4)])
def test_the_refill_shortcut_does_what_the_general_dispatch_does(depth, refill):
    """The same random events into a queue with the refill shortcut and one without: the
    same instructions, and both valid after every event (pipeline_depth, pipeline_refill;
    (8, 4) the runtime's); over 20 seeds, the shortcut fired."""
    fired = sum(_refill_twins(seed, depth, refill) for seed in range(20))
    assert fired, "the refill shortcut never fired"


def _refill_twins(seed: int, depth: int, refill: int) -> int:
    """One seed of the test above: how often the shortcut fired."""
    import random

    from yrdask.runtime import submit_queue as M

    rnd = random.Random(seed)
    fast = M.SubmitQueue(None, pipeline_depth=depth, pipeline_refill=refill)
    general = M.SubmitQueue(None, pipeline_depth=depth, pipeline_refill=refill)
    general.refill_shortcut = False
    fast_dispatches, general_dispatches = _count_calls(fast, "_dispatch"), \
        _count_calls(general, "_dispatch")
    n = leases = fired = 0
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
        dispatched = fast_dispatches[0], general_dispatches[0]
        assert fast.handle(ev) == general.handle(ev), (seed, step, ev)
        # the shortcut fired: the general queue dispatched where the fast one did not
        fired += (fast_dispatches[0] == dispatched[0]
                  and general_dispatches[0] > dispatched[1])
        fast.validate()
        general.validate()
    return fired

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


def _count_calls(obj: object, name: str) -> list:
    """Count the calls of ``obj.name`` (a one-item list), the method still doing its work."""
    count = [0]
    method = getattr(obj, name)

    def counted(*args, **kwargs):
        count[0] += 1
        return method(*args, **kwargs)

    setattr(obj, name, counted)
    return count


# --------------------------------------------------------------------------- CallOrder


class TwinHarness(_CallOrderHarness):

    """Feeds a twin machine the same events the way CallRouter does: a ready call and a
    plain answer through the shortcuts (``send_at_once``, ``succeeded_at_once``) when they
    take them, with the call id as stimulus (as the router's).  Both machines must give the
    same instructions and end in the same state and story after every event."""

    def __init__(self) -> None:
        super().__init__()
        self.twin = C.CallOrder()
        self.shortcuts = {"send": 0, "succeeded": 0}

    def __call__(self, event_type: type, *args, **kwargs) -> list:
        self.n += 1
        sid = args[0] if event_type in (C.CallSubmitted, C.CallDone) else f"s{self.n}"
        ev = event_type(sid, *args, **kwargs)
        out = self.m.handle(ev)
        twin_out = None
        if type(ev) is C.CallSubmitted and ev.ready and ev.error is None:
            ins = self.twin.send_at_once(ev.call_id, ev.instance_id, ev.max_redeliveries,
                                         ev.unordered, ev.concurrency)
            if ins is not None:
                twin_out, self.shortcuts["send"] = [ins], self.shortcuts["send"] + 1
        elif type(ev) is C.CallDone and ev.error is None:
            if self.twin.succeeded_at_once(ev.call_id):
                twin_out = [C.CallSucceeded(ev.call_id, ev.call_id)]
                self.shortcuts["succeeded"] += 1
        if twin_out is None:
            twin_out = self.twin.handle(ev)
        self.m.validate()
        self.twin.validate()
        assert repr(twin_out) == repr(out), (ev, twin_out, out)  # errors: equal by repr
        assert _call_order_state(self.twin) == _call_order_state(self.m), ev
        return out


@pytest.mark.parametrize("seed", range(40))
def test_the_routers_call_order_shortcuts_do_what_handle_does(seed):
    """The random calls of test_call_order.py, fed to a second machine the way CallRouter
    does (``send_at_once``/``succeeded_at_once`` first): the same instructions, state and
    story after every event; both shortcuts fired, and declined where they must."""
    h = TwinHarness()
    drive_random_calls(h, seed)
    assert h.shortcuts["send"] and h.shortcuts["succeeded"], h.shortcuts


def test_handle_delegates_to_the_call_order_shortcuts():
    """``handle(CallSubmitted)`` / ``handle(CallDone)`` of the usual call go through
    ``send_at_once`` / ``succeeded_at_once``: one implementation of those cases."""
    h = _CallOrderHarness()
    h.created("i")
    h(C.HandleAdded, "i")  # a second handle: an answer leaves the instance counted
    sends, successes = _count_calls(h.m, "send_at_once"), _count_calls(h.m, "succeeded_at_once")
    out = h(C.CallSubmitted, "c1", "i")
    assert out == [C.SendCall(f"s{h.n}", "c1", "i", W1)] and sends == [1]
    assert h(C.CallDone, "c1") == [C.CallSucceeded(f"s{h.n}", "c1")] and successes == [1]


# --------------------------------------------------------------------------- plain answers


@pytest.mark.parametrize("msg,plain", [
    (P.TaskDone.wire("t", results=[[P.VALUE, b"x"]]), True),
    (P.TaskDone.wire("t", results=[[P.VALUE, b"x"]], took=1e-5), True),
    (P.TaskDone.wire("t", results=[[P.VALUE, b"x"]], refs=["w", [], []]), False),
    (P.TaskDone.wire("t", error=b"e"), False),
    (P.TaskDone.wire("t", error=b"e", retryable=True, took=1.0), False),
    (P.TaskDone.wire("t", requeue=True), False),
    (P.TaskDone("t", results=[[P.VALUE, b"x"]]).to_msg(), False),  # every field: general
])
def test_the_protocol_says_which_answers_are_plain(msg, plain):
    """``protocol.PLAIN_TASK_DONE`` (not the dict's length) classifies a ``TASK_DONE``; what
    it calls plain reads back the same as ``TaskDone.from_msg``."""
    assert P.PLAIN_TASK_DONE.issuperset(msg) is plain
    if plain:
        done = P.TaskDone.from_msg(msg)
        assert (done.results, done.error, done.refs, done.requeue) == (msg["results"], None,
                                                                      None, False)


class _Entry:
    def __init__(self) -> None:
        self.result = self.error = None

    def set_result(self, kind, payload) -> None:
        self.result = (kind, payload)

    def set_error(self, error) -> None:
        self.error = error


class _Channel:
    def __init__(self) -> None:
        self.sent: list = []

    def send(self, msg) -> None:
        self.sent.append(msg)


def _runtime() -> tuple[DriverRuntime, list, _Channel]:
    """A driver runtime's answer handling with a real router and CallOrder; instance "i1"
    lives on worker W (created through the machine's events); the submitter records."""
    rt = object.__new__(DriverRuntime)
    tasks: list = []
    chan = _Channel()
    rt.objects = SimpleNamespace(on_done_refs=lambda refs: tasks.append(("refs", refs)))
    rt.submitter = SimpleNamespace(on_task_done=tasks.append, tasks={})
    rt.channels = {W: chan}
    rt.channel = lambda address: chan
    rt.router = InstanceRouter(rt, C.CallOrder())
    order = rt.router.order
    for ev in (C.CreateRequested("s1", "i1"), C.HandleAdded("s2", "i1"),
               C.CreateDepsReady("s3", "i1"), C.Created("s4", "i1", W, "i1")):
        order.handle(ev)
    return rt, tasks, chan


def _call(rt, cid: str) -> _Entry:
    entry = _Entry()
    rt.router.call(Call(cid, "i1", "inc", b"", (), (entry,), 1))
    return entry


def _general_way(*args, **kwargs):
    pytest.fail("the general way was taken where a shortcut should have been")


def test_a_plain_answer_settles_its_call_without_a_message_object():
    """A method call's plain answer is read off its wire dict: the router's shortcuts only
    (CallRouter.submit/done: ``send_at_once``, ``succeeded_at_once``), neither
    ``CallOrder.handle`` nor the ``TaskDone`` object (``on_done``)."""
    rt, tasks, chan = _runtime()
    rt.router.order.handle = _general_way
    rt.router.on_done = _general_way
    sends = _count_calls(rt.router.order, "send_at_once")
    successes = _count_calls(rt.router.order, "succeeded_at_once")
    entry = _call(rt, "c1")
    assert [m["task_id"] for m in chan.sent] == ["c1"]  # sent at once
    rt.on_channel_message(P.TaskDone.wire("c1", results=[[P.VALUE, b"x"]]))
    assert entry.result == (P.VALUE, b"x") and entry.error is None
    assert "c1" not in rt.router.calls and "c1" not in rt.router.order.calls
    assert rt.router.order.counts == {"i1": 1}  # the handle only
    assert tasks == [] and sends == successes == [1]
    rt.router.order.validate()


def test_a_plain_answer_with_its_run_time_settles_its_call_without_a_message_object():
    """``took`` (the worker's run time, which ``TaskDone.wire`` carries for tasks) does not
    send a call's plain answer the general way."""
    rt, tasks, chan = _runtime()
    rt.router.order.handle = _general_way
    rt.router.on_done = _general_way
    successes = _count_calls(rt.router.order, "succeeded_at_once")
    entry = _call(rt, "c1")
    rt.on_channel_message(P.TaskDone.wire("c1", results=[[P.VALUE, b"x"]], took=1e-5))
    assert entry.result == (P.VALUE, b"x") and entry.error is None
    assert "c1" not in rt.router.calls and tasks == [] and successes == [1]
    rt.router.order.validate()


def test_other_call_answers_go_the_general_way():
    rt, tasks, chan = _runtime()
    entry = _call(rt, "c2")
    # answered with a value after a cancel (an async method that caught it; the worker
    # answers a cancelled sync call with CancelledError): the value, the general way
    assert rt.router.cancel("c2")
    rt.on_channel_message(P.TaskDone.wire("c2", results=[[P.VALUE, b"x"]]))
    assert entry.error is None and entry.result == (P.VALUE, b"x")
    entry = _call(rt, "c3")  # a refs report is applied first
    rt.on_channel_message(P.TaskDone.wire("c3", results=[[P.VALUE, b"x"]],
                                          refs=["w", [], []]))
    assert tasks == [("refs", ["w", [], []])] and entry.result == (P.VALUE, b"x")
    tasks.clear()
    # a task's answer with the shape of a plain one: the submitter has it
    rt.on_channel_message(P.TaskDone.wire("t1", results=[[P.VALUE, b"x"]]))
    assert len(tasks) == 1 and tasks[0].task_id == "t1"
    assert rt.router.calls == {} and rt.router.order.calls == {}
    rt.router.order.validate()


@pytest.mark.parametrize("late", [None, 2])
def test_a_gather_waits_only_for_refs_still_pending_when_reached(monkeypatch, late):
    """``get``'s wait from the back (``ObjectAccess._wait_all``) hands a task's cancel hook
    the refs still pending when it reaches them, not every ref of the burst: results that
    came meanwhile cost no shield per ref."""
    from yrdask.runtime.object_access import ObjectAccess
    from yrdask.runtime.objects import PENDING, Entry

    entries = [Entry() for _ in range(6)]
    waited = []

    def hook(wait, timeout):  # the results arrive while the thread waits (but ``late``)
        waited.append(wait.__self__)
        for i, entry in enumerate(entries):
            if entry.state is PENDING and i != late or wait.__self__ is entry:
                entry.settle(P.VALUE)
        return wait(timeout)

    monkeypatch.setattr(context, "wait_hook", hook)
    access = SimpleNamespace(_ensure_fetch=lambda ref: None)
    ObjectAccess._wait_all(access, [SimpleNamespace(_entry=e) for e in entries], None)
    expected = [entries[-1]] if late is None else [entries[-1], entries[late]]
    assert waited == expected
    assert all(e.state == P.VALUE for e in entries)
