"""Ray actors are processes of their own by default, as on Ray (docs/isolation.md): each
sees its own environment and module state, a crash ends it alone, nested calls work in it,
``yrdask_light=True`` picks a light actor instead, a cancel reaches the actor's process, and
the exit rules (docs/isolation.md#exit-rules) are Ray 2.x's: ``exit_actor()`` and
``sys.exit(0)`` end the actor without a restart (``ActorDiedError`` for the call and later
ones); a crash that was restarted gives the call it cut short ``ActorUnavailableError``, never
"The actor is dead", unless the call's ``max_task_retries`` delivers it again; the actor serves
later calls.  A light actor on the same node lives on."""

from __future__ import annotations

import asyncio
import atexit
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

    def crash_once(self, marker):
        if not os.path.exists(marker):
            open(marker, "w").close()
            os._exit(1)
        return self.n


def test_light_is_an_option_ray_would_refuse(ray_env):
    light = [Unit.options(yrdask_light=True).remote() for _ in range(3)]
    own = [Unit.options(yrdask_light=False).remote(), Unit.remote()]  # a process by default
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
    said = r"exit_actor\(\)" if how == "leave" else r"sys\.exit\(\)"  # what ended it
    with pytest.raises(ray.exceptions.ActorDiedError, match=said):
        ray.get(getattr(leaving, how).remote(), timeout=T)
    with pytest.raises(ray.exceptions.ActorDiedError, match=said):
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


@ray.remote(num_cpus=0.1)
class Settler:
    """Sets an environment variable and a module of its own in sys.modules in __init__."""

    def __init__(self, i):
        os.environ["YR_PROCESS_ACTOR_VAR"] = str(i)
        sys.modules["yr_process_actor_state"] = type(sys)("yr_process_actor_state")
        sys.modules["yr_process_actor_state"].i = i

    def seen(self):
        return (os.environ.get("YR_PROCESS_ACTOR_VAR"),
                sys.modules["yr_process_actor_state"].i, os.getpid())

    def crash(self):
        os._exit(3)


def test_each_actor_sees_its_own_environment_and_module_state(ray_env):
    """Six actors (no option: processes) each set os.environ and a sys.modules entry in
    __init__ and read their own back, as on Ray; six light ones read their last neighbour's."""
    own = [Settler.remote(i) for i in range(6)]
    seen = ray.get([a.seen.remote() for a in own], timeout=T)
    assert [(env, mod) for env, mod, _pid in seen] == [(str(i), i) for i in range(6)], seen
    assert len({pid for _e, _m, pid in seen}) == 6
    light = [Settler.options(yrdask_light=True).remote(10 + i) for i in range(6)]
    ray.get([a.__ray_ready__.remote() for a in light], timeout=T)  # every __init__ ran
    shared = ray.get([a.seen.remote() for a in light], timeout=T)
    by_pid: dict = {}  # six in the two workers' processes: one value per process
    for env, mod, pid in shared:
        by_pid.setdefault(pid, set()).add((env, mod))
    assert len(by_pid) <= 2 and all(len(v) == 1 for v in by_pid.values()), shared
    for a in own + light:
        ray.kill(a)


def test_os_exit_in_one_actor_leaves_the_others_on_the_node_alive(ray_env):
    """os._exit in one actor (no restarts) ends it alone: its calls raise ActorDiedError,
    the other actors keep their state and their processes."""
    doomed = Unit.options(max_restarts=0).remote()
    others = [Unit.remote() for _ in range(3)]
    assert ray.get([a.incr.remote() for a in others], timeout=T) == [1, 1, 1]
    pids = ray.get([a.pid.remote() for a in others], timeout=T)
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(doomed.crash.remote(), timeout=T)
    with pytest.raises(ray.exceptions.ActorDiedError):
        ray.get(doomed.incr.remote(), timeout=T)
    assert ray.get([a.incr.remote() for a in others], timeout=T) == [2, 2, 2]
    assert ray.get([a.pid.remote() for a in others], timeout=T) == pids
    for a in others:
        ray.kill(a)


def test_a_calls_own_max_task_retries_delivers_it_again_after_a_crash(ray_env, tmp_path):
    """.options(max_task_retries=1) on one call: the actor's process dies under it, the
    actor restarts (max_restarts) and the call runs again there and answers, as on Ray;
    without it (Ray's default 0) the call cut short fails."""
    a = Unit.remote()
    assert ray.get(a.incr.remote(), timeout=T) == 1
    assert ray.get(a.crash_once.options(max_task_retries=1).remote(str(tmp_path / "a")),
                   timeout=T) == 0  # a fresh __init__ ran it
    with pytest.raises(ray.exceptions.ActorUnavailableError):
        ray.get(a.crash_once.remote(str(tmp_path / "b")), timeout=T)
    assert ray.get(a.incr.remote(), timeout=T) == 1  # restarted twice, serving calls
    ray.kill(a)


@ray.remote(num_cpus=0.1)
def square(x):
    return x * x, os.getpid()


@ray.remote(num_cpus=0.1)
class Nester:
    def fan(self, n):
        out = ray.get([square.remote(i) for i in range(n)])
        kid = Unit.remote()
        kid_pid = ray.get(kid.pid.remote())
        ray.kill(kid)
        return [v for v, _ in out], {p for _, p in out}, kid_pid, os.getpid()


def test_an_actor_makes_nested_calls_from_its_own_process(ray_env):
    """A process actor submits tasks and creates and calls an actor of its own, as on Ray:
    the tasks run in worker processes, the child actor in a process of its own."""
    a = Nester.remote()
    values, task_pids, kid_pid, pid = ray.get(a.fan.remote(4), timeout=T)
    assert values == [0, 1, 4, 9]
    assert pid not in task_pids and kid_pid not in task_pids and kid_pid != pid
    ray.kill(a)


@ray.remote(num_cpus=0.1)
class Registrar:
    def __init__(self, path):
        atexit.register(lambda: open(path, "w").close())

    def leave(self):
        ray.actor.exit_actor()

    def crash(self):
        os._exit(1)


def test_an_actor_that_exits_runs_its_atexit_handlers_one_that_crashes_does_not(
        ray_env, tmp_path):
    """exit_actor() ends the actor's process as Ray's does, running the atexit handlers its
    actor registered; a crash (os._exit) skips them."""
    leaving = Registrar.remote(str(tmp_path / "left"))
    crashing = Registrar.options(max_restarts=0).remote(str(tmp_path / "crashed"))
    ray.get([leaving.__ray_ready__.remote(), crashing.__ray_ready__.remote()], timeout=T)
    with pytest.raises(ray.exceptions.ActorDiedError, match=r"exit_actor\(\)"):
        ray.get(leaving.leave.remote(), timeout=T)
    wait_until((tmp_path / "left").exists, T, "the atexit handler of the actor that exited")
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(crashing.crash.remote(), timeout=T)
    assert not (tmp_path / "crashed").exists()
