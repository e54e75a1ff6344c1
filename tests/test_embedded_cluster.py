"""The embedded cluster of ``yr.init()`` (``yrdask/api/cluster.py``): how it starts and stops.

Its workers are forked by Dask nannies inside one launcher subprocess (``python -c`` running
``serve_workers``).  These tests hold what that design promises: the user's script runs once
(no ``__main__`` guard needed), also when a nanny restarts a killed worker; a worker killed
with SIGKILL or SIGTERM is forked again and rejoins with the yr agent and runs work;
``yr.finalize()`` is quick even with a task that never returns and leaves no process behind,
nor does a killed driver or launcher; the Dask dashboard is mounted at its first request;
``import yrdask`` does not import distributed (the launcher's imports overlap the driver's);
the driver builds its submitter and metrics after the workers' start order.

Every test that kills something starts its own cluster.  Order comes from files a task
writes or waits for and from ``wait_until`` on state, never from sleeps.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import dask
import psutil
import pytest

import yrdask as yr
from conftest import check_in, dask_worker_pids, wait_for_file, wait_until
from yrdask.deploy.embedded import TOKEN_ENV

pytestmark = pytest.mark.timeout(180)

T = 60  # seconds: explicit yr.get bound, well under the test time-out
ONE_CPU = yr.InvokeOptions(cpu=1000)  # one per worker process of a num_cpus=2 cluster
# Its own resource shape for ``meet``: the submitter pipelines a backlog of a shape whose
# earlier tasks were short onto one worker, and meeting tasks must run side by side.
MEET = yr.InvokeOptions(cpu=1000, memory=100)


def process_address() -> str:
    """Inside a task: the Dask address of the worker process running it (the embedded cluster
    is one node, docs/nodes.md, so the node id does not tell its processes apart)."""
    from yrdask.runtime.context import current_runtime

    return current_runtime().address


@yr.invoke
def where() -> tuple[int, str]:
    return os.getpid(), process_address()


@yr.invoke
def meet(folder: str, n: int) -> tuple[int, str]:
    """Check in, then wait until ``n`` tasks checked in: they ran at the same time."""
    check_in(folder, n)
    return os.getpid(), process_address()


@yr.invoke
def stuck(started: str) -> None:
    """Signal that it runs, then never return (waits for a file nobody creates)."""
    open(started, "w").close()
    wait_for_file(started + ".never", timeout=3600)


def launcher() -> psutil.Process:
    """The embedded cluster's launcher: the child of this process that runs the nannies."""
    def ours(p: psutil.Process) -> bool:
        try:
            return TOKEN_ENV in p.environ()
        except psutil.Error:
            return False

    found = [p for p in psutil.Process().children() if ours(p)]
    assert len(found) == 1, found
    return found[0]


def alive(procs: list[psutil.Process]) -> list[psutil.Process]:
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


def node_ids() -> set[str]:
    """The worker processes of the cluster's node, as the scheduler lists them."""
    from yrdask.api.nodes import nodes_info

    return {p for n in nodes_info() for p in n["processes"]}


def replaced(pid: int) -> dict[int, str] | None:
    """Dask's workers (pid -> address) once two are up again, neither is process ``pid``,
    and yr lists exactly them (each one's agent registered).

    By pid, not address: a restarted worker may be given its dead predecessor's port.
    """
    workers = dask_worker_pids()
    if len(workers) == 2 and pid not in workers and set(workers.values()) == node_ids():
        return workers
    return None


@pytest.fixture
def own_cluster(cluster):
    """A fresh embedded cluster (num_cpus=2) for a test that kills parts of it."""
    cluster.finalize()
    yr.init(yr.Config(num_cpus=2))
    try:
        yield
    finally:
        yr.finalize()


def run_driver(tmp_path, body: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run ``body`` as a user's script (``python script.py``, no ``__main__`` guard)."""
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(body))
    return subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=timeout, stdin=subprocess.DEVNULL)


