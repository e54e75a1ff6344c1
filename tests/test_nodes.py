"""The node API (yr_api §1.9): `yr.get_node_id`, `yr.get_node_ip_address`, `yr.resources`.

A node is a machine (docs/nodes.md): the worker processes of one host form one node, whose id
is the host's IP unless its processes name another (``YRDASK_NODE_ID``: the cli clusters of the
suite give each ``dask worker`` a node of its own, as Ray's cluster_utils adds nodes).
"""

from __future__ import annotations

import os

import pytest

import yrdask as yr
from conftest import wait_until

pytestmark = pytest.mark.timeout(180)

T = 60


@yr.invoke
def here():
    return yr.get_node_id(), yr.get_node_ip_address(), os.getpid()


@yr.invoke
def resources_inside():
    return yr.resources()


@yr.instance
class Resident:
    def where(self):
        return yr.get_node_id(), yr.get_node_ip_address()


def _host(address: str) -> str:
    return address.split("://")[1].rsplit(":", 1)[0]


def _by_id(nodes: list[dict]) -> dict[str, dict]:
    return {n["id"]: n for n in nodes}


def test_before_init_the_node_calls_raise(cluster):
    cluster.finalize()
    for call in (yr.get_node_id, yr.get_node_ip_address, yr.resources):
        with pytest.raises(yr.YRRuntimeError, match="not initialized"):
            call()


def test_resources_has_openyuanrong_shape(yr_cluster):
    nodes = yr.resources()
    assert nodes and [n["id"] for n in nodes] == sorted(n["id"] for n in nodes)
    for n in nodes:
        assert set(n) == {"id", "status", "capacity", "allocatable"}
        assert n["status"] == 0
        assert {"CPU", "Memory"} <= set(n["capacity"])
        assert set(n["allocatable"]) == set(n["capacity"])
        for r, amount in n["capacity"].items():
            assert isinstance(amount, float) and 0.0 <= n["allocatable"][r] <= amount
    if yr_cluster.kind == "embedded":  # Config(num_cpus=2): one node of 2 CPUs (2 processes)
        assert [n["capacity"]["CPU"] for n in nodes] == [2000.0]
        assert nodes[0]["id"] == _host(yr_cluster.address)  # the host's IP
    else:  # CLI_WORKERS: one worker tagged gpu_node, one plain
        assert sorted(n["capacity"].get("gpu_node", 0.0) for n in nodes) == [0.0, 1.0]


def test_tasks_and_instances_report_the_worker_they_run_on(yr_cluster):
    nodes = _by_id(yr.resources())
    results = yr.get([here.invoke() for _ in range(6)], T)
    for node_id, ip, _pid in results:
        assert node_id in nodes and ip == _host(yr_cluster.address)
    # A worker process belongs to one node: the same pid always reports the same id.
    by_pid: dict[int, set] = {}
    for node, _, pid in results:
        by_pid.setdefault(pid, set()).add(node)
    assert all(len(ids) == 1 for ids in by_pid.values()), by_pid
    if yr_cluster.kind == "embedded":
        assert {node for node, _, _ in results} == {_host(yr_cluster.address)}
    if yr_cluster.kind == "cli":
        assert {pid for _, _, pid in results} <= yr_cluster.worker_pids()
        tagged = yr.InvokeOptions(custom_resources={"gpu_node": 1})
        node_id = yr.get(here.options(tagged).invoke(), T)[0]
        assert nodes[node_id]["capacity"].get("gpu_node") == 1.0
    inst = Resident.invoke()
    first = yr.get(inst.where.invoke(), T)
    assert first[0] in nodes and yr.get(inst.where.invoke(), T) == first
    inst.terminate(is_sync=True)


def test_the_driver_is_not_a_node(yr_cluster):
    driver = yr.get_node_id()
    assert driver.split("://")[0] == yr_cluster.address.split("://")[0]
    assert driver not in _by_id(yr.resources())
    # Every process of these clusters runs on this machine, on the scheduler's interface.
    assert yr.get_node_ip_address() == _host(yr_cluster.address)


def test_allocatable_follows_what_instances_hold(yr_cluster):
    """An instance holds its CPU for its whole life; `allocatable` shows it, also from inside."""
    inst = Resident.options(yr.InvokeOptions(cpu=1000)).invoke()
    node_id = yr.get(inst.where.invoke(), T)[0]
    capacity = _by_id(yr.resources())[node_id]["capacity"]["CPU"]

    def cpu_free():
        return _by_id(yr.resources())[node_id]["allocatable"]["CPU"]

    # Task leases go back within ~1 s of idling, after which only the instance holds CPU.
    wait_until(lambda: cpu_free() == capacity - 1000, 30,
               lambda: f"allocatable CPU {capacity - 1000} on {node_id}, got {cpu_free()}")
    inside = _by_id(yr.get(resources_inside.invoke(), T))
    assert inside[node_id]["allocatable"]["CPU"] <= capacity - 1000
    inst.terminate(is_sync=True)
    wait_until(lambda: cpu_free() == capacity, 30,
               lambda: f"allocatable CPU back to {capacity} on {node_id}, got {cpu_free()}")
