"""The submitter's rules as a pure machine (``yrdask/runtime/submit_queue.py``): no cluster."""

from __future__ import annotations

import random

import pytest

from yrdask.errors import CancelledError, ScheduleError, TaskCrashedError, YRRuntimeError
from yrdask.runtime.submit_queue import (EARLY_REVOKES, Closing, CancelRequested, LeaseGranted,
                                         LeaseRefused, LeasesRevoked, PushTask, RequestLease,
                                         ReturnLeases, SendCancel, SubmitQueue, TaskFailed,
                                         TaskFinished, TaskQueued, TaskSucceeded, Tick, WakeAt,
                                         WithdrawRequests, WorkerJoined, WorkerLost)

IDLE = 1.0


def mk(local: str | None = None, **kw) -> SubmitQueue:
    kw.setdefault("lease_idle_s", IDLE)
    return SubmitQueue(local, **kw)


def step(m: SubmitQueue, ev) -> list:
    out = m.handle(ev)
    m.validate()
    return out


def queue(m: SubmitQueue, tid: str, key: str = "k", slots: int = 1, retries: int = 0,
          data_home: str | None = None, name: str = "f", max_crashes: int | None = None) -> list:
    return step(m, TaskQueued("s", tid, key, {"CPU": 1.0}, 1000, slots, (), retries, data_home,
                              name, max_crashes))


def grant(m: SubmitQueue, rid: str, lid: str, worker: str = "w1", now: float = 0.0) -> list:
    return step(m, LeaseGranted("g", rid, lid, worker, now))


def finish(m: SubmitQueue, tid: str, outcome: str = "ok", took: float | None = 1.0,
           error=None, now: float = 0.0) -> list:
    return step(m, TaskFinished("d", tid, outcome, took, error, now))


def of(out: list, cls: type) -> list:
    return [i for i in out if isinstance(i, cls)]


def requests(out: list) -> list[str]:
    return [i.request_id for i in of(out, RequestLease)]


def pushed(out: list) -> list[tuple[str, str]]:
    return [(i.task_id, i.lease_id) for i in of(out, PushTask)]


def returned(out: list) -> list[str]:
    return [lid for i in of(out, ReturnLeases) for lid in i.lease_ids]


def succeeded(out: list) -> list[str]:
    return [i.task_id for i in of(out, TaskSucceeded)]


def failed(out: list) -> dict:
    return {i.task_id: i.error for i in of(out, TaskFailed)}


# -- leases and pushes -------------------------------------------------------------------------


def test_a_task_asks_for_a_lease_runs_on_it_and_the_idle_lease_goes_back():
    m = mk()
    out = queue(m, "t1", data_home="w9")
    assert of(out, RequestLease) == [RequestLease("s", "r1", "q0", {"CPU": 1.0}, 1000, "w9", (),
                                                  ())]
    assert pushed(grant(m, "r1", "L1", now=0.5)) == [("t1", "L1")]
    out = finish(m, "t1", now=2.0)
    assert succeeded(out) == ["t1"] and [i.at for i in of(out, WakeAt)] == [2.0 + IDLE]
    assert step(m, Tick("t", 2.5)) == [WakeAt("t", 2.0 + IDLE)]  # early: asks again
    assert returned(step(m, Tick("t", 3.0))) == ["L1"]
    assert m.leases == {}


def test_requests_are_bounded_by_the_backlog_and_max_pending():
    m = mk(max_pending_requests=4)
    out = []
    for i in range(10):
        out += queue(m, f"t{i}")
    assert requests(out) == ["r1", "r2", "r3", "r4"]
    m2 = mk()
    out = []
    for i in range(5):
        out += queue(m2, f"t{i}", slots=3)
    assert len(requests(out)) == 2  # two leases of 3 slots run the backlog at once


def test_a_backlog_keeps_requests_outstanding_as_leases_come():
    m = mk(max_pending_requests=2)
    for i in range(6):
        queue(m, f"t{i}")
    out = grant(m, "r1", "L1")
    assert pushed(out) == [("t0", "L1")] and requests(out) == ["r3"]


def test_a_lease_runs_up_to_its_slots_and_takes_the_next_as_one_ends():
    m = mk()
    for i in range(3):
        queue(m, f"t{i}", slots=2)
    assert pushed(grant(m, "r1", "L1")) == [("t0", "L1"), ("t1", "L1")]
    out = finish(m, "t0")
    assert succeeded(out) == ["t0"] and pushed(out) == [("t2", "L1")]


def test_a_grant_with_nothing_queued_goes_back_at_once():
    m = mk()
    queue(m, "t0")
    queue(m, "t1")
    grant(m, "r1", "L1")
    finish(m, "t0")  # L1 takes t1
    assert returned(grant(m, "r2", "L2")) == ["L2"]


def withdrawn(out: list) -> list[str]:
    return [rid for i in of(out, WithdrawRequests) for rid in i.request_ids]


