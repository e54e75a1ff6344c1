"""Task-side Ray behaviours that Ray's own public-API tests check:
runtime context ids and names as Ray gives them, generators called with an int or
``"dynamic"`` ``num_returns`` (tasks and actor methods).

Each test names the Ray behaviour (learned from Ray's source and its tests under
python/ray/tests); waits are refs, never sleeps.
"""

from __future__ import annotations

import os
import signal
import sys
import time
import warnings

import cloudpickle
import pytest

import yrdask.ray as ray
from yrdask.ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

cloudpickle.register_pickle_by_value(sys.modules[__name__])

pytestmark = pytest.mark.timeout(120)


# -- runtime context ----------------------------------------------------------------------


@ray.remote
def context_of_task():
    rtc = ray.get_runtime_context()
    ctx = rtc.get()
    return (rtc.get_node_id(), rtc.get_task_id(), ctx["task_id"].hex(), ctx["node_id"].hex(),
            rtc.get_task_function_name(), rtc.get_placement_group_id(), rtc.get_actor_name())


@ray.remote
class Probe:
    def ids(self):
        rtc = ray.get_runtime_context()
        return rtc.get_task_id(), rtc.get_task_id(), rtc.get_actor_name(), \
            rtc.get_task_function_name()


def test_driver_node_id_is_a_node_and_deprecated_ids_warn(ray_env):
    rtc = ray.get_runtime_context()
    # Ray: a driver belongs to the node it started or joined; its id is one of ray.nodes()'s
    assert rtc.get_node_id() in {n["NodeID"] for n in ray.nodes()}
    assert rtc.get_node_id() == ray.get(context_of_task.remote())[0]
    # Ray's deprecated properties give ids with .hex() and say what to use instead
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert rtc.node_id.hex() == rtc.get_node_id()
        assert rtc.job_id.hex() == rtc.get_job_id()
        assert rtc.task_id is None and rtc.actor_id is None  # a driver runs no task
        assert rtc.current_placement_group_id is None
    said = " ".join(str(w.message) for w in caught)
    for name in ("get_node_id", "get_job_id", "get_task_id", "get_actor_id",
                 "get_placement_group_id"):
        assert f"Use {name}() instead" in said
    assert rtc.get_placement_group_id() is None and rtc.get_actor_name() is None


def test_task_context_ids_names_and_placement_group(ray_env):
    node, task_id, dict_task, dict_node, fname, pg_id, actor_name = ray.get(
        context_of_task.remote())
    assert task_id and dict_task == task_id and dict_node == node
    # Ray's task function name is module.__name__ (no qualname), in tasks
    assert fname == f"{__name__}.context_of_task"
    assert pg_id is None and actor_name is None
    pg = ray.util.placement_group([{"CPU": 1}])
    ray.get(pg.ready())
    try:
        placed = context_of_task.options(
            scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=pg))
        assert ray.get(placed.remote())[5] == pg.id  # Ray: the group the task runs in
    finally:
        ray.util.remove_placement_group(pg)


def test_actor_method_context(ray_env):
    p = Probe.remote()
    first, again, name, fname = ray.get(p.ids.remote())
    second = ray.get(p.ids.remote())[0]
    # Ray: each actor call is a task with an id of its own; an unnamed actor's name is ""
    assert first and first == again and second and second != first
    assert name == ""
    assert fname == f"{__name__}.Probe.ids"
    # ... and an async method's is module + its qualname (Ray's descriptors differ so)

    @ray.remote
    class Local:
        def sync_name(self):
            return ray.get_runtime_context().get_task_function_name()

        async def async_name(self):
            return ray.get_runtime_context().get_task_function_name()

    local = Local.remote()
    assert ray.get(local.sync_name.remote()) == f"{__name__}.Local.sync_name"
    assert ray.get(local.async_name.remote()) == (
        f"{__name__}.test_actor_method_context.<locals>.Local.async_name")
    named = Probe.options(name=f"probe-{id(p)}").remote()
    assert ray.get(named.ids.remote())[2] == f"probe-{id(p)}"


@ray.remote(max_restarts=1)
class Restartable:
    def __init__(self):
        self.at_init = ray.get_runtime_context().was_current_actor_reconstructed

    def state(self):
        return self.at_init, ray.get_runtime_context().was_current_actor_reconstructed, \
            os.getpid()


def test_was_current_actor_reconstructed(ray_env):
    # Ray's property: False in the first incarnation, True (in __init__ too) after a restart
    a = Restartable.remote()
    at_init, now, pid = ray.get(a.state.remote())
    assert at_init is False and now is False
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while True:  # calls during the restart may fail; poll until the new incarnation answers
        try:
            at_init, now, new_pid = ray.get(a.state.remote(), timeout=30)
            break
        except ray.exceptions.RayActorError:
            assert time.monotonic() < deadline
    assert new_pid != pid and at_init is True and now is True
    with pytest.raises(RuntimeError, match="only available in an actor"):
        ray.get_runtime_context().was_current_actor_reconstructed


# -- generators with an int or "dynamic" num_returns -----------------------------------------


@ray.remote
def counting(n):
    for i in range(n):
        yield i


@ray.remote(max_retries=0)
def one_then_error():
    yield "first"
    raise KeyError("after one")


@ray.remote
class Gen:
    def count(self, n):
        for i in range(n):
            yield i

    def one_then_error(self):
        yield "first"
        raise KeyError("after one")

    async def acount(self, n):
        for i in range(n):
            yield i


def test_static_num_returns_generator_drops_extra_values(ray_env):
    # Ray logs values past num_returns and drops them (ray-project/ray#28689); fewer raise
    assert ray.get(counting.options(num_returns=2).remote(3)) == [0, 1]
    assert ray.get(counting.options(num_returns=1).remote(1)) == 0
    with pytest.raises(ray.exceptions.RayTaskError) as info:
        ray.get(counting.options(num_returns=3).remote(2))
    assert isinstance(info.value.as_instanceof_cause(), ValueError)


