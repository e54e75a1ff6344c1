"""Threads follow CPUs (SPEC §5, §6; docs/nodes.md): work holding N whole CPUs runs with N
BLAS threads and starts processes with ``OMP_NUM_THREADS=N``; work holding less gets 1; the
user's own setting wins.  On the suite's embedded cluster: one node of 2 CPUs."""

from __future__ import annotations

import subprocess
import sys

import cloudpickle
import pytest

import yrdask as yr
from conftest import wait_until

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers need not import us

pytestmark = pytest.mark.timeout(120)

T = 60  # seconds: explicit yr.get bound, well under the test time-out


def threads_seen() -> tuple[int, str | None, str | None]:
    """(BLAS threads numpy's library runs with, ``OMP_NUM_THREADS`` of a process started
    now, ``OPENBLAS_NUM_THREADS`` of that process)."""
    import numpy  # noqa: F401 - loads its BLAS
    from threadpoolctl import threadpool_info

    blas = [i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"]
    out = subprocess.run(["sh", "-c", 'echo "$OMP_NUM_THREADS,$OPENBLAS_NUM_THREADS"'],
                         capture_output=True, text=True, check=True).stdout.strip()
    omp, openblas = out.split(",")
    return max(blas), omp or None, openblas or None


probe = yr.invoke(threads_seen)


def _probe(**options) -> tuple:
    return yr.get(probe.options(yr.InvokeOptions(memory=0, **options)).invoke(), T)


@yr.instance
class Holder:
    """An instance whose methods report what :func:`threads_seen` sees."""

    def __init__(self) -> None:
        self.at_init = threads_seen()

    def seen(self) -> tuple:
        return self.at_init, threads_seen()


def test_a_yr_task_holding_2_cpus_runs_with_2_threads_and_a_500_millicore_one_with_1(
        cluster):
    cluster()
    assert _probe(cpu=2000) == (2, "2", "2")
    assert _probe(cpu=500) == (1, "1", "1")  # and the 2-CPU task's limits were put back
    assert _probe(cpu=1500) == (1, "1", "1")  # 1 whole CPU


def test_an_instance_holding_2_cpus_sees_2_in_init_and_methods_and_gives_them_back(cluster):
    cluster()
    inst = Holder.options(yr.InvokeOptions(cpu=2000, memory=0)).invoke()
    try:
        assert yr.get(inst.seen.invoke(), T) == ((2, "2", "2"), (2, "2", "2"))
    finally:
        inst.terminate()
    # the instance's CPUs went back with it (its process's limits too, once it stopped
    # there): 1-CPU tasks see 1 wherever they run
    wait_until(lambda: {_probe(cpu=1000) for _ in range(4)} == {(1, "1", "1")}, 30,
               "1-CPU tasks still see the stopped 2-CPU instance's threads")


def test_isolated_work_holding_2_cpus_gets_them_in_its_process_and_the_users_env_wins(
        cluster):
    cluster()
    assert _probe(cpu=2000, env_vars={"YR_THREADS_TEST": "1"}) == (2, "2", "2")
    # the user's OMP_NUM_THREADS wins, and sizes the friends it leaves unset
    assert _probe(cpu=2000, env_vars={"OMP_NUM_THREADS": "3"}) == (3, "3", "3")
    assert _probe(cpu=2000, env_vars={"OPENBLAS_NUM_THREADS": "1"}) == (1, "2", "1")


def test_ray_num_cpus_2_task_and_actor_run_with_2_threads(ray_env):
    ray = ray_env
    remote = ray.remote(threads_seen)
    assert ray.get(remote.options(num_cpus=2).remote(), timeout=T) == (2, "2", "2")
    assert ray.get(remote.remote(), timeout=T) == (1, "1", "1")
    env = {"env_vars": {"OMP_NUM_THREADS": "3"}}
    assert ray.get(remote.options(num_cpus=2, runtime_env=env).remote(),
                   timeout=T) == (3, "3", "3")

    @ray.remote(num_cpus=2)
    class Actor:
        def seen(self) -> tuple:
            return threads_seen()

    actor = Actor.remote()
    assert ray.get(actor.seen.remote(), timeout=T) == (2, "2", "2")
    ray.kill(actor)
