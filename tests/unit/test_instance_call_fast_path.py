"""The instance call path's shortcuts keep their rules.

* A sync instance's run of chained calls takes its share of the worker once while no Dask
  task is about, and each call takes its turn again while one is (worker/share.py).
* The caller reads a method call's plain answer off its wire dict
  (:meth:`InstanceRouter.on_result`); an answer after a cancel, an error, a refs report and a
  task's answer still go the general way (:meth:`InstanceRouter.on_done`).
"""
from __future__ import annotations

import threading
from types import SimpleNamespace

import cloudpickle
import pytest

from yrdask import protocol as P
from yrdask.runtime import call_order as C
from yrdask.runtime.instance_router import Call, InstanceRouter
from yrdask.runtime.driver import DriverRuntime
from yrdask.serialization import dumps_value, pack_args, unpack_args, wire
from yrdask.worker.hosting import HostedInstance

pytestmark = pytest.mark.timeout(30)

W = "tcp://w1:1"
GATE = threading.Event()  # __init__ waits for it: the calls queue up behind it


class Gated:
    def __init__(self) -> None:
        GATE.wait(10)
        self.n = 0

    def inc(self, i):
        self.n += 1
        return i + 1


class _Share:
    """The share's instance-call side, counted (``dask``: Dask tasks about)."""

    wired = True

    def __init__(self, dask: int) -> None:
        self.dask = dask
        self.starts = self.ends = 0
        self.holding = 0  # calls holding a share now (never above one here)
        self.most = 0

    def call_start(self) -> None:
        self.starts += 1
        self.holding += 1
        self.most = max(self.most, self.holding)

    def call_end(self) -> None:
        self.ends += 1
        self.holding -= 1


class _Agent:
    def __init__(self, share: _Share) -> None:
        self.share = share

    def pack_results(self, task_id, result, nret, caller=None):
        return [[P.VALUE, wire(dumps_value(result))]], None

    def unpack_call(self, msg):
        return unpack_args(msg["args"], []), []

    def refs_report(self, borrowed, nested):
        return None

    def report_state(self, instance_id, state, error):
        pass


class _Peer:
    def __init__(self, expected: int) -> None:
        self.replies: list[dict] = []
        self.done = threading.Event()
        self.expected = expected

    def reply(self, msg: dict) -> None:
        self.replies.append(msg)
        if len(self.replies) >= self.expected:
            self.done.set()


def _run_chain(dask: int, n: int = 6) -> tuple[_Share, _Peer]:
    GATE.clear()
    share = _Share(dask)
    args, _ = pack_args((), {}, lambda v: False)
    inst = HostedInstance(_Agent(share), {"instance_id": "i1", "cls_name": "Gated",
                                          "cls": cloudpickle.dumps(Gated), "args": args,
                                          "concurrency": 1}, [])
    peer = _Peer(n)
    try:
        for k in range(n):  # all queued before __init__ ends: they run as one chain
            blob, _ = pack_args((k,), {}, lambda v: False)
            inst.call(peer, {"task_id": f"c{k}", "method": "inc", "args": blob, "deps": [],
                             "nret": 1})
        GATE.set()
        assert peer.done.wait(10), f"only {len(peer.replies)} of {n} calls answered"
    finally:
        inst.stop("test over")
    return share, peer


def test_a_run_of_calls_takes_the_share_once_without_dask_tasks():
    share, peer = _run_chain(dask=0)
    assert [m["task_id"] for m in peer.replies] == [f"c{k}" for k in range(6)]
    assert share.starts == share.ends == 2  # __init__'s turn, then the chain's
    assert share.most == 1 and share.holding == 0


def test_each_call_takes_its_turn_while_dask_tasks_are_about():
    share, peer = _run_chain(dask=1)
    assert len(peer.replies) == 6
    assert share.starts == share.ends == 7  # __init__ and each call
    assert share.most == 1 and share.holding == 0


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
    rt, tasks, chan = _runtime()
    # the shortcuts only: neither CallOrder.handle (send_at_once, succeeded_at_once) nor the
    # TaskDone object (on_done) nor done() may be reached
    rt.router.order.handle = _general_way
    rt.router.on_done = rt.router.done = _general_way
    entry = _call(rt, "c1")
    assert [m["task_id"] for m in chan.sent] == ["c1"]  # sent at once
    rt.on_channel_message(P.TaskDone.wire("c1", results=[[P.VALUE, b"x"]]))
    assert entry.result == (P.VALUE, b"x") and entry.error is None
    assert "c1" not in rt.router.calls and "c1" not in rt.router.order.calls
    assert rt.router.order.counts == {"i1": 1}  # the handle only
    assert tasks == []
    rt.router.order.validate()


def test_a_plain_answer_with_its_run_time_settles_its_call_without_a_message_object():
    """``took`` (the worker's run time, which ``TaskDone.wire`` carries for tasks) does not
    send a call's plain answer the general way."""
    rt, tasks, chan = _runtime()
    rt.router.order.handle = _general_way
    rt.router.on_done = rt.router.done = _general_way
    entry = _call(rt, "c1")
    rt.on_channel_message(P.TaskDone.wire("c1", results=[[P.VALUE, b"x"]], took=1e-5))
    assert entry.result == (P.VALUE, b"x") and entry.error is None
    assert "c1" not in rt.router.calls and tasks == []
    rt.router.order.validate()


def test_other_answers_go_the_general_way():
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
