"""The one crash-charging rule (``runtime/call_order.py``: ``crash_window``,
``charge_crash``) and its user without I/O, ``CallOrder``: each caller charges its calls
when it loses the process they went to (a worker, or a process instance's own process), at
concurrency 1, > 1 and unbounded, each call by its own bound."""

from __future__ import annotations

import pytest

from yrdask.errors import CallCrashedError, TaskCrashedError, describe_exit
from yrdask.runtime import call_order as C
from yrdask.runtime.call_order import charge_crash, crash_window, may_redeliver
from yrdask.worker.isolated.zygote import describe_exit_of


def counter(crashes: dict):
    def charge(cid: str) -> int:
        crashes[cid] = crashes.get(cid, 0) + 1
        return crashes[cid]
    return charge


def bound(n: int):
    return lambda _cid: n


# -- the rule --------------------------------------------------------------------------


def test_the_window_is_the_oldest_concurrency_unanswered_calls():
    assert [crash_window(n, 1) for n in (0, 1, 5)] == [0, 1, 1]
    assert [crash_window(n, 3) for n in (0, 2, 5)] == [0, 2, 3]
    assert crash_window(7, 0) == 7  # unknown concurrency: every unanswered call counts


def test_concurrency_one_charges_only_the_oldest_and_the_rest_go_again_in_order():
    crashes: dict[str, int] = {}
    resend, failed = charge_crash(["a", "b", "c"], 1, counter(crashes), bound(1))
    assert resend == ["a", "b", "c"] and failed == [] and crashes == {"a": 1}


def test_concurrency_two_charges_the_two_that_may_have_run():
    crashes = {"b": 1}
    resend, failed = charge_crash(["a", "b", "c", "d"], 2, counter(crashes), bound(1))
    assert resend == ["a", "c", "d"] and failed == [("b", 2)]
    assert crashes == {"a": 1, "b": 2}  # the caller forgets a failed call's count


def test_unbounded_concurrency_charges_every_unanswered_call():
    crashes: dict[str, int] = {}
    resend, failed = charge_crash(["a", "b", "c"], 1000, counter(crashes), bound(0))
    assert resend == [] and failed == [("a", 1), ("b", 1), ("c", 1)]


def test_bounds_zero_and_minus_one():
    assert charge_crash(["a"], 1, counter({}), bound(0)) == ([], [("a", 1)])
    crashes = {"a": 99}
    assert charge_crash(["a", "b"], 1, counter(crashes), bound(-1)) == (["a", "b"], [])
    assert crashes == {"a": 100}
    assert [may_redeliver(n, 1) for n in (1, 2)] == [True, False]
    assert may_redeliver(10**6, -1) and not may_redeliver(1, 0)


# -- a lost worker: CallOrder --------------------------------------------------------------


def _order_with_calls(concurrency: int, n: int) -> C.CallOrder:
    m = C.CallOrder(max_redeliveries=1)
    m.handle(C.CreateRequested("s", "i"))
    m.handle(C.HandleAdded("s", "i"))
    m.handle(C.CreateDepsReady("s", "i"))
    m.handle(C.Created("s", "i", "w1", "i"))
    for k in range(n):
        m.handle(C.CallSubmitted("s", f"c{k}", "i", concurrency=concurrency))
    return m


def _lose(m: C.CallOrder, worker: str, to: str) -> tuple[list, list]:
    """Lose ``worker``; the instance is located again at ``to``: (sent, failed) calls (the
    ones past their bound fail once it is known to live on)."""
    out = m.handle(C.ChannelLost("s", worker))
    assert not any(isinstance(i, C.CallFailed) for i in out)
    m.validate()
    out = m.handle(C.Located("s", "i", to, "", "i"))
    failed = [i.call_id for i in out if isinstance(i, C.CallFailed)]
    sent = [i.call_id for i in out if isinstance(i, C.SendCall)]
    m.validate()
    return sent, failed


@pytest.mark.parametrize("concurrency, failing", [(1, ["c0"]), (2, ["c0", "c1"]),
                                                   (0, ["c0", "c1", "c2"])])
def test_a_lost_worker_charges_up_to_the_instances_concurrency(concurrency, failing):
    """Concurrency 2: both of the oldest two calls may have run, both are charged; a second
    loss fails both (bound 1) and the third, never started, goes on."""
    m = _order_with_calls(concurrency, 3)
    assert _lose(m, "w1", "w2") == (["c0", "c1", "c2"], [])
    sent, failed = _lose(m, "w2", "w1")
    assert failed == failing and sent == [c for c in ("c0", "c1", "c2") if c not in failing]


def test_a_lost_worker_at_concurrency_two_charges_calls_answered_out_of_order():
    m = _order_with_calls(2, 3)
    m.handle(C.CallDone("s", "c0"))  # c1 and c2 may both run now
    _lose(m, "w1", "w2")
    m.handle(C.ChannelLost("s", "w2"))
    out = m.handle(C.Located("s", "i", "w1", "", "i"))
    failed = [i for i in out if isinstance(i, C.CallFailed)]
    assert [f.call_id for f in failed] == ["c1", "c2"]
    assert all(isinstance(f.error, CallCrashedError) for f in failed)
    assert "2 times" in str(failed[0].error)


def test_each_call_is_charged_by_its_own_bound():
    """A call's own bound (Ray's max_task_retries, of the method or the call): 0 fails it at
    the first loss of its process, -1 redelivers it however often, none takes the default
    (1 here).  A process instance's callers apply it as a lost worker's do."""
    m = C.CallOrder(max_redeliveries=1)
    for ev in (C.CreateRequested("s", "i"), C.HandleAdded("s", "i"),
               C.CreateDepsReady("s", "i"), C.Created("s", "i", "p1", "i")):
        m.handle(ev)
    for cid, own in (("c0", 0), ("c1", -1), ("c2", None)):
        m.handle(C.CallSubmitted("s", cid, "i", max_redeliveries=own, concurrency=3))
    outcomes = [_lose(m, f"p{n}", f"p{n + 1}") for n in range(1, 5)]
    assert outcomes == [(["c1", "c2"], ["c0"]), (["c1"], ["c2"]), (["c1"], []), (["c1"], [])]


# -- what errors say -------------------------------------------------------------------------


def test_exit_descriptions_name_the_code_or_the_signal():
    assert describe_exit_of(12, 3) == "its isolated process (pid 12) exited with code 3"
    assert describe_exit_of(12, -11) == ("its isolated process (pid 12) was killed by signal "
                                         "11 (SIGSEGV)")
    assert describe_exit(-9) == "was killed by signal 9 (SIGKILL)"


def test_crash_errors_keep_their_type_and_fields_when_they_learn_the_exit():
    task = TaskCrashedError("task t (f) was lost with its worker 4 times", 4, "tcp://w:1")
    told = task.with_exit(describe_exit(3))
    assert type(told) is TaskCrashedError and (told.crashes, told.worker) == (4, "tcp://w:1")
    assert str(told) == "task t (f) was lost with its worker 4 times; its process exited with code 3"
    call = CallCrashedError("method 'm': call c ...", "tcp://w:2").with_exit(describe_exit(-11))
    assert type(call) is CallCrashedError and call.worker == "tcp://w:2"
    assert str(call).endswith("; its process was killed by signal 11 (SIGSEGV)")
