"""yrdask.ray's option mapping and argument checks, without a cluster (SPEC §7).

Ray's units become yr's (``num_cpus=1`` is 1000 millicores, ``memory`` bytes become MB,
``num_gpus`` the ``GPU`` custom resource); Ray options yrdask cannot honour raise
``UnsupportedOptionError`` naming them, unknown keywords ``ValueError`` as on Ray.
"""

from __future__ import annotations

import sys

import pytest

import yrdask.ray as ray
from yrdask.affinity import AffinityType
from yrdask.ray._options import ACTOR, TASK, to_invoke_options
from yrdask.ray.exceptions import UnsupportedOptionError
from yrdask.ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

pytestmark = pytest.mark.timeout(60)


def test_task_defaults_hold_one_cpu_and_no_memory():
    opts = to_invoke_options({}, TASK, "ns")
    assert (opts.invoke.cpu, opts.invoke.memory) == (1000, 0)
    assert opts.max_retries == 3 and opts.retry_exceptions is False and opts.num_returns == 1


def test_actor_defaults_hold_no_cpu_and_keep_the_namespace():
    opts = to_invoke_options({}, ACTOR, "ns1")
    assert (opts.invoke.cpu, opts.invoke.memory, opts.invoke.namespace) == (0, 0, "ns1")
    assert opts.invoke.recover_retry_times == 0


def test_units_are_mapped_to_yr():
    opts = to_invoke_options({"num_cpus": 0.5, "memory": 3 * 2 ** 20 + 1, "num_gpus": 2,
                              "resources": {"ssd": 1}}, TASK, "ns")
    assert opts.invoke.cpu == 500
    assert opts.invoke.memory == 4  # bytes rounded up to MB
    assert opts.invoke.custom_resources == {"GPU": 2.0, "ssd": 1.0}


def test_actor_options_map_to_yr_fields():
    opts = to_invoke_options({"max_restarts": -1, "max_concurrency": 4, "name": "a",
                              "namespace": "other", "lifetime": "detached",
                              "get_if_exists": True}, ACTOR, "ns")
    inv = opts.invoke
    assert inv.recover_retry_times == -1 and inv.concurrency == 4
    assert (inv.name, inv.namespace, inv.get_if_exists) == ("a", "other", True)
    assert inv.is_detached


def test_runtime_env_vars_become_env_vars_and_other_keys_are_refused():
    opts = to_invoke_options({"runtime_env": {"env_vars": {"A": "1"}}}, TASK, "ns", {"B": "2"})
    assert opts.invoke.env_vars == {"B": "2", "A": "1"}
    with pytest.raises(UnsupportedOptionError, match="pip"):
        to_invoke_options({"runtime_env": {"pip": ["x"]}}, TASK, "ns")


def test_node_affinity_soft_and_hard():
    soft = to_invoke_options({"scheduling_strategy": NodeAffinitySchedulingStrategy(
        "tcp://1.2.3.4:5", soft=True)}, TASK, "ns").invoke.schedule_affinities
    hard = to_invoke_options({"scheduling_strategy": NodeAffinitySchedulingStrategy(
        "tcp://1.2.3.4:5", soft=False)}, TASK, "ns").invoke.schedule_affinities
    assert soft[0].affinity_type == AffinityType.PREFERRED
    assert hard[0].affinity_type == AffinityType.REQUIRED
    assert soft[0].label_operators[0].values == ["tcp://1.2.3.4:5"]
    assert to_invoke_options({"scheduling_strategy": "SPREAD"}, TASK, "ns").spread


def test_label_selector_becomes_one_hard_rule_on_node_labels():
    """Each entry is a condition on the node's labels, all AND-ed in one hard affinity (and
    into a hard node affinity's); ``ray.io/node-id`` is the node id."""
    from yrdask.affinity import OperatorType as Op

    (rule,) = to_invoke_options({"label_selector": {
        "zone": "a", "market": "!spot", "gpu": "in(A100, H100)", "ray.io/node-id": "!in(n1)"}},
        TASK, "ns").invoke.schedule_affinities
    assert rule.affinity_type == AffinityType.REQUIRED
    assert [(o.operator_type, o.key, o.values) for o in rule.label_operators] == [
        (Op.LABEL_IN, "zone", ["a"]), (Op.LABEL_NOT_IN, "market", ["spot"]),
        (Op.LABEL_IN, "gpu", ["A100", "H100"]), (Op.LABEL_NOT_IN, "NODE_ID", ["n1"])]
    (both,) = to_invoke_options({"label_selector": {"zone": "a"}, "scheduling_strategy":
                                 NodeAffinitySchedulingStrategy("n2", soft=False)},
                                ACTOR, "ns").invoke.schedule_affinities
    assert [o.key for o in both.label_operators] == ["NODE_ID", "zone"]


