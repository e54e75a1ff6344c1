"""Nested calls from work that runs in a process of its own (docs/isolation.md#nested-calls).

GPU tasks and actors, and work with ``isolated=True`` or ``env_vars``, run in a child process
of their worker.  Its first nested call starts a runtime of its own there, which joins the
scheduler as a client: the child then owns what it creates and borrows the refs it was given.

One embedded cluster for the module, started the Ray way with one declared GPU
(``ray.init(num_cpus=2, num_gpus=1)``; no hardware needed), used through both APIs.
"""

from __future__ import annotations

import gc
import os
import signal
import sys
import time

import cloudpickle
import dask
import numpy as np
import psutil
import pytest

import yrdask as yr
import yrdask.ray as ray
from conftest import wait_for_file, wait_until
from yrdask.ray.exceptions import OwnerDiedError, TaskCancelledError

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # isolated processes too

pytestmark = pytest.mark.timeout(240)

T = 60


@pytest.fixture(scope="module")
def gpu_ray(cluster):
    cluster.finalize()  # this module starts its own cluster, as a Ray program would
    ray.init(num_cpus=2, num_gpus=1)
    yield
    ray.shutdown()


def _ended(pid: int) -> bool:
    """Whether process ``pid`` is gone or a zombie (it may be reaped between two looks)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _started_s() -> float | None:
    """How long this isolated process took to start its runtime (None: not started)."""
    from yrdask.runtime.context import installed_runtime

    return getattr(installed_runtime(), "start_s", None)


@ray.remote
def inc(x):
    return x + 1


@ray.remote
def slow(x, seconds):
    time.sleep(seconds)
    return x


@ray.remote(num_gpus=1)
def gpu_fan_out(n):
    values = ray.get([inc.remote(i) for i in range(n)])
    return {"values": values, "gpus": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "pid": os.getpid(), "start_s": _started_s(), "later": [inc.remote(100)]}


@ray.remote(num_gpus=1, num_cpus=2)
def gpu_whole_node():
    return ray.get([inc.remote(i) for i in range(3)])


@ray.remote
def released(path, started):
    open(started, "w").close()  # its caller has sent it: it waits for it in ray.get now
    wait_for_file(path, 120)  # until the test creates ``path``
    return 1


@ray.remote(num_gpus=1)
def gpu_waits(path, started):
    return ray.get(released.remote(path, started))


@ray.remote(num_gpus=1)
class Trainer:
    def __init__(self):
        self.kept = None

    def step(self, refs):
        self.kept = refs  # still held after this call: the process borrows them
        return ray.get(inc.remote(sum(ray.get(refs))))

    def again(self):
        return ray.get(self.kept)

    def pending(self, seconds):
        return [slow.remote(7, seconds)]

    def pid(self):
        return os.getpid()


@yr.invoke
def yr_inc(x):
    return x + 1


@yr.invoke(invoke_options=yr.InvokeOptions(cpu=100, memory=10,
                                            env_vars={"YR_NESTED_TEST": "on"}))
def env_task(size):
    ref = yr.put(b"x" * size)
    got = yr.get(ref, 30)
    return {"env": os.environ.get("YR_NESTED_TEST"), "len": len(got),
            "sum": yr.get(yr_inc.invoke(1), 30), "pid": os.getpid(), "put": [yr.put(size)]}


@yr.instance
class Isolated:
    def work(self, box):
        value = yr.get(box[0], 30)
        # the large put is always counted (a reader needs its owner): the inc may be done by
        # the time this returns, and then its small value travels with the ref, uncounted
        return [yr.put(value * 2), yr_inc.invoke(value), yr.put(bytes(600 << 10))]

    def pid(self):
        return os.getpid()

    def owned(self):
        """Objects this process's runtime holds (refs it made that others still hold)."""
        from yrdask.runtime.context import installed_runtime

        return installed_runtime().objects.figures()["entries"]

    def stream(self, n, size):
        """Items holding refs to large values this process puts (kept in its node's store)."""
        for i in range(n):
            yield [yr.put(bytes([i]) * size)]

    def arrays(self, n, size):
        """Items holding refs to arrays this process puts (out of band: in the node's store)."""
        for i in range(n):
            yield [yr.put(np.full(size, i, dtype=np.uint8))]

    def consume_own(self, me, n, size, take=None):
        """Consume this instance's own generator method through a handle to itself (the call
        goes out and comes back to this very process): the items' first values, the ids of
        the refs they held, how many of those the store had while they were read, and this
        process's table count before it started.  ``take``: read only so many items, then
        drop the generator while the rest are still coming."""
        before = self.owned()
        gen = me.arrays.invoke(n, size)
        if take is None:
            items = list(gen)  # to its end: the producer dropped its refs
        else:
            items = [next(gen) for _ in range(take)]
        del gen
        boxes = yr.get(items, 30)
        del items
        firsts = [int(yr.get(box[0], 30)[0]) for box in boxes]
        ids = [box[0].id for box in boxes]
        stored = self.holds(ids)[1]
        del boxes
        return firsts, ids, stored, before

    def holds(self, ids):
        """This process's table count, and how many of ``ids`` its node's store still has."""
        from yrdask.runtime.store import node_store

        return self.owned(), sum(node_store().contains(i) for i in ids)

    def checkpoint(self, value):
        self.value = value
        yr.save_state(30)
        self.value = None
        yr.load_state(30)
        return self.value

    def leave(self):
        yr.exit()


