"""The embedded cluster ``yr.init()`` starts when it is given no address.

The Dask scheduler (with the yr extension) runs on the driver's yr event loop; the worker
processes run under Dask nannies in one ``dask worker`` subprocess started with
``python -m``, so the user's script is never imported again in a child process (no
``if __name__ == "__main__"`` guard needed).  Sizing follows SPEC §6: one worker process per
core, at most ``num_cpus``, whose CPU offers add up to ``num_cpus`` × 1000 millicores.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys

from yrdask.errors import YRRuntimeError

STARTUP_TIMEOUT_S = 60


def worker_layout(num_cpus: int | None) -> tuple[int, list[int]]:
    """(number of worker processes, CPU millicores each offers) for ``num_cpus``."""
    cores = os.cpu_count() or 1
    total = num_cpus if num_cpus is not None else cores
    nprocs = max(1, min(cores, total))
    base, extra = divmod(total * 1000, nprocs)
    return nprocs, [base + (1 if i < extra else 0) for i in range(nprocs)]


class EmbeddedCluster:
    """A scheduler in this process plus a ``dask worker`` subprocess of nanny-run workers."""

    def __init__(self, num_cpus: int | None) -> None:
        self.num_cpus = num_cpus
        self.scheduler = None
        self.proc: subprocess.Popen | None = None

    async def start(self) -> str:
        from distributed import Scheduler

        from yrdask.scheduler.extension import YrSchedulerExtension

        nprocs, cpus = worker_layout(self.num_cpus)
        # The embedded scheduler is an implementation detail: keep its INFO chatter quiet.
        dlog = logging.getLogger("distributed")
        if dlog.getEffectiveLevel() < logging.WARNING:
            dlog.setLevel(logging.WARNING)
        self.scheduler = Scheduler(host="127.0.0.1", port=0, dashboard_address="127.0.0.1:0",
                                   validate=False)
        ext = YrSchedulerExtension(self.scheduler)
        await self.scheduler
        address = self.scheduler.address
        env = dict(os.environ)
        # All nannies of one `dask worker` share its options; equal CPU offers per process.
        env["DASK_YRDASK__WORKER__CPU"] = str(cpus[-1])
        env.pop("YR_SERVER_ADDRESS", None)
        env.setdefault("DASK_LOGGING__DISTRIBUTED", "warning")
        cmd = [
            sys.executable, "-m", "distributed.cli.dask_worker", address,
            "--nworkers", str(nprocs), "--nthreads", "1", "--no-dashboard",
            "--preload", "yrdask",
            "--name", "yr-embedded",
        ]
        self.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL,
                                     start_new_session=True)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + STARTUP_TIMEOUT_S
        while len(ext.ledger.workers) < nprocs:
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
        return address

    async def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            # Poll: the workers need this loop (the scheduler) to say goodbye while we wait,
            # and no executor thread is left at interpreter exit (atexit finalize).
            deadline = asyncio.get_running_loop().time() + 20
            while self.proc.poll() is None and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.05)
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        if self.scheduler is not None:
            await self.scheduler.close()
