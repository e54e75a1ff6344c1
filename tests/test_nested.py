"""Nested work on small embedded clusters (SPEC §2: a blocked task gives its CPU back)."""

from __future__ import annotations

import time

import pytest

import yrdask as yr

pytestmark = pytest.mark.timeout(180)

T = 120  # seconds: explicit yr.get bound, well under the test time-out


@pytest.fixture
def one_cpu(cluster):
    return cluster(kind="embedded", num_cpus=1)


@yr.invoke
def rsum(lo, hi):
    if hi - lo <= 10:
        return sum(range(lo, hi))
    mid = (lo + hi) // 2
    left, right = rsum.invoke(lo, mid), rsum.invoke(mid, hi)
    return yr.get(left) + yr.get(right)


@yr.invoke
def level3(x):
    return x * 2


@yr.invoke
def level2(x):
    return yr.get(level3.invoke(x)) + 1


@yr.invoke
def level1(x):
    return yr.get(level2.invoke(x)) + 1


@yr.invoke
def level1_returns_ref(x):
    return level2.invoke(x)


@yr.invoke
def fan_in(n):
    return sum(yr.get([level3.invoke(i) for i in range(n)]))


@yr.invoke(invoke_options=yr.InvokeOptions(cpu=1000))
def whole_cpu_inner(x):
    return x + 1


@yr.invoke(invoke_options=yr.InvokeOptions(cpu=1000))
def whole_cpu_outer(x):
    return yr.get(whole_cpu_inner.invoke(x)) + 1


@yr.invoke
def work(i):
    time.sleep(0.01)
    return i * i


def test_recursive_divide_and_conquer_sum(one_cpu):
    assert yr.get(rsum.invoke(0, 100), T) == 4950


def test_three_levels_deep(one_cpu):
    assert yr.get(level1.invoke(5), T) == 12
    inner = yr.get(level1_returns_ref.invoke(5), T)
    assert yr.get(inner, T) == 11


def test_nested_fan_in(one_cpu):
    assert yr.get(fan_in.invoke(10), T) == sum(2 * i for i in range(10))


def test_blocked_task_gives_back_its_whole_cpu(one_cpu):
    # Both tasks ask for the only CPU: the inner one can run only if the outer one,
    # blocked in yr.get, gives its CPU back.
    assert yr.get(whole_cpu_outer.invoke(1), T) == 3


@yr.invoke(invoke_options=yr.InvokeOptions(cpu=1000))
def reader(key):
    yr.kv_write(f"{key}-started", b"1")
    return yr.kv_read(key, 60)


@yr.invoke(invoke_options=yr.InvokeOptions(cpu=1000))
def writer(key):
    yr.kv_write(key, b"written")
    return True


def test_a_wait_that_lasts_lends_the_cpu_to_another_submitters_work(one_cpu):
    """The reader holds the only CPU and waits for a key that the driver's writer task will
    write.  Its worker asks for no lease, so only the lend-delay timer (worker/lending.py)
    tells the scheduler of the wait: without it the writer never runs."""
    r = reader.invoke("lend-key")
    assert yr.kv_read("lend-key-started", 60) == b"1"  # the reader runs (and holds the CPU)
    w = writer.invoke("lend-key")
    assert yr.get(r, T) == b"written"
    assert yr.get(w, T) is True


def test_wait_based_back_pressure(one_cpu):
    results, pending = [], []
    for i in range(100):
        if len(pending) >= 20:
            ready, pending = yr.wait(pending, wait_num=1, timeout=10)
            assert ready, "no task finished within 10 s"
            results.extend(yr.get(ready, T))
        pending.append(work.invoke(i))
        assert len(pending) <= 20
    results.extend(yr.get(pending, T))
    assert sorted(results) == [i * i for i in range(100)]


@yr.invoke(invoke_options=yr.InvokeOptions(cpu=1000))
def whole_cpu_fan_out(n):
    return yr.get([whole_cpu_inner.invoke(i) for i in range(n)], 60)


def _lease_counters() -> dict:
    from yrdask import protocol as P
    from yrdask.runtime.context import current_runtime

    return current_runtime().scheduler_call(P.CLUSTER_INFO, instances=False)["counters"]


def test_a_drained_children_queue_withdraws_its_waiting_lease_requests(one_cpu, wait_until):
    """Three whole-CPU children on one CPU: one runs on the parent's lent CPU at a time, so
    two of their worker's lease requests wait throughout; once the children are done the
    queue withdraws them (WITHDRAW_LEASE_REQUESTS on the worker stream), instead of letting
    them be granted later and returned at once."""
    before = _lease_counters().get("requests_withdrawn", 0)
    assert yr.get(whole_cpu_fan_out.invoke(3), T) == [1, 2, 3]
    wait_until(lambda: _lease_counters()["requests_withdrawn"] > before, 10,
               lambda: f"no lease request withdrawn: {_lease_counters()}")


# -- nested fan-out wider than the slots (num_cpus=2: 4 task slots of 500 millicores) --------


@yr.invoke
def leaf(x):
    return x * 2


@yr.invoke
def outer(i):
    return sum(yr.get([leaf.invoke(i * 100 + j) for j in range(3)], 60))


@pytest.mark.parametrize("n", [5, 12, 40])
def test_outer_tasks_more_than_slots_each_getting_children(cluster, n):
    """More outer tasks than slots, each blocked in yr.get on its own children: blocked
    tasks lend their slots, so every child runs and every outer task completes."""
    cluster(kind="embedded", num_cpus=2)
    got = yr.get([outer.invoke(i) for i in range(n)], 90)
    assert got == [sum(2 * (i * 100 + j) for j in range(3)) for i in range(n)]
