"""Clusters the Dask way (SPEC §1.2; yr_api §1.1): `dask scheduler/worker --preload yrdask`."""

from __future__ import annotations

import os

import pytest

import yrdask as yr

pytestmark = pytest.mark.timeout(240)

T = 60  # seconds: explicit yr.get bound, well under the test time-out


@yr.invoke  # defined at import, before any yr.init of the session
def ident(x):
    return x


@yr.invoke
def add(n):
    return n + 1


@yr.invoke
def pid():
    return os.getpid()


def test_p1_basics_on_cli_cluster(cli_cluster):
    assert yr.get(add.invoke(1), T) == 2
    assert yr.get(add.invoke(add.invoke(1)), T) == 3
    with pytest.raises(RuntimeError):
        add(1)
    with pytest.raises(TypeError):
        add.invoke(1, 2)


def test_p5_basics_on_cli_cluster(cli_cluster):
    assert yr.get(yr.put(123), T) == 123
    assert yr.get([yr.put(i) for i in range(3)], T) == [0, 1, 2]
    assert yr.get([]) == []
    value = yr.get(yr.put(b"ab"), T)
    assert isinstance(value, memoryview) and value == b"ab"
    with pytest.raises(ValueError):
        yr.put(None)


def test_tasks_run_in_the_cli_worker_processes(cli_cluster):
    pids = yr.get([pid.invoke() for _ in range(10)], T)
    assert set(pids) <= cli_cluster.worker_pids()


def test_worker_joining_after_init_gets_the_plugin(cli_cluster):
    assert yr.is_initialized()
    waits = pid.options(
        yr.InvokeOptions(custom_resources={"late_tag": 1}, schedule_timeout_ms=60000)
    )
    early = waits.invoke()  # nothing offers late_tag yet
    late = cli_cluster.cli.add_worker(resources="late_tag=1", name="late")
    try:
        late_pids = late.pids()
        got = yr.get(waits.invoke(), T)
        assert got in late_pids, f"late_tag task ran in pid {got}, not the late worker {late_pids}"
        got_early = yr.get(early, T)
        assert got_early in late_pids, "a request waiting for late_tag did not run on the new worker"
    finally:
        cli_cluster.cli.remove_worker(late)


def test_config_server_address(cluster):
    cli = cluster.cli_processes()
    assert not yr.is_initialized()
    yr.init(yr.Config(server_address=cli.address))
    try:
        assert yr.is_initialized()
        assert yr.get(pid.invoke(), T) in cli.worker_pids()
    finally:
        yr.finalize()
    assert not yr.is_initialized()


def test_env_server_address(cluster, monkeypatch):
    cli = cluster.cli_processes()
    monkeypatch.setenv("YR_SERVER_ADDRESS", cli.address)
    yr.init()
    try:
        got = yr.get(pid.invoke(), T)
        assert got in cli.worker_pids(), "yr.init() did not join the cluster in YR_SERVER_ADDRESS"
    finally:
        yr.finalize()
    assert not yr.is_initialized()


def test_init_twice_raises(cli_cluster):
    with pytest.raises(RuntimeError):
        yr.init(yr.Config(server_address=cli_cluster.address))
    with pytest.raises(RuntimeError):
        yr.init()
    assert yr.is_initialized()
    assert yr.get(add.invoke(1), T) == 2


def test_calls_before_init_raise(cluster):
    cluster(kind="cli")
    old = add.invoke(1)
    assert yr.get(old, T) == 2
    cluster.finalize()
    assert not yr.is_initialized()
    yr.finalize()  # a no-op when not initialised
    with pytest.raises(RuntimeError):
        add.invoke(1)
    with pytest.raises(RuntimeError):
        yr.put(1)
    with pytest.raises(RuntimeError):
        yr.get(old, 5)
    with pytest.raises(RuntimeError):
        yr.wait([old], 1, 5)
    with pytest.raises(RuntimeError):
        yr.cancel(old)
    with pytest.raises(RuntimeError):
        add(1)


@pytest.mark.parametrize("kind", ["cli", "embedded"])
def test_init_finalize_loop(cluster, kind):
    if kind == "cli":
        address = cluster.cli_processes().address
        conf = lambda: yr.Config(server_address=address)  # noqa: E731
    else:
        cluster.finalize()
        conf = lambda: yr.Config(num_cpus=1)  # noqa: E731
    for i in range(3):
        yr.init(conf())
        try:
            assert yr.get(ident.invoke(i), T) == i
        finally:
            yr.finalize()
        assert not yr.is_initialized()


