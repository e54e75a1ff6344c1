"""The submitter's decisions (``runtime/submitter.py``'s ``Submitter``) on a recording edge:
the rules the simulation's task world does not reach (no top-level ref arguments, no large
values kept on workers, no result settling inside another event), and regressions of what it
found.  No cluster, no loop."""

from __future__ import annotations

from yrdask import protocol as P
from yrdask.runtime import submit_queue as M
from yrdask.runtime.submitter import Submitter, Task

ME = "tcp://me:1"


class Edge:
    """A :class:`~yrdask.runtime.submitter.SubmitterEdge` that records what it is asked."""

    def __init__(self, local: str | None = ME, short_queue: bool = True) -> None:
        self.local = local
        self.short_queue = short_queue
        self.t = 0.0
        self.sent: list[tuple] = []
        self.soon: list[tuple] = []
        self.timers: list[list] = []

    def now(self) -> float:
        return self.t

    def call_soon(self, fn, arg) -> None:
        self.soon.append((fn, arg))

    def call_at(self, at, fn):
        timer = Timer(at, fn)
        self.timers.append(timer)
        return timer

    def request_lease(self, ins, near, answer) -> None:
        self.sent.append(("request", ins.request_id, near))

    def push(self, task, lease_id, worker, slots) -> None:
        self.sent.append(("push", task.task_id, lease_id, worker))

    def send_cancel(self, worker, task_id, force, recursive=False) -> None:
        self.sent.append(("cancel", task_id, worker))

    def when_exit_known(self, worker, then, wait_s) -> None:
        then(None)  # no nanny report: the loss is an eviction, not the task's own crash

    def return_leases(self, lease_ids) -> None:
        self.sent.append(("return", tuple(lease_ids)))

    def withdraw_requests(self, request_ids) -> None:
        self.sent.append(("withdraw", tuple(request_ids)))

    def crashed(self, error, entries) -> None:
        for entry in entries:
            entry.set_error(error)

    def address(self) -> str:
        return self.local or "tcp://driver:1"

    def local_worker(self):
        return self.local

    def prefers_local(self) -> bool:
        return self.short_queue

    def cannot(self, ins, error) -> None:
        raise error


class Timer:
    def __init__(self, at, fn) -> None:
        self.at, self.fn, self.cancelled = at, fn, False

    def cancel(self) -> None:
        self.cancelled = True


class Entry:
    def __init__(self, on_set=None) -> None:
        self.got: list = []
        self.on_set = on_set

    def set_result(self, kind, payload) -> None:
        self.got.append(("ok", payload))
        if self.on_set is not None:
            self.on_set()

    def set_error(self, error) -> None:
        self.got.append(("error", error))


def task(tid: str, entry: Entry | None = None) -> Task:
    return Task(tid, "fn", b"", "f", b"", [], [entry or Entry()], [f"{tid}.0"], 1,
                {"CPU": 1000.0}, ((("CPU", 1000.0),), 1000, 1, ()), 1000, 0, "job")


def submitter(edge: Edge) -> Submitter:
    return Submitter(edge, M.SubmitQueue(None, lease_idle_s=1.0))


def requests(edge: Edge) -> list:
    return [s for s in edge.sent if s[0] == "request"]


def test_local_first_while_the_queue_is_short():
    """A worker's submitter asks for a lease on its own worker while the agent's queue is
    short, else anywhere; a driver never names itself."""
    edge = Edge()
    s = submitter(edge)
    s.submit(task("a"))
    assert requests(edge) == [("request", requests(edge)[0][1], ME)]
    edge = Edge(short_queue=False)
    s = submitter(edge)
    s.submit(task("a"))
    assert [r[2] for r in requests(edge)] == [None]
    edge = Edge(local=None)
    s = submitter(edge)
    s.submit(task("a"))
    assert [r[2] for r in requests(edge)] == [None]


def test_where_large_arguments_live_comes_before_local():
    edge = Edge()
    s = submitter(edge)
    s.submit(task("warm"))  # learns its local worker
    edge.sent.clear()
    s._handle(M.TaskQueued("s", "b", "other-key", {"CPU": 1000.0}, 1000, 1, (), 0,
                           "tcp://data:1", "g"))
    assert [r[2] for r in requests(edge)] == ["tcp://data:1"]


