"""Faults (SPEC §5): instance restarts with redelivery, checkpoints, task reruns, nanny rejoin.

Real embedded clusters whose worker processes run under Dask nannies; processes are killed
with real SIGKILLs, by the pid the code running in them reports.  Calls that must be in
flight when the kill lands block on a file the test creates only after the kill, so the
order of events never depends on timing.
"""

from __future__ import annotations

import os
import pathlib
import signal
import time
from typing import Any

import pytest

import yrdask as yr
from conftest import check_in, dask_worker_pids, wait_for_file, wait_until

pytestmark = pytest.mark.timeout(180)

NUM_CPUS = 3  # a worker process per core, up to three: a restarted instance has somewhere to go


@pytest.fixture
def faults_cluster(cluster):
    return cluster(kind="embedded", num_cpus=NUM_CPUS)


def small(**kw) -> yr.InvokeOptions:
    # light instances: these tests kill the worker process an instance runs in, by the pid
    # it reports, and a light instance's process is its worker's (a process instance's own
    # crashes and exits: test_process_instances.py, test_isolation.py)
    return yr.InvokeOptions(cpu=100, memory=10, light=True, **kw)


@yr.instance
class Counter:
    def __init__(self, start: int = 0) -> None:
        self.n = start

    def incr(self) -> int:
        self.n += 1
        return self.n

    def pid(self) -> int:
        return os.getpid()

    def block(self, path: str) -> str:
        wait_for_file(path)
        return "unblocked"

    def add_and_save(self, x: int) -> int:
        self.n += x
        yr.save_state()
        return self.n

    def add(self, x: int) -> int:
        self.n += x
        return self.n

    def reload(self) -> int:
        yr.load_state()
        return self.n


def kill(pid: int) -> None:
    assert pid != os.getpid(), "refusing to kill the driver"
    os.kill(pid, signal.SIGKILL)


def test_restart_redelivers_in_flight_and_queued_calls(faults_cluster, tmp_path):
    h = Counter.options(small(recover_retry_times=1)).invoke()
    assert yr.get([h.incr.invoke() for _ in range(5)], timeout=60) == [1, 2, 3, 4, 5]
    old_pid = yr.get(h.pid.invoke(), timeout=30)
    gate = str(tmp_path / "gate")
    blocked = h.block.invoke(gate)  # in flight: its worker is killed while it runs
    queued = [h.incr.invoke() for _ in range(20)]  # sent, waiting behind it
    kill(old_pid)
    wait_until(lambda: h.state in ("RESTARTING", "ALIVE") and h.status()["restarts"] == 1,
               60, lambda: f"a restart, status {h.status()}")
    pathlib.Path(gate).touch()
    assert yr.get(blocked, timeout=60) == "unblocked"
    # fresh __init__ on the new process: the sequence starts again at 1, no call lost
    assert yr.get(queued, timeout=60) == list(range(1, 21))
    assert yr.get(h.pid.invoke(), timeout=30) != old_pid
    status = h.status()
    assert status["state"] == "ALIVE" and status["restarts"] == 1
    h.terminate(is_sync=True)


def test_out_of_restarts_fails_pending_and_later_calls_with_the_cause(faults_cluster, tmp_path):
    h = Counter.options(small(recover_retry_times=1)).invoke()
    kill(yr.get(h.pid.invoke(), timeout=30))
    second_pid = yr.get(h.pid.invoke(), timeout=60)  # redelivered to the restarted instance
    pending = h.block.invoke(str(tmp_path / "never"))
    kill(second_pid)
    with pytest.raises(yr.InstanceDiedError) as err:
        yr.get(pending, timeout=60)
    assert isinstance(err.value, yr.YRRuntimeError)
    assert h.instance_id in str(err.value) and "1 restarts" in str(err.value)
    with pytest.raises(yr.InstanceDiedError, match=h.instance_id):
        yr.get(h.incr.invoke(), timeout=60)
    assert h.state == "DEAD"


@yr.instance
class Fragile:
    def __init__(self) -> None:
        self.n = 0

    def crash(self) -> None:
        os._exit(3)  # as a segfault in native code would: the whole process goes

    def incr(self) -> int:
        self.n += 1
        return self.n


