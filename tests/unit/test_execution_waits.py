"""A task's thread blocked in ``yr.get``/``yr.wait`` (``worker/execution.py``'s wait hook):
a cancel ends the wait with ``CancelledError`` raised in that thread, shielded from the
asynchronous interrupt; other threads wait as before (no cluster)."""

from __future__ import annotations

import threading
import time

import pytest

from yrdask.errors import CancelledError
from yrdask.runtime import context
from yrdask.runtime.object_access import block
from yrdask.worker.execution import Execution


def test_a_cancel_ends_the_wait_of_the_task_thread_it_cancels():
    ex = Execution("t1", None, {})
    assert ex.arm("lease-1", "job-1")
    never = threading.Event()
    canceller = threading.Timer(0.2, ex.cancel)
    canceller.start()
    start = time.monotonic()
    try:
        with pytest.raises(CancelledError):
            block(never.wait, None)  # would wait forever
        assert time.monotonic() - start < 5  # the cancel (0.2 s) ended it
        assert ex.armed and not ex.shielded  # back in user code, as the cancel left it
    finally:
        canceller.join()
        ex.disarm()
    assert context.current_lease() is None


def test_an_uncancelled_task_thread_waits_as_asked():
    ex = Execution("t2", None, {})
    assert ex.arm("lease-2", "job-2")
    try:
        ready = threading.Event()
        threading.Timer(0.15, ready.set).start()
        assert block(ready.wait, 30) is True  # woken by the set, across wait slices
        start = time.monotonic()
        assert block(threading.Event().wait, 0.25) is False  # the timeout, across slices
        assert time.monotonic() - start >= 0.25
        assert ex.armed and not ex.shielded and not ex.cancelled
    finally:
        ex.disarm()


def test_a_thread_with_no_task_waits_plainly():
    seen = []

    def wait(timeout):
        seen.append(timeout)
        return False

    assert block(wait, None) is False
    assert seen == [None]  # one plain wait, not slices
