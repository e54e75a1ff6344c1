"""Lineage reconstruction across nodes (docs/objects.md "Reconstruction", "What survives
which failure").

Each ``dask worker`` plays a node of its own (``YRDASK_NODE_ID``), so each has its own
shared-memory store, and the driver's node another: a survivor and one keeper per test.  A
large result is made on the test's *keeper* node,
whose only process is then killed with ``SIGKILL``: its store goes with it (the test waits
until the store directory is removed), so the value is really gone.  Reading it then runs the
task again on the surviving node (Ray's lineage reconstruction), fails with
``ObjectLostError`` when the task has no reruns left (Ray's ``max_retries=0``), and always
fails for a method call's result (Ray does not rebuild actor task outputs either).  A
generator task's lost items are rebuilt the same way, by running the generator again.
"""

from __future__ import annotations

import os
import uuid

import numpy as np
import pytest

import yrdask as yr
from conftest import kill_node
from yrdask.affinity import Affinity, AffinityKind, AffinityType, LabelOperator, OperatorType
from yrdask.runtime.store import store_dir

pytestmark = pytest.mark.timeout(120)

T = 60
MB2 = 2 << 20  # well above the 512 KiB inline limit: the keeper's node store holds it
#: a survivor node and one keeper node per test (tagged ``keeper<n>``, which its work
#: prefers), all started at once: a worker added later costs a test seconds
WORKERS = [{"name": "recon-a"}] + [{"name": f"recon-k{n}", "resources": f"keeper{n}=1"}
                                   for n in (1, 2, 3, 4, 5)]


def on_keeper(n: int) -> yr.InvokeOptions:
    """Soft placement on keeper ``n``: the first run goes there, a rerun anywhere left."""
    return yr.InvokeOptions(schedule_affinities=[Affinity(
        AffinityKind.RESOURCE, AffinityType.PREFERRED,
        [LabelOperator(OperatorType.LABEL_EXISTS, f"keeper{n}")])])


@pytest.fixture(scope="module")
def nodes(cluster):
    """The cli processes (no yr runtime attached: each test picks yr or Ray); each test
    kills its own keeper, so they are stopped at the end of the module."""
    yield cluster.cli_processes(WORKERS)
    cluster.stop_cli()


@pytest.fixture(autouse=True)
def _finalized(cluster):
    yield
    cluster.finalize()


def make_large(runs: str, seed: int) -> np.ndarray:
    """A 2 MB result; each run leaves a file ``<pid>-<uuid>`` in ``runs``."""
    open(os.path.join(runs, f"{os.getpid()}-{uuid.uuid4().hex}"), "w").close()
    return np.full(MB2, seed, dtype=np.uint8)


def runs_in(runs) -> list[int]:
    return [int(p.name.split("-")[0]) for p in runs.iterdir()]


@yr.instance
class Maker:
    def make(self, seed: int) -> np.ndarray:
        return np.full(MB2, seed, dtype=np.uint8)

    def pid(self) -> int:
        return os.getpid()


def test_a_lost_task_result_is_computed_again(nodes, tmp_path):
    """The keeper's node dies after the task ended: ``get`` reruns the task on the other
    node and returns the right value; the task body ran twice, first on the keeper."""
    yr.init(yr.Config(server_address=nodes.address))
    keeper = nodes.worker_with("keeper1")
    ref = yr.invoke(make_large).options(on_keeper(1)).invoke(str(tmp_path), 7)
    ready, _ = yr.wait([ref], timeout=T)  # done, not read: the driver's node has no copy
    assert ready
    first = set(runs_in(tmp_path))
    assert first <= keeper.pids(), "the first run was not on the keeper"
    assert os.path.exists(os.path.join(store_dir(f"node-{keeper.name}"), "objects", ref.id))
    assert not os.path.exists(os.path.join(store_dir(), "objects", ref.id)), \
        "the driver's node holds a copy: nothing would be lost"
    kill_node(keeper)

    got = yr.get(ref, T)
    assert got.nbytes == MB2 and int(got[0]) == 7 and int(got[-1]) == 7
    runs = runs_in(tmp_path)
    assert len(runs) == 2, f"the task ran {len(runs)} times, expected 2 (once more to rebuild)"
    rerun = set(runs) - first
    assert rerun and rerun <= nodes.worker_pids(), "the rerun was not on a surviving node"


