"""A ``dask worker`` nanny's semaphores get no name in ``/dev/shm`` that can outlive it.

Each time a nanny starts a worker process it makes two ``multiprocessing`` queues (the
worker's start report and its stop channel: three semaphores each).  Under Dask's default
``spawn`` method each semaphore is a *named* POSIX semaphore, ``/dev/shm/sem.mp-*``, that
stays named until the nanny's queue is collected or the resource tracker (a child of the
nanny) unlinks it.  A SIGKILL of the whole process tree (``kill -9 -- -PGID``, a container
or systemd unit stop, a test's tree kill) takes the tracker with it and leaves six
semaphores in ``/dev/shm`` for every nanny.

The names are only needed until the worker process has opened them, which it has once it
reported back (the nanny's ``instantiate`` returned with the process running).  From then
on both processes hold the semaphores by handle, so the nanny unlinks the names then, the
way the queue's own finalizer would at exit (and tells the tracker), leaving nothing that a
SIGKILL could strand.  Only the few seconds while a worker process starts stay exposed.  A
nanny using ``fork`` makes unnamed semaphores; nothing changes there.
"""

from __future__ import annotations

import asyncio
from typing import Any

from distributed.core import Status


def _queue_semaphore_names(process: Any) -> set[str]:
    """Names of the semaphores of a ``WorkerProcess``'s two queues (empty when unnamed)."""
    names: set[str] = set()
    for queue in (getattr(process, "init_result_q", None), getattr(process, "child_stop_q", None)):
        for attr in ("_rlock", "_wlock", "_sem"):
            lock = getattr(queue, attr, None)
            name = getattr(getattr(lock, "_semlock", None), "name", None)
            if name:
                names.add(name)
    return names


def unname_running_process(process: Any) -> int:
    """Unlink the ``/dev/shm`` names of a running worker process's queue semaphores; return
    how many.  Runs each semaphore's own finalizer (``sem_unlink`` + resource tracker
    unregister) early, so nothing runs twice or warns at exit."""
    from multiprocessing import util
    from multiprocessing.synchronize import SemLock

    if process is None or getattr(process, "status", None) != Status.running:
        return 0
    names = _queue_semaphore_names(process)
    if not names:
        return 0
    done = 0
    for key in list(util._finalizer_registry):
        finalizer = util._finalizer_registry.get(key)
        if (finalizer is None or getattr(finalizer, "_callback", None) is not SemLock._cleanup
                or not finalizer._args or finalizer._args[0] not in names):
            continue
        try:
            finalizer()  # removes itself from the registry: the queue's collection is quiet
        except OSError:  # already unlinked: nothing left to do for this one
            pass
        done += 1
    return done


def install(nanny: Any) -> None:
    """Unname the queue semaphores of ``nanny``'s worker process now (if it is running or
    starting) and after every later start (restarts after a worker death included)."""
    original = nanny.instantiate
    if getattr(original, "_yrdask_sems", False):
        return

    async def instantiate() -> Any:
        status = await original()
        unname_running_process(nanny.process)
        return status

    instantiate._yrdask_sems = True  # type: ignore[attr-defined]
    nanny.instantiate = instantiate
    process = nanny.process
    if process is not None and process.status == Status.starting:
        asyncio.ensure_future(_unname_once_running(process))
    else:
        unname_running_process(process)


async def _unname_once_running(process: Any) -> None:
    await process.running.wait()
    unname_running_process(process)
