"""yr work in Dask's own panels, read through Dask's public client API (docs/monitoring.md).

After yr tasks and method calls, ``Client.get_task_stream()`` holds them by name (key
``<name>-<id>``, the worker that ran them, a compute start/stop), ``Client.profile()`` shows
the task's function (``yrdask.dashboard.profile``, on by default), and the scheduler's task
prefixes (what Dask's Progress page reads) count them per function.  Runs on both core
kinds.
"""

from __future__ import annotations

import os

import pytest
from dask.utils import key_split
from distributed import Client

import yrdask as yr
from conftest import CORE_KINDS, spin, wait_until

pytestmark = pytest.mark.timeout(180)

T = 60


@yr.invoke
def spin_a_while(ms: float) -> int:
    """Busy for ``ms`` milliseconds (for the profiler's 10 ms samples)."""
    return spin(ms)


@yr.instance
class Scratch:
    """An instance a task makes as a local and drops when it returns."""

    def ping(self) -> int:
        return 1


@yr.invoke
def spin_then_make_scratch(ms: float) -> int:
    """Busy for ``ms`` ms (the profiler samples this thread), then makes a ``Scratch``
    whose only handle is a local of this task, dropped as the task returns."""
    spin(ms)
    scratch = Scratch.invoke()  # noqa: F841  (the local whose end is watched)
    return 0


@yr.invoke
def big_value(nbytes: int) -> bytes:
    """A value larger than the inline limit: its worker keeps it in the node's store."""
    return b"x" * nbytes


@yr.invoke
def fails_always() -> None:
    raise ValueError("meant to fail")


@yr.instance
class Tally:
    def __init__(self) -> None:
        self.n = 0

    def add(self, k: int) -> int:
        self.n += k
        return self.n


@pytest.fixture(scope="module")
def client(cluster, cluster_kind):
    """A Dask client of a fresh cluster with yr's defaults (Profile of yr code on): its own
    worker processes, so that no earlier module's settings reach them."""
    params = dict(CORE_KINDS[cluster_kind])
    if cluster_kind == "cli":  # other worker processes than the shared cli cluster's
        params["workers"] = [{"resources": "profiled=1"}, {}]
    else:
        params["num_cpus"] = 3
    assert "DASK_YRDASK__DASHBOARD__PROFILE" not in os.environ
    c = cluster(**params)
    with Client(c.address, timeout=T) as dask_client:
        yield dask_client
    cluster.close()  # the next module gets its clusters afresh


def samples(state: dict, name: str) -> int:
    """Profiler samples of function ``name`` in a ``client.profile()`` tree."""
    own = state["count"] if state["description"].get("name") == name else 0
    return own + sum(samples(child, name) for child in state["children"].values())


def names_in(stream: list[dict]) -> dict[str, int]:
    out: dict[str, int] = {}
    for rec in stream:
        out[key_split(rec["key"])] = out.get(key_split(rec["key"]), 0) + 1
    return out


def test_task_stream_and_profile_hold_yr_work(client):
    workers = set(client.scheduler_info()["workers"])
    assert all(n > 0 for n in yr.get([spin_a_while.invoke(30) for _ in range(30)], T))
    tally = Tally.invoke()
    assert yr.get([tally.add.invoke(1) for _ in range(20)], T)[-1] == 20
    with pytest.raises(ValueError):
        yr.get(fails_always.invoke(), T)

    def stream_has_all() -> list | None:
        stream = client.get_task_stream()
        got = names_in(stream)
        return stream if (got.get("spin_a_while", 0) >= 30 and got.get("Tally.add", 0) >= 20
                          and got.get("Tally.__init__", 0) >= 1
                          and got.get("fails_always", 0) >= 1) else None
    stream = wait_until(stream_has_all, T, lambda: "yr work in client.get_task_stream(): "
                        f"{names_in(client.get_task_stream())}")
    for rec in stream:
        name = key_split(rec["key"])
        if name not in ("spin_a_while", "Tally.add", "fails_always"):
            continue
        assert rec["worker"] in workers, rec
        (ss,) = rec["startstops"]
        assert ss["action"] == "compute" and ss["stop"] >= ss["start"], rec
        assert rec["status"] == ("error" if name == "fails_always" else "OK"), rec
        if name == "spin_a_while":
            assert ss["stop"] - ss["start"] >= 0.029, rec

    # Dask's profiler sampled the task threads: the function is in client.profile(), with
    # samples, and in the profile of its key alone.
    wait_until(lambda: samples(client.profile(), "spin_a_while") >= 5, T,
               lambda: f"samples of spin_a_while in client.profile(): {client.profile()}")
    assert samples(client.profile(key="spin_a_while"), "spin_a_while") >= 5

    # Progress (Dask's task prefixes): done / erred per function, instances per class.
    def progress() -> dict:
        return client.run_on_scheduler(lambda dask_scheduler: {
            name: dict(tp.states) for name, tp in dask_scheduler.task_prefixes.items()})
    # (the lifetimes are counted on the scheduler's periodic tick: wait for the ALIVE one)
    states = wait_until(lambda: (lambda s: s if s.get("Tally", {}).get("processing", 0) >= 1
                                 else None)(progress()), T,
                        lambda: f"Tally's lifetime in the task prefixes: {progress()}")
    assert states["spin_a_while"]["memory"] >= 30, states
    assert states["Tally.add"]["memory"] >= 20, states
    assert states["fails_always"]["erred"] >= 1, states
    assert states["Tally"]["processing"] >= 1, states  # the ALIVE instance
    tally.terminate()


def test_sampled_task_locals_end_with_the_task(client):
    """While Dask's profiler samples the task threads, a task's local (a handle: its end is
    the watched finalizer) goes when the task ends, not later.  The sampler may hold the
    task's frame as it returns and then drop its locals on the worker's event loop; the
    handle's decref must not overtake the incref its own thread queued (it did, and the
    instance lived on)."""
    def live_scratches() -> list:
        return client.run_on_scheduler(lambda dask_scheduler: [
            i["instance_id"] for i in dask_scheduler.extensions["yr"].cluster_info()["instances"]
            if i["class"] == "Scratch" and i["state"] != "DEAD"])
    assert yr.get([spin_then_make_scratch.invoke(20) for _ in range(24)], T) == [0] * 24
    wait_until(lambda: not live_scratches(), 15,
               lambda: f"Scratch instances whose only handle was a task's local: {live_scratches()}")


def test_yr_values_in_dask_worker_metrics(client):
    """The bytes of yr values a worker keeps in its node's store are in Dask's worker metrics
    (the Workers page shows them as a column) until their owner frees them."""
    def held() -> dict[str, int]:
        return {w: info["metrics"].get("yr_store_bytes", 0)
                for w, info in client.scheduler_info()["workers"].items()}
    size = 4 * 2**20
    ref = big_value.invoke(size)
    assert len(yr.get(ref, T)) == size
    wait_until(lambda: max(held().values()) >= size, T,
               lambda: f"yr_store_bytes per worker: {held()}")
    assert all("yr_store_spilled_bytes" in info["metrics"]
               for info in client.scheduler_info()["workers"].values())
    del ref
    wait_until(lambda: max(held().values()) < size, T,
               lambda: f"yr_store_bytes after the value was freed: {held()}")
