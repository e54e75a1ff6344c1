"""What the yr monitoring pages show, as plain data: rows, filters, pages and time series.

Pure functions over a :class:`Sources` snapshot (the extension's lifecycle and ledger, the
workers' ``metrics["yr"]`` load reports, the lease counters), so the JSON API, the Bokeh
pages, the Prometheus collector and the unit tests share one implementation, and the
10 000-instance figures are measured on the same code the pages run.  Nothing here writes to
the extension.

Instance pages stay cheap with many instances: one pass over the records filters and counts
by state, and only the rows of the requested page are built (the load reports are looked up
per row, by the instance's worker).
"""

from __future__ import annotations

import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

from yrdask import protocol as P

STATES = (P.PENDING, P.ALIVE, P.RESTARTING, P.DEAD)
MAX_LIMIT = 1000  # rows one request may ask for
SAMPLES_KEPT = 600  # scheduling samples kept: 10 minutes at one sample a second


@dataclass
class Sources:
    """The yr state one page update reads (all read-only).

    ``metrics`` maps each Dask worker address to the ``"yr"`` entry of its last heartbeat
    (``WorkerAgent.metrics()``: tasks_running, tasks_queued, tasks_done, instances
    ``{id: [calls_done, calls_pending]}``, scheduling ``{local, forwarded, lease_requests,
    queued, running, leases}``); a worker without the agent maps to ``{}``.
    """

    lifecycle: Any  # yrdask.scheduler.lifecycle.Lifecycle
    ledger: Any  # yrdask.scheduler.resources.Ledger
    metrics: Mapping[str, dict]
    counters: Mapping[str, int]
    pending_requests: int = 0
    #: placement latency by kind: ``{"lease": {"count", "mean_ms", "p50_ms", "p99_ms"}, ...}``
    placement: Mapping[str, dict] = field(default_factory=dict)
    #: why each waiting request waits, oldest first (``WaitWatch.rows()``: ``{"what",
    #: "kind", "holding_id", "job", "needs", "waited_s", "reasons", "text", ...}``)
    waiting: list = field(default_factory=list)


def sources_of(scheduler: Any) -> Sources | None:
    """A :class:`Sources` for a live Dask scheduler, or None when yr is not installed on it."""
    ext = scheduler.extensions.get("yr")
    if ext is None:
        return None
    metrics = {addr: ws.metrics.get("yr") or {} for addr, ws in scheduler.workers.items()}
    figures = getattr(ext, "figures", None)  # SchedulingFigures: placement latencies
    waits = getattr(ext, "waits", None)
    waiting = waits.rows() if waits is not None else []
    return Sources(ext.instances.lifecycle, ext.ledger, metrics, dict(ext.counters),
                   len(ext.pending), figures.snapshot() if figures is not None else {},
                   waiting)


# -- instances -----------------------------------------------------------------------------


@dataclass(frozen=True)
class InstanceQuery:
    """A filter and a page of the instance list (the ``/yr/api/instances`` parameters).

    ``state`` and ``cls`` match exactly ("" = any); ``text`` is a case-insensitive substring
    of the instance's name or id.  Rows come in creation order.
    """

    state: str = ""
    cls: str = ""
    text: str = ""
    offset: int = 0
    limit: int = 100

    @classmethod
    def from_params(cls, get: Callable[[str], str | None]) -> "InstanceQuery":
        """Build from URL parameters ``state``, ``class``, ``name``, ``offset``, ``limit``.

        Raises ValueError naming the bad parameter and what it accepts.
        """
        state = (get("state") or "").upper()
        if state and state not in STATES:
            raise ValueError(f"state={state!r} is not one of {', '.join(STATES)}")
        numbers = {}
        for key, default, top in (("offset", 0, None), ("limit", 100, MAX_LIMIT)):
            raw = get(key)
            try:
                value = default if raw in (None, "") else int(raw)
            except ValueError:
                raise ValueError(f"{key}={raw!r} is not an integer") from None
            if value < 0 or (top is not None and value > top):
                bound = f"0..{top}" if top is not None else ">= 0"
                raise ValueError(f"{key}={value} is out of range ({bound})")
            numbers[key] = value
        return cls(state, get("class") or "", get("name") or "", **numbers)


#: The unit of each built-in resource (custom tags are in the units their worker declared).
UNITS = {"CPU": "millicores", "Memory": "MB"}


