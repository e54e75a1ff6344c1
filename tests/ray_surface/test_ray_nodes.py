"""Nodes on the Ray surface (docs/nodes.md): node labels, ``label_selector``, a head node
without CPUs, and a cancelled task's lost result (docs/objects.md "Reconstruction").

Each ``dask worker`` plays a node of its own (``YRDASK_NODE_ID``, conftest: ``node-<name>``);
two carry labels (``yrdask.worker.labels``), a third keeps a large result and is killed.
"""

from __future__ import annotations

import json
import os
import uuid

import numpy as np
import pytest

import yrdask.ray as ray
from conftest import kill_node, wait_for_file, wait_until
from yrdask.runtime.store import node_store
from yrdask.ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

pytestmark = pytest.mark.timeout(120)

T = 60
ZONE_A = {"zone": "a"}
ZONE_B = {"zone": "b", "market": "spot"}
WORKERS = [
    {"name": "lab-a", "env": {"DASK_YRDASK__WORKER__LABELS": json.dumps(ZONE_A)}},
    {"name": "lab-b", "env": {"DASK_YRDASK__WORKER__LABELS": json.dumps(ZONE_B)}},
    {"name": "lab-k", "resources": "keeper=1"},
]


@pytest.fixture(scope="module")
def nodes(cluster):
    """The cli processes (no runtime attached); a test kills the keeper, so they are stopped
    at the end of the module."""
    yield cluster.cli_processes(WORKERS)
    cluster.stop_cli()


@pytest.fixture
def on_nodes(nodes, cluster):
    cluster.finalize()
    ray.init(address=nodes.address)
    yield nodes
    ray.shutdown()
    cluster.finalize()


@ray.remote(num_cpus=1)
def where() -> tuple[str, dict]:
    ctx = ray.get_runtime_context()
    return ctx.get_node_id(), ctx.get_node_labels()


@ray.remote
class Where:
    def node(self) -> tuple[str, dict]:
        ctx = ray.get_runtime_context()
        return ctx.get_node_id(), ctx.get_node_labels()


def test_label_selector_places_work_by_node_labels_which_the_work_reads(on_nodes):
    """An actor and tasks with a ``label_selector`` run on the nodes whose labels match
    (equals, ``!v``, ``in(...)``, the node id); ``get_node_labels`` there gives the node's
    labels and its id, as ``ray.nodes()`` lists them."""
    node_b = {**ZONE_B, "ray.io/node-id": "node-lab-b"}
    actor = Where.options(label_selector={"market": "spot"}).remote()
    assert ray.get(actor.node.remote(), timeout=T) == ("node-lab-b", node_b)
    for _ in range(4):  # every run lands on a matching node, not by chance
        assert ray.get(where.options(label_selector={"zone": "a"}).remote(), timeout=T) == \
            ("node-lab-a", {**ZONE_A, "ray.io/node-id": "node-lab-a"})
        not_b = ray.get(where.options(label_selector={"zone": "!b"}).remote(), timeout=T)
        assert not_b[0] in ("node-lab-a", "node-lab-k"), not_b
        picked = ray.get(where.options(label_selector={"zone": "in(b,c)"}).remote(), timeout=T)
        assert picked[0] == "node-lab-b", picked
        by_id = ray.get(where.options(
            label_selector={"ray.io/node-id": "node-lab-k"}).remote(), timeout=T)
        assert by_id == ("node-lab-k", {"ray.io/node-id": "node-lab-k"})
    listed = {n["NodeID"]: n["Labels"] for n in ray.nodes()}
    assert listed["node-lab-b"] == node_b and listed["node-lab-k"] == {"ray.io/node-id":
                                                                       "node-lab-k"}


def test_a_label_selector_and_a_hard_node_affinity_both_hold(on_nodes):
    """Both constraints hold together: the node named by the strategy must also match the
    selector (Ray ANDs them), so a task whose two rules name one node runs there."""
    opts = dict(scheduling_strategy=NodeAffinitySchedulingStrategy("node-lab-a", soft=False),
                label_selector={"zone": "a"})
    assert ray.get(where.options(**opts).remote(), timeout=T)[0] == "node-lab-a"


@ray.remote
def make_large(runs: str) -> np.ndarray:
    """A 2 MB result (its node's store keeps it); each run leaves a file in ``runs``."""
    open(os.path.join(runs, f"{os.getpid()}-{uuid.uuid4().hex}"), "w").close()
    return np.ones(2 << 20, dtype=np.uint8)


@ray.remote
def large_when(path: str) -> np.ndarray:
    """A 2 MB result, once ``path`` exists."""
    wait_for_file(path, T)
    return np.ones(2 << 20, dtype=np.uint8)


def test_wait_with_fetch_local_pulls_values_to_the_drivers_node(on_nodes, tmp_path):
    """``ray.wait(fetch_local=True)`` pulls a value another node keeps into this node's
    store and counts it ready once it is here; ``fetch_local=False`` leaves it there; a
    value that gets ready after the wait returned is pulled too, as on Ray.  The tasks
    are placed with ``ray._raylet.RAY_NODE_ID_KEY``, as Ray's programs name a node."""
    go, later = tmp_path / "go", tmp_path / "later"
    go.touch()
    on_a = large_when.options(label_selector={ray._raylet.RAY_NODE_ID_KEY: "node-lab-a"})
    first, second = on_a.remote(str(go)), on_a.remote(str(later))
    here = node_store()
    assert ray.wait([first], timeout=T, fetch_local=False)[0] == [first]
    assert not here.contains(first.hex())
    assert ray.wait([first, second], timeout=T, fetch_local=True) == ([first], [second])
    assert here.contains(first.hex())
    later.touch()
    wait_until(lambda: here.contains(second.hex()), T, "the later value pulled here")
    assert ray.get(second, timeout=T).sum() == 2 << 20


def test_a_cancelled_task_s_lost_result_is_not_computed_again(on_nodes, tmp_path):
    """``ray.cancel`` of a task that already finished marks it: when the node keeping its
    result is lost, reading it raises ``ObjectReconstructionFailedError`` (an
    ``ObjectLostError``) and the task does not run again, as on Ray."""
    keeper = on_nodes.worker_with("keeper")
    make = make_large.options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(f"node-{keeper.name}", soft=True))
    ref = make.remote(str(tmp_path))
    ready, _ = ray.wait([ref], timeout=T, fetch_local=False)
    assert ready
    ray.cancel(ref)
    kill_node(keeper)

    with pytest.raises(ray.exceptions.ObjectReconstructionFailedError) as err:
        ray.get(ref, timeout=T)
    assert isinstance(err.value, ray.exceptions.ObjectLostError)
    assert "was cancelled" in str(err.value) and ref.hex() in str(err.value), err.value
    assert len(list(tmp_path.iterdir())) == 1, "the cancelled task ran again"


def test_a_head_node_without_cpus_runs_zero_cpu_work(cluster):
    """``ray.init(num_cpus=0)`` (Ray's head node that runs no tasks) starts a node offering
    no CPU, where ``num_cpus=0`` tasks and actors still run."""
    cluster.finalize()
    ray.init(num_cpus=0)
    try:
        assert ray.cluster_resources().get("CPU", 0) == 0
        free = ray.remote(num_cpus=0)(lambda: os.getpid())
        assert ray.get(free.remote(), timeout=T) != os.getpid()
        actor = Where.options(num_cpus=0).remote()
        assert ray.get(actor.node.remote(), timeout=T)[0]
    finally:
        ray.shutdown()
        cluster.finalize()
