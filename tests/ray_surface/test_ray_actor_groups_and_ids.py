"""Actor behaviours that Ray's own actor tests rely on: a concurrency
group is not held up by a blocked default group, task ids inside actor methods, Ray's error
types for a bad namespace, ``ObjectRef._on_completed``.

Each test states the Ray behaviour it checks (learned from Ray's source and tests); waits
are rendezvous (files, refs), never sleeps.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import sys
import threading
import time
import weakref

import cloudpickle
import pytest

import yrdask.ray as ray
from conftest import wait_for_file, wait_until

cloudpickle.register_pickle_by_value(sys.modules[__name__])

pytestmark = pytest.mark.timeout(120)


@ray.remote(concurrency_groups={"side": 1})
class LoopBlocker:
    async def block_loop(self, path, started):
        # a blocking call inside an async method: the actor's own event loop stops
        open(started, "w").close()
        wait_for_file(path)
        return "released"

    @ray.method(concurrency_group="side")
    def side_sync(self):
        return threading.current_thread().name

    @ray.method(concurrency_group="side")
    async def side_async(self):
        return "side async"


def test_a_blocked_default_group_does_not_hold_up_other_groups(ray_env, tmp_path):
    # Ray gives each concurrency group its own executor: a call of another group runs while
    # the default group's event loop is blocked (Ray issue 20475)
    a = LoopBlocker.remote()
    release, started = str(tmp_path / "release"), str(tmp_path / "started")
    blocked = a.block_loop.remote(release, started)
    wait_until(lambda: os.path.exists(started), 60, "the blocking call to start")
    assert ray.get(a.side_sync.remote(), timeout=30) != threading.current_thread().name
    assert ray.get(a.side_async.remote(), timeout=30) == "side async"
    open(release, "w").close()
    assert ray.get(blocked, timeout=60) == "released"


@ray.remote
class Ids:
    def sync_ids(self):
        ctx = ray.get_runtime_context()
        return ctx.get_task_id(), ctx.get_task_id()

    async def async_ids(self):
        ctx = ray.get_runtime_context()
        return ctx.get_task_id(), ctx.get_task_id()


def test_actor_methods_have_a_task_id_of_their_own(ray_env):
    # Ray: get_task_id() inside an actor method is the id of that call (stable within it,
    # different for each call); in the driver it is None
    a = Ids.remote()
    calls = ray.get([a.sync_ids.remote(), a.sync_ids.remote(), a.async_ids.remote(),
                     a.async_ids.remote()])
    for first, again in calls:
        assert isinstance(first, str) and first
        assert first == again
    assert len({first for first, _ in calls}) == 4
    assert ray.get_runtime_context().get_task_id() is None


def test_ray_actor_id_is_the_actor_id(ray_env):
    # Ray's handle keeps its id as _ray_actor_id (what _actor_id returns); Ray's tests pass
    # its hex to the state API
    from yrdask.ray.util.state import get_actor
    a = Ids.remote()
    ray.get(a.sync_ids.remote())
    assert a._ray_actor_id.hex() == a._actor_id.hex()
    assert get_actor(id=a._ray_actor_id.hex()).state == "ALIVE"


@ray.remote(concurrency_groups={"io": 2})
class Mixed:
    def sync_call(self):
        return "sync"

    async def async_call(self):
        return "async"


def test_an_async_actor_with_groups_runs_sync_and_async_default_methods(ray_env):
    # Ray: an async actor's default group takes sync methods too, in any order with its
    # async ones (whichever kind is called first, the other still runs there)
    for first, then in (("sync_call", "async_call"), ("async_call", "sync_call")):
        a = Mixed.remote()
        assert ray.get([getattr(a, first).remote(), getattr(a, then).remote()], timeout=60) \
            == [first.split("_")[0], then.split("_")[0]]


@ray.remote
class Named:
    def ping(self):
        return "ok"


def test_namespace_of_a_wrong_type_is_a_type_error(ray_env):
    # Ray's validate_namespace: not a str -> TypeError; "" -> ValueError
    with pytest.raises(TypeError, match="namespace"):
        Named.options(name="n", namespace=object(), get_if_exists=True).remote()
    with pytest.raises(ValueError, match="not a valid namespace"):
        Named.options(name="n", namespace="").remote()
    with pytest.raises(TypeError, match="namespace"):
        ray.get_actor("n", namespace=1)


@ray.remote
def value_or_raise(fail):
    if fail:
        raise KeyError("boom")
    return 7


def test_on_completed_calls_back_with_the_value_or_the_error(ray_env):
    # Ray's ObjectRef._on_completed(callback): callback(value) once ready, the exception
    # object in place of the value if the task failed
    seen = {}
    ray.put(3)._on_completed(lambda v: seen.setdefault("put", v))
    value_or_raise.remote(False)._on_completed(lambda v: seen.setdefault("ok", v))
    value_or_raise.remote(True)._on_completed(lambda v: seen.setdefault("err", v))
    wait_until(lambda: len(seen) == 3, 60, lambda: f"callbacks seen: {seen}")
    assert seen["put"] == 3 and seen["ok"] == 7
    assert isinstance(seen["err"], KeyError)
    with pytest.raises(TypeError):
        ray.put(1)._on_completed("not callable")


@ray.remote
class Awaiter:
    async def await_failing(self):
        try:
            await value_or_raise.remote(True)
        except ray.exceptions.RayTaskError as e:
            return isinstance(e, KeyError)


def test_awaiting_a_failed_ref_raises_rays_error(ray_env):
    # Ray code awaiting a ref (a driver after ray.init, an async actor) gets Ray's error
    # types, as from ray.get: RayTaskError, also an instance of the task's exception
    async def driver():
        errors = []
        for awaitable in (value_or_raise.remote(True), value_or_raise.remote(True).as_future()):
            with pytest.raises(ray.exceptions.RayTaskError) as info:
                await awaitable
            errors.append(info.value)
        return errors

    assert all(isinstance(e, KeyError) for e in asyncio.run(driver()))
    assert isinstance(value_or_raise.remote(True).future().exception(60),
                      ray.exceptions.RayTaskError)
    assert ray.get(Awaiter.remote().await_failing.remote()) is True


def test_a_failing_on_completed_callback_is_not_kept_by_its_log_record(ray_env):
    # the error is logged; a handler that keeps records (pytest's capture, a memory
    # handler) must not keep the callback, its frames or the value alive through them
    records = []
    keeper = logging.Handler()
    keeper.emit = records.append
    logging.getLogger("yrdask").addHandler(keeper)
    try:
        def callback(value):
            raise RuntimeError("callback failed")

        kept = weakref.ref(callback)
        ray.put(3)._on_completed(callback)
        del callback
        wait_until(lambda: any("callback failed" in r.getMessage() for r in records), 60,
                   "the callback's error to be logged")
        wait_until(lambda: gc.collect() is not None and kept() is None, 30,
                   "the failed callback to be released")
    finally:
        logging.getLogger("yrdask").removeHandler(keeper)


# -- cancelling actor tasks ---------------------------------------------------------------------


@ray.remote
class Recorder:
    def __init__(self):
        self.called = False  # a value under the name of a method, as Ray's tests keep

    def called(self):
        self.called = True

    def was_called(self):
        return self.called


@ray.remote
class Sleeper:
    async def sleep(self, recorder, started):
        open(started, "w").close()
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:  # Ray: the running coroutine is cancelled
            ray.get(recorder.called.remote())
            raise
        return "slept"

    async def async_is_canceled(self):
        return ray.get_runtime_context().is_canceled()


@ray.remote
class SyncWaiter:
    def sync_wait(self, path, started=None, seen=None):
        if started:
            open(started, "w").close()
        if seen:  # until the cancel has reached this call (it goes on running)
            deadline = time.monotonic() + 60
            while not ray.get_runtime_context().is_canceled() and time.monotonic() < deadline:
                time.sleep(0.01)
            open(seen, "w").close()
        wait_for_file(path)
        return ray.get_runtime_context().is_canceled()


def test_a_value_on_the_actor_does_not_hide_its_method(ray_env):
    # Ray calls the class's method even where the instance holds a value of that name
    r = Recorder.remote()
    assert ray.get(r.__ray_ready__.remote()) is True
    assert ray.get(r.was_called.remote()) is False
    ray.get(r.called.remote())
    assert ray.get(r.was_called.remote()) is True


def test_cancel_of_a_running_async_actor_task(ray_env, tmp_path):
    # Ray: the coroutine gets CancelledError, and ray.get raises TaskCancelledError once the
    # actor is done with it (its except block has run)
    r, s = Recorder.remote(), Sleeper.remote()
    started = str(tmp_path / "started")
    ref = s.sleep.remote(r, started)
    wait_until(lambda: os.path.exists(started), 60, "the call to start")
    t0 = time.monotonic()
    ray.cancel(ref)
    with pytest.raises(ray.exceptions.TaskCancelledError, match="was cancelled"):
        ray.get(ref, timeout=30)
    assert time.monotonic() - t0 < 30
    assert ray.get(r.was_called.remote())
    # Ray refuses force for an actor task it still tracks (a finished one is a no-op there,
    # as here): one that cannot finish for a minute, so the answer cannot overtake the cancel
    with pytest.raises(ValueError, match="force=True is not supported for actor tasks"):
        ray.cancel(s.sleep.remote(r, str(tmp_path / "started-2")), force=True)
    ray.kill(s)  # leave the shared cluster idle for the next module
    ray.kill(r)


def test_cancel_of_a_sync_actor_task_sets_is_canceled(ray_env, tmp_path):
    # Ray: a running sync actor task goes on and sees is_canceled(); its result is dropped
    s = SyncWaiter.options(max_concurrency=2).remote()
    release = str(tmp_path / "release")
    started = str(tmp_path / "started")
    seen = str(tmp_path / "seen")
    running = s.sync_wait.remote(release, started, seen)
    other = s.sync_wait.remote(release)
    queued_ok = s.sync_wait.options(name="later").remote(release)
    wait_until(lambda: os.path.exists(started), 60, "the call to start")  # it runs: cancel it
    ray.cancel(running)
    # the cancel reaches the call, which sees is_canceled() and goes on; released only then
    # (a cancel that comes after the call returned is no cancel, as on Ray)
    wait_until(lambda: os.path.exists(seen), 60, "the call to see its cancel")
    open(release, "w").close()
    with pytest.raises(ray.exceptions.TaskCancelledError):
        ray.get(running, timeout=60)
    assert ray.get([other, queued_ok], timeout=60) == [False, False]
    # finished: cancelling it has no effect
    ray.cancel(other)
    assert ray.get(other) is False
    sleeper = Sleeper.remote()
    with pytest.raises(RuntimeError, match="not supported in an async actor"):
        ray.get(sleeper.async_is_canceled.remote(), timeout=60)
    ray.kill(sleeper)
    ray.kill(s)


@ray.remote
class Echo:
    def echo(self, x):
        return x


@ray.remote
def held(path):
    wait_for_file(path)
    return "first"


def test_allow_out_of_order_execution(ray_env, tmp_path):
    # Ray: False is refused for async and threaded actors (they never run in order);
    # True lets a sync actor's later call pass one whose argument is not ready yet
    with pytest.raises(ValueError, match="async actors"):
        Sleeper.options(allow_out_of_order_execution=False).remote()
    with pytest.raises(ValueError, match="multi-threaded actors"):
        Echo.options(max_concurrency=2, allow_out_of_order_execution=False).remote()
    a = Echo.options(allow_out_of_order_execution=True).remote()
    release = str(tmp_path / "release")
    first = a.echo.remote(held.remote(release))
    assert ray.get(a.echo.remote("second"), timeout=30) == "second"
    open(release, "w").close()
    assert ray.get(first, timeout=60) == "first"


class Boom(Exception):
    pass


@ray.remote(max_task_retries=2)
class Streamer:
    def __init__(self):
        self.runs = 0

    @ray.method(num_returns="streaming")
    async def stream(self, fail_runs):
        self.runs += 1
        run = self.runs
        yield 1
        if run <= fail_runs:
            raise Boom(f"run {run}")
        yield 2

    @ray.method(num_returns="streaming", retry_exceptions=[Boom])
    def sync_stream(self, fail_runs):
        self.runs += 1
        yield "a"
        if self.runs <= fail_runs:
            raise Boom(f"run {self.runs}")
        yield "b"

    def reset(self):
        self.runs = 0


def test_generator_methods_are_retried_after_listed_exceptions(ray_env):
    # Ray reruns a streaming actor task after an exception retry_exceptions names, up to
    # max_task_retries times; the caller does not see the items it already has again
    s = Streamer.remote()
    gen = s.stream.options(retry_exceptions=[Boom]).remote(2)
    assert [ray.get(r) for r in gen] == [1, 2]
    ray.get(s.reset.remote())
    gen = s.stream.options(retry_exceptions=[Boom]).remote(3)  # one failure too many
    assert ray.get(next(gen)) == 1
    with pytest.raises(Boom, match="run 3"):
        ray.get(next(gen))
    ray.get(s.reset.remote())
    gen = s.stream.remote(1)  # no retry_exceptions: no rerun
    assert ray.get(next(gen)) == 1
    with pytest.raises(Boom, match="run 1"):
        ray.get(next(gen))
    ray.get(s.reset.remote())
    assert [ray.get(r) for r in s.sync_stream.remote(2)] == ["a", "b"]  # @ray.method's
