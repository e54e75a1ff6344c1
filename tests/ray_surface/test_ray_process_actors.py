"""Ray actors that are processes of their own (``yrdask_light=False``, docs/isolation.md):
the option itself, a cancel that reaches the actor's process, and the exit rules
(docs/isolation.md#exit-rules) as Ray 2.x applies them: ``exit_actor()`` and ``sys.exit(0)``
end the actor without a restart (``ActorDiedError`` for the call and later ones); a crash that
was restarted gives the call it cut short ``ActorUnavailableError``, never "The actor is
dead", and the actor serves later calls.  A light actor on the same node lives on."""

from __future__ import annotations

import asyncio
import os
import sys

import cloudpickle
import pytest

import yrdask.ray as ray
from conftest import wait_until

cloudpickle.register_pickle_by_value(sys.modules[__name__])

pytestmark = pytest.mark.timeout(120)

T = 90


@ray.remote(num_cpus=0.1, max_restarts=2)
class Unit:
    def __init__(self):
        self.n = 0

    def incr(self):
        self.n += 1
        return self.n

    def pid(self):
        return os.getpid()

    def leave(self):
        ray.actor.exit_actor()

    def quit(self):
        sys.exit(0)

    def crash(self):
        os._exit(1)


def test_light_is_an_option_ray_would_refuse(ray_env):
    light = [Unit.options(yrdask_light=True).remote() for _ in range(3)]
    own = [Unit.options(yrdask_light=False).remote() for _ in range(2)]
    pids = ray.get([a.pid.remote() for a in light + own], timeout=T)
    assert len(set(pids[:3])) < 3  # light ones share their worker's process (two workers)
    assert len(set(pids[3:])) == 2 and not set(pids[3:]) & set(pids[:3])  # own processes
    with pytest.raises(TypeError, match="yrdask_light must be None or a bool"):
        Unit.options(yrdask_light="yes").remote()
    for a in light + own:
        ray.kill(a)


@pytest.mark.parametrize("how", ["leave", "quit"])
def test_intended_exit_ends_a_process_actor_without_restart(ray_env, how):
    leaving = Unit.options(yrdask_light=False).remote()
    light = Unit.options(yrdask_light=True).remote()
    assert ray.get([leaving.incr.remote(), light.incr.remote()], timeout=T) == [1, 1]
    with pytest.raises(ray.exceptions.ActorDiedError):
        ray.get(getattr(leaving, how).remote(), timeout=T)
    with pytest.raises(ray.exceptions.ActorDiedError):
        ray.get(leaving.incr.remote(), timeout=T)  # max_restarts=2 left unused
    assert ray.get(light.incr.remote(), timeout=T) == 2
    ray.kill(light)


def test_a_restarted_crash_is_not_reported_as_a_dead_actor(ray_env):
    crashing = Unit.options(yrdask_light=False).remote()
    light = Unit.options(yrdask_light=True).remote()
    first = ray.get(crashing.pid.remote(), timeout=T)
    assert ray.get(light.incr.remote(), timeout=T) == 1
    with pytest.raises(ray.exceptions.ActorUnavailableError) as info:
        ray.get(crashing.crash.remote(), timeout=T)
    assert "The actor is dead" not in str(info.value), str(info.value)
    assert "may or may not have been executed" in str(info.value)
    assert ray.get(crashing.pid.remote(), timeout=T) != first  # restarted, serving calls
    assert ray.get(light.incr.remote(), timeout=T) == 2
    for a in (crashing, light):
        ray.kill(a)


@ray.remote(num_cpus=0.1)
class Napper:
    async def nap(self, started):
        open(started, "w").close()
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:  # the running coroutine is cancelled, in its process
            self.cancelled = True
            raise
        return "slept"

    async def was_cancelled(self):
        return getattr(self, "cancelled", False)


def test_cancel_reaches_a_running_call_in_the_actors_process(ray_env, tmp_path):
    a = Napper.options(yrdask_light=False).remote()
    started = tmp_path / "started"
    ref = a.nap.remote(str(started))
    wait_until(started.exists, T, "the call to start")
    ray.cancel(ref)
    with pytest.raises(ray.exceptions.TaskCancelledError, match="was cancelled"):
        ray.get(ref, timeout=T)
    assert ray.get(a.was_cancelled.remote(), timeout=T) is True
    ray.kill(a)
