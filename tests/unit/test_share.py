"""WorkerShare (yrdask/worker/share.py) with plain threads: who waits for whom."""

from __future__ import annotations

import threading

import pytest

from yrdask.worker.share import WorkerShare

pytestmark = pytest.mark.timeout(30)


def started(fn) -> tuple[threading.Thread, threading.Event]:
    done = threading.Event()

    def run() -> None:
        fn()
        done.set()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, done


def test_dask_waits_for_yr_and_yr_for_dask():
    yr = [1]  # one yr task running, as the gate would count it
    share = WorkerShare(1, lambda: yr[0])
    t, took = started(lambda: (share.dask_take(), share.dask_give()))
    assert not took.wait(0.2), "a Dask task took the one thread a yr task uses"
    yr[0] = 0
    share.yr_freed()
    assert took.wait(5)
    t.join(5)
    assert share.dask == 0 and share.held == set()
    # a Dask task holding the thread: a yr task the gate starts waits for it
    share.dask_take()
    yr[0] = 1
    t2, ran = started(share.yr_start)
    assert not ran.wait(0.2), "a yr task ran beside a Dask task on a one-thread worker"
    share.dask_give()
    assert ran.wait(5)
    t2.join(5)
    assert share.dask == 0 and share.yr_waiting == 0


def test_yr_never_waits_when_no_dask_task_is_there():
    share = WorkerShare(1, lambda: 5)  # yr's ledger let five run (fractional CPUs)
    share.yr_start()  # returns at once
    assert share.yr_waiting == 0


def test_a_dask_task_lends_its_share_in_yr_get():
    yr = [0]
    share = WorkerShare(1, lambda: yr[0])
    share.dask_take()
    share.dask_lend(True)  # it waits in yr.get: the yr task it waits for may run
    assert share.dask == 0
    yr[0] = 1
    share.yr_start()
    yr[0] = 0
    share.yr_freed()
    share.dask_lend(False)  # runs again: takes a share back
    assert share.dask == 1 and len(share.held) == 1
    share.dask_give()
    assert share.dask == 0


def test_the_gate_counts_what_yr_takes_of_the_share():
    """yr's side of the share is the lease gate's count: started, not ended, not lent."""
    from yrdask.worker import lease_gate as G

    gate = G.LeaseGate()
    gate.handle(G.TaskArrived("s", "t1", "L", 2, 0.0))
    gate.handle(G.TaskArrived("s", "t2", "L", 2, 0.0))
    gate.handle(G.TaskArrived("s", "t3", "L", 2, 0.0))  # waits behind the two
    assert gate.active() == 2
    gate.handle(G.SlotLent("s", "L", True))  # t1 or t2 waits in yr.get: t3 starts
    assert gate.active() == 2 and gate.running() == 3
    gate.handle(G.TaskEnded("s", "t3"))
    assert gate.active() == 1
    gate.validate()


def test_method_calls_take_a_share_and_lend_it_in_yr_get():
    share = WorkerShare(1, lambda: 0)
    share.call_start()  # no Dask task: counted, never waits
    assert share.busy() == 1
    t, took = started(lambda: (share.dask_take(), share.dask_give()))
    assert not took.wait(0.2), "a Dask task took the one thread a method call uses"
    share.call_lend(True)  # the call waits in yr.get: its thread is free meanwhile
    assert took.wait(5)
    t.join(5)
    share.call_lend(False)
    share.call_end()
    assert share.busy() == 0 and not share.calls_lent
    # a Dask task holding the thread: a method call waits for it, uncounted meanwhile
    share.dask_take()
    t2, ran = started(lambda: (share.call_start(), share.call_end()))
    assert not ran.wait(0.2), "a method call ran beside a Dask task on a one-thread worker"
    assert share.busy() == 1
    share.dask_give()
    assert ran.wait(5)
    t2.join(5)
    assert share.busy() == 0 and share.dask == 0
