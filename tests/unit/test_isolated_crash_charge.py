"""The crash charge of an isolated instance's calls when its process dies (pure rule)."""

from __future__ import annotations

from yrdask.errors import CallCrashedError, TaskCrashedError, describe_exit
from yrdask.worker.isolated import charge_crash, describe_exit_of


def calls(*spec: tuple[object, str]) -> list:
    return [(peer, {"task_id": cid}) for peer, cid in spec]


def ids(entries: list) -> list[str]:
    return [e[1]["task_id"] for e in entries]


def test_each_callers_oldest_call_is_charged_and_the_rest_go_again_in_order():
    a, b = object(), object()
    crashes: dict[str, int] = {}
    pending = calls((a, "a1"), (b, "b1"), (a, "a2"), (b, "b2"))
    resend, failed = charge_crash(pending, crashes, max_redeliveries=1)
    assert ids(resend) == ["a1", "b1", "a2", "b2"] and failed == []
    assert crashes == {"a1": 1, "b1": 1}


def test_a_call_past_the_bound_fails_and_the_calls_behind_it_go_again():
    a = object()
    crashes = {"a1": 1}
    resend, failed = charge_crash(calls((a, "a1"), (a, "a2")), crashes, max_redeliveries=1)
    assert ids(resend) == ["a2"]
    assert [(f[1]["task_id"], f[2]) for f in failed] == [("a1", 2)]
    assert crashes == {}  # forgotten once failed


def test_zero_redeliveries_fails_the_running_call_at_once():
    a = object()
    resend, failed = charge_crash(calls((a, "a1")), {}, max_redeliveries=0)
    assert resend == [] and ids(failed) == ["a1"]


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