def test_a_call_that_kills_its_process_fails_and_the_calls_behind_it_run(faults_cluster):
    h = Fragile.options(small(recover_retry_times=3)).invoke()
    assert yr.get(h.incr.invoke(), timeout=30) == 1
    poison = h.crash.invoke()
    behind = [h.incr.invoke() for _ in range(3)]  # sent after it: they never started
    with pytest.raises(yr.YRRuntimeError) as err:
        yr.get(poison, timeout=90)
    text = str(err.value)
    assert "'crash'" in text and h.instance_id in text and "2 times" in text, text
    assert "max-call-redeliveries" in text and "its process exited with code 3" in text, text
    # Run once more after the first death (at least once), not a third time: the instance
    # restarted twice and keeps its third restart; the calls behind it run on a fresh one.
    assert yr.get(behind, timeout=90) == [1, 2, 3]
    # The scheduler hears ALIVE on the worker's stream, maybe after the calls were answered.
    status = wait_until(lambda: (st := h.status())["state"] == "ALIVE" and st, 30,
                        lambda: f"the instance ALIVE again at the scheduler: {h.status()}")
    assert status["restarts"] == 2, status
    h.terminate(is_sync=True)


def test_no_restarts_fails_fast(faults_cluster, tmp_path):
    h = Counter.options(small()).invoke()  # recover_retry_times=0
    pid = yr.get(h.pid.invoke(), timeout=30)
    pending = h.block.invoke(str(tmp_path / "never"))
    kill(pid)
    with pytest.raises(yr.InstanceDiedError) as err:
        yr.get(pending, timeout=30)
    assert h.instance_id in str(err.value) and "was lost" in str(err.value)
    assert h.status()["restarts"] in (0, None)


def test_checkpointed_restart_resumes_from_the_last_save(faults_cluster):
    h = Counter.options(small(recover_retry_times=2)).invoke(100)
    assert yr.get([h.add_and_save.invoke(x) for x in (1, 2, 3)], timeout=60) == [101, 103, 106]
    assert yr.get(h.add.invoke(1000), timeout=30) == 1106  # not saved: lost with the process
    kill(yr.get(h.pid.invoke(), timeout=30))
    assert yr.get(h.incr.invoke(), timeout=60) == 107
    assert h.status()["restarts"] == 1


def test_load_state_restores_the_last_checkpoint_in_place(faults_cluster):
    h = Counter.options(small()).invoke()
    assert yr.get(h.add_and_save.invoke(5), timeout=60) == 5
    assert yr.get(h.add.invoke(10), timeout=30) == 15
    assert yr.get(h.reload.invoke(), timeout=30) == 5
    assert yr.get(h.incr.invoke(), timeout=30) == 6
    h.terminate()


def test_save_state_outside_an_instance_is_an_error(faults_cluster):
    with pytest.raises(yr.YRRuntimeError, match="inside a method of an instance"):
        yr.save_state()

    @yr.invoke
    def in_task():
        yr.load_state()

    with pytest.raises(yr.YRRuntimeError, match="inside a method of an instance"):
        yr.get(in_task.invoke(), timeout=30)


def test_terminate_never_restarts(faults_cluster):
    h = Counter.options(small(recover_retry_times=-1)).invoke()
    pid = yr.get(h.pid.invoke(), timeout=30)
    h.terminate(is_sync=True)
    assert h.state == "DEAD"
    probe = Counter.options(small()).invoke()  # the worker process itself was not touched
    assert os.path.exists(f"/proc/{pid}")
    assert yr.get(probe.incr.invoke(), timeout=30) == 1
    with pytest.raises(RuntimeError, match="terminated"):
        h.incr.invoke()
    probe.terminate()


def test_named_instance_found_by_name_after_a_restart(faults_cluster):
    h = Counter.options(small(recover_retry_times=1, name="restartable-named")).invoke()
    kill(yr.get(h.pid.invoke(), timeout=30))
    assert yr.get(h.incr.invoke(), timeout=60) == 1
    again = yr.get_instance("restartable-named")
    assert yr.get(again.incr.invoke(), timeout=30) == 2
    h.terminate(is_sync=True)


@yr.instance
class Parent:
    def __init__(self) -> None:
        # The child lives in another worker process, so it survives the parent's process:
        # only the owner rule can end it.  The embedded cluster is one node (docs/nodes.md);
        # a whole CPU does not fit the rest of this process's share, so it goes to the other.
        self.child = Counter.options(yr.InvokeOptions(cpu=1000, memory=10)).invoke()

    def get_child(self) -> Any:
        return self.child

    def pid(self) -> int:
        return os.getpid()

    def child_incr(self) -> int:
        return yr.get(self.child.incr.invoke())


