"""Shared fixtures of the yrdask acceptance suite: real multi-process clusters and leak checks.

yr is process-global, so one ``ClusterManager`` (the session fixture ``cluster``) keeps at most
one yr runtime active and re-initialises only when the requested cluster kind or parameters
change::

    cluster()                                        # embedded, Config(num_cpus=2)
    cluster(kind="embedded", num_cpus=1)
    cluster(kind="cli", workers=[{"resources": "gpu_node=1"}, {}])

The "cli" kind starts real ``dask scheduler`` / ``dask worker`` subprocesses with
``--preload yrdask`` and joins them with ``yr.init(yr.Config(server_address=...))``.  The
processes of the last requested cli cluster stay up while the runtime switches to another kind,
so switching back only re-runs ``yr.init``.  ``cluster.cli_processes(workers)`` gives the
processes with no runtime attached, for tests that call ``yr.init`` themselves.

Fixtures that pick a cluster:

* ``yr_cluster`` -- the core kinds, parametrised per module over ``["embedded", "cli"]``
  (``cluster_kind`` is module scoped, so pytest groups a module's tests by kind);
* ``cli_cluster`` -- the standard cli cluster: one worker tagged ``gpu_node=1``, one plain.

At session end ``_leak_check`` asserts that no child process of the test process, no
non-daemon thread other than the main one and no open socket (comm or listener) is left once
everything is finalised.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Callable

import psutil
import pytest

TESTS_DIR = pathlib.Path(__file__).resolve().parent
ROOT = TESTS_DIR.parent

# Worker processes import the test modules by name when they unpickle the functions and
# exception classes defined there, and import yrdask for --preload: put both on their path.
os.environ["PYTHONPATH"] = os.pathsep.join(
    [str(TESTS_DIR), str(ROOT)]
    + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
)
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
# The suite decides which cluster each test talks to.
os.environ.pop("YR_SERVER_ADDRESS", None)
# A scheduler on a fixed port keeps its detached instances and KV in a state file by default
# (docs/faults.md, "Scheduler restart"): tests reuse ports, so no cluster of theirs keeps
# state unless the test names a file of its own (tests/test_scheduler_restart.py).
os.environ.setdefault("DASK_YRDASK__STATE__PATH", "false")

import yrdask as yr  # noqa: E402

#: The standard cli cluster: a worker offering the custom tag ``gpu_node`` and a plain one.
CLI_WORKERS: list[dict[str, Any]] = [{"resources": "gpu_node=1"}, {}]

#: Parameters of the core cluster kinds that ``yr_cluster`` runs the acceptance programs on.
CORE_KINDS: dict[str, dict[str, Any]] = {
    "embedded": {"kind": "embedded", "num_cpus": 2},
    "cli": {"kind": "cli", "workers": CLI_WORKERS},
}

STARTUP_TIMEOUT = 60  # seconds for a scheduler / worker to come up
STOP_TIMEOUT = 20  # seconds for a process to exit after SIGTERM


def wait_until(predicate: Callable[[], Any], timeout: float, what: str | Callable[[], str],
               interval: float = 0.05):
    """Poll ``predicate`` until it is truthy; fail naming ``what`` after ``timeout`` seconds.

    For eventual state kept by another process (a file a task writes, the scheduler's view of
    an instance), never to order events.  ``what`` may be a callable, so a failure message can
    describe the state at the time of failure.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            desc = what() if callable(what) else what
            raise AssertionError(f"timed out after {timeout} s waiting for {desc}")
        time.sleep(interval)


def dask_worker_pids() -> dict[int, str]:
    """Dask's view of the embedded cluster's worker processes, pid -> address (its scheduler
    runs on this process's yr loop).  By pid: a restarted worker may get its predecessor's
    port.  ``dict.items`` copies in C: the scheduler's ``workers`` is a SortedDict, whose own
    items view iterates in Python, so the loop's thread could remove a worker between a key
    and its lookup (KeyError) while a test polls for exactly that removal."""
    from yrdask.runtime.context import current_runtime

    workers = current_runtime().cluster.scheduler.workers
    return {ws.pid: address for address, ws in list(dict.items(workers))}


def wake_ups(pid: int) -> int:
    """Context switches of every thread of ``pid`` so far (Linux's /proc; each wake-up is
    one): read before and after an idle window to count how often a process woke in it."""
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/status") as f:
            total += sum(int(line.split()[1]) for line in f
                         if line.startswith(("voluntary_ctxt", "nonvoluntary_ctxt")))
    return total


