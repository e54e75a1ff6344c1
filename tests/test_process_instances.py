"""Process instances (docs/isolation.md): an instance is a process of its own by default
(``yrdask.instances.light`` false), forked from its worker's zygote.  Its environment, module
state and crash are its own, and the exit rules (docs/isolation.md#exit-rules) end or
restart that instance alone; light instances (``InvokeOptions(light=True)``) still share
their worker's process.

The embedded cluster has one worker process, so every instance is a neighbour of every other.
"""

from __future__ import annotations

import os
import sys
import time

import pytest

import yrdask as yr
from conftest import wait_until, wake_ups

pytestmark = pytest.mark.timeout(180)

T = 60
SETTING: dict = {}  # module state: one per process


def small(**kw) -> yr.InvokeOptions:
    return yr.InvokeOptions(cpu=50, memory=10, **kw)


@yr.instance
class Member:
    def __init__(self, i: int) -> None:
        self.i = i
        os.environ["YR_PROCESS_MODEL_VAR"] = str(i)
        SETTING["i"] = i

    def seen(self) -> tuple:
        return os.environ.get("YR_PROCESS_MODEL_VAR"), SETTING.get("i"), os.getpid()

    def incr(self) -> int:
        self.i += 1
        return self.i

    def crash(self) -> None:
        os._exit(9)

    def quit(self, *code: object) -> None:
        sys.exit(*code)

    def leave(self) -> None:
        yr.exit()

    def quit_once(self, marker: str, code: int) -> str:
        if not os.path.exists(marker):
            open(marker, "w").close()
            sys.exit(code)
        return "back"


@yr.instance
class AsyncMember:
    async def quit(self) -> None:
        sys.exit()

    async def ping(self) -> str:
        return "pong"


def state(h) -> dict:
    return h.status()


def test_each_process_instance_sees_its_own_environment_and_module_state(cluster):
    """Six members that each set an environment variable and a module global in __init__
    read back their own values as process instances (the default: no light option), and
    their neighbours' as light ones (light=True: one shared worker process)."""
    cluster(kind="embedded", num_cpus=1)
    own = [Member.options(small()).invoke(i) for i in range(6)]
    seen = yr.get([h.seen.invoke() for h in own], T)
    assert [(env, mod) for env, mod, _pid in seen] == [(str(i), i) for i in range(6)], seen
    assert len({pid for _e, _m, pid in seen}) == 6  # six processes
    light = [Member.options(small(light=True)).invoke(10 + i) for i in range(6)]
    assert yr.get([h.incr.invoke() for h in light], T) == list(range(11, 17))  # all built
    shared = yr.get([h.seen.invoke() for h in light], T)
    assert len({pid for _e, _m, pid in shared}) == 1  # one worker process hosts them all
    (env, mod), = {(env, mod) for env, mod, _pid in shared}  # the last __init__'s, for all
    assert env == str(mod) and 10 <= mod < 16
    for h in own + light:
        h.terminate()


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads Linux's /proc")
def test_an_idle_process_instance_does_not_wake_up(cluster):
    """Once its calls are answered (and their batch for Dask's panels sent, which a call
    arms), a process instance's process sleeps until the next call: no timer of its own
    wakes it.  A periodic tick would cost each of hundreds of idle actors CPU all along."""
    cluster(kind="embedded", num_cpus=1)
    h = Member.options(small()).invoke(1)
    pid = yr.get(h.seen.invoke(), T)[2]
    time.sleep(0.6)  # the batch a call arms goes within 250 ms (dask_panels.FLUSH_MS)
    before = wake_ups(pid)
    time.sleep(1.5)  # an idle window: a 250 ms tick would wake it six times
    assert wake_ups(pid) - before <= 1
    assert yr.get(h.incr.invoke(), T) == 2  # and a call still wakes it
    h.terminate()


def test_process_instances_cost_their_worker_no_thread_each(cluster):
    """The worker agent learns each process's exit from its zygote's reports: supervising
    more process instances starts no thread per instance in the worker's process."""
    import psutil

    cluster(kind="embedded", num_cpus=1)
    first = Member.options(small()).invoke(0)
    pid = yr.get(first.seen.invoke(), T)[2]
    worker = psutil.Process(pid).parent().parent()  # the child's zygote's parent
    before = worker.num_threads()
    more = [Member.options(small()).invoke(i) for i in range(1, 9)]
    seen = yr.get([h.seen.invoke() for h in more], T)
    assert {psutil.Process(p).parent().parent().pid for _e, _m, p in seen} == {worker.pid}
    assert worker.num_threads() - before < 4  # 8 more instances; no thread each
    for h in [first, *more]:
        h.terminate()