def test_script_without_main_guard_runs_once(tmp_path):
    """Workers never import the user's script: not at startup, not after a nanny restart."""
    runs = tmp_path / "runs"
    result = run_driver(tmp_path, f"""
        import os, signal, time
        import yrdask as yr

        with open({str(runs)!r}, "a") as f:
            f.write(f"{{os.getpid()}}\\n")

        @yr.invoke
        def where():
            from yrdask.runtime.context import current_runtime

            return os.getpid(), current_runtime().address

        def workers():  # pid -> address, once yr lists the same processes as Dask
            from yrdask.api.nodes import nodes_info
            from yrdask.runtime.context import current_runtime

            listed = {{p for n in nodes_info() for p in n["processes"]}}
            dask_view = current_runtime().cluster.scheduler.workers  # copied in C (a
            now = {{ws.pid: a for a, ws in list(dict.items(dask_view))}}  # SortedDict)
            return now if set(now.values()) == listed else {{}}

        yr.init(yr.Config(num_cpus=2))
        pid, node = yr.get(where.invoke(), timeout=60)
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while len(now := workers()) < 2 or pid in now:  # by pid: a port may be reused
            assert time.monotonic() < deadline, "the killed worker did not come back"
            time.sleep(0.05)  # the scheduler answering these polls runs in this process
        one_cpu = yr.InvokeOptions(cpu=1000)
        yr.get([where.options(one_cpu).invoke() for _ in range(4)], timeout=60)
        yr.finalize()
        print("DRIVER", os.getpid())
    """)
    assert result.returncode == 0 and "DRIVER" in result.stdout, result.stderr[-3000:]
    driver = result.stdout.split("DRIVER", 1)[1].split()[0]
    assert runs.read_text().split() == [driver], runs.read_text()


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_killed_worker_is_forked_again_and_rejoins_with_the_agent(own_cluster, tmp_path, sig):
    """SIGTERM too: Dask stops workers with it (memory limit) and expects them to die at once,
    although the process they are forked from handles it (``dask worker`` closes on it)."""
    nanny_process = launcher()
    pid, node = yr.get(where.options(ONE_CPU).invoke(), timeout=T)
    assert psutil.Process(pid).ppid() == nanny_process.pid  # forked by a nanny in the launcher
    before = dask_worker_pids()
    assert before.get(pid) == node and set(before.values()) == node_ids()

    os.kill(pid, sig)
    # A node is listed once its worker's yr agent registered with the scheduler extension.
    now = wait_until(lambda: replaced(pid), 60,
                     lambda: f"the nanny to bring the worker back with its agent: "
                             f"{dask_worker_pids()}, yr lists {node_ids()}")
    (new_pid,) = set(now) - set(before)

    # Two one-CPU tasks at once: one on each worker, so one on the restarted worker.
    ran = yr.get([meet.options(MEET).invoke(str(tmp_path), 2) for _ in range(2)], timeout=T)
    assert sorted(ran) == sorted(now.items()), (ran, now)
    assert psutil.Process(new_pid).ppid() == nanny_process.pid


@pytest.mark.parametrize("cancelled", [True, False], ids=["cancelled", "running"])
def test_finalize_is_quick_with_a_task_that_never_returns(cluster, tmp_path, cancelled):
    """A task thread that never returns keeps its worker's interpreter from exiting (Dask's
    nanny would wait 8 s for it); finalize kills such a worker once it has unregistered."""
    cluster.finalize()
    yr.init(yr.Config(num_cpus=2))
    procs = [launcher()] + launcher().children(recursive=True)
    started = tmp_path / "started"
    ref = stuck.invoke(str(started))
    wait_until(started.exists, 60, "the stuck task to start")
    if cancelled:
        yr.cancel(ref)
        with pytest.raises(yr.CancelledError):
            yr.get(ref, timeout=T)
    t0 = time.monotonic()
    yr.finalize()
    took = time.monotonic() - t0
    assert not alive(procs), [p.pid for p in alive(procs)]
    assert took < 6, f"yr.finalize took {took:.1f} s"