def wait_for_file(path: str, timeout: float = 60) -> None:
    """Block, inside a task or method, until the test creates ``path``.

    Lets a test hold work in flight (running on a worker) until it has done what it must
    do meanwhile (kill a process, fill a queue), without timing assumptions.
    """
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} never appeared")
        time.sleep(0.01)


def check_in(folder: str, n: int, timeout: float = 60) -> None:
    """Inside a task: check in under ``folder``, then wait until ``n`` tasks checked in (so
    they ran at the same time). Each check-in is a file named after the checking process."""
    open(os.path.join(folder, str(os.getpid())), "w").close()
    deadline = time.monotonic() + timeout
    while len(os.listdir(folder)) < n:
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {os.listdir(folder)} checked in")
        time.sleep(0.01)


def spin(ms: float) -> int:
    """Busy CPU for ``ms`` milliseconds, inside a task: wide enough to see on Dask's Task
    Stream and to be sampled by its profiler (which counts each sample on the caller of the
    deepest Python frame, so callers name the work)."""
    end = time.perf_counter() + ms / 1000
    n = 0
    while time.perf_counter() < end:
        n += 1
    return n


def _tail(path: pathlib.Path, n: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "<no log>"


def _process_tree(pid: int) -> set[int]:
    """``pid`` and every live process below it (a ``dask worker`` CLI is a nanny with a child)."""
    try:
        proc = psutil.Process(pid)
        return {pid} | {c.pid for c in proc.children(recursive=True)}
    except psutil.NoSuchProcess:
        return set()


def _stop_process(proc: subprocess.Popen, timeout: float = STOP_TIMEOUT) -> None:
    """SIGTERM the process we started, wait, then SIGKILL; then reap anything it left below it."""
    _stop_processes([proc], timeout)


def _stop_processes(procs: list[subprocess.Popen], timeout: float = STOP_TIMEOUT) -> None:
    """SIGTERM the processes we started, all before any is waited for (their graceful
    shutdowns overlap instead of adding up), wait, then SIGKILL; then reap what they left."""
    live = [p for p in procs if p.poll() is None]
    below: list[psutil.Process] = []
    for proc in live:
        try:
            below += psutil.Process(proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            pass
    for proc in live:
        try:
            os.kill(proc.pid, signal.SIGTERM)
        except ProcessLookupError:  # exited meanwhile; reaped by wait below
            pass
    deadline = time.monotonic() + timeout
    for proc in live:
        try:
            proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(10)
    _, alive = psutil.wait_procs(below, timeout=10)
    for p in alive:  # orphans of the processes we started
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=5)


def named_semaphores(pids: list[int]) -> tuple[set[str], set[str]]:
    """The ``/dev/shm/sem.mp-*`` semaphores the processes ``pids`` have open: (all of them,
    those whose name is still in /dev/shm).  Scoped to our processes: other programs on the
    machine may make and drop their own semaphores meanwhile."""
    mapped: set[str] = set()
    for p in pids:
        try:
            with open(f"/proc/{p}/maps") as maps:
                for line in maps:
                    path = line.split(None, 5)[-1].strip()
                    if path.startswith("/dev/shm/sem.mp-"):
                        mapped.add(path.split(" ")[0])
        except OSError:
            pass
    return mapped, {m for m in mapped if os.path.exists(m)}


@dataclasses.dataclass
class WorkerProc:
    """One ``dask worker`` subprocess started by the suite."""

    name: str
    resources: str
    proc: subprocess.Popen
    log: pathlib.Path

    @property
    def pid(self) -> int:
        return self.proc.pid

    def pids(self) -> set[int]:
        """The CLI process and the processes under it (nanny -> worker process)."""
        return _process_tree(self.pid)


def kill_node(worker: WorkerProc) -> None:
    """``SIGKILL`` every process of a worker that is a node of its own (its nanny and worker
    process) and wait until its store is gone: the node's reaper removes it once no process
    of it lives, so the values it kept are really lost."""
    from yrdask.runtime.store import store_dir

    procs = [psutil.Process(p) for p in worker.pids()]
    for p in procs:
        p.send_signal(signal.SIGKILL)
    psutil.wait_procs(procs, timeout=10)
    worker.proc.wait(10)
    where = store_dir(f"node-{worker.name}")
    wait_until(lambda: not os.path.exists(where), 30, f"the killed node's store {where} removed")


@dataclasses.dataclass
class CliCluster:
    """A scheduler and workers started with ``--preload yrdask`` as subprocesses."""

    spec: tuple
    address: str
    scheduler: subprocess.Popen | None
    workers: list[WorkerProc]
    workdir: pathlib.Path
    _counter: int = 0
    scheduler_cmd: tuple = ()
    scheduler_env: dict | None = None

    def alive(self) -> bool:
        return self.scheduler.poll() is None and all(w.proc.poll() is None for w in self.workers)

    def worker_with(self, tag: str) -> WorkerProc:
        matches = [w for w in self.workers if tag in w.resources]
        assert len(matches) == 1, f"expected one worker tagged {tag!r}, got {matches}"
        return matches[0]

    def worker_pids(self) -> set[int]:
        return set().union(*(w.pids() for w in self.workers))

    def _launch_worker(self, resources: str = "", nthreads: int = 1, name: str | None = None,
                       node: str | None = None, env: dict[str, str] | None = None):
        """Start a ``dask worker`` (``env`` added to its environment); it plays the host
        ``node`` (default: a node of its own, ``node-<name>``, as Ray's cluster_utils adds
        nodes; docs/nodes.md)."""
        self._counter += 1
        name = name or f"w{self._counter}"
        log = self.workdir / f"worker-{name}.log"
        cmd = [
            sys.executable, "-m", "distributed.cli.dask_worker", self.address,
            "--preload", "yrdask", "--nthreads", str(nthreads), "--name", name,
        ]
        if resources:
            cmd += ["--resources", resources]
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, cwd=self.workdir,
                env={**os.environ, "YRDASK_NODE_ID": node or f"node-{name}", **(env or {})},
            )
        worker = WorkerProc(name=name, resources=resources, proc=proc, log=log)
        self.workers.append(worker)
        return worker

    def _wait_for_workers(self, n: int) -> None:
        from distributed import Client

        try:
            with Client(self.address, timeout=STARTUP_TIMEOUT, set_as_default=False) as client:
                client.wait_for_workers(n, timeout=STARTUP_TIMEOUT)
        except Exception as exc:
            logs = "\n".join(f"--- {w.name} (rc={w.proc.poll()})\n{_tail(w.log)}" for w in self.workers)
            raise RuntimeError(f"cli workers did not join {self.address}: {exc!r}\n{logs}") from exc

    def add_worker(self, resources: str = "", nthreads: int = 1, name: str | None = None,
                   node: str | None = None) -> WorkerProc:
        """Start one more worker and wait until the scheduler lists it."""
        worker = self._launch_worker(resources, nthreads, name, node)
        self._wait_for_workers(len(self.workers))
        return worker

    def remove_worker(self, worker: WorkerProc) -> None:
        _stop_process(worker.proc)
        self.workers.remove(worker)

    def _launch_scheduler(self) -> None:
        """Start the ``dask scheduler`` and wait for its address file (a restart writes it
        anew)."""
        sched_file = self.workdir / "sched.json"
        log = self.workdir / "scheduler.log"
        sched_file.unlink(missing_ok=True)
        with open(log, "ab") as out:
            self.scheduler = sched = subprocess.Popen(
                self.scheduler_cmd, stdin=subprocess.DEVNULL, stdout=out,
                stderr=subprocess.STDOUT, cwd=self.workdir,
                env={**os.environ, **(self.scheduler_env or {})})
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while True:
            if sched.poll() is not None:
                raise RuntimeError(f"dask scheduler exited with {sched.returncode}:\n{_tail(log)}")
            try:
                self.address = json.loads(sched_file.read_text())["address"]
                return
            except (OSError, ValueError, KeyError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"dask scheduler wrote no {sched_file}:\n{_tail(log)}")
            time.sleep(0.1)

    def restart_scheduler(self, sig: int = signal.SIGKILL) -> None:
        """Stop the scheduler with ``sig`` and start it again with the same command line
        (a fixed ``port`` brings it back at the same address)."""
        os.kill(self.scheduler.pid, sig)
        self.scheduler.wait(STOP_TIMEOUT)
        self._launch_scheduler()

    @classmethod
    def start(cls, workers: list[dict[str, Any]], workdir: pathlib.Path, port: int = 0,
              env: dict[str, str] | None = None) -> "CliCluster":
        """A scheduler (on ``port``, with ``env`` added to its environment) and ``workers``."""
        workdir.mkdir(parents=True, exist_ok=True)
        cmd = (
            sys.executable, "-m", "distributed.cli.dask_scheduler", "--preload", "yrdask",
            "--port", str(port), "--dashboard-address", ":0",
            "--scheduler-file", str(workdir / "sched.json"),
        )
        cluster = cls(spec=_freeze(workers), address="", scheduler=None, workers=[],
                      workdir=workdir, scheduler_cmd=cmd, scheduler_env=env)
        try:
            cluster._launch_scheduler()
            for spec in workers:
                cluster._launch_worker(spec.get("resources", ""), spec.get("nthreads", 1),
                                       spec.get("name"), spec.get("node"), spec.get("env"))
            cluster._wait_for_workers(len(workers))
        except BaseException:
            cluster.stop()
            raise
        return cluster

    def stop(self) -> None:
        _stop_processes([w.proc for w in self.workers])  # workers first, all at once
        self.workers.clear()
        if self.scheduler is not None:
            _stop_process(self.scheduler)