def format_amount(resource: str, amount: float) -> str:
    """An amount with its unit: ``CPU`` in cores and millicores (``"1.5 cores (1500 m)"``),
    ``Memory`` in MB, custom tags as plain numbers."""
    if resource == "CPU":
        cores = amount / 1000
        return f"{cores:g} {'core' if cores == 1 else 'cores'} ({amount:g} m)"
    if resource == "Memory":
        return f"{amount:g} MB"
    return f"{amount:g}"


def format_shape(shape: Mapping[str, float] | None) -> str:
    """``{"CPU": 500.0, "Memory": 0.0}`` -> ``"CPU 500, Memory 0"`` (for tables)."""
    return ", ".join(f"{r} {a:g}" for r, a in sorted((shape or {}).items()))


def instance_row(rec: Any, metrics: Mapping[str, dict],
                 waiting: Mapping[str, str] | None = None) -> dict[str, Any]:
    """One instance record as a JSON-able row; calls come from its worker's load report,
    ``waiting`` (why it is not placed yet) from ``waiting`` by instance id."""
    calls = None
    if rec.worker is not None:
        calls = (metrics.get(rec.worker) or {}).get("instances", {}).get(rec.instance_id)
    return {
        "instance_id": rec.instance_id,
        "name": rec.name_key[1] if rec.name_key else "",
        "namespace": rec.name_key[0] if rec.name_key else "",
        "class": rec.spec.get("cls_name") or "",
        "state": rec.state,
        "worker": rec.worker or "",
        "owner": rec.owner,
        "detached": rec.detached,
        "restarts": rec.restarts,
        "resources": dict(rec.spec.get("shape") or {}),
        "calls_done": calls[0] if calls else None,
        "calls_pending": calls[1] if calls else None,
        "created_at": rec.created_at,
        "reason": rec.reason,
        "waiting": (waiting or {}).get(rec.instance_id, ""),
    }


def waiting_by_instance(src: Sources) -> dict[str, str]:
    """``{instance id: why it waits}`` for the instances among the waiting requests."""
    return {w["holding_id"]: w["text"] for w in src.waiting
            if w.get("kind") == "instance" and w.get("holding_id")}


def ended_view(src: Sources, limit: int = 100) -> dict[str, Any]:
    """Reply of ``/yr/api/ended``: ``{"kept", "total", "ended": [tombstone, ...]}``, newest
    first; a tombstone is ``{instance_id, class, name, namespace, owner, job, worker, reason,
    created_at, ended_at, restarts, detached}`` (``Lifecycle.ended_rows``)."""
    lc = src.lifecycle
    return {"kept": lc.ended.maxlen, "total": len(lc.ended), "ended": lc.ended_rows(limit)}


def query_instances(src: Sources, q: InstanceQuery) -> dict[str, Any]:
    """The page ``q`` asks for, with counts over all instances.

    Reply: ``{"total", "matched", "offset", "limit", "by_state": {state: n},
    "classes": [names], "instances": [row, ...], "waiting": [why each waiting request
    waits]}``.
    """
    by_state: Counter = Counter()
    classes: set[str] = set()
    matched: list[Any] = []
    text = q.text.lower()
    records = src.lifecycle.instances.values()
    for rec in records:
        by_state[rec.state] += 1
        cls_name = rec.spec.get("cls_name") or ""
        classes.add(cls_name)
        if q.state and rec.state != q.state:
            continue
        if q.cls and cls_name != q.cls:
            continue
        if text and text not in rec.instance_id.lower() and not (
                rec.name_key and text in rec.name_key[1].lower()):
            continue
        matched.append(rec)
    page = matched[q.offset:q.offset + q.limit]
    waits = waiting_by_instance(src)
    return {
        "total": len(records),
        "matched": len(matched),
        "offset": q.offset,
        "limit": q.limit,
        "by_state": {s: by_state.get(s, 0) for s in STATES},
        "classes": sorted(classes),
        "instances": [instance_row(rec, src.metrics, waits) for rec in page],
        "waiting": list(src.waiting),
    }


def count_by_state(records: Iterable[Any]) -> dict[str, int]:
    """``{state: number of instances}`` for every state, zeros included."""
    counts = Counter(rec.state for rec in records)
    return {s: counts.get(s, 0) for s in STATES}


# -- resources -----------------------------------------------------------------------------


