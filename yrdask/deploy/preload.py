"""What ``dask scheduler/worker --preload yrdask`` runs: yr's extension or worker plugin.

The scheduler extension never imports the worker package; it is handed the worker plugin
here, and installs it on every worker (as distributed's shuffle extension does).

Each role imports only its own side: a worker process never imports the scheduler package
or the dashboard (about 0.2 s of imports per worker process, which made start-up grow with
the number of workers; docs/nodes.md, Start-up).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from yrdask.scheduler.extension import YrSchedulerExtension

#: What a worker imports before its agent takes work: every module that unpickling yr or
#: Ray work imports (~20 ms once per worker process; the embedded cluster's launcher
#: imports them before it forks its workers).  Imported by the task threads instead, the
#: first tasks of a fresh worker deadlocked in Python's import locks (worker/plugin.py).
WORKER_WARM_MODULES = ("yrdask.api.functions", "yrdask.api.instances", "yrdask.ray",
                       "yrdask.ray._alias", "yrdask.ray.util.queue")


def install_scheduler(scheduler: Any) -> YrSchedulerExtension:
    """Install yr's extension on ``scheduler`` (once), with the plugin it gives workers."""
    from yrdask.dashboard import install as install_dashboard
    from yrdask.scheduler.durable import DurableControl, open_store
    from yrdask.scheduler.extension import EXTENSION_NAME, YrSchedulerExtension
    from yrdask.worker.plugin import YrNannyPlugin, YrWorkerPlugin

    ext = scheduler.extensions.get(EXTENSION_NAME)
    if ext is None:
        store = open_store(scheduler)  # yrdask.state.path: what outlives this scheduler
        ext = YrSchedulerExtension(scheduler, worker_plugin=YrWorkerPlugin(WORKER_WARM_MODULES),
                                   monitoring=install_dashboard, nanny_plugin=YrNannyPlugin(),
                                   durable=DurableControl(store) if store is not None else None)
    return ext


async def dask_setup(server: object) -> None:
    """Dask preload hook: install yr on a scheduler or a worker (nannies need nothing)."""
    from distributed import Scheduler, Worker

    if isinstance(server, Worker):
        from yrdask.worker.plugin import YrWorkerPlugin

        await server.plugin_add(YrWorkerPlugin(WORKER_WARM_MODULES), name=YrWorkerPlugin.name)
    elif isinstance(server, Scheduler):
        install_scheduler(server)
