"""The Dask WorkerPlugin that installs yr's worker agent on a worker.

The scheduler extension registers it with the scheduler, so every worker, including ones
that join later or come back after a nanny restart, gets it.  ``dask worker --preload
yrdask`` installs it too, before the worker registers; when the scheduler's copy arrives it
adopts the agent that is already there instead of building a second one.
"""

from __future__ import annotations

from typing import Any

from distributed.diagnostics.plugin import WorkerPlugin

AGENT_KEY = "yr"


class YrWorkerPlugin(WorkerPlugin):
    """Creates (or adopts) the worker's :class:`~yrdask.worker.agent.WorkerAgent`."""

    name = "yrdask"
    idempotent = True

    async def setup(self, worker: Any) -> None:
        from yrdask.worker import output
        from yrdask.worker.agent import WorkerAgent

        if AGENT_KEY in worker.extensions:
            return
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
