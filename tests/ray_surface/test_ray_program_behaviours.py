"""yrdask.ray behaviours that real Ray programs and Ray's own tests rely on:
per-call method options, ``cancel(force=True)``, runtime context names, Ray's error types,
async-actor ordering, concurrency groups, ActorPool, dynamic generators.

Each test states the Ray behaviour it checks (learned from Ray's source and tests); waits
are rendezvous (events, files, refs), never sleeps.
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import time
import uuid

import cloudpickle
import pytest

import yrdask.ray as ray
from conftest import wait_for_file, wait_until

cloudpickle.register_pickle_by_value(sys.modules[__name__])

pytestmark = pytest.mark.timeout(120)


# -- per-call method options ------------------------------------------------------------------


@ray.remote
class Flaky:
    def __init__(self):
        self.tries = {}

    def fail_until(self, key, n):
        """Raises ValueError the first ``n`` times it is called with ``key``."""
        self.tries[key] = self.tries.get(key, 0) + 1
        if self.tries[key] <= n:
            raise ValueError(f"try {self.tries[key]}")
        return self.tries[key]



@ray.remote(concurrency_groups={"io": 1})
class Grouped:
    def thread(self):
        return threading.current_thread().name


def test_per_call_retry_options_override_the_methods(ray_env):
    f = Flaky.remote()
    # Ray: actor.method.options(max_task_retries=, retry_exceptions=) holds for that call
    retried = f.fail_until.options(max_task_retries=2, retry_exceptions=[ValueError])
    assert ray.get(retried.remote("a", 2)) == 3
    with pytest.raises(ValueError, match="try 1"):  # the method itself does not retry
        ray.get(f.fail_until.remote("b", 1))
    with pytest.raises(ValueError, match="try 2"):  # one retry is not enough for two failures
        ray.get(f.fail_until.options(max_task_retries=1, retry_exceptions=True).remote("c", 2))
    with pytest.raises(ValueError, match="try 1"):  # only the listed exception types retry
        ray.get(f.fail_until.options(max_task_retries=3,
                                     retry_exceptions=[KeyError]).remote("d", 1))
    with pytest.raises(TypeError):  # the signature is still checked at the call
        retried.remote("e")


def test_per_call_concurrency_group(ray_env):
    g = Grouped.remote()
    assert ray.get(g.thread.options(concurrency_group="io").remote())
    with pytest.raises(ValueError, match="no such concurrency group"):
        ray.get(g.thread.options(concurrency_group="nope").remote())


# -- cancel(force=True) -------------------------------------------------------------------------


@ray.remote
def blocked_in_c(path):
    with open(path, "a") as f:
        f.write("x")
    time.sleep(600)  # in C: no Python bytecode runs, so no exception can reach it


@ray.remote
def quick():
    return "ran"


def test_force_cancel_ends_the_worker_process_of_a_task_blocked_in_c(ray_env, tmp_path):
    marks = [tmp_path / "a", tmp_path / "b"]
    refs = [blocked_in_c.remote(str(m)) for m in marks]  # both CPUs of the cluster
    for m in marks:
        wait_for_file(str(m))
    for ref in refs:
        ray.cancel(ref, force=True)
    for ref in refs:
        with pytest.raises(ray.exceptions.TaskCancelledError):
            ray.get(ref, timeout=10)  # at once, not after the sleep
    # the CPUs are free: a new task runs now (it would wait 600 s behind the sleepers)
    assert ray.get(quick.remote(), timeout=60) == "ran"
    # a forced cancel is not a crash of the task: it is not run again on the new process
    assert [m.read_text() for m in marks] == ["x", "x"]
    # the nannies' fresh processes join: the cluster is whole again for the next tests
    wait_until(lambda: ray.available_resources().get("CPU") == 2, 60, "both CPUs back")


# -- names Ray programs use ---------------------------------------------------------------------


@ray.remote(num_returns=3)
def three_yields(n):
    for i in range(n):
        yield i * 10


def test_int_num_returns_on_a_generator_function(ray_env):
    # Ray: the yielded values are the returns; another count is the task's ValueError
    assert ray.get(list(three_yields.remote(3))) == [0, 10, 20]
    with pytest.raises(ValueError, match="returned 2 objects, but num_returns=3"):
        ray.get(three_yields.remote(2)[0])


@ray.remote
def names():
    ctx = ray.get_runtime_context()
    return ctx.get_task_name(), ctx.get_task_function_name(), ctx.is_canceled()


@ray.remote
def note_cancel(start, out):
    open(start, "w").close()
    try:
        while True:
            time.sleep(0.01)
    except BaseException:  # the cancel lands here; the task may still look at its context
        with open(out + ".part", "w") as f:
            f.write(str(ray.get_runtime_context().is_canceled()))
        os.replace(out + ".part", out)  # whole: the test reads it as soon as it exists
        raise


@ray.remote
class Named:
    def names(self):
        ctx = ray.get_runtime_context()
        return ctx.get_task_name(), ctx.get_task_function_name()

    async def async_names(self):
        return ray.get_runtime_context().get_task_name()


def test_runtime_context_names_and_ids(ray_env, tmp_path):
    mod = __name__
    assert ray.get(names.remote()) == ("names", f"{mod}.names", False)
    assert ray.get(names.options(name="custom").remote())[0] == "custom"
    a = Named.remote()
    assert ray.get(a.names.remote()) == ("Named.names", f"{mod}.Named.names")
    assert ray.get(a.async_names.remote()) == "Named.async_names"
    assert ray.get(a.names.options(name="renamed").remote())[0] == "renamed"
    ctx = ray.get_runtime_context()
    assert ctx.get_task_name() is None
    with pytest.warns(DeprecationWarning, match="Use get_node_id"):  # Ray's deprecated form
        assert ctx.node_id.hex() == ctx.get_node_id()
    # in a driver, Ray's get() leaves task_id and actor_id out rather than None
    assert set(ctx.get()) == {"job_id", "node_id", "namespace"}
    start, out = tmp_path / "started", tmp_path / "out"
    ref = note_cancel.remote(str(start), str(out))
    wait_for_file(str(start))
    ray.cancel(ref)
    wait_for_file(str(out))
    assert out.read_text() == "True"
    ray.kill(a)


def test_actor_proxy_job_config_and_max_concurrency(ray_env):
    from yrdask.ray.actor import ActorProxy

    handle: ActorProxy[Named] = Named.options(max_concurrency=5000).remote()  # Ray: no bound
    hint = ray.actor.ActorClass[Named]  # the class's type in hints, as Ray's actors page
    assert hint.__origin__ is ray.actor.ActorClass and hint.__args__ == (Named,)
    assert ray.ObjectRef[int].__origin__ is ray.ObjectRef  # `ref: ray.ObjectRef[int] = ...`
    assert isinstance(handle, ActorProxy)
    assert ray.get(handle.names.remote())[0] == "Named.names"
    ray.kill(handle)
    ns = f"jc-{uuid.uuid4().hex[:6]}"
    ray.shutdown()
    ray.init(job_config=ray.job_config.JobConfig(ray_namespace=ns))
    assert ray.get_runtime_context().namespace == ns
    with pytest.raises(ray.exceptions.UnsupportedOptionError, match="metadata"):
        ray.job_config.JobConfig(metadata={"a": "b"})


def test_code_search_path_lets_workers_load_the_jobs_modules(ray_env, tmp_path):
    # a function and a class of a module that only the job's code_search_path holds travel
    # by reference (cloudpickle pickles an importable module's names so): the worker and
    # the actor's process import the module from that directory, as Ray's workers do from
    # their PYTHONPATH
    import importlib

    name = f"codepath_mod_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(
        "def tripled(x):\n    return x * 3\n\n\n"
        "class Keeper:\n    def module(self):\n        return __name__\n")
    sys.path.insert(0, str(tmp_path))
    try:
        mod = importlib.import_module(name)
    finally:
        sys.path.remove(str(tmp_path))
    ray.shutdown()
    ray.init(job_config=ray.job_config.JobConfig(code_search_path=[str(tmp_path)]))
    assert ray.get(ray.remote(mod.tripled).remote(2)) == 6
    keeper = ray.remote(mod.Keeper).remote()
    assert ray.get(keeper.module.remote()) == name
    ray.kill(keeper)
    with pytest.raises(TypeError, match="code search path"):
        ray.job_config.JobConfig(code_search_path="not a list")


# -- Ray's error types and wording -------------------------------------------------------------


def test_errors_typed_and_worded_as_rays(ray_env, tmp_path):
    from yrdask.ray.util.queue import Queue

    with pytest.raises(TypeError, match="name must be None or a string"):
        Named.options(name=5).remote()
    with pytest.raises(ValueError, match="cannot be an empty string"):
        Named.options(name="").remote()
    with pytest.raises(TypeError):
        Queue(maxsize="3")
    q = Queue()
    with pytest.raises(TypeError, match="Iterable"):
        q.put_nowait_batch(5)
    q.put_nowait_batch(iter([1, 2]))  # any iterable, as on Ray
    with pytest.raises(TypeError, match="must be an int"):
        q.get_nowait_batch("2")
    assert q.get_nowait_batch(2) == [1, 2]
    q.shutdown()
    gate = tmp_path / "gate"
    slow = value_after.remote(str(gate), 1)
    with pytest.raises(ray.exceptions.GetTimeoutError, match="timeout=None"):
        ray.get(slow, timeout=0.1)
    gate.touch()
    assert ray.get(slow) == 1
    a = Named.remote()
    ray.get(a.names.remote())
    ray.kill(a)
    with pytest.raises(ray.exceptions.ActorDiedError,
                       match=r"(?s)The actor is dead because.*class_name: Named"):
        ray.get(a.names.remote())


def test_available_resources_leave_out_what_is_used_up(ray_env):
    hogs = [Named.options(num_cpus=1).remote() for _ in range(2)]  # both workers' CPU
    ray.get([h.names.remote() for h in hogs])
    assert "CPU" not in ray.available_resources()
    assert ray.cluster_resources()["CPU"] == 2
    for h in hogs:
        ray.kill(h)


# -- ActorPool, dynamic generators --------------------------------------------------------------


@ray.remote
class Echo:
    def echo(self, v):
        return v


def test_actor_pool_map_unordered_drops_earlier_unread_submissions(ray_env):
    from yrdask.ray.util import ActorPool

    pool = ActorPool([Echo.remote()])
    pool.submit(lambda a, v: a.echo.remote(v), "earlier")
    assert sorted(pool.map_unordered(lambda a, v: a.echo.remote(v), [1, 2])) == [1, 2]
    pool.submit(lambda a, v: a.echo.remote(v), "earlier")
    assert list(pool.map(lambda a, v: a.echo.remote(v), [3, 4])) == [3, 4]
    # a call of several returns (a list of refs) is one submission, as on Ray
    pairs = pool.map(lambda a, v: a.echo.options(num_returns=2).remote((v, -v)), [5, 6])
    assert list(pairs) == [[5, -5], [6, -6]]


@ray.remote(num_returns="dynamic")
def two_then_fail():
    yield 1
    yield 2
    raise KeyError("third")


def test_dynamic_generator_that_raised_gives_its_refs_and_an_error_ref(ray_env):
    import gc

    import distributed

    from yrdask.runtime.context import current_runtime

    refs = list(ray.get(two_then_fail.remote()))
    assert len(refs) == 3
    assert ray.get(refs[:2]) == [1, 2]
    with pytest.raises(KeyError) as info:
        ray.get(refs[2])
    # the worker dropped the error's live traceback (below), not what the user sees
    assert isinstance(info.value, ray.exceptions.RayTaskError)
    text = str(info.value)
    assert "Traceback" in text and "two_then_fail" in text and "KeyError: 'third'" in text
    del info
    # once the driver, which owns them, lets go, no process keeps any of the three (the
    # error's live traceback held the generator's frame, and so the refs, for good)
    ids = {r.hex() for r in refs}
    del refs
    gc.collect()

    def kept(ids: set) -> list:
        from yrdask.runtime.context import installed_runtime

        return sorted(ids & set(installed_runtime().objects.entries))

    with distributed.Client(current_runtime().info.scheduler_address, set_as_default=False,
                            timeout=30) as client:
        wait_until(lambda: not any(client.run(kept, ids).values()), 30,
                   lambda: f"the dynamic generator's refs freed: {client.run(kept, ids)}")


# -- ray.init() and python -m yrdask.ray ---------------------------------------------------------


def test_init_joins_ray_address(monkeypatch):
    from yrdask.ray._session import _address

    monkeypatch.setenv("RAY_ADDRESS", "tcp://10.0.0.1:8786")
    assert _address(None) == "tcp://10.0.0.1:8786"  # Ray: ray.init() joins RAY_ADDRESS
    assert _address("auto") == "tcp://10.0.0.1:8786"
    assert _address("local") == ""
    monkeypatch.setenv("RAY_ADDRESS", "auto")
    monkeypatch.delenv("YR_SERVER_ADDRESS", raising=False)
    with pytest.raises(ConnectionError):
        _address(None)


def test_python_m_yrdask_ray_takes_a_module_and_code(tmp_path):
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), root,
                                                       os.environ.get("PYTHONPATH", "")]))
    env.pop("YR_SERVER_ADDRESS", None)
    env.pop("RAY_ADDRESS", None)
    (tmp_path / "prog.py").write_text(
        "import sys, ray\nfrom ray.util import ActorPool\nprint(sys.argv[1:], ray.__name__)\n")
    out = subprocess.run([sys.executable, "-m", "yrdask.ray", "-m", "prog", "x"], env=env,
                         capture_output=True, text=True, timeout=60, cwd=str(tmp_path))
    assert out.returncode == 0 and out.stdout.strip() == "['x'] yrdask.ray", out.stderr[-2000:]
    out = subprocess.run([sys.executable, "-m", "yrdask.ray", "-c",
                          "import sys, ray; print(sys.argv, ray.__name__)", "y"], env=env,
                         capture_output=True, text=True, timeout=60, cwd=str(tmp_path))
    assert out.returncode == 0 and out.stdout.strip() == "['-c', 'y'] yrdask.ray", out.stderr


# -- async actor ordering -----------------------------------------------------------------------


@ray.remote
def value_after(path, value):
    wait_for_file(path)
    return value


@ray.remote
class AsyncRecorder:
    def __init__(self):
        self.seen = []

    async def record(self, x):
        self.seen.append(x)
        return x

    async def seen_so_far(self):
        return self.seen


@ray.remote
class SyncRecorder:
    def __init__(self):
        self.seen = []

    def record(self, x):
        self.seen.append(x)
        return x

    def seen_so_far(self):
        return self.seen


def test_async_actor_runs_a_later_call_whose_argument_is_ready_first(ray_env, tmp_path):
    gate = tmp_path / "gate"
    a = AsyncRecorder.remote()
    first = a.record.remote(value_after.remote(str(gate), 2))
    assert ray.get(a.record.remote(3), timeout=60) == 3  # Ray prints 3 then 2
    gate.touch()
    assert ray.get(first) == 2 and ray.get(a.seen_so_far.remote()) == [3, 2]
    # a sync (single-threaded) actor keeps the caller's order, as on Ray
    gate2 = tmp_path / "gate2"
    s = SyncRecorder.remote()
    first = s.record.remote(value_after.remote(str(gate2), 2))
    second = s.record.remote(3)
    assert ray.wait([second], timeout=0.5) == ([], [second])
    gate2.touch()
    assert ray.get([first, second]) == [2, 3] and ray.get(s.seen_so_far.remote()) == [2, 3]


# -- concurrency groups -------------------------------------------------------------------------


@ray.remote(concurrency_groups={"io": 1, "compute": 2})
class AsyncGroups:
    def __init__(self):
        self.release = None

    @ray.method(concurrency_group="io")
    async def hold(self):
        self.release = asyncio.Event()  # on the io group's loop
        self.loop = asyncio.get_running_loop()
        await self.release.wait()
        return threading.current_thread().name

    @ray.method(concurrency_group="compute")
    def sync_in_group(self):  # Ray: a sync method of an async actor's group runs there
        return threading.current_thread().name

    @ray.method(concurrency_group="compute")
    async def let_go(self):
        self.loop.call_soon_threadsafe(self.release.set)
        return threading.current_thread().name

    async def default(self):
        return threading.current_thread().name


@ray.remote(concurrency_groups={"io": 1}, max_concurrency=1)
class ThreadedGroups:
    @ray.method(concurrency_group="io")
    def io(self, path):
        wait_for_file(path)
        return threading.current_thread().name

    def default(self):
        return threading.current_thread().name


def test_each_concurrency_group_has_its_own_executor(ray_env, tmp_path):
    a = AsyncGroups.remote()
    assert ray.get(a.default.remote())  # constructed
    held = a.hold.remote()  # occupies io, the only slot of its group
    names = ray.get([a.sync_in_group.remote(), a.default.remote()], timeout=30)
    assert names[0].startswith("ray-group-compute") and not names[1].startswith("ray-group")
    assert ray.get(a.let_go.remote(), timeout=30).startswith("ray-group-compute")
    assert ray.get(held, timeout=30).startswith("ray-group-io")
    t = ThreadedGroups.remote()
    gate = tmp_path / "gate"
    blocked = t.io.remote(str(gate))  # io's one thread waits; the default group goes on
    assert not ray.get(t.default.remote(), timeout=30).startswith("ray-group-io")
    gate.touch()
    assert ray.get(blocked, timeout=30).startswith("ray-group-io")
    ray.kill(a)
    ray.kill(t)


# -- max_calls ----------------------------------------------------------------------------------


@ray.remote(max_calls=1)
def pid_once():
    return os.getpid()


def test_max_calls_recycles_the_process(ray_env):
    # Ray: the process ends after max_calls calls of the function; the next runs in a new one
    pids = [ray.get(pid_once.remote(), timeout=60) for _ in range(3)]
    assert len(set(pids)) == 3
    with pytest.raises(ValueError, match="max_calls"):
        pid_once.options(max_calls=-1).remote()


@ray.remote
class Batcher:
    """Ray's async-actor batching example: calls wait on a shared Event until a batch of
    ``size`` has started; the last of a batch sets it, the woken ones clear it."""

    def __init__(self, size: int) -> None:
        self.event, self.started, self.size = asyncio.Event(), 0, size

    async def run(self) -> int:
        self.started += 1
        if self.started == self.size:
            self.event.set()
        else:
            await self.event.wait()
            self.event.clear()
            self.started = 0
        return 1


def test_a_woken_call_resumes_before_the_next_queued_call_starts(ray_env):
    # with max_concurrency=2 the third call must not start before the first, woken by the
    # second's Event.set(), resumes: else it sees the Event still set and two calls end up
    # waiting on a cleared Event, holding both slots for ever (Ray runs it to the end)
    actor = Batcher.options(max_concurrency=2).remote(2)
    assert ray.get([actor.run.remote() for _ in range(8)], timeout=60) == [1] * 8
    ray.kill(actor)
