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


class Flaky(Exception):
    pass


@ray.remote(num_cpus=0.1)
class Tally:
    """Counts the runs of a method elsewhere (it lives on across the other actor's deaths)."""

    def __init__(self):
        self.n = 0

    def next(self):
        self.n += 1
        return self.n - 1

    def count(self):
        return self.n


@ray.remote(num_cpus=0.1, max_restarts=1)
class Mixed:
    @ray.method(retry_exceptions=[Flaky])
    def act(self, tally, actions):
        """Run ``actions[i]`` on its i-th run: raise (rerun), exit (a crash) or return."""
        i = ray.get(tally.next.remote())
        action = actions[i] if i < len(actions) else "return"
        if action == "raise":
            raise Flaky()
        if action == "exit":
            os._exit(1)
        return i


@pytest.mark.parametrize("actions, error", [
    pytest.param(["exit", "raise", "raise"], Flaky, id="exit,raise,raise"),  # crash charged
    pytest.param(["raise", "exit", "raise"], Flaky, id="raise,exit,raise"),
    pytest.param(["raise", "raise", "exit"], ray.exceptions.ActorUnavailableError,
                 id="raise,raise,exit"),  # restarted, past its budget
])
def test_reruns_after_exceptions_and_crashes_share_max_task_retries(ray_env, actions, error):
    """Ray's max_task_retries is one budget for the reruns after a retry_exceptions
    exception and the deliveries after a crash: with 2, the call runs three times in all,
    whatever the mix, and fails with what ended its last run."""
    tally = Tally.options(yrdask_light=True).remote()
    a = Mixed.remote()
    with pytest.raises(error):
        ray.get(a.act.options(max_task_retries=2).remote(tally, actions), timeout=T)
    assert ray.get(tally.count.remote(), timeout=T) == 3
    with_budget = a.act.options(max_task_retries=4).remote(tally, [])  # serves later calls
    assert ray.get(with_budget, timeout=T) == 3
    for x in (a, tally):
        ray.kill(x)


@ray.remote(num_cpus=0.1, max_restarts=2)
class Closer:
    def __init__(self, path):
        self.path = path
        atexit.register(lambda: open(f"{path}.atexit", "w").close())

    def __ray_shutdown__(self):
        with open(f"{self.path}.shutdown", "w") as f:
            f.write(str(os.getpid()))

    def nap(self, s):
        import time

        time.sleep(s)
        return s


@pytest.mark.parametrize("light", [False, True], ids=["process", "light"])
def test_ray_terminate_runs_the_calls_before_it_then_ends_the_actor_gracefully(
        ray_env, tmp_path, light):
    """actor.__ray_terminate__.remote() is queued as a call: the calls sent before it
    answer, then the actor ends by intent (no restart, though max_restarts=2 is left),
    running __ray_shutdown__ and, in its own process, its atexit handlers; later calls
    raise ActorDiedError."""
    path = str(tmp_path / "c")
    a = Closer.options(yrdask_light=light).remote(path)
    before = a.nap.remote(0.3)
    a.__ray_terminate__.remote()
    assert ray.get(before, timeout=T) == 0.3
    with pytest.raises(ray.exceptions.ActorDiedError, match=r"exited by __ray_terminate__\(\)"):
        ray.get(a.nap.remote(0), timeout=T)
    wait_until(lambda: os.path.exists(f"{path}.shutdown"), T, "__ray_shutdown__ to run")
    if not light:
        wait_until(lambda: os.path.exists(f"{path}.atexit"), T, "the atexit handler")


def test_ray_shutdown_runs_when_the_last_handle_goes(ray_env, tmp_path):
    path = str(tmp_path / "d")
    a = Closer.remote(path)
    ray.get(a.nap.remote(0), timeout=T)
    del a
    wait_until(lambda: os.path.exists(f"{path}.shutdown"), T, "__ray_shutdown__ to run")


@ray.remote(num_cpus=0.1, max_restarts=1)
class Starter:
    def __init__(self, path, how):
        atexit.register(lambda: open(f"{path}.atexit", "w").close())
        with open(f"{path}.inits", "a") as f:
            f.write("x")
        if how == "exit_actor":
            ray.actor.exit_actor()
        elif how == "sys.exit(0)":
            sys.exit(0)
        elif how == "sys.exit(1)":
            sys.exit(1)

    def ping(self):
        return "pong"