def resources_view(src: Sources) -> dict[str, Any]:
    """Capacity vs held per worker and per resource tag.

    Reply: ``{"units": {resource: unit}, "workers": [{"worker", "capacity", "held", "free",
    "leases", "instances", "tasks_running", "tasks_queued"}], "rows": [{"worker",
    "resource", "unit", "capacity", "held", "free", "used", "capacity_text", "held_text",
    "free_text"}], "totals": {resource: {"unit", "capacity", "held", "free", "capacity_text",
    "held_text", "free_text"}}}`` where ``used`` is held/capacity (0..1, above 1 while a
    blocked task's CPU is taken back); amounts are in the resource's unit (``CPU``
    millicores, ``Memory`` MB), the ``*_text`` fields say so (:func:`format_amount`).
    """
    workers, rows = [], []
    totals: dict[str, dict[str, float]] = {}
    ledger = src.ledger
    # one pass; rows are nodes (hosts: docs/nodes.md), so count by the holding's node
    kinds = Counter((h.node or h.worker, h.kind) for h in ledger.holdings.values())
    for addr, ws in sorted(ledger.workers.items()):
        names = sorted(set(ws.capacity) | set(ws.held))
        held = {r: ws.held.get(r, 0.0) for r in names}
        free = {r: ws.capacity.get(r, 0.0) - held[r] for r in names}
        load = src.metrics.get(addr) or {}
        workers.append({"worker": addr, "processes": sorted(getattr(ws, "processes", ())),
                        "capacity": dict(ws.capacity), "held": held,
                        "free": free, "leases": kinds[addr, "lease"],
                        "instances": kinds[addr, "instance"],
                        "tasks_running": load.get("tasks_running"),
                        "tasks_queued": load.get("tasks_queued")})
        for r in names:
            cap = ws.capacity.get(r, 0.0)
            rows.append({"worker": addr, "resource": r, "unit": UNITS.get(r, ""),
                         "capacity": cap, "held": held[r], "free": free[r],
                         "used": held[r] / cap if cap else 0.0,
                         **_texts(r, cap, held[r], free[r])})
            tot = totals.setdefault(r, {"unit": UNITS.get(r, ""), "capacity": 0.0, "held": 0.0,
                                        "free": 0.0})
            tot["capacity"] += cap
            tot["held"] += held[r]
            tot["free"] += free[r]
    for r, tot in totals.items():
        tot.update(_texts(r, tot["capacity"], tot["held"], tot["free"]))
    units = {r: UNITS.get(r, "") for r in sorted(totals)}
    return {"units": units, "workers": workers, "rows": rows,
            "totals": dict(sorted(totals.items()))}


def _texts(resource: str, capacity: float, held: float, free: float) -> dict[str, str]:
    return {"capacity_text": format_amount(resource, capacity),
            "held_text": format_amount(resource, held),
            "free_text": format_amount(resource, free)}


# -- scheduling ----------------------------------------------------------------------------

#: Figures of one scheduling sample; the ``*_total`` ones only grow (the rest are levels).
SAMPLE_FIELDS = (
    "tasks_local_total",  # tasks the workers' submitters pushed to their own worker
    "tasks_forwarded_total",  # ... and to another worker
    "leases_granted_total",  # leases the scheduler granted
    "leases_local_total",  # ... on the requester's own worker
    "tasks_running",  # tasks running in the workers' task pools
    "tasks_queued",  # tasks waiting for a thread of a worker's task pool
    "submit_queued",  # tasks queued in the workers' submitters (waiting for a lease)
    "lease_requests_waiting",  # lease and instance requests the scheduler holds back
    "calls_running",  # instance method calls in progress (running or queued at the instance)
    "instances_hosted",  # instances the workers host
    "running",  # work in progress: tasks_running + calls_running
)
RATES = {"local_per_s": "tasks_local_total", "forwarded_per_s": "tasks_forwarded_total",
         "leases_per_s": "leases_granted_total", "leases_local_per_s": "leases_local_total"}


