"""A node is a machine, and GPUs are leased by device id (SPEC §6, docs/nodes.md).

One embedded cluster for the module, started the Ray way: ``ray.init(num_cpus=2, num_gpus=2,
resources={"NPU": 2, ...})``.  Its two worker processes form one node of 2 CPUs, 2 declared
GPUs and 2 declared Ascend NPUs (no hardware is needed: the code under test only reads
``CUDA_VISIBLE_DEVICES`` and ``ASCEND_RT_VISIBLE_DEVICES``).  Each test runs
through the Ray API and through the yr API.

Overlap is made certain, not hoped for: tasks meet at a barrier of files (each waits, bounded,
until the expected number of them run), and each records the set of tasks running when it
met the others, with their device ids.
"""

from __future__ import annotations

import os
import sys
import time
import uuid

import cloudpickle
import pytest

import yrdask as yr
import yrdask.ray as ray
from yrdask.ray.util.placement_group import (get_current_placement_group, placement_group,
                                             remove_placement_group)
from yrdask.ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # isolated processes too

pytestmark = pytest.mark.timeout(240)

T = 60


@pytest.fixture(scope="module")
def gpu_ray(cluster, tmp_path_factory):
    cluster.finalize()  # this module starts its own cluster, as a Ray program would
    ray.init(num_cpus=2, num_gpus=2, resources={"rack_a": 2, "NPU": 2})
    yield tmp_path_factory.mktemp("gpus")
    ray.shutdown()


@pytest.fixture
def room(gpu_ray):
    """A fresh directory for one test's barrier files."""
    d = gpu_ray / uuid.uuid4().hex[:8]
    d.mkdir()
    return str(d)


def meet(room: str, expected: int, timeout: float = 30.0,
         env: str = "CUDA_VISIBLE_DEVICES") -> dict:
    """Inside a task: a two-phase barrier of ``expected`` tasks, recording who ran together.

    A task marks itself running (with its devices) and arrived, waits (bounded) until
    ``expected`` tasks arrived, records the running ones, marks itself done, waits until
    ``expected`` are done and stops running.  Arrived and done marks are never removed, so
    tasks after the first ``expected`` pass at once.  Returns what it saw.
    """
    devices = os.environ.get(env, "")
    me = uuid.uuid4().hex
    running = os.path.join(room, f"{me}.{devices or 'none'}.run")
    open(running, "w").close()
    open(os.path.join(room, f"{me}.arrived"), "w").close()
    met = _wait_for(room, ".arrived", expected, timeout)
    together = sorted(f.split(".")[1] for f in os.listdir(room) if f.endswith(".run"))
    open(os.path.join(room, f"{me}.done"), "w").close()
    _wait_for(room, ".done", expected, timeout)
    os.remove(running)
    return {"devices": devices, "together": together, "met": met,
            "gpu_ids": ray.get_gpu_ids(),
            "accelerators": ray.get_runtime_context().get_accelerator_ids()["GPU"],
            "npus": ray.get_runtime_context().get_accelerator_ids()["NPU"],
            "cuda": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "omp": os.environ.get("OMP_NUM_THREADS")}


