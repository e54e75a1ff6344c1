"""Borrowers counted (docs/objects.md "When a value is freed").

Refs nested in results, arguments and instance state are counted with Ray's ownership
protocol: a value lives while its owner or any borrower holds it, and is then freed with the
copy a worker keeps.  These tests read every process's object table and worker store (a Dask
client runs the probe in each worker), so "flat memory" is counted, not guessed from RSS.
"""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import time

import cloudpickle
import distributed
import numpy as np
import pytest

import yrdask as yr
from conftest import wait_until
from yrdask.runtime.context import installed_runtime

pytestmark = pytest.mark.timeout(180)

T = 60
MB4 = 4 << 20


@pytest.fixture
def borrow_cluster(cluster):
    active = cluster(kind="embedded", num_cpus=2)
    with distributed.Client(active.address, set_as_default=False, timeout=30) as client:
        yield client


def probe() -> dict:
    """This process's live object entries, counter records and worker-store copies."""
    from yrdask.runtime.context import installed_runtime as rt_of

    rt = rt_of()
    figures = rt.objects.figures()
    figures["store"] = len(rt.agent.store) if rt.agent is not None else 0
    return figures


def live(client: distributed.Client) -> dict:
    """``{process: entries + records + store copies}`` for the driver and every worker."""
    everyone = {"driver": installed_runtime().objects.figures() | {"store": 0}}
    everyone.update(client.run(probe))
    return {k: f["entries"] + f["owned"] + f["borrowed"] + f["store"] for k, f in everyone.items()}


@yr.invoke
def nested_put():
    return [yr.put(np.zeros(MB4, dtype=np.uint8))]


@yr.invoke
def large_result():
    return np.ones(MB4, dtype=np.uint8)


@yr.invoke
def nested_put_and_pid():
    return [yr.put(np.zeros(MB4, dtype=np.uint8))], os.getpid()


@yr.invoke(return_nums=2)
def large_and_pid(seed):
    return np.full(MB4, seed, dtype=np.uint8), os.getpid()


@yr.instance
class Keeper:
    def __init__(self) -> None:
        self.kept = None

    def keep(self, refs: list) -> int:
        self.kept = refs
        return len(refs)

    def total(self) -> int:
        return int(sum(yr.get(r, T).sum() for r in self.kept))

    def drop(self) -> None:
        self.kept = None


