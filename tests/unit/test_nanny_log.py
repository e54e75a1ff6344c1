"""The embedded cluster's log filters (yrdask/deploy/nanny_log.py), driven through a logger
with no I/O: Dask's heartbeat error is dropped only for a worker that is closing."""

from __future__ import annotations

import logging
from types import SimpleNamespace

from yrdask.deploy.nanny_log import HEARTBEAT_FAILED, ClosingHeartbeat


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


class Worker:
    """Named like Dask's: the filter finds the logging worker on the call stack."""

    def __init__(self, log: logging.Logger, status: str) -> None:
        self.log, self.status = log, SimpleNamespace(name=status)

    def heartbeat(self) -> None:
        try:
            raise OSError("Stream is closed")
        except OSError:
            self.log.exception(HEARTBEAT_FAILED + ".")


def test_a_closing_workers_heartbeat_error_is_dropped_a_running_ones_kept():
    log = logging.getLogger("yrdask-test.closing-heartbeat")
    log.propagate = False
    records = _Records()
    log.addHandler(records)
    log.addFilter(ClosingHeartbeat())
    for status in ("closing", "closing_gracefully", "closed"):
        Worker(log, status).heartbeat()
    assert records.records == []
    Worker(log, "running").heartbeat()
    log.error("something else")  # not the heartbeat line, not from a worker
    assert [r.getMessage() for r in records.records] == [HEARTBEAT_FAILED + ".", "something else"]