def test_a_drained_queue_withdraws_its_unanswered_requests_and_returns_a_crossing_grant():
    m = mk()
    for i in range(3):
        queue(m, f"t{i}")
    grant(m, "r1", "L1")  # r2, r3 wait at the scheduler
    for tid in ("t1", "t2"):
        assert withdrawn(step(m, CancelRequested("c", tid))) == []  # t0 runs: not drained
    out = finish(m, "t0")
    assert succeeded(out) == ["t0"] and withdrawn(out) == ["r2", "r3"]
    assert m.requests == {} and set(m.withdrawn) == {"r2", "r3"}
    out = step(m, LeaseRefused("x", "r2", "withdrawn"))  # the scheduler's answer
    assert out == [] and "r2" not in m.withdrawn
    assert returned(grant(m, "r3", "L3")) == ["L3"]  # the grant crossed the withdraw
    assert m.withdrawn == {} and set(m.leases) == {"L1"}
    assert any(e[1] == ("granted after its withdraw", "r3", "L3") for e in m.story("r3"))


def test_a_burst_never_withdraws_while_its_tasks_run():
    m = mk()
    out = []
    for i in range(10):
        out += queue(m, f"t{i}")
    assert requests(out) == ["r1", "r2", "r3", "r4"]
    assert requests(grant(m, "r1", "L1")) == ["r5"]  # four wait again
    out = []
    for i in range(9):  # the queue empties once t9 is pushed, but t9 runs: no withdraw
        out += finish(m, f"t{i}")
    out += queue(m, "u")  # a late task of the burst
    assert withdrawn(out) == [] and requests(out) == []
    out = finish(m, "t9")
    assert withdrawn(out) == [] and pushed(out) == [("u", "L1")]
    assert withdrawn(finish(m, "u")) == ["r2", "r3", "r4", "r5"]


def drained_with_a_request_open(m) -> list:
    """Two tasks, one lease (r1) and one request (r2) open; t1 is cancelled and t0 ends:
    the queue drains with r2 unanswered.  The instructions of t0's end."""
    queue(m, "t0")
    queue(m, "t1")
    grant(m, "r1", "L1")
    step(m, CancelRequested("c", "t1"))
    return finish(m, "t0")


def test_a_grant_after_the_withdraw_serves_new_tasks_of_its_queue():
    m = mk()
    assert withdrawn(drained_with_a_request_open(m)) == ["r2"]
    out = queue(m, "t2")
    assert pushed(out) == [("t2", "L1")]  # the idle lease takes it
    assert requests(queue(m, "t3")) == ["r3"]
    out = grant(m, "r2", "L2")  # withdrawn, crossed: its queue has a task again
    assert returned(out) == [] and pushed(out) == [("t3", "L2")]
    assert m.withdrawn == {} and list(m.requests) == ["r3"]


def test_a_withdrawn_request_is_forgotten_on_closing():
    m = mk()
    drained_with_a_request_open(m)
    assert set(m.withdrawn) == {"r2"}
    step(m, Closing("z"))
    assert m.withdrawn == {} and returned(grant(m, "r2", "L2")) == ["L2"]


def test_local_and_forwarded_pushes_are_counted():
    m = mk(local="me")
    queue(m, "a")
    queue(m, "b")
    grant(m, "r1", "L1", worker="me")
    grant(m, "r2", "L2", worker="other")
    f = m.figures()
    assert (f["local"], f["forwarded"], f["lease_requests"], f["running"], f["leases"]) == \
        (1, 1, 2, 2, 2)


# -- the stall of a queue with no lease ------------------------------------------------------------


def test_five_outer_tasks_revoked_while_busy_never_stall():
    """The nested program: 5 outer tasks, leases revoked while they run (their CPU lent to
    the leaves), a refusal; the old submitter then had a queued outer task and nothing
    asking for a lease."""
    m = mk(max_pending_requests=4)
    out = []
    for i in range(5):
        out += queue(m, f"o{i}")
    assert requests(out) == ["r1", "r2", "r3", "r4"]
    out = grant(m, "r1", "L1") + grant(m, "r2", "L2") + grant(m, "r3", "L3") + \
        grant(m, "r4", "L4")
    assert pushed(out) == [("o0", "L1"), ("o1", "L2"), ("o2", "L3"), ("o3", "L4")]
    assert requests(out) == ["r5"]  # o4 waits with one request out
    assert step(m, LeasesRevoked("rv", ("L1", "L2", "L3", "L4"))) == []  # all busy
    out = step(m, LeaseRefused("rf", "r5", "deadline"))
    assert failed(out) == {} and requests(out) == ["r6"]  # only revoked leases: ask again
    for i, lid in enumerate(["L1", "L2", "L3", "L4"]):
        out = finish(m, f"o{i}")
        assert succeeded(out) == [f"o{i}"] and returned(out) == [lid]
    assert list(m.requests) == ["r6"]
    assert pushed(grant(m, "r6", "L5")) == [("o4", "L5")]
    assert succeeded(finish(m, "o4")) == ["o4"]


def test_a_task_back_from_a_revoked_lease_asks_for_a_new_one():
    """Revoke while busy, then the task ends (a user error to retry): the lease goes back
    and the task needs a new one."""
    m = mk()
    queue(m, "t", retries=1)
    grant(m, "r1", "L1")
    assert step(m, LeasesRevoked("rv", ("L1",))) == []
    out = finish(m, "t", "retryable", error="boom")
    assert returned(out) == ["L1"] and requests(out) == ["r2"] and failed(out) == {}
    assert pushed(grant(m, "r2", "L2")) == [("t", "L2")]