def test_a_task_done_inside_another_settlement_waits_its_turn():
    """Settling a result may run user callbacks that end up handing the submitter another
    ``TASK_DONE``: it is deferred (call_soon), and settles with its own results then."""
    edge = Edge()
    s = submitter(edge)
    done_b = P.TaskDone("b", results=[(P.VALUE, b"B")], took=0.1)
    a_entry = Entry(on_set=lambda: s.on_task_done(done_b))
    b_entry = Entry()
    s.submit(task("a", a_entry))
    s.submit(task("b", b_entry))
    for i, (_what, rid, _near) in enumerate(requests(edge)):
        s.lease_answer(rid, f"L{i}", f"tcp://w{i}:1")
    assert sorted(x[1] for x in edge.sent if x[0] == "push") == ["a", "b"]
    s.on_task_done(P.TaskDone("a", results=[(P.VALUE, b"A")], took=0.1))
    assert a_entry.got == [("ok", b"A")]
    assert b_entry.got == [] and [arg for _fn, arg in edge.soon] == [done_b]
    fn, arg = edge.soon.pop()
    fn(arg)
    assert b_entry.got == [("ok", b"B")] and not s.tasks


def test_one_timer_for_the_earliest_wake():
    edge = Edge()
    s = submitter(edge)
    s._wake_at(5.0)
    s._wake_at(7.0)  # later: the armed one serves
    s._wake_at(2.0)  # earlier: replaces it
    assert [(t.at, t.cancelled) for t in edge.timers] == [(5.0, True), (2.0, False)]
    s.close()
    assert edge.timers[-1].cancelled
    s._wake_at(1.0)  # closed: no timer
    assert len(edge.timers) == 2


def test_cancel_before_arguments_are_ready_fails_it_here():
    edge = Edge()
    s = submitter(edge)
    entry = Entry()
    t = task("a", entry)
    t.dep_refs = []
    s.tasks["a"] = t  # submitted, its arguments not ready yet
    s.waiting += 1
    s.cancel("a.0")
    assert entry.got and entry.got[0][0] == "error" and "cancelled" in str(entry.got[0][1])
    assert s.waiting == 0 and "a" not in s.tasks
    assert edge.sent == []


class Held:
    """A ref argument the task holds (``Task.held``): counts whether anything still holds it."""

    alive = 0

    def __init__(self) -> None:
        Held.alive += 1

    def __del__(self) -> None:
        Held.alive -= 1


def _pushed_with_a_ref(edge: Edge) -> tuple[Submitter, Entry]:
    s = submitter(edge)
    entry = Entry()
    t = task("a", entry)
    t.held = [Held()]
    s.submit(t)
    del t
    (_what, rid, _near), = requests(edge)
    s.lease_answer(rid, "L1", "tcp://w:1")
    assert ("push", "a", "L1", "tcp://w:1") in edge.sent
    return s, entry


def test_a_cancelled_task_holds_its_ref_arguments_until_its_worker_answers():
    """A cancel settles a running task at once, but its worker may still run it and keep a
    ref argument: the refs stay held until its TASK_DONE (which reports what it kept) has
    been handled, so the owner cannot free them under the worker (FINDINGS.md I)."""
    Held.alive = 0
    edge = Edge()
    s, entry = _pushed_with_a_ref(edge)
    s.cancel("a")
    assert entry.got and entry.got[0][0] == "error" and "cancelled" in str(entry.got[0][1])
    assert "a" not in s.tasks and Held.alive == 1  # settled, its ref argument still held
    s.on_task_done(P.TaskDone("a", results=[(P.VALUE, b"A")], took=0.1))
    assert Held.alive == 0 and not s.cancelled_args and entry.got[1:] == []


def test_a_cancelled_task_lets_go_of_its_refs_when_its_worker_is_lost():
    Held.alive = 0
    edge = Edge()
    s, _entry = _pushed_with_a_ref(edge)
    s.cancel("a")
    assert Held.alive == 1
    s.on_channel_lost("tcp://other:1")
    assert Held.alive == 1
    s.on_channel_lost("tcp://w:1")
    assert Held.alive == 0 and not s.cancelled_args


