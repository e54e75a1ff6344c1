"""Resource groups and yr.Group (yr_api.md §1.6) on real clusters: reservations, placement into
bundles, strategies, removal, validation, gang creation and fate sharing.

Most tests use the standard cli cluster (``two_workers``): two ``dask worker``s of 1000
millicores each, each a node of its own (the embedded cluster is one node: docs/nodes.md).  Every test removes what it created and ends by checking that all capacity is free again.
"""

from __future__ import annotations

import threading

import pytest

import yrdask as yr
from yrdask.runtime.context import current_runtime

pytestmark = pytest.mark.timeout(240)

T = 60  # seconds: explicit bounds of yr.get / wait, well under the test time-out
SMALL = {"CPU": 500, "Memory": 256}


@yr.invoke
def node():
    return yr.get_node_id()


@yr.invoke
def pid():
    import os

    return os.getpid()


@yr.instance
class Member:
    def __init__(self, tag: int = 0) -> None:
        self.tag = tag

    def node(self):
        return self.tag, yr.get_node_id()


def in_bundle(rg, index: int, cpu: int = 250, memory: int = 64,
              schedule_timeout_ms: int = T * 1000) -> yr.InvokeOptions:
    return yr.InvokeOptions(cpu=cpu, memory=memory, schedule_timeout_ms=schedule_timeout_ms,
                            resource_group_options=yr.ResourceGroupOptions(rg.name, index))


def free_cpu() -> dict[str, float]:
    return {n["id"]: n["allocatable"]["CPU"] for n in yr.resources()}


def all_free(wait_until) -> None:
    """The extension holds nothing for this test any more: every worker's CPU is free."""
    wait_until(lambda: all(n["allocatable"]["CPU"] == n["capacity"]["CPU"]
                           for n in yr.resources()),
               T, lambda: f"all capacity free again, got {yr.resources()}")


@pytest.fixture
def two_workers(cluster, wait_until):
    from conftest import CORE_KINDS

    rt = cluster(**CORE_KINDS["cli"])  # two nodes of one 1000-millicore worker each
    wait_until(lambda: len(yr.resources()) == 2, T, "two workers")
    all_free(wait_until)  # idle leases of earlier tests go back within a second or so
    yield rt
    all_free(wait_until)


def test_create_wait_remove_reserves_and_frees_capacity(two_workers, wait_until):
    rg = yr.create_resource_group([dict(SMALL), {"CPU": 300}], name="rg-basic")
    assert (rg.name, rg.resource_group_name, rg.bundle_count) == ("rg-basic", "rg-basic", 2)
    assert rg.bundle_specs == [{"CPU": 500.0, "Memory": 256.0}, {"CPU": 300.0, "Memory": 128.0}]
    assert rg.request_id
    try:
        rg.wait(T)
        assert sum(free_cpu().values()) == 2000 - 800  # reserved out of the workers' free CPU
        with pytest.raises(yr.YRValueError, match="already exists"):
            yr.create_resource_group([dict(SMALL)], name="rg-basic")
    finally:
        yr.remove_resource_group(rg)
    wait_until(lambda: sum(free_cpu().values()) == 2000, T, "the reservation freed")
    with pytest.raises(yr.YRRuntimeError, match="removed"):
        rg.wait(1)


def test_tasks_and_instances_run_on_their_bundles_worker_strict_spread(two_workers):
    rg = yr.create_resource_group([dict(SMALL), dict(SMALL)], strategy="STRICT_SPREAD")
    try:
        rg.wait(T)
        where = [set(yr.get([node.options(in_bundle(rg, i)).invoke() for _ in range(4)],
                            timeout=T)) for i in (0, 1)]
        assert all(len(w) == 1 for w in where), where  # a bundle lives on one worker
        assert where[0] != where[1]  # STRICT_SPREAD: each bundle on its own worker
        h = Member.options(in_bundle(rg, 1)).invoke(7)
        assert yr.get(h.node.invoke(), timeout=T) == (7, next(iter(where[1])))
        # The scheduler's view (dashboard, status) lists the group and where its bundles are.
        info = current_runtime().scheduler_call("yr_cluster_info", instances=False)
        mine = [g for g in info["resource_groups"] if g["name"] == rg.name]
        assert [b["worker"] for b in mine[0]["bundles"]] == [next(iter(w)) for w in where]
        assert mine[0]["state"] == "CREATED" and mine[0]["strategy"] == "STRICT_SPREAD"
        anywhere = yr.get(node.options(in_bundle(rg, -1)).invoke(), timeout=T)
        assert anywhere in where[0] | where[1]
        h.terminate()
    finally:
        yr.remove_resource_group(rg)