def test_revoking_an_idle_or_unknown_lease():
    m = mk()
    queue(m, "t")
    grant(m, "r1", "L1")
    finish(m, "t")
    assert returned(step(m, LeasesRevoked("rv", ("L1", "nope")))) == ["L1"]
    assert step(m, LeasesRevoked("rv", ("L1",))) == []


def test_revoked_while_a_backlog_waits_asks_at_once():
    m = mk(max_pending_requests=1)
    queue(m, "a")
    grant(m, "r1", "L1")
    out = queue(m, "b")
    assert requests(out) == ["r2"]
    step(m, LeaseRefused("rf", "r2", "no room"))  # L1 still serves the queue
    out = step(m, LeasesRevoked("rv", ("L1",)))
    assert requests(out) == ["r3"]


def test_a_busy_lease_is_kept_when_revoked_and_goes_back_when_it_runs_dry():
    """Nested fan-out: every parent's children queue holds a lease and waits for more, so
    each revokes the others'; returning them after every task traded them round the queues
    (a scheduler round trip of idle CPU per task).  A busy revoked lease is kept."""
    m = mk(max_pending_requests=1)
    queue(m, "a")
    queue(m, "b")
    grant(m, "r1", "L1")
    out = step(m, LeasesRevoked("rv", ("L1",), keep=True))
    assert out == [WakeAt("rv", 0.5)]  # the keep's bound, also if no task of it ends
    assert "L1" in m.leases and not m.leases["L1"].revoked
    # another waiter's revoke changes nothing
    assert step(m, LeasesRevoked("rv2", ("L1",), keep=True)) == []
    out = finish(m, "a")
    assert pushed(out) == [("b", "L1")] and returned(out) == []
    queue(m, "c")  # submitted while kept: the kept lease takes it too
    out = finish(m, "b")
    assert pushed(out) == [("c", "L1")] and returned(out) == []
    out = finish(m, "c")
    assert returned(out) == ["L1"] and not m.leases  # ran dry: back at once, no idle time


def test_a_kept_lease_goes_back_after_keep_revoked_s():
    m = mk(keep_revoked_s=0.5)
    for t in "abc":
        queue(m, t)
    grant(m, "r1", "L1", now=1.0)
    step(m, LeasesRevoked("rv", ("L1",), keep=True))
    assert pushed(finish(m, "a", now=1.4)) == [("b", "L1")]  # within 0.5 s: kept
    out = finish(m, "b", now=1.6)
    assert returned(out) == ["L1"] and pushed(out) == [] and m.requests  # c waits for one
    assert [t.task_id for t in m.queues["k"].tasks] == ["c"]


def test_a_kept_lease_whose_tasks_do_not_end_is_revoked_at_its_bound():
    """A kept lease with two slots, one task blocked for long (a parent in yr.get): the bound
    is kept by a timer, not only when a task of the lease ends, so the lease takes no new
    task after it (the simulation's revoke check found new tasks taken 0.5 s past it)."""
    m = mk(keep_revoked_s=0.5)
    queue(m, "a", slots=2)
    queue(m, "b", slots=2)
    grant(m, "r1", "L1", now=1.0)
    assert step(m, LeasesRevoked("rv", ("L1",), keep=True)) == [WakeAt("rv", 1.5)]
    out = finish(m, "b", now=1.2)
    queue(m, "c", slots=2)  # within the bound: the kept lease takes it
    assert m.leases["L1"].tasks.keys() == {"a", "c"}
    out = step(m, Tick("t", 1.5))
    assert m.leases["L1"].revoked and returned(out) == [] and pushed(out) == []
    queue(m, "d", slots=2)  # past the bound: it waits for a lease of its own
    assert "d" not in m.leases["L1"].tasks and m.requests
    finish(m, "c", now=1.6)
    assert returned(finish(m, "a", now=9.0)) == ["L1"]


def test_every_busy_revoked_lease_is_kept_while_its_queue_has_tasks():
    """Two parents on one worker share its children queue (and its leases): both leases
    serve the backlog, each goes back when it runs dry."""
    m = mk(max_pending_requests=2)
    for t in "abcd":
        queue(m, t)
    grant(m, "r1", "L1")
    grant(m, "r2", "L2")
    out = step(m, LeasesRevoked("rv", ("L1", "L2"), keep=True))
    assert out == [WakeAt("rv", 0.5)]  # both busy: both kept
    assert pushed(finish(m, "a")) == [("c", "L1")]
    assert pushed(finish(m, "b")) == [("d", "L2")]
    assert returned(finish(m, "c")) == ["L1"]
    assert returned(finish(m, "d")) == ["L2"] and not m.leases