PIDS: list[int] = []  # the isolated processes the tests used: none may outlive the cluster


def test_a_gpu_task_submits_cpu_tasks_and_gets_them(gpu_ray):
    out = ray.get(gpu_fan_out.remote(4), timeout=T)
    assert out["values"] == [1, 2, 3, 4] and out["gpus"] == "0"
    assert out["pid"] != os.getpid() and out["start_s"] is not None
    # A ref the GPU task created and returned: the task's process owns it, the driver reads it
    assert ray.get(out["later"][0], timeout=T) == 101
    PIDS.append(out["pid"])


def test_a_gpu_task_holding_every_cpu_lends_them_while_it_waits(gpu_ray):
    """It holds both CPUs of the node: the CPU tasks it waits for run on the CPU its nested
    ray.get lends (Ray's rule), as a worker's task lends its own."""
    assert ray.get(gpu_whole_node.remote(), timeout=T) == [1, 2, 3]


def test_a_gpu_actor_gets_refs_passed_in_a_list_and_submits_a_task(gpu_ray):
    trainer = Trainer.remote()
    refs = [slow.remote(1, 0.3), inc.remote(2)]  # the first one still pending when passed
    assert ray.get(trainer.step.remote(refs), timeout=T) == 5
    del refs  # the actor's process still borrows them: the driver must keep them
    gc.collect()
    assert ray.get(trainer.again.remote(), timeout=T) == [1, 3]
    PIDS.append(ray.get(trainer.pid.remote(), timeout=T))
    ray.kill(trainer)


def test_env_vars_task_puts_gets_and_submits_through_the_yr_api(gpu_ray):
    out = yr.get(env_task.invoke(1 << 20), T)  # a large put: to the node's store
    assert out["env"] == "on" and out["len"] == 1 << 20 and out["sum"] == 2
    assert yr.get(out["put"][0], T) == 1 << 20  # owned by the task's process, still alive
    PIDS.append(out["pid"])


def test_isolated_instance_reads_a_ref_in_a_container_and_returns_its_own(gpu_ray):
    h = Isolated.options(yr.InvokeOptions(cpu=100, memory=10, isolated=True)).invoke()
    doubled, plus_one, big = yr.get(h.work.invoke([yr.put(20)]), T)
    assert yr.get([doubled, plus_one], T) == [40, 21] and len(yr.get(big, T)) == 600 << 10
    assert yr.get(h.owned.invoke(), T) >= 1  # lent to the driver: the process keeps it
    del doubled, plus_one, big  # the driver lets go: the process frees them (none pinned)
    gc.collect()
    wait_until(lambda: yr.get(h.owned.invoke(), T) == 0, 30,
               "the isolated process to free the objects the driver let go of")
    PIDS.append(yr.get(h.pid.invoke(), T))
    assert yr.get(h.checkpoint.invoke(7), T) == 7  # yr.save_state / yr.load_state there
    with pytest.raises(yr.InstanceDiedError, match="exited by yr.exit"):
        yr.get(h.leave.invoke(), T)


def test_cancelling_a_gpu_task_blocked_in_a_nested_get_frees_its_gpu_at_once(gpu_ray, tmp_path):
    release = str(tmp_path / "release")  # the nested task runs until the test creates it
    started = tmp_path / "started"
    ref = gpu_waits.remote(release, str(started))
    try:
        # the nested task runs, so the GPU task waits in its nested ray.get (a ray.wait of
        # 0.5 s alone could not tell that from a GPU task still queued on a loaded machine)
        wait_until(started.exists, T, "the nested task to start")
        assert ray.wait([ref], timeout=0.5) == ([], [ref])
        t0 = time.monotonic()
        ray.cancel(ref)
        with pytest.raises(TaskCancelledError):
            ray.get(ref, timeout=T)
        # its process is killed, so the GPU is free while the nested task still runs
        assert ray.get(gpu_fan_out.remote(0), timeout=T)["values"] == []
        assert time.monotonic() - t0 < 20
    finally:
        open(release, "w").close()


def test_reading_a_ref_whose_isolated_owner_is_gone_fails_with_owner_died(gpu_ray):
    trainer = Trainer.remote()
    pid = ray.get(trainer.pid.remote(), timeout=T)
    (pending,) = ray.get(trainer.pending.remote(30), timeout=T)  # the actor's process owns it
    # the driver asks the owner for it (and waits there): the owner's death ends that wait
    assert ray.wait([pending], timeout=0.5) == ([], [pending])
    ray.kill(trainer)
    wait_until(lambda: _ended(pid), 30, "the actor's process to end")
    with pytest.raises(OwnerDiedError, match="its owner .* is unreachable"):
        ray.get(pending, timeout=T)


