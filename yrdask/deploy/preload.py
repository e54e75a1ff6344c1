"""What ``dask scheduler/worker --preload yrdask`` runs: yr's extension or worker plugin.

The scheduler extension never imports the worker package; it is handed the worker plugin
here, and installs it on every worker (as distributed's shuffle extension does).
"""

from __future__ import annotations

from typing import Any

from distributed import Scheduler, Worker

from yrdask.dashboard import install as install_dashboard
from yrdask.scheduler.extension import EXTENSION_NAME, YrSchedulerExtension
from yrdask.worker.plugin import YrNannyPlugin, YrWorkerPlugin


def install_scheduler(scheduler: Any) -> YrSchedulerExtension:
    """Install yr's extension on ``scheduler`` (once), with the plugin it gives workers."""
    ext = scheduler.extensions.get(EXTENSION_NAME)
    if ext is None:
        ext = YrSchedulerExtension(scheduler, worker_plugin=YrWorkerPlugin(),
                                   monitoring=install_dashboard, nanny_plugin=YrNannyPlugin())
    return ext


async def dask_setup(server: object) -> None:
    """Dask preload hook: install yr on a scheduler or a worker (nannies need nothing)."""
    if isinstance(server, Scheduler):
        install_scheduler(server)
    elif isinstance(server, Worker):
        await server.plugin_add(YrWorkerPlugin(), name=YrWorkerPlugin.name)
