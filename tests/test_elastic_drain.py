"""Scale-down loses nothing (SPEC §9, docs/deploy.md "Scaling down"), on a real
``LocalCluster`` of two worker processes with the yrdask preloads: Dask's own
``workers_to_close`` / ``retire_workers`` (called directly, as the HTTP API and
``client.retire_workers`` do) and one ``cluster.adapt()`` run."""
from __future__ import annotations

import contextlib
import os
import threading

import dask
import pytest
import yr
from distributed import Client, LocalCluster

from conftest import wait_until
from yrdask.runtime.context import current_runtime

pytestmark = pytest.mark.timeout(90)


@yr.instance
class Counter:
    def __init__(self) -> None:
        self.n = 0
        self.seen: list[int] = []

    def inc(self, k: int = 0, sleep_s: float = 0.0) -> int:
        import time

        time.sleep(sleep_s)
        self.n += 1
        self.seen.append(k)
        return self.n

    def checkpoint(self) -> int:
        yr.save_state()
        return self.n

    def state(self) -> tuple:
        return self.n, list(self.seen), os.getpid()

    def hold(self, path: str) -> int:
        """Runs until ``path`` exists (says it started with ``path.started``)."""
        import time

        open(path + ".started", "w").close()
        while not os.path.exists(path):
            time.sleep(0.01)
        return self.n


@yr.invoke
def big(n: int) -> bytes:
    return b"x" * n


@yr.invoke
def wait_for(path: str) -> str:
    import time

    while not os.path.exists(path):
        time.sleep(0.01)
    return "done"


@pytest.fixture(scope="module")
def local(cluster):
    """Two worker processes of one node, yr connected; each test gets both back."""
    cluster.finalize()  # the session's yr runtime, if any: this module brings its own
    lc = LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                      scheduler_kwargs={"preload": ["yrdask"]}, preload=["yrdask"],
                      dashboard_address=":0")
    with joined(lc) as client:
        yield lc, client


@contextlib.contextmanager
def joined(dask_cluster):
    """A Dask client and the yr runtime on ``dask_cluster``; both and it closed on exit."""
    client = Client(dask_cluster)
    yr.init(yr.Config(server_address=dask_cluster.scheduler_address))
    try:
        yield client
    finally:
        yr.finalize()
        client.close()
        dask_cluster.close()


@pytest.fixture
def two(local):
    lc, client = local
    live = {ws["name"] for ws in client.scheduler_info()["workers"].values()}
    if len(live) < 2:  # forget the retired ones, then start new ones
        lc.sync(lc.scale_down, [n for n in lc.worker_spec if n not in live])
        lc.scale(2)
        wait_until(lambda: client.run_on_scheduler(
            lambda dask_scheduler: len(dask_scheduler.extensions["yr"].ledger.processes)) == 2,
            60, "two yr workers")
    wait_until(lambda: not client.run_on_scheduler(  # leases go back after lease_idle_s
        lambda dask_scheduler: dask_scheduler.extensions["yr"].leases.ledger.holdings
        and any(h.kind == "lease" for h in
                dask_scheduler.extensions["yr"].leases.ledger.holdings.values())),
        10, "no yr task lease held (the last test's work is over)")
    return lc, client


def host_of(client: Client, iid: str) -> str:
    return client.run_on_scheduler(
        lambda dask_scheduler: dask_scheduler.extensions["yr"].instances.lifecycle
        .instances[iid].worker)


def to_close(client: Client, n: int = 2) -> list:
    return client.run_on_scheduler(
        lambda dask_scheduler: dask_scheduler.workers_to_close(n=n))


def test_a_worker_running_a_yr_task_is_not_proposed(two, tmp_path):
    _lc, client = two
    flag = str(tmp_path / "go")
    ref = wait_for.invoke(flag)
    busy = wait_until(lambda: [w for w, ws in client.scheduler_info()["workers"].items()
                               if ws["metrics"].get("yr", {}).get("tasks_running")],
                      30, "the task to run")[0]
    proposed = to_close(client)
    assert busy not in proposed
    open(flag, "w").close()
    assert yr.get(ref) == "done"


def test_an_instance_without_a_checkpoint_keeps_its_worker_unless_the_key_says(two):
    """Kept by default (as Ray keeps nodes with actors); with
    ``yrdask.scheduling.drain-restart-unmovable`` its worker retires and it restarts
    elsewhere from ``__init__``, within its restart budget."""
    _lc, client = two
    # a process instance: its process ends before its worker is removed, so no call is
    # answered from its old state while it restarts elsewhere (the check of the last call)
    c = Counter.options(yr.InvokeOptions(recover_retry_times=1)).invoke()
    assert yr.get(c.inc.invoke(1)) == 1
    host = host_of(client, c.instance_id)
    proposed = to_close(client)
    assert host not in proposed and len(proposed) == 1
    assert client.retire_workers(workers=[host], close_workers=True) == {}
    assert host in client.scheduler_info()["workers"]
    assert yr.get(c.inc.invoke(2)) == 2 and host_of(client, c.instance_id) == host
    with dask.config.set({"yrdask.scheduling.drain-restart-unmovable": True}):
        assert host in to_close(client)  # the scheduler runs in this process: it sees the key
        assert host in client.retire_workers(workers=[host], close_workers=True)
    assert yr.get(c.inc.invoke(3)) == 1  # a fresh __init__ elsewhere
    assert host_of(client, c.instance_id) != host
    c.terminate()