@pytest.mark.parametrize("how", ["exit_actor", "sys.exit(0)", "sys.exit(1)"])
def test_an_exit_in_init_follows_the_exit_rules_of_a_method(ray_env, tmp_path, how):
    """exit_actor() and sys.exit(0) in __init__ end the actor by intent: no restart (one
    __init__ run), its atexit handlers run, and calls raise ActorDiedError naming the exit,
    as on Ray.  sys.exit(1) there is a crash of its process: it restarts (max_restarts=1)
    and fails again, so __init__ ran twice."""
    path = str(tmp_path / "s")
    a = Starter.remote(path, how)
    said = {"exit_actor": r"exit_actor\(\)", "sys.exit(0)": r"sys\.exit\(\)",
            "sys.exit(1)": "exited with code 1 and it had used all its 1 restarts"}[how]
    with pytest.raises(ray.exceptions.ActorDiedError, match=said):
        ray.get(a.ping.remote(), timeout=T)
    with open(f"{path}.inits") as f:
        assert f.read() == ("xx" if how == "sys.exit(1)" else "x")
    if how != "sys.exit(1)":
        wait_until(lambda: os.path.exists(f"{path}.atexit"), T, "the atexit handler")


@ray.remote(num_cpus=0.1)
class Background:
    def __init__(self, path):
        atexit.register(lambda: open(path, "w").close())

    async def leave_soon(self):
        asyncio.get_running_loop().create_task(self._leave())
        return "started"

    async def _leave(self):
        await asyncio.sleep(0.1)
        ray.actor.exit_actor()

    async def ping(self):
        return "pong"


def test_exit_actor_in_a_background_asyncio_task_ends_the_actor(ray_env, tmp_path):
    """An asyncio task a method started belongs to the actor: exit_actor() there ends it
    by intent, as on Ray (its atexit handlers run, later calls raise ActorDiedError)."""
    path = tmp_path / "bg"
    a = Background.remote(str(path))
    assert ray.get(a.leave_soon.remote(), timeout=T) == "started"
    wait_until(path.exists, T, "the atexit handler")
    with pytest.raises(ray.exceptions.ActorDiedError, match=r"exit_actor\(\)"):
        ray.get(a.ping.remote(), timeout=T)


@ray.remote(num_cpus=0.1)
class Finder:
    def __init__(self, name):
        self.found = ray.get_actor(name)  # in the job's namespace, as its methods are
        self.ns = ray.get_runtime_context().namespace

    def seen(self):
        return ray.get(self.found.incr.remote()), self.ns


@pytest.mark.parametrize("light", [False, True], ids=["process", "light"])
def test_init_runs_in_the_actors_job_context(ray_env, light):
    """__init__ sees its job's namespace (get_actor finds a named actor of the job there),
    as Ray's does, not only the methods."""
    named = Unit.options(name="findme").remote()
    f = Finder.options(yrdask_light=light).remote("findme")
    ns = ray.get_runtime_context().namespace
    assert ray.get(f.seen.remote(), timeout=T) == (1, ns)
    for a in (f, named):
        ray.kill(a)


@pytest.mark.parametrize("light", [False, True], ids=["process", "light"])
def test_ray_kill_ends_the_actor_without_its_cleanup(ray_env, tmp_path, light):
    """ray.kill is Ray's force kill: the running call is cut short (ActorDiedError), and
    neither __ray_shutdown__ nor the atexit handlers run, though the grace period would
    allow them; __ray_terminate__ (above) runs both."""
    path = str(tmp_path / "k")
    a = Closer.options(yrdask_light=light).remote(path)
    ray.get(a.nap.remote(0), timeout=T)
    running = a.nap.remote(10)
    ray.kill(a)
    with pytest.raises(ray.exceptions.ActorDiedError, match="ray.kill"):
        ray.get(running, timeout=T)
    # ray.kill returns once the actor stopped: a graceful stop would have run them by now
    assert not os.path.exists(f"{path}.shutdown") and not os.path.exists(f"{path}.atexit")
