"""The zygote's spare processes (docs/isolation.md, "Cost"): each worker's zygote keeps
``yrdask.instances.spare-processes`` children forked and listening, a process instance's
creation is handed one (its environment applied then), and a spare is no instance: the
scheduler never hears of it, and it ends with its worker.

The embedded cluster has one worker process here, so there is one zygote; the tests of warm
zygotes (the scheduler has every worker start its zygote once the cluster places its first
process instance) run on two.
"""

from __future__ import annotations

import os
import signal

import psutil
import pytest

import yrdask as yr
from conftest import dask_worker_pids, wait_until, wake_ups

pytestmark = pytest.mark.timeout(120)

T = 60


@yr.instance
class Where:
    def __init__(self) -> None:
        self.pid = os.getpid()

    def where(self) -> dict:
        return {"pid": os.getpid(), "ppid": os.getppid(),
                "env": os.environ.get("YR_SPARE_TEST"), "cwd": os.getcwd()}


def process(**kw) -> yr.InvokeOptions:
    return yr.InvokeOptions(cpu=50, memory=10, light=False, **kw)


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def spares(zygote: int, instances: set[int]) -> set[int]:
    """The zygote's live children that host no instance."""
    return {c.pid for c in psutil.Process(zygote).children() if c.pid not in instances
            and alive(c.pid)}


def scheduler_instances(address: str) -> set[str]:
    """The instance ids the scheduler's lifecycle knows."""
    from distributed import Client

    def ids(dask_scheduler):
        return list(dask_scheduler.extensions["yr"].instances.lifecycle.instances)

    with Client(address, timeout=30) as client:
        return set(client.run_on_scheduler(ids))


def test_a_creation_is_handed_the_spare_and_a_spare_is_no_instance(cluster, tmp_path):
    # a fresh cluster: the process of an instance that an earlier test terminated may still
    # be exiting (terminate() does not wait for it), and would count as a spare here
    cluster.finalize()
    address = cluster(kind="embedded", num_cpus=1).address
    first = Where.options(process()).invoke()
    one = yr.get(first.where.invoke(), T)
    zygote = one["ppid"]
    spare = wait_until(lambda: (s := spares(zygote, {one["pid"]})) and s, T,
                       "the zygote to fork a spare after the first creation")
    assert len(spare) == 1, spare  # yrdask.instances.spare-processes: 1 (the default)
    # The next creation is that process, with its own environment and directory applied.
    second = Where.options(process(env_vars={"YR_SPARE_TEST": "mine"},
                                   runtime_env={"working_dir": str(tmp_path)})).invoke()
    two = yr.get(second.where.invoke(), T)
    assert {two["pid"]} == spare
    assert (two["env"], two["cwd"], two["ppid"]) == ("mine", str(tmp_path), zygote)
    assert one["env"] is None
    # A new spare took its place; the scheduler knows the two instances and nothing else.
    again = wait_until(lambda: (s := spares(zygote, {one["pid"], two["pid"]})) and s, T,
                       "a new spare after the second creation")
    assert len(again) == 1 and not again & {one["pid"], two["pid"]}, again
    assert scheduler_instances(address) == {first.instance_id, second.instance_id}
    for h in (first, second):
        h.terminate()
    wait_until(lambda: not alive(one["pid"]) and not alive(two["pid"]), 30,
               "the terminated instances' processes to end")
    assert alive(again.pop())  # the spare stays for the next creation
    assert scheduler_instances(address) == set()


def test_no_spare_outlives_its_worker(cluster):
    cluster(kind="embedded", num_cpus=1)
    h = Where.options(process()).invoke()
    me = yr.get(h.where.invoke(), T)
    zygote = me["ppid"]
    spare = wait_until(lambda: (s := spares(zygote, {me["pid"]})) and s, T, "a spare")
    worker = psutil.Process(zygote).ppid()
    assert worker != os.getpid()
    os.kill(worker, signal.SIGKILL)  # no close, no cleanup
    wait_until(lambda: not any(alive(p) for p in {zygote, me["pid"], *spare}), 30,
               "the zygote, its instance and its spare to end with their worker")
    cluster.finalize()  # the nanny's new worker has no zygote yet: a fresh cluster next


