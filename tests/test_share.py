"""One share of each worker (docs/scheduling.md): a dask.array reduction, yr tasks and an
instance's method calls at once on the cli cluster (two one-thread workers) never run more
than one at a time on a worker, and all results are right.  The yr tasks ask for a whole
CPU: yr's default (500 millicores) lets yr itself run two per thread, by its own ledger.

Each yr task and each Dask chunk function records ``(start, end)`` in a file named after its
worker process; the test sweeps each worker's intervals.  Run with
``DASK_YRDASK__WORKER__SHARE_THREADS=False`` (the switch off, seen by the cli workers it
starts) it fails: the two kinds overlap.
"""

from __future__ import annotations

import os
import pathlib
import time

import dask.array as da
import numpy as np
import pytest
from distributed import Client

import yrdask as yr
from conftest import spin, wait_until

pytestmark = pytest.mark.timeout(120)

T = 60
MS = 20  # each task is busy this long


def _record(folder: str, kind: str, start: float) -> None:
    with open(os.path.join(folder, f"{os.getpid()}.log"), "a") as f:
        f.write(f"{kind} {start} {time.monotonic()}\n")


def busy_block(block, folder: str):
    """A Dask chunk function: busy ``MS`` ms, recorded."""
    start = time.monotonic()
    spin(MS)
    _record(folder, "dask", start)
    return block


@yr.invoke
def yr_busy(folder: str, i: int) -> int:
    start = time.monotonic()
    spin(MS)
    _record(folder, "yr", start)
    return i * i


@yr.instance
class Busy:
    """Its method calls are busy ``MS`` ms each, recorded as kind ``call``."""

    def work(self, folder: str, i: int) -> int:
        start = time.monotonic()
        spin(MS)
        _record(folder, "call", start)
        return -i


def most_at_once(intervals: list[tuple[float, float]]) -> int:
    """The largest number of intervals open at one moment (touching ones do not overlap)."""
    events = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals],
                    key=lambda ev: (ev[0], ev[1]))
    now = peak = 0
    for _, step in events:
        now += step
        peak = max(peak, now)
    return peak


def test_yr_and_dask_tasks_share_each_workers_thread(cluster, tmp_path: pathlib.Path):
    c = cluster("cli")
    folder = str(tmp_path)
    with Client(c.address, timeout=T) as client:
        threads = {addr: info["nthreads"]
                   for addr, info in client.scheduler_info()["workers"].items()}
        assert set(threads.values()) == {1}, threads
        x = da.arange(4000 * 4000, chunks=500 * 500).reshape((4000, 4000))
        blocks = x.map_blocks(busy_block, folder, meta=np.empty((0, 0), dtype=x.dtype))
        total = blocks.sum()
        # a light instance: its calls share the worker's thread, which is what is checked
        # (a process instance's calls run in its own process)
        busy = Busy.options(yr.InvokeOptions(light=True)).invoke()
        assert yr.get(busy.work.invoke(folder, 0), T) == 0  # placed and constructed
        future = client.compute(total)
        wait_until(lambda: any("dask" in log.read_text() for log in tmp_path.glob("*.log")),
                   T, "the first Dask chunk")  # then yr work joins it
        whole = yr_busy.options(yr.InvokeOptions(cpu=1000))  # one thread each, as Dask's
        refs = [whole.invoke(folder, i) for i in range(60)]
        calls = [busy.work.invoke(folder, i) for i in range(1, 41)]
        assert yr.get(refs, T) == [i * i for i in range(60)]
        assert yr.get(calls, T) == [-i for i in range(1, 41)]
        n = 4000 * 4000
        assert future.result(timeout=T) == n * (n - 1) // 2
        busy.terminate()
    per_worker: dict[str, dict[str, list[tuple[float, float]]]] = {}
    for log in tmp_path.glob("*.log"):
        runs: dict[str, list[tuple[float, float]]] = {"yr": [], "dask": [], "call": []}
        for line in log.read_text().split("\n"):
            if line:
                kind, start, end = line.split()
                runs[kind].append((float(start), float(end)))
        per_worker[log.stem] = runs
    assert sum(len(r["yr"]) for r in per_worker.values()) == 60
    assert sum(len(r["dask"]) for r in per_worker.values()) == blocks.npartitions
    assert sum(len(r["call"]) for r in per_worker.values()) == 41

    def side_by_side(r: dict, kind: str) -> bool:
        return bool(r[kind] and r["dask"]
                    and min(s for s, _ in r[kind]) < max(e for _, e in r["dask"])
                    and min(s for s, _ in r["dask"]) < max(e for _, e in r[kind]))
    # yr tasks and method calls ran while Dask's did on some worker (else the check below
    # proves nothing) ...
    assert any(side_by_side(r, "yr") for r in per_worker.values()), per_worker
    assert any(side_by_side(r, "call") for r in per_worker.values()), per_worker
    # ... and never more of them at once than a worker's one thread
    peaks = {pid: most_at_once(r["yr"] + r["dask"] + r["call"])
             for pid, r in per_worker.items()}
    assert max(peaks.values()) == 1, peaks


def dask_waits_on_yr(folder: str, i: int) -> int:
    """A Dask task that waits in ``yr.get`` for a yr task: it lends its share meanwhile."""
    return yr.get(yr_busy.options(yr.InvokeOptions(cpu=1000)).invoke(folder, i), T) + 1


def dask_waits_on_dask(i: int) -> int:
    """A Dask task that waits for another through ``worker_client`` (which secedes)."""
    from distributed import worker_client

    with worker_client() as wc:
        return wc.submit(lambda k: k * 10, i, pure=False).result() + 1


def test_a_task_waiting_for_the_other_kind_gives_its_share_back(cluster, tmp_path):
    """Every thread held by a Dask task that waits for yr (yr.get) or for Dask (secede):
    the work it waits for still gets a thread, on the same one-thread workers."""
    c = cluster("cli")
    with Client(c.address, timeout=T) as client:
        on_yr = client.map(dask_waits_on_yr, [str(tmp_path)] * 4, range(4), pure=False)
        assert client.gather(on_yr) == [i * i + 1 for i in range(4)]
        on_dask = client.map(dask_waits_on_dask, range(4), pure=False)
        assert client.gather(on_dask) == [i * 10 + 1 for i in range(4)]