def test_a_plain_revoke_ends_the_keeping():
    """Resource groups' removals and waiters whose queue runs nothing revoke without keep:
    the lease takes no more tasks."""
    m = mk()
    for t in "abc":
        queue(m, t)
    grant(m, "r1", "L1")
    step(m, LeasesRevoked("rv", ("L1",), keep=True))
    assert pushed(finish(m, "a")) == [("b", "L1")]
    assert step(m, LeasesRevoked("rv", ("L1",))) == [] and m.leases["L1"].revoked
    out = finish(m, "b")
    assert returned(out) == ["L1"] and pushed(out) == [] and m.requests  # c asks anew
    # without keep a busy lease is never kept
    m = mk()
    queue(m, "a")
    queue(m, "b")
    grant(m, "r1", "L1")
    step(m, LeasesRevoked("rv", ("L1",)))
    assert returned(finish(m, "a")) == ["L1"]


def test_a_revoked_busy_lease_without_a_backlog_goes_back_after_its_task():
    m = mk()
    queue(m, "a")
    grant(m, "r1", "L1")
    assert step(m, LeasesRevoked("rv", ("L1",), keep=True)) == [WakeAt("rv", 0.5)]
    assert returned(finish(m, "a")) == ["L1"] and not m.leases  # no idle time


def test_a_revoke_that_comes_before_its_grant_is_applied_with_the_grant():
    """The scheduler revokes a lease it has just granted (another queue waits): the revoke
    travels on its stream, the grant in the rpc's reply, and may come first."""
    m = mk(max_pending_requests=2)
    for t in "abc":
        queue(m, t)
    grant(m, "r1", "L1")
    assert step(m, LeasesRevoked("rv", ("L2",), keep=True)) == []  # not granted yet
    out = grant(m, "r2", "L2")
    assert pushed(out) == [("b", "L2")] and m.leases["L2"].kept_until is not None
    assert pushed(finish(m, "b")) == [("c", "L2")]
    assert returned(finish(m, "c")) == ["L2"]
    assert returned(finish(m, "a")) == [] and "L1" in m.leases  # never revoked: kept idle
    # granted after its queue's tasks went elsewhere: back at once, revoked or not
    m = mk(max_pending_requests=2)
    queue(m, "a")
    queue(m, "b")
    grant(m, "r1", "L1")
    assert pushed(finish(m, "a")) == [("b", "L1")]
    step(m, LeasesRevoked("rv", ("L2",), keep=True))
    out = grant(m, "r2", "L2")
    assert returned(out) == ["L2"] and "L2" not in m.leases


def test_early_revokes_are_bounded_and_a_plain_one_wins_over_keep():
    """Revokes of unknown leases (mostly ones returned already: the revoke crossed the
    return) are remembered, the latest EARLY_REVOKES only; keep then plain is plain."""
    m = mk(max_pending_requests=2)
    step(m, LeasesRevoked("rv", ("L2",), keep=True))
    step(m, LeasesRevoked("rv", ("L2",)))
    step(m, LeasesRevoked("rv", ("L2",), keep=True))
    assert m.early_revokes == {"L2": False}
    gone = tuple(f"X{i}" for i in range(EARLY_REVOKES))
    step(m, LeasesRevoked("rv", gone, keep=True))
    assert len(m.early_revokes) == EARLY_REVOKES and "L2" not in m.early_revokes
    assert "X0" in m.early_revokes and gone[-1] in m.early_revokes
    for t in "ab":
        queue(m, t)
    out = grant(m, "r1", "X0")  # remembered: kept, busy
    assert pushed(out) == [("a", "X0")] and m.leases["X0"].kept_until is not None
    assert "X0" not in m.early_revokes


# -- pipelining ----------------------------------------------------------------------------------


def test_short_tasks_are_pipelined_long_ones_are_not():
    m = mk(pipeline_depth=3, pipeline_below_s=0.005, max_pending_requests=1)
    for i in range(8):
        queue(m, f"t{i}")
    assert pushed(grant(m, "r1", "L1")) == [("t0", "L1")]
    out = finish(m, "t0", took=0.001)  # short: the lease gets up to 3
    assert pushed(out) == [("t1", "L1"), ("t2", "L1"), ("t3", "L1")]
    m2 = mk(pipeline_depth=3, max_pending_requests=1)
    for i in range(4):
        queue(m2, f"t{i}")
    grant(m2, "r1", "L1")
    assert pushed(finish(m2, "t0", took=0.5)) == [("t1", "L1")]


def test_a_pipelined_lease_is_refilled_once_it_has_room_for_a_whole_refill():
    # pipeline_refill=2: with many workers each push carries two tasks, not one
    m = mk(pipeline_depth=4, pipeline_refill=2, max_pending_requests=1)
    for i in range(12):
        queue(m, f"t{i}")
    grant(m, "r1", "L1")
    assert pushed(finish(m, "t0", took=0.001)) == [(f"t{i}", "L1") for i in (1, 2, 3, 4)]
    assert pushed(finish(m, "t1", took=0.001)) == []  # room for one task only
    assert pushed(finish(m, "t2", took=0.001)) == [("t5", "L1"), ("t6", "L1")]
    m.validate()
    m2 = mk(pipeline_depth=4, pipeline_refill=2, max_pending_requests=1)  # not pipelined:
    for i in range(3):  # a free slot is filled at once, as always
        queue(m2, f"t{i}")
    grant(m2, "r1", "L1")
    assert pushed(finish(m2, "t0", took=0.5)) == [("t1", "L1")]


