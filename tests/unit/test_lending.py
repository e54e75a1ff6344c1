"""When a worker tells the scheduler a task's CPU is lent (worker/lending.py), as a pure
machine, and through the task side that feeds it (worker/task_side.py), with no cluster."""

from __future__ import annotations

import random

import pytest

from yrdask.worker.lending import (Asking, Blocked, LendNotices, Notify, Tick, WakeAt,
                                   parse_delay)
from yrdask.worker.task_side import TaskSide

D = 0.002


def notices(out: list) -> list[tuple[str, bool]]:
    return [(i.holding_id, i.blocked) for i in out if type(i) is Notify]


def wakes(out: list) -> list[float]:
    return [i.at for i in out if type(i) is WakeAt]


def feed(m: LendNotices, event) -> list:
    out = m.handle(event)
    m.validate()
    return out


def test_a_short_block_ends_untold():
    m = LendNotices(D)
    out = feed(m, Blocked("get", "L1", True, 10.0))
    assert notices(out) == [] and wakes(out) == [10.0 + D]
    assert feed(m, Blocked("got", "L1", False, 0.0)) == []
    assert m.told() == set()
    assert feed(m, Tick("t", 10.0 + D)) == []  # the spent timer finds nothing to tell
    assert m.next_wake is None and not m.holds


def test_a_block_that_lasts_is_told_then_untold():
    m = LendNotices(D)
    feed(m, Blocked("get", "L1", True, 10.0))
    assert notices(feed(m, Tick("t", 10.0 + D))) == [("L1", True)]
    assert m.told() == {"L1"}
    assert notices(feed(m, Blocked("got", "L1", False, 0.0))) == [("L1", False)]
    assert m.told() == set()


def test_the_timer_is_armed_once_and_rearmed_for_a_later_block():
    m = LendNotices(D)
    assert wakes(feed(m, Blocked("get", "L1", True, 10.0))) == [10.0 + D]
    feed(m, Blocked("got", "L1", False, 0.0))
    # the next block starts before the timer fires: no second timer now ...
    assert feed(m, Blocked("get", "L1", True, 10.001)) == []
    # ... the timer finds it not due yet and comes back when it is
    out = feed(m, Tick("t", 10.0 + D))
    assert notices(out) == [] and wakes(out) == [10.001 + D]
    assert notices(feed(m, Tick("t", 10.001 + D))) == [("L1", True)]


def test_blocks_are_told_at_once_while_the_worker_asks_for_a_lease():
    m = LendNotices(D)
    feed(m, Blocked("get", "L1", True, 10.0))
    # its submitter asks: what it asks for may need the blocked task's CPU
    assert notices(feed(m, Asking("ask", True))) == [("L1", True)]
    assert notices(feed(m, Blocked("get", "L2", True, 10.0))) == [("L2", True)]
    feed(m, Asking("answer", False))
    assert notices(feed(m, Blocked("get", "L3", True, 10.0))) == []  # not asking any more
    assert m.told() == {"L1", "L2"}


def test_threads_of_one_instance_lend_once():
    m = LendNotices(D)
    feed(m, Blocked("get", "I1", True, 10.0))
    feed(m, Blocked("get", "I1", True, 10.001))  # a second thread of the instance
    assert notices(feed(m, Tick("t", 10.0 + D))) == [("I1", True)]
    assert feed(m, Blocked("got", "I1", False, 0.0)) == []  # one thread still waits
    assert notices(feed(m, Blocked("got", "I1", False, 0.0))) == [("I1", False)]


def test_delay_zero_tells_every_block_at_once_and_stray_unblocks_are_ignored():
    m = LendNotices(0.0)
    assert notices(feed(m, Blocked("get", "L1", True, 1.0))) == [("L1", True)]
    assert notices(feed(m, Blocked("got", "L1", False, 0.0))) == [("L1", False)]
    assert feed(m, Blocked("got", "L1", False, 0.0)) == []
    assert ("unblock-ignored", "L1") in [what for _, what in m.story_of("L1")]


