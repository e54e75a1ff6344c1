"""One clear line per worker death on the embedded cluster, instead of Dask's nanny warnings.

The embedded cluster's launcher (``serve_workers``) shares the driver's stderr.  When a
worker process dies, its Dask nanny logs ``Restarting worker (status=Status.running)`` (and
more when it has to kill one): lines that name no worker and alarm users although yrdask
handles the death (the nanny starts a new process; yrdask restarts or ends the instances it
hosted and runs its tasks again).  :func:`install` rewrites the nanny's restart warning into
one line that names the worker, and keeps every other record as it is: errors (a nanny that
cannot start a worker) still show, and yrdask's own loggers are not touched.  A process
that ended on purpose for ``cancel(force=True)`` (exit code ``FORCED_CANCEL_EXIT``) is not
reported at all: the user asked for it.  A worker that closes while a heartbeat is in flight
makes Dask log a heartbeat ERROR with a traceback; that one is dropped too (nothing failed).
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from yrdask.protocol import FORCED_CANCEL_EXIT

RESTARTING = "Restarting worker"
MAX_FRAMES = 12  # how far up the logging call to look for the nanny


def _nanny_of_caller() -> tuple[Any, int | None]:
    """The Nanny whose method is logging now (found on the call stack), or None, and the
    exit code of its worker process that the method was handed (``_on_worker_exit``)."""
    frame = sys._getframe(1)
    for _ in range(MAX_FRAMES):
        if frame is None:
            return None, None
        owner = frame.f_locals.get("self")
        if owner is not None and type(owner).__name__ == "Nanny":
            return owner, frame.f_locals.get("exitcode")
        frame = frame.f_back
    return None, None


class WorkerDeathLine(logging.Filter):
    """Turns the nanny's "Restarting worker" warning into one line naming the worker."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno != logging.WARNING or not str(record.msg).startswith(RESTARTING):
            return True
        nanny, exitcode = _nanny_of_caller()
        if exitcode == FORCED_CANCEL_EXIT:
            return False  # ended on purpose by cancel(force=True): nothing to report
        worker = getattr(nanny, "worker_address", None) or "?"
        where = getattr(nanny, "address_safe", None) or getattr(nanny, "address", None) or "?"
        record.msg = ("yrdask: worker process %s died; its nanny %s is starting a new one "
                      "and yrdask restarts or ends the instances it hosted and runs its tasks "
                      "again (nothing to do)")
        record.args = (worker, where)
        return True


HEARTBEAT_FAILED = "Failed to communicate with scheduler during heartbeat"
CLOSING = {"closing", "closing_gracefully", "closed"}


def _worker_of_caller() -> Any:
    """The Dask Worker whose method is logging now (found on the call stack), or None."""
    frame = sys._getframe(1)
    for _ in range(MAX_FRAMES):
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        if owner is not None and type(owner).__name__ == "Worker":
            return owner
        frame = frame.f_back
    return None


class ClosingHeartbeat(logging.Filter):
    """Drops Dask's heartbeat error of a worker that is closing: ``Worker.close`` closes its
    connection pool under a heartbeat still in flight, which Dask logs as an ERROR with a
    traceback though nothing failed (seen when a program ends with work in flight on a loaded
    machine).  A heartbeat that fails while the worker runs is still logged."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno != logging.ERROR or not str(record.msg).startswith(HEARTBEAT_FAILED):
            return True
        status = getattr(_worker_of_caller(), "status", None)
        return getattr(status, "name", None) not in CLOSING


def install() -> None:
    """Add the filters to ``distributed.nanny`` and ``distributed.worker`` (idempotent; the
    forked worker processes inherit them)."""
    log = logging.getLogger("distributed.nanny")
    if not any(isinstance(f, WorkerDeathLine) for f in log.filters):
        log.addFilter(WorkerDeathLine())
    log = logging.getLogger("distributed.worker")
    if not any(isinstance(f, ClosingHeartbeat) for f in log.filters):
        log.addFilter(ClosingHeartbeat())
