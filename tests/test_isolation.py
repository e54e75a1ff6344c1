"""Isolated instances (docs/isolation.md): their own process, env_vars and working_dir, and a
crash that takes only that process.

Real clusters: the embedded one (one worker process, so every instance is a neighbour of
every other) and the cli one.  Pids come from the code running in the processes.
"""

from __future__ import annotations

import atexit
import os
import signal
import threading
import time

import psutil
import pytest

import yrdask as yr
from conftest import wait_for_file, wait_until
from yrdask.errors import CallCrashedError, TaskCrashedError

pytestmark = pytest.mark.timeout(240)


def small(**kw) -> yr.InvokeOptions:
    return yr.InvokeOptions(cpu=100, memory=10, **kw)
# ``plain`` instances below are light ones (light=True): the reference for what runs in the
# worker's own process, which the isolated ones are compared with


@yr.instance
class Probe:
    def __init__(self, start: int = 0) -> None:
        self.n = start

    def incr(self) -> int:
        self.n += 1
        return self.n

    def where(self) -> dict:
        return {"pid": os.getpid(), "ppid": os.getppid(), "cwd": os.getcwd(),
                "env": os.environ.get("YR_ISOLATION_TEST")}

    def big(self, n: int) -> bytes:
        return b"x" * n

    def exit(self, code: int) -> None:
        os._exit(code)

    def segfault(self) -> None:
        os.kill(os.getpid(), signal.SIGSEGV)

    def steps(self, n: int):
        for _ in range(n):
            self.n += 1
            yield self.n


def descends_from(pid: int, ancestor: int) -> bool:
    return ancestor in [p.pid for p in psutil.Process(pid).parents()]


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.parametrize("kind", ["embedded", "cli"])
def test_isolated_instance_sees_its_env_vars_and_working_dir(cluster, kind, tmp_path):
    if kind == "embedded":
        cluster(kind="embedded", num_cpus=1)
    else:
        cluster(kind="cli", workers=[{}])
    plain = Probe.options(small(light=True)).invoke()
    iso = Probe.options(small(env_vars={"YR_ISOLATION_TEST": "from-env-vars"},
                              runtime_env={"working_dir": str(tmp_path)})).invoke()
    here, there = yr.get([plain.where.invoke(), iso.where.invoke()], timeout=60)
    assert there["env"] == "from-env-vars" and there["cwd"] == str(tmp_path)
    assert here["env"] is None
    assert descends_from(there["pid"], here["pid"])  # started by the same worker process
    assert there["pid"] not in (here["pid"], os.getpid())
    assert yr.get(iso.big.invoke(2_000_000), timeout=60) == b"x" * 2_000_000  # kept by the agent
    iso.terminate()
    wait_until(lambda: gone(there["pid"]), 30, "the isolated process to end on terminate")
    plain.terminate()


def test_crash_takes_only_the_isolated_process(cluster):
    cluster(kind="embedded", num_cpus=1)
    plain = Probe.options(small(light=True)).invoke(10)
    other = Probe.options(small(isolated=True)).invoke(20)
    doomed = Probe.options(small(isolated=True)).invoke(30)
    worker = yr.get(plain.where.invoke(), timeout=60)["pid"]
    assert descends_from(yr.get(doomed.where.invoke(), timeout=60)["pid"], worker)
    with pytest.raises(yr.YRRuntimeError, match="exited with code 7") as info:
        yr.get(doomed.exit.invoke(7), timeout=60)
    assert isinstance(info.value, yr.InstanceDiedError)
    # The neighbours on the same worker go on, state intact; the worker was not restarted.
    assert yr.get([plain.incr.invoke(), other.incr.invoke()], timeout=60) == [11, 21]
    assert yr.get(plain.where.invoke(), timeout=60)["pid"] == worker
    with pytest.raises(yr.InstanceDiedError, match="exited with code 7"):
        yr.get(doomed.incr.invoke(), timeout=60)
    # The scheduler keeps why it ended (yrdask status, the dashboard's ended list).
    status = wait_until(lambda: (st := doomed.status())["state"] == "DEAD" and st, 30,
                        lambda: f"the instance DEAD at the scheduler: {doomed.status()}")
    assert "exited with code 7" in status["reason"], status
    for h in (plain, other):
        h.terminate()


def test_restart_rules_apply_to_a_dead_isolated_process(cluster):
    cluster(kind="embedded", num_cpus=1)
    h = Probe.options(small(isolated=True, recover_retry_times=3)).invoke(5)
    first = yr.get(h.where.invoke(), timeout=60)["pid"]
    poison = h.segfault.invoke()
    after = h.incr.invoke()  # sent behind the poison call: runs on a restarted process
    with pytest.raises(CallCrashedError, match="signal 11 .SIGSEGV."):
        yr.get(poison, timeout=120)
    assert yr.get(after, timeout=60) == 6  # a fresh __init__(5), then this call
    assert yr.get(h.where.invoke(), timeout=60)["pid"] != first
    h.terminate()


