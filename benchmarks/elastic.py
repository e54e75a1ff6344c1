"""The ``elastic`` group: figures of a cluster that Dask's deployer grows and shrinks.

Every figure here runs on its own ``LocalCluster(n_workers=0, threads_per_worker=1)`` under
``cluster.adapt()`` (Dask's own ``Adaptive``), not on the harness's 2-worker cluster
(:attr:`benchmarks.figures.Figure.own_cluster`): the system joins it with
:meth:`~benchmarks.registry.System.join` and leaves with ``leave``.  The cluster is the
same for every system but for what the system needs preloaded
(:meth:`~benchmarks.registry.System.elastic_cluster_kwargs`: yrdask on the scheduler and
workers; nothing for plain Dask).  A new figure of the group is one more function taking
``(system, p)`` and using :func:`adaptive_cluster`.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from typing import Any, Iterator

WORKER_TIMEOUT_S = 60.0  # for the cluster to scale down to no workers, or for a result


@contextlib.contextmanager
def adaptive_cluster(system: Any, p: dict) -> Iterator[Any]:
    """A LocalCluster of no workers under ``adapt(minimum=0, maximum=p["maximum"])``,
    joined by ``system``; closed on exit."""
    import logging

    from distributed import LocalCluster

    logging.getLogger("distributed").setLevel(logging.WARNING)
    cluster = LocalCluster(n_workers=0, threads_per_worker=1, processes=True,
                           dashboard_address="127.0.0.1:0", **system.elastic_cluster_kwargs())
    try:
        cluster.adapt(minimum=0, maximum=p["maximum"], interval=p["interval"],
                      wait_count=p["wait_count"])
        system.join(cluster.scheduler_address)
        try:
            yield cluster
        finally:
            system.leave()
    finally:
        cluster.close()


def until_no_workers(cluster: Any) -> float:
    """Wait (bounded) until the deployer has scaled the cluster down to no workers, their
    processes ended too (the deployer scales up again only once the closing ones are gone);
    returns the seconds waited."""
    t = time.perf_counter()
    while cluster.scheduler.workers or cluster.workers:
        if time.perf_counter() - t > WORKER_TIMEOUT_S:
            raise TimeoutError(f"the cluster kept {len(cluster.scheduler.workers)} workers "
                               f"for {WORKER_TIMEOUT_S:g} s with nothing to do")
        time.sleep(0.05)
    return time.perf_counter() - t


def first_result(system: Any, p: dict) -> tuple[float, dict]:
    """``adaptive_first_result_s``: from no workers, one trivial task submitted -> its
    result, while the deployer adds a worker for it; the median over ``repeats``, each
    from no workers again."""
    runs = []
    with adaptive_cluster(system, p) as cluster:
        for _ in range(p["repeats"]):
            until_no_workers(cluster)
            t = time.perf_counter()
            assert system.gather([system.submit(1)], WORKER_TIMEOUT_S) == [2]
            runs.append(time.perf_counter() - t)
    return statistics.median(runs), {"runs_s": runs, "maximum": p["maximum"],
                                     "interval": p["interval"]}
