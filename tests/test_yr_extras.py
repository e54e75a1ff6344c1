"""The rest of yr (yr_api §1.3, §1.9, §2, P14, P20): refs nested in task arguments gate the
task's start (yr's dependency resolver), ``__yr_shutdown__`` on terminate, ``real_id``,
``yr.exit()`` and ``yr.get_namespace()``.  On both core cluster kinds (``yr_cluster``)."""

from __future__ import annotations

import threading
import time
import uuid

import pytest

import yrdask as yr
from conftest import wait_for_file

pytestmark = pytest.mark.timeout(180)

T = 60  # seconds: explicit bounds, well under the test time-out


def uniq(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def absent(key: str) -> bool:
    try:
        yr.kv_read(key, 0)
        return False
    except yr.YRTimeoutError:
        return True


# -- nested refs ------------------------------------------------------------------------------


@yr.invoke
def slow(release: str, key: str) -> int:
    """Runs until the test creates ``release``; says so in the KV store before and after."""
    yr.kv_write(key + "-started", b"1")
    wait_for_file(release, T)
    yr.kv_write(key, b"done")
    return 41


def _probe(refs: list, key: str) -> tuple:
    """What the task sees when it starts: is ``slow`` done?  Then its nested ref's value."""
    seen = None if absent(key) else yr.kv_read(key, 0)
    assert isinstance(refs[0], yr.ObjectRef)  # nested refs still arrive as refs
    return seen, yr.get(refs[0], 5) + 1


probe = yr.invoke(_probe)


def test_a_task_starts_only_after_its_nested_refs_are_done(yr_cluster, tmp_path):
    key, release = uniq("slow"), str(tmp_path / "release")
    ref = slow.invoke(release, key)
    task = probe.invoke([ref], key)
    assert yr.kv_read(key + "-started", T) == b"1"  # slow runs; probe may not start yet
    open(release, "w").close()
    assert yr.get(task, T) == (b"done", 42)  # when probe started, slow had finished
    yr.kv_del([key, key + "-started"])


def test_nested_refs_in_dicts_and_kwargs_gate_too(yr_cluster, tmp_path):
    key, release = uniq("slow"), str(tmp_path / "release")
    ref = slow.invoke(release, key)
    task = probe_kw.invoke(key=key, box={"inner": (ref,)})
    yr.kv_read(key + "-started", T)
    open(release, "w").close()
    assert yr.get(task, T) == b"done"
    yr.kv_del([key, key + "-started"])


@yr.invoke
def probe_kw(key: str, box: dict) -> bytes | None:
    return None if absent(key) else yr.kv_read(key, 0)


def test_without_the_flag_nested_refs_are_not_waited_for(yr_cluster, tmp_path):
    """The internal submit flag the Ray surface turns off (Ray passes nested refs at once)."""
    key, release = uniq("slow"), str(tmp_path / "release")
    eager = yr.invoke(_seen_now)
    eager._wait_nested = False
    eager = eager.options(yr.InvokeOptions(cpu=300))  # the flag survives .options()
    ref = slow.invoke(release, key)
    try:
        assert yr.get(eager.invoke([ref], key), T) is None  # ran while slow still blocked
    finally:
        open(release, "w").close()
    assert yr.get(ref, T) == 41
    yr.kv_del([key, key + "-started"])


def _seen_now(refs: list, key: str) -> bytes | None:
    return None if absent(key) else yr.kv_read(key, 0)


class NestedBoom(Exception):
    pass


@yr.invoke
def fails() -> int:
    raise NestedBoom("the dependency broke")


@yr.invoke
def records_run(refs: list, key: str) -> int:
    yr.kv_write(key, b"ran")
    return 1


def test_a_failed_nested_ref_fails_the_task_with_a_dependency_error(yr_cluster):
    key = uniq("ran")
    bad = fails.invoke()
    task = records_run.invoke([1, {"x": bad}], key)
    with pytest.raises(yr.DependencyError) as e:
        yr.get(task, T)
    err = e.value
    assert err.dependency == bad.id and bad.id in str(err) and "records_run" in str(err)
    assert err.code == 4306 and "DEPENDENCY_FAILED" in str(err)
    assert isinstance(err, RuntimeError) and isinstance(err.cause, NestedBoom)
    assert isinstance(err, NestedBoom)  # `except NestedBoom` catches it, as for a top-level ref
    assert absent(key), "the task body ran although its nested dependency failed"
    # a top-level failed argument keeps yr's rule: the original error type
    with pytest.raises(NestedBoom):
        yr.get(records_run.invoke(bad, key), T)


# -- graceful shutdown ------------------------------------------------------------------------


@yr.instance
class Graceful:
    def __init__(self, key: str) -> None:
        self.key = key

    def ping(self) -> str:
        return "pong"

    def __yr_shutdown__(self, grace: int) -> None:
        yr.kv_write(self.key, f"shutdown after {grace} s at most".encode())


def test_terminate_runs_yr_shutdown_with_the_default_grace(yr_cluster):
    key = uniq("shutdown")
    h = Graceful.invoke(key)
    assert yr.get(h.ping.invoke(), T) == "pong"
    assert absent(key)
    h.terminate()  # asynchronous: the hook's KV write is the signal
    assert yr.kv_read(key, 30) == b"shutdown after 30 s at most"
    yr.kv_del(key)


def test_kill_instance_runs_the_hook_before_it_returns(yr_cluster):
    key = uniq("killed")
    h = Graceful.invoke(key)
    yr.get(h.ping.invoke(), T)
    yr.kill_instance(h.instance_id)  # synchronous: the instance is gone, its hook has run
    assert yr.kv_read(key, 0) == b"shutdown after 30 s at most"
    yr.kv_del(key)


@yr.instance
class SlowHook:
    def __init__(self, key: str) -> None:
        self.key = key

    def ping(self) -> str:
        return "pong"

    def __yr_shutdown__(self, grace: int) -> None:
        yr.kv_write(self.key, f"grace {grace}".encode())
        threading.Event().wait(60)  # overruns its grace: the stop must not wait for it


def test_custom_grace_period_bounds_the_hook(yr_cluster):
    key = uniq("slow")
    opts = yr.InvokeOptions(custom_extensions={"GRACEFUL_SHUTDOWN_TIME": "1"})
    h = SlowHook.options(opts).invoke(key)
    yr.get(h.ping.invoke(), T)
    t0 = time.monotonic()
    yr.kill_instance(h.instance_id)  # returns once the 1 s grace is over, not after 60 s
    assert time.monotonic() - t0 < 20
    assert yr.kv_read(key, 0) == b"grace 1"
    yr.kv_del(key)


def test_bad_grace_period_is_rejected_at_the_options():
    with pytest.raises(yr.YRValueError, match="GRACEFUL_SHUTDOWN_TIME"):
        yr.InvokeOptions(custom_extensions={"GRACEFUL_SHUTDOWN_TIME": "soon"})


@yr.instance
class NoHook:
    def ping(self) -> str:
        return "pong"


def test_an_instance_without_the_hook_stops_as_before(yr_cluster):
    h = NoHook.invoke()
    yr.get(h.ping.invoke(), T)
    h.terminate(is_sync=True)
    with pytest.raises(RuntimeError, match="terminated"):
        h.ping.invoke()


def test_bad_grace_period_is_a_typed_error():
    opts = yr.InvokeOptions()
    opts.custom_extensions["GRACEFUL_SHUTDOWN_TIME"] = "soon"
    from yrdask.api.instances import _grace_seconds

    with pytest.raises(yr.YRValueError, match="GRACEFUL_SHUTDOWN_TIME"):
        _grace_seconds(opts)


# -- real_id, exit, namespace -----------------------------------------------------------------


@yr.instance
class Leaver:
    def __init__(self) -> None:
        self.n = 0

    def add(self) -> int:
        self.n += 1
        return self.n

    def leave(self) -> str:
        yr.exit()
        return "not reached"


def test_real_id_is_the_id_of_the_instance_a_handle_reaches(yr_cluster):
    h = Leaver.invoke()
    assert h.real_id == h.instance_id
    name = uniq("named")
    first = Leaver.options(yr.InvokeOptions(name=name)).invoke()
    second = Leaver.options(yr.InvokeOptions(name=name)).invoke()  # binds the same instance
    assert second.real_id == first.real_id
    assert yr.get(second.add.invoke(), T) == 1 and yr.get(first.add.invoke(), T) == 2
    first.terminate(is_sync=True)
    h.terminate(is_sync=True)


def test_exit_ends_the_instance_from_inside(yr_cluster):
    h = Leaver.invoke()
    assert yr.get(h.add.invoke(), T) == 1
    with pytest.raises(yr.InstanceDiedError, match="yr.exit"):
        yr.get(h.leave.invoke(), T)
    with pytest.raises(RuntimeError):  # later calls fail too: the instance has ended
        yr.get(h.add.invoke(), T)


@yr.invoke
def exit_in_a_task() -> None:
    yr.exit()


def test_exit_outside_an_instance_is_a_typed_error(yr_cluster):
    with pytest.raises(yr.YRRuntimeError, match="inside a method of an instance"):
        yr.exit()
    with pytest.raises(RuntimeError, match="inside a method of an instance"):
        yr.get(exit_in_a_task.invoke(), T)


def test_get_namespace_is_the_default_namespace(yr_cluster):
    assert yr.get_namespace() == ""
