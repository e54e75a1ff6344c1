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
from yrdask import words
from yrdask.words import ray_shape

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

    def api_of(self, job_id: str) -> str:
        """``"ray"`` for a job whose driver speaks Ray (``yrdask.ray``), else ``"yr"``."""
        for job in self.ext.jobs.values():
            if job.job_id == job_id:
                return getattr(job, "api", "yr")
        return "yr"

    def holding_job(self, h: Any) -> str:
        """The job a holding works for ("" when unknown: a worker's own task lease)."""
        return self.job_of(h.holding_id if h.kind == "instance" else h.owner, h.kind)

    def problem(self, why: dict[str, Any]) -> str:
        """Why this wait can be a problem, or "" when it is ordinary queueing.

        It can be one when it can never run (no worker could ever fit it), when it waits on
        another job (what holds the workers that could run it belongs to other jobs), or when
        nothing of its job that will end holds that room: only its own instances (they live
        until they are ended) or nothing at all.  Waiting behind its own job's running tasks
        is queueing: counted, not warned about.
        """
        reasons = why["reasons"]
        if not reasons or all(r.startswith(("can never run it", "the cluster has no yr"))
                              for r in reasons):
            return "it can never run"
        job = why["job"]
        ledger = self.ext.ledger
        tasks: set[str] = set()  # jobs whose task leases hold room where it could run
        instances: set[str] = set()  # ... and whose instances do
        for ws in ledger.workers.values():
            if not ws.could_ever_fit(why["needs"]):
                continue
            for hid in ws.holdings:
                h = ledger.holdings.get(hid)
                if h is not None:
                    (tasks if h.kind == "lease" else instances).add(self.holding_job(h))
        others = (tasks | instances) - {job, ""}
        if others:
            return f"it waits on other jobs ({', '.join(sorted(others))})"
        if tasks:  # its own job's tasks (or nested tasks, "") hold the room: they will end
            return ""
        if instances:
            return "the room is held by instances of its own job, which run until ended"
        return "nothing of its job is running"

    def explain(self, request_id: str, now: float | None = None) -> dict[str, Any] | None:
        """:meth:`LeaseQueue.explain_wait` plus ``job``, ``scaling`` (:meth:`scaling`: first
        among the reasons when the cluster is scaling for it), ``problem`` (:meth:`problem`,
        "" for ordinary queueing or scaling) and, for a Ray job, the text in Ray's words."""
        why = self.ext.leases.explain_wait(request_id, self._now() if now is None else now)
        if why is not None:
            why["job"] = self.job_of(why["owner"], why["kind"])
            why["api"] = self.api_of(why["job"]) if why["job"] else "yr"
            why["scaling"] = scaling = self.scaling(why)
            why["problem"] = "" if scaling else self.problem(why)
            if scaling:  # first: what it waits for
                joined = "; ".join(why["reasons"])
                why["reasons"].insert(0, scaling)
                why["text"] = why["text"].replace(f": {joined}. ", f": {scaling}; {joined}. ", 1)
            if why["api"] == "ray":
                in_ray_words(why)
        return why

    def scaling(self, why: dict[str, Any]) -> str:
        """What Dask's deployer was asked for, for a request the growing cluster could run
        (``""`` when no deployer is attached, or none of its workers could run it)."""
        scale_up = getattr(self.ext, "scale_up", None)
        w = self.ext.leases.pending.get(why["request_id"])
        if scale_up is None or w is None:
            return ""
        return scale_up.scaling_text(w.shape, w.affinity, ray=why["api"] == "ray")

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
            why = self.explain(rid, now)
            if why is None or not (why["problem"] or why["scaling"]):
                continue  # queueing behind its own job's work
            self.warned.add(rid)
            self.warnings += 1
            text = why["text"]
            if why["job"]:
                text = text.replace(why["what"], f"{why['what']} of job {why['job']}", 1)
            if why["problem"]:
                text = f"{text} (not ordinary queueing: {why['problem']})"
            logger.warning("yrdask: %s", text)
            self._tell_driver(why["job"], text)

    def _tell_driver(self, job_id: str, text: str) -> None:
        """Send the warning to the job's driver too (it may run on another host)."""
        if not job_id:
            return
        for job in list(self.ext.jobs.values()):
            if job.job_id == job_id:
                self.ext._send_to_owner(job.owner, P.WaitWarning(text).to_msg())


# -- Ray's words ---------------------------------------------------------------------------


def in_ray_words(why: dict[str, Any]) -> None:
    """Rewrite a wait explanation for a Ray program through yrdask/words.py's table: Ray's
    names (task, actor), CPUs rather than millicores, and Ray's remedies (``.options``,
    ``ray.init``)."""
    what = words.in_ray_words(why["what"])
    reasons = [words.in_ray_words(r) for r in why["reasons"]]
    head = f"{what} waits for {ray_shape(why['needs'])}"
    if why.get("waited_s") is not None:
        head += f" ({why['waited_s']:.0f} s so far)"
    why.update(what=what, reasons=reasons, fix=words.RAY_FIX_HINT,
               problem=words.in_ray_words(why.get("problem") or ""),
               text=f"{head}: {'; '.join(reasons)}. {words.RAY_FIX_HINT}")