def scheduling_sample(src: Sources, now: float | None = None) -> dict[str, float]:
    """The scheduling figures now: :data:`SAMPLE_FIELDS` plus ``time`` (epoch seconds)."""
    out = dict.fromkeys(SAMPLE_FIELDS, 0)
    for load in src.metrics.values():
        sched = load.get("scheduling") or {}
        out["tasks_local_total"] += sched.get("local", 0)
        out["tasks_forwarded_total"] += sched.get("forwarded", 0)
        out["submit_queued"] += sched.get("queued", 0)
        out["tasks_running"] += load.get("tasks_running", 0)
        out["tasks_queued"] += load.get("tasks_queued", 0)
        hosted = load.get("instances") or {}
        out["instances_hosted"] += len(hosted)
        out["calls_running"] += sum(c[1] for c in hosted.values() if c)
    out["running"] = out["tasks_running"] + out["calls_running"]
    out["leases_granted_total"] = src.counters.get("leases_granted", 0)
    out["leases_local_total"] = src.counters.get("leases_local", 0)
    out["lease_requests_waiting"] = src.pending_requests
    out["time"] = time.time() if now is None else now
    return out


def worker_scheduling(src: Sources) -> list[dict[str, Any]]:
    """Per worker: its task pool and its submitter's local vs forwarded counts."""
    rows = []
    for addr, load in sorted(src.metrics.items()):
        sched = load.get("scheduling") or {}
        rows.append({"worker": addr, "tasks_running": load.get("tasks_running", 0),
                     "tasks_queued": load.get("tasks_queued", 0),
                     "tasks_done": load.get("tasks_done", 0),
                     "local": sched.get("local", 0), "forwarded": sched.get("forwarded", 0),
                     "lease_requests": sched.get("lease_requests", 0),
                     "submit_queued": sched.get("queued", 0), "leases": sched.get("leases", 0),
                     "instances": len(load.get("instances") or ()),
                     "calls_running": sum(c[1] for c in (load.get("instances") or {}).values()
                                          if c)})
    return rows


class Timeline:
    """The last :data:`SAMPLES_KEPT` scheduling samples, oldest first.

    ``added`` counts every sample ever added, so a reader that remembers it can ask
    :meth:`series` for only the samples added since (the scheduling page streams those).
    """

    def __init__(self, maxlen: int = SAMPLES_KEPT) -> None:
        self.samples: deque[dict[str, float]] = deque(maxlen=maxlen)
        self.added = 0

    def add(self, sample: dict[str, float]) -> None:
        self.samples.append(sample)
        self.added += 1

    def series(self, last: int | None = None) -> dict[str, list[float]]:
        """Columns ``time``, the sample fields and the rates of :data:`RATES` (per second).

        A rate is the growth since the previous sample; a counter that went down (a worker
        came back under its nanny with fresh counters) counts as 0.
        """
        samples = list(self.samples)[-(last + 1):] if last else list(self.samples)
        cols: dict[str, list[float]] = {k: [] for k in ("time", *SAMPLE_FIELDS, *RATES)}
        prev = None
        for s in samples:
            for k in ("time", *SAMPLE_FIELDS):
                cols[k].append(s[k])
            for rate, total in RATES.items():
                if prev is None or s["time"] <= prev["time"]:
                    cols[rate].append(0.0)
                else:
                    grew = max(0.0, s[total] - prev[total])
                    cols[rate].append(grew / (s["time"] - prev["time"]))
            prev = s
        if last and len(samples) > last:  # the extra oldest sample only served the rates
            cols = {k: v[1:] for k, v in cols.items()}
        return cols


def scheduling_view(src: Sources, timeline: Timeline, last: int | None = None) -> dict:
    """Reply of ``/yr/api/scheduling``: ``{"now": sample, "workers": [...], "placement":
    {kind: {"count", "mean_ms", "p50_ms", "p99_ms"}}, "series": {...}}``."""
    return {"now": scheduling_sample(src), "workers": worker_scheduling(src),
            "placement": dict(src.placement), "series": timeline.series(last)}


class RestartCounter:
    """Restarts seen so far, for a counter that only grows although dead records go away.

    Each :meth:`observe` adds the growth of every record's ``restarts`` since the last look;
    restarts of an instance that both restarted and vanished between two looks are missed.
    Only records that restarted are remembered: the sampler looks every second, and most of
    10 000 instances never restart.
    """

    def __init__(self) -> None:
        self.total = 0
        self._seen: dict[str, int] = {}  # instance id -> restarts, for those with any

    def observe(self, records: Iterable[Any]) -> int:
        seen = {rec.instance_id: rec.restarts for rec in records if rec.restarts}
        for iid, restarts in seen.items():
            self.total += max(0, restarts - self._seen.get(iid, 0))
        self._seen = seen
        return self.total
