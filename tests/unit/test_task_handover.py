"""A task thread ending a task runs the next task of its lease (``WorkerAgent._execute_gated``
with the thread-local ``_Ending``), and hands it to another thread if ``finished`` raises."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from yrdask.worker.agent import WorkerAgent
from yrdask.worker.task_runner import _AgentEdge, _Ending


class _Recording:
    """A caller that is no call-channel ``Peer``: its answers go out at once, in order."""

    def __init__(self) -> None:
        self.replies: list = []

    def reply(self, msg: dict) -> None:
        self.replies.append(msg["task_id"])


def _agent(admits: dict, fail: set) -> SimpleNamespace:
    """What ``_execute_gated`` reads of an agent; ``finished(ex)`` starts ``admits[ex]``
    through the real edge's ``start`` and raises for the tasks in ``fail``."""
    agent = SimpleNamespace(share=SimpleNamespace(dask=False), _ending=_Ending(), _held=[],
                            ran=[], submitted=[], loop=SimpleNamespace(time=lambda: 0.0))
    agent.executor = SimpleNamespace(submit=lambda fn, ex: agent.submitted.append(ex))
    agent._execute_gated = lambda ex: None
    edge = _AgentEdge(agent)  # type: ignore[arg-type]

    def execute(ex):
        agent.ran.append((ex.task_id, threading.get_ident()))
        return {"task_id": ex.task_id}

    def finished(ex):
        for after in admits.get(ex.task_id, ()):
            edge.start(after)
        if ex.task_id in fail:
            raise RuntimeError("finished failed")

    agent._execute = execute
    agent.task_side = SimpleNamespace(finished=finished,
                                      next_waits=lambda task_id: task_id in admits)
    return agent


def _task(task_id: str, peer: _Recording) -> SimpleNamespace:
    return SimpleNamespace(task_id=task_id, peer=peer, armed=False, shielded=False)


def test_the_ending_thread_runs_the_first_task_its_end_admits():
    peer = _Recording()
    t1, t2, t3, t4 = (_task(f"t{i}", peer) for i in range(1, 5))
    agent = _agent({"t1": [t2, t4], "t2": [t3]}, set())
    WorkerAgent._execute_gated(agent, t1)  # type: ignore[arg-type]
    assert [t for t, _ in agent.ran] == ["t1", "t2", "t3"]  # t4: the second one admitted
    assert {ident for _, ident in agent.ran} == {threading.get_ident()}
    assert agent.submitted == [t4]
    assert peer.replies == ["t1", "t2", "t3"]
    assert not agent._ending.free and agent._ending.next is None


def test_a_task_admitted_by_a_failing_finish_goes_to_another_thread():
    peer = _Recording()
    t1, t2 = _task("t1", peer), _task("t2", peer)
    agent = _agent({"t1": [t2]}, {"t1"})
    with pytest.raises(RuntimeError, match="finished failed"):
        WorkerAgent._execute_gated(agent, t1)  # type: ignore[arg-type]
    assert agent.submitted == [t2]  # not lost with this thread's frame
    assert [t for t, _ in agent.ran] == ["t1"]
    assert not agent._ending.free and agent._ending.next is None
    # the thread's slot is clear: a task started later from it goes to the executor
    _AgentEdge(agent).start(_task("t3", peer))  # type: ignore[arg-type]
    assert [ex.task_id for ex in agent.submitted] == ["t2", "t3"]


class _Stream:
    def __init__(self) -> None:
        self.sent: list = []

    def send(self, msg: dict) -> None:
        self.sent.append(msg["task_id"])


def _holding_agent(results: dict) -> tuple[SimpleNamespace, list, list]:
    """``_agent`` with the real held answers (``results``: extra fields per task id): its loop is a list of calls run by hand
    (``calls``), its timers a list (``timers``)."""
    import collections

    from yrdask.worker.agent import WorkerAgent as W

    calls: list = []
    timers: list = []
    agent = _agent({}, set())
    agent._held = collections.deque()
    agent._held_armed = False
    agent._held_timer = None
    agent.replies_held = 0
    agent.runtime = SimpleNamespace(on_loop=lambda fn, *a: calls.append((fn, a)))
    agent.loop = SimpleNamespace(time=lambda: 0.0,
                                 call_later=lambda s, fn: timers.append(fn) or fn)
    for name in ("_hold_reply", "_on_loop", "_arm_held", "_held_expired", "_send_held",
                 "_send_after_held"):
        setattr(agent, name, getattr(W, name).__get__(agent))
    agent._execute = lambda ex: {"task_id": ex.task_id, **results.get(ex.task_id, {})}
    return agent, calls, timers


def _run(calls: list) -> None:
    while calls:
        fn, args = calls.pop(0)
        fn(*args)


