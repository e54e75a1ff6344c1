"""yrdask.ray tasks, objects and errors on a real embedded cluster (SPEC §7).

Ray's semantics where they differ from yr's: ``get`` waits forever by default and
``timeout=0`` only checks, ``wait`` returns after one ready ref, ``put`` stores ``None``,
task errors come back as ``RayTaskError(E)``, options are not sticky.  The session attaches
to the suite's yr runtime (the ``cluster`` fixture), as ``ray.init`` does when yrdask is
already initialised.
"""

from __future__ import annotations

import os
import sys
import threading

import cloudpickle
import pytest

import yrdask.ray as ray
from conftest import wait_for_file

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers need not import us

pytestmark = pytest.mark.timeout(120)


class MyError(Exception):
    pass


@ray.remote
def add(a, b):
    return a + b


@ray.remote
def fail(msg):
    raise MyError(msg)


@ray.remote
def wait_then(path, value):
    wait_for_file(path)
    return value


def test_init_attaches_to_the_running_runtime_and_refuses_twice(ray_env):
    with pytest.raises(RuntimeError, match="ray.init twice"):
        ray.init()
    ctx = ray.init(ignore_reinit_error=True)
    assert ctx["namespace"].startswith("test_ray_core-")
    assert ray.is_initialized()
    with pytest.raises(ValueError, match="existing cluster"):
        ray.shutdown()
        ray.init(num_cpus=3)


def test_remote_chaining_and_num_returns(ray_env):
    assert ray.get(add.remote(1, 2)) == 3
    assert ray.get(add.remote(add.remote(1, 2), 10)) == 13
    a, b = add.options(num_returns=2).remote((1,), (2,))  # returns (1, 2): two refs
    assert ray.get([a, b]) == [1, 2]
    assert add.options(num_returns=0).remote(1, 2) is None
    with pytest.raises(TypeError):
        add.remote(1)  # checked against the signature at the call


def test_put_get_with_rays_rules(ray_env):
    assert ray.get(ray.put(None)) is None
    assert ray.get(ray.put(b"")) == b""
    value = ray.get(ray.put(b"abc"))
    assert value == b"abc" and isinstance(value, bytes)
    assert ray.get([]) == []
    with pytest.raises(TypeError, match="wrap the ray.ObjectRef in a list"):
        ray.put(ray.put(1))
    with pytest.raises(ValueError, match="ObjectRef or a list"):
        ray.get((ray.put(1),))
    with pytest.raises(ValueError, match="non-negative"):
        ray.get(ray.put(1), timeout=-1)


def test_get_timeout_and_zero_timeout(ray_env, tmp_path):
    gate = str(tmp_path / "go")
    ref = wait_then.remote(gate, "late")
    with pytest.raises(ray.exceptions.GetTimeoutError) as info:
        ray.get(ref, timeout=0)
    assert isinstance(info.value, TimeoutError)
    with pytest.raises(ray.exceptions.GetTimeoutError):
        ray.get(ref, timeout=0.2)
    open(gate, "w").close()
    assert ray.get(ref) == "late"  # timeout=None waits forever
    assert ray.get(ref, timeout=0) == "late"


def test_wait_returns_one_ready_by_default(ray_env, tmp_path):
    gate = str(tmp_path / "go")
    fast = ray.put(1)
    slow = wait_then.remote(gate, 2)
    ready, not_ready = ray.wait([slow, fast])
    assert ready == [fast] and not_ready == [slow]
    ready, not_ready = ray.wait([slow, fast], num_returns=2, timeout=0.1)
    assert ready == [fast] and not_ready == [slow]
    ready, not_ready = ray.wait([slow, fast], timeout=0)  # Ray: what is ready now
    assert ready == [fast]
    open(gate, "w").close()
    ready, not_ready = ray.wait([slow, fast], num_returns=2)
    assert ready == [slow, fast] and not_ready == []