def test_pipelining_goes_round_robin_over_the_leases():
    m = mk(pipeline_depth=2, max_pending_requests=2)
    for i in range(2):
        queue(m, f"t{i}")
    grant(m, "r1", "L1")
    grant(m, "r2", "L2")
    for i in range(2, 6):
        queue(m, f"t{i}")
    out = finish(m, "t0", took=0.001)
    assert pushed(out) == [("t2", "L1"), ("t3", "L1"), ("t4", "L2")]


def test_a_requeued_task_goes_first_and_stops_pipelining():
    m = mk(pipeline_depth=3, max_pending_requests=1)
    for i in range(6):
        queue(m, f"t{i}")
    grant(m, "r1", "L1")
    finish(m, "t0", took=0.001)  # t1, t2, t3 pipelined
    out = finish(m, "t2", "requeue", took=None)
    assert pushed(out) == []  # L1 still has t1 and t3 (over one slot): no more pipelining
    assert [t.task_id for t in m.queues["k"].tasks][:2] == ["t2", "t4"]
    finish(m, "t1")
    out = finish(m, "t3")
    assert pushed(out) == [("t2", "L1")]


def test_tasks_handed_back_one_by_one_keep_their_submission_order():
    # the gate bounces pipelined tasks one at a time, the later ones too: none may overtake
    # an earlier one, or (one CPU) an earlier task waits behind a later one that never ends
    m = mk(pipeline_depth=3, max_pending_requests=1)
    for i in range(6):
        queue(m, f"t{i}")
    grant(m, "r1", "L1")
    finish(m, "t0", took=0.001)  # t1, t2, t3 pipelined
    finish(m, "t2", "requeue", took=None)
    finish(m, "t3", "requeue", took=None)
    assert [t.task_id for t in m.queues["k"].tasks] == ["t2", "t3", "t4", "t5"]
    out = finish(m, "t1")
    assert pushed(out) == [("t2", "L1")]


# -- outcomes, retries, refusals ----------------------------------------------------------------


def test_user_errors_retry_while_retries_last():
    m = mk()
    queue(m, "t", retries=1)
    grant(m, "r1", "L1")
    out = finish(m, "t", "retryable", error="e1")
    assert pushed(out) == [("t", "L1")] and failed(out) == {}
    out = finish(m, "t", "retryable", error="e2")
    assert failed(out) == {"t": "e2"}
    assert finish(m, "t") == []  # settled: a late answer is ignored


def test_a_final_error_fails_at_once():
    m = mk()
    queue(m, "t", retries=5)
    grant(m, "r1", "L1")
    assert failed(finish(m, "t", "error", error="bad")) == {"t": "bad"}


def test_a_refusal_fails_the_queue_only_when_nothing_else_serves_it():
    m = mk(max_pending_requests=2)
    queue(m, "a")
    queue(m, "b")
    out = step(m, LeaseRefused("rf", "r1", "no room"))
    assert failed(out) == {} and requests(out) == []  # r2 still out
    out = step(m, LeaseRefused("rf", "r2", "no room at all"))
    errs = failed(out)
    assert set(errs) == {"a", "b"} and all(isinstance(e, ScheduleError) for e in errs.values())
    assert "no room at all" in str(errs["a"])
    assert step(m, LeaseRefused("rf", "r2", "again")) == []  # stale


def test_a_refusal_with_a_usable_lease_waits_for_it_then_asks_on_new_work():
    m = mk(max_pending_requests=1)
    queue(m, "a")
    grant(m, "r1", "L1")
    queue(m, "b")
    out = step(m, LeaseRefused("rf", "r2", "no room"))
    assert failed(out) == {} and requests(out) == []  # L1 will take b: no refusal loop
    assert pushed(finish(m, "a")) == [("b", "L1")]
    queue(m, "c")
    assert requests(queue(m, "d")) == [] and len(m.requests) == 1


# -- cancel --------------------------------------------------------------------------------------


def test_cancel_a_queued_task():
    m = mk()
    queue(m, "t", name="fn")
    out = step(m, CancelRequested("c", "t"))
    err = failed(out)["t"]
    assert isinstance(err, CancelledError) and "fn" in str(err)
    assert returned(grant(m, "r1", "L1")) == ["L1"]  # nothing left to run
    assert step(m, CancelRequested("c", "t")) == []


def test_cancel_a_pushed_task_fails_now_and_its_end_only_frees_the_slot():
    m = mk()
    queue(m, "t")
    queue(m, "u")
    grant(m, "r1", "L1", worker="w1")
    out = step(m, CancelRequested("c", "t"))
    assert of(out, SendCancel) == [SendCancel("c", "t", "w1")]
    assert isinstance(failed(out)["t"], CancelledError)
    assert step(m, CancelRequested("c", "t")) == []  # once
    out = finish(m, "t")  # it ran to the end anyway: no second settlement
    assert succeeded(out) == [] and failed(out) == {} and pushed(out) == [("u", "L1")]


def test_cancel_on_a_revoked_lease_returns_it_at_the_end():
    m = mk()
    queue(m, "t")
    grant(m, "r1", "L1")
    step(m, LeasesRevoked("rv", ("L1",)))
    step(m, CancelRequested("c", "t"))
    assert returned(finish(m, "t", "error", error="cancelled")) == ["L1"]