def test_restarted_owner_gets_new_children_and_the_old_ones_end(faults_cluster):
    p = Parent.options(small(recover_retry_times=1)).invoke()
    assert yr.get(p.child_incr.invoke(), timeout=60) == 1
    old_child = yr.get(p.get_child.invoke(), timeout=30)
    kill(yr.get(p.pid.invoke(), timeout=30))
    # fresh __init__ made a fresh child: its counter starts again
    assert yr.get(p.child_incr.invoke(), timeout=60) == 1
    new_child = yr.get(p.get_child.invoke(), timeout=30)
    assert new_child.instance_id != old_child.instance_id
    wait_until(lambda: old_child.state == "DEAD", 30,
               lambda: f"the old child to end, status {old_child.status()}")
    assert "restarted" in old_child.status()["reason"]
    p.terminate(is_sync=True)


@yr.invoke
def die_once(marker: str) -> str:
    if not os.path.exists(marker):
        pathlib.Path(marker).touch()
        os.kill(os.getpid(), signal.SIGKILL)
    return f"ran on {os.getpid()}"


def test_task_whose_worker_dies_is_rerun_without_using_retries(faults_cluster, tmp_path):
    marker = str(tmp_path / "died")
    ref = die_once.options(yr.InvokeOptions(retry_times=0)).invoke(marker)
    assert yr.get(ref, timeout=90).startswith("ran on")
    assert os.path.exists(marker)


@yr.invoke
def exits_every_time(path: str) -> None:
    with open(path, "a") as f:
        f.write("x")
    os._exit(3)  # as a segfault or the OOM killer would: the whole worker process goes


@yr.invoke
def plus_one(x: int) -> int:
    return x + 1


@pytest.mark.parametrize("kind,retry_times", [("embedded", 0), ("cli", 1)])
def test_a_task_that_crashes_its_process_runs_retry_times_more_naming_the_exit(
        cluster, kind, retry_times, tmp_path):
    """openYuanrong's rule for a crash "such as core dump" (here ``os._exit(3)``): rerun
    ``retry_times`` times (0 by default: it runs once), then the typed error naming how the
    process ended; an outside kill (SIGKILL) is rerun without spending them (test above)."""
    if kind == "embedded":
        cluster(kind="embedded", num_cpus=NUM_CPUS)
    else:
        cluster(kind="cli", workers=[{}, {}])
    runs = tmp_path / "runs"
    with pytest.raises(yr.TaskCrashedError) as info:
        yr.get(exits_every_time.options(small(retry_times=retry_times)).invoke(str(runs)),
               timeout=120)
    text = str(info.value)
    assert runs.read_text() == "x" * (retry_times + 1), text
    assert "exits_every_time" in text and f"more than retry_times={retry_times} allows" in text
    assert "its process exited with code 3" in text, text
    assert yr.get(plus_one.invoke(1), timeout=60) == 2  # the cluster goes on


def all_workers_up(dead: int | None = None) -> dict[int, str] | None:
    """Dask's workers (pid -> address) once every worker process of the cluster is up (one
    per core, up to NUM_CPUS: docs/nodes.md), none is process ``dead``, and yr lists exactly
    them (each one's agent registered)."""
    from yrdask.deploy.embedded import worker_layout

    now = dask_worker_pids()
    up = len(now) == worker_layout(NUM_CPUS)[0] and set(now.values()) == yr_processes()
    return now if up and dead not in now else None


def yr_processes() -> set[str]:
    """The worker processes yr lists (each one's agent registered with the extension)."""
    from yrdask.runtime.context import current_runtime

    info = current_runtime().scheduler_call("yr_cluster_info")
    return {p for node in info["workers"].values() for p in node["processes"]}


@yr.invoke
def meet(folder: str, n: int) -> int:
    """Check in, then wait until ``n`` tasks checked in: they ran at the same time."""
    check_in(folder, n)
    return os.getpid()