def test_a_bundle_is_used_up_by_what_runs_in_it_and_returned_after(two_workers):
    rg = yr.create_resource_group([{"CPU": 500, "Memory": 256}], name="rg-cap")
    try:
        rg.wait(T)
        first = Member.options(in_bundle(rg, 0, cpu=400)).invoke(1)
        assert yr.get(first.node.invoke(), timeout=T)[0] == 1
        # 100 millicores left in the bundle: a 400 request waits though the workers have room.
        second = Member.options(in_bundle(rg, 0, cpu=400)).invoke(2)
        ready, _ = yr.wait([second.node.invoke()], timeout=2)
        assert ready == []
        first.terminate()
        assert yr.get(second.node.invoke(), timeout=T)[0] == 2
        second.terminate()
    finally:
        yr.remove_resource_group(rg)


@yr.invoke
def pid_and_node():
    import os

    return os.getpid(), yr.get_node_id()


def test_bundles_of_a_lost_worker_are_placed_again(two_workers, wait_until):
    import os
    import signal

    rg = yr.create_resource_group([dict(SMALL), dict(SMALL)], strategy="STRICT_SPREAD")
    try:
        rg.wait(T)
        pid0, node0 = yr.get(pid_and_node.options(in_bundle(rg, 0)).invoke(), timeout=T)
        _, node1 = yr.get(pid_and_node.options(in_bundle(rg, 1)).invoke(), timeout=T)
        os.kill(pid0, signal.SIGKILL)  # bundle 0's worker process; its nanny starts a new one
        rg.wait(T)
        pid, again = yr.get(pid_and_node.options(in_bundle(rg, 0)).invoke(), timeout=T)
        # Placed again, still apart from bundle 1: on the node whose process came back.
        assert pid != pid0 and again == node0 != node1
    finally:
        yr.remove_resource_group(rg)


def test_impossible_strict_spread_waits_and_wait_names_why(two_workers):
    rg = yr.create_resource_group([{"CPU": 300}] * 3, strategy="STRICT_SPREAD")
    try:
        with pytest.raises(yr.YRTimeoutError) as err:
            rg.wait(2)
        msg = str(err.value)
        assert isinstance(err.value, TimeoutError)
        assert "was not created within 2 s" in msg and "STRICT_SPREAD needs 3 distinct" in msg
        # It never took anything while it waited.
        assert sum(free_cpu().values()) == 2000
        waiting = node.options(in_bundle(rg, 0, schedule_timeout_ms=-1)).invoke()
    finally:
        yr.remove_resource_group(rg.name)
    # What waited for the group (forever) fails once it is removed.
    with pytest.raises(yr.ScheduleError, match="does not exist"):
        yr.get(waiting, timeout=T)


def test_removal_frees_capacity_a_waiting_instance_needed_and_kills_its_members(two_workers):
    rg = yr.create_resource_group([{"CPU": 1000, "Memory": 256}] * 2, strategy="STRICT_SPREAD")
    rg.wait(T)
    inside = Member.options(in_bundle(rg, 0)).invoke(1)
    assert yr.get(inside.node.invoke(), timeout=T)[0] == 1
    outside = Member.options(yr.InvokeOptions(cpu=1000, memory=64, schedule_timeout_ms=-1)).invoke(2)
    ready, _ = yr.wait([outside.node.invoke()], timeout=2)
    assert ready == []  # every worker's CPU is reserved by the group
    yr.remove_resource_group(rg)
    assert yr.get(outside.node.invoke(), timeout=T)[0] == 2
    with pytest.raises(yr.YRRuntimeError, match="resource group .* was removed"):
        yr.get(inside.node.invoke(), timeout=T)
    outside.terminate()


