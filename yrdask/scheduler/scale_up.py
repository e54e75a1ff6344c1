"""yr work scales Dask's deployers up: the scheduler's adaptive target counts it
(docs/deploy.md, "Scaling up").

Dask's deployers ask the scheduler how many workers it wants: ``distributed.deploy.Adaptive``
(``cluster.adapt()`` of LocalCluster, dask-jobqueue, dask-gateway) through the comm handler
``adaptive_target``, the Kubernetes operator through ``GET /api/v1/adaptive_target``, which
calls ``Scheduler.adaptive_target()``.  :class:`ScaleUp` replaces both, on its scheduler
only, with the larger of Dask's own answer and what the waiting yr work needs
(:mod:`yrdask.scheduler.demand`).

A deployer counts as *attached* while it asked within ``yrdask.scaling.deployer-timeout``
(the dashboard's and Prometheus' calls do not count: they only read).  While one is
attached, the lease queue asks :meth:`ScaleUp.verdict` about requests that do not fit now:
one that a worker of the deployer's shape could run keeps waiting past its
``schedule_timeout_ms`` (the cluster can grow to it, as Ray waits for its autoscaler), and
one that none could run, nor any node there is, is refused at once with the reason.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import dask
from dask.utils import parse_timedelta

from yrdask.scheduler import demand as D
from yrdask.scheduler.resources import Shape, format_shape
from yrdask.words import ray_shape

logger = logging.getLogger("yrdask.scheduler")

SHAPE_KEY = "yrdask.scaling.worker-resources"
TIMEOUT_KEY = "yrdask.scaling.deployer-timeout"
DEFAULT_DEPLOYER_TIMEOUT_S = 15.0
FRESH_S = 0.5  # the demand computed for explanations is reused this long


def deployer_timeout_s() -> float:
    """``yrdask.scaling.deployer-timeout`` in seconds (a number or a Dask time string)."""
    raw = dask.config.get(TIMEOUT_KEY, DEFAULT_DEPLOYER_TIMEOUT_S)
    seconds = parse_timedelta(raw, default="s")
    if seconds is None or seconds <= 0:
        raise ValueError(f"{TIMEOUT_KEY}={raw!r} must be a duration > 0, e.g. 15s")
    return float(seconds)


def configured_worker() -> Shape | None:
    """``yrdask.scaling.worker-resources``: one worker's shape, or None (learn it)."""
    return D.configured_shape(dask.config.get(SHAPE_KEY, None), SHAPE_KEY)