@yr.invoke
def boxed_stream(n):
    """Items holding refs to 1 MB values this worker puts (counted: kept in its store)."""
    for i in range(n):
        yield [yr.put(np.full(MB4 // 4, i, dtype=np.uint8)), os.getpid()]


@yr.instance
class Boxer:
    def stream(self, n):
        for i in range(n):
            yield [yr.put(np.full(MB4 // 4, i, dtype=np.uint8)), os.getpid()]


@yr.invoke
def consume_boxed_stream(n):
    """A task consuming a generator task (on its own worker when it is the only one): the
    values its items' refs hold, and whether every item came from this very process."""
    items = list(boxed_stream.invoke(n))  # to its end: the producer dropped its own refs
    boxes = yr.get(items, T)
    del items
    values = [int(yr.get(box[0], T)[0]) for box in boxes]
    return values, all(box[1] == os.getpid() for box in boxes)


def test_nested_refs_read_kept_and_dropped_leave_nothing_behind(borrow_cluster):
    """A task returns ``[put(4 MB)]``, the driver reads it and an instance keeps it until
    the next one comes; 300 rounds hold at most a few objects."""
    from yrdask.runtime.store import node_store

    keeper = Keeper.invoke()
    shm_before = node_store().used()
    for i in range(300):
        outer = nested_put.invoke()
        refs = yr.get(outer, T)
        assert yr.get(refs[0], T).nbytes == MB4
        assert yr.get(keeper.keep.invoke(refs), T) == 1
        del outer, refs
        if i % 60 == 59:
            # the instance keeps one value: its entries and records, nothing that grows per
            # round (the last rounds' releases are asynchronous: polled, not sampled once)
            wait_until(lambda: sum(live(borrow_cluster).values()) <= 8, 30,
                       lambda: f"at most 8 entries after round {i}: {live(borrow_cluster)}")
    yr.get(keeper.drop.invoke(), T)
    wait_until(lambda: sum(live(borrow_cluster).values()) == 0, 30,
               lambda: f"every table and store empty, not {live(borrow_cluster)}")
    # and the node's shared memory holds none of the 300 values (1.2 GB put in all)
    wait_until(lambda: node_store().used() <= shm_before, 30,
               lambda: f"the node's store back to {shm_before} bytes, not {node_store().used()}")
    keeper.terminate(is_sync=True)


def test_a_lent_result_outlives_the_callers_ref_then_its_copy_is_freed(borrow_cluster):
    keeper = Keeper.invoke()
    big = large_result.invoke()  # kept in its worker's store
    assert yr.get(keeper.keep.invoke([big]), T) == 1
    del big  # the driver lets go; the instance still borrows it
    assert yr.get(keeper.total.invoke(), T) == MB4
    stores = lambda: sum(f["store"] for f in borrow_cluster.run(probe).values())  # noqa: E731
    assert stores() == 1
    yr.get(keeper.drop.invoke(), T)
    wait_until(lambda: stores() == 0, 30, "the worker's copy freed after the last borrower")
    keeper.terminate(is_sync=True)


def test_a_result_outlives_the_worker_that_made_it_on_its_node(borrow_cluster):
    """The worker keeping a large result is killed after its task ended: the value is still
    in the node's store, so it is read from there (nothing is lost, nothing runs again)."""
    value, pid = large_and_pid.invoke(3)
    os.kill(yr.get(pid, T), signal.SIGKILL)  # the worker keeping the 4 MB result
    got = yr.get(value, T)
    assert got.nbytes == MB4 and int(got[0]) == 3
    wait_until(lambda: len(borrow_cluster.scheduler_info()["workers"]) == 2, 60,
               "the killed worker back under its nanny")


def test_a_borrower_reading_after_its_owner_died_gets_owner_died_error(borrow_cluster):
    refs, pid = yr.get(nested_put_and_pid.invoke(), T)
    os.kill(pid, signal.SIGKILL)  # the worker owning the put value
    # until the loss is known a read may still map the node's copy; from then on, Ray's rule
    wait_until(refs[0].is_exception, 60, "the driver told of its owner's death")
    with pytest.raises(yr.errors.OwnerDiedError) as err:
        yr.get(refs[0], T)
    assert isinstance(err.value, yr.errors.ObjectLostError)
    assert refs[0].id in str(err.value) and "owner" in str(err.value)
    wait_until(lambda: len(borrow_cluster.scheduler_info()["workers"]) == 2, 60,
               "the killed worker back under its nanny")


# A driver that joins the cluster by address, submits a task, and hands the ref out (pickled,
# as hex on stdout) before its result is back: the ref carries no value, only its owner.
JOINED_DRIVER = """
import sys, time, cloudpickle, yrdask as yr
yr.init(yr.Config(server_address=sys.argv[1]))

@yr.invoke
def later():
    time.sleep(2)
    return 1

print(cloudpickle.dumps(later.invoke()).hex(), flush=True)
sys.stdin.read()  # until the test kills it
"""


def test_a_ref_whose_joined_driver_died_fails_at_once_for_a_later_reader(borrow_cluster):
    """The owner is a driver that joined by address and was killed; this process reads its
    ref only afterwards: the scheduler no longer knows that owner, so the read fails at once
    instead of after Dask's 30 s connect timeout (docs/faults.md "Owners that are gone")."""
    address = borrow_cluster.scheduler.address
    proc = subprocess.Popen([sys.executable, "-c", JOINED_DRIVER, address],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line, "the joined driver printed no ref"
    finally:
        proc.kill()
        proc.wait(30)
        proc.stdin.close()
        proc.stdout.close()
    ref = cloudpickle.loads(bytes.fromhex(line.strip()))
    t0 = time.monotonic()
    # whether or not the scheduler has seen the driver's stream close by now
    with pytest.raises(yr.errors.OwnerDiedError, match="its owner .* is unreachable: "):
        yr.get(ref, T)
    assert time.monotonic() - t0 < 8  # not the 30 s connect timeout
    del ref


@pytest.mark.parametrize("source", ["task", "method"])
def test_refs_in_a_workers_generator_items_are_freed_once_the_consumer_drops_them(
        borrow_cluster, source):
    """Refs nested in the items of a generator in a worker are lent to the consumer via each
    item, as refs nested in a result are (not pinned to the worker's end): once the driver
    holds neither the items nor the refs, every worker's table and store is empty again."""
    gc.collect()
    before = live(borrow_cluster)["driver"]  # what earlier tests' refs still hold there
    # a light instance: its generator runs in the worker, whose tables the test reads (a
    # process instance's: test_isolated_nested.py)
    boxer = Boxer.options(yr.InvokeOptions(light=True)).invoke() if source == "method" else None
    gen = boxer.stream.invoke(3) if boxer else boxed_stream.invoke(3)
    items = list(gen)
    item_ids = {item.id for item in items}  # "<call id>.<index>": none may stay in the driver
    boxes = yr.get(items, T)
    del gen, items  # the items themselves are dropped here
    assert [int(yr.get(box[0], T)[0]) for box in boxes] == [0, 1, 2]
    assert sum(f["owned"] for f in borrow_cluster.run(probe).values()) == 3  # still held
    del boxes
    gc.collect()

    def back() -> bool:  # the workers' tables empty, the driver's no fuller than before
        now = live(borrow_cluster)
        return now.pop("driver") <= before and sum(now.values()) == 0

    wait_until(back, 30, lambda: f"every worker's table and store empty and the driver's "
                                 f"back to {before}, not {live(borrow_cluster)}")
    # the items' entries (holders of the lent refs) left the driver's table: a driver count
    # no higher than before alone could hide them behind earlier tests' refs freed since
    assert len(item_ids) == 3 and not item_ids & set(installed_runtime().objects.entries)
    if boxer:
        boxer.terminate(is_sync=True)


def test_refs_in_generator_items_consumed_in_the_producers_process_are_freed(cluster):
    """The consumer is a task on the producer's own worker (the only one): the item is not
    there yet when its refs are lent, so the consumer's stream counts it held from the lend
    on; once the task drops the items and the refs, nothing is left."""
    active = cluster(kind="embedded", num_cpus=1)
    with distributed.Client(active.address, set_as_default=False, timeout=30) as client:
        assert len(client.run(probe)) == 1
        values, here = yr.get(consume_boxed_stream.invoke(3), T)
        assert values == [0, 1, 2] and here
        wait_until(lambda: sum(live(client).values()) == 0, 30,
                   lambda: f"every table and store empty, not {live(client)}")