def test_killed_driver_takes_its_cluster_down(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import sys
        import yrdask as yr
        yr.init(yr.Config(num_cpus=2))
        print("READY", flush=True)
        sys.stdin.read()  # until the test kills us
    """)], cwd=tmp_path, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "READY"
        tree = psutil.Process(proc.pid).children(recursive=True)
        assert len(tree) == 3, tree  # the launcher and its two workers
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        wait_until(lambda: not alive(tree), 60,
                   lambda: f"the cluster of a killed driver to exit: {alive(tree)}")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_killed_driver_takes_every_descendant_down_at_once(tmp_path, sig):
    """Also while a worker runs a task that never returns (so its worker cannot exit by
    itself): the launcher sees the driver's end of its stdin close, however the driver
    ended, and kills its whole tree within seconds."""
    started = str(tmp_path / "started")
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import os, sys, threading
        import yrdask as yr

        @yr.invoke
        def stuck(started):
            open(started, "w").close()
            threading.Event().wait()  # never returns

        yr.init(yr.Config(num_cpus=2))
        ref = stuck.invoke({started!r})
        done = threading.Event()
        while not os.path.exists({started!r}):  # bounded by the test's readline time-out
            done.wait(0.01)
        print("READY", flush=True)
        sys.stdin.read()  # until the test kills us
    """)], cwd=tmp_path, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    tree: list[psutil.Process] = []
    try:
        assert proc.stdout.readline().strip() == "READY"
        tree = psutil.Process(proc.pid).children(recursive=True)
        assert len(tree) >= 3, tree  # the launcher and its two workers (and more)
        os.kill(proc.pid, sig)
        proc.wait(10)
        wait_until(lambda: not alive(tree), 5,
                   lambda: f"every process of a killed driver's cluster to exit: {alive(tree)}")
    finally:
        if proc.poll() is None:
            tree += psutil.Process(proc.pid).children(recursive=True)
            proc.kill()
            proc.wait(10)
        for p in alive(tree):
            p.kill()


def test_killed_launcher_takes_its_workers_down(own_cluster):
    """Forked workers hold copies of each other's pipes; all still exit with the launcher,
    also a worker forked later (a nanny restart), and finalize still cleans up."""
    nanny_process = launcher()
    pid, node = yr.get(where.options(ONE_CPU).invoke(), timeout=T)
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: replaced(pid), 60, "the nanny to bring the worker back")
    workers = nanny_process.children()
    assert len(workers) == 2, workers
    os.kill(nanny_process.pid, signal.SIGKILL)
    wait_until(lambda: not alive(workers), 60,
               lambda: f"the workers of a killed launcher to exit: {alive(workers)}")
    t0 = time.monotonic()
    yr.finalize()
    assert time.monotonic() - t0 < 6
    assert not alive([nanny_process] + workers)


def test_dashboard_is_mounted_at_its_first_request(tmp_path):
    """Bokeh is imported when the dashboard is first asked for, not at ``yr.init``."""
    result = run_driver(tmp_path, """
        import sys, urllib.request
        import yrdask as yr

        @yr.invoke
        def one():
            return 1

        info = yr.init(yr.Config(num_cpus=1))
        assert yr.get(one.invoke(), timeout=60) == 1
        print("bokeh at init:", "bokeh" in sys.modules)
        with urllib.request.urlopen(info.dashboard_link, timeout=60) as r:
            print("status page:", r.status, r.geturl().endswith("/status"), b"bokeh" in r.read())
        base = info.dashboard_link.rsplit("/", 1)[0]
        with urllib.request.urlopen(base + "/individual-plots.json", timeout=60) as r:
            print("plots:", "Individual Task Stream" in r.read().decode())
        yr.finalize()
    """)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "bokeh at init: False" in result.stdout, result.stdout
    assert "status page: 200 True True" in result.stdout, result.stdout
    assert "plots: True" in result.stdout, result.stdout


