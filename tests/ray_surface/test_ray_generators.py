"""yrdask.ray generators and placement groups on a real embedded cluster (SPEC §7).

A generator function returns an ``ObjectRefGenerator`` (Ray's default, ``"streaming"``);
``num_returns="dynamic"`` gives a ref whose value iterates the refs; generator and async
generator actor methods stream too.  Placement groups reserve bundles in Ray units and place
tasks and actors in a bundle with ``PlacementGroupSchedulingStrategy``.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import cloudpickle
import pytest

import yrdask as yr
import yrdask.ray as ray
from conftest import wait_until
from yrdask.ray.util.placement_group import (get_placement_group, placement_group,
                                             placement_group_table, remove_placement_group)
from yrdask.ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

cloudpickle.register_pickle_by_value(sys.modules[__name__])

pytestmark = pytest.mark.timeout(120)


@ray.remote
def tens(n):
    for i in range(n):
        yield i * 10


@ray.remote
def not_a_generator():
    return 1


class Broken(Exception):
    pass


@ray.remote
def breaks_after_one():
    yield 1
    raise Broken("second")


def test_generator_task_streams_refs(ray_env):
    gen = tens.remote(3)
    assert isinstance(gen, ray.ObjectRefGenerator)
    assert [ray.get(r) for r in gen] == [0, 10, 20]
    dyn = tens.options(num_returns="dynamic").remote(3)
    assert isinstance(dyn, ray.ObjectRef)
    inner = ray.get(dyn)
    assert isinstance(inner, ray.DynamicObjectRefGenerator)
    assert [ray.get(r) for r in inner] == [0, 10, 20]
    with pytest.raises(ValueError, match="generator function"):
        not_a_generator.options(num_returns="streaming").remote()


def test_generator_error_comes_at_its_item(ray_env):
    refs = breaks_after_one.remote()
    assert ray.get(next(refs)) == 1
    with pytest.raises(Broken):
        ray.get(next(refs))


@ray.remote
class Streamer:
    def count(self, n):
        for i in range(n):
            yield i

    async def acount(self, n):
        for i in range(n):
            await asyncio.sleep(0)
            yield i


def test_generator_methods_stream(ray_env):
    s = Streamer.remote()
    assert [ray.get(r) for r in s.count.remote(3)] == [0, 1, 2]

    async def main():
        return [await r async for r in s.acount.remote(3)]

    assert asyncio.run(main()) == [0, 1, 2]
    ray.kill(s)


@ray.remote
class BreaksAfterTwo:
    def sync(self):
        yield 1
        yield 2
        raise Broken("third")

    async def asynchronous(self):
        yield 1
        await asyncio.sleep(0)
        yield 2
        raise Broken("third")


def _values_or_errors(refs):
    out = []
    for ref in refs:
        try:
            out.append(ray.get(ref, timeout=60))
        except Broken:
            out.append("Broken")
    return out


def test_a_generator_method_that_raises_fills_the_rest_of_its_returns_with_the_error(ray_env):
    # Ray: num_returns=4 and two values, then an error: the refs after the values raise it
    # (an async generator as a sync one)
    b = BreaksAfterTwo.remote()
    for method in (b.sync, b.asynchronous):
        assert _values_or_errors(method.options(num_returns=4).remote()) == \
            [1, 2, "Broken", "Broken"]
        dynamic = ray.get(method.options(num_returns="dynamic").remote(), timeout=60)
        assert _values_or_errors(dynamic) == [1, 2, "Broken"]
        # every return made before the error: Ray only logs it (its generator page)
        assert _values_or_errors(method.options(num_returns=2).remote()) == [1, 2]
    ray.kill(b)


@ray.remote(num_cpus=1)
def node_of_task():
    return ray.get_runtime_context().get_node_id()


@ray.remote(num_cpus=1)
class Pinned:
    def node(self):
        return ray.get_runtime_context().get_node_id()


def test_placement_group_spread_places_work_in_its_bundles(ray_env):
    # The embedded cluster is one node: SPREAD (a preference) puts both bundles on it, and
    # STRICT_SPREAD would wait for a second node, as on Ray.
    strict = placement_group([{"CPU": 1}, {"CPU": 1}], strategy="STRICT_SPREAD")
    assert strict.wait(0.5) is False
    remove_placement_group(strict)
    pg = placement_group([{"CPU": 1}, {"CPU": 1}], strategy="SPREAD")
    assert ray.get(pg.ready()) is not None and pg.wait(30)
    assert placement_group_table(pg)["state"] == "CREATED"
    assert pg.bundle_count == 2 and pg.bundle_specs == [{"CPU": 1}, {"CPU": 1}]
    nodes = ray.get([node_of_task.options(
        scheduling_strategy=PlacementGroupSchedulingStrategy(pg, i)).remote() for i in range(2)])
    assert len(set(nodes)) == 1 and nodes[0] == ray.nodes()[0]["NodeID"]
    actor = Pinned.options(scheduling_strategy=PlacementGroupSchedulingStrategy(pg, 0)).remote()
    assert ray.get(actor.node.remote()) == nodes[0]
    ray.kill(actor)
    remove_placement_group(pg)
    assert placement_group_table(pg)["state"] == "REMOVED"


def _groups() -> dict:
    from yrdask import protocol as P
    from yrdask.runtime.context import current_runtime

    info = current_runtime().scheduler_call(P.CLUSTER_INFO, instances=False)
    return {g["name"]: g["state"] for g in info["resource_groups"]}


def test_a_detached_placement_group_outlives_its_driver(ray_env, cluster):
    # Ray: lifetime="detached" keeps the group after its job ends, until it is removed; a
    # group of the job's own lifetime goes with the job
    name, own = f"detached-{os.urandom(3).hex()}", f"own-{os.urandom(3).hex()}"
    code = ("import yrdask.ray as ray\n"
            "from yrdask.ray.util.placement_group import placement_group\n"
            f"ray.init(address={cluster.active.address!r})\n"
            f"assert placement_group([{{'CPU': 0.1}}], name={name!r}, lifetime='detached')"
            ".wait(60)\n"
            f"assert placement_group([{{'CPU': 0.1}}], name={own!r}).wait(60)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=90)
    assert out.returncode == 0, out.stderr[-3000:]
    wait_until(lambda: own not in _groups(), 30, "the job's own group to go with its job")
    assert _groups().get(name) == "CREATED"
    found = get_placement_group(name)  # another job finds it by name
    assert found.name == name and found.bundle_specs == [{"CPU": 0.1}] and found.wait(0)
    remove_placement_group(found)
    assert name not in _groups()
    for gone in (name, own):
        with pytest.raises(ValueError, match=f"Failed to look up placement group.*{gone}"):
            get_placement_group(gone)
    with pytest.raises(ValueError, match="lifetime"):
        placement_group([{"CPU": 1}], lifetime="forever")


def test_placement_group_that_cannot_fit_is_not_ready(ray_env):
    pg = placement_group([{"CPU": 64}])
    assert pg.wait(0.5) is False
    remove_placement_group(pg)
    with pytest.raises(ValueError, match="strategy"):
        placement_group([{"CPU": 1}], strategy="EVERYWHERE")
    with pytest.raises(ValueError, match="bundle_index"):
        PlacementGroupSchedulingStrategy(pg, 5)


@ray.remote
def two_items():
    yield 1
    yield 2


@ray.remote
def five():
    return 5


def test_num_returns_none_is_rays_default(ray_env):
    # Ray's tests pass num_returns=None for "the default": a generator streams, a function
    # returns one value
    gen = two_items.options(num_returns=None).remote()
    assert [ray.get(ref, timeout=60) for ref in gen] == [1, 2]
    assert ray.get(five.options(num_returns=None).remote(), timeout=60) == 5
    assert ray.get(ray.remote(num_returns=None)(lambda: 6).remote(), timeout=60) == 6


@ray.remote
class Plain:
    def one(self):
        return 1


def test_streaming_and_dynamic_on_a_plain_function_fail_where_declared(ray_env):
    # Ray refuses them at the decorator (and at .options()), before anything is submitted
    with pytest.raises(ValueError, match="can only be used with generator functions"):
        ray.remote(num_returns="dynamic")(five)
    with pytest.raises(ValueError, match="can only be used with generator functions"):
        ray.remote(five).options(num_returns="streaming")
    with pytest.raises(ValueError, match="can only be used with generator functions"):
        ray.method(num_returns="dynamic")(five)
    p = Plain.remote()
    with pytest.raises(ValueError, match="can only be used with generator functions"):
        p.one.options(num_returns="dynamic")
    assert ray.get(p.one.options(num_returns=None).remote(), timeout=60) == 1
    ray.kill(p)


def test_get_of_a_streaming_generator_gives_the_generator(ray_env):
    # Ray's rule: code written for num_returns="dynamic" (ray.get, then iterate) reads a
    # streaming generator too
    gen = tens.remote(3)
    assert ray.get(gen) is gen
    first, second, third = ray.get(gen)
    assert ray.get([first, second, third], timeout=60) == [0, 10, 20]
    # None is the method's own num_returns again: a generator method streams
    s = Streamer.remote()
    again = s.count.options(num_returns=2).options(num_returns=None).remote(2)
    assert isinstance(again, ray.ObjectRefGenerator)
    assert [ray.get(r, timeout=60) for r in again] == [0, 1]
    ray.kill(s)


@ray.remote(num_cpus=0)
class Runs:
    def __init__(self):
        self.n = 0

    def inc(self):
        self.n += 1
        return self.n


class Flaky(Exception):
    pass


@ray.remote(max_retries=1)
def fails_in_its_first_run(runs):
    for i in range(3):
        yield i
        if i == 1 and ray.get(runs.inc.remote()) == 1:
            raise Flaky("first run")


def test_a_streaming_task_reruns_for_retry_exceptions_and_sends_only_new_items(ray_env):
    runs = Runs.remote()
    gen = fails_in_its_first_run.options(retry_exceptions=[Flaky]).remote(runs)
    assert [ray.get(r, timeout=60) for r in gen] == [0, 1, 2]  # the rerun's 0, 1 not again
    assert ray.get(runs.inc.remote(), timeout=60) == 3  # it ran twice
    runs = Runs.remote()
    gen = fails_in_its_first_run.remote(runs)  # not named: the error is the next item
    assert ray.get(next(gen), timeout=60) == 0
    assert ray.get(next(gen), timeout=60) == 1
    with pytest.raises(Flaky):
        ray.get(next(gen), timeout=60)
    with pytest.raises(StopIteration):
        next(gen)


@ray.remote(num_cpus=0)
class Gate:
    def __init__(self):
        self.open = asyncio.Event()

    async def wait(self):
        await self.open.wait()

    def release(self):
        self.open.set()


@ray.remote
def one_then_gated(gate):
    yield "first"
    ray.get(gate.wait.remote())
    yield "second"


def test_wait_takes_generators_ready_when_their_next_item_is(ray_env):
    gate = Gate.remote()
    gen = one_then_gated.remote(gate)
    assert ray.wait([gen], timeout=60) == ([gen], [])  # the first item came
    assert ray.get(next(gen), timeout=60) == "first"
    assert ray.wait([gen], timeout=0) == ([], [gen])  # the second waits for the gate
    plain = ray.put(1)
    assert ray.wait([gen, plain], num_returns=1, timeout=60) == ([plain], [gen])
    gate.release.remote()
    assert ray.wait([plain, gen], num_returns=2, timeout=60) == ([plain, gen], [])
    assert ray.get(next(gen), timeout=60) == "second"
    assert ray.wait([gen], timeout=60) == ([gen], [])  # over: next() stops at once
    with pytest.raises(StopIteration):
        next(gen)
    with pytest.raises(TypeError, match="got a single ObjectRefGenerator"):
        ray.wait(gen)
    with pytest.raises(ValueError, match="unique"):
        ray.wait([gen, gen])
    ray.kill(gate)


@ray.remote(num_returns="dynamic")
def three_large():
    for i in range(3):
        yield bytes([i]) * (1 << 20)  # kept on the worker: one table entry each here


def test_a_dynamic_generator_lets_go_of_each_ref_it_hands_out(ray_env):
    from yrdask.ray.util.state import list_objects

    def held() -> set:
        import gc

        gc.collect()
        return {o.object_id for o in list_objects()}

    inner = ray.get(three_large.remote(), timeout=60)
    ids = [r.hex() for r in list(inner._refs)]
    assert set(ids) <= held()
    for i, ref in enumerate(inner):  # each ref taken goes once the loop moves on
        assert ray.get(ref, timeout=60)[:1] == bytes([i])
        assert not set(ids[:i]) & held()
        assert set(ids[i:]) <= held()
    del ref
    assert not set(ids) & held()
    assert list(inner) == [] and len(inner) == 0  # handed out once, as on Ray


def test_cancelling_a_dynamic_generators_ref_cancels_its_task(ray_env):
    gate = Gate.remote()
    ref = one_then_gated.options(num_returns="dynamic").remote(gate)
    assert ref.task_id == ref.hex().split(".")[0]  # the ref names its task
    ray.cancel(ref)
    with pytest.raises(ray.exceptions.TaskCancelledError):
        ray.get(ref, timeout=60)
    ray.get(gate.release.remote(), timeout=60)