def test_cancel_of_a_task_on_a_lost_worker_is_forgotten():
    m = mk()
    queue(m, "t")
    grant(m, "r1", "L1")
    step(m, CancelRequested("c", "t"))
    out = step(m, WorkerLost("x", "w1", 0.0))
    assert returned(out) == ["L1"] and failed(out) == {} and requests(out) == []
    assert m.tasks == {}


def test_cancel_unknown_task_is_ignored():
    assert mk().handle(CancelRequested("c", "nope")) == []


# -- lost workers --------------------------------------------------------------------------------


def test_a_lost_worker_requeues_its_tasks_first_and_is_avoided():
    m = mk(avoid_lost_s=30.0, max_pending_requests=1)
    queue(m, "a")
    grant(m, "r1", "L1", worker="w1")
    queue(m, "b")
    out = step(m, WorkerLost("x", "w1", 10.0))
    assert returned(out) == ["L1"]
    assert [t.task_id for t in m.queues["k"].tasks] == ["a", "b"]
    assert requests(out) == []  # r2 (for b) is still out
    out = grant(m, "r2", "L2", worker="w1", now=11.0)  # the scheduler did not know yet
    assert returned(out) == ["L2"] and of(out, RequestLease)[0].avoid == ("w1",)
    assert pushed(grant(m, "r3", "L3", worker="w2", now=12.0)) == [("a", "L3")]
    step(m, Tick("t", 41.0))
    assert m.lost == {}


def test_a_new_process_at_a_lost_workers_address_is_asked_for_at_once():
    """WorkerJoined: a worker restarted at its dead predecessor's address (a fixed
    --worker-port) ends the avoidance; the requests that avoid it are asked again."""
    m = mk(avoid_lost_s=30.0, max_pending_requests=1)
    queue(m, "a")
    grant(m, "r1", "L1", worker="w1")
    out = step(m, WorkerLost("x", "w1", 10.0))
    assert returned(out) == ["L1"]
    (req,) = of(out, RequestLease)
    assert req.avoid == ("w1",)  # the only worker, at the scheduler: it would wait 30 s
    out = step(m, WorkerJoined("j", "w1", 11.0))
    assert withdrawn(out) == [req.request_id]
    (again,) = of(out, RequestLease)
    assert again.avoid == () and m.lost == {}
    queue(m, "b")
    # the withdrawn request's answer, a grant crossing the withdraw, serves the backlog
    assert pushed(grant(m, req.request_id, "L2", worker="w1", now=11.1)) == [("a", "L2")]
    assert pushed(grant(m, again.request_id, "L3", worker="w1", now=11.2)) == [("b", "L3")]


def test_a_join_at_an_address_that_was_never_lost_changes_nothing():
    m = mk(max_pending_requests=1)
    queue(m, "a")
    assert step(m, WorkerJoined("j", "w1", 1.0)) == []
    assert m.requests and not m.withdrawn


def test_a_task_that_keeps_killing_workers_fails_after_max_crash_retries():
    m = mk(max_crash_retries=2, max_pending_requests=1)
    queue(m, "t", name="crasher")
    rid = "r1"
    for n in range(1, 4):
        w = f"w{n}"
        assert pushed(grant(m, rid, f"L{n}", worker=w, now=n)) == [("t", f"L{n}")]
        out = step(m, WorkerLost("x", w, n + 0.5))
        if n < 3:
            assert failed(out) == {}
            rid = requests(out)[0]
    err = failed(out)["t"]
    assert type(err) is TaskCrashedError and isinstance(err, YRRuntimeError)
    assert "crasher" in str(err) and "w3" in str(err) and "3 times" in str(err)
    assert "max-task-crashes=2" in str(err) and (err.crashes, err.worker) == (3, "w3")
    assert m.tasks == {}


def lose_until_failed(m: SubmitQueue, limit: int,
                      crashed: bool = False) -> tuple[int, BaseException | None]:
    """Grant each request on a fresh worker and lose it (``crashed``: the process crashed by
    its own hand); (how many losses, the error)."""
    rid = "r1"
    for n in range(1, limit + 1):
        w = f"w{n}"
        assert pushed(grant(m, rid, f"L{n}", worker=w, now=n)) == [("t", f"L{n}")]
        out = step(m, WorkerLost("x", w, n + 0.5, crashed=crashed))
        if "t" in failed(out):
            return n, failed(out)["t"]
        rid = requests(out)[0]
    return limit, None


@pytest.mark.parametrize("own", [0, 1, 5])
def test_a_task_bound_of_reruns_overrides_the_queue_bound(own):
    m = mk(max_crash_retries=2, max_pending_requests=1)
    queue(m, "t", name="crasher", max_crashes=own)
    losses, err = lose_until_failed(m, 10)
    assert losses == own + 1 and isinstance(err, TaskCrashedError)
    assert f"its own bound of {own} reruns" in str(err)