def test_sigkilled_worker_tree_leaves_no_semaphores(tmp_path):
    """A ``dask worker --preload yrdask`` nanny's queue semaphores lose their /dev/shm names
    once its worker process runs (and again for the process it restarts), so a SIGKILL of the
    whole tree, resource tracker included, strands none of them (docs/deploy.md)."""
    import signal
    import time

    import psutil
    from conftest import CliCluster, _is_multiprocessing_helper, named_semaphores

    def worker_process(nanny: psutil.Process, not_pid: int = 0) -> psutil.Process | None:
        for child in nanny.children():
            try:
                # its title is "dask worker [...]" (Dask sets it with setproctitle, a
                # yrdask dependency), so it is the child that is not Python's resource tracker
                if child.pid != not_pid and not _is_multiprocessing_helper(child):
                    return child
            except psutil.Error:
                pass
        return None

    def names_once_running(nanny: psutil.Process, not_pid: int = 0) -> tuple[int, set[str]]:
        deadline = time.monotonic() + 60
        while True:  # the nanny unlinks the names once its worker process reported back
            child = worker_process(nanny, not_pid)
            mapped, named = named_semaphores([child.pid] if child else [])
            if len(mapped) >= 6 and not named:
                return child.pid, mapped
            assert time.monotonic() < deadline, (
                f"the nanny's worker process {child} maps {sorted(mapped)}; still named in "
                f"/dev/shm: {sorted(named)}")
            time.sleep(0.1)

    cli = CliCluster.start([{}], tmp_path / "cli")
    try:
        nanny = psutil.Process(cli.workers[0].proc.pid)
        first, mapped = names_once_running(nanny)
        os.kill(first, signal.SIGKILL)  # the nanny starts a new worker process, new queues
        _, mapped_again = names_once_running(nanny, not_pid=first)
        assert not mapped & mapped_again
        tree = [nanny, *nanny.children(recursive=True)]
        for p in tree:
            p.send_signal(signal.SIGKILL)
        psutil.wait_procs(tree, timeout=10)
        cli.workers[0].proc.wait(10)
        left = sorted(m for m in mapped | mapped_again if os.path.exists(m))
        assert not left, f"a SIGKILLed worker tree left {left} in /dev/shm"
    finally:
        cli.stop()


def test_a_worker_process_started_before_the_nanny_plugin_reports_its_exit():
    """A nanny that registers before the scheduler's extension has started gets yr's nanny
    plugin after its worker process started: that process's exit is reported too (without
    the report, a yr task that crashed it would be taken for an eviction and rerun without
    spending its retry_times)."""
    import asyncio
    import logging
    import resource
    import signal

    from distributed import Nanny, Scheduler
    from distributed.protocol.pickle import dumps as pickle_dumps

    from yrdask.deploy.preload import install_scheduler
    from yrdask.worker.plugin import YrNannyPlugin

    class Heard(logging.Handler):
        """The scheduler's log lines that name the worker, each waking the test's loop."""

        def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
            super().__init__(logging.INFO)
            self.loop, self.lines, self.event = loop, [], asyncio.Event()

        def emit(self, record: logging.LogRecord) -> None:
            self.lines.append(record.getMessage())
            self.loop.call_soon_threadsafe(self.event.set)

    async def main() -> None:
        heard = Heard(asyncio.get_running_loop())
        log = logging.getLogger("yrdask.scheduler")
        log.addHandler(heard)
        level = log.level
        log.setLevel(logging.INFO)  # (setLevel: the logger's cached answers are cleared too)
        try:
            await until_heard(heard)
        finally:
            log.removeHandler(heard)
            log.setLevel(level)

    async def until_heard(heard: Heard) -> None:
        async with Scheduler(port=0, dashboard_address=":0") as s:
            ext = install_scheduler(s)
            ext.nanny_plugin = None  # (started already: this extension registers none)
            async with Nanny(s.address, nthreads=1, dashboard_address=":0") as nanny:
                worker = nanny.worker_address
                ext.on_add_worker(worker)  # (its hooks came after the worker registered)
                await s.register_nanny_plugin(None, pickle_dumps(YrNannyPlugin()),
                                              name=YrNannyPlugin.name, idempotent=True)
                resource.prlimit(nanny.pid, resource.RLIMIT_CORE, (0, 0))  # no core file
                os.kill(nanny.pid, signal.SIGABRT)  # a crash of its own: a core-dump signal
                while not (said := [line for line in heard.lines if worker in line]):
                    heard.event.clear()
                    try:
                        await asyncio.wait_for(heard.event.wait(), 30)
                    except asyncio.TimeoutError:
                        raise AssertionError("the scheduler never said how the worker "
                                             f"process ended: {heard.lines}") from None
                assert said == [f"yrdask: worker process {worker} was killed by signal 6 "
                                "(SIGABRT)"], said

    asyncio.run(main())
