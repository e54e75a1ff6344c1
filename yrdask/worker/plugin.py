"""The Dask WorkerPlugin that installs yr's worker agent on a worker.

The scheduler extension registers it with the scheduler, so every worker, including ones
that join later or come back after a nanny restart, gets it.  ``dask worker --preload
yrdask`` installs it too, before the worker registers; when the scheduler's copy arrives it
adopts the agent that is already there instead of building a second one.

Before the agent exists (so before any work can reach the worker) the plugin imports the
modules it was given (the composition root, ``yrdask.deploy.preload``, names the facades):
a fresh worker's task threads then never import ``yrdask.ray`` at the same moment.  Two
threads that import a package and one of its submodules at once deadlock in Python's
per-module import locks (``_DeadlockError``) or hand user code a half-imported module.
"""

from __future__ import annotations

import importlib
from typing import Any

from distributed.diagnostics.plugin import NannyPlugin, WorkerPlugin

AGENT_KEY = "yr"


class YrWorkerPlugin(WorkerPlugin):
    """Creates (or adopts) the worker's :class:`~yrdask.worker.agent.WorkerAgent`."""

    name = "yrdask"
    idempotent = True

    def __init__(self, warm_modules: tuple[str, ...] = ()) -> None:
        #: imported before the agent takes work (one thread; see the module docstring)
        self.warm_modules = tuple(warm_modules)

    async def setup(self, worker: Any) -> None:
        from yrdask.worker import output
        from yrdask.worker.agent import WorkerAgent

        if AGENT_KEY in worker.extensions:
            return
        for module in self.warm_modules:
            importlib.import_module(module)
        agent = WorkerAgent(worker)
        worker.extensions[AGENT_KEY] = agent
        output.install(agent)  # prints of yr work go to drivers that ask (log_to_driver)
        await agent.register()

    async def teardown(self, worker: Any) -> None:
        # A plugin being replaced by the scheduler's copy keeps the agent; a closing worker
        # closes it.
        if worker.status.name in ("closing", "closed", "closing_gracefully", "failed"):
            agent = worker.extensions.pop(AGENT_KEY, None)
            if agent is not None:
                from yrdask.worker import output

                await output.uninstall(agent)
                await agent.close()


class YrNannyPlugin(NannyPlugin):
    """Tells the scheduler how each worker process of its nanny ended (exit code or signal),
    so that errors about work lost with it can say why (``WORKER_EXITED``); and unlinks the
    names of the nanny's queue semaphores once each worker process runs (nanny_sems)."""

    name = "yrdask-nanny"
    idempotent = True

    async def setup(self, nanny: Any) -> None:
        from yrdask import protocol as P
        from yrdask.worker import nanny_sems

        nanny_sems.install(nanny)  # no /dev/shm semaphore names a SIGKILL could strand
        original = nanny._on_worker_exit_sync  # what each new worker process calls at exit
        if getattr(original, "_yrdask", False):
            return
        # the pid of the running worker process (gone from the nanny by the time it exits),
        # so the scheduler ties a report that comes late to the process that ended
        pid = [nanny.pid or 0]
        instantiate = nanny.instantiate

        async def instantiate_noting_pid(*args: Any, **kwargs: Any) -> Any:
            result = await instantiate(*args, **kwargs)
            pid[0] = nanny.pid or 0
            return result

        def on_exit(exitcode: int) -> None:
            if exitcode:  # sent before the nanny starts the next worker process
                nanny.loop.add_callback(_report, nanny, P.WorkerExited(
                    nanny.address, int(exitcode), pid[0]))
            pid[0] = 0
            original(exitcode)

        on_exit._yrdask = True  # type: ignore[attr-defined]
        nanny._on_worker_exit_sync = on_exit
        nanny.instantiate = instantiate_noting_pid
        if nanny.process is not None:
            # a worker process that started before this plugin came (its nanny registered
            # before the scheduler's extension had started) took the nanny's callback then:
            # its exit is reported too (else a crash of its yr tasks is taken for an eviction)
            nanny.process.on_exit = on_exit


async def _report(nanny: Any, msg: Any) -> None:
    from yrdask import protocol as P

    try:
        await P.request(nanny.scheduler, msg)
    except Exception:  # noqa: BLE001 - the scheduler is gone or has no yrdask: nothing to tell
        pass
