"""The worker's lease gate as a pure machine, and the cancel record of a task (no cluster)."""

from __future__ import annotations

import random
import threading
import time

import pytest

from yrdask.errors import CancelledError
from yrdask.worker.execution import Execution
from yrdask.worker.lease_gate import (BounceTask, LeaseGate, SlotLent, StartTask, TaskArrived,
                                      TaskEnded, Tick, WakeAt)

P = 0.05


def started(out: list) -> list[str]:
    return [i.task_id for i in out if isinstance(i, StartTask)]


def bounced(out: list) -> list[str]:
    return [i.task_id for i in out if isinstance(i, BounceTask)]


def wakes(out: list) -> list[float]:
    return [i.at for i in out if isinstance(i, WakeAt)]


def arrive(gate: LeaseGate, task: str, lease: str = "L", slots: int = 1, now: float = 0.0):
    out = gate.handle(TaskArrived("t", task, lease, slots, now))
    gate.validate()
    return out


def test_runs_up_to_slots_then_holds_the_rest():
    gate = LeaseGate(P)
    assert started(arrive(gate, "a", slots=2)) == ["a"]
    assert started(arrive(gate, "b", slots=2)) == ["b"]
    out = arrive(gate, "c", slots=2)
    assert started(out) == [] and wakes(out) == [P]
    assert gate.queued() == 1 and gate.running() == 2


def test_an_ended_task_starts_the_next_waiting_one_in_order():
    gate = LeaseGate(P)
    arrive(gate, "a")
    arrive(gate, "b")
    arrive(gate, "c")
    assert started(gate.handle(TaskEnded("t", "a"))) == ["b"]
    assert started(gate.handle(TaskEnded("t", "b"))) == ["c"]
    assert gate.handle(TaskEnded("t", "c")) == []
    gate.validate()
    assert gate.leases == {} and gate.lease_of == {}


def test_a_blocked_task_lends_its_slot_and_gets_it_back():
    gate = LeaseGate(P)
    arrive(gate, "a")
    arrive(gate, "b")
    assert started(gate.handle(SlotLent("t", "L", True))) == ["b"]
    gate.validate()
    assert gate.handle(SlotLent("t", "L", False)) == []  # both run: no new start
    out = arrive(gate, "c")
    assert started(out) == [], "two running on one slot: c must wait"
    assert started(gate.handle(TaskEnded("t", "a"))) == []
    assert started(gate.handle(TaskEnded("t", "b"))) == ["c"]
    gate.validate()


def test_a_task_waiting_past_patience_is_bounced_and_forgotten():
    gate = LeaseGate(P)
    arrive(gate, "a", now=0.0)
    out = arrive(gate, "b", now=0.01)
    assert wakes(out) == [pytest.approx(0.06)]
    out = gate.handle(Tick("t", 0.03))  # early: nothing due, the timer is asked for again
    assert bounced(out) == [] and wakes(out) == [pytest.approx(0.06)]
    out = gate.handle(Tick("t", 0.061))
    assert bounced(out) == ["b"] and wakes(out) == []
    gate.validate()
    assert "b" not in gate.lease_of
    assert gate.handle(TaskEnded("t", "b")) == []  # never started: ignored
    assert gate.handle(TaskEnded("t", "a")) == []
    assert gate.leases == {}


def test_one_timer_for_many_waiting_tasks():
    gate = LeaseGate(P)
    arrive(gate, "a")
    all_wakes = []
    for i in range(5):
        all_wakes += wakes(arrive(gate, f"w{i}", now=0.001 * i))
    assert all_wakes == [P], "later deadlines need no new timer"
    out = gate.handle(Tick("t", P + 0.002))
    assert bounced(out) == ["w0", "w1", "w2"]
    assert wakes(out) == [pytest.approx(0.003 + P)]
    gate.validate()


def test_stale_and_unknown_events_are_ignored_and_logged():
    gate = LeaseGate(P)
    assert gate.handle(TaskEnded("s1", "nobody")) == []
    assert gate.handle(SlotLent("s2", "instance-1", True)) == []
    arrive(gate, "a")
    assert arrive(gate, "a") == []  # pushed twice
    assert gate.handle(SlotLent("s3", "L", False)) == []  # nothing lent
    gate.validate()
    assert any(what[0] == "end-ignored" for _, what in gate.story_of("nobody"))
    assert any(what[0] == "duplicate-ignored" for _, what in gate.story_of("a"))


def test_leases_are_independent():
    gate = LeaseGate(P)
    assert started(arrive(gate, "a", "L1")) == ["a"]
    assert started(arrive(gate, "b", "L2")) == ["b"]
    arrive(gate, "c", "L1")
    assert started(gate.handle(TaskEnded("t", "b"))) == []
    assert started(gate.handle(TaskEnded("t", "a"))) == ["c"]