def test_requests_that_cannot_use_the_group_fail_at_the_call(two_workers):
    rg = yr.create_resource_group([dict(SMALL)], name="rg-bad")
    try:
        rg.wait(T)
        with pytest.raises(yr.YRValueError, match=r"bundle_index 1 is out of range .* 0\.\.0"):
            node.options(in_bundle(rg, 1)).invoke()
        with pytest.raises(yr.YRValueError, match="bundle_index 3 is out of range"):
            Member.options(in_bundle(rg, 3)).invoke()
        with pytest.raises(yr.YRValueError, match="names no resource group"):
            node.options(yr.InvokeOptions(
                resource_group_options=yr.ResourceGroupOptions("no-such-group", 0))).invoke()
        # Larger than its bundle: fails with what the bundle holds.
        with pytest.raises(yr.ScheduleError, match="can never fit bundle 0"):
            yr.get(node.options(in_bundle(rg, 0, cpu=800)).invoke(), timeout=T)
    finally:
        yr.remove_resource_group("rg-bad")


@pytest.mark.parametrize("call, error, text", [
    (lambda: yr.create_resource_group({"CPU": 1}), yr.YRTypeError,
     "invalid bundles type, actual: dict"),
    (lambda: yr.create_resource_group([]), yr.YRValueError,
     "invalid bundles number, actual: 0, expect: > 0."),
    (lambda: yr.create_resource_group([{"CPU": 1}], name=5), yr.YRTypeError, "invalid name type"),
    (lambda: yr.create_resource_group([{"CPU": 1}], name="primary"), yr.YRValueError,
     "reserved"),
    (lambda: yr.create_resource_group([{"CPU": 1}], name=""), yr.YRValueError, "reserved"),
    (lambda: yr.create_resource_group([{"CPU": -1}]), yr.YRValueError, "expect: >= 0"),
    (lambda: yr.create_resource_group([{"CPU": "1"}]), yr.YRTypeError, "expect: int or float"),
    (lambda: yr.create_resource_group(["CPU"]), yr.YRTypeError, "invalid bundle 0 type"),
    (lambda: yr.create_resource_group([{"CPU": 1}], strategy="TIGHT"), yr.YRValueError,
     "invalid strategy 'TIGHT'"),
    (lambda: yr.remove_resource_group(3), yr.YRTypeError, "expect: str or yr.ResourceGroup"),
    (lambda: yr.ResourceGroupOptions("rg", -2), yr.YRValueError, "bundle_index must be >= -1"),
    (lambda: yr.InvokeOptions(resource_group_options="rg"), yr.YRTypeError,
     "yr.ResourceGroupOptions"),
    (lambda: yr.GroupOptions(timeout=0), yr.YRValueError, "-1 \\(forever\\) or > 0"),
])
def test_validation_errors_name_the_problem(two_workers, call, error, text):
    with pytest.raises(error, match=text):
        call()


def test_wait_timeout_validation_and_defaults(two_workers):
    rg = yr.create_resource_group([{"CPU": 100, "Memory": 0, "ssd": 0}], name="rg-defaults")
    try:
        assert rg.bundles == [{"CPU": 100.0, "Memory": 0.0}]  # zero custom resources dropped
        with pytest.raises(yr.YRValueError, match="greater than or equal to -1"):
            rg.wait(-2)
        rg.wait()  # None: forever (it fits at once)
    finally:
        yr.remove_resource_group(rg)


def test_a_custom_resource_bundle_is_reserved_on_the_worker_that_offers_it(cli_cluster):
    gpu = cli_cluster.cli.worker_with("gpu_node")
    rg = yr.create_resource_group([{"CPU": 100, "Memory": 64, "gpu_node": 1}])
    try:
        rg.wait(T)
        where = yr.get(pid.options(in_bundle(rg, 0, cpu=100, memory=32)).invoke(), timeout=T)
        assert where in gpu.pids()
        tagged = [n for n in yr.resources() if "gpu_node" in n["capacity"]]
        assert [n["allocatable"]["gpu_node"] for n in tagged] == [0]
    finally:
        yr.remove_resource_group(rg)