def test_a_process_ended_for_a_retirement_dask_refused_restarts_on_its_worker(two):
    """The drain ends the processes of instances that restart elsewhere; when Dask then
    keeps the worker (Dask data no other worker can take), they restart there."""
    _lc, client = two
    c = Counter.options(yr.InvokeOptions(recover_retry_times=1)).invoke()
    assert yr.get(c.inc.invoke(1)) == 1
    host = host_of(client, c.instance_id)
    other = next(w for w in client.scheduler_info()["workers"] if w != host)
    data = client.scatter(b"d" * 1000, workers=[host])  # only the host has it
    with dask.config.set({"yrdask.scheduling.drain-restart-unmovable": True}):
        retired = client.retire_workers(workers=[host, other], close_workers=True)
    assert host not in retired and host in client.scheduler_info()["workers"]
    assert yr.get(c.inc.invoke(2), timeout=30) == 1  # a fresh __init__, on its worker
    assert host_of(client, c.instance_id) == host
    del data
    c.terminate()


@pytest.mark.parametrize("isolated", [False, True], ids=["in-worker", "own-process"])
def test_a_checkpointed_instance_moves_with_its_state_and_calls_run_once(two, isolated):
    """Retiring the host (``client.retire_workers``) moves the instance with its current
    state (not its last checkpoint), and calls sent while it drains are held, then run
    once on the new home, in order."""
    _lc, client = two
    c = Counter.options(yr.InvokeOptions(isolated=True) if isolated
                        else yr.InvokeOptions(light=True)).invoke()
    assert yr.get(c.checkpoint.invoke()) == 0  # movable from now on
    assert yr.get([c.inc.invoke(k) for k in range(1, 4)]) == [1, 2, 3]  # after the checkpoint
    old = host_of(client, c.instance_id)
    slow = c.inc.invoke(4, 0.5)  # runs while the drain starts: it finishes first
    retire = threading.Thread(target=client.retire_workers,
                              kwargs={"workers": [old], "close_workers": True})
    retire.start()
    iid = c.instance_id
    if isolated:  # its calls go to its own process, which holds them; once the state is
        # taken there, the scheduler moves the instance off its worker
        wait_until(lambda: client.run_on_scheduler(
            lambda dask_scheduler: dask_scheduler.extensions["yr"].instances.lifecycle
            .instances[iid].worker != old), 30, "the drain to take the instance's state")
    else:
        wait_until(lambda: client.run(
            lambda dask_worker: iid in dask_worker.extensions["yr"].instance_side.held,
            workers=[old]).get(old), 30, "the drain to hold the instance's calls")
    during = [c.inc.invoke(k) for k in range(5, 10)]  # held on the old host, then moved
    retire.join(60)
    assert yr.get(slow) == 4 and yr.get(during) == [5, 6, 7, 8, 9]
    n, seen, _pid = yr.get(c.state.invoke())
    assert (n, seen) == (9, list(range(1, 10)))  # each call ran exactly once, in order
    new = host_of(client, c.instance_id)
    assert new != old and old not in client.scheduler_info()["workers"]
    moved = [e for e in current_runtime().router.order.story_of(c.instance_id) if "moved" in e[1]]
    if not isolated:  # (a process instance's calls above were sent once it had moved)
        assert moved, "no call was answered 'moved' by the old host"
    c.terminate()


def test_nothing_new_is_placed_on_a_worker_while_it_drains(two, tmp_path):
    """From the moment ``retire_workers`` drains a worker, new instances go elsewhere,
    though it has the most room (else the drain would end by keeping it: work was placed
    on it meanwhile)."""
    _lc, client = two
    light = yr.InvokeOptions(light=True, cpu=100)
    mover = Counter.options(light).invoke()
    assert yr.get(mover.checkpoint.invoke()) == 0  # movable
    host = host_of(client, mover.instance_id)
    # the other worker process is fuller than the host from now on (the node's processes
    # are ranked by their own free CPU)
    filler = Counter.options(yr.InvokeOptions(light=True, cpu=500)).invoke()
    yr.get(filler.inc.invoke())
    other = host_of(client, filler.instance_id)
    assert other != host
    flag = str(tmp_path / "go")
    running = mover.hold.invoke(flag)  # the drain waits for it
    wait_until(lambda: os.path.exists(flag + ".started"), 30, "the call to run")
    retired: list = []
    retire = threading.Thread(target=lambda: retired.append(client.retire_workers(
        workers=[host], close_workers=True)))
    retire.start()
    try:
        wait_until(lambda: client.run_on_scheduler(
            lambda dask_scheduler: dask_scheduler.extensions["yr"].ledger.processes[host]
            .draining), 30, "the drain to begin")
        newcomer = Counter.options(light).invoke()
        assert yr.get(newcomer.inc.invoke()) == 1
        assert host_of(client, newcomer.instance_id) == other
    finally:
        open(flag, "w").close()
        retire.join(60)
    assert yr.get(running) == 0 and host in retired[0]
    assert host_of(client, mover.instance_id) == other
    assert yr.get(newcomer.inc.invoke()) == 2
    for c in (mover, filler, newcomer):
        c.terminate()