def test_a_crash_restarts_that_process_instance_alone(cluster):
    """os._exit in one instance (a process, by default): it restarts per
    recover_retry_times (a fresh __init__); its process neighbour and the light instance on
    the same worker keep their state, and the worker process is the same."""
    cluster(kind="embedded", num_cpus=1)
    doomed = Member.options(small(recover_retry_times=2)).invoke(100)
    neighbour = Member.options(small()).invoke(200)
    light = Member.options(small(light=True)).invoke(300)
    assert yr.get([neighbour.incr.invoke(), light.incr.invoke()], T) == [201, 301]
    worker = yr.get(light.seen.invoke(), T)[2]
    before = yr.get(doomed.seen.invoke(), T)[2]
    poison = doomed.crash.invoke()
    after = doomed.incr.invoke()  # behind the poison: runs on a restarted process
    with pytest.raises(yr.CallCrashedError, match="exited with code 9"):
        yr.get(poison, T)  # ran twice (bound 1), two restarts
    assert yr.get(after, T) == 101
    assert yr.get(doomed.seen.invoke(), T)[2] != before
    assert state(doomed)["restarts"] == 2
    assert yr.get([neighbour.incr.invoke(), light.incr.invoke()], T) == [202, 302]
    assert yr.get(light.seen.invoke(), T)[2] == worker
    for h in (doomed, neighbour, light):
        h.terminate()


@pytest.mark.parametrize("light", [False, True])
@pytest.mark.parametrize("code", [(), (0,)])
def test_sys_exit_ends_the_instance_without_a_restart(cluster, light, code):
    """sys.exit() or sys.exit(0) in a method is an intended exit, as exit_actor() is: the
    instance ends although it has restarts left, the call and later ones fail with
    InstanceDiedError, and the neighbours live on (a light instance's worker too)."""
    cluster(kind="embedded", num_cpus=1)
    leaving = Member.options(small(light=light, recover_retry_times=3)).invoke(1)
    neighbour = Member.options(small(light=not light)).invoke(2)
    assert yr.get(leaving.incr.invoke(), T) == 2
    with pytest.raises(yr.InstanceDiedError, match=r"exited by sys\.exit\(\)"):
        yr.get(leaving.quit.invoke(*code), T)
    with pytest.raises(yr.InstanceDiedError, match=r"exited by sys\.exit\(\)"):
        yr.get(leaving.incr.invoke(), T)
    st = wait_until(lambda: (s := state(leaving))["state"] == "DEAD" and s, 30,
                    lambda: f"the instance DEAD at the scheduler: {state(leaving)}")
    assert not st["restarts"], st  # none, although it had three
    assert yr.get(neighbour.incr.invoke(), T) == 3
    neighbour.terminate()


def test_sys_exit_with_a_code_is_a_crash_of_a_process_instance(cluster, tmp_path):
    """sys.exit(3) in a process instance ends its process with code 3: a crash, so the
    restart rules apply (the call runs again on the restarted process)."""
    cluster(kind="embedded", num_cpus=1)
    h = Member.options(small(light=False, recover_retry_times=1)).invoke(1)
    neighbour = Member.options(small(light=False)).invoke(2)
    assert yr.get(h.quit_once.invoke(str(tmp_path / "once"), 3), T) == "back"
    st = state(h)
    assert st["state"] == "ALIVE" and st["restarts"] == 1, st
    assert yr.get(neighbour.incr.invoke(), T) == 3
    for x in (h, neighbour):
        x.terminate()


def test_sys_exit_in_an_async_method_ends_the_process_instance(cluster):
    cluster(kind="embedded", num_cpus=1)
    h = AsyncMember.options(small(light=False, recover_retry_times=1)).invoke()
    assert yr.get(h.ping.invoke(), T) == "pong"
    with pytest.raises(yr.InstanceDiedError, match=r"exited by sys\.exit\(\)"):
        yr.get(h.quit.invoke(), T)
    with pytest.raises(yr.InstanceDiedError, match=r"exited by sys\.exit\(\)"):
        yr.get(h.ping.invoke(), T)



@yr.invoke
def square(x: int) -> int:
    return x * x