def test_a_finished_task_lets_go_of_its_refs_at_once():
    Held.alive = 0
    edge = Edge()
    s, entry = _pushed_with_a_ref(edge)
    s.on_task_done(P.TaskDone("a", results=[(P.VALUE, b"A")], took=0.1))
    assert entry.got == [("ok", b"A")] and Held.alive == 0 and not s.pushed


def test_a_task_cancelled_after_its_worker_was_lost_holds_nothing_for_it():
    """Lost with its worker, the task waits to run again; cancelled then, no worker runs it,
    so nothing waits for a TASK_DONE: its ref arguments go with it."""
    Held.alive = 0
    edge = Edge()
    s, entry = _pushed_with_a_ref(edge)
    s.on_channel_lost("tcp://w:1")  # requeued (a crash rerun)
    assert "a" in s.tasks and not s.pushed
    s.cancel("a")
    assert entry.got and entry.got[0][0] == "error"
    assert Held.alive == 0 and not s.cancelled_args


def test_a_plain_answer_read_from_its_wire_dict_inside_another_settlement_waits_its_turn():
    """``on_task_ok`` (the driver's hot path, no ``TaskDone`` object) keeps the same rule:
    inside another event's settlement it is deferred, then settles with its own results."""
    edge = Edge()
    s = submitter(edge)
    a_entry = Entry(on_set=lambda: s.on_task_ok("b", [(P.VALUE, b"B")], 0.1))
    b_entry = Entry()
    s.submit(task("a", a_entry))
    s.submit(task("b", b_entry))
    for i, (_what, rid, _near) in enumerate(requests(edge)):
        s.lease_answer(rid, f"L{i}", f"tcp://w{i}:1")
    s.on_task_ok("a", [(P.VALUE, b"A")], 0.1)
    assert a_entry.got == [("ok", b"A")] and b_entry.got == [] and len(edge.soon) == 1
    fn, arg = edge.soon.pop()
    fn(arg)
    assert b_entry.got == [("ok", b"B")] and not s.tasks and not s._results


def test_the_runtime_reads_a_plain_answer_without_a_message_object():
    """``Runtime.on_channel_message``: a task's plain answer (``protocol.PLAIN_TASK_DONE``) goes
    to ``on_task_ok``; one with an error, a requeue or a refs report, one written with every
    field (``to_msg``), and a method call's, take the ``TaskDone`` path."""
    from yrdask.runtime.runtime import Runtime

    seen: list = []

    class Sub:
        tasks = {"t1": None, "t2": None, "t3": None}

        def on_task_ok(self, task_id, results, took):
            seen.append(("ok", task_id, results, took))

        def on_task_done(self, done):
            seen.append(("done", done.task_id))

    class Router:
        def on_result(self, cid, results):  # a method call's plain answer: declined here,
            return False  # so call1 takes on_done (tests/unit/test_instance_call_fast_path.py)

        def on_done(self, done):
            return done.task_id == "call1"

    class Objects:
        def on_done_refs(self, refs):
            seen.append(("refs", refs))

    rt = object.__new__(Runtime)
    rt.submitter, rt.router, rt.objects = Sub(), Router(), Objects()
    rt.on_channel_message(P.TaskDone.wire("t1", results=[[P.VALUE, b"x"]], took=0.5))
    rt.on_channel_message(P.TaskDone("t1", results=[[P.VALUE, b"y"]]).to_msg())  # every field
    rt.on_channel_message(P.TaskDone.wire("t2", error=b"err"))
    rt.on_channel_message(P.TaskDone.wire("t3", requeue=True))
    rt.on_channel_message(P.TaskDone.wire("t1", results=[], refs=["w", [], []]))
    rt.on_channel_message(P.TaskDone.wire("call1", results=[]))
    rt.on_channel_message(P.TaskDone.wire("gone", results=[]))  # settled already (a cancel)
    assert seen == [("ok", "t1", [[P.VALUE, b"x"]], 0.5), ("done", "t1"),
                    ("done", "t2"), ("done", "t3"), ("refs", ["w", [], []]), ("done", "t1"),
                    ("done", "gone")]