@pytest.mark.parametrize("seed", range(20))
def test_random_schedules_keep_the_invariants_and_settle_every_task(seed):
    """Every task is started or bounced exactly once; never more running than slots plus
    lent slots; nothing waits while its lease has a free slot (validate)."""
    rng = random.Random(seed)
    gate = LeaseGate(P)
    now = 0.0
    slots = {f"L{i}": rng.randint(1, 3) for i in range(3)}
    running: dict[str, str] = {}  # task -> lease
    blocked: dict[str, str] = {}  # blocked running tasks -> lease
    outcome: dict[str, str] = {}
    timers: list[float] = []
    n = 0

    def apply(out):
        for ins in out:
            if isinstance(ins, StartTask):
                assert ins.task_id not in outcome
                outcome[ins.task_id] = "start"
                running[ins.task_id] = gate.lease_of[ins.task_id]
            elif isinstance(ins, BounceTask):
                assert ins.task_id not in outcome
                outcome[ins.task_id] = "bounce"
            else:
                timers.append(ins.at)
        gate.validate()
        for ins in out:  # a start never makes more run than the slots not lent
            if isinstance(ins, StartTask):
                lease = running[ins.task_id]
                active = [t for t, l in running.items() if l == lease and t not in blocked]
                assert len(active) <= slots[lease], (ins.task_id, active)

    for _ in range(400):
        now += rng.random() * 0.02
        roll = rng.random()
        if roll < 0.35:
            lease = rng.choice(list(slots))
            n += 1
            apply(gate.handle(TaskArrived("r", f"t{n}", lease, slots[lease], now)))
        elif roll < 0.6 and running:
            task = rng.choice(sorted(running))
            if task in blocked:
                apply(gate.handle(SlotLent("u", blocked.pop(task), False)))
            lease = running.pop(task)
            apply(gate.handle(TaskEnded("e", task)))
        elif roll < 0.75 and running:
            task = rng.choice(sorted(running))
            if task in blocked:
                apply(gate.handle(SlotLent("u", blocked.pop(task), False)))
            else:
                blocked[task] = running[task]
                apply(gate.handle(SlotLent("b", running[task], True)))
        elif timers and min(timers) <= now:
            timers.remove(min(timers))
            apply(gate.handle(Tick("k", now)))
    # drain: unblock and end everything, let the timers fire
    for _ in range(10_000):
        if not running and not gate.lease_of:
            break
        now += 0.01
        if running:
            task = sorted(running)[0]
            if task in blocked:
                apply(gate.handle(SlotLent("u", blocked.pop(task), False)))
            running.pop(task)
            apply(gate.handle(TaskEnded("e", task)))
        if timers and min(timers) <= now:
            timers.remove(min(timers))
            apply(gate.handle(Tick("k", now)))
    assert gate.lease_of == {} and gate.leases == {}
    assert sorted(outcome, key=lambda t: int(t[1:])) == [f"t{i}" for i in range(1, n + 1)]


# -- the cancel record -----------------------------------------------------------------------


def test_cancel_before_start_means_it_never_arms():
    ex = Execution("t", None, {})
    assert ex.cancel() is False
    assert ex.arm() is False


def test_cancel_interrupts_only_the_armed_user_code_and_nothing_after():
    ex = Execution("t", None, {})
    seen = []
    armed = threading.Event()

    def task_thread():
        try:
            assert ex.arm()
            armed.set()
            for _ in range(2000):  # user code: busy in Python, interruptible
                time.sleep(0.001)
            seen.append("finished")
        except CancelledError:
            seen.append("cancelled")
        while True:
            try:
                ex.disarm()
                break
            except CancelledError:
                seen.append("late")
        for _ in range(200):  # after disarm: nothing may arrive any more
            time.sleep(0.0005)
        seen.append("after")

    th = threading.Thread(target=task_thread)
    th.start()
    armed.wait(5)
    assert ex.cancel() is True
    assert ex.cancel() is False  # one shot only
    th.join(10)
    assert seen == ["cancelled", "after"]


@pytest.mark.parametrize("seed", range(5))
def test_cancels_racing_with_the_end_never_escape_the_record(seed):
    """Cancel many short 'tasks' on one thread at random moments: a cancel never lands outside
    its own task's armed region (the next task, or the thread's own bookkeeping)."""
    rng = random.Random(seed)
    escaped: list = []
    records: list[Execution] = []
    ready = threading.Semaphore(0)
    results: dict[int, str] = {}

    def worker():
        for i in range(200):
            ex = records[i]
            outcome = "ok"
            try:
                if ex.arm():
                    ready.release()
                    try:
                        total = 0
                        for k in range(rng.randint(0, 3000)):
                            total += k
                    finally:
                        ex.disarm()
                else:
                    ready.release()
                    outcome = "never-ran"
            except CancelledError:
                outcome = "cancelled"
            while True:
                try:
                    ex.disarm()
                    break
                except CancelledError:
                    outcome = "cancelled"
            try:
                for _ in range(50):  # bookkeeping between tasks
                    pass
                results[i] = outcome
            except CancelledError as e:  # pragma: no cover - the bug this test guards
                escaped.append((i, e))

    records.extend(Execution(f"t{i}", None, {}) for i in range(200))
    th = threading.Thread(target=worker)
    th.start()
    for i in range(200):
        ready.acquire(timeout=10)
        if rng.random() < 0.5:
            time.sleep(rng.random() * 0.0005)
            records[i].cancel()
    th.join(30)
    assert not th.is_alive()
    assert escaped == []
    assert len(results) == 200
