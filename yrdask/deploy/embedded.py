"""The embedded cluster ``yr.init()`` starts when it is given no address.

The Dask scheduler (with the yr extension) runs on the driver's yr event loop.  The worker
processes run under Dask nannies in one subprocess, the *launcher* (``python -c`` running
:func:`serve_workers`, which ends in ``dask worker ADDR --preload yrdask``).  Sizing follows
SPEC §6: one worker process per core, at most ``num_cpus``, whose CPU offers add up to
``num_cpus`` × 1000 millicores.

Startup, in the order it happens (``import yrdask`` does not import distributed)::

    driver                                   launcher (python -c)
    yr.init: launch() ─── Popen ──────────▶  import distributed, yrdask, worker modules
    import distributed, build the scheduler  (both at once, one core each)
    start(): {"argv", "env"} ── stdin ────▶  dask worker: nannies fork the workers (~ms)
    wait: agents registered, nannies up  ◀── workers register, yr agents register

The nannies fork (``multiprocessing-method: fork``) instead of spawning a new interpreter, so
a worker, also one a nanny restarts after a crash, starts in milliseconds and shares the
launcher's imported modules (PSS).  Neither can re-run the user's script: the launcher never
imported it, so no ``if __name__ == "__main__"`` guard is needed.  The dashboard's Bokeh pages
are mounted at its first request (:class:`LazyDashboard`).

Lifetime: the cluster's processes end when the driver ends, however it ends (SIGKILL
included).  The driver holds the write end of the launcher's stdin and never writes to it
after the start order; the launcher reads it to its end in a thread (:func:`_die_with_driver`),
and EOF (the driver's process is gone, so the kernel closed its end; or :meth:`close` is
done) makes it kill its whole process tree (nannies' workers, their zygotes and isolated
children) and exit.  A worker also exits when its nanny's process dies (Dask's parent pipe),
and a zygote when its worker dies.  ``PR_SET_PDEATHSIG`` is not used for the launcher: it
fires when the driver *thread* that started it ends, not the process.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import uuid
from typing import Any, Callable

from yrdask.errors import YRRuntimeError

STARTUP_TIMEOUT_S = 60
#: Environment variable marking the processes of one embedded cluster (its token).
TOKEN_ENV = "YRDASK_EMBEDDED_CLUSTER"
#: How long ``close`` waits for a worker process to exit once it unregistered, and then for
#: ``dask worker`` once its workers are gone, before it kills them.
EXIT_GRACE_S = 1.0
#: How long ``close`` lets the workers take to unregister (then it kills them).
CLOSE_TIMEOUT_S = 10.0


def worker_layout(num_cpus: int | None) -> tuple[int, list[int]]:
    """(number of worker processes, CPU millicores each offers) for ``num_cpus``.

    The cores are those this process may use: its CPU affinity and the container's cgroup
    CPU quota count (Dask's ``dask.system.CPU_COUNT``), as Ray counts them, not every core
    of the host (``os.cpu_count()``): a 16-CPU container on a 192-core host starts 16."""
    import dask.system

    cores = dask.system.CPU_COUNT or 1
    total = num_cpus if num_cpus is not None else cores
    nprocs = max(1, min(cores, total))
    base, extra = divmod(total * 1000, nprocs)
    return nprocs, [base + (1 if i < extra else 0) for i in range(nprocs)]


class EmbeddedCluster:
    """A scheduler in this process plus the launcher subprocess of nanny-run workers.

    :meth:`launch` starts the launcher, :meth:`start` the scheduler (then it hands the
    launcher its address and waits for the workers), :meth:`close` stops both.
    """

    def __init__(self, num_cpus: int | None, security: Any = None,
                 num_gpus: int | None = None, resources: dict | None = None) -> None:
        self.num_cpus = num_cpus
        self.num_gpus = num_gpus  # None: the GPUs detected on this host
        self.resources = dict(resources or {})  # offered once by the node
        self.security = security  # a distributed.security.Security: the cluster uses TLS
        self.scheduler = None
        self.proc: subprocess.Popen | None = None
        # What the workers offer besides CPUs (node_env), found while the driver imports:
        # nvidia-smi can take a second, off the start-up's critical path here.
        self._node_env: concurrent.futures.Future | None = None
        # In the environment of the launcher and so of every worker it forks: tells this
        # cluster's processes from others, whatever their titles (Dask sets them if it can).
        self.token = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"

    def launch(self) -> None:
        """Start the launcher; it imports, then waits for :meth:`start` to send the address."""
        if self.proc is not None:
            return
        env = dict(os.environ)
        env.pop("YR_SERVER_ADDRESS", None)
        env[TOKEN_ENV] = self.token
        env.setdefault("DASK_LOGGING__DISTRIBUTED", "warning")
        env["DASK_DISTRIBUTED__WORKER__MULTIPROCESSING_METHOD"] = _START_METHOD
        # A nanny sets these in its process before it starts a worker; some only take effect
        # when a process starts (glibc reads MALLOC_TRIM_THRESHOLD_ then), so a forked
        # worker has them only if the launcher started with them.  Dask's defaults here; the
        # launcher applies ``distributed.nanny.pre-spawn-environ`` from the Dask config once
        # it has imported dask (:func:`_apply_pre_spawn_config`), so a driver that has not
        # imported dask starts it without importing dask first (~50 ms sooner).  One that
        # has may have set the config in process (``dask.config.set``): read here.
        if "dask" in sys.modules:
            import dask

            pre_spawn = dask.config.get("distributed.nanny.pre-spawn-environ", None) or {}
            for key, value in {**_PRE_SPAWN_ENV, **pre_spawn}.items():
                if value is not None:
                    env.setdefault(key, str(value))
            env[_DEFAULTED_ENV] = ""
        else:
            defaulted = [key for key in _PRE_SPAWN_ENV if key not in env]
            env.update({key: _PRE_SPAWN_ENV[key] for key in defaulted})
            env[_DEFAULTED_ENV] = ",".join(defaulted)
        self.proc = subprocess.Popen([sys.executable, "-c", _LAUNCHER], env=env,
                                     stdin=subprocess.PIPE, start_new_session=True)
        self._node_env = concurrent.futures.Future()
        threading.Thread(target=self._find_devices, name="yr-find-devices",
                         daemon=True).start()

    def _find_devices(self) -> None:
        try:
            self._node_env.set_result(self.node_env())
        except BaseException as e:  # noqa: BLE001 - re-raised by start()
            self._node_env.set_exception(e)

    async def start(self, after_order: Callable[[], None] | None = None) -> str:
        """Start the scheduler and the workers; returns the scheduler's address.

        What is not needed before the workers' start order (the dashboard's routes and
        metrics, and ``after_order``: the driver runtime's submitter and router) runs once
        the order is sent, while the launcher forks: off yr.init's critical path.
        """
        self.launch()
        from distributed import Scheduler

        from yrdask.deploy.preload import install_scheduler

        nprocs, cpus = worker_layout(self.num_cpus)
        # The embedded scheduler is an implementation detail: keep its INFO chatter quiet.
        dlog = logging.getLogger("distributed")
        if dlog.getEffectiveLevel() < logging.WARNING:
            dlog.setLevel(logging.WARNING)
        security, tls_env = _embedded_tls(self.security)
        # The dashboard's HTTP server listens at once; its Bokeh pages (an import of 0.5-1 s
        # and ~20 MB) are mounted at its first request (see LazyDashboard).
        self.scheduler = Scheduler(host="127.0.0.1", port=0, dashboard_address="127.0.0.1:0",
                                   dashboard=False, validate=False, **security)
        LazyDashboard(self.scheduler).install()
        ext = install_scheduler(self.scheduler)
        ext.defer_monitoring = True
        await self.scheduler
        address = self.scheduler.address
        # All nannies of one `dask worker` share its options; equal CPU offers per process.
        node_env = await asyncio.wrap_future(self._node_env)
        env = {"DASK_YRDASK__WORKER__CPU": str(cpus[-1]), **node_env, **tls_env}
        argv = [address, "--nworkers", str(nprocs), "--nthreads", "1", "--no-dashboard",
                "--preload", "yrdask", "--name", "yr-embedded"]
        try:
            self.proc.stdin.write(json.dumps({"argv": argv, "env": env}).encode() + b"\n")
            self.proc.stdin.flush()
        except OSError:
            pass  # it exited: reported below
        ext.start_monitoring()
        if after_order is not None:
            after_order()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + STARTUP_TIMEOUT_S
        while len(ext.ledger.processes) < nprocs:
            if self.proc.poll() is not None:
                raise YRRuntimeError(
                    f"the embedded cluster's workers exited with code {self.proc.returncode}")
            if loop.time() > deadline:
                raise YRRuntimeError(
                    f"the embedded cluster did not start {nprocs} workers in "
                    f"{STARTUP_TIMEOUT_S} s")
            ext.worker_added.clear()
            try:  # woken by each registration; the bound only re-checks the subprocess
                await asyncio.wait_for(ext.worker_added.wait(), 0.5)
            except asyncio.TimeoutError:
                pass
        # A nanny has started once it heard from its worker (it polls for that every 50 ms),
        # which can be after the worker registered; if the worker dies before, the nanny
        # fails to start and `dask worker` exits with all workers.  The scheduler tracks
        # nannies that have not reported back (as it does before broadcasting nanny plugins).
        while getattr(self.scheduler, "_starting_nannies", None):
            if self.proc.poll() is not None or loop.time() > deadline:
                raise YRRuntimeError("the embedded cluster's nannies did not start")
            await asyncio.sleep(0.01)
        return address

    def node_env(self) -> dict[str, str]:
        """What every worker process offers to the one node the cluster is (docs/nodes.md):
        the GPUs declared (``num_gpus``) or detected here once, the NPUs declared
        (``resources={"NPU": n}``) or detected, their models, and the other declared
        ``resources``, all node-wide (they do not add up over the processes)."""
        from yrdask.worker.devices import (NPU_VISIBLE_ENV, declared_ids, detect_gpus,
                                           detect_npus)

        resources = dict(self.resources)
        env = {}
        for kind, declared, detect, var, key in (
                ("GPU", self.num_gpus, detect_gpus, "CUDA_VISIBLE_DEVICES", "ACCELERATOR_TYPE"),
                ("NPU", resources.pop("NPU", None), detect_npus, NPU_VISIBLE_ENV, "NPU_TYPE")):
            ids, model = detect()  # declared devices keep the model of the ones found
            if declared is not None:
                ids = declared_ids(int(declared), var)
                model = model if ids else ""
            env[f"DASK_YRDASK__WORKER__{kind}S"] = repr(list(ids))
            if model:
                env[f"DASK_YRDASK__WORKER__{key}"] = repr(model)
        if resources:
            env["DASK_YRDASK__WORKER__NODE_RESOURCES"] = repr(
                {str(k): float(v) for k, v in resources.items()})
        return env

    async def close(self) -> None:
        """Stop the workers, then the scheduler; no process of the cluster is left after it.

        SIGTERM lets ``dask worker`` close its nannies, whose workers unregister from the
        scheduler (which keeps running meanwhile) and exit.  A worker process still alive
        ``EXIT_GRACE_S`` after it unregistered, which is what a task thread that never
        returns causes (the interpreter waits for it at exit), or ``CLOSE_TIMEOUT_S`` after
        the SIGTERM, is killed; so is the ``dask worker`` process if it does not follow.
        """
        loop = asyncio.get_running_loop()
        proc = self.proc
        if proc is not None:
            workers = self._worker_processes()
            pids = {p.pid for p in workers}
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            deadline = loop.time() + CLOSE_TIMEOUT_S
            # Poll: this loop runs the scheduler the workers say goodbye to.
            while self._registered(pids) and _alive(workers) and loop.time() < deadline:
                await asyncio.sleep(0.02)
            grace = min(deadline, loop.time() + EXIT_GRACE_S)
            while (proc.poll() is None or _alive(workers)) and loop.time() < grace:
                await asyncio.sleep(0.02)
            for p in _alive(workers):
                _kill(p)
            # The nannies see their workers gone and `dask worker` exits.
            deadline = loop.time() + EXIT_GRACE_S
            while proc.poll() is None and loop.time() < deadline:
                await asyncio.sleep(0.02)
            if proc.poll() is None:
                for p in _alive(self._worker_processes()):
                    _kill(p)
                proc.kill()
                proc.wait()
            if proc.stdin is not None:
                proc.stdin.close()
        if self.scheduler is not None:
            await self.scheduler.close()

    def _registered(self, pids: set[int]) -> bool:
        """Whether a worker process of ``pids`` is still registered with the scheduler."""
        workers = self.scheduler.workers.values() if self.scheduler is not None else ()
        return any(ws.pid in pids for ws in workers)

    def _worker_processes(self) -> list:
        """The worker processes now: the launcher's children, and the workers the scheduler
        knows that carry this cluster's token (a worker can outlive a killed launcher)."""
        import psutil

        procs = {}
        if self.proc.poll() is None:  # not reaped: the pid is still the launcher's
            try:
                for p in psutil.Process(self.proc.pid).children(recursive=True):
                    procs[p.pid] = p
            except psutil.Error:
                pass
        for ws in list(self.scheduler.workers.values()) if self.scheduler is not None else []:
            if ws.pid and ws.pid not in procs:
                try:
                    p = psutil.Process(ws.pid)
                    if p.environ().get(TOKEN_ENV) == self.token:
                        procs[p.pid] = p
                except psutil.Error:
                    pass
        return list(procs.values())


def _alive(procs: list) -> list:
    import psutil

    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.Error:
            pass
    return out


def _kill(p: Any) -> None:
    """SIGKILL a psutil.Process (psutil checks it is still the process it was, by pid and
    start time, so a reused pid is never hit)."""
    import psutil

    try:
        p.kill()
    except psutil.Error:
        pass


class LazyDashboard:
    """Mounts a scheduler's Bokeh dashboard when its HTTP server gets its first request.

    ``Scheduler(dashboard=False, dashboard_address=...)`` serves the plain HTTP routes (JSON,
    health, metrics, yr's own) without importing Bokeh.  This adds a catch-all route that
    matches until the dashboard is mounted: the first request imports the dashboard off the
    event loop, mounts it exactly as ``Scheduler(dashboard=True)`` would
    (``distributed.dashboard.scheduler.connect``), then redirects (307) to the same URL, which
    the dashboard now serves.  Pages added to ``distributed.dashboard.scheduler.applications``
    before that first request are included (yr's own pages mount themselves once Dask's
    application is there: ``yrdask.dashboard``).
    """

    def __init__(self, scheduler: Any, prefix: str = "/") -> None:
        self.scheduler = scheduler
        self.prefix = prefix
        self.mounted = False
        self._mounting: asyncio.Future | None = None

    def install(self) -> None:
        from tornado import web
        from tornado.routing import Matcher, Rule

        lazy = self

        class UntilMounted(Matcher):
            def match(self, request: Any) -> dict | None:
                return None if lazy.mounted else {}

        class MountDashboard(web.RequestHandler):
            async def prepare(self) -> None:
                await lazy.mount()
                self.redirect(self.request.uri, status=307)

        self.scheduler.http_application.add_handlers(
            r".*", [Rule(UntilMounted(), MountDashboard)])

    async def mount(self) -> None:
        if self._mounting is None:
            self._mounting = asyncio.ensure_future(self._mount())
        await asyncio.shield(self._mounting)

    async def _mount(self) -> None:
        import importlib

        loop = asyncio.get_running_loop()
        try:
            dash = await loop.run_in_executor(
                None, importlib.import_module, "distributed.dashboard.scheduler")
        except ImportError:  # what Scheduler(dashboard=True) does without Bokeh
            from distributed.http.utils import get_handlers

            self.scheduler.http_application.add_handlers(r".*", get_handlers(
                server=self.scheduler, modules=["distributed.http.scheduler.missing_bokeh"],
                prefix=self.prefix))
        else:
            dash.connect(self.scheduler.http_application, self.scheduler.http_server,
                         self.scheduler, prefix=self.prefix)
        self.mounted = True


#: Dask's default ``distributed.nanny.pre-spawn-environ`` (its config is only registered once
#: distributed is imported; values set by the user are read at launch).
_PRE_SPAWN_ENV = {"MALLOC_TRIM_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1",
                  "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}

_LAUNCHER = "from yrdask.deploy.embedded import serve_workers; serve_workers()"
#: In the launcher's environment: the keys of ``_PRE_SPAWN_ENV`` it got as defaults (the
#: driver's environment did not set them), which the Dask config may change.
_DEFAULTED_ENV = "YRDASK_PRE_SPAWN_DEFAULTED"

#: How the nannies start workers.  Forking the launcher is safe where fork is (Linux); macOS
#: system libraries are not fork-safe once threads ran, so there workers are spawned: slower,
#: and still without the user's script, which the launcher never imported.
_START_METHOD = "fork" if sys.platform.startswith("linux") else "spawn"

#: Modules a worker imports as it starts (yr's preload and agent; Dask's reseeding of
#: numpy.random; its worker HTTP routes are added from the config).
_WORKER_MODULES = ("yrdask.deploy.preload", "yrdask.worker.plugin", "yrdask.worker.agent",
                   "yrdask.worker.output", "yrdask.runtime.transport", "numpy.random",
                   "multiprocessing.synchronize")


def serve_workers() -> None:
    """The launcher (``python -c``): import what workers need, then run ``dask worker``.

    Its imports overlap the driver's scheduler startup.  The first stdin line, sent once the
    scheduler listens, is ``{"argv": [...], "env": {...}}``: the ``dask worker`` arguments and
    extra environment (Dask config) for the nannies and their workers.
    """
    import importlib

    import dask
    from distributed.cli import dask_worker

    _apply_pre_spawn_config()
    os.register_at_fork(after_in_child=_fresh_signal_handlers)
    # A nanny polls its new worker's start message this often (Dask: every 50 ms), and the
    # driver waits for every nanny to have it: poll more often, it costs microseconds.
    from distributed.nanny import WorkerProcess

    WorkerProcess._init_msg_interval = 0.005
    # What each worker would import after the fork: imported once here, it is shared memory.
    from yrdask.deploy.preload import WORKER_WARM_MODULES

    for module in (*_WORKER_MODULES, *WORKER_WARM_MODULES,
                   *dask.config.get("distributed.worker.http.routes")):
        try:
            importlib.import_module(module)
        except ImportError:
            pass
    # Each worker sends the scheduler Dask's version report when it registers; its package
    # versions are cached per process and ``platform.uname().processor`` runs ``uname -p``:
    # computed once here, every forked worker has them (~30-80 ms less per worker).
    from distributed.versions import get_versions

    get_versions()
    line = sys.stdin.readline()
    if not line:
        return  # the driver went away before its scheduler started
    order = json.loads(line)
    import threading

    threading.Thread(target=_die_with_driver, daemon=True, name="yr-driver-watch").start()
    os.environ.update(order["env"])
    dask.config.refresh()
    from yrdask.deploy import nanny_log

    nanny_log.install()  # one line naming the worker per worker death, on the driver's stderr
    dask_worker.main(order["argv"], prog_name="dask worker")


def _apply_pre_spawn_config() -> None:
    """In the launcher: the Dask config's ``distributed.nanny.pre-spawn-environ`` for the
    variables the driver's environment did not set.  The launcher started with Dask's
    defaults; when the config asks for other values it runs itself again with them (before
    it reads its start order), since some are only read when a process starts."""
    import dask

    defaulted = set(filter(None, os.environ.pop(_DEFAULTED_ENV, "").split(",")))
    wanted = dask.config.get("distributed.nanny.pre-spawn-environ", None) or {}
    change = {key: str(value) for key, value in wanted.items()
              if value is not None and (key in defaulted or key not in os.environ)
              and os.environ.get(key) != str(value)}
    if change:
        os.environ.update(change)
        os.execv(sys.executable, [sys.executable, "-c", _LAUNCHER])


def _die_with_driver() -> None:
    """In the launcher: wait for EOF on stdin (the driver is gone), then take every
    descendant down with SIGKILL and exit.  A normal :meth:`EmbeddedCluster.close` has
    stopped the workers before it closes stdin, so this only finds stragglers then."""
    # The raw descriptor, not sys.stdin: a forked worker closes sys.stdin (multiprocessing
    # does), which would wait forever on the buffer's lock held by this thread at the fork.
    try:
        while os.read(0, 65536):
            pass
    except OSError:
        pass
    import psutil

    try:
        tree = psutil.Process().children(recursive=True)
    except psutil.Error:
        tree = []
    for p in tree:  # a worker's zygote and isolated children are found here too
        try:
            p.kill()
        except psutil.Error:
            pass
    os._exit(1)


def _fresh_signal_handlers() -> None:
    """In a forked worker: SIGTERM and SIGINT handled as in a new interpreter.

    ``dask worker`` handles them in this process (they close the nannies), and a fork keeps
    the handlers; a worker must not, since Dask stops a worker with SIGTERM (memory limit,
    failed start) and expects it to die at once.
    """
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)


def _embedded_tls(security: Any) -> tuple[dict, dict[str, str]]:
    """Scheduler keyword arguments and worker environment for a TLS embedded cluster.

    Each role uses its own certificate from ``security`` or, when it has none, the client's
    (one certificate for a one-machine cluster).  The workers get theirs as Dask config in
    their environment; in-memory PEM text (``Security.temporary()``) passes through as well.
    """
    if security is None:
        return {}, {}
    from distributed.security import Security

    fields = {k: getattr(security, k) for k in Security.__slots__}
    for role in ("scheduler", "worker"):
        if not fields[f"tls_{role}_cert"]:
            fields[f"tls_{role}_cert"] = security.tls_client_cert
            fields[f"tls_{role}_key"] = security.tls_client_key
    fields["require_encryption"] = True
    env = {"DASK_DISTRIBUTED__COMM__REQUIRE_ENCRYPTION": "True",
           "DASK_DISTRIBUTED__COMM__TLS__CA_FILE": fields["tls_ca_file"],
           "DASK_DISTRIBUTED__COMM__TLS__WORKER__CERT": fields["tls_worker_cert"]}
    if fields["tls_worker_key"]:
        env["DASK_DISTRIBUTED__COMM__TLS__WORKER__KEY"] = fields["tls_worker_key"]
    return {"protocol": "tls", "security": Security(**fields)}, env
