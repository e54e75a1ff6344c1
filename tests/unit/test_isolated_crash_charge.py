"""The crash charge of an isolated instance's calls when its process dies (pure rule, the
one of ``runtime/call_order.py``: callers by their stable ids, several calls in flight)."""

from __future__ import annotations

from yrdask.errors import CallCrashedError, TaskCrashedError, describe_exit
from yrdask.runtime.call_order import may_redeliver
from yrdask.worker.isolated import caller_of, charge_crash, describe_exit_of


def test_each_callers_oldest_call_is_charged_and_the_rest_go_again_in_order():
    crashes: dict[str, int] = {}
    pending = [("A", "a1"), ("B", "b1"), ("A", "a2"), ("B", "b2")]
    resend, failed = charge_crash(pending, crashes, max_redeliveries=1)
    assert resend == ["a1", "b1", "a2", "b2"] and failed == []
    assert crashes == {"a1": 1, "b1": 1}


def test_a_call_past_the_bound_fails_and_the_calls_behind_it_go_again():
    crashes = {"a1": 1}
    resend, failed = charge_crash([("A", "a1"), ("A", "a2")], crashes, max_redeliveries=1)
    assert resend == ["a2"] and failed == [("a1", 2)]
    assert crashes == {}  # forgotten once failed


def test_zero_redeliveries_fails_the_running_call_at_once_and_minus_one_never():
    assert charge_crash([("A", "a1")], {}, max_redeliveries=0) == ([], [("a1", 1)])
    crashes = {"a1": 99}
    assert charge_crash([("A", "a1")], crashes, max_redeliveries=-1) == (["a1"], [])
    assert crashes == {"a1": 100}


def test_one_caller_over_several_channels_is_charged_once():
    """Calls of one caller in flight together (concurrency > 1, async methods, a channel
    reopened): the caller id, not the channel, says whose oldest call was running."""
    crashes: dict[str, int] = {}
    resend, failed = charge_crash([("A", "a1"), ("A", "a2"), ("A", "a3")], crashes, 1)
    assert resend == ["a1", "a2", "a3"] and crashes == {"a1": 1}
    # a1 answered meanwhile; next death: a2 is the oldest now, and only it is charged
    del crashes["a1"]
    resend, failed = charge_crash([("A", "a2"), ("A", "a3")], crashes, 1)
    assert crashes == {"a2": 1} and failed == []


def test_the_bound_is_the_rule_call_order_applies():
    assert [may_redeliver(n, 1) for n in (1, 2)] == [True, False]
    assert may_redeliver(10**6, -1) and not may_redeliver(1, 0)


def test_callers_are_named_by_their_owner_address():
    class Peer:
        caller = "tcp://driver:1"

    assert caller_of(Peer()) == "tcp://driver:1"
    anonymous = object()
    assert caller_of(anonymous) == caller_of(anonymous) != caller_of(object())


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