def test_isolated_restarts_are_the_instances_one_budget_at_the_scheduler(cluster):
    """recover_retry_times=2 is one budget per instance, counted by the scheduler: deaths of
    the isolated process show in the handle's state and restart count, the third death ends
    it, and a restart after a worker loss draws on the same budget (no reset)."""
    cluster(kind="embedded", num_cpus=1)

    def restarted(h, n):
        return wait_until(lambda: (st := h.status())["state"] == "ALIVE"
                          and st["restarts"] == n and st, 60,
                          lambda: f"restart {n} seen by the scheduler: {h.status()}")

    # Killed three times, the worker untouched.
    h = Probe.options(small(isolated=True, recover_retry_times=2)).invoke(5)
    for n in (1, 2):
        os.kill(yr.get(h.where.invoke(), timeout=60)["pid"], signal.SIGKILL)
        assert yr.get(h.incr.invoke(), timeout=60) == 6  # a fresh __init__(5), this call
        restarted(h, n)
    os.kill(yr.get(h.where.invoke(), timeout=60)["pid"], signal.SIGKILL)
    with pytest.raises(yr.InstanceDiedError, match="killed by signal 9 .SIGKILL. and it had "
                                                   "used all its 2 restarts"):
        yr.get(h.incr.invoke(), timeout=60)
    status = wait_until(lambda: (st := h.status())["state"] == "DEAD" and st, 30,
                        lambda: f"the instance DEAD at the scheduler: {h.status()}")
    assert "all its 2 restarts" in status["reason"], status

    # A process death, then a worker loss, then a process death: the third ends it too.
    g = Probe.options(small(isolated=True, recover_retry_times=2)).invoke(5)
    os.kill(yr.get(g.where.invoke(), timeout=60)["pid"], signal.SIGKILL)
    restarted(g, 1)
    where = yr.get(g.where.invoke(), timeout=60)
    worker = psutil.Process(where["ppid"]).ppid()  # child -> zygote -> worker
    assert worker != os.getpid()
    os.kill(worker, signal.SIGKILL)
    restarted(g, 2)  # on the worker its nanny started again
    assert yr.get(g.incr.invoke(), timeout=120) == 6
    os.kill(yr.get(g.where.invoke(), timeout=60)["pid"], signal.SIGKILL)
    with pytest.raises(yr.InstanceDiedError, match="used all its 2 restarts"):
        yr.get(g.incr.invoke(), timeout=60)
    assert wait_until(lambda: g.state == "DEAD", 30, lambda: f"DEAD: {g.status()}")


def test_no_isolated_process_outlives_terminate_or_finalize(cluster):
    cluster(kind="embedded", num_cpus=1)
    handles = [Probe.options(small(isolated=True)).invoke() for _ in range(2)]
    pids = [w["pid"] for w in yr.get([h.where.invoke() for h in handles], timeout=60)]
    pooled = yr.get(task_env.options(small(isolated=True)).invoke(), timeout=60)["pid"]
    handles[0].terminate()
    wait_until(lambda: gone(pids[0]), 30, "the terminated instance's process to end")
    assert not gone(pids[1]) and not gone(pooled)
    yr.finalize()  # the next test's cluster() re-initialises
    wait_until(lambda: gone(pids[1]) and gone(pooled), 30,
               "the isolated processes to end with their worker")


def test_isolated_process_ends_when_its_worker_is_killed(cluster):
    cluster(kind="embedded", num_cpus=1)
    plain = Probe.options(small(light=True)).invoke()
    h = Probe.options(small(isolated=True)).invoke()
    worker = yr.get(plain.where.invoke(), timeout=60)["pid"]
    child = yr.get(h.where.invoke(), timeout=60)["pid"]
    assert worker != os.getpid() and descends_from(child, worker)
    os.kill(worker, signal.SIGKILL)  # no close, no cleanup
    wait_until(lambda: gone(child), 30, "the orphaned isolated process to exit")


def test_idle_pooled_processes_are_reaped(cluster):
    from yrdask.worker.isolated.pool import POOL_IDLE_S

    cluster(kind="embedded", num_cpus=1)
    first = yr.get(task_env.options(small(isolated=True)).invoke(), timeout=60)
    worker = yr.get(task_env.options(small()).invoke(), timeout=60)["pid"]
    assert descends_from(first["pid"], worker)
    wait_until(lambda: gone(first["pid"]), POOL_IDLE_S * 4, "the idle pooled process to go")
    assert not gone(worker)