def test_wait_argument_errors(ray_env):
    r = ray.put(1)
    with pytest.raises(ValueError, match="unique"):
        ray.wait([r, r])
    with pytest.raises(ValueError, match="greater than"):
        ray.wait([r], num_returns=2)
    with pytest.raises(ValueError, match="Invalid number"):
        ray.wait([r], num_returns=0)
    with pytest.raises(TypeError):
        ray.wait(r)
    with pytest.raises(ValueError, match="nonnegative"):
        ray.wait([r], timeout=-1)
    assert ray.wait([]) == ([], [])


def test_task_error_is_ray_task_error_and_the_users_type(ray_env):
    with pytest.raises(MyError) as info:
        ray.get(fail.remote("boom"))
    err = info.value
    assert isinstance(err, ray.exceptions.RayTaskError)
    assert not isinstance(err, RuntimeError)  # as on Ray (yr adds RuntimeError)
    assert err.cause.args == ("boom",) and err.args[0].args == ("boom",)  # Ray's args
    assert "boom" in str(err) and "Traceback" in str(err)
    # a task whose argument failed fails with the same error
    with pytest.raises(ray.exceptions.RayTaskError) as info:
        ray.get(add.remote(fail.remote("dep"), 1))
    assert isinstance(info.value, MyError)


@ray.remote
def nested_get():
    return ray.get(fail.remote("inner"))


def test_error_from_a_nested_get_keeps_the_cause(ray_env):
    with pytest.raises(MyError) as info:
        ray.get(nested_get.remote())
    assert isinstance(info.value, ray.exceptions.RayTaskError)


@ray.remote(max_retries=3, retry_exceptions=[MyError])
def flaky(path):
    n = int(open(path).read()) if os.path.exists(path) else 0
    with open(path, "w") as f:
        f.write(str(n + 1))
    if n < 2:
        raise MyError(f"attempt {n}")
    return n


@ray.remote(max_retries=3)
def not_retried(path):
    with open(path, "a") as f:
        f.write("x")
    raise MyError("once")


@ray.remote(max_retries=5, retry_exceptions=[KeyError])
def other_type(path):
    with open(path, "a") as f:
        f.write("x")
    raise MyError("not listed")


def test_retry_exceptions(ray_env, tmp_path):
    assert ray.get(flaky.remote(str(tmp_path / "a"))) == 2  # ran three times
    with pytest.raises(MyError):
        ray.get(not_retried.remote(str(tmp_path / "b")))
    assert open(tmp_path / "b").read() == "x"  # retry_exceptions=False: user errors run once
    with pytest.raises(MyError):
        ray.get(other_type.remote(str(tmp_path / "c")))
    assert open(tmp_path / "c").read() == "x"  # only listed types are retried


def test_cancel_raises_task_cancelled(ray_env, tmp_path):
    ref = wait_then.remote(str(tmp_path / "never"), 1)
    ray.cancel(ref)
    with pytest.raises(ray.exceptions.TaskCancelledError):
        ray.get(ref, timeout=60)
    with pytest.raises(TypeError, match="ray.kill"):
        ray.cancel("not a ref")


def test_await_and_future(ray_env):
    import asyncio

    async def main():
        return await add.remote(2, 3)

    assert asyncio.run(main()) == 5
    fut = add.remote(4, 5).future()
    assert fut.result(timeout=60) == 9


@ray.remote
def context_in_task():
    ctx = ray.get_runtime_context()
    return (ctx.namespace, ctx.get_job_id(), ctx.get_assigned_resources(), ctx.get_actor_id(),
            ctx.get_task_id() is not None, ctx.get_node_id())


def test_runtime_context_in_a_task(ray_env):
    ns, job, resources, actor_id, has_task, node = ray.get(
        context_in_task.options(num_cpus=0.5).remote())
    driver = ray.get_runtime_context()
    assert ns == driver.namespace and job == driver.get_job_id()
    assert resources == {"CPU": 0.5} and actor_id is None and has_task
    assert node in {n["NodeID"] for n in ray.nodes()}
    assert driver.get_assigned_resources() == {}


@ray.remote
def session_in_task():
    return ray.get_runtime_context().get_session_name()


@ray.remote
class SessionInActor:
    def session(self):
        return ray.get_runtime_context().get_session_name(), ray.get(session_in_task.remote())


