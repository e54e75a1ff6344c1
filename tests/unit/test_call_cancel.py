"""Ray's cancel of a method call at its caller (``CallOrder``'s ``CallCancelled``, carried out
by ``CallRouter.cancel``, which ``InstanceRouter`` and the simulation's instance world both
run): a call that has not left never does and fails at once, a call in flight has its
worker told, and what a cancelled call's answer settles it with."""
from __future__ import annotations

import pytest

from .harness import MachineHarness
from .test_call_order import of, sent

from yrdask import protocol as P
from yrdask.errors import CancelledError, InstanceDiedError, RemoteError
from yrdask.runtime import call_order as C
from yrdask.runtime.call_router import CallRouter, cancelled_answer

pytestmark = pytest.mark.timeout(30)

W1, W2 = "tcp://w1:1", "tcp://w2:1"
GONE = CancelledError("cancelled")


@pytest.fixture
def h() -> MachineHarness:
    h = MachineHarness(C.CallOrder())
    h(C.CreateRequested, "i")
    h(C.HandleAdded, "i")
    h(C.CreateDepsReady, "i")
    return h


def test_a_call_cancelled_while_its_instance_is_created_is_never_sent(h):
    assert sent(h(C.CallSubmitted, "c1", "i")) == []
    h(C.CallSubmitted, "c2", "i")
    assert h(C.CallCancelled, "c1", GONE) == [C.CallFailed(f"s{h.n}", "c1", GONE)]
    assert sent(h(C.Created, "i", W1, "i")) == ["c2"]  # c1 never leaves
    assert h(C.CallCancelled, "c1", GONE) == []  # settled: a second cancel does nothing


def test_a_cancelled_call_held_by_order_is_never_sent_and_the_ones_behind_go_on(h):
    h(C.Created, "i", W1, "i")
    assert sent(h(C.CallSubmitted, "c1", "i", False)) == []  # waits for its argument
    h(C.CallSubmitted, "c2", "i")
    h(C.CallSubmitted, "c3", "i")
    assert of(h(C.CallCancelled, "c2", GONE), C.CallFailed) == [
        C.CallFailed(f"s{h.n}", "c2", GONE)]
    out = h(C.CallCancelled, "c1", GONE)  # the head: the ones behind it leave now
    assert of(out, C.CallFailed) == [C.CallFailed(f"s{h.n}", "c1", GONE)]
    assert sent(out) == ["c3"]


def test_a_call_in_flight_has_its_worker_told_and_its_answer_settles_it(h):
    h(C.Created, "i", W1, "i")
    h(C.CallSubmitted, "c1", "i")
    assert h(C.CallCancelled, "c1", GONE) == [C.SendCancel(f"s{h.n}", "c1", W1)]
    assert h(C.CallCancelled, "c1", GONE) == []  # told once
    assert h(C.CallDone, "c1") == [C.CallSucceeded(f"s{h.n}", "c1")]  # it ran on
    assert h.m.cancels == {}


@pytest.mark.parametrize("back", ["lost", "moved"])
def test_a_cancelled_call_that_comes_back_unrun_is_not_sent_again(h, back):
    h(C.Created, "i", W1, "i")
    h(C.CallSubmitted, "c1", "i")
    h(C.CallSubmitted, "c2", "i")
    h(C.CallCancelled, "c2", GONE)
    if back == "lost":
        out = h(C.ChannelLost, W1)
    else:
        out = h(C.CallMoved, "c1")
    assert of(out, C.CallFailed) == [C.CallFailed(f"s{h.n}", "c2", GONE)]
    assert sent(h(C.Located, "i", W2, "", "i")) == ["c1"]


class _Edge:
    """What ``CallRouter.cancel`` hands its edge, recorded."""

    def __init__(self) -> None:
        self.did: list = []

    def send_call(self, ins: C.SendCall) -> None:
        self.did.append(("send", ins.call_id))

    def send_cancel(self, worker: str, msg: P.CancelTask) -> None:
        self.did.append(("cancel", worker, msg.task_id, msg.recursive))

    def call_failed(self, call_id: str, error) -> None:
        self.did.append(("failed", call_id, error))

    def flush_soon(self) -> None:
        pass

    def send_create(self, instance_id: str) -> None:
        pass


def test_the_router_fails_an_unsent_call_with_rays_words_and_tells_a_sent_ones_worker():
    edge = _Edge()
    router = CallRouter(edge, C.CallOrder())
    router.create_requested("i")
    router.incref("i")
    router.create_deps_ready("i")
    router.submit("c1", "i", True)
    router.cancel("c1")  # not sent: it fails now, in Ray's words
    [(what, cid, error)] = edge.did
    assert (what, cid, type(error)) == ("failed", "c1", CancelledError)
    assert str(error) == "Task: c1 was cancelled."
    router.create_answered("i", ["i", W1, None])
    router.submit("c2", "i", True)
    router.cancel("c2", recursive=True)
    assert edge.did[1:] == [("send", "c2"), ("cancel", W1, "c2", True)]


def test_a_cancelled_calls_answer_settles_it_unless_its_instance_died_under_it():
    assert cancelled_answer("c1", None) is None  # it ran on to its value (a sync method)
    boom = ValueError("the method raised")
    assert cancelled_answer("c1", boom) is boom
    cancelled = CancelledError("Task: c1 was cancelled.")
    assert cancelled_answer("c1", cancelled) is cancelled
    for died in (InstanceDiedError("gone"),  # as the simulation sends it
                 RemoteError.from_exception(InstanceDiedError("gone"), "")):  # on the wire
        settled = cancelled_answer("c1", died)
        assert isinstance(settled, CancelledError) and "c1" in str(settled)