class ScaleUp:
    """The scheduler's adaptive target with yr demand in it (see module docstring)."""

    def __init__(self, ext: Any) -> None:
        self.ext = ext
        scheduler = ext.scheduler
        self.dask_target = scheduler.adaptive_target  # Dask's own (the bound method)
        self.timeout_s = deployer_timeout_s()  # checked at start: a bad value fails early
        self.configured = configured_worker()
        self.learnt: Shape | None = None  # the newest yr worker process offer seen
        self.seen_at: float | None = None  # when a deployer last asked (the loop's clock)
        self.asked = 0  # the target yr work asked for, last computed
        self._computed_at: float | None = None
        scheduler.handlers["adaptive_target"] = self.deployer_target
        scheduler.adaptive_target = self.adaptive_target
        ext.leases.scaling = self

    # -- what Dask's deployers call ----------------------------------------------------------

    def deployer_target(self, target_duration: Any = None) -> int:
        """The comm handler ``adaptive_target`` (``distributed.deploy.Adaptive``)."""
        self.seen_at = self._now()
        return self.adaptive_target(target_duration)

    def adaptive_target(self, target_duration: Any = None) -> int:
        """``Scheduler.adaptive_target``: the larger of Dask's own target and yr's.  Called
        by ``/api/v1/adaptive_target`` (a deployer: it attaches), Prometheus' ``desired
        workers`` and the dashboard's JSON (readers: they do not)."""
        if _from_http_api(sys._getframe(1)):
            self.seen_at = self._now()
        return max(self.dask_target(target_duration), self.yr_target())

    # -- yr demand ---------------------------------------------------------------------------

    def worker_shape(self) -> Shape | None:
        """One worker process's resources: the newest yr worker seen, else the config
        key, else None (unknown: yr asks for one worker and learns its shape)."""
        processes = self.ext.ledger.processes
        if processes:
            p = processes[next(reversed(processes))]
            self.learnt = D.offer_shape(p.capacity, p.gpus, p.shared)
        if self.learnt is not None:
            return self.learnt
        try:  # read each time: the key may be set while the scheduler runs
            self.configured = configured_worker()
        except ValueError:
            logger.warning("yrdask: ignoring a bad %s", SHAPE_KEY, exc_info=True)
        return self.configured

    def yr_target(self) -> int:
        """Workers yr work wants: the busy ones plus, while work waits, every worker there
        is and the workers of the deployer's shape that the waiting work fills."""
        ext = self.ext
        self._computed_at = self._now()
        ledger = ext.ledger
        # Busy: what a drain could not empty now (yr work, instances that cannot move, a
        # node's bundle reservations); a worker whose instances can move is left to
        # workers_to_close (drain.py).
        busy = ext.drainer.kept([a for a, p in ledger.processes.items()
                                 if p.holdings or ledger.workers[p.node].holdings])
        needs = D.pending_needs(ext.leases, ext.rgroups.machine)
        shape = self.worker_shape()
        more = (0 if not needs else 1 if shape is None
                else D.workers_needed(needs, shape)[0])
        # Workers on their way: in Dask but not yet offered to yr, or the other way round.
        workers = ext.scheduler.workers
        arriving = sum(a not in ledger.processes for a in workers) + len(ext.pending_workers)
        more = max(0, more - arriving)
        self.asked = len(workers) + len(ext.pending_workers) + more if more else len(busy)
        return self.asked

    # -- what the lease queue and the wait explanations ask ------------------------------------

    def attached(self) -> bool:
        """A deployer asked for the adaptive target within ``deployer-timeout``."""
        if self.seen_at is None:
            return False
        try:
            self.timeout_s = deployer_timeout_s()
        except ValueError:
            logger.warning("yrdask: ignoring a bad %s", TIMEOUT_KEY, exc_info=True)
        return self._now() - self.seen_at <= self.timeout_s

    def verdict(self, shape: Shape, affinity: Any) -> str | None:
        """For a request that does not fit now: None while no deployer is attached (the
        usual rules), ``""`` if a worker of the deployer's shape could run it (it waits for
        the cluster to grow), else why none could (it fails at once unless a node there
        could ever run it)."""
        if not self.attached():
            return None
        worker = self.worker_shape()
        return "" if worker is None else D.unfit_reason(shape, affinity, worker)

    def scaling_text(self, shape: Shape, affinity: Any, ray: bool = False) -> str:
        """``"waiting for the cluster to scale: asked Dask's deployer for 2 workers of
        {CPU: 1000, Memory: 2000}"`` for a waiting request the growing cluster could run;
        ``""`` when none is attached or no worker of its shape could run it."""
        if D.for_bundle(self.ext.leases, affinity) or self.verdict(shape, affinity) != "":
            return ""
        now = self._now()
        if self._computed_at is None or now - self._computed_at > FRESH_S:
            self.yr_target()
        worker = self.worker_shape()
        if worker is None:
            of = "(its shape is learnt from the first one)"
        else:
            of = f"of {ray_shape(worker) if ray else format_shape(worker)}"
        n = max(self.asked, 1)
        if ray:
            return (f"waiting for the autoscaler (Dask's deployer) to add nodes: asked for "
                    f"{n} worker{'s' if n != 1 else ''} {of}")
        return (f"waiting for the cluster to scale: asked Dask's deployer for {n} "
                f"worker{'s' if n != 1 else ''} {of}")

    def _now(self) -> float:
        return self.ext._loop().time()


def _from_http_api(frame: Any) -> bool:
    """True if ``frame`` is Dask's ``GET /api/v1/adaptive_target`` handler."""
    api = sys.modules.get("distributed.http.scheduler.api")
    return api is not None and frame.f_code is api.AdaptiveTargetHandler.get.__code__