def test_a_job_that_ends_removes_its_groups(cluster, wait_until):
    from conftest import CORE_KINDS

    cluster(**CORE_KINDS["cli"])
    yr.create_resource_group([{"CPU": 700}], name="rg-of-ended-job").wait(T)
    yr.finalize()  # the job ends: its groups go with it
    cluster(**CORE_KINDS["cli"])  # a new job on the same scheduler
    wait_until(lambda: len(yr.resources()) == 2, T, "two workers")
    # The name is free again and nothing is reserved.
    all_free(wait_until)
    yr.create_resource_group([{"CPU": 700}], name="rg-of-ended-job").wait(T)
    yr.remove_resource_group("rg-of-ended-job")
    all_free(wait_until)


# -- yr.Group ---------------------------------------------------------------------------------


def test_group_creates_members_together_on_invoke(two_workers):
    opts = yr.InvokeOptions(cpu=300, memory=64, group_name="gang-ok")
    handles = [Member.options(opts).invoke(i) for i in range(3)]
    g = yr.Group("gang-ok", yr.GroupOptions(timeout=T))
    g.invoke()
    g.wait()
    assert [yr.get(h.node.invoke(), timeout=T)[0] for h in handles] == [0, 1, 2]
    g.terminate()
    with pytest.raises(yr.YRRuntimeError):
        yr.get(handles[0].node.invoke(), timeout=T)


def test_group_is_all_or_nothing(two_workers):
    opts = yr.InvokeOptions(cpu=1000, memory=64, group_name="gang-too-big")
    handles = [Member.options(opts).invoke(i) for i in range(3)]  # 3000 on 2 x 1000
    g = yr.Group("gang-too-big", yr.GroupOptions(timeout=2))
    g.invoke()
    try:
        with pytest.raises(yr.YRTimeoutError, match="gang-too-big.*need .*CPU: 3000.* in total"):
            g.wait()
        assert sum(free_cpu().values()) == 2000  # not one member was placed
    finally:
        g.terminate()
    for h in handles:
        with pytest.raises(yr.YRRuntimeError):
            yr.get(h.node.invoke(), timeout=T)


def test_group_members_share_fate_naming_the_member_that_died(two_workers, wait_until):
    opts = yr.InvokeOptions(cpu=300, memory=64, group_name="gang-fate")
    a, b = (Member.options(opts).invoke(i) for i in range(2))
    g = yr.Group("gang-fate", yr.GroupOptions(timeout=T, strategy="STRICT_SPREAD"))
    g.invoke()
    g.wait()
    assert yr.get(a.node.invoke(), timeout=T)[1] != yr.get(b.node.invoke(), timeout=T)[1]
    a.terminate(is_sync=True)
    # The scheduler ends b once it sees a's holding go (asynchronously, in its process).
    wait_until(lambda: b.state == "DEAD", T, lambda: f"member b ended, status {b.status()}")
    with pytest.raises(yr.YRRuntimeError, match=f"member instance {a.instance_id} ended"):
        yr.get(b.node.invoke(), timeout=T)
    with pytest.raises(yr.YRRuntimeError, match="removed"):
        g.wait()
    g.terminate()


def test_group_misuse_is_rejected(two_workers):
    with pytest.raises(yr.YRValueError, match="detached"):
        Member.options(yr.InvokeOptions(group_name="gang-x",
                                        custom_extensions={"lifecycle": "detached"})).invoke()
    with pytest.raises(yr.YRValueError, match="applies to instances"):
        node.options(yr.InvokeOptions(group_name="gang-x")).invoke()
    with pytest.raises(yr.YRValueError, match="has no members"):
        yr.Group("gang-empty").invoke()
    g = yr.Group("gang-x")
    with pytest.raises(yr.YRRuntimeError, match="not supported.*terminate"):
        g.suspend()
    with pytest.raises(yr.YRRuntimeError, match="not supported"):
        g.resume()
    with pytest.raises(yr.YRRuntimeError, match="was not invoked"):
        g.wait()


def test_groups_can_be_created_from_several_threads(two_workers):
    made, errors = [], []

    def make(i: int) -> None:
        try:
            rg = yr.create_resource_group([{"CPU": 100, "Memory": 16}], name=f"rg-thread-{i}")
            rg.wait(T)
            made.append(rg)
        except Exception as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=make, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(T)
    assert not errors and len(made) == 4
    assert sum(free_cpu().values()) == 2000 - 400
    for rg in made:
        yr.remove_resource_group(rg)
