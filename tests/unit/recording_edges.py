"""Recording I/O edges for the scheduler adapters' unit tests: the decisions run as in
production, and what they would send or schedule is kept for the test to read."""
from __future__ import annotations


class LeaseRecorder:
    """A ``LeaseServiceEdge`` (``scheduler/lease_service.py``): a settable clock, the timers and the
    messages to owners kept in lists, jobs and workers as sets the test fills."""

    def __init__(self, jobs: set[str] | None = None, workers: set[str] | None = None) -> None:
        self.t = 0.0
        self.jobs = set(jobs or ())
        self.workers = set(workers or ())
        self.sent: list[tuple[str, dict]] = []
        self.timers: list[tuple[float, object]] = []
        self.feeds = 0

    def now(self) -> float:
        return self.t

    def call_at(self, at, fn) -> None:
        self.timers.append((at, fn))

    def send_to_owner(self, owner, msg) -> None:
        self.sent.append((owner, msg))

    def has_job(self, owner) -> bool:
        return owner in self.jobs

    def is_worker(self, owner) -> bool:
        return owner in self.workers

    def after_feed(self) -> None:
        self.feeds += 1