@pytest.mark.parametrize("retries", [0, 2])
def test_a_yr_task_whose_process_crashes_spends_its_retry_times(retries):
    """openYuanrong's rule: a crash of the task's own process (core dump, ``os._exit``) is
    rerun ``retry_times`` times; an eviction or lost host is rerun without spending them, up
    to the queue's bound."""
    m = mk(max_crash_retries=3, max_pending_requests=1)
    queue(m, "t", name="crasher", retries=retries)
    losses, err = lose_until_failed(m, 10, crashed=True)
    assert losses == retries + 1 and type(err) is TaskCrashedError
    assert f"more than retry_times={retries} allows" in str(err) and "crasher" in str(err)
    m = mk(max_crash_retries=3, max_pending_requests=1)
    queue(m, "t", name="evicted", retries=retries)
    losses, err = lose_until_failed(m, 10, crashed=False)
    assert losses == 4 and "max-task-crashes=3" in str(err)


def test_a_task_with_its_own_bound_ignores_how_its_process_ended():
    """Ray's rule: ``max_retries`` bounds every loss of the worker, a crash or not."""
    m = mk(max_crash_retries=3, max_pending_requests=1)
    queue(m, "t", name="ray_task", max_crashes=2)
    losses, err = lose_until_failed(m, 10, crashed=True)
    assert losses == 3 and "its own bound of 2 reruns" in str(err)

def test_a_task_without_a_bound_of_reruns_is_rerun_every_time():
    m = mk(max_crash_retries=2, max_pending_requests=1)
    queue(m, "t", name="crasher", max_crashes=-1)
    losses, err = lose_until_failed(m, 12)
    assert (losses, err) == (12, None) and "t" in m.tasks


def test_a_late_answer_from_a_lost_worker_settles_the_requeued_task():
    m = mk()
    queue(m, "t")
    grant(m, "r1", "L1")
    step(m, WorkerLost("x", "w1", 1.0))
    assert succeeded(finish(m, "t", now=1.1)) == ["t"]
    assert returned(grant(m, "r2", "L2", worker="w2", now=1.2)) == ["L2"]


# -- closing, stale events, story --------------------------------------------------------------


def test_closing_returns_leases_and_any_later_grant():
    m = mk()
    queue(m, "a")
    queue(m, "b")
    grant(m, "r1", "L1")
    assert returned(step(m, Closing("close"))) == ["L1"]
    assert returned(m.handle(LeaseGranted("g", "r2", "L2", "w1", 0.0))) == ["L2"]
    assert m.handle(TaskQueued("s", "c", "k", {}, 1, 1, (), 0, None, "f")) == []
    assert m.handle(Tick("t", 100.0)) == []


def test_stale_events_are_ignored_and_logged():
    m = mk()
    assert m.handle(LeaseGranted("g", "r9", "L9", "w1", 0.0)) == []
    assert m.handle(TaskFinished("d", "nope", "ok", 0.1, None, 0.0)) == []
    assert any("ignored" in str(w) for _sid, w in m.story("r9"))


def test_story_tells_what_happened_to_a_task():
    m = mk()
    queue(m, "t1")
    grant(m, "r1", "L1")
    finish(m, "t1")
    # the hot path logs flat entries named by strings, the rest the objects themselves
    names = [w[0] if isinstance(w[0], str) else type(w[0]).__name__ for _sid, w in m.story("t1")]
    kinds = [n.split()[0] for n in names if n[0].isupper()]  # not the notes ("lease", ...)
    assert kinds == ["TaskQueued", "PushTask", "TaskFinished", "TaskSucceeded"]
    assert any(isinstance(w[0], LeaseGranted) for _sid, w in m.story("L1"))


def test_validate_catches_a_stalled_queue():
    m = mk()
    queue(m, "t")
    m.requests.clear()
    m.queues["k"].requests.clear()
    with pytest.raises(AssertionError, match="stalls"):
        m.validate()


# -- random event sequences -------------------------------------------------------------------


