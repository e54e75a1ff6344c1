"""Every wait explained: why resource requests wait, and a warning once one waits long.

The lease queue (:mod:`leases`) knows what waits and the ledger what each worker lacks;
:class:`WaitWatch` reads both once a second (a periodic callback of the scheduler) and

* logs a warning on ``yrdask.scheduler`` for each request that has waited
  ``yrdask.scheduling.wait-warning`` (default 5 s), once per request: what it needs, what
  each worker that could run it lacks, which instances (by class) hold it, and how to fix it;
* gives the same explanations to ``yr_cluster_info`` (``"waiting"``: ``yrdask status``) and
  the dashboard, with the job each request belongs to.

On the embedded cluster the scheduler runs in the driver's process, so the warning is
printed by the driver too.  Nothing here changes the queue: it only reads.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from typing import Any

import dask
from dask.utils import parse_timedelta

from yrdask import protocol as P

logger = logging.getLogger("yrdask.scheduler")

DEFAULT_WAIT_WARNING_S = 5.0
ROWS_SHOWN = 200  # waiting requests explained in one listing


def wait_warning_s() -> float:
    """``yrdask.scheduling.wait-warning`` in seconds (a number or a Dask time string)."""
    raw = dask.config.get("yrdask.scheduling.wait-warning", DEFAULT_WAIT_WARNING_S)
    seconds = parse_timedelta(raw, default="s")
    if seconds is None or seconds < 0:
        raise ValueError(f"yrdask.scheduling.wait-warning={raw!r} must be a duration >= 0, "
                         "e.g. 5s")
    return float(seconds)


class WaitWatch:
    """Explains waiting requests and warns once about each long wait (module docstring)."""

    def __init__(self, ext: Any) -> None:
        self.ext = ext
        self.threshold_s = wait_warning_s()  # checked at start: a bad value fails early
        self.warned: set[str] = set()  # request ids warned about, while they wait
        self.warnings = 0  # warnings logged so far (tests, metrics)

    def _now(self) -> float:
        try:
            return asyncio.get_running_loop().time()
        except RuntimeError:
            return asyncio.get_event_loop().time()

    def job_of(self, owner: str, kind: str) -> str:
        """The job a request belongs to: an instance's job up its owner tree, a driver's
        lease its job id; "" for a worker's own task leases."""
        if kind == "instance":
            lc = self.ext.instances.lifecycle
            rec = lc.instances.get(owner)
            return lc.job_of(rec.owner) if rec is not None else ""
        job = self.ext.jobs.get(owner)
        return job.job_id if job is not None else ""

    def explain(self, request_id: str, now: float | None = None) -> dict[str, Any] | None:
        """:meth:`LeaseQueue.explain_wait` plus ``job``."""
        why = self.ext.leases.explain_wait(request_id, self._now() if now is None else now)
        if why is not None:
            why["job"] = self.job_of(why["owner"], why["kind"])
        return why

    def rows(self, limit: int = ROWS_SHOWN) -> list[dict[str, Any]]:
        """The oldest ``limit`` waiting requests explained, oldest first (each explanation
        walks the ledger, so pages and ``yrdask status`` show a bounded number)."""
        now = self._now()
        rids = itertools.islice(self.ext.leases.pending, limit)
        return [why for rid in list(rids) if (why := self.explain(rid, now)) is not None]

    def check(self) -> None:
        """Periodic: warn about requests that have waited past the threshold (once each)."""
        leases = self.ext.leases
        try:  # read each time: the key may be changed while the scheduler runs
            self.threshold_s = wait_warning_s()
        except ValueError:
            logger.warning("yrdask: ignoring a bad yrdask.scheduling.wait-warning; using %g s",
                           self.threshold_s, exc_info=True)
        if self.warned:
            self.warned &= set(leases.pending)
        now = self._now()
        for rid in leases.waiting_longer_than(self.threshold_s, now):
            if rid in self.warned:
                continue
            self.warned.add(rid)
            why = self.explain(rid, now)
            if why is None:
                continue
            self.warnings += 1
            text = why["text"]
            if why["job"]:
                text = text.replace(why["what"], f"{why['what']} of job {why['job']}", 1)
            logger.warning("yrdask: %s", text)
            self._tell_driver(why["job"], text)

    def _tell_driver(self, job_id: str, text: str) -> None:
        """Send the warning to the job's driver too (it may run on another host)."""
        if not job_id:
            return
        for job in list(self.ext.jobs.values()):
            if job.job_id == job_id:
                self.ext._send_to_owner(job.owner, P.WaitWarning(text).to_msg())
