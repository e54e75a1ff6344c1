"""yrdask.ray actors on a real embedded cluster (SPEC §7): handles, kill, exit_actor, named
and detached actors, async actors, concurrency groups, ``ray.method``, ActorPool and Queue.

Concurrency is shown with rendezvous (events, barriers), never with timing.  Every test kills
the actors it names, and uses its own namespace, so tests do not see each other's actors.
"""

from __future__ import annotations

import asyncio
import sys
import threading

import cloudpickle
import pytest

import yrdask.ray as ray
from yrdask.ray.util import ActorPool, list_named_actors
from yrdask.ray.util.queue import Empty, Full, Queue

cloudpickle.register_pickle_by_value(sys.modules[__name__])

pytestmark = pytest.mark.timeout(120)


@ray.remote
class Counter:
    def __init__(self, start: int = 0):
        self.n = start

    def inc(self, k: int = 1) -> int:
        self.n += k
        return self.n

    @ray.method(num_returns=2)
    def pair(self):
        return self.n, -self.n

    def triple(self):
        return 1, 2, 3

    def bye(self):
        ray.actor.exit_actor()

    def whoami(self):
        ctx = ray.get_runtime_context()
        return ctx.get_actor_id(), ctx.namespace, ctx.get_assigned_resources()


@ray.remote
def bump(counter, k):
    return ray.get(counter.inc.remote(k))


def test_calls_run_in_order_and_handles_travel(ray_env):
    c = Counter.remote(10)
    assert ray.get([c.inc.remote() for _ in range(5)]) == [11, 12, 13, 14, 15]
    assert ray.get(bump.remote(c, 5)) == 20  # a handle passed to a task
    a, b = c.pair.remote()
    assert ray.get([a, b]) == [20, -20]
    x, y, z = c.triple.options(num_returns=3).remote()
    assert ray.get([x, y, z]) == [1, 2, 3]
    with pytest.raises(AttributeError, match="nope"):
        c.nope
    with pytest.raises(TypeError, match="remote"):
        c.inc()
    ray.kill(c)


def test_kill_fails_pending_and_later_calls(ray_env):
    c = Counter.remote()
    assert ray.get(c.inc.remote()) == 1
    ray.kill(c)
    with pytest.raises(ray.exceptions.ActorDiedError) as info:
        ray.get(c.inc.remote())
    assert isinstance(info.value, ray.exceptions.RayActorError)
    with pytest.raises(ValueError, match="ray.cancel"):
        ray.kill(ray.put(1))


def test_exit_actor_ends_the_actor(ray_env):
    c = Counter.remote()
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(c.bye.remote())
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(c.inc.remote(), timeout=60)
    with pytest.raises(TypeError, match="non-actor"):
        ray.actor.exit_actor()


class InitError(Exception):
    pass


@ray.remote
class BadInit:
    def __init__(self):
        raise InitError("no")

    def m(self):
        return 1


def test_failed_init_is_actor_died_for_every_call(ray_env):
    b = BadInit.remote()
    for _ in range(2):
        with pytest.raises(ray.exceptions.ActorDiedError, match="InitError"):
            ray.get(b.m.remote())


class MethodError(Exception):
    pass


@ray.remote
class Raiser:
    def m(self):
        raise MethodError("m")

    def ok(self):
        return "alive"


def test_method_error_keeps_the_actor(ray_env):
    r = Raiser.remote()
    with pytest.raises(MethodError) as info:
        ray.get(r.m.remote())
    assert isinstance(info.value, ray.exceptions.RayTaskError)
    assert ray.get(r.ok.remote()) == "alive"


def test_named_actors_in_namespaces(ray_env):
    c = Counter.options(name="c1").remote(1)
    same = ray.get_actor("c1")
    assert ray.get(same.inc.remote()) == 2
    assert list_named_actors() == ["c1"]
    assert {"name": "c1", "namespace": ray.get_runtime_context().namespace} in \
        list_named_actors(all_namespaces=True)
    other = Counter.options(name="c1", namespace="elsewhere").remote(100)
    assert ray.get(ray.get_actor("c1", namespace="elsewhere").inc.remote()) == 101
    with pytest.raises(ValueError, match="Failed to look up actor"):
        ray.get_actor("missing")
    again = Counter.options(name="c1", get_if_exists=True).remote(0)
    assert ray.get(again.inc.remote()) == 3  # the existing actor
    for handle in (c, other):
        ray.kill(handle)


def test_detached_actor_outlives_the_session_until_killed(ray_env):
    ns = ray.get_runtime_context().namespace
    d = Counter.options(name="keeper", lifetime="detached").remote(7)
    assert ray.get(d.inc.remote()) == 8
    ray.shutdown()
    ray.init(namespace=ns)
    again = ray.get_actor("keeper")
    assert ray.get(again.inc.remote()) == 9
    ray.kill(again)


def test_runtime_context_in_an_actor(ray_env):
    c = Counter.options(num_cpus=0.25).remote()
    actor_id, ns, resources = ray.get(c.whoami.remote())
    assert actor_id == c._actor_id.hex()
    assert ns == ray.get_runtime_context().namespace
    assert resources == {"CPU": 0.25}
    ray.kill(c)


@ray.remote
class AsyncActor:
    def __init__(self):
        self.event = None

    async def wait_for_partner(self):
        if self.event is None:
            self.event = asyncio.Event()
        await asyncio.wait_for(self.event.wait(), 60)
        return "released"

    async def release(self):
        if self.event is None:
            self.event = asyncio.Event()
        self.event.set()
        return "set"