@pytest.mark.parametrize("selector, error", [(["zone"], TypeError), ({"zone": ""}, ValueError),
                                             ({"zone": 1}, ValueError),
                                             ({"zone": "in()"}, ValueError)])
def test_a_bad_label_selector_is_refused_at_the_option(selector, error):
    with pytest.raises(error, match="label_selector"):
        to_invoke_options({"label_selector": selector}, TASK, "ns")


@pytest.mark.parametrize("key, value", [("accelerator_type", "A100"),
                                        ("object_store_memory", 10),
                                        ("placement_group_bundle_index", 0)])
def test_unsupported_ray_options_are_named(key, value):
    def f():
        return 1

    with pytest.raises(UnsupportedOptionError, match=key):
        ray.remote(**{key: value})(f)


def test_system_config_is_refused_before_anything_starts_and_says_what_bounds_memory():
    with pytest.raises(UnsupportedOptionError, match="no node-wide monitor") as info:
        ray.init(_system_config={"memory_usage_threshold": 0.4})
    assert "distributed.worker.memory" in str(info.value)
    assert "Drop _system_config" in str(info.value)
    with pytest.raises(UnsupportedOptionError, match=r"\{'object_timeout_milliseconds'\}") as info:
        ray.init(_system_config={"object_timeout_milliseconds": 10})
    assert "memory" not in str(info.value)


def test_unknown_keywords_and_wrong_kinds_are_value_errors():
    def f():
        return 1

    with pytest.raises(ValueError, match="Invalid option keyword bogus"):
        ray.remote(bogus=1)(f)
    with pytest.raises(ValueError, match="max_restarts"):
        ray.remote(max_restarts=1)(f)  # an actor option on a task

    class C:
        pass

    with pytest.raises(ValueError, match="num_returns"):
        ray.remote(num_returns=2)(C)


@pytest.mark.parametrize("options, match", [
    ({"num_cpus": -1}, "num_cpus"), ({"max_retries": -2}, "max_retries"),
    ({"retry_exceptions": [1]}, "retry_exceptions"), ({"num_returns": "x"}, "num_returns"),
    ({"resources": {"CPU": 1}}, "num_cpus"),
])
def test_bad_task_values(options, match):
    with pytest.raises((ValueError, TypeError), match=match):
        to_invoke_options(options, TASK, "ns")


def test_bad_actor_values():
    with pytest.raises(ValueError, match="lifetime"):
        to_invoke_options({"lifetime": "forever"}, ACTOR, "ns")
    with pytest.raises(ValueError, match="get_if_exists"):
        to_invoke_options({"get_if_exists": True}, ACTOR, "ns")


def test_direct_calls_say_what_to_do():
    @ray.remote
    def f():
        return 1

    @ray.remote
    class C:
        def m(self):
            return 1

    with pytest.raises(TypeError, match=r"f.remote\(\)"):
        f()
    with pytest.raises(TypeError, match=r"C.remote\(\)"):
        C()
    with pytest.raises(ValueError, match="async def"):
        @ray.remote
        async def g():
            return 1


def test_options_return_a_new_function_and_keep_the_original():
    @ray.remote(num_cpus=2)
    def f():
        return 1

    g = f.options(num_cpus=0.25, num_returns=2)
    assert g is not f
    assert f._options == {"num_cpus": 2}
    assert g._options == {"num_cpus": 0.25, "num_returns": 2}


def test_method_decorator_takes_keywords_only():
    with pytest.raises(TypeError, match="keyword arguments only"):
        ray.method(1)
    with pytest.raises(ValueError, match="Invalid option keyword bogus"):
        ray.method(bogus=1)


def test_exceptions_have_rays_shapes():
    from yrdask.ray import exceptions as E

    assert issubclass(E.GetTimeoutError, TimeoutError)
    assert issubclass(E.ActorDiedError, E.RayActorError)
    assert issubclass(E.OwnerDiedError, E.ObjectLostError)
    err = E.RayTaskError("f", "Traceback...", KeyError("k")).as_instanceof_cause()
    assert isinstance(err, KeyError) and isinstance(err, E.RayTaskError)
    assert not isinstance(err, RuntimeError)
    assert isinstance(err.args[0], KeyError) and err.cause.args == ("k",)


def test_alias_maps_ray_to_the_same_modules_in_a_fresh_process():
    import subprocess

    code = ("import yrdask.ray._alias as a; a.install(); import ray, ray.util.queue, yrdask.ray;"
            "from ray.util import ActorPool; import yrdask.ray.util.queue as q;"
            "assert ray is yrdask.ray and ray.util.queue is q;"
            "assert ray.__spec__.name == 'yrdask.ray'; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.stdout.strip() == "ok", out.stderr