def _freeze(value: Any) -> Any:
    if isinstance(value, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    return value


@dataclasses.dataclass
class Cluster:
    """The cluster the active yr runtime is attached to."""

    kind: str
    key: tuple
    cli: CliCluster | None = None
    scheduler_address: str | None = None  # what yr.init reported (embedded or cli)

    @property
    def address(self) -> str | None:
        return self.cli.address if self.cli else self.scheduler_address

    def worker_pids(self) -> set[int] | None:
        """Pids of the cli worker processes (None for an embedded cluster)."""
        return self.cli.worker_pids() if self.cli else None


class ClusterManager:
    """Keeps at most one yr runtime (and one set of cli processes) alive for the session."""

    def __init__(self, workdir: pathlib.Path) -> None:
        self.workdir = workdir
        self.active: Cluster | None = None
        self.cli: CliCluster | None = None
        self._n = 0

    def __call__(self, kind: str = "embedded", **params: Any) -> Cluster:
        defaults = {"embedded": {"num_cpus": 2}, "cli": {"workers": CLI_WORKERS}}
        params = {**defaults.get(kind, {}), **params}
        key = (kind, _freeze(params))
        if self.active is not None and self.active.key == key and yr.is_initialized():
            return self.active
        self.finalize()
        if kind == "embedded":
            info = yr.init(yr.Config(num_cpus=params["num_cpus"]))
            self.active = Cluster(kind, key, scheduler_address=info.scheduler_address)
        elif kind == "cli":
            cli = self.cli_processes(params["workers"])
            info = yr.init(yr.Config(server_address=cli.address))
            self.active = Cluster(kind, key, cli, scheduler_address=info.scheduler_address)
        else:
            raise ValueError(f"unknown cluster kind {kind!r}")
        return self.active

    def cli_processes(self, workers: list[dict[str, Any]] = CLI_WORKERS) -> CliCluster:
        """Running cli processes for ``workers``, with no yr runtime active (it is finalised)."""
        self.finalize()
        spec = _freeze(workers)
        if self.cli is not None and self.cli.spec == spec and self.cli.alive():
            return self.cli
        self.stop_cli()
        self._n += 1
        self.cli = CliCluster.start(workers, self.workdir / f"cli{self._n}")
        return self.cli

    def finalize(self) -> None:
        """End the yr runtime, whoever started it."""
        if yr.is_initialized():
            yr.finalize()
        self.active = None

    def stop_cli(self) -> None:
        if self.cli is not None:
            cli, self.cli = self.cli, None
            cli.stop()

    def close(self) -> None:
        try:
            self.finalize()
        finally:
            self.stop_cli()


def _is_multiprocessing_helper(proc: psutil.Process) -> bool:
    """Python's own per-process helpers (resource tracker, forkserver) live until exit."""
    try:
        cmd = " ".join(proc.cmdline())
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return True
    return "multiprocessing.resource_tracker" in cmd or "multiprocessing.forkserver" in cmd


def _describe(proc: psutil.Process) -> str:
    try:
        return f"{proc.pid}: {' '.join(proc.cmdline())[:200]}"
    except psutil.Error:
        return f"{proc.pid}: <gone>"


@pytest.fixture(scope="session", autouse=True)
def _leak_check():
    """After everything is finalised, no child processes and no stray non-daemon threads."""
    yield
    if yr.is_initialized():  # a test that initialised on its own and did not finalise
        yr.finalize()
    me = psutil.Process()
    children = [p for p in me.children(recursive=True) if not _is_multiprocessing_helper(p)]
    _, alive = psutil.wait_procs(children, timeout=10)
    leaked = [_describe(p) for p in alive]
    for p in alive:  # do not leave them running on the machine
        try:
            p.kill()
        except psutil.Error:
            pass

    def stray_threads():
        return [
            t for t in threading.enumerate()
            if t is not threading.main_thread() and not t.daemon and t.is_alive()
        ]

    deadline = time.monotonic() + 5
    while stray_threads() and time.monotonic() < deadline:
        stray_threads()[0].join(0.1)
    threads = [t.name for t in stray_threads()]

    def open_sockets():
        return [f"{c.status} {c.laddr} -> {c.raddr}" for c in me.net_connections(kind="inet")
                if c.status in (psutil.CONN_ESTABLISHED, psutil.CONN_LISTEN)]

    deadline = time.monotonic() + 5  # comms closed by finalize may take a moment to go
    while open_sockets() and time.monotonic() < deadline:
        time.sleep(0.1)
    sockets = open_sockets()
    assert not leaked and not threads and not sockets, (
        f"left after finalize: child processes {leaked}, non-daemon threads {threads}, "
        f"open sockets (comms, servers) {sockets}"
    )


@pytest.fixture(scope="module", autouse=True)
def _module_environ():
    """Each test module gives ``os.environ`` back as it found it.  Dask's ``Nanny`` writes its
    pre-spawn environment (``OMP_NUM_THREADS=1``, ``MALLOC_TRIM_THRESHOLD_=65536``, ...) into
    the process that starts it and leaves it there, so a module that starts an in-process
    ``LocalCluster`` would hand those values to every later test's subprocesses."""
    saved = dict(os.environ)
    yield
    if os.environ != saved:
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture(scope="session")
def cluster(_leak_check, tmp_path_factory) -> ClusterManager:
    """The session's ``ClusterManager``; call it to get a runtime on a given kind of cluster."""
    manager = ClusterManager(tmp_path_factory.mktemp("clusters"))
    yield manager
    manager.close()


@pytest.fixture(scope="module", params=list(CORE_KINDS))
def cluster_kind(request) -> str:
    """The core cluster kind a module's tests run on (module scoped: tests group by kind)."""
    return request.param


@pytest.fixture
def yr_cluster(cluster: ClusterManager, cluster_kind: str) -> Cluster:
    """An initialised yr runtime on the module's current core kind."""
    return cluster(**CORE_KINDS[cluster_kind])


@pytest.fixture
def cli_cluster(cluster: ClusterManager) -> Cluster:
    """An initialised yr runtime on the standard cli cluster (``CLI_WORKERS``)."""
    return cluster(**CORE_KINDS["cli"])


@pytest.fixture(name="wait_until")
def _wait_until_fixture():
    """``wait_until(predicate, timeout, what)``: poll a condition (files written by tasks)."""
    return wait_until


# -- an instance class for the monitoring tests (test_dashboard, test_status_cli) -----------


@yr.instance
class Greeter:
    """A named instance for the monitoring views to list: counts its ``hello`` calls."""

    def __init__(self) -> None:
        self.calls = 0

    def hello(self) -> int:
        self.calls += 1
        return self.calls


@pytest.fixture
def ray_env(cluster, request):
    """yrdask.ray on the embedded cluster (two 1-CPU workers), in a namespace of its own;
    ``ray.shutdown()`` after the test detaches (the suite's runtime stays)."""
    import yrdask.ray as ray

    cluster()
    ray.init(namespace=f"{request.module.__name__.rpartition('.')[2]}-{os.urandom(3).hex()}")
    yield ray
    ray.shutdown()


def pending_greeter(name: str) -> Any:
    """A :class:`Greeter` that stays PENDING: it asks for 64 CPUs, more than any test worker
    offers, and its request waits two minutes before it times out."""
    return Greeter.options(yr.InvokeOptions(name=name, cpu=64_000, memory=0,
                                            schedule_timeout_ms=120_000)).invoke()