def test_a_value_kept_only_by_the_retired_worker_is_read_after(two):
    _lc, client = two
    ref = big.invoke(2 * 1024 * 1024)  # large: its worker keeps it in the node's store
    assert len(yr.get(ref)) == 2 * 1024 * 1024
    entry = current_runtime().objects.entries[ref.id]
    keeper = entry.location
    assert keeper in client.scheduler_info()["workers"]
    wait_until(lambda: not client.run_on_scheduler(  # its lease goes back after lease_idle_s
        lambda dask_scheduler: dask_scheduler.extensions["yr"].leases.holdings_on(keeper)),
        10, "the task's lease to go back")
    retired = client.retire_workers(workers=[keeper], close_workers=True)
    assert keeper in retired
    wait_until(lambda: entry.location != keeper, 10, "the owner to learn the new keeper")
    assert entry.location in client.scheduler_info()["workers"]
    entry.value = None  # read it again from where it is kept now, not from the cache
    entry.has_value = False
    assert yr.get(ref) == b"x" * (2 * 1024 * 1024)


def test_adaptive_scale_down_moves_a_checkpointed_instance(two):
    """One real ``adapt()`` run: Dask's Adaptive proposes the idle worker with the least
    Dask data (the instance's host: the other holds a scattered key), retires it through
    the scheduler's ``retire_workers`` and then kills it; the instance lives on with its
    state on the remaining worker."""
    lc, client = two
    c = Counter.invoke()
    assert yr.get(c.inc.invoke(1)) == 1
    assert yr.get(c.checkpoint.invoke()) == 1
    assert yr.get(c.inc.invoke(2)) == 2  # the state to keep is newer than the checkpoint
    host = host_of(client, c.instance_id)
    other = next(w for w in client.scheduler_info()["workers"] if w != host)
    data = client.scatter(b"d" * 1_000_000, workers=[other])
    adaptive = lc.adapt(minimum=1, maximum=2, interval="200ms", wait_count=2)
    try:
        wait_until(lambda: list(client.scheduler_info()["workers"]) == [other], 30,
                   "Adaptive to retire the instance's host")
    finally:
        adaptive.stop()
    assert yr.get(c.inc.invoke(3)) == 3
    assert host_of(client, c.instance_id) == other
    del data
    c.terminate()


@pytest.fixture
def two_nodes(local):
    """Two worker processes playing two nodes (``YRDASK_NODE_ID``): separate stores."""
    from distributed import Nanny, Scheduler, SpecCluster

    lc, _client = local
    yr.finalize()
    workers = {n: {"cls": Nanny, "options": {"nthreads": 1, "preload": ["yrdask"],
                                             "env": {"YRDASK_NODE_ID": f"drain-{n}"}}}
               for n in ("a", "b")}
    sc = SpecCluster(workers=workers, scheduler={"cls": Scheduler, "options": {
        "preload": ["yrdask"], "dashboard_address": ":0"}})
    try:
        with joined(sc) as client:
            yield sc, client
    finally:
        yr.init(yr.Config(server_address=lc.scheduler_address))


def test_a_value_kept_on_a_retiring_node_is_copied_to_another_node(two_nodes):
    _sc, client = two_nodes
    ref = big.invoke(2 * 1024 * 1024)
    yr.wait([ref])
    entry = current_runtime().objects.entries[ref.id]
    keeper = entry.location
    wait_until(lambda: not client.run_on_scheduler(
        lambda dask_scheduler: dask_scheduler.extensions["yr"].leases.holdings_on(keeper)),
        10, "the task's lease to go back")
    assert keeper in client.retire_workers(workers=[keeper], close_workers=True)
    new = wait_until(lambda: entry.location if entry.location != keeper else None, 10,
                     "the owner to learn the new keeper")
    assert new != keeper and new in client.scheduler_info()["workers"]
    copied = client.run(lambda: __import__("yrdask.runtime.store", fromlist=["x"])
                        .node_store().contains(ref.id), workers=[new])[new]
    assert copied, "the value was not written to the other node's store"
    assert yr.get(ref) == b"x" * (2 * 1024 * 1024)  # never read before: pulled from there
