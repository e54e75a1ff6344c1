"""``ray.cancel``: Ray's default (``recursive=True``) cancels the tasks the cancelled task
submitted too, and theirs; ``recursive=False`` leaves them running.  A cancelled actor task
settles as on Ray: a running ``async def`` method that catches ``asyncio.CancelledError``
gives what it returns or raises; one that lets it through, and a sync method, give
``TaskCancelledError``.  An actor task cancelled before it was sent (its actor not created
yet) never runs, on a light actor and on one in a process of its own.

The tasks leave files as they start, finish normally or end (``finally``), so the test
waits on files, never on sleeps.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time

import cloudpickle
import psutil
import pytest

import yrdask as yr
import yrdask.ray as ray
from conftest import wait_until

cloudpickle.register_pickle_by_value(sys.modules[__name__])

pytestmark = pytest.mark.timeout(120)


def _touch(folder, name):
    open(os.path.join(folder, name), "w").close()


@ray.remote(num_cpus=0)
def grandchild(folder):
    _touch(folder, "grandchild-started")
    try:
        while not os.path.exists(os.path.join(folder, "release")):
            time.sleep(0.02)
        _touch(folder, "grandchild-finished")
    finally:
        _touch(folder, "grandchild-ended")


@ray.remote(num_cpus=0)
def child(folder):
    ref = grandchild.remote(folder)
    _touch(folder, "child-started")
    try:
        return ray.get(ref)
    finally:
        _touch(folder, "child-ended")


@ray.remote(num_cpus=0)
def parent(folder):
    return ray.get(child.remote(folder))


def _started(folder):
    return all(os.path.exists(os.path.join(folder, f))
               for f in ("child-started", "grandchild-started"))


def test_a_recursive_cancel_cancels_the_tasks_children_and_theirs(ray_env, tmp_path):
    folder = str(tmp_path)
    ref = parent.remote(folder)
    wait_until(lambda: _started(folder), 60, "the child and grandchild to start")
    ray.cancel(ref)  # recursive=True: Ray's default
    with pytest.raises(ray.exceptions.TaskCancelledError):
        ray.get(ref, timeout=30)
    wait_until(lambda: os.path.exists(os.path.join(folder, "grandchild-ended")), 60,
               "the grandchild to be cancelled")
    assert os.path.exists(os.path.join(folder, "child-ended"))
    _touch(folder, "release")
    assert not os.path.exists(os.path.join(folder, "grandchild-finished"))


def test_a_cancel_that_is_not_recursive_leaves_the_children_running(ray_env, tmp_path):
    folder = str(tmp_path)
    ref = parent.remote(folder)
    wait_until(lambda: _started(folder), 60, "the child and grandchild to start")
    ray.cancel(ref, recursive=False)
    with pytest.raises(ray.exceptions.TaskCancelledError):
        ray.get(ref, timeout=30)
    _touch(folder, "release")  # the grandchild, still running, finishes normally
    wait_until(lambda: os.path.exists(os.path.join(folder, "grandchild-finished")), 60,
               "the grandchild to finish")


@yr.invoke(invoke_options=yr.InvokeOptions(cpu=0, memory=0))
def yr_child(folder):
    _touch(folder, "yr-child-started")
    try:
        while True:
            time.sleep(0.02)
    finally:
        _touch(folder, "yr-child-ended")


@yr.invoke(invoke_options=yr.InvokeOptions(cpu=0, memory=0))
def yr_parent(folder):
    return yr.get(yr_child.invoke(folder))


def test_yr_cancel_with_allow_recursive_cancels_the_children(ray_env, tmp_path):
    folder = str(tmp_path)
    ref = yr_parent.invoke(folder)
    wait_until(lambda: os.path.exists(os.path.join(folder, "yr-child-started")), 60,
               "the child to start")
    yr.cancel(ref, allow_recursive=True)
    wait_until(lambda: os.path.exists(os.path.join(folder, "yr-child-ended")), 60,
               "the child to be cancelled")


@ray.remote
class Cancellable:
    async def handles(self, folder, how):
        _touch(folder, f"{how}-started")
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            if how == "returns":
                return "caught"
            if how == "raises":
                raise ValueError("raised in the except block")
            raise
        return "slept"


@ray.remote
class SyncCancellable:
    def sync(self, folder):
        _touch(folder, "sync-started")
        while not ray.get_runtime_context().is_canceled():
            time.sleep(0.02)
        return "saw the cancel"


def _cancel_when_started(ref, folder, name):
    wait_until(lambda: os.path.exists(os.path.join(folder, f"{name}-started")), 60,
               f"{name} to start")
    ray.cancel(ref)


def test_a_cancelled_actor_task_settles_as_its_method_decides(ray_env, tmp_path):
    folder = str(tmp_path)
    c = Cancellable.remote()
    ref = c.handles.remote(folder, "returns")
    _cancel_when_started(ref, folder, "returns")
    assert ray.get(ref, timeout=60) == "caught"  # Ray: the value of a caught cancel
    ref = c.handles.remote(folder, "raises")
    _cancel_when_started(ref, folder, "raises")
    with pytest.raises(ray.exceptions.RayTaskError, match="raised in the except block"):
        ray.get(ref, timeout=60)
    ref = c.handles.remote(folder, "reraises")
    _cancel_when_started(ref, folder, "reraises")
    with pytest.raises(ray.exceptions.TaskCancelledError):
        ray.get(ref, timeout=60)
    ray.kill(c)
    s = SyncCancellable.remote()
    ref = s.sync.remote(folder)  # a sync method runs on; its value is dropped (Ray)
    _cancel_when_started(ref, folder, "sync")
    with pytest.raises(ray.exceptions.TaskCancelledError):
        ray.get(ref, timeout=60)
    ray.kill(s)


@ray.remote
class Parent:
    async def run_async(self, folder):
        return await child.remote(folder)


@ray.remote
class SyncParent:
    def run(self, folder):
        return ray.get(child.remote(folder))


@pytest.mark.parametrize("kind", ["async", "sync"])
def test_a_recursive_cancel_of_an_actor_task_cancels_the_tasks_it_submitted(ray_env, tmp_path,
                                                                            kind):
    # Ray: recursive=True (the default) reaches the tasks an actor task submitted too
    folder = str(tmp_path)
    # light actors (pinned): a recursive cancel does not reach yet the tasks a process
    # actor submitted (docs/migrating-from-ray.md, ray.cancel)
    actor = (Parent if kind == "async" else SyncParent).options(yrdask_light=True).remote()
    ref = actor.run_async.remote(folder) if kind == "async" else actor.run.remote(folder)
    wait_until(lambda: _started(folder), 60, "the child and grandchild to start")
    ray.cancel(ref)
    with pytest.raises(ray.exceptions.TaskCancelledError):
        ray.get(ref, timeout=60)
    wait_until(lambda: os.path.exists(os.path.join(folder, "grandchild-ended")), 60,
               "the grandchild to be cancelled")
    _touch(folder, "release")
    assert not os.path.exists(os.path.join(folder, "grandchild-finished"))
    ray.kill(actor)


@ray.remote
class Holder:
    """Keeps what it is given (a ref inside a list stays a ref) for the test to read."""

    def __init__(self):
        self.kept = None

    def keep(self, box):
        self.kept = box

    def get(self):
        return self.kept


@ray.remote(num_cpus=0)
def calls_an_actor(folder, actor, holder):
    ref = actor.handles.remote(folder, "reraises")
    ray.get(holder.keep.remote([ref]))
    return ray.get(ref)


def test_a_recursive_cancel_cancels_the_actor_tasks_a_task_submitted(ray_env, tmp_path):
    # Ray's CancelChildren cancels a child actor task too (never by force): here a running
    # async method, which lets the CancelledError through
    folder = str(tmp_path)
    actor, holder = Cancellable.remote(), Holder.remote()
    ref = calls_an_actor.remote(folder, actor, holder)
    wait_until(lambda: os.path.exists(os.path.join(folder, "reraises-started")), 60,
               "the actor task to start")
    # (the task hands the ref to the holder right after the call starts: it may not be there yet)
    (child_ref,) = wait_until(lambda: ray.get(holder.get.remote(), timeout=30), 30,
                              "the task to hand its actor call's ref to the holder")
    ray.cancel(ref)
    with pytest.raises(ray.exceptions.TaskCancelledError):
        ray.get(ref, timeout=30)
    with pytest.raises(ray.exceptions.TaskCancelledError):
        ray.get(child_ref, timeout=30)  # it would sleep 60 s if not cancelled
    ray.kill(actor)
    ray.kill(holder)


@ray.remote(num_cpus=0)
def held(folder):
    """A value that comes only once the test writes ``release``."""
    while not os.path.exists(os.path.join(folder, "release")):
        time.sleep(0.02)
    return "released"


@ray.remote(num_cpus=0)
def blocked_on(box, folder, name, how):
    """Blocks in ``ray.get`` or ``ray.wait`` on the ref in ``box``; notes its start and its
    end (a ``finally`` runs only in a process that goes on)."""
    with open(os.path.join(folder, f"{name}-pid.part"), "w") as f:
        f.write(str(os.getpid()))
    os.replace(os.path.join(folder, f"{name}-pid.part"), os.path.join(folder, f"{name}-pid"))
    _touch(folder, f"{name}-started")
    try:
        if how == "get":
            return ray.get(box[0])
        return len(ray.wait(box)[0])
    finally:
        _touch(folder, f"{name}-ended")


@pytest.mark.parametrize("force,how", [(True, "get"), (False, "wait")])
def test_a_cancel_ends_a_task_blocked_on_a_value_in_its_own_process(ray_env, tmp_path,
                                                                    force, how):
    # the thread blocked in ray.get / ray.wait is in C, where the interrupt of a cancel never
    # lands: its wait ends instead, so the task stops at once and a forced cancel does not
    # have to end the worker process (with its other tasks: `other`, blocked beside it)
    folder = str(tmp_path)
    gate = held.remote(folder)
    ref = blocked_on.remote([gate], folder, "cancelled", how)
    other = blocked_on.remote([gate], folder, "other", how)
    wait_until(lambda: all(os.path.exists(os.path.join(folder, f"{n}-started"))
                           for n in ("cancelled", "other")), 60, "both tasks to block")
    ray.cancel(ref, force=force)
    with pytest.raises(ray.exceptions.TaskCancelledError):
        ray.get(ref, timeout=30)
    wait_until(lambda: os.path.exists(os.path.join(folder, "cancelled-ended")), 30,
               "the cancelled task to end in its process (its finally ran)")
    assert not os.path.exists(os.path.join(folder, "other-ended"))
    with open(os.path.join(folder, "cancelled-pid")) as f:
        proc = psutil.Process(int(f.read()))
    until = time.monotonic() + 2.0  # an absence: watched for 4x the agent's 0.5 s grace
    while time.monotonic() < until:
        assert proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
        time.sleep(0.05)
    _touch(folder, "release")
    assert ray.get(other, timeout=60) == ("released" if how == "get" else 1)


@ray.remote(num_cpus=0)
def opens_when(folder, name, fails=False):
    """An argument that is ready once the test writes ``name`` in ``folder`` (``fails``:
    then it fails)."""
    wait_until(lambda: os.path.exists(os.path.join(folder, name)), 60, f"the test's {name}",
               interval=0.01)
    if fails:
        raise ValueError(f"{name} failed")
    return name


@ray.remote(num_cpus=0)
class Recorder:
    """Records each call it runs as a file.  Its process switches threads every
    microsecond meanwhile, so a call that reached it idle would begin before a cancel
    that followed it were read (the window of a cancel sent behind its call)."""

    def __init__(self, folder, after=None):
        self.folder = folder
        self.interval = sys.getswitchinterval()
        sys.setswitchinterval(1e-6)

    def record(self, name, after=None):
        _touch(self.folder, name)  # the method's side effect
        return name

    def restore(self):
        sys.setswitchinterval(self.interval)  # (a light actor's process is a worker's)


def _cancel_ten_then_open(actor, folder, name):
    """Ten calls of ``actor`` that wait in their caller, cancelled: each fails at once.
    Then one left alone, sent after them once the test writes ``name``; what it gives."""
    cancelled = [actor.record.remote(f"ran-{name}-{i}") for i in range(10)]
    for ref in cancelled:
        ray.cancel(ref)
    for ref in cancelled:  # at once: none of them has left
        with pytest.raises(ray.exceptions.TaskCancelledError):
            ray.get(ref, timeout=30)
    kept = actor.record.remote(f"kept-{name}")
    _touch(folder, name)
    return ray.get(kept, timeout=60)


@pytest.mark.parametrize("light", [True, False], ids=["light", "process"])
def test_an_actor_task_cancelled_before_it_was_sent_never_runs(ray_env, tmp_path, light):
    # Ray: an actor task cancelled before it is sent never runs.  Its calls wait in their
    # caller while the actor is created (its creation waits for an argument: three actors,
    # one after another), then behind a call whose argument fails (it fails in its caller,
    # unsent, and the ones behind it go on: five times).  None of the cancelled calls
    # reaches an actor; the calls left alone run.  (Eight rounds: each a window for a call
    # that did reach its actor to begin before a cancel sent behind it.)
    names = []
    for k in range(3):
        folder = str(tmp_path / str(k))
        os.mkdir(folder)
        actor = Recorder.options(yrdask_light=light).remote(
            folder, opens_when.remote(folder, "open-0"))
        try:
            assert _cancel_ten_then_open(actor, folder, "open-0") == "kept-open-0"
            for j in range(1, 2 if k < 2 else 4):
                held = actor.record.remote("held",
                                           opens_when.remote(folder, f"open-{j}", True))
                assert _cancel_ten_then_open(actor, folder, f"open-{j}") == f"kept-open-{j}"
                with pytest.raises(ValueError, match=f"open-{j} failed"):
                    ray.get(held, timeout=30)
        finally:
            ray.get(actor.restore.remote(), timeout=60)
            ray.kill(actor)
        names += sorted(os.listdir(folder))
    rounds = (2, 2, 4)
    assert names == [name for n in rounds for name in sorted(  # no cancelled call ran
        [f"kept-open-{j}" for j in range(n)] + [f"open-{j}" for j in range(n)])]