class _Driver:
    """Random but well-formed stimuli for one machine, and the bookkeeping to check it."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.m = SubmitQueue("w0", max_pending_requests=rng.choice([1, 2, 4]),
                             pipeline_depth=rng.choice([1, 2, 4]), lease_idle_s=1.0,
                             avoid_lost_s=rng.choice([0.5, 5.0]),
                             max_crash_retries=rng.choice([0, 1, 3]))
        self.now = 0.0
        self.n = 0
        self.settled: dict[str, int] = {}
        self.submitted: list[str] = []
        self.finished_ok: str | None = None

    def feed(self, ev) -> list:
        out = self.m.handle(ev)
        self.m.validate()
        for ins in out:
            if isinstance(ins, (TaskSucceeded, TaskFailed)):
                self.settled[ins.task_id] = self.settled.get(ins.task_id, 0) + 1
                assert self.settled[ins.task_id] == 1, f"{ins.task_id} settled twice"
            if isinstance(ins, TaskSucceeded):
                assert ins.task_id == self.finished_ok, "success without an ok TASK_DONE"
        return out

    def pushed(self) -> list[tuple[str, str]]:
        return [(t, l.worker) for l in self.m.leases.values() for t in l.tasks]

    def random_step(self) -> None:
        rng, m = self.rng, self.m
        self.finished_ok = None
        r = rng.random()
        if r < 0.25:
            self.n += 1
            tid = f"t{self.n}"
            self.submitted.append(tid)
            key = rng.choice(["a", "b"])
            self.feed(TaskQueued("q", tid, key, {"CPU": 1}, 100, 1 if key == "a" else 2, (),
                                 rng.choice([0, 1]), None, "f"))
        elif r < 0.45 and m.requests:
            rid = rng.choice(sorted(m.requests))
            if rng.random() < 0.85:
                self.n += 1
                self.feed(LeaseGranted("g", rid, f"L{self.n}", rng.choice(["w0", "w1", "w2"]),
                                       self.now))
            else:
                self.feed(LeaseRefused("r", rid, "no"))
        elif r < 0.7 and self.pushed():
            tid, _w = rng.choice(self.pushed())
            outcome = rng.choice(["ok", "ok", "ok", "error", "retryable", "requeue"])
            self.finished_ok = tid if outcome == "ok" else None
            self.feed(TaskFinished("d", tid, outcome, rng.choice([0.001, 0.5]),
                                   None if outcome in ("ok", "requeue") else "e", self.now))
        elif r < 0.75 and self.submitted:
            self.feed(CancelRequested("c", rng.choice(self.submitted)))
        elif r < 0.82 and m.leases:
            ids = tuple(rng.sample(sorted(m.leases), rng.randint(1, len(m.leases))))
            self.feed(LeasesRevoked("rv", ids, rng.random() < 0.5))
        elif r < 0.86:
            self.feed(WorkerLost("x", rng.choice(["w0", "w1", "w2"]), self.now))
        elif r < 0.95:
            self.now += rng.choice([0.01, 0.3, 1.5])
            self.feed(Tick("t", self.now))
        else:  # stale answers
            self.feed(rng.choice([LeaseGranted("g", "r-none", "L-none", "w1", self.now),
                                  TaskFinished("d", "t-none", "ok", 0.1, None, self.now),
                                  LeasesRevoked("rv", ("L-none",))]))

    def drain(self) -> None:
        """A kind scheduler and healthy workers: everything must settle, leases go back."""
        for _ in range(1000):
            m = self.m
            if m.requests:
                rid = sorted(m.requests)[0]
                self.n += 1
                self.finished_ok = None  # on a worker never lost (the scheduler avoids those)
                self.feed(LeaseGranted("g", rid, f"L{self.n}", "w9", self.now))
            elif self.pushed():
                tid, _w = self.pushed()[0]
                self.finished_ok = tid
                self.feed(TaskFinished("d", tid, "ok", 0.5, None, self.now))
            elif m.leases or m.lost:
                self.now += 1.0
                self.feed(Tick("t", self.now))
            else:
                break
        assert not self.m.leases and not self.m.requests and not self.m.tasks
        assert set(self.settled) == set(self.submitted), "a task never settled"


@pytest.mark.parametrize("seed", range(8))
def test_random_event_sequences_keep_the_invariants(seed):
    rng = random.Random(seed)
    for _ in range(400):
        d = _Driver(rng)
        for _ in range(rng.randint(5, 60)):
            d.random_step()
        d.drain()


# -- refs nested in arguments (yr's dependency resolver; objects.pack_recording_refs) -------


class _Holder:
    def __init__(self, inner) -> None:
        self.inner = inner


class _Slotted:
    __slots__ = ("ref",)

    def __init__(self, ref) -> None:
        self.ref = ref

    def __reduce__(self):
        return (_Slotted, (self.ref,))


def _refs(*ids: str) -> list:
    """Real ObjectRefs of a stand-in runtime (pickling a ref asks its runtime's table)."""
    import types

    from yrdask.runtime.object_table import ObjectTable

    rt = types.SimpleNamespace(address="tcp://me:1", closed=False)
    rt.objects = ObjectTable(rt, 1024)
    return [rt.objects.new_ref(i) for i in ids]


def _pack(args: tuple, kwargs: dict) -> list[str]:
    from yrdask.runtime.objects import ObjectRef, pack_recording_refs
    from yrdask.serialization import pack_args

    (_blob, _top), nested = pack_recording_refs(pack_args, args, kwargs,
                                                lambda v: isinstance(v, ObjectRef))
    return sorted(r._id for r in nested)


def test_nested_refs_are_the_ones_pickled_inside_the_arguments_not_at_top_level():
    top, a, b, c, d, e = _refs(*"tabcde")
    args = (top, [a, (b, {"k": c})], _Holder(_Holder(d)))
    kwargs = {"x": {frozenset([1]): [e, a]}, "y": _Slotted(a), "z": top}
    assert _pack(args, kwargs) == ["a", "b", "c", "d", "e"]  # each once, no "t"


def test_no_nested_ref_records_nothing_and_recording_ends_with_the_pack():
    import pickle

    from yrdask.runtime import objects

    (a,) = _refs("a")
    assert _pack((a, 1, "x", [2, 3]), {"k": {"v": 4}}) == []
    pickle.dumps([a])  # outside a pack: nothing records
    assert getattr(objects._pickled, "refs", None) is None


def test_cycles_and_shared_containers_record_a_ref_once():
    (a,) = _refs("a")
    loop: list = [a]
    loop.append(loop)
    shared = [a]
    assert _pack((loop, shared, shared), {}) == ["a"]