def _run_of_three(replies: dict) -> tuple:
    """Tasks t1, t2, t3 of one lease, each admitted by the end of the one before, run by
    one thread; ``replies`` gives some of them extra answer fields.  (stream, agent, the
    loop calls queued, the timers armed)."""
    from yrdask.worker.channel_peers import Peer

    stream = _Stream()
    agent, calls, timers = _holding_agent(replies)
    peer = Peer(agent.runtime.on_loop, stream)  # type: ignore[arg-type]
    t1, t2, t3 = (_task(f"t{i}", peer) for i in range(1, 4))
    nxt = {"t1": t2, "t2": t3}
    agent.task_side.finished = lambda ex: (
        _AgentEdge(agent).start(nxt[ex.task_id]) if ex.task_id in nxt else None)
    agent.task_side.next_waits = lambda task_id: task_id in nxt
    WorkerAgent._execute_gated(agent, t1)  # type: ignore[arg-type]
    return stream, agent, calls, timers


def test_a_run_of_plain_answers_is_held_and_sent_in_order_at_its_end():
    stream, agent, calls, timers = _run_of_three({})
    assert stream.sent == [] and agent.replies_held == 2  # t3 ends the run: not held
    _run(calls)
    assert stream.sent == ["t1", "t2", "t3"] and not agent._held
    assert len(timers) == 1  # armed once for the run
    timers.pop()()  # the timer finds nothing held, and disarms
    assert not agent._held_armed and agent._held_timer is None


def test_an_answer_with_refs_or_an_error_is_not_held():
    stream, agent, calls, timers = _run_of_three({"t1": {"refs": []}, "t2": {"error": 1}})
    assert agent.replies_held == 0 and not timers
    _run(calls)
    assert stream.sent == ["t1", "t2", "t3"] and not agent._held


def test_an_answer_not_held_keeps_its_place_behind_what_its_thread_sent_before():
    """A drain already queued (another thread's run ended) must not carry a refs answer
    ahead of the messages its own thread queued first."""
    from yrdask.worker.channel_peers import Peer

    stream = _Stream()
    agent, calls, _ = _holding_agent({})
    peer = Peer(agent.runtime.on_loop, stream)  # type: ignore[arg-type]
    agent._hold_reply(peer, {"task_id": "t1"}, True)  # another thread's run, held
    agent._on_loop(agent._send_held)  # ...whose end queues its drain
    peer.reply({"task_id": "item"})  # this thread's earlier message (a generator item, say)
    agent._hold_reply(peer, {"task_id": "t2", "refs": []}, False)
    _run(calls)
    assert stream.sent == ["t1", "item", "t2"]


def _ordered(results: dict, waits: set, peer_kind: str = "peer") -> list:
    """One task t1 run to its end: the order of its answer (``answer``) and the gate's
    bookkeeping (``finished``); ``waits``: task ids whose lease has a task waiting."""
    from yrdask.worker.channel_peers import Peer

    order: list = []
    agent, calls, _ = _holding_agent(results)
    if peer_kind == "peer":
        peer = Peer(lambda fn, *a: order.append(("answer", a[0].get("error") is not None)),
                    _Stream())  # type: ignore[arg-type]
    else:
        peer = SimpleNamespace(reply=lambda msg: order.append(("answer", "error" in msg)),
                               caller="")
    agent.task_side.finished = lambda ex: order.append(("finished", ex.task_id))
    agent.task_side.next_waits = lambda task_id: task_id in waits
    WorkerAgent._execute_gated(agent, _task("t1", peer))  # type: ignore[arg-type]
    return order


def test_a_plain_answer_goes_before_the_bookkeeping_when_nothing_would_hold_it():
    assert _ordered({}, set()) == [("answer", False), ("finished", "t1")]
    assert _ordered({"t1": {"refs": []}}, set()) == [("answer", False), ("finished", "t1")]
    assert _ordered({}, {"t1"}, "local") == [("answer", False), ("finished", "t1")]


def test_an_error_answer_goes_after_the_task_is_forgotten():
    """An error may be retried (same id, same lease): the retry must find the slot free."""
    assert _ordered({"t1": {"error": b"x"}}, set()) == [("finished", "t1"), ("answer", True)]
    assert _ordered({"t1": {"error": b"x"}}, set(), "local") == [("finished", "t1"),
                                                                 ("answer", True)]


def test_a_plain_answer_that_may_be_held_waits_for_the_hold_decision():
    """A task of its lease waits (the end admits it): whether the answer is held depends on
    what the bookkeeping admits, so it runs first."""
    assert _ordered({}, {"t1"}) == [("finished", "t1"), ("answer", False)]
