"""Threads follow CPUs, the rules without a cluster: lease marks, the environment of a process
of its own, and one process's limits under concurrent work (worker/threads.py)."""

from __future__ import annotations

import os

import numpy  # noqa: F401 - loads the BLAS whose limits these tests follow
import pytest
from threadpoolctl import threadpool_info

from yrdask import protocol as P
from yrdask.worker.threads import (THREAD_ENV, ThreadLimits, _in_setter, instance_cpus,
                                   isolation_env)


def blas_threads() -> int:
    return max(i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas")


def set_blas(n: int) -> None:
    """Set the BLAS limit as yrdask does, from the process's setter thread (OpenBLAS keeps
    the limits of the first thread that sets one)."""
    from threadpoolctl import threadpool_limits

    _in_setter(threadpool_limits, n, "blas")


@pytest.fixture
def limits(monkeypatch) -> ThreadLimits:
    """A process's limits, starting as a Dask worker's do (1 everywhere)."""
    for key in THREAD_ENV:
        monkeypatch.setenv(key, "1")
    before = blas_threads()
    set_blas(1)
    t = ThreadLimits()
    yield t
    assert t.limit == 0, "a test left its holds"
    set_blas(before)


@pytest.mark.parametrize("cpus, lease", [(0.5, "L1"), (1.0, "L1"), (1.9, "L1"),
                                         (2.0, "L1#CPU=2"), (4.5, "L1#CPU=4")])
def test_a_lease_of_2_whole_cpus_or_more_says_so_in_its_id(cpus, lease):
    assert P.mark_lease("L1", [], cpus) == lease
    assert P.lease_cpus(lease) == (int(cpus) if cpus >= 2 else 0)


def test_a_device_lease_keeps_its_devices_and_cores():
    lease = P.mark_lease("L2", ["0", "NPU:1"], 1.5)
    assert P.lease_devices(lease) == ("0,NPU:1", 1.5) and P.lease_cpus(lease) == 1.5


def test_an_instance_holds_threads_only_for_2_whole_cpus_or_more():
    assert instance_cpus({"shape": {"CPU": 2500.0}}) == 2
    assert instance_cpus({"shape": {"CPU": 1999.0}}) == 0
    assert instance_cpus({}) == 0


def test_a_process_of_its_own_gets_its_whole_cpus_and_the_users_variables_win():
    assert isolation_env(None, 2.7) == dict.fromkeys(THREAD_ENV, "2")
    assert isolation_env({"A": "b"}, 0.5) == {**dict.fromkeys(THREAD_ENV, "1"), "A": "b"}
    # the user's OMP_NUM_THREADS sizes the friends they leave unset; theirs stay as set
    assert isolation_env({"OMP_NUM_THREADS": "3", "MKL_NUM_THREADS": "5"}, 2) == {
        **dict.fromkeys(THREAD_ENV, "3"), "MKL_NUM_THREADS": "5"}


def test_the_largest_holder_sets_the_process_limit_and_the_last_one_puts_it_back(limits):
    limits.hold(2)
    assert (blas_threads(), os.environ["OMP_NUM_THREADS"]) == (2, "2")
    limits.hold(3)
    limits.hold(2)
    assert (blas_threads(), os.environ["OPENBLAS_NUM_THREADS"]) == (3, "3")
    limits.release(2)
    assert blas_threads() == 3  # the 3-CPU work still runs
    limits.release(3)
    assert (blas_threads(), os.environ["MKL_NUM_THREADS"]) == (2, "2")
    limits.release(2)
    assert blas_threads() == 1
    assert all(os.environ[key] == "1" for key in THREAD_ENV)


def test_a_variable_the_users_code_set_while_it_ran_stays_theirs(limits, monkeypatch):
    limits.hold(2)
    os.environ["OMP_NUM_THREADS"] = "5"  # the user's code, in the running work
    limits.hold(3)
    assert os.environ["OMP_NUM_THREADS"] == "5"
    assert os.environ["MKL_NUM_THREADS"] == "3"
    limits.release(3)
    limits.release(2)
    assert os.environ["OMP_NUM_THREADS"] == "5"  # neither raised nor put back
    assert os.environ["MKL_NUM_THREADS"] == "1" and blas_threads() == 1


def test_work_in_a_thread_of_its_own_has_nothing_to_put_back_without_openmp(limits):
    # numpy's OpenBLAS here uses pthreads: no OpenMP library is loaded, so no per-thread limit
    if any(i["user_api"] == "openmp" for i in threadpool_info()):
        pytest.skip("an OpenMP runtime is loaded in this process")
    assert limits.enter_thread(2) is None
    limits.leave_thread(None)