def test_session_name_is_the_clusters_everywhere(ray_env):
    # Ray: one name per cluster instance, the same in the driver, its tasks and its actors
    import re

    name = ray.get_runtime_context().get_session_name()
    assert re.fullmatch(r"session_\d{4}-\d\d-\d\d_\d\d-\d\d-\d\d_\d{6}_\d+", name), name
    assert ray.get(session_in_task.remote()) == name
    actor = SessionInActor.remote()
    assert ray.get(actor.session.remote()) == (name, name)  # and a task it submits
    ray.kill(actor)


def test_nodes_and_resources_in_ray_units(ray_env):
    nodes = ray.nodes()  # the embedded cluster is one node (a machine: docs/nodes.md)
    assert len(nodes) == 1 and all(n["Alive"] for n in nodes)
    assert sum(n["Resources"]["CPU"] for n in nodes) == 2.0
    total = ray.cluster_resources()
    assert total["CPU"] == 2.0 and total["memory"] > 2 ** 20
    free = ray.available_resources()
    assert 0 <= free["CPU"] <= 2.0


@ray.remote
def where():
    return ray.get_runtime_context().get_node_id()


def test_node_affinity_places_on_the_node(ray_env):
    from yrdask.ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    for node in [n["NodeID"] for n in ray.nodes()]:
        strategy = NodeAffinitySchedulingStrategy(node, soft=False)
        assert set(ray.get([where.options(scheduling_strategy=strategy).remote()
                            for _ in range(3)])) == {node}


def test_spread_uses_every_node(ray_env):
    seen = set(ray.get([where.options(scheduling_strategy="SPREAD").remote()
                        for _ in range(8)]))
    assert seen == {n["NodeID"] for n in ray.nodes()}


@ray.remote(runtime_env={"env_vars": {"YRDASK_RAY_TEST_VAR": "42"}})
def read_env():
    return os.environ.get("YRDASK_RAY_TEST_VAR")


def test_runtime_env_vars_reach_yr_options():
    from yrdask.ray._options import TASK, to_invoke_options

    assert to_invoke_options(read_env._options, TASK, "ns").invoke.env_vars == {
        "YRDASK_RAY_TEST_VAR": "42"}


def test_threads_share_one_auto_init(cluster):
    cluster()
    ray.shutdown()
    results = []

    def run():
        results.append(ray.get(add.remote(1, 1)))

    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results == [2, 2, 2, 2]
    ray.shutdown()


def test_init_joins_a_dask_scheduler_by_address(cluster, monkeypatch):
    cli = cluster.cli_processes()  # dask scheduler + workers, no yr runtime in this process
    ray.shutdown()
    ctx = ray.init(address=cli.address, namespace="joined")
    try:
        assert ctx["address"] == cli.address
        assert ray.get(add.remote(20, 22)) == 42
        assert ray.cluster_resources().get("gpu_node") == 1.0  # the cli worker's tag
    finally:
        ray.shutdown()  # ray.init started this runtime, so it ends it
    assert not ray.is_initialized()
    monkeypatch.setenv("RAY_ADDRESS", cli.address)
    ray.init(address="auto")
    try:
        assert ray.get(add.remote(1, 1)) == 2
    finally:
        ray.shutdown()
    monkeypatch.delenv("RAY_ADDRESS")
    monkeypatch.delenv("YR_SERVER_ADDRESS", raising=False)
    with pytest.raises(ConnectionError, match="auto"):
        ray.init(address="auto")
    with pytest.raises(ray.exceptions.UnsupportedOptionError, match="ray://"):
        ray.init(address="ray://head:10001")


@ray.remote
def ready_count(refs, timeout):
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout)
    return len(ready)


def test_nested_refs_are_not_waited_for(ray_env, tmp_path):
    gate = str(tmp_path / "go")
    inner = wait_then.remote(gate, 5)
    # Ray's rule (yr's differs): a task starts before refs nested in its arguments are ready
    assert ray.get(ready_count.remote([inner], 0), timeout=60) == 0
    open(gate, "w").close()
    assert ray.get(inner, timeout=60) == 5
    assert ray.get(ready_count.remote([inner], 60), timeout=90) == 1