@yr.instance
class Nester:
    """Makes nested calls from its own process: a task, another instance, a put and a get."""

    def fan(self, n: int) -> tuple:
        squares = yr.get([square.invoke(i) for i in range(n)], T)
        kid = Member.options(small()).invoke(7)
        kid_seen = yr.get(kid.seen.invoke(), T)
        kid.terminate()
        boxed = yr.get(yr.put(sum(squares)), T)
        return squares, boxed, kid_seen, os.getpid()


def test_a_process_instance_makes_nested_calls(cluster):
    """A default (process) instance submits tasks, creates and calls an instance of its own
    and puts and gets an object, through its own runtime; the child instance is a process
    apart from its creator's."""
    cluster(kind="embedded", num_cpus=1)
    h = Nester.options(small()).invoke()
    worker = Member.options(small(light=True)).invoke(0)
    squares, boxed, (env, mod, kid_pid), pid = yr.get(h.fan.invoke(4), T)
    assert squares == [0, 1, 4, 9] and boxed == 14
    assert (env, mod) == ("7", 7)
    worker_pid = yr.get(worker.seen.invoke(), T)[2]
    assert len({pid, kid_pid, worker_pid}) == 3, (pid, kid_pid, worker_pid)
    for x in (h, worker):
        x.terminate()


def test_yr_exit_ends_a_process_instance_without_a_restart(cluster):
    """yr.exit() in a method of a process instance is an intended exit: no restart although
    it has some left; the call and later ones fail, and its neighbour lives on."""
    cluster(kind="embedded", num_cpus=1)
    leaving = Member.options(small(recover_retry_times=2)).invoke(0)
    neighbour = Member.options(small()).invoke(5)
    assert yr.get(leaving.incr.invoke(), T) == 1
    with pytest.raises(yr.InstanceDiedError, match=r"yr\.exit\(\)"):
        yr.get(leaving.leave.invoke(), T)
    with pytest.raises(yr.InstanceDiedError, match=r"yr\.exit\(\)"):
        yr.get(leaving.incr.invoke(), T)
    st = wait_until(lambda: (s := state(leaving))["state"] == "DEAD" and s, 30,
                    lambda: f"the instance DEAD at the scheduler: {state(leaving)}")
    assert not st["restarts"], st
    assert yr.get(neighbour.incr.invoke(), T) == 6
    neighbour.terminate()


def _cycle_counter(*args: str) -> dict:
    """``python -m benchmarks.process_cycle`` in a process of its own (its own cluster)."""
    import json
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-m", "benchmarks.process_cycle", *args], cwd=root,
                         capture_output=True, text=True, timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_cycle_counter_puts_a_process_instance_s_cpu_in_its_own_process():
    """``benchmarks.process_cycle`` (docs/isolation.md, "Cost") counts a process instance's
    life in the zygote's reaped children and its worker; a light instance's has none there."""
    proc = _cycle_counter("8")
    cpu = proc["cpu_ms_per_cycle"]
    assert proc["kind"] == "process" and proc["cycles"] == 8
    assert cpu["instances"] > 0 and cpu["zygote"] > 0 and cpu["worker"] > 0, proc
    light = _cycle_counter("8", "--light")
    assert light["kind"] == "light"
    assert light["cpu_ms_per_cycle"]["instances"] == 0, light  # no process was forked
    # each process instance's life writes to hundreds of pages it shares with its zygote
    # (docs/isolation.md, "Where the copies come from"); a light one forks nothing
    assert proc["minor_faults_per_cycle"]["instances"] > 200, proc
    assert light["minor_faults_per_cycle"] == {"zygote": 0, "instances": 0}, light


def test_the_fork_floor_counts_one_copy_on_write_fault_per_shared_page_written():
    """``benchmarks.fork_floor``: a child that writes to N pages it shares with its parent
    takes at least N minor faults, and their CPU and a fork's are what it reports."""
    import json
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-m", "benchmarks.fork_floor", "--pages", "300",
                          "--forks", "5"], cwd=root, capture_output=True, text=True,
                         timeout=120, check=True)
    floor = json.loads(out.stdout.strip().splitlines()[-1])
    assert floor["pages"] == 300 and floor["cow_faults"] >= 300, floor
    assert floor["cow_fault_us"] > 0 and floor["fork_exit_ms"] > 0, floor
    assert floor["zygote_rss_mb"] > 20, floor  # Dask and yrdask imported, as in a zygote
