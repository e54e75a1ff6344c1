"""Placement and bottom-up scheduling (SPEC §6) on real clusters.

* tags: on a ``dask scheduler``/``dask worker`` subprocess cluster whose workers carry
  ``zone_a`` / ``zone_b``, tasks and instances asking for a tag run in that worker's process;
* ``schedule_affinities``: NODE_ID pins (REQUIRED), steers away (REQUIRED_ANTI), prefers;
  INSTANCE affinities follow instance labels; an affinity no worker meets fails in time;
* local first: nested work runs on the submitting worker and the scheduling figures (the
  workers' heartbeat reports, ``yr_cluster_info``) count it as local; under load it spills.
"""

from __future__ import annotations

import os
import time

import psutil
import pytest

import yrdask as yr
from conftest import wait_until
from yrdask.runtime.context import current_runtime

pytestmark = pytest.mark.timeout(180)

T = 60
ZONES = [{"resources": "zone_a=100"}, {"resources": "zone_b=100"}]


def node_affinity(typ: yr.AffinityType, node: str, kind=yr.AffinityKind.RESOURCE,
                  key: str = "NODE_ID") -> list:
    return [yr.Affinity(kind, typ, [yr.LabelOperator(yr.OperatorType.LABEL_IN, key, [node])])]


def cluster_info() -> dict:
    return current_runtime().scheduler_call("yr_cluster_info")


@yr.invoke
def where() -> tuple[int, str]:
    return os.getpid(), yr.get_node_id()


@yr.instance
class Probe:
    def where(self) -> tuple[int, str]:
        return os.getpid(), yr.get_node_id()


@pytest.fixture
def zones(cluster):
    return cluster(kind="cli", workers=ZONES)


def test_tags_place_tasks_and_instances_on_the_tagged_worker(zones):
    for zone in ("zone_a", "zone_b"):
        pids = zones.cli.worker_with(zone).pids()
        opts = yr.InvokeOptions(cpu=100, memory=10, custom_resources={zone: 1})
        got = yr.get([where.options(opts).invoke() for _ in range(6)], T)
        assert {pid for pid, _ in got} <= pids, (zone, got, pids)
        handles = [Probe.options(opts).invoke() for _ in range(3)]
        got = yr.get([h.where.invoke() for h in handles], T)
        # each instance is a process of its own, started by that worker
        assert all({pid, *(p.pid for p in psutil.Process(pid).parents())} & pids
                   for pid, _ in got), (zone, got, pids)
        for h in handles:
            h.terminate()


def test_node_id_affinity_pins_avoids_and_prefers(zones):
    nodes = [n["id"] for n in yr.resources()]
    assert len(nodes) == 2
    for node in nodes:
        pinned = yr.InvokeOptions(cpu=100, memory=10,
                                  schedule_affinities=node_affinity(yr.AffinityType.REQUIRED, node))
        got = yr.get([where.options(pinned).invoke() for _ in range(6)], T)
        assert {n for _, n in got} == {node}
        h = Probe.options(pinned).invoke()
        assert yr.get(h.where.invoke(), T)[1] == node
        h.terminate()
        anti = yr.InvokeOptions(
            cpu=100, memory=10,
            schedule_affinities=node_affinity(yr.AffinityType.REQUIRED_ANTI, node))
        got = yr.get([where.options(anti).invoke() for _ in range(6)], T)
        assert node not in {n for _, n in got}
        preferred = yr.InvokeOptions(
            cpu=100, memory=10,
            schedule_affinities=node_affinity(yr.AffinityType.PREFERRED, node))
        assert yr.get(where.options(preferred).invoke(), T)[1] == node


def test_affinity_no_worker_meets_fails_after_the_schedule_timeout(zones):
    opts = yr.InvokeOptions(
        cpu=100, schedule_timeout_ms=500,
        schedule_affinities=node_affinity(yr.AffinityType.REQUIRED, "tcp://10.9.9.9:1"))
    with pytest.raises(yr.ScheduleError, match="affinity"):
        yr.get(where.options(opts).invoke(), T)


def test_instance_affinity_follows_labels(zones):
    db = Probe.options(yr.InvokeOptions(cpu=100, memory=10, labels=["role:db"])).invoke()
    db_node = yr.get(db.where.invoke(), T)[1]
    near = yr.InvokeOptions(cpu=100, memory=10, schedule_affinities=node_affinity(
        yr.AffinityType.REQUIRED, "db", kind=yr.AffinityKind.INSTANCE, key="role"))
    got = yr.get([where.options(near).invoke() for _ in range(4)], T)
    assert {n for _, n in got} == {db_node}
    db.terminate()


# --------------------------------------------------------------------------- local first


@yr.invoke
def nested_where(n: int) -> list:
    return [yr.get(where.invoke(), T) for _ in range(n)]


@yr.invoke
def spill(n: int, seconds: float) -> list:
    @yr.invoke
    def busy(s: float) -> int:
        time.sleep(s)
        return os.getpid()

    opts = yr.InvokeOptions(cpu=1000)
    return yr.get([busy.options(opts).invoke(seconds) for _ in range(n)], T)


def local_count() -> int:
    return sum(w.get("scheduling", {}).get("local", 0)
               for w in cluster_info()["scheduling"].values())


def test_nested_work_runs_locally_and_is_counted_as_local(cluster):
    cluster(kind="embedded", num_cpus=2)
    before = local_count()
    yr.get(where.invoke(), T)  # the workers are up
    got = yr.get(nested_where.invoke(20), T)
    assert len({pid for pid, _ in got}) == 1  # all on the parent's worker
    wait_until(lambda: local_count() >= before + 20, 30,
               lambda: f"20 more local tasks in the heartbeat figures ({cluster_info()['scheduling']})")
    assert cluster_info()["counters"]["leases_local"] >= 1


def test_nested_work_spills_to_other_workers_under_load(cluster):
    cluster(kind="embedded", num_cpus=2)
    pids = yr.get(spill.invoke(8, 0.3), T)
    assert len(set(pids)) == 2, f"8 one-CPU tasks of 0.3 s all ran in {set(pids)}"
    wait_until(lambda: sum(w.get("scheduling", {}).get("forwarded", 0)
                           for w in cluster_info()["scheduling"].values()) > 0,
               30, "forwarded work in the heartbeat figures")


def test_local_first_off_places_nested_leases_by_load(cluster, monkeypatch):
    monkeypatch.setenv("DASK_YRDASK__SCHEDULING__LOCAL_FIRST", "False")
    cluster.finalize()
    yr.init(yr.Config(num_cpus=2))
    try:
        @yr.invoke
        def setting() -> bool:
            import dask

            return dask.config.get("yrdask.scheduling.local-first")

        assert yr.get(setting.invoke(), T) is False
        before = cluster_info()["counters"]["leases_local"]
        yr.get(nested_where.invoke(10), T)
        assert cluster_info()["counters"]["leases_local"] == before
    finally:
        yr.finalize()


def test_placement_latency_figures_are_kept(cluster):
    cluster(kind="embedded", num_cpus=2)
    yr.get(where.invoke(), T)
    placement = cluster_info()["placement"]
    assert placement["lease"]["count"] >= 1
    assert 0 <= placement["lease"]["p50_ms"] <= placement["lease"]["p99_ms"]
