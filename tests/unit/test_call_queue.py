"""Hosting's dispatch decisions (``worker/call_queue.py``): no call before ``__init__``
finished, arrival order, at most ``concurrency`` at once, nothing after a stop.  The
simulation drives the same class for every hosted instance (tests/sim/calls.py), and
``worker/hosting.py`` runs it for every executor."""
from __future__ import annotations

import pytest

from yrdask.worker.call_queue import CallQueue

pytestmark = pytest.mark.timeout(30)


def test_calls_wait_for_init_then_start_in_arrival_order_up_to_the_concurrency():
    q = CallQueue(2)
    assert [q.arrived(c) for c in "abc"] == [False, False, False]
    q.validate()
    assert q.constructed() == ["a", "b"]
    q.validate()
    assert q.arrived("d") is False  # c waits: d goes behind it
    assert q.finished() == "c"
    assert q.finished() == "d"
    assert q.finished() is None and q.finished() is None
    assert q.running == 0
    q.validate()


def test_concurrency_one_runs_one_call_at_a_time():
    q = CallQueue(1)
    q.constructed()
    assert q.arrived("a") is True
    assert q.arrived("b") is False
    q.validate()
    assert q.finished() == "b"
    assert q.finished() is None


def test_a_stopped_queue_starts_nothing_and_hands_back_the_waiting_calls():
    q = CallQueue(1)
    q.constructed()
    q.arrived("a")
    q.arrived("b")
    assert q.stop() == ["b"]
    assert q.finished() is None
    assert q.arrived("c") is False and not q.waiting
    q.validate()


def test_a_zero_concurrency_is_refused():
    with pytest.raises(ValueError, match="at least 1"):
        CallQueue(0)


def test_take_removes_the_calls_an_executor_of_their_own_runs_before_init():
    # Ray's concurrency groups: their calls leave the queue once the class is known
    q = CallQueue(1)
    for c in ("a", "side1", "b", "side2"):
        q.arrived(c)
    assert q.take(lambda c: c.startswith("side")) == ["side1", "side2"]
    assert q.constructed() == ["a"]
    assert q.finished() == "b"
    q.validate()