def test_finalize_ends_the_spares(cluster):
    cluster(kind="embedded", num_cpus=1)
    h = Where.options(process()).invoke()
    me = yr.get(h.where.invoke(), T)
    spare = wait_until(lambda: (s := spares(me["ppid"], {me["pid"]})) and s, T, "a spare")
    cluster.finalize()
    wait_until(lambda: not any(alive(p) for p in {me["ppid"], me["pid"], *spare}), 30,
               "the zygote, its instance and its spare to end at finalize")


def test_no_spares_with_spare_processes_0(cluster, monkeypatch):
    cluster.finalize()
    monkeypatch.setenv("DASK_YRDASK__INSTANCES__SPARE_PROCESSES", "0")  # for the workers
    cluster(kind="embedded", num_cpus=1)
    hs = [Where.options(process()).invoke() for _ in range(2)]
    pids = {w["pid"] for w in yr.get([h.where.invoke() for h in hs], T)}
    zygote = psutil.Process(next(iter(pids))).ppid()
    assert {c.pid for c in psutil.Process(zygote).children()} == pids  # forked on request
    cluster.finalize()  # later tests get the default


def test_a_bad_spare_count_is_refused_at_init(monkeypatch):
    import dask

    with dask.config.set({"yrdask.instances.spare-processes": 17}):
        with pytest.raises(yr.YRValueError, match=r"spare-processes=17: expected at most 16"):
            yr.init(yr.Config(num_cpus=1))
    with dask.config.set({"yrdask.instances.spare-processes": "many"}):
        with pytest.raises(yr.YRValueError, match=r"spare-processes='many': expected a whole"):
            yr.init(yr.Config(num_cpus=1))


def test_a_dead_spare_is_passed_over(cluster):
    """A spare killed while it waits (the OOM killer, a stray kill) costs the next creation
    nothing but a fork: it is never handed a request, and nobody is told of its exit."""
    cluster(kind="embedded", num_cpus=1)
    h = Where.options(process()).invoke()
    me = yr.get(h.where.invoke(), T)
    spare = wait_until(lambda: (s := spares(me["ppid"], {me["pid"]})) and s, T, "a spare")
    (dead,) = spare
    os.kill(dead, signal.SIGKILL)
    g = Where.options(process()).invoke()  # at once: the zygote may not have reaped it yet
    there = yr.get(g.where.invoke(), T)
    assert there["pid"] != dead and there["ppid"] == me["ppid"]
    assert yr.get(h.where.invoke(), T)["pid"] == me["pid"]  # the neighbour is untouched
    for x in (h, g):
        x.terminate()


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads Linux's /proc")
def test_an_idle_zygote_sleeps_and_still_reaps(cluster):
    """The zygote wakes for the agent's lines and its children's exits (SIGCHLD), not on a
    timer: idle, it does not run at all; a child that dies is still reaped and reported."""
    import time

    cluster.finalize()  # no exit of an earlier test's instance wakes it in the window
    cluster(kind="embedded", num_cpus=1)
    h = Where.options(process(recover_retry_times=1)).invoke()
    me = yr.get(h.where.invoke(), T)
    zygote = me["ppid"]
    wait_until(lambda: spares(zygote, {me["pid"]}), T, "a spare")
    time.sleep(0.3)  # the spare's start and the agent's connect to it are over
    before = wake_ups(zygote)
    time.sleep(1.5)  # an idle window: a 20 ms poll would wake it 75 times
    assert wake_ups(zygote) - before <= 1
    os.kill(me["pid"], signal.SIGKILL)  # reaped and reported: the instance restarts
    wait_until(lambda: yr.get(h.where.invoke(), T)["pid"] != me["pid"], T, "the restart")
    assert not alive(me["pid"])  # no zombie left behind
    h.terminate()


