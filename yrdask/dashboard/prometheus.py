"""yr's Prometheus collector, served by Dask's own ``/metrics`` endpoint.

Dask's ``PrometheusHandler`` renders the global ``prometheus_client.REGISTRY``, into which
it registers its collectors (``PrometheusCollector`` subclasses) once per process.  yr does
the same: one :class:`YrMetricCollector` is registered once and reports the newest live
:class:`~yrdask.dashboard.YrDashboard` (a process normally runs one scheduler; the test
suite runs them one after another, as Dask's handler assumes too).  Names use Dask's
namespace (``distributed.dashboard.prometheus.namespace``, default ``dask``) and the
subsystem ``yr``:

* ``dask_yr_workers`` (gauge): workers registered with yr;
* ``dask_yr_instances{state}`` (gauge): instances by state;
* ``dask_yr_instance_restarts_total`` (counter): instance restarts seen (sampled each second
  and at each scrape, since ended instances are forgotten);
* ``dask_yr_resource_capacity{worker,resource}``, ``dask_yr_resource_held{worker,resource}``
  (gauges): what each worker offers, and what leases and instances hold there;
* ``dask_yr_<counter>_total`` (counters): each of the extension's counters (``ext.counters``:
  leases_granted, leases_local, leases_forwarded, lease_timeouts, ...);
* ``dask_yr_lease_requests_waiting`` (gauge): lease and instance requests waiting;
* ``dask_yr_tasks_running{worker}``, ``dask_yr_tasks_queued{worker}`` (gauges): a worker's
  task pool;
* ``dask_yr_tasks_local_total``, ``dask_yr_tasks_forwarded_total`` (counters): tasks the
  workers' submitters pushed to their own worker, or to another one;
* ``dask_yr_placements_total{kind}`` (counter) and
  ``dask_yr_placement_latency_seconds{kind,stat}`` (gauge, stat = mean, p50, p99 of the
  recent ones): leases and instances the scheduler placed, and how long each waited.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from typing import Any

import prometheus_client
from distributed.http.prometheus import PrometheusCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from yrdask.dashboard import data

_collector: "YrMetricCollector | None" = None

#: Help texts of the extension's lease counters (``ext.counters``; any other counter there is
#: exported too, as ``dask_yr_<name>_total``).
COUNTERS = {
    "leases_granted": "Leases granted by the yr scheduler",
    "leases_local": "Leases granted on the requester's own worker",
    "leases_forwarded": "Leases granted on another worker than the requester's",
    "lease_timeouts": "Lease or instance requests not met in time",
    "requests_withdrawn": "Waiting lease requests withdrawn by their owner (its queue drained)",
}
OWN_NAMES = {"workers", "instances", "instance_restarts", "resource_capacity", "resource_held",
             "lease_requests_waiting", "tasks_running", "tasks_queued", "tasks_local",
             "tasks_forwarded", "placements", "placement_latency_seconds"}


class YrMetricCollector(PrometheusCollector):
    """See module docstring; ``dashboard`` is a weak reference to the one it reports."""

    def __init__(self, dash: Any) -> None:
        super().__init__(dash.scheduler)
        self.subsystem = "yr"
        self.dashboard = weakref.ref(dash)

    def describe(self) -> list:
        return []  # no collect() at registration time (names are dynamic per worker)

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        dash = self.dashboard()
        src = dash.sources() if dash is not None else None
        if src is None:
            return
        name = self.build_name
        yield GaugeMetricFamily(name("workers"), "Workers registered with yr",
                                value=len(src.ledger.workers))
        states = GaugeMetricFamily(name("instances"), "yr instances by state",
                                   labels=["state"])
        for state, n in data.count_by_state(src.lifecycle.instances.values()).items():
            states.add_metric([state], n)
        yield states
        dash.restarts.observe(src.lifecycle.instances.values())
        yield CounterMetricFamily(name("instance_restarts"),
                                  "Instance restarts seen by the yr scheduler",
                                  value=dash.restarts.total)
        capacity = GaugeMetricFamily(name("resource_capacity"),
                                     "Resources a worker offers to yr (CPU in millicores, "
                                     "Memory in MB)", labels=["worker", "resource"])
        held = GaugeMetricFamily(name("resource_held"),
                                 "Resources held by yr leases and instances on a worker",
                                 labels=["worker", "resource"])
        for row in data.resources_view(src)["rows"]:
            capacity.add_metric([row["worker"], row["resource"]], row["capacity"])
            held.add_metric([row["worker"], row["resource"]], row["held"])
        yield capacity
        yield held
        for key, value in sorted(src.counters.items()):  # every counter of the extension
            if key in OWN_NAMES:
                continue
            yield CounterMetricFamily(name(key), COUNTERS.get(key, f"yr scheduler: {key}"),
                                      value=value)
        yield GaugeMetricFamily(name("lease_requests_waiting"),
                                "Lease and instance requests waiting for resources",
                                value=src.pending_requests)
        running = GaugeMetricFamily(name("tasks_running"), "yr tasks running on a worker",
                                    labels=["worker"])
        queued = GaugeMetricFamily(name("tasks_queued"),
                                   "yr tasks waiting for a thread on a worker",
                                   labels=["worker"])
        calls = GaugeMetricFamily(name("instance_calls_running"),
                                  "yr instance method calls in progress on a worker",
                                  labels=["worker"])
        for row in data.worker_scheduling(src):
            running.add_metric([row["worker"]], row["tasks_running"])
            queued.add_metric([row["worker"]], row["tasks_queued"])
            calls.add_metric([row["worker"]], row["calls_running"])
        yield running
        yield queued
        yield calls
        yield GaugeMetricFamily(name("instances_ended_kept"),
                                "Ended yr instances the scheduler still lists (bounded)",
                                value=len(src.lifecycle.ended))
        placements = CounterMetricFamily(name("placements"), "Leases and instances placed",
                                         labels=["kind"])
        latency = GaugeMetricFamily(name("placement_latency_seconds"),
                                    "Time from request to placement (recent ones)",
                                    labels=["kind", "stat"])
        for kind, fig in sorted(src.placement.items()):
            placements.add_metric([kind], fig["count"])
            for stat in ("mean", "p50", "p99"):
                latency.add_metric([kind, stat], fig[f"{stat}_ms"] / 1000)
        yield placements
        yield latency
        now = data.scheduling_sample(src)
        yield CounterMetricFamily(name("tasks_local"),
                                  "Tasks workers' submitters pushed to their own worker",
                                  value=now["tasks_local_total"])
        yield CounterMetricFamily(name("tasks_forwarded"),
                                  "Tasks workers' submitters pushed to another worker",
                                  value=now["tasks_forwarded_total"])


def install(dash: Any) -> None:
    """Make ``dash`` the one the process's yr collector reports (registering it once)."""
    global _collector
    if _collector is None:
        _collector = YrMetricCollector(dash)
        prometheus_client.REGISTRY.register(_collector)
    else:
        _collector.server = dash.scheduler
        _collector.dashboard = weakref.ref(dash)


def forget(dash: Any) -> None:
    """``dash``'s scheduler closed: stop reporting it (unless a newer one took over)."""
    if _collector is not None and _collector.dashboard() is dash:
        _collector.dashboard = lambda: None
        _collector.server = None
