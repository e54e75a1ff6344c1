"""Ray's cancel of a method call at its caller (``runtime/call_router.py``'s rules, which
``InstanceRouter`` and the simulation's instance world both run): what a cancel does before
and after the call left, and what a cancelled call's answer settles it with."""
from __future__ import annotations

import pytest

from yrdask import protocol as P
from yrdask.errors import CancelledError, InstanceDiedError, RemoteError
from yrdask.runtime.call_router import cancel_effect, cancelled_answer

pytestmark = pytest.mark.timeout(30)


def test_a_call_not_sent_yet_fails_at_once_and_a_sent_one_tells_its_worker():
    now = cancel_effect("c1", None)
    assert isinstance(now, CancelledError) and "c1" in str(now)
    told = cancel_effect("c2", "tcp://w:1", recursive=True)
    assert type(told) is P.CancelTask
    assert (told.task_id, told.recursive) == ("c2", True)


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