def test_the_pipelining_keys_reach_the_submit_queue():
    """``yrdask.scheduling.pipeline-depth`` / ``pipeline-refill`` set the runtime's submit
    queue (defaults 8 and 4); a value out of range is refused naming its key."""
    import dask
    import pytest

    from yrdask.errors import YRValueError

    queue = Submitter.for_runtime(object()).machine
    assert (queue.pipeline_depth, queue.pipeline_refill) == (8, 4)
    with dask.config.set({"yrdask.scheduling.pipeline-depth": 4,
                          "yrdask.scheduling.pipeline-refill": "2"}):  # "2": as from the env
        queue = Submitter.for_runtime(object()).machine
    assert (queue.pipeline_depth, queue.pipeline_refill) == (4, 2)
    for bad, key in (({"yrdask.scheduling.pipeline-refill": 0}, "pipeline-refill=0"),
                     ({"yrdask.scheduling.pipeline-depth": 2.5}, "pipeline-depth=2.5"),
                     ({"yrdask.scheduling.pipeline-refill": 9}, "pipeline-refill=9 is more")):
        with dask.config.set(bad), pytest.raises(YRValueError, match=key):
            Submitter.for_runtime(object())


class ItemEdge(Edge):
    """An :class:`Edge` with an object table of real entries (generator items)."""

    def __init__(self) -> None:
        super().__init__()
        self.entries: dict = {}

    def entry_of(self, oid):
        return self.entries.get(oid)

    def keeps_copy(self, oid) -> bool:
        return False  # the lost worker was on another node


def _generator_call(edge: ItemEdge, s: Submitter, worker: str) -> tuple:
    """A generator call (``nret`` STREAMING) pushed to ``worker``, which sent two items
    it keeps; returns the call's end entry and its items' entries."""
    from yrdask.runtime.objects import Entry as RealEntry

    end = RealEntry()
    t = task("g", end)
    t.nret, t.ref_ids = P.STREAMING, ["g"]
    s.submit(t)
    (_what, rid, _near), = requests(edge)
    s.lease_answer(rid, "L1", worker)
    items = []
    for i in range(2):
        entry = edge.entries[f"g.{i}"] = RealEntry()
        entry.set_result(P.LOCATION, worker)
        s.item_kept("g", f"g.{i}")
        items.append(entry)
    return end, items


def test_items_lost_while_their_call_runs_are_settled_by_the_next_run():
    """A generator call still running when its worker is lost: its kept items go back to
    pending (they are neither failed nor rerun a second time), and the run that follows
    the loss settles each with its item of the same index."""
    edge = ItemEdge()
    s = submitter(edge)
    end, items = _generator_call(edge, s, "tcp://w:1")
    assert sorted(s.reconstruct("tcp://w:1")) == ["g.0", "g.1"]
    assert all(not e.ready for e in items) and set(s.rebuilding["g"]) == {"g.0", "g.1"}
    s.on_channel_lost("tcp://w:1")  # the call itself runs again, as after any lost worker
    assert not s.rebuilt_item("g", "g.5", [P.LOCATION, "tcp://w:2"])  # never lost: a duplicate
    for i in range(2):
        assert s.rebuilt_item("g", f"g.{i}", [P.LOCATION, "tcp://w:2"])
        assert items[i].location == "tcp://w:2" and s.lineage[f"g.{i}"].task_id == "g"
    assert not s.rebuilding


def test_a_rerun_that_yields_fewer_items_fails_the_missing_ones():
    """A finished generator call whose items were lost runs again; an item the rerun did
    not yield again raises ``ValueError`` naming it once the rerun ended."""
    edge = ItemEdge()
    s = submitter(edge)
    end, items = _generator_call(edge, s, "tcp://w:1")
    s.on_task_done(P.TaskDone("g", results=[(P.VALUE, b"2")], took=0.1))
    assert "g" not in s.tasks
    edge.sent.clear()
    assert sorted(s.reconstruct("tcp://w:1")) == ["g.0", "g.1"]
    assert "g" in s.tasks and ("push", "g", "L1", "tcp://w:1") in edge.sent  # run again
    assert s.rebuilt_item("g", "g.0", [P.LOCATION, "tcp://w:2"])
    s.on_task_done(P.TaskDone("g", results=[(P.VALUE, b"1")], took=0.1))
    assert items[0].location == "tcp://w:2"
    assert items[1].state == P.ERROR and not s.rebuilding
    error = items[1].exception()
    assert isinstance(error, ValueError) and "g.1" in str(error)
    assert "yielded fewer items than the first time" in str(error)
