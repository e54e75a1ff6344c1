"""One clear line per worker death on the embedded cluster, instead of Dask's nanny warnings.

The embedded cluster's launcher (``serve_workers``) shares the driver's stderr.  When a
worker process dies, its Dask nanny logs ``Restarting worker (status=Status.running)`` (and
more when it has to kill one): lines that name no worker and alarm users although yrdask
handles the death (the nanny starts a new process; yrdask restarts or ends the instances it
hosted and runs its tasks again).  :func:`install` rewrites the nanny's restart warning into
one line that names the worker, and keeps every other record as it is: errors (a nanny that
cannot start a worker) still show, and yrdask's own loggers are not touched.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

RESTARTING = "Restarting worker"
MAX_FRAMES = 12  # how far up the logging call to look for the nanny


def _nanny_of_caller() -> Any:
    """The Nanny whose method is logging now (found on the call stack), or None."""
    frame = sys._getframe(1)
    for _ in range(MAX_FRAMES):
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        if owner is not None and type(owner).__name__ == "Nanny":
            return owner
        frame = frame.f_back
    return None


class WorkerDeathLine(logging.Filter):
    """Turns the nanny's "Restarting worker" warning into one line naming the worker."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno != logging.WARNING or not str(record.msg).startswith(RESTARTING):
            return True
        nanny = _nanny_of_caller()
        worker = getattr(nanny, "worker_address", None) or "?"
        where = getattr(nanny, "address_safe", None) or getattr(nanny, "address", None) or "?"
        record.msg = ("yrdask: worker process %s died; its nanny %s is starting a new one "
                      "and yrdask restarts or ends the instances it hosted and runs its tasks "
                      "again (nothing to do)")
        record.args = (worker, where)
        return True


def install() -> None:
    """Add the filter to ``distributed.nanny`` (idempotent)."""
    log = logging.getLogger("distributed.nanny")
    if not any(isinstance(f, WorkerDeathLine) for f in log.filters):
        log.addFilter(WorkerDeathLine())
