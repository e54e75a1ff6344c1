"""How Ray actor classes may be written: ``async def __init__`` (awaited on the actor's
event loop before any call) and ``@ray.method`` with no options.

Each test states the Ray behaviour it checks (learned from Ray's source and tests).
"""

from __future__ import annotations

import asyncio
import sys
import threading

import cloudpickle
import pytest

import yrdask.ray as ray

cloudpickle.register_pickle_by_value(sys.modules[__name__])

pytestmark = pytest.mark.timeout(120)


@ray.remote
class AsyncInit:
    async def __init__(self, value):
        await asyncio.sleep(0)  # really suspends: the loop must finish it
        self.value = value
        self.init_loop = id(asyncio.get_running_loop())
        self.ticker = asyncio.get_running_loop().create_task(asyncio.sleep(3600))

    async def get(self):
        # a task made in __init__ lives on the loop the methods run on (Ray: one loop)
        return self.value, self.init_loop == id(asyncio.get_running_loop()), \
            not self.ticker.done()


@ray.remote
class AsyncInitOnly:
    """A class whose only ``async def`` is ``__init__`` (an async actor all the same)."""

    async def __init__(self):
        await asyncio.sleep(0)
        self.ready = True

    def get(self):
        return self.ready


@ray.remote
class FailingAsyncInit:
    async def __init__(self):
        await asyncio.sleep(0)
        raise ValueError("init failed on purpose")

    def get(self):
        return "unreachable"


def test_an_async_init_is_awaited_on_the_actors_loop_before_any_call(ray_env):
    a = AsyncInit.remote(7)
    assert ray.get(a.get.remote(), timeout=60) == (7, True, True)
    assert ray.get(AsyncInitOnly.remote().get.remote(), timeout=60) is True


def test_an_async_init_that_raises_fails_every_call_as_the_actor_dying(ray_env):
    # Ray: a failed constructor makes every call raise ActorDiedError naming the error
    f = FailingAsyncInit.remote()
    with pytest.raises(ray.exceptions.ActorDiedError, match="init failed on purpose"):
        ray.get(f.get.remote(), timeout=60)


@ray.remote
class Plain:
    @ray.method()
    def empty_parens(self):
        return "()"

    @ray.method
    def bare(self):
        return threading.current_thread().name != ""


def test_ray_method_without_options_changes_nothing(ray_env):
    # Ray 2.x accepts @ray.method and @ray.method(): the method keeps its defaults
    p = Plain.remote()
    assert ray.get([p.empty_parens.remote(), p.bare.remote()], timeout=60) == ["()", True]


def test_ray_method_with_a_positional_option_is_a_type_error():
    with pytest.raises(TypeError, match="keyword arguments only"):
        ray.method(2)


def _caller_side(invocation):
    """Ray's ``__ray_invocation_decorator__``: runs where ``.remote()`` is called; it sends
    the argument twice and hands the keyword arguments back beside the ref."""
    def call(args, kwargs):
        return invocation([args[0], args[0]], {}), kwargs

    return call


def _actor_side(fn):
    def run(self, b, c):
        return fn(self, b + c)

    run.__ray_invocation_decorator__ = _caller_side
    return run


@ray.remote
class Decorated:
    @_actor_side
    def add_one(self, x):
        return x + 1

    def plain(self, x):
        return x


@ray.remote
def call_decorated(actor):
    ref, extra = actor.add_one.remote(5, note="task")
    return ray.get(ref), extra


def test_a_methods_invocation_decorator_wraps_its_calls_where_they_are_made(ray_env):
    a = Decorated.remote()
    ref, extra = a.add_one.remote(3, kwarg=3)
    assert isinstance(ref, ray.ObjectRef) and extra == {"kwarg": 3}
    assert ray.get(ref) == 7  # (3 + 3) + 1: the decorator split the argument in two
    # the handle carries it: a task that calls through a handle it was passed is wrapped too
    assert ray.get(call_decorated.remote(a)) == (11, {"note": "task"})
    ref, _ = a.add_one.options(name="with-options").remote(1)  # and with per-call options
    assert ray.get(ref) == 3
    assert ray.get(a.plain.remote(4)) == 4  # other methods are called as they are