def test_async_actor_runs_calls_concurrently(ray_env):
    a = AsyncActor.remote()
    waiting = a.wait_for_partner.remote()  # blocks until the next call runs
    assert ray.get(a.release.remote()) == "set"
    assert ray.get(waiting) == "released"

    async def main():
        return await a.release.remote()

    assert asyncio.run(main()) == "set"


@ray.remote(concurrency_groups={"io": 2})
class Grouped:
    def __init__(self):
        self.barrier = threading.Barrier(2, timeout=60)
        self.gate = threading.Event()

    @ray.method(concurrency_group="io")
    def io(self):
        self.barrier.wait()  # both io calls must run at once to pass
        return self.gate.wait(60)

    def compute(self):  # the default group: runs while the io group is busy
        self.gate.set()
        return "computed"


def test_concurrency_groups(ray_env):
    g = Grouped.remote()
    io1, io2 = g.io.remote(), g.io.remote()
    assert ray.get(g.compute.remote()) == "computed"
    assert ray.get([io1, io2]) == [True, True]
    ray.kill(g)

    with pytest.raises(ValueError, match="does not define"):
        @ray.remote(concurrency_groups={"io": 1})
        class Wrong:
            @ray.method(concurrency_group="cpu")
            def m(self):
                return 1
        Wrong.remote()


@ray.remote
class Square:
    def f(self, x):
        return x * x


def test_actor_pool(ray_env):
    actors = [Square.remote(), Square.remote()]
    pool = ActorPool(actors)
    assert list(pool.map(lambda a, v: a.f.remote(v), range(6))) == [0, 1, 4, 9, 16, 25]
    assert sorted(pool.map_unordered(lambda a, v: a.f.remote(v), range(5))) == [0, 1, 4, 9, 16]
    pool.submit(lambda a, v: a.f.remote(v), 3)
    pool.submit(lambda a, v: a.f.remote(v), 4)
    pool.submit(lambda a, v: a.f.remote(v), 5)  # waits for an idle actor
    assert not pool.has_free()
    assert [pool.get_next(), pool.get_next(), pool.get_next()] == [9, 16, 25]
    assert not pool.has_next() and pool.has_free()
    idle = pool.pop_idle()
    assert idle in actors
    with pytest.raises(ValueError, match="already"):
        pool.push(actors[0] if idle is actors[1] else actors[1])
    pool.push(idle)
    for a in actors:
        ray.kill(a)


@ray.remote
def consume(q, n):
    return [q.get(timeout=60) for _ in range(n)]


def test_queue(ray_env):
    q = Queue(maxsize=2)
    assert q.empty() and q.qsize() == 0
    q.put(1)
    q.put_nowait(2)
    assert q.full() and len(q) == 2
    with pytest.raises(Full):
        q.put_nowait(3)
    with pytest.raises(Full):
        q.put(3, timeout=0.1)
    assert q.get() == 1 and q.get_nowait() == 2
    with pytest.raises(Empty):
        q.get_nowait()
    with pytest.raises(Empty):
        q.get(timeout=0.1)
    q.put_nowait_batch([5, 6])
    assert q.get_nowait_batch(2) == [5, 6]
    with pytest.raises(Empty):
        q.get_nowait_batch(1)
    ref = consume.remote(q, 3)  # a task reads what the driver writes
    for i in range(3):
        q.put(i)
    assert ray.get(ref) == [0, 1, 2]
    q.shutdown()


@ray.remote(max_restarts=1, max_task_retries=1)
class Phoenix:
    def __init__(self):
        self.calls = 0

    def crash_once(self, path):
        import os

        if not os.path.exists(path):
            open(path, "w").close()
            os._exit(1)  # the actor's worker process dies
        self.calls += 1
        return self.calls


def test_max_restarts_brings_the_actor_back(ray_env, tmp_path):
    p = Phoenix.remote()
    # the call in flight is delivered again to the restarted actor (fresh __init__)
    assert ray.get(p.crash_once.remote(str(tmp_path / "died")), timeout=90) == 1
    assert ray.get(p.crash_once.remote(str(tmp_path / "died")), timeout=60) == 2
    ray.kill(p)


@ray.remote(max_restarts=1)
class Fragile:
    """max_task_retries left at Ray's default 0: a call running when the actor dies fails."""

    def crash(self):
        import os

        os._exit(1)

    def ping(self):
        return "pong"


def test_default_max_task_retries_fails_the_running_call_and_the_actor_restarts(ray_env):
    f = Fragile.remote()
    assert ray.get(f.ping.remote(), timeout=60) == "pong"
    with pytest.raises(ray.exceptions.ActorUnavailableError, match="not delivered again") as err:
        ray.get(f.crash.remote(), timeout=90)  # run once: it is not sent to the new actor
    # Ray's words for a call its actor's crash cut short while the actor restarts: it is
    # temporarily unavailable (a RayActorError), not dead
    assert isinstance(err.value, ray.exceptions.RayActorError)
    assert "temporarily unavailable" in str(err.value)
    assert "may or may not have been executed" in str(err.value)
    assert "is dead" not in str(err.value)
    assert ray.get(f.ping.remote(), timeout=90) == "pong"  # the one restart is still there
    ray.kill(f)


@ray.remote(max_retries=1)
def crash_every_time(path):
    import os

    with open(path, "a") as f:
        f.write("x")
    os._exit(1)


@pytest.mark.parametrize("max_retries", [1, 4])
def test_max_retries_bounds_reruns_after_worker_crashes(ray_env, tmp_path, max_retries):
    runs = tmp_path / "runs"
    ref = crash_every_time.options(max_retries=max_retries).remote(str(runs))
    with pytest.raises(ray.exceptions.WorkerCrashedError):
        ray.get(ref, timeout=120)
    assert runs.read_text() == "x" * (max_retries + 1)  # above yrdask's default bound of 3
