"""yr work scales Dask's deployers up (docs/deploy.md, "Scaling up"): on a LocalCluster of
no workers, waiting yr tasks, instance creations and resource-group bundles count in the
scheduler's adaptive target, so ``cluster.adapt()`` adds workers for them; the Kubernetes
operator's ``GET /api/v1/adaptive_target`` reports them; a wait says the cluster scales; a
request no worker of the deployer's shape could run fails at once, saying why.

One LocalCluster (scheduler in this process, worker processes under nannies) serves the
module; each test starts from zero workers.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import urllib.request

import dask
import pytest
from distributed import LocalCluster

import yrdask as yr
from conftest import wait_until
from yrdask.cli import fetch_cluster_info

pytestmark = pytest.mark.timeout(120)

T = 60
WORKER = {"CPU": 1000, "Memory": 1000}  # the deployer's shape while none was seen


@yr.invoke
def double(x: int) -> int:
    return 2 * x


@yr.instance
class Box:
    def __init__(self, value: str) -> None:
        self.value = value

    def get(self) -> str:
        return self.value


@pytest.fixture(scope="module")
def lc(cluster):
    """A LocalCluster of no workers with yrdask preloaded and Dask's HTTP API on, joined by
    this process's yr runtime."""
    cluster.finalize()  # yr is per process: this module's runtime is its own
    routes = dask.config.get("distributed.scheduler.http.routes")
    with dask.config.set({"distributed.scheduler.http.routes":
                          [*routes, "distributed.http.scheduler.api"],
                          "yrdask.scaling.worker-resources": WORKER,
                          "yrdask.scheduling.wait-warning": "0.2s"}):
        with LocalCluster(n_workers=0, threads_per_worker=1, processes=True,
                          dashboard_address="127.0.0.1:0",
                          scheduler_kwargs={"preload": ["yrdask"]},
                          preload=["yrdask"]) as lc:
            yr.init(yr.Config(server_address=lc.scheduler_address))
            try:
                yield lc
            finally:
                if yr.is_initialized():  # the Ray test ends with ray.shutdown()
                    yr.finalize()


def from_zero(lc: LocalCluster) -> None:
    """No workers, their processes gone (the deployer adds none while one still closes)."""
    lc.scale(0)
    wait_until(lambda: not lc.scheduler.workers and not lc.workers, T,
               lambda: f"no workers (there are {list(lc.scheduler.workers)})")


def api_target(lc: LocalCluster) -> int:
    port = lc.scheduler.http_server.port
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v1/adaptive_target",
                                timeout=T) as r:
        return json.load(r)["workers"]


def waiting(lc: LocalCluster) -> list[dict]:
    """The scheduler's explained waits (what ``yrdask status`` lists)."""
    return asyncio.run(fetch_cluster_info(lc.scheduler_address, T))["waiting"]


def test_http_api_reports_yr_demand_and_the_wait_says_scaling(lc, caplog):
    """The operator's way: it reads the target over HTTP and scales the cluster itself.
    Ten tasks wait as four lease requests of {CPU: 500, Memory: 500}: two workers of the
    configured shape.  Past their 0.5 s schedule timeout they still wait (the cluster can
    grow to them), explained as the cluster scaling, also in the warning."""
    from_zero(lc)
    assert api_target(lc) == 0  # nothing waits (and the deployer is attached from now on)
    opts = yr.InvokeOptions(schedule_timeout_ms=500)
    with caplog.at_level(logging.WARNING, logger="yrdask.scheduler"):
        refs = [double.options(opts).invoke(i) for i in range(10)]
        assert wait_until(lambda: api_target(lc) == 2, T, "the API to ask for 2 workers")
        rows = wait_until(lambda: [w for w in waiting(lc) if w["waited_s"] >= 1.0], T,
                          "requests waiting past their schedule timeout")
        text = wait_until(lambda: next((r.getMessage() for r in caplog.records
                                        if "waits for" in r.getMessage()), None),
                          T, "a wait warning")
    scaling = ("waiting for the cluster to scale: asked Dask's deployer for 2 workers of "
               "{CPU: 1000, Memory: 1000}")
    assert all(w["reasons"][0] == scaling and not w["problem"] for w in rows), rows
    assert scaling in text and "can never run" not in text, text
    lc.scale(1)  # the operator may add fewer than asked: the work gets done all the same
    assert yr.get(refs, T) == [2 * i for i in range(10)]


def test_a_request_no_added_worker_could_run_fails_fast(lc):
    """While a deployer is attached, more CPUs than a worker (or the node) has, or a tag no
    worker offers, fails at once with the reason, not after the schedule timeout."""
    from_zero(lc)
    api_target(lc)  # a deployer asks: it is attached
    for opts, why in ((yr.InvokeOptions(cpu=64_000), "CPU=64000 (a worker offers 1000)"),
                      (yr.InvokeOptions(custom_resources={"ssd": 1}), "ssd=1 (a worker offers 0)")):
        t0 = time.monotonic()
        with pytest.raises(yr.YRError) as e:
            yr.get(double.options(opts).invoke(1), T)
        assert time.monotonic() - t0 < 10, "not refused at once"
        assert "can never be scheduled: no worker the deployer adds could ever run it" in \
            str(e.value) and why in str(e.value), str(e.value)


def test_adapt_scales_from_zero_for_tasks_instances_and_resource_groups(lc):
    """``cluster.adapt()`` (Dask's own Adaptive, over the comm) adds workers for yr work:
    tasks, an instance, a resource group's bundles, each time from no workers."""
    def tasks():
        assert yr.get([double.invoke(i) for i in range(10)], T) == [2 * i for i in range(10)]

    def instance():
        box = Box.invoke("kept")
        assert yr.get(box.get.invoke(), T) == "kept"
        box.terminate()

    def resource_group():
        rg = yr.create_resource_group([{"CPU": 500, "Memory": 256}] * 2)
        rg.wait(T)
        inside = yr.InvokeOptions(cpu=500, memory=256,
                                  resource_group_options=yr.ResourceGroupOptions(rg.name, 1))
        assert yr.get(double.options(inside).invoke(21), T) == 42
        yr.remove_resource_group(rg)

    for work in (tasks, instance, resource_group):
        from_zero(lc)
        adaptive = lc.adapt(minimum=0, maximum=2, interval="200ms")
        try:
            work()
        finally:
            adaptive.stop()
    from_zero(lc)


def test_a_ray_program_hears_of_the_autoscaler(lc):
    """The same wait, for a Ray driver: nodes, the autoscaler, num_cpus."""
    import yrdask.ray as ray

    from_zero(lc)
    yr.finalize()
    ray.init(address=lc.scheduler_address)
    try:
        @ray.remote(num_cpus=0.5)
        def one() -> int:
            return 1

        api_target(lc)  # a deployer asks: it is attached
        ref = one.remote()
        [row] = wait_until(lambda: waiting(lc), T, "the Ray task's wait")
        assert row["reasons"][0].startswith(
            "waiting for the autoscaler (Dask's deployer) to add nodes: asked for 1 worker "
            "of num_cpus=1, memory="), row
        assert "num_cpus=0.5" in row["text"] and "InvokeOptions" not in row["text"], row
        lc.scale(1)
        assert ray.get(ref, timeout=T) == 1
    finally:
        ray.shutdown()