# -- warm zygotes (docs/isolation.md, "Process start") -------------------------------------


@yr.invoke
def task_pid() -> int:
    return os.getpid()


def whole_worker(**kw) -> yr.InvokeOptions:
    """A whole worker's CPU (the 2-CPU embedded cluster has two workers of 1000 millicores):
    a second such instance goes to the other worker."""
    return yr.InvokeOptions(cpu=1000, memory=10, **kw)


def zygote_of(worker_pid: int) -> int | None:
    """The pid of ``worker_pid``'s zygote, or None if it has none."""
    for c in psutil.Process(worker_pid).children():
        try:
            if "--zygote" in c.cmdline() and alive(c.pid):
                return c.pid
        except psutil.NoSuchProcess:
            continue
    return None


def warming_on(address: str) -> bool:
    """Whether the scheduler has turned zygote warming on (it saw a process instance)."""
    from distributed import Client

    def on(dask_scheduler):
        return dask_scheduler.extensions["yr"].zygotes.on

    with Client(address, timeout=30) as client:
        return client.run_on_scheduler(on)


def fresh_two_workers(cluster) -> tuple[str, set[int]]:
    """A new 2-worker embedded cluster (no zygote started yet), and its workers' pids."""
    cluster.finalize()
    address = cluster(kind="embedded", num_cpus=2).address
    pids = set(dask_worker_pids())
    assert len(pids) == 2 and not any(zygote_of(p) for p in pids), pids
    return address, pids


def test_the_first_process_instance_warms_every_workers_zygote(cluster):
    address, pids = fresh_two_workers(cluster)
    first = Where.options(whole_worker(light=False)).invoke()
    one = yr.get(first.where.invoke(), T)
    here = psutil.Process(one["ppid"]).ppid()  # the first instance's worker
    (other,) = pids - {here}
    # The other worker started its zygote with no process instance of its own.
    warm = wait_until(lambda: zygote_of(other), T, "the other worker's zygote to start")
    assert warming_on(address)
    # The next process instance there is forked by that zygote, started before it.
    second = Where.options(whole_worker(light=False)).invoke()
    two = yr.get(second.where.invoke(), T)
    assert two["ppid"] == warm and psutil.Process(two["ppid"]).ppid() == other
    for h in (first, second):
        h.terminate()


def test_tasks_and_light_instances_start_no_zygote(cluster):
    address, pids = fresh_two_workers(cluster)
    light = [Where.options(whole_worker(light=True)).invoke() for _ in range(2)]
    hosts = {w["pid"] for w in yr.get([h.where.invoke() for h in light], T)}
    assert hosts == pids  # one light instance in each worker's own process
    for h in light:
        h.terminate()
    assert set(yr.get([task_pid.invoke() for _ in range(8)], T)) <= hosts
    assert not warming_on(address)  # the scheduler told no worker
    assert not any(zygote_of(p) for p in pids)


def test_warm_zygotes_false_warms_none(cluster):
    import dask

    with dask.config.set({"yrdask.instances.warm-zygotes": False}):  # the scheduler's
        address, pids = fresh_two_workers(cluster)
    try:
        h = Where.options(whole_worker(light=False)).invoke()
        me = yr.get(h.where.invoke(), T)
        here = psutil.Process(me["ppid"]).ppid()
        assert not warming_on(address)
        assert [p for p in pids if zygote_of(p)] == [here]
        h.terminate()
    finally:
        cluster.finalize()  # later tests get the default, even when this one fails


def test_a_bad_warm_zygotes_is_refused_at_init():
    import dask

    with dask.config.set({"yrdask.instances.warm-zygotes": "sometimes"}):
        with pytest.raises(yr.YRValueError,
                           match=r"warm-zygotes='sometimes': expected true or false"):
            yr.init(yr.Config(num_cpus=1))