def _wait_for(room: str, suffix: str, n: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while sum(f.endswith(suffix) for f in os.listdir(room)) < n:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


@ray.remote(num_gpus=1)
def one_gpu(room, expected):
    return meet(room, expected)


@yr.invoke(invoke_options=yr.InvokeOptions(custom_resources={"GPU/.+/count": 1}))
def yr_one_gpu(room, expected):
    return meet(room, expected)


@ray.remote(num_gpus=0.5)
def half_gpu(room):
    return meet(room, 2)


@yr.invoke(invoke_options=yr.InvokeOptions(custom_resources={"GPU": 0.5}))
def yr_half_gpu(room):
    return meet(room, 2)


@ray.remote(num_gpus=1)
class GpuActor:
    def devices(self):
        return os.environ.get("CUDA_VISIBLE_DEVICES"), tuple(ray.get_gpu_ids())


@yr.instance(invoke_options=yr.InvokeOptions(custom_resources={"GPU": 1}))
class YrGpu:
    def devices(self):
        return os.environ.get("CUDA_VISIBLE_DEVICES"), tuple(ray.get_gpu_ids())

    def nested(self):
        return yr.get(yr_inc.invoke(1))


@ray.remote
def inc(x):
    return x + 1


@yr.invoke
def yr_inc(x):
    return x + 1


@ray.remote(num_gpus=1)
def gpu_nested():
    return ray.get(inc.remote(1))


@ray.remote(num_gpus=1)
def gpu_node_and_arg(x):
    return ray.get_runtime_context().get_node_id(), x


@ray.remote(resources={"NPU": 1})
def one_npu(room, expected):
    return meet(room, expected, env="ASCEND_RT_VISIBLE_DEVICES")


@yr.invoke(invoke_options=yr.InvokeOptions(custom_resources={"NPU/.+/count": 1}))
def yr_one_npu(room, expected):
    return meet(room, expected, env="ASCEND_RT_VISIBLE_DEVICES")


@ray.remote(resources={"NPU": 1})
class NpuActor:
    def devices(self):
        return (os.environ.get("ASCEND_RT_VISIBLE_DEVICES"),
                tuple(ray.get_runtime_context().get_accelerator_ids()["NPU"]))


@yr.instance(invoke_options=yr.InvokeOptions(custom_resources={"NPU/.+/count": 1}))
class YrNpu:
    def devices(self):
        return (os.environ.get("ASCEND_RT_VISIBLE_DEVICES"),
                tuple(ray.get_runtime_context().get_accelerator_ids()["NPU"]))


@ray.remote(num_cpus=2)
def two_cpus():
    return os.getpid()


@yr.invoke(invoke_options=yr.InvokeOptions(cpu=2000))
def yr_two_cpus():
    return os.getpid()


@ray.remote(num_cpus=1)
def child():
    return get_current_placement_group() is not None


@ray.remote(num_cpus=1)
def parent():
    group = get_current_placement_group()
    return group is not None, ray.get([child.remote(), child.remote()])


def check_one_gpu_tasks(results: list[dict]) -> None:
    """Each task saw one id, equal to CUDA_VISIBLE_DEVICES; at most two ran at once, never
    sharing an id."""
    for r in results:
        assert r["devices"] in ("0", "1"), r
        assert r["gpu_ids"] == [int(r["devices"])] and r["accelerators"] == [r["devices"]], r
        assert r["met"], f"the first two GPU tasks never ran together: {results}"
        assert len(r["together"]) <= 2 and len(set(r["together"])) == len(r["together"]), r
        assert r["omp"] == "1"  # OMP_NUM_THREADS follows the task's CPUs (1)
    assert {r["devices"] for r in results} == {"0", "1"}


def test_ray_init_declares_one_node_with_its_gpus_and_resources(gpu_ray):
    nodes = ray.nodes()
    assert len(nodes) == 1, nodes
    assert nodes[0]["Resources"]["CPU"] == 2.0 and nodes[0]["Resources"]["GPU"] == 2.0
    total = ray.cluster_resources()
    assert total["GPU"] == 2.0 and total["CPU"] == 2.0 and total["rack_a"] == 2.0
    assert total["NPU"] == 2.0
    (node,) = yr.resources()
    assert node["capacity"]["GPU"] == 2.0 and node["capacity"]["CPU"] == 2000.0
    assert node["capacity"]["NPU"] == 2.0


def check_one_npu_tasks(results: list[dict]) -> None:
    """Each NPU task saw one id in ASCEND_RT_VISIBLE_DEVICES, the same in
    get_accelerator_ids()["NPU"], no GPU; the two ran together on distinct devices."""
    for r in results:
        assert r["devices"] in ("0", "1"), r
        assert r["npus"] == [r["devices"]] and r["accelerators"] == [] and r["cuda"] is None, r
        assert r["met"], f"the two NPU tasks never ran together: {results}"
        assert len(set(r["together"])) == len(r["together"]) == 2, r
    assert {r["devices"] for r in results} == {"0", "1"}


def test_two_one_npu_tasks_see_their_own_device(room):
    check_one_npu_tasks(ray.get([one_npu.remote(room, 2) for _ in range(2)], timeout=T))


def test_yr_two_one_npu_tasks_see_their_own_device(room):
    check_one_npu_tasks(yr.get([yr_one_npu.invoke(room, 2) for _ in range(2)], T))


def test_npu_actors_and_instances_keep_distinct_npus_across_calls(gpu_ray):
    actor, inst = NpuActor.remote(), YrNpu.invoke()
    seen = [[tuple(ray.get(actor.devices.remote(), timeout=T)) for _ in range(2)],
            [tuple(yr.get(inst.devices.invoke(), T)) for _ in range(2)]]
    for calls in seen:
        assert len(set(calls)) == 1, seen  # the same device on every call
        devices, ids = calls[0]
        assert devices in ("0", "1") and ids == (devices,), seen
    assert seen[0][0][0] != seen[1][0][0]
    ray.kill(actor)
    inst.terminate(is_sync=True)


def test_four_one_gpu_tasks_see_their_own_device_two_at_a_time(room):
    check_one_gpu_tasks(ray.get([one_gpu.remote(room, 2) for _ in range(4)], timeout=T))


def test_yr_four_one_gpu_tasks_see_their_own_device_two_at_a_time(room):
    check_one_gpu_tasks(yr.get([yr_one_gpu.invoke(room, 2) for _ in range(4)], T))


def test_two_half_gpu_tasks_share_one_device(room):
    # A shape of its own: a backlog of a shape whose tasks were short would be pipelined
    # onto one lease, and these two must run side by side.
    half = half_gpu.options(memory=101 * 2 ** 20)
    got = ray.get([half.remote(room) for _ in range(2)], timeout=T)
    assert all(r["met"] for r in got), f"two num_gpus=0.5 tasks did not run together: {got}"
    assert got[0]["devices"] == got[1]["devices"] and got[0]["devices"] in ("0", "1")
    assert got[0]["together"] == [got[0]["devices"]] * 2


def test_yr_two_half_gpu_tasks_share_one_device(room):
    half = yr_half_gpu.options(yr.InvokeOptions(memory=102, custom_resources={"GPU": 0.5}))
    got = yr.get([half.invoke(room) for _ in range(2)], T)
    assert all(r["met"] for r in got), got
    assert got[0]["devices"] == got[1]["devices"]


def test_two_actors_keep_distinct_gpus_across_calls(gpu_ray):
    actors = [GpuActor.remote() for _ in range(2)]
    seen = [[tuple(ray.get(a.devices.remote(), timeout=T)) for _ in range(3)] for a in actors]
    for calls in seen:
        assert len(set(calls)) == 1, calls  # the same device on every call
        devices, ids = calls[0]
        assert ids == (int(devices),)
    assert seen[0][0][0] != seen[1][0][0]
    for a in actors:
        ray.kill(a)


def test_yr_two_instances_keep_distinct_gpus_across_calls(gpu_ray):
    insts = [YrGpu.invoke() for _ in range(2)]
    seen = [[tuple(yr.get(i.devices.invoke(), T)) for _ in range(3)] for i in insts]
    assert all(len(set(calls)) == 1 for calls in seen), seen
    assert seen[0][0][0] != seen[1][0][0]
    for i in insts:
        i.terminate(is_sync=True)


def test_a_two_cpu_task_runs_on_a_two_cpu_node(gpu_ray):
    assert ray.get(two_cpus.remote(), timeout=T) > 0
    assert yr.get(yr_two_cpus.invoke(), T) > 0


def test_a_two_cpu_placement_group_is_ready_and_captures_child_tasks(gpu_ray):
    pg = placement_group([{"CPU": 2}])
    assert pg.wait(T)
    captured = PlacementGroupSchedulingStrategy(pg, placement_group_capture_child_tasks=True)
    in_group, children = ray.get(parent.options(scheduling_strategy=captured).remote(),
                                 timeout=T)
    assert in_group and children == [True, True]
    # Not captured: the task runs in the group, but its children would not (on this 2-CPU
    # node they would wait for the group's CPUs forever, as on Ray).
    plain = PlacementGroupSchedulingStrategy(pg)
    assert ray.get(child.options(scheduling_strategy=plain).remote(), timeout=T) is False
    remove_placement_group(pg)


def test_nested_calls_from_gpu_work_run(gpu_ray):
    """GPU work runs in a process of its own, whose first nested call starts a runtime
    there (docs/isolation.md): nested calls work through both APIs; the node id and
    top-level ObjectRef arguments work there too."""
    assert ray.get(gpu_nested.remote(), timeout=T) == 2
    inst = YrGpu.invoke()
    assert yr.get(inst.nested.invoke(), T) == 2
    inst.terminate(is_sync=True)
    node, value = ray.get(gpu_node_and_arg.remote(inc.remote(1)), timeout=T)
    assert value == 2 and node == ray.nodes()[0]["NodeID"]