def test_runtime_env_with_packages_is_rejected():
    with pytest.raises(yr.YRValueError, match="'pip'.*does not install packages"):
        yr.InvokeOptions(runtime_env={"pip": ["numpy"]})
    with pytest.raises(yr.YRTypeError):
        yr.InvokeOptions(isolated="yes")


@yr.invoke
def task_env() -> dict:
    return {"pid": os.getpid(), "ppid": os.getppid(), "cwd": os.getcwd(),
            "env": os.environ.get("YR_ISOLATION_TEST")}


@yr.invoke
def task_exit(code: int) -> None:
    os._exit(code)


@pytest.mark.parametrize("kind", ["embedded", "cli"])
def test_tasks_with_env_vars_run_in_pooled_processes(cluster, kind, tmp_path):
    if kind == "embedded":
        cluster(kind="embedded", num_cpus=1)
    else:
        cluster(kind="cli", workers=[{}])
    plain = yr.get(task_env.options(small()).invoke(), timeout=60)
    iso = task_env.options(small(env_vars={"YR_ISOLATION_TEST": "task"},
                                 runtime_env={"working_dir": str(tmp_path)}))
    first = yr.get(iso.invoke(), timeout=60)
    assert first["env"] == "task" and first["cwd"] == str(tmp_path)
    assert descends_from(first["pid"], plain["pid"]) and plain["env"] is None
    again = [yr.get(iso.invoke(), timeout=60) for _ in range(3)]
    assert {r["pid"] for r in again} == {first["pid"]}  # the pooled process is reused
    with pytest.raises(TaskCrashedError, match="exited with code 9"):
        yr.get(task_exit.options(small(env_vars={"YR_ISOLATION_TEST": "x"})).invoke(9),
               timeout=60)
    after = yr.get(task_env.options(small()).invoke(), timeout=60)
    assert after["pid"] == plain["pid"]  # the worker was not restarted


@yr.instance
class DiesInInit:
    def __init__(self) -> None:
        os._exit(5)

    def ping(self) -> str:
        return "pong"


def test_isolated_init_that_kills_its_process_ends_the_instance(cluster, tmp_path):
    cluster(kind="embedded", num_cpus=1)
    h = DiesInInit.options(small(isolated=True)).invoke()
    with pytest.raises(yr.InstanceDiedError, match="exited with code 5"):
        yr.get(h.ping.invoke(), timeout=60)
    missing = Probe.options(small(runtime_env={"working_dir": str(tmp_path / "nope")})).invoke()
    with pytest.raises(yr.YRValueError, match="does not exist on this worker host"):
        yr.get(missing.incr.invoke(), timeout=60)
    missing.terminate()


def test_config_working_dir_is_the_default_for_isolated_work(cluster, tmp_path):
    cli = cluster.cli_processes([{}])
    job_dir, own_dir = tmp_path / "job", tmp_path / "own"
    job_dir.mkdir()
    own_dir.mkdir()
    yr.init(yr.Config(server_address=cli.address, working_dir=str(job_dir)))
    try:
        plain = Probe.options(small(light=True)).invoke()
        default = Probe.options(small(isolated=True)).invoke()
        named = Probe.options(small(runtime_env={"working_dir": str(own_dir)})).invoke()
        here, there, own = yr.get([h.where.invoke() for h in (plain, default, named)],
                                  timeout=60)
        assert there["cwd"] == str(job_dir) and own["cwd"] == str(own_dir)
        assert here["cwd"] != str(job_dir)  # in-process work keeps the worker's directory
        task = yr.get(task_env.options(small(env_vars={"YR_ISOLATION_TEST": "t"})).invoke(),
                      timeout=60)
        assert task["cwd"] == str(job_dir)
    finally:
        cluster.finalize()


def test_generator_method_of_an_isolated_instance_streams(cluster):
    cluster(kind="embedded", num_cpus=1)
    h = Probe.options(small(isolated=True)).invoke(0)
    gen = h.steps.invoke(3)
    assert isinstance(gen, yr.ObjectRefGenerator)
    assert yr.get(list(gen), timeout=60) == [1, 2, 3]
    assert yr.get(h.incr.invoke(), timeout=60) == 4
    h.terminate()


@yr.instance
class GracefulIsolated:
    def pid(self) -> int:
        return os.getpid()

    def __yr_shutdown__(self, grace: int) -> None:
        with open("shutdown.txt", "w") as f:  # relative: the instance's working_dir
            f.write(f"grace {grace}")


def test_kill_instance_runs_the_isolated_shutdown_hook_then_kills(cluster, tmp_path):
    cluster(kind="embedded", num_cpus=1)
    h = GracefulIsolated.options(small(runtime_env={"working_dir": str(tmp_path)})).invoke()
    sibling = Probe.options(small(runtime_env={"working_dir": str(tmp_path)})).invoke()
    pid, other = yr.get([h.pid.invoke(), sibling.where.invoke()], timeout=60)
    yr.kill_instance(h.instance_id)  # synchronous: the hook has run, the process is killed
    assert (tmp_path / "shutdown.txt").read_text() == "grace 30"
    wait_until(lambda: gone(pid), 30, "the stopped instance's process to end")
    assert yr.get(sibling.incr.invoke(), timeout=60) == 1 and not gone(other["pid"])
    sibling.terminate()