def test_a_lost_result_with_no_reruns_left_raises_object_lost(nodes, tmp_path):
    """Ray's ``max_retries=0``: the lost result is not computed again, and reading it raises
    ``ray.exceptions.ObjectLostError`` naming the object and the task's bound."""
    from yrdask import ray

    ray.init(address=nodes.address)
    try:
        keeper = nodes.worker_with("keeper2")
        from yrdask.ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        # the node id is the worker's YRDASK_NODE_ID (conftest: node-<name>, docs/nodes.md)
        make = ray.remote(max_retries=0)(make_large).options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(f"node-{keeper.name}", soft=True))
        ref = make.remote(str(tmp_path), 5)
        # fetch_local=False: the default pulls a copy to the driver's node, as on Ray, and
        # that copy would outlive the keeper
        ready, _ = ray.wait([ref], timeout=T, fetch_local=False)
        assert ready
        assert set(runs_in(tmp_path)) <= keeper.pids(), "the first run was not on the keeper"
        kill_node(keeper)

        with pytest.raises(ray.exceptions.ObjectLostError) as err:
            ray.get(ref, timeout=T)
        assert not isinstance(err.value, ray.exceptions.OwnerDiedError)  # the driver owns it
        message = str(err.value)
        assert ref.hex() in message and "lost with worker" in message, message
        assert "max_retries=0 allows no more" in message, message
        assert len(runs_in(tmp_path)) == 1, "the task ran again despite max_retries=0"
    finally:
        ray.shutdown()


def test_a_lost_method_result_raises_object_lost(nodes):
    """A method call's large result lost with its node is not computed again (Ray's rule
    for actor task outputs): ``ObjectLostError`` naming the object and why."""
    yr.init(yr.Config(server_address=nodes.address))
    keeper = nodes.worker_with("keeper3")
    maker = Maker.options(on_keeper(3)).invoke()
    assert yr.get(maker.pid.invoke(), T) in keeper.pids()
    ref = maker.make.invoke(9)
    ready, _ = yr.wait([ref], timeout=T)
    assert ready
    kill_node(keeper)

    with pytest.raises(yr.errors.ObjectLostError) as err:
        yr.get(ref, T)
    assert not isinstance(err.value, yr.errors.OwnerDiedError)  # the driver owns it
    message = str(err.value)
    assert ref.id in message and "lost with worker" in message, message
    assert "method call results" in message, message


def fewer_when_run_again(runs: str):
    """Three 2 MB items on its first run, two on later ones (each run leaves a file)."""
    first = not os.listdir(runs)
    open(os.path.join(runs, f"{os.getpid()}-{uuid.uuid4().hex}"), "w").close()
    for i in range(3 if first else 2):
        yield np.full(MB2, i + 1, dtype=np.uint8)


def test_lost_generator_items_are_computed_again(nodes, tmp_path):
    """A generator task's items kept on a node that dies: reading one runs the generator
    again and settles each lost item with the rerun's item of the same index; an item the
    rerun did not yield again raises a ``ValueError`` that says so."""
    yr.init(yr.Config(server_address=nodes.address))
    keeper = nodes.worker_with("keeper4")
    gen = yr.invoke(fewer_when_run_again).options(on_keeper(4)).invoke(str(tmp_path))
    refs = list(gen)  # the stream is over: every item came, none read
    assert len(refs) == 3
    first = set(runs_in(tmp_path))
    assert first <= keeper.pids(), "the first run was not on the keeper"
    kill_node(keeper)

    for i in (0, 1):
        got = yr.get(refs[i], T)
        assert got.nbytes == MB2 and int(got[0]) == i + 1 and int(got[-1]) == i + 1
    with pytest.raises(ValueError, match="yielded fewer items than the first time") as err:
        yr.get(refs[2], T)
    assert refs[2].id in str(err.value)
    runs = runs_in(tmp_path)
    assert len(runs) == 2, f"the generator ran {len(runs)} times, expected 2 (once to rebuild)"
    assert set(runs) - first <= nodes.worker_pids(), "the rerun was not on a surviving node"


def three_large(runs: str):
    """Three 2 MB items, ``i + 1`` each; each run leaves a file."""
    open(os.path.join(runs, f"{os.getpid()}-{uuid.uuid4().hex}"), "w").close()
    for i in range(3):
        yield np.full(MB2, i + 1, dtype=np.uint8)


def test_lost_items_of_a_dynamic_generator_are_computed_again(nodes, tmp_path):
    """Ray's ``num_returns="dynamic"``: the caller owns the items (not the worker that ran
    the generator), so the items survive that worker's node, and reading them after it died
    runs the task again."""
    from yrdask import ray
    from yrdask.ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    ray.init(address=nodes.address)
    try:
        keeper = nodes.worker_with("keeper5")
        make = ray.remote(num_returns="dynamic")(three_large).options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(f"node-{keeper.name}", soft=True))
        refs = list(ray.get(make.remote(str(tmp_path)), timeout=T))
        assert len(refs) == 3
        assert set(runs_in(tmp_path)) <= keeper.pids(), "the first run was not on the keeper"
        kill_node(keeper)

        for i, ref in enumerate(refs):
            got = ray.get(ref, timeout=T)
            assert got.nbytes == MB2 and int(got[0]) == i + 1
        assert len(runs_in(tmp_path)) == 2, "the generator did not run once more to rebuild"
    finally:
        ray.shutdown()
