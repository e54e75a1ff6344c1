"""Plain dask.distributed: ``LocalCluster(n_workers=2, threads_per_worker=1, processes=True)``."""

from __future__ import annotations

import time

from benchmarks.common import latency_result, payload, put_get_result, same_size, timed_calls
from benchmarks.registry import N_WORKERS, System, measures


def inc(i):
    return i + 1


def nested(warmup, calls):
    import statistics
    import time

    from distributed import worker_client

    with worker_client() as c:
        for i in range(warmup):
            c.submit(inc, i, pure=False).result()
        out = []
        for i in range(calls):
            t = time.perf_counter()
            c.submit(inc, i, pure=False).result()
            out.append((time.perf_counter() - t) * 1000.0)
    return statistics.median(out)


class Dask(System):
    name = "dask"

    def start(self) -> None:
        import logging

        from distributed import Client, LocalCluster

        logging.getLogger("distributed").setLevel(logging.WARNING)
        self.cluster = LocalCluster(n_workers=N_WORKERS, threads_per_worker=1, processes=True,
                                    dashboard_address=":0")
        self.client = Client(self.cluster)
        self.client.wait_for_workers(N_WORKERS)

    def trivial_call(self):
        return self.client.submit(inc, 0, pure=False).result()

    def stop(self) -> None:
        self.client.close()
        self.cluster.close()

    @measures("task_rtt_ms")
    def task_rtt(self, p: dict):
        c = self.client
        return latency_result(timed_calls(lambda i: c.submit(inc, i, pure=False).result(),
                                          p["warmup"], p["calls"], p.get("max_seconds")))

    @measures("tasks_10k_per_s")
    def tasks(self, p: dict):
        c = self.client
        c.gather([c.submit(inc, i, pure=False) for i in range(p["warmup"])])
        n = p["tasks"]
        t = time.perf_counter()
        futs = [c.submit(inc, i, pure=False) for i in range(n)]
        submitted = time.perf_counter() - t
        out = c.gather(futs)
        dt = time.perf_counter() - t
        assert out[-1] == n
        return n / dt, {"tasks": n, "seconds": dt, "submit_seconds": submitted}

    @measures("put_get_100mb_mb_per_s")
    def put_get(self, p: dict):
        # Dask's put/get: scatter to a worker (hash=False: no tokenising), then fetch it back.
        c = self.client
        arr, kind = payload(p["size_mb"])
        secs = []
        for k in range(p["warmup"] + p["repeats"]):
            t = time.perf_counter()
            fut = c.scatter(arr, hash=False)
            out = fut.result()
            dt = time.perf_counter() - t
            assert same_size(arr, out)
            same = out is arr
            del fut, out
            if k >= p["warmup"]:
                secs.append(dt)
        value, extra = put_get_result(secs, p["size_mb"], kind)
        extra["get_returned_same_object"] = same  # True: no copy was made at all
        return value, extra

    @measures("nested_task_ms")
    def nested_calls(self, p: dict):
        ms = self.client.submit(nested, p["warmup"], p["calls"], pure=False).result()
        return ms, {"calls": p["calls"]}


SYSTEM = Dask()