def inbound_peers() -> list:
    """Who is connected to this process's endpoint now (its agent and its callers)."""
    conns = psutil.Process().net_connections(kind="tcp")
    ports = {c.laddr.port for c in conns if c.status == psutil.CONN_LISTEN}
    return sorted(f"{c.raddr.ip}:{c.raddr.port}" for c in conns
                  if c.status == psutil.CONN_ESTABLISHED and c.laddr.port in ports)


@yr.instance
class Connections:
    def __init__(self, path: str) -> None:
        self.path = path

    def inbound(self) -> list:
        return inbound_peers()

    def __yr_shutdown__(self, grace: int) -> None:
        with open(self.path, "w") as f:
            f.write("\n".join(inbound_peers()))


def test_the_stop_travels_on_the_supervision_channel(cluster, tmp_path):
    """A terminate reaches the process on the channel its agent holds: while its shutdown
    hook runs, nobody new is connected to it (the agent opens no connection per stop)."""
    cluster(kind="embedded", num_cpus=1)
    path = tmp_path / "peers"
    h = Connections.options(small()).invoke(str(path))
    before = yr.get(h.inbound.invoke(), timeout=60)
    assert len(before) >= 2  # its agent's supervision channel and this driver's calls
    yr.kill_instance(h.instance_id)  # synchronous: the hook has run
    during = path.read_text().split("\n")
    assert set(during) <= set(before), f"new peers while it stopped: {set(during) - set(before)}"


@yr.instance
class StoppedInInit:
    """Its atexit handler still runs when its ``__init__`` returns, and ends well after."""

    def __init__(self, path: str) -> None:
        def at_exit() -> None:
            open(f"{path}.atexit", "w").close()
            wait_for_file(f"{path}.returned", 30)
            time.sleep(0.5)  # long after its agent heard that __init__ returned
            open(f"{path}.atexit-done", "w").close()

        atexit.register(at_exit)
        open(f"{path}.started", "w").close()
        wait_for_file(f"{path}.release", 30)
        open(f"{path}.returned", "w").close()


def test_a_stop_while_init_runs_lets_the_atexit_handlers_finish(cluster, tmp_path):
    """A terminate while ``__init__`` runs reaches the process at once, and its atexit
    handlers finish even when ``__init__`` returns meanwhile: the process does not exit
    before the stop is answered."""
    cluster(kind="embedded", num_cpus=1)
    path = str(tmp_path / "s")
    h = StoppedInInit.options(small()).invoke(path)
    wait_until(lambda: os.path.exists(f"{path}.started"), 60, "__init__ to start")
    kill = threading.Thread(target=yr.kill_instance, args=(h.instance_id,))
    kill.start()
    wait_until(lambda: os.path.exists(f"{path}.atexit"), 30, "the stop to run atexit")
    open(f"{path}.release", "w").close()
    kill.join(60)
    assert not kill.is_alive()
    assert os.path.exists(f"{path}.atexit-done"), "the process exited during its atexit"


@yr.instance
class DiesInFirstRestart:
    """Its first restart dies in ``__init__`` (a count in a file): the start after it works."""

    def __init__(self, path: str) -> None:
        n = int(open(path).read()) if os.path.exists(path) else 0
        with open(path, "w") as f:
            f.write(str(n + 1))
        if n == 1:
            os._exit(7)
        self.starts = n + 1

    def count(self) -> int:
        return self.starts

    def pid(self) -> int:
        return os.getpid()


def test_a_restart_that_dies_in_init_is_one_more_death(cluster, tmp_path):
    """Found by the simulation (its former model of isolated instances): a restarted
    isolated process that died before it built the instance left it RESTARTING for good, its calls waiting.  The death
    of restart 1 is a new death: the budget allows restart 2, which serves the call."""
    cluster(kind="embedded", num_cpus=1)
    h = DiesInFirstRestart.options(small(isolated=True, recover_retry_times=3)).invoke(
        str(tmp_path / "starts"))
    os.kill(yr.get(h.pid.invoke(), timeout=60), signal.SIGKILL)
    assert yr.get(h.count.invoke(), timeout=90) == 3  # start 2 died in __init__, start 3 serves
    status = wait_until(lambda: (st := h.status())["state"] == "ALIVE" and st, 30,
                        lambda: f"ALIVE at the scheduler: {h.status()}")
    assert status["restarts"] == 2, status
    h.terminate()