def test_import_yrdask_does_not_import_distributed():
    """``yr.init`` starts the workers' launcher before this process imports distributed, so
    the two imports overlap: keep ``distributed`` out of yrdask's import-time imports."""
    out = subprocess.run(
        [sys.executable, "-c", "import sys, yrdask; print(sorted(m for m in sys.modules "
                               "if m.split('.')[0] in ('distributed', 'bokeh')))"],
        capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_start_order_goes_before_the_driver_builds_its_submitter_and_metrics(tmp_path):
    """What the driver needs only once workers run (its submitter and instance router, the
    dashboard's routes and metrics) is built after the workers' start order is sent, while
    the launcher forks (docs/changelog/performance-history.md, "2026-11-26: Start-up with many
    worker processes"); all of it is there when init returns."""
    result = run_driver(tmp_path, """
        import sys, urllib.request
        import yrdask as yr
        from yrdask.deploy.embedded import EmbeddedCluster

        LATER = ("yrdask.runtime.submitter", "yrdask.runtime.instance_router",
                 "yrdask.dashboard.prometheus")
        launch = EmbeddedCluster.launch

        def recording_launch(self):
            launch(self)
            pipe = self.proc.stdin

            class Recorder:
                def write(self, data):
                    print("at the order:", [m for m in LATER if m in sys.modules], flush=True)
                    return pipe.write(data)

                def __getattr__(self, name):
                    return getattr(pipe, name)

            self.proc.stdin = Recorder()

        EmbeddedCluster.launch = recording_launch

        @yr.invoke
        def one():
            return 1

        info = yr.init(yr.Config(num_cpus=1))
        print("at init:", [m for m in LATER if m in sys.modules])
        base = info.dashboard_link.rsplit("/", 1)[0]
        with urllib.request.urlopen(base + "/metrics", timeout=60) as r:
            print("metrics:", b"yr_" in r.read())
        assert yr.get(one.invoke(), timeout=60) == 1
        yr.finalize()
    """)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "at the order: []" in result.stdout, result.stdout
    assert ("at init: ['yrdask.runtime.submitter', 'yrdask.runtime.instance_router', "
            "'yrdask.dashboard.prometheus']") in result.stdout, result.stdout
    assert "metrics: True" in result.stdout, result.stdout


def test_workers_start_light_and_follow_the_dask_pre_spawn_config(tmp_path, monkeypatch):
    """Start-up (docs/nodes.md): a worker process imports neither the scheduler nor the
    dashboard; the launcher starts before the driver imports dask, yet the Dask config's
    ``distributed.nanny.pre-spawn-environ`` reaches every worker (the launcher runs itself
    again for it), and the driver's own environment wins over both."""
    cfg = tmp_path / "dask-config"
    cfg.mkdir()
    (cfg / "spawn.yaml").write_text(textwrap.dedent("""
        distributed:
          nanny:
            pre-spawn-environ:
              OMP_NUM_THREADS: 3
              MALLOC_TRIM_THRESHOLD_: 1234
    """))
    monkeypatch.setenv("DASK_CONFIG", str(cfg))
    monkeypatch.setenv("MKL_NUM_THREADS", "5")
    result = run_driver(tmp_path, """
        import os, sys
        import yrdask as yr

        @yr.invoke
        def probe():
            heavy = sorted(m for m in sys.modules
                           if m.startswith(("yrdask.scheduler", "yrdask.dashboard")))
            env = [os.environ.get(k) for k in
                   ("OMP_NUM_THREADS", "MALLOC_TRIM_THRESHOLD_", "MKL_NUM_THREADS")]
            return heavy, env

        yr.init(yr.Config(num_cpus=1))
        print("PROBE", repr(yr.get(probe.invoke(), timeout=60)))
        yr.finalize()
    """)
    assert result.returncode == 0 and "PROBE" in result.stdout, result.stderr[-3000:]
    heavy, env = eval(result.stdout.split("PROBE", 1)[1].strip())  # noqa: S307 - our repr
    assert heavy == [], f"a worker process imported the scheduler side: {heavy}"
    assert env == ["3", "1234", "5"]


def test_init_freezes_the_started_heap_and_finalize_gives_it_back(cluster):
    """yr.init moves what is alive once the driver has started into the GC's permanent
    generation (collections in bursts skip it); yr.finalize gives it back, so objects of
    the ended session that became garbage are collected again."""
    import gc

    cluster.finalize()
    assert gc.get_freeze_count() == 0
    yr.init(yr.Config(num_cpus=2))
    try:
        frozen = gc.get_freeze_count()
        assert frozen > 10_000, frozen  # the imported libraries at least
        assert yr.get(where.invoke(), timeout=T)[0] != os.getpid()
    finally:
        yr.finalize()
    assert gc.get_freeze_count() == 0
    with dask.config.set({"yrdask.process.gc-freeze": False}):
        yr.init(yr.Config(num_cpus=2))
        try:
            assert gc.get_freeze_count() == 0
        finally:
            yr.finalize()
    gc.freeze()  # the program manages its collector itself: yr leaves its freeze alone
    try:
        own = gc.get_freeze_count()
        yr.init(yr.Config(num_cpus=2))
        try:  # (frozen objects freed since leave the count: it only ever falls)
            assert 0 < gc.get_freeze_count() <= own
        finally:
            yr.finalize()
        assert 0 < gc.get_freeze_count() <= own
    finally:
        gc.unfreeze()
    with dask.config.set({"yrdask.process.gc-freeze": "no"}):  # refused before a start
        with pytest.raises(yr.errors.YRValueError, match="gc-freeze is 'no'"):
            yr.init(yr.Config(num_cpus=2))
    assert not yr.is_initialized()