def test_a_later_reader_of_a_ref_whose_isolated_owner_is_gone_fails_at_once(gpu_ray):
    """Nobody waited on the ref while its owner lived: the first read after its death asks
    the scheduler, which no longer knows the owner, instead of retrying the connect for
    Dask's 30 s connect timeout (docs/faults.md "Owners that are gone")."""
    trainer = Trainer.remote()
    pid = ray.get(trainer.pid.remote(), timeout=T)
    (pending,) = ray.get(trainer.pending.remote(5), timeout=T)  # owned by the actor's process
    ray.kill(trainer)
    wait_until(lambda: _ended(pid), 30, "the actor's process to end")
    t0 = time.monotonic()
    # whether or not the scheduler has seen the process's stream close by now
    with pytest.raises(OwnerDiedError, match="its owner .* is unreachable: "):
        ray.get(pending, timeout=T)
    assert time.monotonic() - t0 < 8  # not the 30 s connect timeout


def test_a_reader_of_a_ref_whose_owner_hangs_fails_within_seconds(gpu_ray):
    """The owner is still listed by the scheduler (SIGSTOPped: its stream stays open), and
    no connect reaches it: the read is given up after yrdask.object-store.owner-unreachable,
    not Dask's 30 s connect timeout."""
    trainer = Trainer.remote()
    pid = ray.get(trainer.pid.remote(), timeout=T)
    PIDS.append(pid)  # resumed and killed below: the last test checks that it ended
    (pending,) = ray.get(trainer.pending.remote(2), timeout=T)  # owned by the actor's process
    os.kill(pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        with dask.config.set({"yrdask.object-store.owner-unreachable": "2s"}):
            with pytest.raises(OwnerDiedError, match="no connection within 2 s, though the "
                                                     "scheduler still lists it"):
                ray.get(pending, timeout=T)
        assert time.monotonic() - t0 < 6  # the bound plus one connect try, not 30 s
    finally:
        os.kill(pid, signal.SIGCONT)
        ray.kill(trainer)


def test_refs_in_an_isolated_generators_items_are_freed_once_the_consumer_drops_them(gpu_ray):
    """Refs nested in the items of a generator method of an isolated instance are lent to the
    caller via each item, as refs nested in a result are: the process frees the objects once
    the consumer holds neither the items nor the refs (they are not pinned to its end)."""
    h = Isolated.options(yr.InvokeOptions(cpu=100, memory=10, isolated=True)).invoke()
    boxes = [yr.get(item, T) for item in h.stream.invoke(3, 600 << 10)]  # items dropped
    assert [yr.get(box[0], T)[:2] for box in boxes] == [b"\0\0", b"\1\1", b"\2\2"]
    assert yr.get(h.owned.invoke(), T) == 3  # the consumer still holds the refs
    del boxes
    gc.collect()
    wait_until(lambda: yr.get(h.owned.invoke(), T) == 0, 30,
               "the isolated process to free the objects its generator's items lent")
    PIDS.append(yr.get(h.pid.invoke(), T))
    h.terminate()


@pytest.mark.parametrize("take", [None, 1])
def test_refs_in_items_an_isolated_instance_reads_from_its_own_generator_are_freed(
        gpu_ray, take):
    """The instance consumes its own generator method (through a handle to itself): the
    item is not in this process yet when its refs are lent to it, so its stream counts the
    item as holding them from the lend on; once the method drops the items and the refs,
    the process's table is back to its count before and the store has none of the values
    (they are not pinned to the process's end).  ``take=1``: the generator is dropped after
    one item, and the items still coming let go of what was lent via them."""
    h = Isolated.options(yr.InvokeOptions(cpu=100, memory=10, isolated=True,
                                          concurrency=2)).invoke()
    firsts, ids, stored, before = yr.get(h.consume_own.invoke(h, 3, 600 << 10, take), T)
    read = 3 if take is None else take
    assert firsts == list(range(read)) and stored == read  # in the store, as read
    wait_until(lambda: yr.get(h.holds.invoke(ids), T) == (before, 0), 30,
               lambda: f"table count {before} and none of {ids} in the store, not "
                       f"{yr.get(h.holds.invoke(ids), T)}")
    PIDS.append(yr.get(h.pid.invoke(), T))
    h.terminate()


def test_no_isolated_process_outlives_the_cluster(gpu_ray):
    assert PIDS
    ray.shutdown()

    def gone() -> bool:
        return all(_ended(p) for p in PIDS)

    wait_until(gone, 30, lambda: f"the isolated processes {PIDS} to end with the cluster")


def test_nested_calls_from_isolated_work_on_a_cli_cluster(cluster):
    """A cluster of `dask scheduler` / `dask worker` processes: the isolated process finds
    the scheduler through its worker."""
    cluster(kind="cli", workers=[{}])
    out = yr.get(env_task.invoke(10), T)
    assert out["env"] == "on" and out["len"] == 10 and out["sum"] == 2
    assert yr.get(out["put"][0], T) == 10