def test_killed_worker_comes_back_and_runs_work(faults_cluster, tmp_path):
    # all of them: a worker an earlier test killed may still be on its way back
    before = wait_until(all_workers_up, 90, lambda: f"every worker process up: Dask lists "
                                                    f"{dask_worker_pids()}, yr {yr_processes()}")
    h = Counter.options(small()).invoke()
    pid = yr.get(h.pid.invoke(), timeout=30)
    assert pid in before
    kill(pid)

    now = wait_until(lambda: all_workers_up(dead=pid), 90,
                     lambda: f"the nanny to bring the worker back: Dask lists "
                             f"{dask_worker_pids()}, yr lists {yr_processes()}")
    h.terminate()  # its restart holds a lease: the meeting tasks below get the processes alone
    # One one-CPU task per worker process, all at once (they wait for each other), so one runs
    # on the new process.
    meeting = yr.InvokeOptions(cpu=1000, memory=10)
    pids = yr.get([meet.options(meeting).invoke(str(tmp_path), len(now)) for _ in now],
                  timeout=60)
    assert sorted(pids) == sorted(now), (pids, now)


@yr.instance
class Worker:
    def __init__(self) -> None:
        self.calls = 0

    def work(self, i: int, gate: str | None = None) -> int:
        self.calls += 1
        if gate:
            wait_for_file(gate, 120)
        time.sleep(0.04)
        return i


def test_chaos_every_call_returns_while_workers_are_killed(faults_cluster, tmp_path):
    """16 instances with unlimited restarts get 300 calls each while a killer SIGKILLs a
    random worker process every 2 s (once all workers are back); every call returns.
    Call 150 of each instance waits until the second kill landed, so at least two kills
    land while every instance still has calls pending, however slow the machine is."""
    import random
    import threading

    from distributed import Client

    instances = [Worker.options(small(recover_retry_times=-1)).invoke() for _ in range(16)]
    yr.get([h.work.invoke(-1) for h in instances], timeout=60)
    done = threading.Event()
    kills: list[float] = []
    n_workers = len(wait_until(all_workers_up, 90, "every worker process up"))
    gate = tmp_path / "two-kills-landed"

    def killer() -> None:
        with Client(faults_cluster.address, set_as_default=False, timeout=30) as client:
            while not done.wait(2.0):
                try:
                    pids = list(client.run(os.getpid, on_error="ignore").values())
                except Exception:  # a worker died under the call: try again later
                    continue
                if len(pids) < n_workers:
                    continue  # wait for the nannies to bring everyone back
                pid = random.choice(pids)
                try:
                    os.kill(pid, signal.SIGKILL)
                    kills.append(time.monotonic())
                except ProcessLookupError:
                    pass
                if len(kills) >= 2:
                    gate.touch()

    thread = threading.Thread(target=killer, name="chaos-killer", daemon=True)
    start = time.monotonic()
    thread.start()
    try:
        refs = {h.instance_id: [h.work.invoke(i, str(gate) if i == 150 else None)
                                for i in range(300)] for h in instances}
        results = {iid: yr.get(r, timeout=300) for iid, r in refs.items()}
    finally:
        done.set()
        thread.join(30)
    elapsed = time.monotonic() - start
    assert all(results[iid] == list(range(300)) for iid in results)
    assert len(kills) >= 2, f"only {len(kills)} kills landed in {elapsed:.1f} s"
    restarts = sum(h.status()["restarts"] for h in instances)
    assert restarts >= 1
    print(f"\nchaos: 16 x 300 calls in {elapsed:.1f} s, {len(kills)} worker kills, "
          f"{restarts} instance restarts, all {16 * 300} calls returned")
    for h in instances:
        h.terminate()


def test_hung_worker_is_removed_after_the_ttl_and_its_instance_restarts(cluster, tmp_path):
    """A SIGSTOPped worker keeps its sockets open: only Dask's heartbeat TTL notices it.
    The scheduler then tells every caller, which sends its unanswered calls again."""
    import dask

    cluster.finalize()
    with dask.config.set({"distributed.scheduler.worker-ttl": "3s"}):
        yr.init(yr.Config(num_cpus=2))
    stopped = None
    try:
        h = Counter.options(small(recover_retry_times=1)).invoke()
        assert yr.get(h.incr.invoke(), timeout=60) == 1
        stopped = yr.get(h.pid.invoke(), timeout=30)
        os.kill(stopped, signal.SIGSTOP)
        ref = h.incr.invoke()  # sent to the hung process, answered by its replacement
        assert yr.get(ref, timeout=60) == 1
        assert h.status()["restarts"] == 1
    finally:
        if stopped is not None:
            try:
                os.kill(stopped, signal.SIGCONT)
            except ProcessLookupError:  # its nanny already replaced it
                pass
        yr.finalize()