def test_generator_that_raises_fills_the_rest_of_its_returns_with_the_error(ray_env):
    # Ray: the values yielded before the error are the first returns, the error each other
    for call in (one_then_error, Gen.remote().one_then_error):
        first, second, third = call.options(num_returns=3).remote()
        assert ray.get(first) == "first"
        for ref in (second, third):
            with pytest.raises(ray.exceptions.RayTaskError) as info:
                ray.get(ref)
            assert isinstance(info.value, KeyError) and "after one" in str(info.value)


def test_actor_generator_method_with_int_or_dynamic_num_returns(ray_env):
    g = Gen.remote()
    assert ray.get(g.count.options(num_returns=3).remote(3)) == [0, 1, 2]
    assert ray.get(g.count.options(num_returns=2).remote(4)) == [0, 1]  # extra dropped
    assert ray.get(g.count.options(num_returns=1).remote(1)) == 0
    refs = list(ray.get(g.count.options(num_returns="dynamic").remote(4)))
    assert ray.get(refs) == [0, 1, 2, 3]
    assert ray.get(g.acount.options(num_returns=2).remote(2)) == [0, 1]
    assert ray.get(list(ray.get(g.acount.options(num_returns="dynamic").remote(2)))) == [0, 1]
    # without num_returns the method streams again, as before
    assert ray.get(list(g.count.options(num_returns=2).options(
        num_returns="streaming").remote(2))) == [0, 1]
    assert ray.get(list(g.count.remote(2))) == [0, 1]


# -- cancel of a borrowed ref --------------------------------------------------------------


@ray.remote
def sleepy():
    for _ in range(1200):  # interruptible: a Python loop around short sleeps
        time.sleep(0.05)
    return "not cancelled"


@ray.remote
def submit_sleepy():
    return [sleepy.remote()]


def test_cancel_of_a_borrowed_ref_goes_to_its_owner(ray_env):
    # Ray: ray.cancel(ref) of a task another worker submitted asks that owner to cancel it
    inner = ray.get(submit_sleepy.remote())[0]
    with pytest.raises(ray.exceptions.GetTimeoutError):
        ray.get(inner, timeout=0.2)
    ray.cancel(inner)
    with pytest.raises(ray.exceptions.TaskCancelledError):
        ray.get(inner, timeout=30)


@ray.remote
def busy_in_python(path):
    with open(path + ".part", "w") as f:
        f.write(str(os.getpid()))
    os.replace(path + ".part", path)  # whole: the test reads it as soon as it exists
    while True:  # Python bytecode runs between the short sleeps: an interrupt reaches it
        time.sleep(0.01)


def test_force_cancel_of_a_task_that_stops_at_the_interrupt_keeps_its_process(ray_env,
                                                                              tmp_path):
    # The process also hosts other work (Ray's runs only this task): a task that stops at
    # the interrupt is not worth the process; only one blocked in C ends it (test_ray_program_behaviours)
    import psutil

    from conftest import wait_for_file

    mark = tmp_path / "pid"
    ref = busy_in_python.remote(str(mark))
    wait_for_file(str(mark))
    pid = int(mark.read_text())
    ray.cancel(ref, force=True)
    with pytest.raises(ray.exceptions.TaskCancelledError):
        ray.get(ref, timeout=10)
    proc = psutil.Process(pid)
    until = time.monotonic() + 2.0  # an absence: watched for 4x the agent's 0.5 s grace
    while time.monotonic() < until:
        assert proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
        time.sleep(0.05)


# -- placement groups ----------------------------------------------------------------------


@ray.remote
class _Wide:
    def ping(self) -> str:
        return "pong"


def test_request_that_fits_no_bundle_is_refused_at_remote(ray_env):
    """Ray checks at ``.remote()`` that a task's or actor's request fits one bundle of its
    placement group (else it could never run): ``ValueError`` in Ray's words."""
    pg = ray.util.placement_group([{"CPU": 1}])
    ray.get(pg.ready())
    try:
        strategy = PlacementGroupSchedulingStrategy(placement_group=pg)
        with pytest.raises(ValueError, match=r"Cannot schedule .*context_of_task with the "
                           r"placement group because the resource request \{'CPU': 2\} "
                           r"cannot fit into any bundles for the placement group, "
                           r"\[\{'CPU': 1\.0\}\]\."):
            context_of_task.options(num_cpus=2, scheduling_strategy=strategy).remote()
        with pytest.raises(ValueError, match=r"Cannot schedule _Wide with the placement group "
                           r"because the resource request \{'CPU': 1, 'GPU': 8\}"):
            _Wide.options(num_cpus=1, num_gpus=8, scheduling_strategy=strategy).remote()
        fits = _Wide.options(num_cpus=1, scheduling_strategy=strategy).remote()
        assert ray.get(fits.ping.remote()) == "pong"
        ray.kill(fits)
    finally:
        ray.util.remove_placement_group(pg)


@ray.remote
def own_title():
    import psutil

    return psutil.Process().cmdline()[0]


@ray.remote(name="renamed")
def named_title():
    import psutil

    return psutil.Process().cmdline()[0]


def test_a_task_runs_under_the_process_title_ray_task_name(ray_env):
    # Ray's docs find a task's process by its title: ray::<task name>
    pytest.importorskip("setproctitle")
    assert ray.get(own_title.remote(), timeout=60) == "ray::own_title"
    assert ray.get(named_title.remote(), timeout=60) == "ray::renamed"
    assert ray.get(own_title.options(name="other").remote(), timeout=60) == "ray::other"