def test_random_runs_keep_notices_paired_and_every_lasting_block_told():
    """Whatever the order, the scheduler hears blocked/unblocked alternately per holding, and a
    block that lasts past the delay is told by the timers the machine asks for."""
    for seed in range(200):
        rng = random.Random(seed)
        m = LendNotices(D)
        now, wake = 0.0, None
        blocked = {h: 0 for h in ("L1", "L2", "I1")}
        told = {h: False for h in blocked}  # what the scheduler heard last
        since: dict[str, float] = {}
        for _ in range(60):
            now += rng.choice([0.0, 0.0005, 0.003])
            r = rng.random()
            if wake is not None and wake <= now:
                wake, out = None, feed(m, Tick("t", now))
            elif r < 0.1:
                out = feed(m, Asking("ask", rng.random() < 0.5 or not m.asking))
            else:
                h = rng.choice(list(blocked))
                b = blocked[h] == 0 or (h == "I1" and rng.random() < 0.3)
                if b:
                    blocked[h] += 1
                    since.setdefault(h, now)
                else:
                    blocked[h] -= 1
                    if not blocked[h]:
                        since.pop(h)
                out = feed(m, Blocked("x", h, b, now))
            for h, b in notices(out):
                assert told[h] != b, f"seed {seed}: {h} told {b} twice"
                told[h] = b
            for at in wakes(out):
                wake = at if wake is None else min(wake, at)
            for h, t0 in since.items():  # told, or a timer will tell it in time
                assert told[h] or (wake is not None and wake <= t0 + D), \
                    f"seed {seed}: {h} blocked since {t0}, untold, timer {wake}"
        for h in blocked:
            assert told[h] == (h in m.told())


class _Edge:
    def __init__(self) -> None:
        self.clock = 5.0
        self.sent: list[tuple[str, bool]] = []
        self.timers: list = []
        self.started: list = []

    def now(self) -> float:
        return self.clock

    def start(self, ex) -> None:
        self.started.append(ex.task_id)

    def reply(self, ex, msg) -> None:
        pass

    def call_at(self, at, fn) -> None:
        self.timers.append((at, fn))

    def exit_process(self, ex) -> None:
        raise AssertionError

    def notify(self, holding_id: str, blocked: bool) -> None:
        self.sent.append((holding_id, blocked))


class _Rec:
    def __init__(self, task_id, peer, msg) -> None:
        self.task_id = task_id

    def cancel(self) -> None:
        pass


def test_task_side_lend_frees_the_gate_slot_at_once_and_the_cpu_when_it_lasts():
    edge = _Edge()
    side = TaskSide(edge, _Rec, notices=LendNotices(D))
    side.run_task(None, {"task_id": "a", "lease_id": "L", "slots": 1})
    side.run_task(None, {"task_id": "b", "lease_id": "L", "slots": 1})
    assert edge.started == ["a"]
    side.lend("L", True)  # a waits in yr.get: b starts now, the scheduler hears nothing yet
    assert edge.started == ["a", "b"] and edge.sent == []
    [(at, tick)] = [(at, fn) for at, fn in edge.timers if fn == side.lend_tick]
    assert at == 5.0 + D
    edge.clock = at
    tick()
    assert edge.sent == [("L", True)]
    side.lend("L", False)
    assert edge.sent == [("L", True), ("L", False)]
    side.gate.validate()
    side.notices.validate()


def test_task_side_asking_tells_waiting_blocks():
    edge = _Edge()
    side = TaskSide(edge, _Rec, notices=LendNotices(D))
    side.run_task(None, {"task_id": "a", "lease_id": "L", "slots": 1})
    side.lend("L", True)
    side.asking(True)
    assert edge.sent == [("L", True)]
    side.asking(False)
    side.lend("L", False)
    assert edge.sent == [("L", True), ("L", False)]


def test_the_lend_delay_setting_takes_durations_and_names_bad_values():
    assert parse_delay("2ms") == 0.002
    assert parse_delay(0) == 0.0
    assert parse_delay(0.5) == 0.5
    for bad in ("soon", -1, None):
        with pytest.raises(ValueError, match="yrdask.worker.lend-delay"):
            parse_delay(bad)
